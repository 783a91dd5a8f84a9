"""The gradient oracle (DESIGN.md, "Gradients (the second pass)"; FORMULATIONS.md section 2, "Gradients").

- :func:`oracle_gradients`: float64 gradients of ``<do, o> + <d_final_state, final_state>`` with respect to
  every differentiable input (``spec.Arg.differentiable``: q, k, v, every gate, beta, RWKV-4's w and u,
  aft's w) and the initial state, by torch autograd through the float64 oracle (attnlab.oracle) in any
  form. Inputs and cotangents of any dtype are upcast exactly.
- :func:`directional_derivative_mpmath`: its certificate, ``d/de <do, f(x + e u)> + <dS, S(x + e u)>`` at
  ``e = 0`` by mpmath.diff of the mpmath oracle's unrounded output at high precision, to compare with
  ``<grad, u>`` (:func:`inner`).
- :func:`gradient_dtypes`, :func:`gradient_floor`: what attnlab.metrics.measure_gradients needs to judge a
  kernel's gradients (the dtype each is returned in; the conditioning floors).
- :func:`log_scale_cotangent`: a final-state cotangent that does not depend on how a log-scale state
  (RWKV-4's ``(a, b, p)``) is normalized.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import mpmath
import numpy as np
import torch

from attnlab.metrics import gradient_conditioning_floor
from attnlab.oracle import Oracle, as_formulation
from attnlab.spec import Formulation
from attnlab.validation import validate

STATE = "initial_state"
# The dtype a kernel returns the initial state's gradient in (FORMULATIONS.md section 2, "Gradients").
STATE_GRADIENT_DTYPE = torch.float32


def differentiable_names(f: Formulation | str, inputs: Mapping[str, Any]) -> list[str]:
    """The inputs of ``inputs`` that get a gradient: ``f``'s differentiable arguments present (not None), in
    declaration order, then ``initial_state`` when one is given."""
    f = as_formulation(f)
    names = [a.name for a in f.args if a.differentiable and inputs.get(a.name) is not None]
    return names + ([STATE] if f.state is not None and inputs.get(STATE) is not None else [])


def _parts(value: Any) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def _form_options(form: str, chunk_size: int, opts: Mapping[str, Any]) -> dict[str, Any]:
    return {**({"chunk_size": chunk_size} if form == "chunkwise" else {}), **opts}


def _check_cotangents(f: Formulation, o: Any, do: torch.Tensor, final: Any, d_final_state: Any) -> None:
    if not isinstance(do, torch.Tensor) or tuple(do.shape) != tuple(o.shape):
        got = tuple(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__
        raise ValueError(f"do must be a tensor of o's shape {tuple(o.shape)}; got {got}")
    if d_final_state is None:
        return
    if f.state is None:
        raise ValueError(f"{f.name} has no state: d_final_state must be None")
    parts = _parts(d_final_state)
    shapes = [tuple(p.shape) for p in final]
    if len(parts) != len(shapes) or [tuple(p.shape) for p in parts] != shapes:
        raise ValueError(f"d_final_state must match the final state's parts {', '.join(f.state.names)} "
                         f"of shapes {shapes}; got {[tuple(p.shape) for p in parts]}")


def oracle_gradients(
    name_or_entry: str | Formulation,
    inputs: Mapping[str, Any],
    do: torch.Tensor,
    d_final_state: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    form: str = "chunkwise",
    chunk_size: int = 64,
    heads_per_call: int | None = None,
    **opts: Any,
) -> dict[str, Any]:
    """Float64 gradients of ``<do, o> + <d_final_state, final_state>`` by autograd through the oracle.

    ``inputs``: the formulation's inputs as the oracle takes them (tensors of any floating dtype, options,
    ``initial_state``); ``do``: the cotangent of ``o`` (its shape); ``d_final_state``: the final state's
    cotangent (a tensor, or a tuple for a multi-part state; None: none). ``form``, ``chunk_size`` and
    ``opts`` (rwkv4's ``stable``) configure attnlab.oracle. Returns ``{name: float64 gradient}`` for every
    differentiable input present (:func:`differentiable_names`), ``initial_state``'s a tuple for a
    multi-part state. Inputs are validated as the oracle validates them (a bad one raises the same error).
    ``heads_per_call``: differentiate that many heads at a time (:func:`_by_heads`), so that autograd keeps the
    intermediates of those heads only (softmax's are T x T per head); None: all at once.
    """
    f = as_formulation(name_or_entry)
    if heads_per_call is not None:
        by_heads = _by_heads(f, inputs, do, d_final_state, heads_per_call,
                             lambda x, d, dS: oracle_gradients(f, x, d, dS, form, chunk_size, **opts))
        if by_heads is not None:
            return by_heads
    call = {k: v for k, v in inputs.items() if k != "return_state"}
    validate(f, call)  # as given: an integer tensor must not pass for being upcast
    names = differentiable_names(f, inputs)
    # Fresh float64 leaves: the exact upcast of what was given, whatever its dtype or graph.
    leaves = {n: tuple(p.detach().to(torch.float64).requires_grad_() for p in _parts(inputs[n])) for n in names}
    call.update({n: (leaves[n][0] if n != STATE else f.state.join(leaves[n])) for n in names})
    with torch.enable_grad():
        if f.state is not None:
            o, final = Oracle(f, form, "float64", **_form_options(form, chunk_size, opts))(**call, return_state=True)
            final = f.state.split(final)
        else:
            o, final = Oracle(f, form, "float64", **_form_options(form, chunk_size, opts))(**call), ()
        _check_cotangents(f, o, do, final, d_final_state)
        loss = (o * do.to(o)).sum()
        if d_final_state is not None:
            loss = loss + sum((part * d.to(part)).sum() for part, d in zip(final, _parts(d_final_state)))
        flat = [leaf for n in names for leaf in leaves[n]]
        grads = torch.autograd.grad(loss, flat, allow_unused=True) if flat else ()
    grads = [torch.zeros_like(leaf) if g is None else g for leaf, g in zip(flat, grads)]
    out: dict[str, Any] = {}
    for n in names:
        parts, grads = grads[: len(leaves[n])], grads[len(leaves[n]):]
        out[n] = f.state.join(tuple(parts)) if n == STATE else parts[0]
    return out


def _by_heads(f: Formulation, inputs: Mapping[str, Any], do: torch.Tensor, d_final_state: Any, heads: int,
              gradients: Callable[[dict[str, Any], torch.Tensor, Any], dict[str, Any]]) -> dict[str, Any] | None:
    """``gradients(inputs, do, d_final_state)`` over groups of ``heads`` heads, joined: heads are independent, so a
    head-indexed input's gradient is its groups' gradients side by side and a shared input's (one without the H
    dimension: aft's position bias) their sum. None when there is nothing to split: no H dimension in o (o has
    the value argument's dims), or no more than ``heads`` heads."""
    value = f.args_with_role("value")[0]
    if "H" not in value.dims or not isinstance(inputs.get(value.name), torch.Tensor):
        return None
    axis_of = {a.name: a.dims.index("H") if "H" in a.dims else None for a in f.args}
    o_axis = value.dims.index("H")
    H = inputs[value.name].shape[o_axis]
    if H <= heads or tuple(do.shape) != tuple(inputs[value.name].shape):
        return None
    state_axes = [dims.index("H") for _, dims in f.state.parts] if f.state is not None else []

    def state_slice(state: Any, h0: int) -> Any:
        parts = tuple(p.narrow(axis, h0, min(heads, H - h0)) for p, axis in zip(f.state.split(state), state_axes))
        return f.state.join(parts)

    groups = []
    for h0 in range(0, H, heads):
        width = min(heads, H - h0)
        x = {n: (t.narrow(axis_of[n], h0, width) if isinstance(t, torch.Tensor) and axis_of.get(n) is not None else t)
             for n, t in inputs.items() if n != STATE}
        if inputs.get(STATE) is not None:
            x[STATE] = state_slice(inputs[STATE], h0)
        d_state = state_slice(d_final_state, h0) if d_final_state is not None else None
        groups.append(gradients(x, do.narrow(o_axis, h0, width), d_state))
    joined: dict[str, Any] = {}
    for n in groups[0]:
        if n == STATE:
            parts = zip(*(f.state.split(g[n]) for g in groups))
            joined[n] = f.state.join(tuple(torch.cat(p, axis) for p, axis in zip(parts, state_axes)))
        elif axis_of[n] is not None:
            joined[n] = torch.cat([g[n] for g in groups], axis_of[n])
        else:
            joined[n] = sum(g[n] for g in groups)
    return joined


def inner(grads: Mapping[str, Any], direction: Mapping[str, Any]) -> float:
    """``<grad, u>``: the sum over the direction's inputs (a multi-part state's parts too) of sum(grad * u),
    in float64; the first-order change of the loss along ``direction``."""
    total = torch.zeros((), dtype=torch.float64)
    for name, u in direction.items():
        for g, part in zip(_parts(grads[name]), _parts(u)):
            total = total + (g.detach().to(torch.float64).cpu() * part.detach().to(torch.float64).cpu()).sum()
    return float(total)


def _mp_inner(a: Any, b: Any) -> mpmath.mpf:
    return mpmath.fsum(np.asarray(a, dtype=object).ravel() * np.asarray(b, dtype=object).ravel())


def directional_derivative_mpmath(
    name_or_entry: str | Formulation,
    inputs: Mapping[str, Any],
    do: torch.Tensor,
    direction: Mapping[str, Any],
    d_final_state: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    dps: int = 40,
    form: str = "recurrent",
    **opts: Any,
) -> mpmath.mpf:
    """``d/de [<do, o(x + e u)> + <d_final_state, S(x + e u)>]`` at ``e = 0``, by mpmath at ``dps`` digits.

    ``direction``: input name (a differentiable input or ``initial_state``) -> ``u``, shaped as the input
    (a tuple for a multi-part state); inputs it leaves out do not move. The inputs, ``u`` and the cotangents
    are converted exactly to mpf; ``x + e u`` is formed in mpmath, so no rounding to float64 moves it.
    mpmath.diff takes a central difference with step ``2^-(prec+10)`` at twice the working precision plus
    40 bits, so its error is about ``2^-(prec+30)`` of the loss: compare with ``inner(grads, direction)``
    well beyond float64. Default form: the recurrent one, the code the float64 gradients' chunkwise and
    parallel forms are independent of. ``chunk_size`` and rwkv4's ``stable`` go in ``opts``.
    """
    f = as_formulation(name_or_entry)
    allowed = differentiable_names(f, inputs)
    unknown = sorted(set(direction) - set(allowed))
    if unknown:
        raise ValueError(f"direction has {', '.join(unknown)}, not among the differentiable inputs {', '.join(allowed)}")
    oracle = Oracle(f, form, "mpmath", dps=dps, **opts)
    call = {k: v for k, v in inputs.items() if k != "return_state"}
    backend, base = oracle.arguments(**call)
    keyword = {n: ("state" if n == STATE else n) for n in direction}  # the form's keyword of each moved input
    steps = {n: tuple(backend.asarray(p) for p in _parts(u)) for n, u in direction.items()}
    d_out = backend.asarray(do)
    d_state = [backend.asarray(p) for p in _parts(d_final_state)] if d_final_state is not None else []

    def loss(e: mpmath.mpf) -> mpmath.mpf:
        moved = dict(base)
        for n, u in steps.items():
            x = _parts(base[keyword[n]]) if n == STATE else (base[n],)
            x = tuple(xi + e * ui for xi, ui in zip(x, u))
            moved[keyword[n]] = x if n == STATE else x[0]
        o, final = oracle.evaluate(backend, moved)
        return _mp_inner(d_out, o) + mpmath.fsum(_mp_inner(d, s) for d, s in zip(d_state, final or ()))

    with mpmath.workdps(dps):
        return mpmath.diff(loss, mpmath.mpf(0))


def gradient_dtypes(name_or_entry: str | Formulation, inputs: Mapping[str, Any]) -> dict[str, torch.dtype]:
    """The dtype a kernel returns each gradient in: its input's dtype, fp32 for the initial state
    (FORMULATIONS.md section 2, "Gradients"); what attnlab.metrics.measure_gradients rounds each to."""
    return {n: (STATE_GRADIENT_DTYPE if n == STATE else inputs[n].dtype) for n in differentiable_names(name_or_entry, inputs)}


def gradient_floor(
    name_or_entry: str | Formulation,
    inputs: Mapping[str, Any],
    do: torch.Tensor,
    d_final_state: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
    *,
    trials: int = 3,
    seed: int = 0,
    base: Mapping[str, Any] | None = None,
    **oracle_opts: Any,
) -> dict[str, float]:
    """Each gradient's conditioning floor (attnlab.metrics.gradient_conditioning_floor) through
    :func:`oracle_gradients` (``oracle_opts``: its ``form``, ``chunk_size`` and options): inputs (clamped into
    their ranges) and cotangents perturbed at fp32 roundoff. ``base``: the already computed
    oracle_gradients of these inputs, if any."""
    f = as_formulation(name_or_entry)

    def gradients(x: Mapping[str, Any], cotangents: Mapping[str, Any]) -> dict[str, Any]:
        return oracle_gradients(f, x, cotangents["do"], cotangents.get("d_final_state"), **oracle_opts)

    cotangents = {"do": do, **({"d_final_state": d_final_state} if d_final_state is not None else {})}
    return gradient_conditioning_floor(gradients, inputs, cotangents, trials=trials, seed=seed, base=base,
                                       args={a.name: a for a in f.args})


def log_scale_cotangent(name_or_entry: str | Formulation, final_state: Any, d_scaled: Any) -> Any:
    """The cotangent of ``final_state``'s own parts equivalent to ``d_scaled`` on its scale-free parts.

    A state with a log-scale part (RWKV-4's ``(a, b, p)``, which holds ``e^p a`` and ``e^p b``) is unique only
    up to that scale: forms, options (rwkv4's naive loop returns p = 0) and kernels may return different
    ``(a, b, p)`` for one function, so a cotangent of the parts themselves is a cotangent of one
    representation. ``d_scaled`` holds cotangents ``dA, dB`` of ``e^p a, e^p b`` (one per part that is not
    log scale, in order): the loss ``<dA, e^p a> + <dB, e^p b>`` is the same whatever the representation, and
    its cotangent on the parts at ``final_state`` is ``(e^p dA, e^p dB, e^p (a dA + b dB))``. A state without
    a log-scale part has ``d_scaled`` for its cotangent.
    """
    spec = as_formulation(name_or_entry).state
    assert spec is not None, "a formulation without state has no final-state cotangent"
    parts = spec.split(final_state)
    logs = [i for i in range(len(parts)) if spec.is_log_scale(i)]
    if not logs:
        return d_scaled
    scale = torch.exp(parts[logs[0]].detach().to(torch.float64))
    plain = [i for i in range(len(parts)) if i not in logs]
    d = dict(zip(plain, _parts(d_scaled)))
    d_log = sum(scale * parts[i].detach().to(torch.float64) * d[i].to(torch.float64) for i in plain)
    return spec.join(tuple(d_log if i in logs else scale * d[i].to(torch.float64) for i in range(len(parts))))


__all__ = ["oracle_gradients", "directional_derivative_mpmath", "inner", "differentiable_names", "gradient_dtypes",
           "gradient_floor", "log_scale_cotangent"]
