"""``attnlab bench``: each kernel timed side by side with its peer, in one run.

The peer is the registry entry's ``bench_peer`` (attnlab.spec.Peer): flash-linear-attention's kernel of the
same formulation where it has one, torch's scaled_dot_product_attention for softmax. It is called through its
declared convention (attnlab.conventions): every conversion (names, dtypes, layout, log decay, stacked state)
is done once, before the timing, so the timed call is exactly the peer's own. attnlab's kernel runs with the
peer's ``our_options`` (the options under which it computes the same function). Times are medians of
``triton.testing.do_bench`` after a warm-up call (compilation stays out of the numbers); the ratio ours / peer
is the figure to read, since absolute times depend on the GPU. The memory floor is the time to read every
input and write the output once at the measured device-to-device bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from attnlab.conventions import BoundCall, peer_adapter
from attnlab.oracle import as_formulation
from attnlab.spec import Formulation

Inputs = dict[str, torch.Tensor]


def peer_inputs(f: Formulation | str, x: Inputs) -> dict[str, Any]:
    """``x`` with the bench peer's ``our_options``: the call under which attnlab's kernel and the peer compute
    the same function (``x`` itself when ``f`` has no bench peer)."""
    peer = as_formulation(f).bench_peer
    return {**x, **dict(peer.our_options)} if peer else dict(x)


def peer_call(f: Formulation | str, x: Inputs) -> BoundCall:
    """The bench peer's call on ``x`` (attnlab's inputs, with the peer's our_options), every conversion done
    now: ``call()`` is exactly the peer function's call, ``call.result(call())`` its output in attnlab's
    convention. Imports the peer's module (fla, torch)."""
    f = as_formulation(f)
    if f.bench_peer is None:
        raise ValueError(f"{f.name} has no bench peer")
    return peer_adapter(f.bench_peer, f).bind(**peer_inputs(f, x))


def peer_output(f: Formulation | str, x: Inputs) -> torch.Tensor:
    """The bench peer's ``o`` on ``x``, converted back to attnlab's convention (layout, returns)."""
    call = peer_call(f, x)
    return call.result(call())


def _bytes_moved(x: Inputs, out: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in x.values()) + out.numel() * out.element_size()


def measured_bandwidth(device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    import triton.testing

    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def _timed(call: Callable[[], Any]) -> tuple[float, Any, str | None]:
    """(median ms, the output, None) or (nan, None, the error) when the call fails."""
    import triton.testing

    try:
        out = call()
        return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"), out, None
    except Exception as error:  # one implementation's failure is recorded, the run goes on
        return math.nan, None, _error_text(error)


def _error_text(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:300]


def _timed_peer(f: Formulation, x: Inputs) -> tuple[float, str | None]:
    """(median ms, None) of the bench peer's call, bound before the timing, or (nan, the error)."""
    try:
        call = peer_call(f, x)
    except Exception as error:  # the peer's module is missing, or its convention refuses the inputs
        return math.nan, _error_text(error)
    ms, _, error = _timed(call)
    return ms, error


def run(names: list[str] | list[Formulation], *, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, form: str = "chunkwise",
        progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Time each formulation's kernel (its default and, if its module offers one, its SPEED_OPTIONS
    setting) and its peer at one shape; one result row per kernel setting."""
    from attnlab.kernel import kernel, speed_options

    bandwidth = measured_bandwidth()
    rows = []
    for f in map(as_formulation, names):
        name, peer = f.name, f.bench_peer
        x = {n: t.to(device="cuda", dtype=dtype) for n, t in f.sample(B=B, T=T, H=H, K=K, V=V, seed=0).items()}
        inputs = peer_inputs(f, x)
        peer_ms, peer_error = _timed_peer(f, x) if peer else (math.nan, None)
        chosen = form if form in f.kernel_forms else f.kernel_forms[0]
        speed = speed_options(name, chosen)
        for setting, opts in (("default", {}), ("speed", speed)):
            if setting == "speed" and not opts:
                continue
            ours = kernel(name, chosen, **opts)
            ours_ms, out, error = _timed(lambda: ours(**inputs))  # noqa: B023
            row: dict[str, Any] = {
                "formulation": name, "setting": setting, "kernel": repr(ours), "ours_ms": ours_ms,
                "floor_ms": 1e3 * _bytes_moved(x, out) / bandwidth if out is not None else math.nan,
                "peer": peer.label if peer else None, "peer_ms": peer_ms, "ratio": ours_ms / peer_ms,
            }
            if error:
                row["error"] = error
            if peer_error:
                row["peer_error"] = peer_error
            progress(f"{name:15s} {setting:8s} ours {ours_ms:8.3f} ms  peer {peer_ms:8.3f} ms  ratio {row['ratio']:.2f}")
            rows.append(row)
        del x, inputs
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, str]) -> str:
    lines = ["# attnlab kernel benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| formulation | kernel | ours (ms) | peer | peer (ms) | ours / peer | memory floor (ms) | ours / floor |",
              "|---|---|---:|---|---:|---:|---:|---:|"]
    def cell(value: float, digits: int, otherwise: str = "n/a") -> str:
        return f"{value:.{digits}f}" if value == value else otherwise

    for r in rows:
        ours = cell(r["ours_ms"], 3, r.get("error", "n/a"))
        lines.append(f"| {r['formulation']} | `{r['kernel']}` | {ours} | {r['peer'] or 'none'} | {cell(r['peer_ms'], 3, r.get('peer_error', 'n/a'))} | "
                     f"{cell(r['ratio'], 2)} | {cell(r['floor_ms'], 3)} | {cell(r['ours_ms'] / r['floor_ms'], 1)} |")
    return "\n".join(lines) + "\n"

