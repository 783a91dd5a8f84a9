"""``attnlab bench``: each kernel timed side by side with its peer, in one run.

The peer is the registry entry's ``bench_peer`` (attnlab.spec.Peer): flash-linear-attention's kernel of the
same formulation where it has one, torch's scaled_dot_product_attention pinned to its flash backend
(FlashAttention-2) for softmax. It is called through its declared convention (attnlab.conventions): every conversion (names, dtypes, layout, log decay, stacked state)
is done once, before the timing, so the timed call is exactly the peer's own. attnlab's kernel runs with the
peer's ``our_options`` (the options under which it computes the same function). Times are medians of
``triton.testing.do_bench`` after a warm-up call (compilation stays out of the numbers); the ratio ours / peer
is the figure to read, since absolute times depend on the GPU. The memory floor is the time to move the bytes
no implementation can avoid, at the measured device-to-device bandwidth: for the forward, every input read and the
output written once; for a training step, also the output's cotangent read and every gradient written once
(each tensor once: a lower bound, not what a kernel that recomputes or saves intermediates moves).

Passes: "forward" times the call; "backward" times the forward and the backward together (``o.backward(do)``
with a fixed random ``do``, every differentiable input a leaf whose gradient is reset before each step), as a
training step meets them, for attnlab's kernel and the peer alike (the peer's converted inputs are its leaves,
so no conversion is timed). A kernel without a backward gets a row saying so. Where both passes ran, the
training step's row also gives attnlab's backward / forward: (step - forward) / forward, the backward's cost in
forwards, the figure to read where the peer has no backward on this GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
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


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def bytes_moved(f: Formulation, x: Inputs, out: torch.Tensor, backward: bool) -> int:
    """The memory floor's bytes (module docstring): ``x``'s tensors read and ``out`` written; ``backward``, also
    ``out``'s cotangent read and the gradient of each of ``f``'s differentiable inputs in ``x`` written."""
    moved = _nbytes(x.values()) + _nbytes([out])
    if backward:
        moved += _nbytes([out]) + _nbytes(x[a.name] for a in f.args if a.differentiable and a.name in x)
    return moved


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


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_()
    return value


def forward_backward(call: Callable[[], Any], leaves: list[torch.Tensor]) -> Callable[[], None]:
    """One training step of ``call``: its forward, then ``o.backward(do)`` (``o`` the first output, ``do`` drawn
    once), the leaves' gradients reset first so that no step accumulates into the last one's."""
    def first(out: Any) -> torch.Tensor:
        return out[0] if isinstance(out, (tuple, list)) else out

    do = torch.randn_like(first(call()))

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        first(call()).backward(do)

    return step


def peer_step(f: Formulation | str, x: Inputs, backward: bool = False) -> Callable[[], Any]:
    """The bench peer's call on ``x`` (``backward``: its training step, :func:`forward_backward`, every floating
    input a leaf), bound now. Raises what the peer raises (its module missing, its convention refusing)."""
    call = peer_call(f, x)
    if not backward:
        return call
    call = replace(call, args=tuple(map(_leaf, call.args)), kwargs={k: _leaf(v) for k, v in call.kwargs.items()})
    leaves = [t for t in (*call.args, *call.kwargs.values()) if isinstance(t, torch.Tensor) and t.requires_grad]
    return forward_backward(call, leaves)


def _timed_peer(f: Formulation, x: Inputs, backward: bool = False) -> tuple[float, str | None]:
    """(median ms, None) of the bench peer's call (``backward``: its forward and backward), bound before the
    timing, or (nan, the error)."""
    try:
        call = peer_step(f, x, backward)
    except Exception as error:  # the peer's module is missing, its convention refuses the inputs, no backward
        return math.nan, _error_text(error)
    ms, _, error = _timed(call)
    return ms, error


PASS_LABELS = {"forward": "forward", "backward": "forward + backward"}


def _timed_ours(ours: Any, inputs: dict[str, Any], f: Formulation, backward: bool) -> tuple[float, Any, str | None]:
    """(median ms, the forward's output, None) of attnlab's kernel (``backward``: forward and backward), or (nan,
    None, the error)."""
    if not backward:
        return _timed(lambda: ours(**inputs))
    differentiable = {a.name for a in f.args if a.differentiable}
    grad_inputs = {n: _leaf(t) if n in differentiable else t for n, t in inputs.items()}
    leaves = [t for t in grad_inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    try:
        with torch.no_grad():
            out = ours(**inputs)
        step = forward_backward(lambda: ours(**grad_inputs), leaves)
    except Exception as error:  # noqa: BLE001 - recorded in the row
        return math.nan, None, _error_text(error)
    ms, _, error = _timed(step)
    return ms, out, error


def run(names: list[str] | list[Formulation], *, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype,
        form: str = "chunkwise", passes: Sequence[str] = ("forward",), progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Time each formulation's kernel (its default and, if its module offers one, its SPEED_OPTIONS
    setting) and its peer at one shape, in each of ``passes``; one result row per kernel setting and pass."""
    from attnlab.kernel import kernel, speed_options

    bandwidth = measured_bandwidth()
    rows = []
    for f in map(as_formulation, names):
        name, peer = f.name, f.bench_peer
        x = {n: t.to(device="cuda", dtype=dtype) for n, t in f.sample(B=B, T=T, H=H, K=K, V=V, seed=0).items()}
        inputs = peer_inputs(f, x)
        chosen = form if form in f.kernel_forms else f.kernel_forms[0]
        speed = speed_options(name, chosen)
        for timed_pass in passes:
            backward = timed_pass == "backward"
            peer_ms, peer_error = _timed_peer(f, x, backward) if peer else (math.nan, None)
            for setting, opts in (("default", {}), ("speed", speed)):
                if setting == "speed" and not opts:
                    continue
                ours = kernel(name, chosen, **opts)
                ours_ms, out, error = _timed_ours(ours, inputs, f, backward)
                row: dict[str, Any] = {
                    "formulation": name, "setting": setting, "pass": PASS_LABELS[timed_pass], "kernel": repr(ours),
                    "ours_ms": ours_ms,
                    "floor_ms": 1e3 * bytes_moved(f, x, out, backward) / bandwidth if out is not None else math.nan,
                    "peer": peer.label if peer else None, "peer_ms": peer_ms, "ratio": ours_ms / peer_ms,
                }
                if error:
                    row["error"] = error
                if peer_error:
                    row["peer_error"] = peer_error
                progress(f"{name:15s} {setting:8s} {PASS_LABELS[timed_pass]:18s} ours {ours_ms:8.3f} ms  "
                         f"peer {peer_ms:8.3f} ms  ratio {row['ratio']:.2f}")
                rows.append(row)
        del x, inputs
        torch.cuda.empty_cache()
    return with_backward_over_forward(rows)


def with_backward_over_forward(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with each training step's ``backward_over_forward``, (step - forward) / forward of attnlab's
    kernel in the same setting, where its forward row is among them."""
    forward = {(r["formulation"], r["setting"]): r["ours_ms"] for r in rows if r["pass"] == PASS_LABELS["forward"]}
    for row in rows:
        key = (row["formulation"], row["setting"])
        if row["pass"] == PASS_LABELS["backward"] and key in forward:
            row["backward_over_forward"] = (row["ours_ms"] - forward[key]) / forward[key]
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, str]) -> str:
    lines = ["# attnlab kernel benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| formulation | pass | kernel | ours (ms) | peer | peer (ms) | ours / peer | memory floor (ms) | "
              "ours / floor | backward / forward |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    def cell(value: float, digits: int, otherwise: str = "n/a") -> str:
        return f"{value:.{digits}f}" if value == value else otherwise

    for r in rows:
        ours = cell(r["ours_ms"], 3, r.get("error") or "n/a")
        lines.append(f"| {r['formulation']} | {r.get('pass', 'forward')} | `{r['kernel']}` | {ours} | {r['peer'] or 'none'} | {cell(r['peer_ms'], 3, r.get('peer_error', 'n/a'))} | "
                     f"{cell(r['ratio'], 2)} | {cell(r['floor_ms'], 3)} | {cell(r['ours_ms'] / r['floor_ms'], 1)} | "
                     f"{cell(r.get('backward_over_forward', math.nan), 2, '')} |")
    return "\n".join(lines) + "\n"

