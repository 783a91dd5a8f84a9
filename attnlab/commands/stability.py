"""``attnlab map FAMILY``: stability maps, where an implementation's arithmetic breaks.

A map sweeps two input parameters, runs every implementation of the report
(attnlab's kernels and the naive recurrences, attnlab/report.py) at each grid
point against the float64 oracle, and draws two heatmaps per implementation,
``excess`` and the count of non-finite outputs, with the theoretical boundary
on top. Which formulations take part in which family, and which of their
arguments the swept parameter acts on, is the registry's
``Formulation.stability`` (attnlab/spec.py, :class:`StabilityMap`).

- ``gate``: sequence length T x gate strength s, every registered log gate
  rescaled so that its mean magnitude (per-token log decay) is s. Boundary:
  the cumulative log decay of one chunk, ``s min(T, C)``, reaching the exp
  threshold (88.72 fp32 and bf16, 11.09 fp16): a chunkwise kernel that
  factors ``exp(G_i - G_j)`` into ``exp(G_i) exp(-G_j)`` overflows beyond it.
- ``delta``: beta (the same for every token) x key norm r (keys rescaled to
  norm r). Boundary: ``beta r^2 = 2``, beyond which ``I - beta k k^T`` has an
  eigenvalue below -1 and the state grows exponentially with T.
- ``shift``: dtype x a constant c added to every key. Boundary: ln(max) of
  the dtype (11.09 fp16, 88.72 bf16 and fp32), where ``exp(k)`` overflows in
  an algorithm without a running maximum (keys are N(0, 1) + c, so the
  largest reaches the threshold a few units of c earlier).

Written to the output folder: ``map-<family>.json`` (rows, settings, device,
versions), ``map-<family>-<formulation>[-<dtype>][-T<T>].png``, and index.md
rewritten to link them. Each row carries its verdict (attnlab.commands.report).

Exit status: 0 when every point was measured (whatever its verdict: a map
draws where arithmetic breaks); 1 when a point raised; 2 for a usage error
(unknown family or formulation, bad dtype, bfloat16 where attnlab's kernels
run under the Triton interpreter, --device cuda without a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.evaluate import DTYPES
from attnlab.registry import REGISTRY
from attnlab.commands.report import (
    REFERENCE_CHUNK_SIZE,
    Row,
    Sizes,
    Transform,
    add_common_arguments,
    device_description,
    device_slug,
    exit_status,
    implementations,
    lengths_arg,
    measure_point,
    refuse_bf16_on_the_interpreter,
    resolve_device,
    versions,
    write_index,
)
from attnlab.spec import Formulation, StabilityMap

Axis = list[Any]


def exp_threshold(dtype: str) -> float:
    """ln of the largest finite number of ``dtype``: exp overflows above it (11.09 fp16, 88.72 fp32)."""
    return math.log(torch.finfo(DTYPES[dtype]).max)


@dataclass(frozen=True)
class Boundary:
    """A theoretical boundary curve in the map's own coordinates, with its label."""

    label: str
    xs: list[Any]
    ys: list[float]


class Family:
    """The two swept parameters of a map family, how they act on the inputs, and the boundary."""

    name: str
    x_name: str
    y_name: str
    x_log: bool
    y_log: bool
    description: str
    # Which of (dtype, T) each figure is split by; the other ones are axes.
    per_dtype: bool
    per_length: bool
    # The float64 oracle's form that serves as reference.
    reference_form: str = "chunkwise"

    def axes(self, lengths: Sequence[int], dtypes: Sequence[str], steps: int) -> tuple[Axis, Axis]:
        """The x and y values of the grid."""
        raise NotImplementedError

    def point(self, x: Any, y: float, T: int, dtype: str) -> tuple[int, str]:
        """The (T, dtype) a grid point runs at."""
        return T, dtype

    def transform(self, spec: StabilityMap, x: Any, y: float) -> Transform:
        """The edit of the float64 inputs at grid point (x, y)."""
        raise NotImplementedError

    def boundaries(self, xs: Axis, chunk_size: int) -> list[Boundary]:
        raise NotImplementedError


class GateFamily(Family):
    name, x_name, y_name, x_log, y_log = "gate", "T", "gate strength s (mean |log decay| per token)", True, True
    per_dtype, per_length = True, False
    description = (
        "T x gate strength s: every registered log gate rescaled so that a state entry's log decay per token has "
        "mean magnitude s. Boundary: the cumulative log decay of one chunk, s·min(T, C), at the exp limit (88.72 "
        "fp32/bf16, 11.09 fp16), beyond which a chunkwise kernel that factors exp(G_i − G_j) into exp(G_i)·exp(−G_j) "
        "overflows."
    )

    def axes(self, lengths: Sequence[int], dtypes: Sequence[str], steps: int) -> tuple[Axis, Axis]:
        return list(lengths), [float(s) for s in np.geomspace(0.01, 30.0, steps)]

    def point(self, x: Any, y: float, T: int, dtype: str) -> tuple[int, str]:
        return int(x), dtype

    def transform(self, spec: StabilityMap, x: Any, y: float) -> Transform:
        def rescale_gates(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            share = y / len(spec.args)  # general's entry decay is gk_i + gv_j: each gate takes its share of s
            return {n: (t * (share / t.abs().mean()) if n in spec.args else t) for n, t in inputs.items()}

        return rescale_gates

    def boundaries(self, xs: Axis, chunk_size: int) -> list[Boundary]:
        dense = [float(T) for T in np.geomspace(min(xs), max(xs), 64)]
        return [
            Boundary(f"s·min(T, {chunk_size}) = {exp_threshold(dtype):.2f} ({label} exp limit)", dense,
                     [exp_threshold(dtype) / min(T, chunk_size) for T in dense])
            for dtype, label in (("float32", "fp32/bf16"), ("float16", "fp16"))
        ]


class DeltaFamily(Family):
    name, x_name, y_name, x_log, y_log = "delta", "beta", "key norm |k|", False, True
    per_dtype, per_length = True, True
    reference_form = "recurrent"  # the chunkwise UT inverse grows exponentially with unnormalized keys
    description = (
        "beta (the same for every token) x key norm |k| (keys rescaled). Boundary: β|k|² = 2, beyond which "
        "I − βkkᵀ has an eigenvalue below −1 and the state grows exponentially with T. Reference: the float64 "
        "recurrent oracle (the chunkwise one's UT inverse grows exponentially with unnormalized keys)."
    )

    def axes(self, lengths: Sequence[int], dtypes: Sequence[str], steps: int) -> tuple[Axis, Axis]:
        # beta stops short of 2: the conditioning floor perturbs it by one fp32 unit, above its range
        return [float(b) for b in np.linspace(0.2, 1.95, steps)], [float(r) for r in np.geomspace(0.5, 4.0, steps)]

    def transform(self, spec: StabilityMap, x: Any, y: float) -> Transform:
        keys, strength = spec.args

        def set_norm_and_beta(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            edited = dict(inputs)
            edited[keys] = y * inputs[keys] / inputs[keys].norm(dim=-1, keepdim=True)
            edited[strength] = torch.full_like(inputs[strength], x)
            return edited

        return set_norm_and_beta

    def boundaries(self, xs: Axis, chunk_size: int) -> list[Boundary]:
        dense = [float(b) for b in np.linspace(min(xs), max(xs), 64)]
        return [Boundary("β|k|² = 2", dense, [math.sqrt(2 / b) for b in dense])]


class ShiftFamily(Family):
    name, x_name, y_name, x_log, y_log = "shift", "dtype", "key shift c (added to every key)", False, False
    per_dtype, per_length = False, True
    description = (
        "dtype x a constant c added to every key. Boundary: ln(max) of the dtype (11.09 fp16, 88.72 bf16 and fp32), "
        "where exp(k) overflows in an algorithm without a running maximum; the keys are N(0, 1) + c, so the "
        "largest reaches it a few units of c earlier. The result is shift-invariant in exact arithmetic."
    )

    def axes(self, lengths: Sequence[int], dtypes: Sequence[str], steps: int) -> tuple[Axis, Axis]:
        around_thresholds = [exp_threshold(d) + offset for d in dtypes for offset in (-2.0, 1.0)]
        shifts = {round(float(c), 2) for c in np.linspace(0.0, 120.0, steps)} | {round(c, 2) for c in around_thresholds}
        return list(dtypes), sorted(shifts)

    def point(self, x: Any, y: float, T: int, dtype: str) -> tuple[int, str]:
        return T, str(x)

    def transform(self, spec: StabilityMap, x: Any, y: float) -> Transform:
        def shift_keys(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {n: (t + y if n in spec.args else t) for n, t in inputs.items()}

        return shift_keys

    def boundaries(self, xs: Axis, chunk_size: int) -> list[Boundary]:
        return [Boundary(f"ln(max {d}) = {exp_threshold(d):.2f}", [d], [exp_threshold(d)]) for d in xs]


FAMILIES: dict[str, Family] = {family.name: family for family in (GateFamily(), DeltaFamily(), ShiftFamily())}


def members(family: str) -> list[tuple[Formulation, StabilityMap]]:
    """The registry's formulations that take part in ``family``, with their map spec."""
    return [(f, spec) for f in REGISTRY for spec in f.stability if spec.family == family]


def kernel_chunk_size(name: str) -> int:
    """The chunkwise kernel's default chunk size (the oracle's when the kernel is unavailable, or where the
    kernel picks its size by shape, "auto": kda's picks 64 at the maps' small B*H)."""
    from attnlab.kernel import kernel

    try:
        size = kernel(name, "chunkwise").opts.get("chunk_size", REFERENCE_CHUNK_SIZE)
    except Exception:  # noqa: BLE001 - a missing kernel module still gets a map of its baselines
        return REFERENCE_CHUNK_SIZE
    return REFERENCE_CHUNK_SIZE if size == "auto" else int(size)


@dataclass(frozen=True)
class MapSettings:
    """Everything a stability map's numbers depend on; recorded in map-<family>.json."""

    family: str
    formulations: tuple[str, ...]
    dtypes: tuple[str, ...]
    lengths: tuple[int, ...]
    steps: int
    device: str
    seed: int
    sizes: Sizes


@dataclass(frozen=True)
class MapDefaults:
    dtypes: tuple[str, ...]
    gate_lengths: tuple[int, ...]
    lengths: tuple[int, ...]
    steps: int
    sizes: Sizes


MAP_DEFAULTS = {
    "cpu": MapDefaults(("float16",), (16, 64, 256), (64,), 6, Sizes(B=1, H=2, K=16, V=16)),
    # The shipped maps (reports/nvidia-h200): about 5 minutes per family on an H200, launch-bound (the naive
    # recurrences and the delta map's float64 recurrent oracle run token by token).
    "cuda": MapDefaults(("bfloat16", "float16"), (64, 1024, 16384), (1024,), 7, Sizes(B=1, H=4, K=64, V=64)),
}
SHIFT_DEFAULT_DTYPES = {"cpu": ("float16", "float32"), "cuda": ("float16", "bfloat16", "float32")}


def figure_groups(settings: MapSettings) -> list[tuple[str | None, int | None]]:
    """The (dtype, T) each figure is drawn for; None where that one is an axis of the map."""
    family = FAMILIES[settings.family]
    dtypes: list[str | None] = list(settings.dtypes) if family.per_dtype else [None]
    lengths: list[int | None] = list(settings.lengths) if family.per_length else [None]
    return [(d, T) for d in dtypes for T in lengths]


def run_map(settings: MapSettings, out: Path, *, append: bool = False) -> Path:
    """Sweep the grid, write map-<family>.json and the heatmaps, rewrite index.md; return index.md's path.

    The JSON is rewritten after every figure, so a sweep cut short keeps what it finished. With ``append``
    the figures of an earlier map-<family>.json in ``out`` (same grid) are kept, except those this run redraws.
    """
    from tqdm import tqdm

    family = FAMILIES[settings.family]
    xs, ys = family.axes(settings.lengths, settings.dtypes, settings.steps)
    specs = {f.name: (f, spec) for f, spec in members(settings.family)}
    groups = figure_groups(settings)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"map-{family.name}.json"
    earlier = _earlier_map(path, xs, ys) if append else None
    run = {"settings": {**asdict(settings), "command": map_command(settings)},
           "device": {"type": settings.device, "name": device_description(settings.device)},
           "versions": versions(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    document = {
        "what": f"stability map '{family.name}': {family.x_name} x {family.y_name} (attnlab map)",
        "description": family.description,
        **run,
        "runs": [*(earlier["runs"] if earlier else []), run],
        "axes": {"x": {"name": family.x_name, "values": xs}, "y": {"name": family.y_name, "values": ys}},
        "figures": list(earlier["figures"]) if earlier else [],
        "rows": list(earlier["rows"]) if earlier else [],
    }
    started = time.time()
    total = len(settings.formulations) * len(groups) * len(xs) * len(ys)
    with tqdm(total=total, desc=f"attnlab map {settings.family}", unit="point", file=sys.stderr) as progress:
        for name in settings.formulations:
            f, spec = specs[name]
            chunk_size = kernel_chunk_size(name)
            for group_dtype, group_T in groups:
                mine: list[Row] = []
                for x in xs:
                    for y in ys:
                        T, dtype = family.point(x, y, group_T or 0, group_dtype or "")
                        progress.set_postfix_str(f"{name} {dtype} T={T} {family.x_name}={x} y={y:.3g}")
                        mine += measure_point(f, dtype, T, settings.sizes, implementations(f, dtype), seed=settings.seed,
                                              device=settings.device, transform=family.transform(spec, x, y),
                                              extra={"family": family.name, "x": x, "y": y, "run": len(document["runs"]) - 1},
                                              reference_form=family.reference_form)
                        progress.update()
                stem = "-".join(["map", family.name, name, *([group_dtype] if group_dtype else []),
                                 *([f"T{group_T}"] if group_T else [])])
                png = out / f"{stem}.png"
                boundaries = family.boundaries(xs, chunk_size)
                plot_map(mine, family, xs, ys, boundaries, png, title=_figure_title(f, family, group_dtype, group_T))
                redrawn = (name, group_dtype, group_T)
                document["figures"] = [g for g in document["figures"] if (g["formulation"], g["dtype"], g["T"]) != redrawn]
                document["figures"].append({"formulation": name, "dtype": group_dtype, "T": group_T, "png": png.name,
                                            "chunk_size": chunk_size, "boundaries": [asdict(b) for b in boundaries]})
                document["rows"] = [r for r in document["rows"] if not _in_group(r, *redrawn)] + mine
                run["seconds"] = round(time.time() - started, 1)
                path.write_text(json.dumps(document, indent=1, allow_nan=False) + "\n")
    return write_index(out)


def _in_group(row: Row, name: str, dtype: str | None, T: int | None) -> bool:
    """Whether ``row`` belongs to the figure of (formulation, dtype, T); None is an axis of the map (any value)."""
    return row["formulation"] == name and dtype in (None, row["dtype"]) and T in (None, row["T"])


def _earlier_map(path: Path, xs: Axis, ys: Axis) -> dict[str, Any] | None:
    """The map already at ``path``, to append to; a ValueError when its grid is not ``xs`` x ``ys``."""
    if not path.exists():
        return None
    earlier = json.loads(path.read_text())
    if [earlier["axes"]["x"]["values"], earlier["axes"]["y"]["values"]] != json.loads(json.dumps([xs, ys])):
        raise ValueError(f"{path} was drawn on another grid (x {earlier['axes']['x']['values']}, y "
                         f"{earlier['axes']['y']['values']}); --append needs the same --steps, --lengths and --dtypes "
                         f"axes, or leave --append out to start the map afresh")
    earlier.setdefault("runs", [{key: earlier[key] for key in ("settings", "device", "versions") if key in earlier}])
    return earlier


def map_command(settings: MapSettings) -> str:
    """The command line that reproduces this map."""
    s = settings.sizes
    return (f"attnlab map {settings.family} --formulations {','.join(settings.formulations)} "
            f"--dtypes {','.join(settings.dtypes)} --lengths {','.join(map(str, settings.lengths))} "
            f"--steps {settings.steps} --shape {s.B},{s.H},{s.K},{s.V} --device {settings.device} --seed {settings.seed}")


def _figure_title(f: Formulation, family: Family, dtype: str | None, T: int | None) -> str:
    where = ", ".join([*([dtype] if dtype else []), *([f"T={T}"] if T else [])])
    return f"{f.name}: {family.name} stability map" + (f" ({where})" if where else "")


def _index_coordinates(values: Axis, log: bool, points: Sequence[Any]) -> list[float]:
    """Positions of ``points`` on a heatmap axis whose cell i holds ``values[i]``; NaN outside the grid."""
    if not all(isinstance(v, (int, float)) for v in values):
        return [float(values.index(p)) if p in values else math.nan for p in points]
    scale = (lambda v: math.log(v)) if log else (lambda v: float(v))
    grid = [scale(v) for v in values]
    positions = []
    for p in points:
        q = scale(p)
        inside = grid[0] <= q <= grid[-1]
        positions.append(float(np.interp(q, grid, np.arange(len(grid)))) if inside else math.nan)
    return positions


def _tick_label(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:.3g}"


def plot_map(rows: Sequence[Row], family: Family, xs: Axis, ys: Axis, boundaries: Sequence[Boundary], path: Path,
             *, title: str) -> None:
    """Heatmaps of excess and non-finite outputs, one row of panels per implementation, with the boundary drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    impl_names = list(dict.fromkeys(r["impl"] for r in rows))
    cell = {(r["impl"], r["x"], r["y"]): r for r in rows}
    width, height = 0.62 * len(xs) + 2.2, 0.36 * len(ys) + 1.2
    fig, axes = plt.subplots(len(impl_names), 2, figsize=(2 * width, height * len(impl_names) + 0.6), squeeze=False)
    excess_cmap = plt.get_cmap("viridis").with_extremes(over="crimson", bad="0.8")
    count_cmap = plt.get_cmap("Reds").with_extremes(bad="0.8")
    for (excess_ax, count_ax), impl in zip(axes, impl_names):
        excess = np.full((len(ys), len(xs)), np.nan)
        counts = np.full((len(ys), len(xs)), np.nan)
        for i, y in enumerate(ys):
            for j, x in enumerate(xs):
                r = cell.get((impl, x, y))
                if r is None or r["error"]:
                    continue
                counts[i, j] = r["nonfinite"]
                excess[i, j] = r["excess"] if r["excess"] is not None else (np.inf if r["nonfinite"] else np.nan)
        finite = excess[np.isfinite(excess)]
        top = max(10.0, float(finite.max()) if finite.size else 10.0)
        bottom = float(finite.min()) if finite.size else 1.0  # below 1 where the conditioning floor is pessimistic
        excess_image = excess_ax.imshow(np.where(np.isinf(excess), 10 * top, excess), origin="lower", aspect="auto",
                                        cmap=excess_cmap, norm=LogNorm(vmin=min(1.0, bottom), vmax=top))
        count_image = count_ax.imshow(counts, origin="lower", aspect="auto", cmap=count_cmap,
                                      norm=matplotlib.colors.Normalize(vmin=0, vmax=max(1.0, np.nanmax(counts, initial=0))))
        for i in range(len(ys)):
            for j in range(len(xs)):
                r = cell.get((impl, xs[j], ys[i]))
                if r is None:
                    continue
                if r["error"]:
                    text = "err"
                elif r["excess"] is None:
                    text = "ref∞" if r["ref_nonfinite"] else "∞"
                else:
                    text = f"{r['excess']:.2g}"
                excess_ax.text(j, i, text, ha="center", va="center", fontsize=6, color="white" if text != "err" else "black")
                count_ax.text(j, i, "err" if r["error"] else str(r["nonfinite"]), ha="center", va="center", fontsize=6)
        for ax, label in ((excess_ax, "excess"), (count_ax, "non-finite outputs")):
            ax.set_xticks(range(len(xs)), [_tick_label(x) for x in xs], fontsize=7)
            ax.set_yticks(range(len(ys)), [_tick_label(y) for y in ys], fontsize=7)
            ax.set_xlabel(family.x_name, fontsize=8)
            ax.set_ylabel(family.y_name, fontsize=7)
            ax.set_title(f"{impl}: {label}", fontsize=9)
            ax.set_xlim(-0.5, len(xs) - 0.5)
            ax.set_ylim(-0.5, len(ys) - 0.5)
            for index, boundary in enumerate(boundaries):
                bx = _index_coordinates(xs, family.x_log, boundary.xs)
                by = _index_coordinates(ys, family.y_log, boundary.ys)
                style = dict(color="white" if ax is excess_ax else "black", lw=1.8, ls=("-", "--")[index % 2])
                if len(boundary.xs) == 1:  # a categorical column: a bar across it
                    ax.plot([bx[0] - 0.5, bx[0] + 0.5], [by[0], by[0]], label=boundary.label, **style)
                else:
                    ax.plot(bx, by, label=boundary.label, **style)
        fig.colorbar(excess_image, ax=excess_ax, extend="max", fraction=0.05).ax.tick_params(labelsize=7)
        fig.colorbar(count_image, ax=count_ax, fraction=0.05).ax.tick_params(labelsize=7)
        excess_ax.legend(fontsize=6, loc="upper left", framealpha=0.7)
    fig.suptitle(f"{title}; red: non-finite, grey: failed or undefined; lines: theoretical boundary", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- command line -----------------------------------------------------------------


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``attnlab map`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "map", help="stability maps: heatmaps of excess and non-finite outputs over two input parameters",
        description="Sweep two input parameters and draw, per implementation (attnlab's kernels and the naive "
                    "recurrences), heatmaps of excess and of non-finite outputs with the theoretical boundary. "
                    "gate: T x gate strength, for the gated forms (boundary: the cumulative log decay of a chunk at "
                    "the exp limit); delta: beta x key norm, for the delta rules (beta |k|^2 = 2); shift: dtype x a "
                    "constant added to the keys, for rwkv4 and aft (the exp thresholds 11.09 fp16, 88.72 bf16/fp32). "
                    "Writes map-<family>.json and PNGs into --out and rewrites its index.md to link them.",
    )
    parser.add_argument("family", choices=tuple(FAMILIES), help="which map")
    add_common_arguments(parser)
    parser.add_argument("--lengths", type=lengths_arg, default=None,
                        help="gate: the T axis (default 16,64,256 on the CPU, 64,1024,16384 on a GPU); delta and shift: one map per length "
                             "(default 64 on the CPU, 1024 on a GPU)")
    parser.add_argument("--steps", type=int, default=None,
                        help="grid points on each continuous axis (default 6 on the CPU, 7 on a GPU)")
    parser.add_argument("--append", action="store_true",
                        help="keep the figures of the folder's map-<family>.json (same grid) that this run does not "
                             "redraw, for a map built in several runs")
    parser.set_defaults(func=partial(cmd_map, parser))
    return parser


def cmd_map(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    device = resolve_device(parser, args.device)
    defaults = MAP_DEFAULTS[device]
    taking_part = [f.name for f, _ in members(args.family)]
    chosen = args.formulations or taking_part
    outside = [n for n in chosen if n not in taking_part]
    if outside:
        parser.error(f"{', '.join(outside)} take(s) no part in the {args.family} map; it covers {', '.join(taking_part)}")
    if args.steps is not None and args.steps < 2:
        parser.error(f"--steps must be at least 2; got {args.steps}")
    dtypes = args.dtypes or (SHIFT_DEFAULT_DTYPES[device] if args.family == "shift" else defaults.dtypes)
    refuse_bf16_on_the_interpreter(parser, device, dtypes)
    lengths = args.lengths or (defaults.gate_lengths if args.family == "gate" else defaults.lengths)
    settings = MapSettings(family=args.family, formulations=tuple(chosen), dtypes=tuple(dtypes), lengths=tuple(lengths),
                           steps=args.steps or defaults.steps, device=device, seed=args.seed,
                           sizes=args.shape or defaults.sizes)
    out = args.out or Path("reports") / device_slug(device)
    started = time.time()
    try:
        index = run_map(settings, out, append=args.append)
    except ValueError as error:
        parser.error(str(error))
    print(f"map: {index} (map-{args.family}.json and map-{args.family}-*.png, {time.time() - started:.0f} s)")
    document = json.loads((out / f"map-{args.family}.json").read_text())
    mine = [r for r in document["rows"] if r.get("run") == len(document["runs"]) - 1]  # this run's points
    raised = [r for r in mine if r["error"]]
    for name, impl, dtype, error in dict.fromkeys((r["formulation"], r["impl"], r["dtype"], r["error"])
                                                  for r in raised):
        print(f"  raised: {name} {impl} {dtype}: {error}", file=sys.stderr)
    return exit_status(mine)
