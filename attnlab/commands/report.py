"""``attnlab report``: how each implementation's error grows with the sequence length.

For every formulation, dtype and length T the registry's default inputs are
drawn (one seed), rounded to the dtype, and every implementation runs on
exactly those inputs:

- ``attnlab:<form>``: attnlab's Triton kernel of each of the registry's
  kernel forms (under the Triton interpreter on a machine without a GPU);
- ``fp32-recurrent``: the formulation's naive recurrence (the recurrent
  oracle with the registry's ``naive_options``) evaluated in float32, its
  output rounded once to the dtype: what plain fp32 accumulation achieves;
- ``fp16-recurrent`` / ``bf16-recurrent``: the same recurrence entirely in the
  dtype, the naive same-precision baseline.

Each is measured against the float64 chunkwise oracle on the same device and
the same rounded inputs (attnlab.metrics: ``rel_err``, ``max_err``,
``floor_round``, ``floor_cond``, ``floor``, ``excess``, ``nonfinite``); at
short lengths the float64 oracle is itself checked against the mpmath one and
the agreement recorded. A point that raises is recorded with its error and
the sweep goes on. Each row carries its ``verdict`` (attnlab.metrics, by the
registry's bounds for its formulation and dtype): ``held``, ``imprecise`` or
``failed`` (above the correctness bound, non-finite, or raised).

``--passes forward,backward`` (default: forward) adds the backward pass: on
the same inputs, a random cotangent ``do`` (drawn from the seed, rounded to
the dtype) and, where the formulation has a state, a random fp32 cotangent of
the final state (on its scale-free parts: attnlab.gradients.log_scale_cotangent),
each differentiable implementation's gradients by autograd are measured
against float64 autograd through the chunkwise oracle, one head at a time
(attnlab.gradients.oracle_gradients; softmax keeps T x T intermediates per
head), with each gradient's rounding floor and
conditioning floor (attnlab.gradients.gradient_floor): one row per gradient,
with ``"pass": "backward"`` and ``"gradient"`` (a row without ``pass`` is a
forward row, as every report written before). Implementations whose output
does not require grad (attnlab's kernel forms without a backward) are listed once under
report.json's ``backward.no_backward``, not failed.

Exit status: 0 when every point was measured; 1 when a point raised (its
row records the error); 2 for a usage error (unknown formulation, dtype or
pass, bfloat16 where attnlab's kernels run under the Triton interpreter,
--device cuda without a GPU).

Written to the output folder: ``report.json`` (rows, settings, seed,
versions, device, oracles), one ``<formulation>.png`` per formulation (error
vs T, log-log, one panel per dtype, with the floor and the textbook guides),
with the backward pass one ``<formulation>-backward.png`` (gradient error vs
T, a panel per gradient and dtype, with the rounding floor), and ``index.md``
(the tables and the plots; it also links the stability maps ``attnlab map``
wrote into the same folder).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from attnlab.evaluate import DTYPES, rounded_inputs
from attnlab.kernel import interpreter_active  # first: it sets TRITON_INTERPRET=1 before triton is imported
from attnlab.metrics import (FAILED, VERDICTS, conditioning_floor, grade, measure, rel_err, unit_roundoff, user_bounds,
                             worst_verdict)
from attnlab.oracle import oracle
from attnlab.registry import BOUNDS, bounds_for, formulation, names
from attnlab.spec import Bounds, Formulation

Row = dict[str, Any]
Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]

SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
REFERENCE_CHUNK_SIZE = 64
REFERENCE_NAME = "float64-chunkwise"
METRIC_KEYS = ("rel_err", "max_err", "floor_round", "floor_cond", "floor", "excess", "nonfinite")
# What a row's verdict was graded by is recorded beside it.
VERDICT_KEYS = ("verdict", "accuracy_bound", "correctness_bound")
# A fitted exponent of rel_err against T above this counts as growth with length.
GROWTH_SLOPE = 0.25
# The passes a report measures (--passes); a row without a "pass" field is a forward row (reports written before).
FORWARD, BACKWARD = "forward", "backward"
PASSES = (FORWARD, BACKWARD)
GRADIENT_REFERENCE_NAME = "float64-chunkwise-autograd"
# Backward rows carry these beside the forward ones.
BACKWARD_KEYS = ("pass", "gradient")


@dataclass(frozen=True)
class Sizes:
    """Batch, heads and head dimensions of the sampled inputs (T is swept)."""

    B: int
    H: int
    K: int
    V: int


@dataclass(frozen=True)
class Defaults:
    """What a report sweeps when the command line does not say (every formulation, always)."""

    dtypes: tuple[str, ...]
    lengths: tuple[int, ...]
    sizes: Sizes


# The CPU default is the README's main command (`make report`): fp16 and fp32
# kernels under the interpreter and the baselines at short lengths, about two
# minutes on a 2-core CPU. The GPU default is the shipped gallery.
DEFAULTS = {
    "cpu": Defaults(("float16", "float32"), (16, 32, 64, 128), Sizes(B=1, H=2, K=16, V=16)),
    "cuda": Defaults(("bfloat16", "float16"), (64, 256, 1024, 4096, 16384, 65536), Sizes(B=1, H=4, K=64, V=64)),
}
MPMATH_CHECK_MAX_T = 64


@dataclass(frozen=True)
class Settings:
    """Everything a report's numbers depend on; recorded in report.json."""

    formulations: tuple[str, ...]
    dtypes: tuple[str, ...]
    lengths: tuple[int, ...]
    device: str
    seed: int
    sizes: Sizes
    mpmath_check_max_T: int = MPMATH_CHECK_MAX_T
    reference: str = REFERENCE_NAME
    reference_chunk_size: int = REFERENCE_CHUNK_SIZE

    def command(self) -> str:
        """The command line that reproduces this report."""
        s = self.sizes
        return (
            f"attnlab report --formulations {','.join(self.formulations)} --dtypes {','.join(self.dtypes)} "
            f"--lengths {','.join(map(str, self.lengths))} --shape {s.B},{s.H},{s.K},{s.V} "
            f"--device {self.device} --seed {self.seed} --mpmath-check-max-T {self.mpmath_check_max_T}"
        )


# --- implementations ------------------------------------------------------------


@dataclass(frozen=True)
class Implementation:
    """One implementation a report measures: its name and how to build its callable.

    Building is deferred to the sweep, so a kernel module that is missing or
    refuses the configuration becomes an error in that implementation's row.
    """

    name: str
    build: Callable[[], Callable[..., Any]]


def _kernel(name: str, form: str) -> Callable[..., Any]:
    from attnlab.kernel import kernel

    return kernel(name, form)


def _naive_recurrence(f: Formulation, precision: str, out_dtype: str) -> Callable[..., torch.Tensor]:
    run = oracle(f.name, "recurrent", precision, **dict(f.naive_options))

    def call(**inputs: Any) -> Any:
        if inputs.get("return_state"):  # the backward pass: o rounded to the dtype, the state as computed
            o, state = run(**inputs)
            return o.to(DTYPES[out_dtype]), state
        return run(**inputs).to(DTYPES[out_dtype])

    return call


def implementations(f: Formulation, dtype: str) -> list[Implementation]:
    """attnlab's kernels of ``f`` and the naive recurrences in fp32 and in ``dtype``, as run on ``dtype`` inputs."""
    impls = [Implementation(f"attnlab:{form}", partial(_kernel, f.name, form)) for form in f.kernel_forms]
    impls.append(Implementation("fp32-recurrent", partial(_naive_recurrence, f, "float32", dtype)))
    if dtype != "float32":
        impls.append(Implementation(f"{SHORT_DTYPE[dtype]}-recurrent", partial(_naive_recurrence, f, dtype, dtype)))
    return impls


# --- measuring one point ----------------------------------------------------------


def describe_error(error: BaseException) -> str:
    """One line naming the exception, short enough for a table footnote."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _json_float(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _blank_row(base: Row) -> Row:
    return {**base, **{key: None for key in METRIC_KEYS}, "ref_nonfinite": None, "error": None}


def _graded(f: Formulation, dtype: str, row: Row, bounds: Bounds | None = None) -> Row:
    """``row`` with its verdict and the bounds it was graded by: failed when it raised or has a non-finite
    entry, else its excess graded by ``bounds`` (default: the registry's bounds for ``f`` in ``dtype``), with the
    user's accuracy bound where attnlab.metrics.user_bound is in force."""
    b = user_bounds(bounds or bounds_for(f, dtype))
    row.update(accuracy_bound=b.accuracy, correctness_bound=b.correctness)
    if row["error"] or row["nonfinite"] or row["excess"] is None:
        row["verdict"] = FAILED
    else:
        row["verdict"] = grade(row["excess"], b.accuracy, b.correctness)
    return row


def mpmath_agreement(name: str, inputs: dict[str, torch.Tensor], reference_output: torch.Tensor) -> float:
    """``rel_err`` of the float64 oracle's output against the mpmath recurrent oracle's, on CPU copies of ``inputs``."""
    certified = oracle(name, "recurrent", "mpmath")(**{n: t.cpu() if isinstance(t, torch.Tensor) else t
                                                        for n, t in inputs.items()})
    return rel_err(reference_output.cpu(), certified)


def measure_point(
    f: Formulation,
    dtype: str,
    T: int,
    sizes: Sizes,
    impls: Sequence[Implementation],
    *,
    seed: int,
    device: str,
    transform: Transform | None = None,
    check_with_mpmath: bool = False,
    extra: Row | None = None,
    reference_form: str = "chunkwise",
    options: dict[str, Any] | None = None,
) -> list[Row]:
    """Rows for every implementation at one (formulation, dtype, T), against the float64 oracle.

    The reference output and the conditioning floor are computed once and
    shared by the implementations. ``transform`` edits the float64 inputs
    before rounding (the stability maps); ``extra`` is merged into each row;
    ``reference_form`` is the float64 oracle's form (chunkwise: the fast one);
    ``options`` (``scale=...``) are passed to the reference and every implementation.
    A failure of the reference fails every row of the point; a failure of
    one implementation fails its row only.
    """
    base = {"formulation": f.name, "impl": None, "dtype": dtype, "T": T, **(extra or {}),
            "oracle": f"float64-{reference_form}", "oracle_device": device, "oracle_check": None}
    try:
        inputs = rounded_inputs(f.name, DTYPES[dtype], device, B=sizes.B, T=T, H=sizes.H, K=sizes.K, V=sizes.V,
                                seed=seed, transform=transform)
        inputs = {**inputs, **(options or {})}
        chunking = {"chunk_size": REFERENCE_CHUNK_SIZE} if reference_form == "chunkwise" else {}
        reference = oracle(f.name, reference_form, "float64", **chunking)
        ref = reference(**inputs)
        floor_cond = conditioning_floor(reference, inputs, base=ref)
        ref_nonfinite = int((~torch.isfinite(ref)).sum())
        if check_with_mpmath:
            base["oracle_check"] = _json_float(mpmath_agreement(f.name, inputs, ref))
    except Exception as error:  # noqa: BLE001 - recorded in the rows, the sweep goes on
        message = f"reference oracle failed: {describe_error(error)}"
        return [_graded(f, dtype, {**_blank_row(base), "impl": impl.name, "error": message}) for impl in impls]
    rows = []
    for impl in impls:
        row = {**_blank_row(base), "impl": impl.name, "ref_nonfinite": ref_nonfinite}
        try:
            o = impl.build()(**inputs)
            metrics = measure(o, ref, DTYPES[dtype], floor_cond).as_dict()
            row.update({key: (value if key == "nonfinite" else _json_float(value)) for key, value in metrics.items()})
        except Exception as error:  # noqa: BLE001 - recorded in the row, the sweep goes on
            row["error"] = describe_error(error)
            if isinstance(error, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
        rows.append(_graded(f, dtype, row))
    return rows


# --- measuring one point's gradients (the backward pass) ------------------------------


class NoBackward(Exception):
    """An implementation that is not differentiable: its output does not require grad, or it refuses inputs that
    require grad (NotImplementedError: attnlab's kernels without a backward)."""


def backward_bounds(f: Formulation, dtype: str) -> Bounds:
    """The bounds a gradient in ``dtype`` is graded by: the registry's (attnlab.registry.bounds_for) gradient bounds
    (spec.Bounds.gradients)."""
    b = bounds_for(f, dtype)
    accuracy, correctness = b.gradients
    return replace(b, accuracy=accuracy, correctness=correctness)


def _parts(value: Any) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def draw_cotangents(f: Formulation, o: torch.Tensor, final: Any, dtype: str, seed: int) -> tuple[torch.Tensor, Any]:
    """``(do, d_scaled)`` drawn from ``seed``: ``do`` standard normal of o's shape, rounded to ``dtype`` (the
    dtype o is returned in); ``d_scaled`` (None without a state) standard normal fp32 cotangents of the final
    state's scale-free parts (attnlab.gradients.log_scale_cotangent: the same loss whatever representation of a
    log-scale state an implementation returns)."""
    generator = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64).to(device=o.device, dtype=DTYPES[dtype])
    if final is None:
        return do, None
    parts = f.state.split(final)
    d_scaled = tuple(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(device=p.device,
                                                                                      dtype=torch.float32)
                     for i, p in enumerate(parts) if not f.state.is_log_scale(i))
    return do, f.state.join(d_scaled)


def implementation_gradients(f: Formulation, call: Callable[..., Any], inputs: dict[str, Any], do: torch.Tensor,
                             d_scaled: Any) -> dict[str, torch.Tensor]:
    """An implementation's gradients of ``<do, o> + <dS, final state>`` with respect to every differentiable input
    (attnlab.gradients.differentiable_names), by torch autograd through ``call``; ``dS`` is ``d_scaled`` carried
    onto the implementation's own final state (log_scale_cotangent). Raises NoBackward when o does not require
    grad, ValueError when an input gets no gradient."""
    from attnlab.gradients import differentiable_names, log_scale_cotangent

    leaves = {n: inputs[n].detach().clone().requires_grad_() for n in differentiable_names(f, inputs)}
    with torch.enable_grad():
        try:
            if f.state is not None:
                o, final = call(**{**inputs, **leaves}, return_state=True)
            else:
                o, final = call(**{**inputs, **leaves}), None
        except NotImplementedError as error:
            raise NoBackward(str(error)) from None
        if not (isinstance(o, torch.Tensor) and o.requires_grad):
            raise NoBackward("its output does not require grad")
        outputs, cotangents = [o], [do.to(o)]
        if final is not None:
            parts = f.state.split(final)
            carried = _parts(log_scale_cotangent(f, f.state.join(tuple(p.detach() for p in parts)), d_scaled))
            for part, d in zip(parts, carried):
                if part.requires_grad:
                    outputs.append(part)
                    cotangents.append(d.to(part))
        grads = torch.autograd.grad(outputs, list(leaves.values()), cotangents, allow_unused=True)
    missing = [n for n, g in zip(leaves, grads) if g is None]
    if missing:
        raise ValueError(f"the backward returned no gradient for {', '.join(missing)}")
    return dict(zip(leaves, grads))


def measure_backward_point(
    f: Formulation,
    dtype: str,
    T: int,
    sizes: Sizes,
    impls: Sequence[Implementation],
    no_backward: dict[tuple[str, str], str],
    *,
    seed: int,
    device: str,
    extra: Row | None = None,
) -> list[Row]:
    """Rows for every gradient of every differentiable implementation at one (formulation, dtype, T).

    The inputs are the forward pass's (the registry's defaults rounded to ``dtype``); the cotangents are drawn
    from ``seed`` (:func:`draw_cotangents`). The reference is float64 autograd through the chunkwise oracle
    (attnlab.gradients.oracle_gradients), with each gradient's conditioning floor (gradient_floor: inputs and
    cotangents perturbed at fp32 roundoff), computed once for the point. Each gradient is measured against it
    (attnlab.metrics.measure_gradients: rounded to the dtype it is returned in for the rounding floor) and graded
    by :func:`backward_bounds`. An implementation whose output does not require grad is recorded in
    ``no_backward`` ((formulation, impl) -> why) and skipped from then on: not a failure. A reference that
    raises fails every implementation's row; an implementation that raises fails its own.
    """
    from attnlab.gradients import gradient_dtypes, gradient_floor, log_scale_cotangent, oracle_gradients
    from attnlab.metrics import measure_gradients

    base = {"formulation": f.name, "impl": None, "dtype": dtype, "T": T, **(extra or {}), "pass": BACKWARD,
            "gradient": None, "oracle": GRADIENT_REFERENCE_NAME, "oracle_device": device, "oracle_check": None}
    todo = [impl for impl in impls if (f.name, impl.name) not in no_backward]
    try:
        inputs = rounded_inputs(f.name, DTYPES[dtype], device, B=sizes.B, T=T, H=sizes.H, K=sizes.K, V=sizes.V,
                                seed=seed)
        reference = oracle(f.name, "chunkwise", "float64", chunk_size=REFERENCE_CHUNK_SIZE)
        if f.state is not None:
            o, final = reference(**inputs, return_state=True)
        else:
            o, final = reference(**inputs), None
        do, d_scaled = draw_cotangents(f, o, final, dtype, seed)
        d_final = None if final is None else log_scale_cotangent(f, final, d_scaled)
        # One head per autograd call: a long softmax row's T x T intermediates for one head at a time.
        chunking = {"form": "chunkwise", "chunk_size": REFERENCE_CHUNK_SIZE, "heads_per_call": 1}
        ref = oracle_gradients(f, inputs, do, d_final, **chunking)
        floor_cond = gradient_floor(f, inputs, do, d_final, base=ref, seed=seed, **chunking)
        dtypes = gradient_dtypes(f, inputs)
    except Exception as error:  # noqa: BLE001 - recorded in the rows, the sweep goes on
        message = f"reference gradients failed: {describe_error(error)}"
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
            message += (f" (float64 autograd through {f.name}'s oracle keeps its intermediates, one head at a time; "
                        "shorter --lengths)")
        return [_graded(f, dtype, {**_blank_row(base), "impl": impl.name, "error": message}, backward_bounds(f, dtype))
                for impl in todo]
    rows = []
    for impl in todo:
        try:
            grads = implementation_gradients(f, impl.build(), inputs, do, d_scaled)
            measured = measure_gradients(grads, ref, dtypes, floor_cond)
        except NoBackward as why:
            no_backward[(f.name, impl.name)] = str(why)
            continue
        except Exception as error:  # noqa: BLE001 - recorded in the row, the sweep goes on
            if isinstance(error, torch.cuda.OutOfMemoryError):
                torch.cuda.empty_cache()
            rows.append(_graded(f, dtype, {**_blank_row(base), "impl": impl.name, "error": describe_error(error)},
                                backward_bounds(f, dtype)))
            continue
        for name, m in measured.items():
            row = {**_blank_row(base), "impl": impl.name, "gradient": name,
                   "ref_nonfinite": sum(int((~torch.isfinite(p)).sum()) for p in _parts(ref[name]))}
            row.update({key: (value if key == "nonfinite" else _json_float(value)) for key, value in m.as_dict().items()})
            rows.append(_graded(f, dtype, row, backward_bounds(f, dtype)))
    return rows


def is_backward(row: Row) -> bool:
    """Whether a row is the backward pass's (a row without a "pass" field is a forward row)."""
    return row.get("pass", FORWARD) == BACKWARD


# --- the sweep --------------------------------------------------------------------


def device_description(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    mode = "under the Triton interpreter" if interpreter_active() else "compiled (TRITON_INTERPRET is not 1)"
    return f"CPU ({platform.machine()}, {os.cpu_count()} cores), kernels {mode}"


def device_slug(device: str) -> str:
    """A folder name for the device: ``cpu`` or the GPU's name (``nvidia-h100-80gb-hbm3``)."""
    return "cpu" if device == "cpu" else re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def versions() -> dict[str, str]:
    """Versions of everything the numbers depend on (and the git commit, when there is one)."""
    from importlib.metadata import version

    found = {"python": platform.python_version(), "torch": torch.__version__,
             **{dist: version(dist) for dist in ("attnlab", "triton", "numpy", "mpmath", "matplotlib")}}
    if torch.version.cuda:
        found["cuda"] = torch.version.cuda
    try:
        root = Path(__file__).resolve().parent.parent
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        found["git_commit"] = commit
    except (OSError, subprocess.SubprocessError):
        pass
    return found


def oracle_summary(settings: Settings, rows: Iterable[Row]) -> dict[str, Any]:
    """Which oracle served as reference at which lengths, and how well mpmath agreed where it was checked."""
    checks = sorted({(r["formulation"], r["T"], r["dtype"], r["oracle_check"]) for r in rows
                     if r.get("oracle_check") is not None}, key=lambda c: (c[0], c[1]))
    checked_lengths = sorted({T for _, T, _, _ in checks})
    return {
        "reference": f"float64 chunkwise oracle (chunk_size {settings.reference_chunk_size}) on {settings.device}",
        "reference_lengths": list(settings.lengths),
        "mpmath_check": {
            "what": "rel_err of the float64 oracle against the mpmath recurrent oracle (dps 50), on the first "
                    "dtype's rounded inputs",
            "lengths": checked_lengths,
            "max_rel_diff": max((c[3] for c in checks), default=None),
            "checks": [{"formulation": n, "T": T, "dtype": d, "rel_diff": v} for n, T, d, v in checks],
        },
    }


def run_report(settings: Settings, out: Path, *, append: bool = False, passes: Sequence[str] = (FORWARD,)) -> Path:
    """Sweep, write report.json (after each formulation), the plots and index.md; return index.md's path.

    ``passes``: forward (each output against the float64 oracle) and/or backward (each gradient against float64
    autograd through the chunkwise oracle, :func:`measure_backward_point`)."""
    from tqdm import tqdm

    passes = tuple(p for p in PASSES if p in passes)
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "report.json"
    earlier = json.loads(report_path.read_text()) if append and report_path.exists() else None
    run_index = len(earlier["runs"]) if earlier else 0
    started = time.time()
    recorded = asdict(settings)
    command = settings.command()
    if passes != (FORWARD,):  # a forward report's settings are recorded as before there were passes
        recorded["passes"] = list(passes)
        command += f" --passes {','.join(passes)}"
    run = {"settings": {**recorded, "command": command}, "seed": settings.seed,
           "device": {"type": settings.device, "name": device_description(settings.device)},
           "versions": versions(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    rows: list[Row] = []
    no_backward: dict[tuple[str, str], str] = {}
    points = [(name, dtype, T) for name in settings.formulations for dtype in settings.dtypes for T in settings.lengths]
    with tqdm(total=len(points) * len(passes), desc="attnlab report", unit="point", file=sys.stderr) as progress:
        for name in settings.formulations:
            f = formulation(name)
            for dtype in settings.dtypes:
                impls = implementations(f, dtype)
                for T in settings.lengths:
                    if FORWARD in passes:
                        progress.set_postfix_str(f"{name} {dtype} T={T}")
                        check = dtype == settings.dtypes[0] and T <= settings.mpmath_check_max_T
                        point = measure_point(f, dtype, T, settings.sizes, impls, seed=settings.seed,
                                              device=settings.device, check_with_mpmath=check, extra={"run": run_index})
                        rows.extend(point)
                        progress.update()
                    if BACKWARD in passes:
                        progress.set_postfix_str(f"{name} {dtype} T={T} backward")
                        rows.extend(measure_backward_point(f, dtype, T, settings.sizes, impls, no_backward,
                                                           seed=settings.seed, device=settings.device,
                                                           extra={"run": run_index}))
                        progress.update()
            run["seconds"] = round(time.time() - started, 1)
            _write_report(report_path, settings, run, rows, earlier,
                          backward=backward_summary(settings, no_backward) if BACKWARD in passes else None)
    report = json.loads(report_path.read_text())
    forward = [r for r in report["rows"] if not is_backward(r)]
    for name in dict.fromkeys(r["formulation"] for r in forward):
        plot_error_vs_length([r for r in forward if r["formulation"] == name], name, out / f"{name}.png")
    backward = [r for r in report["rows"] if is_backward(r)]
    for name in dict.fromkeys(r["formulation"] for r in backward):
        plot_gradient_error_vs_length([r for r in backward if r["formulation"] == name], name,
                                      out / backward_figure(name))
    return write_index(out)


def backward_figure(name: str) -> str:
    """The file name of a formulation's gradient error-vs-T figure."""
    return f"{name}-backward.png"


def backward_summary(settings: Settings, no_backward: dict[tuple[str, str], str]) -> dict[str, Any]:
    """report.json's "backward" entry: the reference, the cotangents and the implementations without a backward."""
    return {
        "reference": f"float64 autograd through the chunkwise oracle (chunk_size {settings.reference_chunk_size}) "
                     f"on {settings.device}, at every T ({GRADIENT_REFERENCE_NAME})",
        "cotangents": f"do ~ N(0, 1) from seed {settings.seed}, rounded to the dtype; where the formulation has a "
                      "state, N(0, 1) fp32 cotangents of the final state's scale-free parts "
                      "(attnlab.gradients.log_scale_cotangent)",
        "gradients": "every differentiable input the forward pass gives (no initial state is given)",
        "floors": "floor_round: each float64 gradient rounded once to the dtype it is returned in; floor_cond: its "
                  "relative change with inputs and cotangents perturbed at fp32 roundoff (attnlab.gradients."
                  "gradient_floor)",
        "bounds": "the registry's gradient bounds (attnlab.registry.bounds_for, spec.Bounds.gradients)",
        "no_backward": [{"formulation": n, "impl": i, "why": why} for (n, i), why in no_backward.items()],
    }


def _row_key(row: Row) -> tuple[Any, ...]:
    """A point's rows (every gradient of an implementation at one T, in the backward pass) are replaced together."""
    return row["formulation"], row["impl"], row["dtype"], row["T"], row.get("pass", FORWARD)


def _write_report(path: Path, settings: Settings, run: dict[str, Any], rows: list[Row], earlier: dict[str, Any] | None,
                  backward: dict[str, Any] | None = None) -> None:
    """report.json: this run's settings on top, every run in ``runs``, the rows of all runs (new ones replace old);
    ``backward`` (:func:`backward_summary`), with an earlier run's implementations without a backward kept."""
    replaced = {_row_key(r) for r in rows}
    kept = [r for r in (earlier["rows"] if earlier else []) if _row_key(r) not in replaced]
    all_rows = kept + rows
    runs = [*(earlier["runs"] if earlier else []), run]
    before = (earlier or {}).get("backward")
    if before and backward:
        listed = {(e["formulation"], e["impl"]) for e in backward["no_backward"]}
        backward = {**backward, "no_backward": [e for e in before["no_backward"]
                                                if (e["formulation"], e["impl"]) not in listed] + backward["no_backward"]}
    backward = backward or before
    report = {
        "what": "error of each implementation against the float64 oracle, by formulation, dtype and T (attnlab report)",
        **{key: run[key] for key in ("settings", "seed", "device", "versions")},
        "oracle": oracle_summary(settings, all_rows),
        **({"backward": backward} if backward else {}),
        "runs": runs,
        "rows": all_rows,
    }
    path.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")


# --- plots ------------------------------------------------------------------------


def growth_exponent(lengths: Sequence[int], errors: Sequence[float | None]) -> float | None:
    """Least-squares slope of log(rel_err) against log(T): 0 is flat, 0.5 like sqrt(T), 1 linear in T."""
    points = [(math.log(T), math.log(e)) for T, e in zip(lengths, errors) if e is not None and e > 0]
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread > 0 else None


def textbook_guides(lengths: Sequence[int], u: float) -> dict[str, list[float]]:
    """gamma_T = Tu / (1 - Tu) (recursive summation; NaN once Tu >= 1, where it is vacuous) and sqrt(T) u."""
    return {
        "γ_T = Tu/(1−Tu)": [T * u / (1 - T * u) if T * u < 1 else math.nan for T in lengths],
        "√T·u": [math.sqrt(T) * u for T in lengths],
    }


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else math.nan


MARKERS = ("o", "s", "^", "D", "v", "P")


def _impl_styles(impl_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A line style per implementation: hollow markers, so that implementations on the same values stay visible."""
    import matplotlib.pyplot as plt

    return {impl: dict(color=plt.get_cmap("tab10")(i % 10), marker=MARKERS[i % len(MARKERS)], ms=10 - 1.5 * (i % 4),
                       mfc="none", mew=1.4, lw=1.4) for i, impl in enumerate(impl_names)}


def _save_figure(fig: Any, axes: Iterable[Any], title: str, path: Path) -> None:
    """One legend (right) for the labels of ``axes``, the title, and ``fig`` written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="center right", fontsize=8, frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_error_vs_length(rows: Sequence[Row], name: str, path: Path) -> None:
    """One PNG for one formulation: a column per dtype; top rel_err vs T (log-log) with the floor and
    the textbook guides, bottom excess vs T; a line per implementation (hollow markers, so that
    implementations sitting on the same values stay visible)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    impl_names = list(dict.fromkeys(r["impl"] for r in rows))
    style = _impl_styles(impl_names)
    fig, axes = plt.subplots(2, len(dtypes), figsize=(5.2 * len(dtypes) + 2.4, 7.4), squeeze=False,
                             gridspec_kw={"height_ratios": (2.2, 1)}, sharex="col")
    for column, dtype in enumerate(dtypes):
        error_ax, excess_ax = axes[0][column], axes[1][column]
        sub = [r for r in rows if r["dtype"] == dtype]
        lengths = sorted({r["T"] for r in sub})
        floors = [_median(r["floor_round"] for r in sub if r["T"] == T and r["floor_round"] is not None) for T in lengths]
        judged = [_median(r["floor"] for r in sub if r["T"] == T and r["floor"] is not None) for T in lengths]
        guides = textbook_guides(lengths, unit_roundoff(DTYPES[dtype]))
        shown = [v for r in sub for v in (r["rel_err"], r["floor"]) if v is not None and v > 0]
        shown += [g for guide in guides.values() for g in guide if math.isfinite(g)]
        low, high = min(shown, default=1e-8) / 2, min(max(shown, default=1.0), 1e3) * 3
        error_ax.plot(lengths, floors, color="black", ls="--", lw=1.8, label="rounding floor")
        if any(j > 1.05 * fl for j, fl in zip(judged, floors) if math.isfinite(j) and math.isfinite(fl)):
            error_ax.plot(lengths, judged, color="black", ls=":", lw=1.8, label="floor with conditioning")
        for (label, guide), line in zip(guides.items(), ("-.", (0, (1, 2)))):
            error_ax.plot(lengths, guide, color="0.5", ls=line, lw=1.3, label=label)
        failed = []
        for impl in impl_names:
            mine = sorted((r for r in sub if r["impl"] == impl), key=lambda r: r["T"])
            measured = [r for r in mine if r["rel_err"] is not None]
            broken = [r["T"] for r in mine if r["error"] is None and r["rel_err"] is None]
            if measured:
                error_ax.plot([r["T"] for r in measured], [r["rel_err"] for r in measured], label=impl, **style[impl])
                excess_ax.plot([r["T"] for r in measured], [r["excess"] for r in measured], **style[impl])
            if broken:
                error_ax.plot(broken, [high / 1.6] * len(broken), ls="none", marker="X", ms=10,
                              color=style[impl]["color"], label=f"{impl}: non-finite output")
            if any(r["error"] for r in mine):
                failed.append(impl)
        if failed:
            error_ax.text(0.02, 0.02, "failed (see index.md): " + ", ".join(failed), transform=error_ax.transAxes,
                          fontsize=7, color="firebrick", va="bottom")
        error_ax.set_yscale("log")
        error_ax.set_ylim(low, high)
        error_ax.set_ylabel("rel_err = |o − ref|_F / |ref|_F")
        error_ax.set_title(f"{dtype} (u = {unit_roundoff(DTYPES[dtype]):.2g})")
        excess_ax.axhline(1.0, color="black", ls="--", lw=1.2)
        excess_ax.set_yscale("log")
        excesses = [r["excess"] for r in sub if r["excess"] is not None and r["excess"] > 0] or [1.0]
        excess_ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        if max(excesses) / min(excesses) < 10:  # within a decade the minor ticks carry the labels
            excess_ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        else:
            excess_ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        excess_ax.set_ylabel("excess = rel_err / floor")
        excess_ax.set_xlabel("sequence length T")
        for ax in (error_ax, excess_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, [str(T) for T in lengths])
            ax.grid(True, which="major", alpha=0.3)
    _save_figure(fig, axes[0], f"{name}: error vs T against the float64 oracle ({formulation(name).title})", path)


def plot_gradient_error_vs_length(rows: Sequence[Row], name: str, path: Path) -> None:
    """One PNG for one formulation's backward pass: a panel per gradient (columns) and dtype (rows), rel_err vs T
    (log-log) with the rounding floor (and the floor with conditioning where it is larger), a line per
    implementation; X marks non-finite gradients."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured_rows = [r for r in rows if r.get("gradient")]
    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    gradients = list(dict.fromkeys(r["gradient"] for r in measured_rows)) or ["(none)"]
    impl_names = list(dict.fromkeys(r["impl"] for r in rows))
    style = _impl_styles(impl_names)
    fig, axes = plt.subplots(len(dtypes), len(gradients), figsize=(3.6 * len(gradients) + 2.4, 3.4 * len(dtypes) + 0.8),
                             squeeze=False, sharex=True)
    for i, dtype in enumerate(dtypes):
        failed = sorted({r["impl"] for r in rows if r["dtype"] == dtype and r["error"]})
        for j, gradient in enumerate(gradients):
            ax = axes[i][j]
            sub = [r for r in measured_rows if r["dtype"] == dtype and r["gradient"] == gradient]
            lengths = sorted({r["T"] for r in sub}) or sorted({r["T"] for r in rows})
            floors = [_median(r["floor_round"] for r in sub if r["T"] == T and r["floor_round"] is not None)
                      for T in lengths]
            judged = [_median(r["floor"] for r in sub if r["T"] == T and r["floor"] is not None) for T in lengths]
            shown = [v for r in sub for v in (r["rel_err"], r["floor"], r["floor_round"]) if v is not None and v > 0]
            low, high = min(shown, default=1e-8) / 2, min(max(shown, default=1.0), 1e3) * 3
            ax.plot(lengths, floors, color="black", ls="--", lw=1.6, label="rounding floor")
            if any(a > 1.05 * b for a, b in zip(judged, floors) if math.isfinite(a) and math.isfinite(b)):
                ax.plot(lengths, judged, color="black", ls=":", lw=1.6, label="floor with conditioning")
            for impl in impl_names:
                mine = sorted((r for r in sub if r["impl"] == impl), key=lambda r: r["T"])
                measured = [r for r in mine if r["rel_err"] is not None]
                broken = [r["T"] for r in mine if r["rel_err"] is None]
                if measured:
                    ax.plot([r["T"] for r in measured], [r["rel_err"] for r in measured], label=impl, **style[impl])
                if broken:
                    ax.plot(broken, [high / 1.6] * len(broken), ls="none", marker="X", ms=10,
                            color=style[impl]["color"], label=f"{impl}: non-finite gradient")
            if failed and j == 0:
                ax.text(0.02, 0.02, "failed (see index.md): " + ", ".join(failed), transform=ax.transAxes,
                        fontsize=7, color="firebrick", va="bottom")
            ax.set_yscale("log")
            ax.set_ylim(low, high)
            ax.set_xscale("log", base=2)
            if not sub:  # nothing measured (every reference failed): no data to place the lengths on the log axis
                ax.set_xlim(lengths[0] / 2, lengths[-1] * 2)
            ax.set_xticks(lengths, [str(T) for T in lengths])
            ax.grid(True, which="major", alpha=0.3)
            ax.set_title(f"d{gradient}, {dtype}", fontsize=10)
            if j == 0:
                ax.set_ylabel("rel_err = |g − ref|_F / |ref|_F")
            if i == len(dtypes) - 1:
                ax.set_xlabel("sequence length T")
    _save_figure(fig, axes.flat, f"{name}: gradient error vs T against float64 autograd ({formulation(name).title})",
                 path)


# --- index.md ---------------------------------------------------------------------


def _format_excess(row: Row | None) -> str:
    if row is None:
        return ""
    if row["error"]:
        return "error"
    if row["excess"] is None:
        return f"∞ ({row['nonfinite']} nf)" if row["nonfinite"] else "n/a"
    return f"{row['excess']:.2f}" if row["excess"] < 10 else f"{row['excess']:.3g}"


def _format_number(value: float | None) -> str:
    return "" if value is None else f"{value:.2g}"


def row_verdict(row: Row) -> str:
    """A row's verdict: recorded in it, or (a row of a report.json written before verdicts) graded now."""
    if row.get("verdict"):
        return row["verdict"]
    if row["error"] or row["nonfinite"] or row["excess"] is None:
        return FAILED
    b = user_bounds(bounds_for(formulation(row["formulation"]), row["dtype"]))
    return grade(row["excess"], b.accuracy, b.correctness)


def verdict_cell(rows: Iterable[Row]) -> str:
    """The worst verdict of some rows, with the lengths where it was reached unless every row is held."""
    rows = list(rows)
    worst = worst_verdict(row_verdict(r) for r in rows)
    where = sorted({r["T"] for r in rows if row_verdict(r) == worst})
    return worst if worst == VERDICTS[0] else f"{worst} (T={','.join(map(str, where))})"


def bounds_text(dtypes: Iterable[str]) -> str:
    """The registry's bounds of some dtypes, in words (a formulation's own entry may differ)."""
    return "; ".join(f"{d}: accuracy {BOUNDS[d].accuracy:g}, correctness {BOUNDS[d].correctness:g}"
                     for d in dict.fromkeys(dtypes) if d in BOUNDS)


def summary_table(rows: Sequence[Row]) -> list[str]:
    """Markdown lines: one row per (formulation, implementation, dtype), excess at each T, the worst verdict,
    growth and worst error."""
    lengths = sorted({r["T"] for r in rows})
    header = ["formulation", "impl", "dtype", *[f"T={T}" for T in lengths], "verdict", "growth", "worst rel_err",
              "floor", "non-finite"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    groups = dict.fromkeys((r["formulation"], r["impl"], r["dtype"]) for r in rows)
    for name, impl, dtype in groups:
        mine = {r["T"]: r for r in rows if (r["formulation"], r["impl"], r["dtype"]) == (name, impl, dtype)}
        measured = sorted((T, r["rel_err"]) for T, r in mine.items() if r["rel_err"] is not None)
        slope = growth_exponent([T for T, _ in measured], [e for _, e in measured])
        worst = max((e for _, e in measured), default=None)
        floors = [r["floor"] for r in mine.values() if r["floor"] is not None]
        nonfinite = sum(r["nonfinite"] or 0 for r in mine.values())
        cells = [name, f"`{impl}`", dtype, *[_format_excess(mine.get(T)) for T in lengths], verdict_cell(mine.values()),
                 "" if slope is None else f"T^{slope:.2f}", _format_number(worst),
                 _format_number(max(floors)) if floors else "", str(nonfinite)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def headline(rows: Sequence[Row]) -> list[str]:
    """Markdown bullets: the worst kernel excess, which curves grow with T and which formulations' kernels are flat."""
    lines = []
    kernels = [r for r in rows if r["impl"].startswith("attnlab:") and r["error"] is None]
    measured = [r for r in kernels if r["excess"] is not None]
    if measured:
        worst = max(measured, key=lambda r: r["excess"])
        lines.append(f"- Worst excess of an attnlab kernel: **{worst['excess']:.3g}** ({worst['formulation']}, "
                     f"`{worst['impl']}`, {worst['dtype']}, T={worst['T']}).")
    broken = sorted({(r["formulation"], r["impl"], r["dtype"]) for r in kernels if r["excess"] is None})
    if broken:
        lines.append("- Kernels with non-finite outputs: " + ", ".join(f"{n} `{i}` {d}" for n, i, d in broken) + ".")
    points = [r for r in rows if r["impl"].startswith("attnlab:")]
    if points:
        counts = {v: sum(row_verdict(r) == v for r in points) for v in VERDICTS}
        graded = [f"{v} {n}" for v, n in counts.items() if n]
        not_held = sorted({(r["formulation"], r["impl"], r["dtype"], row_verdict(r)) for r in points
                           if row_verdict(r) != VERDICTS[0]})
        lines.append(f"- Verdicts of attnlab's kernels over {len(points)} points: {', '.join(graded)}"
                     + (" (" + ", ".join(f"{n} `{i}` {d} {v}" for n, i, d, v in not_held) + ")" if not_held else "")
                     + ".")
    slopes = {}
    for key in dict.fromkeys((r["formulation"], r["impl"], r["dtype"]) for r in rows):
        mine = sorted((r["T"], r["rel_err"]) for r in rows
                      if (r["formulation"], r["impl"], r["dtype"]) == key and r["rel_err"] is not None)
        slopes[key] = growth_exponent([T for T, _ in mine], [e for _, e in mine])
    for kind, is_kernel in (("attnlab kernels", True), ("Baselines", False)):
        growing = [f"{n} `{i}` {d} (T^{p:.2f})" for (n, i, d), p in slopes.items()
                   if p is not None and p > GROWTH_SLOPE and i.startswith("attnlab:") == is_kernel]
        if growing:
            lines.append(f"- {kind} whose error grows with T (fitted exponent > {GROWTH_SLOPE}): "
                         + ", ".join(growing) + ".")
    kernel_slopes = [(n, p) for (n, i, _), p in slopes.items() if i.startswith("attnlab:")]
    flat = [n for n in dict.fromkeys(n for n, _ in kernel_slopes)
            if all(p is not None and p <= GROWTH_SLOPE for m, p in kernel_slopes if m == n)]
    if flat:
        lines.append(f"- Formulations whose kernels are all flat in T (exponent <= {GROWTH_SLOPE}): {', '.join(flat)}.")
    failed = sum(1 for r in rows if r["error"])
    if failed:
        lines.append(f"- {failed} point(s) failed; their errors are listed under *Failures*.")
    return lines


def failures(rows: Sequence[Row]) -> list[str]:
    """Markdown bullets, one per distinct (formulation, implementation, dtype, error), with the lengths it hit."""
    hits: dict[tuple[str, str, str, str], list[int]] = {}
    for r in rows:
        if r["error"]:
            hits.setdefault((r["formulation"], r["impl"], r["dtype"], r["error"]), []).append(r["T"])
    return [f"- {n} `{i}` {d}, T={','.join(map(str, sorted(Ts)))}: {e}" for (n, i, d, e), Ts in hits.items()]


def map_sections(out: Path) -> list[str]:
    """Markdown for index.md: one section per stability map (map-<family>.json, written by ``attnlab map``) in ``out``, with a table and the figures."""
    lines: list[str] = []
    for path in sorted(out.glob("map-*.json")):
        document = json.loads(path.read_text())
        rows = document["rows"]
        family = document["settings"]["family"]
        lines += [f"## Stability map: {family}", "", document["description"], "",
                  *[f"- Device: {run['device']['name']}; reproduce: `{run['settings']['command']}`"
                    for run in document.get("runs", [document])],
                  f"- Axes: {document['axes']['x']['name']} x {document['axes']['y']['name']}", "",
                  "| formulation | impl | dtype | points | held / imprecise / failed | with non-finite output | raised "
                  "| largest finite excess |",
                  "|---|---|---|---|---|---|---|---|"]
        for key in dict.fromkeys((r["formulation"], r["impl"], r["dtype"]) for r in rows):
            mine = [r for r in rows if (r["formulation"], r["impl"], r["dtype"]) == key]
            broken = sum(1 for r in mine if not r["error"] and r["nonfinite"])
            raised = sum(1 for r in mine if r["error"])
            graded = " / ".join(str(sum(row_verdict(r) == v for r in mine)) for v in VERDICTS)
            largest = max((r["excess"] for r in mine if r["excess"] is not None), default=None)
            lines.append(f"| {key[0]} | `{key[1]}` | {key[2]} | {len(mine)} | {graded} | {broken} | {raised} | "
                         f"{'' if largest is None else f'{largest:.3g}'} |")
        lines.append("")
        for figure in document["figures"]:
            lines += [f"![{figure['png']}]({figure['png']})", ""]
    return lines


def write_index(out: Path) -> Path:
    """(Re)write ``out/index.md`` from the folder's report.json and map-*.json; return its path."""
    lines = ["# attnlab report", ""]
    report_path = out / "report.json"
    if report_path.exists():
        report = json.loads(report_path.read_text())
        settings = report["settings"]
        rows = [r for r in report["rows"] if not is_backward(r)]
        backward = [r for r in report["rows"] if is_backward(r)]
        versions_text = ", ".join(f"{k} {v}" for k, v in report["versions"].items())
        oracle_info = report["oracle"]
        check = oracle_info["mpmath_check"]
        sizes = settings["sizes"]
        lines += [
            f"- Device: {report['device']['name']}",
            f"- Versions: {versions_text}",
            f"- Inputs: the registry's default distributions, seed {report['seed']}, B={sizes['B']}, H={sizes['H']}, "
            f"K={sizes['K']}, V={sizes['V']}, rounded to each dtype; every implementation sees the same rounded inputs.",
            f"- Reference: {oracle_info['reference']}, at every T ({', '.join(map(str, oracle_info['reference_lengths']))}).",
            "- Oracle check: " + (f"float64 agrees with mpmath to {check['max_rel_diff']:.1e} (max rel diff) at "
                                  f"T={', '.join(map(str, check['lengths']))}." if check["max_rel_diff"] is not None
                                  else "none (no length within the mpmath limit)." if rows
                                  else "none (the forward pass was not run)."),
            f"- Reproduce: `{settings['command']}`" + (f" ({len(report['runs'])} runs merged with --append)"
                                                       if len(report["runs"]) > 1 else ""),
            "",
            "Implementations: `attnlab:<form>` are attnlab's Triton kernels; `fp32-recurrent` is the naive recurrence "
            "in float32 with its output rounded to the dtype (plain fp32 accumulation); `fp16-recurrent` and "
            "`bf16-recurrent` run the same recurrence entirely in the dtype (the naive same-precision baseline).",
            "",
            "`excess = rel_err / floor`, with `floor = max(floor_round, floor_cond)`: 1.0 is a perfect kernel; "
            "*∞ (n nf)* marks n non-finite outputs; *growth* is the fitted exponent p of rel_err ∝ T^p.",
            "",
            "*verdict* (the worst over T, with the lengths where it was reached): *held* when the excess is within "
            "the accuracy bound, *imprecise* above it up to the correctness bound (the right function, less "
            "accurately than one rounding allows), *failed* above the correctness bound, with a non-finite output, "
            "or when the point raised (attnlab.registry.BOUNDS: "
            + bounds_text(r["dtype"] for r in report["rows"]) + "). The naive baselines are graded too.",
            "",
        ]
        if rows:
            lines += forward_sections(rows)
        if backward or report.get("backward"):
            lines += backward_sections(backward, report.get("backward") or {})
    lines += map_sections(out)
    path = out / "index.md"
    path.write_text("\n".join(lines).rstrip() + "\n")
    return path


def forward_sections(rows: Sequence[Row]) -> list[str]:
    """index.md's sections of the forward pass: the summary, the excess table, the plots and the failures."""
    lines = [
        "## Summary",
        "",
        *headline(rows),
        "",
        "## Excess by length",
        "",
        *summary_table(rows),
        "",
        "## Error vs T",
        "",
        "Log-log; dashed: the rounding floor (the exact answer rounded once to the dtype); grey: the textbook "
        "guides γ_T = Tu/(1−Tu) (recursive summation, worst case) and √T·u (random rounding errors); "
        "X: non-finite output.",
        "",
    ]
    for name in dict.fromkeys(r["formulation"] for r in rows):
        lines += [f"### {name}: {formulation(name).title}", "", f"![{name}: error vs T]({name}.png)", ""]
    problems = failures(rows)
    if problems:
        lines += ["## Failures", "", *problems, ""]
    return lines


def gradient_table(rows: Sequence[Row]) -> list[str]:
    """Markdown lines: one row per (formulation, implementation, dtype, gradient), its excess at each T, the worst
    verdict, worst error, floor and non-finite entries; a point that raised is a line of its own (gradient —)."""
    lengths = sorted({r["T"] for r in rows})
    header = ["formulation", "impl", "dtype", "gradient", *[f"T={T}" for T in lengths], "verdict", "worst rel_err",
              "floor", "non-finite"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, impl, dtype, gradient in dict.fromkeys((r["formulation"], r["impl"], r["dtype"], r["gradient"])
                                                     for r in rows):
        mine = {r["T"]: r for r in rows if (r["formulation"], r["impl"], r["dtype"], r["gradient"])
                == (name, impl, dtype, gradient)}
        errors = [r["rel_err"] for r in mine.values() if r["rel_err"] is not None]
        floors = [r["floor"] for r in mine.values() if r["floor"] is not None]
        cells = [name, f"`{impl}`", dtype, f"d{gradient}" if gradient else "—",
                 *[_format_excess(mine.get(T)) for T in lengths], verdict_cell(mine.values()),
                 _format_number(max(errors)) if errors else "", _format_number(max(floors)) if floors else "",
                 str(sum(r["nonfinite"] or 0 for r in mine.values()))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def backward_sections(rows: Sequence[Row], about: dict[str, Any]) -> list[str]:
    """index.md's sections of the backward pass (``rows``; ``about``: report.json's "backward" entry)."""
    lines = ["## Backward pass", "",
             "Each gradient of each differentiable implementation, measured as the forward output is: `rel_err` over "
             "`floor = max(floor_round, floor_cond)`, graded by the same bounds.", ""]
    for key, label in (("reference", "Reference"), ("cotangents", "Cotangents"), ("gradients", "Gradients"),
                       ("floors", "Floors"), ("bounds", "Bounds")):
        if about.get(key):
            lines.append(f"- {label}: {about[key]}.")
    missing = about.get("no_backward") or []
    if missing:
        lines.append("- No backward (not differentiable, so not measured; not a failure): "
                     + ", ".join(f"{e['formulation']} `{e['impl']}`" for e in missing)
                     + f" ({'; '.join(dict.fromkeys(e['why'] for e in missing))}).")
    lines.append("")
    if not rows:
        return [*lines, "No implementation had a backward to measure.", ""]
    counts = {v: sum(row_verdict(r) == v for r in rows) for v in VERDICTS}
    measured = [r for r in rows if r["excess"] is not None]
    lines += ["### Summary", "",
              f"- Verdicts over {len(rows)} gradient rows: " + ", ".join(f"{v} {n}" for v, n in counts.items() if n) + "."]
    if measured:
        worst = max(measured, key=lambda r: r["excess"])
        lines.append(f"- Worst excess: **{worst['excess']:.3g}** ({worst['formulation']}, `{worst['impl']}`, "
                     f"{worst['dtype']}, d{worst['gradient']}, T={worst['T']}).")
    lines += ["", "### Gradient excess by length", "", *gradient_table(rows), "", "### Gradient error vs T", "",
              "Log-log, a panel per gradient and dtype; dashed: the rounding floor (the float64 gradient rounded once "
              "to the dtype it is returned in); dotted: the floor with conditioning, where larger; X: non-finite "
              "gradient.", ""]
    for name in dict.fromkeys(r["formulation"] for r in rows):
        lines += [f"#### {name}: {formulation(name).title}", "",
                  f"![{name}: gradient error vs T]({backward_figure(name)})", ""]
    problems = failures(rows)
    if problems:
        lines += ["### Backward failures", "", *problems, ""]
    return lines


# --- command line -----------------------------------------------------------------


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def formulations_arg(text: str) -> list[str]:
    """argparse type: ``all`` or a comma-separated list of known formulations."""
    if text == "all":
        return names()
    chosen = _comma_list(text)
    unknown = [n for n in chosen if n not in names()]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown formulation(s) {', '.join(unknown) or repr(text)}; expected 'all' or some of {', '.join(names())}")
    return chosen


def _choices(text: str, allowed: Iterable[str], what: str) -> list[str]:
    """A non-empty comma-separated list of some of ``allowed``; else an argparse error naming the unknown ``what``."""
    allowed = list(allowed)
    chosen = _comma_list(text)
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or repr(text)}; expected some of {', '.join(allowed)}")
    return chosen


def dtypes_arg(text: str) -> list[str]:
    """argparse type: a comma-separated list of float16, bfloat16, float32."""
    return _choices(text, DTYPES, "dtype(s)")


def lengths_arg(text: str) -> list[int]:
    """argparse type: a comma-separated list of positive integers."""
    try:
        lengths = [int(item) for item in _comma_list(text)]
    except ValueError:
        lengths = []
    if not lengths or any(T <= 0 for T in lengths):
        raise argparse.ArgumentTypeError(f"lengths must be positive integers, comma-separated; got {text!r}")
    return sorted(set(lengths))


def passes_arg(text: str) -> list[str]:
    """argparse type: a comma-separated list of forward, backward (returned in that order)."""
    chosen = _choices(text, PASSES, "pass(es)")
    return [p for p in PASSES if p in chosen]


def shape_arg(text: str) -> Sizes:
    """argparse type: ``B,H,K,V``, four positive integers."""
    try:
        values = [int(item) for item in _comma_list(text)]
    except ValueError:
        values = []
    if len(values) != 4 or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"shape must be B,H,K,V (four positive integers); got {text!r}")
    return Sizes(*values)


def resolve_device(parser: argparse.ArgumentParser, requested: str | None) -> str:
    """``cuda`` when asked for (and present) or when present by default, else ``cpu``; exits 2 on cuda without a GPU."""
    if requested == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to torch here; use --device cpu (kernels then run "
                     "under the Triton interpreter, fp16 and fp32 only)")
    return requested or ("cuda" if torch.cuda.is_available() else "cpu")


def refuse_bf16_on_the_interpreter(parser: argparse.ArgumentParser, device: str, dtypes: Iterable[str]) -> None:
    """Exit 2 (before any work) when bfloat16 is asked for where attnlab's kernels run under the Triton
    interpreter: every kernel point would fail, so the sweep could not do what was asked."""
    if device == "cpu" and interpreter_active() and "bfloat16" in dtypes:
        parser.error("--dtypes bfloat16 needs a GPU: attnlab's kernels run under the Triton interpreter here, which "
                     "computes bf16 on raw bit patterns (every kernel point would fail); use float16 or float32 on "
                     "the CPU, or run on a CUDA device")


def exit_status(rows: Iterable[Row]) -> int:
    """1 when a point raised (its row records the error: the sweep did not measure what was asked), else 0.
    A measured point graded imprecise or failed is a finding of the report, not a failure of the command."""
    return 1 if any(r["error"] for r in rows) else 0


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``attnlab report`` and ``attnlab map`` share."""
    parser.add_argument("--formulations", type=formulations_arg, default=None,
                        help="'all' or a comma-separated list (default: all)")
    parser.add_argument("--dtypes", type=dtypes_arg, default=None,
                        help="comma-separated, from float16, bfloat16, float32 (default: float16,float32 on the CPU, "
                             "bfloat16,float16 on a GPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where inputs, kernels and the float64 oracle run (default: cuda when present)")
    parser.add_argument("--shape", type=shape_arg, default=None, metavar="B,H,K,V",
                        help="batch, heads and head dimensions (default: 1,2,16,16 on the CPU, 1,4,64,64 on a GPU)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the registry's input sampling (default 0)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default: reports/<device>, e.g. reports/cpu)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``attnlab report`` on the CLI's subparsers."""
    parser = subparsers.add_parser(
        "report", help="error vs sequence length for every kernel and baseline, with plots (report.json, index.md)",
        description="Measure attnlab's kernels (attnlab:<form>) and the naive recurrences (fp32-recurrent, "
                    "<dtype>-recurrent) against the float64 oracle at each length, and write report.json, one "
                    "error-vs-T plot per formulation and index.md into --out. With no options on a machine without "
                    "a GPU it runs the short default (fp16 and fp32, T=16..128, about two minutes on 2 cores); on a "
                    "GPU the default is the gallery (bf16 and fp16, T=64..65536). Stability maps: see `attnlab map`.",
    )
    add_common_arguments(parser)
    parser.add_argument("--lengths", type=lengths_arg, default=None,
                        help="comma-separated sequence lengths (default: 16,32,64,128 on the CPU, 64,256,...,65536 on a GPU)")
    parser.add_argument("--mpmath-check-max-T", type=int, default=MPMATH_CHECK_MAX_T, metavar="T",
                        help=f"check the float64 oracle against mpmath at lengths up to T (default {MPMATH_CHECK_MAX_T}; 0: never)")
    parser.add_argument("--passes", type=passes_arg, default=[FORWARD], metavar="PASSES",
                        help="comma-separated, from forward, backward (default: forward). backward: every gradient "
                             "of every differentiable implementation (the naive recurrences, attnlab's kernels that "
                             "have a backward; those without are listed as such) against float64 autograd through the "
                             "chunkwise oracle, with a seeded random cotangent of o and of the final state")
    parser.add_argument("--append", action="store_true",
                        help="merge into the folder's report.json (rows recomputed here replace the old ones), "
                             "for a gallery built in several runs")
    parser.set_defaults(func=partial(cmd_report, parser))
    return parser


def cmd_report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    device = resolve_device(parser, args.device)
    defaults = DEFAULTS[device]
    refuse_bf16_on_the_interpreter(parser, device, args.dtypes or defaults.dtypes)
    settings = Settings(
        formulations=tuple(args.formulations or names()),
        dtypes=tuple(args.dtypes or defaults.dtypes),
        lengths=tuple(args.lengths or defaults.lengths),
        device=device,
        seed=args.seed,
        sizes=args.shape or defaults.sizes,
        mpmath_check_max_T=args.mpmath_check_max_T,
    )
    out = args.out or Path("reports") / device_slug(device)
    started = time.time()
    index = run_report(settings, out, append=args.append, passes=args.passes)
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    raised = [r for r in rows if r["error"]]
    counts = ", ".join(f"{sum(row_verdict(r) == v for r in rows)} {v}" for v in VERDICTS)
    print(f"report: {index} ({len(rows)} rows: {counts}; {len(raised)} raised; {time.time() - started:.0f} s); "
          f"data in {out / 'report.json'}, plots beside it")
    for name, impl, dtype, error in dict.fromkeys((r["formulation"], r["impl"], r["dtype"], r["error"])
                                                  for r in raised):
        print(f"  raised: {name} {impl} {dtype}: {error}", file=sys.stderr)
    missing = (report.get("backward") or {}).get("no_backward") or []
    if missing:
        print(f"  no backward (not measured): {', '.join(e['formulation'] + ' ' + e['impl'] for e in missing)}")
    return exit_status(rows)
