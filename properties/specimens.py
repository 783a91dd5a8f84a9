"""Known-bad specimens: deliberately broken kernels, in plain torch, that the properties must catch.

Each follows the attnlab convention (keyword inputs with FORMULATIONS.md
names, returns ``o`` in the input dtype), runs on the CPU in any dtype, and
carries exactly one defect. Apart from that defect they compute in fp32
and round once (except the naive RWKV-4 loop, whose defect *is* computing in
the input dtype), so that only the defect can be what a property catches.
``SPECIMENS`` names the property expected to catch each; ``attnlab
selftest`` checks that it does.

Two passes are broken: the forward specimens compute a wrong ``o``; the
backward specimens (``broken_pass="backward"``, issue 22) compute the right
``o`` (the float64 oracle rounded once to the input dtype) and a wrong
gradient. Each backward specimen is a ``torch.autograd.Function`` whose
backward is the float64 gradient oracle (attnlab.gradients, autograd through
the oracle) with ONE gradient recomputed by a defective formula, rounded once
to its input's dtype; the defect is real on every input (not a matter of
precision) except the naive RWKV-4 backward, whose defect is arithmetic in
the input dtype that overflows past the exp threshold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Specimen", "SPECIMENS", "FORWARD", "BACKWARD"]

FORWARD, BACKWARD = "forward", "backward"


def _scale(scale: float | None, K: int) -> float:
    return K**-0.5 if scale is None else scale


def rwkv4_naive_exp(*, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """RWKV-4 accumulating exp(k) directly in the input dtype: overflows once k passes 11.09 (fp16) or 88.72."""
    a = torch.zeros_like(k[:, 0])
    b = torch.zeros_like(k[:, 0])
    decay = torch.exp(-w)
    outputs = []
    for t in range(k.shape[1]):
        bonus = torch.exp(u + k[:, t])
        outputs.append((a + bonus * v[:, t]) / (b + bonus))
        a = decay * a + torch.exp(k[:, t]) * v[:, t]
        b = decay * b + torch.exp(k[:, t])
    return torch.stack(outputs, dim=1)


def _chunks(T: int, chunk_size: int) -> list[slice]:
    return [slice(s, min(s + chunk_size, T)) for s in range(0, T, chunk_size)]


def gla_split_exp(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  scale: float | None = None, chunk_size: int = 16) -> torch.Tensor:
    """Chunkwise GLA with the factorized decay ``(q exp(G)) (k exp(-G))^T``: exp(-G) overflows for strong gates."""
    s = _scale(scale, q.shape[-1])
    q32, k32, v32, g32 = (x.float().transpose(1, 2) for x in (q, k, v, g))
    S = q32.new_zeros(*q32.shape[:2], q32.shape[-1], v32.shape[-1])
    outputs = []
    for span in _chunks(q32.shape[2], chunk_size):
        G = g32[:, :, span].cumsum(dim=2)
        q_decayed, k_grown = s * q32[:, :, span] * torch.exp(G), k32[:, :, span] * torch.exp(-G)
        scores = (q_decayed @ k_grown.mT).tril()
        outputs.append(scores @ v32[:, :, span] + q_decayed @ S)
        k_to_end = k32[:, :, span] * torch.exp(G[:, :, -1:] - G)
        S = torch.exp(G[:, :, -1, :, None]) * S + k_to_end.mT @ v32[:, :, span]
    return torch.cat(outputs, dim=2).transpose(1, 2).to(q.dtype)


def retnet_sees_next_token(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           scale: float | None = None, chunk_size: int = 16) -> torch.Tensor:
    """Chunkwise RetNet whose causal mask, in a partial last chunk, lets token t read token t + 1."""
    s = _scale(scale, q.shape[-1])
    q32, k32, v32 = (x.float().transpose(1, 2) for x in (q, k, v))
    log_gamma = g.float()[None, :, None, None]
    S = q32.new_zeros(*q32.shape[:2], q32.shape[-1], v32.shape[-1])
    outputs = []
    for span in _chunks(q32.shape[2], chunk_size):
        n = span.stop - span.start
        lag = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)[None, :]
        reach = 1 if n < chunk_size else 0  # the defect: one token too far in the partial chunk
        decay = torch.where(lag >= -reach, torch.exp(log_gamma * lag), 0.0)
        qs = s * q32[:, :, span]
        outputs.append(((qs @ k32[:, :, span].mT) * decay) @ v32[:, :, span]
                       + (qs * torch.exp(log_gamma * (torch.arange(n, device=q.device)[:, None] + 1))) @ S)
        k_to_end = k32[:, :, span] * torch.exp(log_gamma * (n - 1 - torch.arange(n, device=q.device))[:, None])
        S = torch.exp(log_gamma * n) * S + k_to_end.mT @ v32[:, :, span]
    return torch.cat(outputs, dim=2).transpose(1, 2).to(q.dtype)


def deltanet_state_not_carried(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                               scale: float | None = None, chunk_size: int = 16) -> torch.Tensor:
    """DeltaNet by chunks, each chunk starting again from the zero state instead of the previous chunk's."""
    s = _scale(scale, q.shape[-1])
    q32, k32, v32 = (x.float().transpose(1, 2) for x in (q, k, v))
    b32 = beta.float().transpose(1, 2)
    outputs = []
    for span in _chunks(q32.shape[2], chunk_size):
        S = q32.new_zeros(*q32.shape[:2], q32.shape[-1], v32.shape[-1])  # the defect: the state is dropped
        for t in range(span.start, span.stop):
            k_t, v_t, b_t = k32[:, :, t, :, None], v32[:, :, t, None, :], b32[:, :, t, None, None]
            S = S - b_t * k_t * (k_t.mT @ S) + b_t * k_t * v_t
            outputs.append((s * q32[:, :, t, None, :] @ S)[:, :, 0])
    return torch.stack(outputs, dim=2).transpose(1, 2).to(q.dtype)


def kda_gate_after_update(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """KDA with the gate on the wrong side: ``Diag(exp g) (I - beta k k^T) S`` instead of ``(I - beta k k^T) Diag(exp g) S``."""
    s = _scale(scale, q.shape[-1])
    q32, k32, v32, g32 = (x.float().transpose(1, 2) for x in (q, k, v, g))
    b32 = beta.float().transpose(1, 2)
    S = q32.new_zeros(*q32.shape[:2], q32.shape[-1], v32.shape[-1])
    outputs = []
    for t in range(q32.shape[2]):
        k_t, v_t, b_t = k32[:, :, t, :, None], v32[:, :, t, None, :], b32[:, :, t, None, None]
        S = S - b_t * k_t * (k_t.mT @ S)
        S = torch.exp(g32[:, :, t, :, None]) * S + b_t * k_t * v_t
        outputs.append((s * q32[:, :, t, None, :] @ S)[:, :, 0])
    return torch.stack(outputs, dim=2).transpose(1, 2).to(q.dtype)


def gla_decay_off_by_one(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """GLA decaying the current token's write too: ``S_t = Diag(exp g_t) (S_{t-1} + k_t v_t^T)``."""
    s = _scale(scale, q.shape[-1])
    q32, k32, v32, g32 = (x.float().transpose(1, 2) for x in (q, k, v, g))
    S = q32.new_zeros(*q32.shape[:2], q32.shape[-1], v32.shape[-1])
    outputs = []
    for t in range(q32.shape[2]):
        S = torch.exp(g32[:, :, t, :, None]) * (S + k32[:, :, t, :, None] * v32[:, :, t, None, :])
        outputs.append((s * q32[:, :, t, None, :] @ S)[:, :, 0])
    return torch.stack(outputs, dim=2).transpose(1, 2).to(q.dtype)


def softmax_default_scale_one(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              scale: float | None = None, causal: bool = True) -> torch.Tensor:
    """Softmax attention defaulting to scale 1 where FORMULATIONS.md says K ** -0.5."""
    s = 1.0 if scale is None else scale  # the defect
    q32, k32, v32 = (x.float().transpose(1, 2) for x in (q, k, v))
    logits = s * q32 @ k32.mT
    if causal:
        T = q.shape[1]
        logits = logits.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return (torch.softmax(logits, dim=-1) @ v32).transpose(1, 2).to(q.dtype)


# --- backward specimens: the right o, one wrong gradient ------------------------------------------------------------


@dataclass(frozen=True)
class _Recipe:
    """What a backward specimen's autograd.Function needs besides its tensors: the formulation, the tensor inputs'
    names (in the Function's argument order), the options, and ``gradients(x, do) -> {name: float64 gradient}``
    (``x``: the saved inputs and the options)."""

    formulation: str
    names: tuple[str, ...]
    options: dict[str, Any]
    gradients: Callable[[dict[str, Any], torch.Tensor], dict[str, torch.Tensor]]


class _BrokenBackward(torch.autograd.Function):
    """Forward: the float64 recurrent oracle rounded once to the input dtype. Backward: ``recipe.gradients``, each
    rounded once to its input's dtype."""

    @staticmethod
    def forward(ctx: Any, recipe: _Recipe, *tensors: torch.Tensor) -> torch.Tensor:
        from attnlab.oracle import oracle

        ctx.recipe = recipe
        ctx.save_for_backward(*tensors)
        o = oracle(recipe.formulation, "recurrent")(**dict(zip(recipe.names, tensors)), **recipe.options)
        return o.to(tensors[0].dtype)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        recipe: _Recipe = ctx.recipe
        x = dict(zip(recipe.names, ctx.saved_tensors))
        grads = recipe.gradients({**x, **recipe.options}, do)
        return (None, *(grads[n].to(x[n].dtype) if needed else None
                        for n, needed in zip(recipe.names, ctx.needs_input_grad[1:])))


def _broken_backward(formulation: str, gradients: Callable[[dict[str, Any], torch.Tensor], dict[str, torch.Tensor]],
                     inputs: dict[str, Any]) -> torch.Tensor:
    """Call a backward specimen: ``inputs`` are the keyword inputs (tensors and options; a None option left out)."""
    names = tuple(n for n, t in inputs.items() if isinstance(t, torch.Tensor))
    options = {n: v for n, v in inputs.items() if n not in names and v is not None}
    return _BrokenBackward.apply(_Recipe(formulation, names, options, gradients), *(inputs[n] for n in names))


def _oracle_gradients(name: str, x: dict[str, Any], do: torch.Tensor, **opts: Any) -> dict[str, torch.Tensor]:
    from attnlab.gradients import oracle_gradients

    return oracle_gradients(name, x, do, **opts)


def _shift_in_time(x: torch.Tensor, steps: int) -> torch.Tensor:
    """``x`` moved ``steps`` positions along time (axis 1): ``+1`` later (position t holds t - 1's), ``-1`` earlier;
    zeros where nothing moves in."""
    out = torch.zeros_like(x)
    T = x.shape[1]
    if steps >= 0:
        out[:, steps:] = x[:, : T - steps]
    else:
        out[:, : T + steps] = x[:, -steps:]
    return out


def _gla_dg_one_step_short(x: dict[str, Any], do: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = _oracle_gradients("gla", x, do)
    # The oracle depends on g only through G_t = sum_{s <= t} g_s, so dg_t = sum_{s >= t} dG_s (a reverse cumulative
    # sum). dG_t = dg_t - dg_{t+1}; the defect sums s > t only (the reverse cumsum stops one step short of t).
    dg = grads["g"]
    dG = dg - _shift_in_time(dg, -1)
    grads["g"] = dG.flip(1).cumsum(1).flip(1) - dG
    return grads


def gla_dg_one_step_short(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """GLA whose gate gradient's reverse cumulative sum is one step short: dg_t = sum_{s > t} dG_s instead of
    sum_{s >= t} dG_s (dG_t the gradient of the cumulative log decay G_t). o, dq, dk, dv are right; dg is wrong
    wherever dG_t is not zero (T = 1 included: dg comes back zero). Caught by backward_matches_oracle[dg]."""
    return _broken_backward("gla", _gla_dg_one_step_short, dict(q=q, k=k, v=v, g=g, scale=scale))


def _deltanet_dk_without_erase(x: dict[str, Any], do: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = _oracle_gradients("deltanet", x, do)
    # dk by autograd through the recurrence with k detached in the erase term -beta k (k^T S): the erase's value is
    # unchanged, its dependence on k is dropped (the write beta k v^T still carries k's gradient).
    q, k, v = (x[n].detach().double().transpose(1, 2) for n in ("q", "k", "v"))
    beta = x["beta"].detach().double().transpose(1, 2)
    s = _scale(x.get("scale"), q.shape[-1])
    k = k.requires_grad_()
    with torch.enable_grad():
        S = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
        outputs = []
        for t in range(q.shape[2]):
            k_t, v_t, b_t = k[:, :, t, :, None], v[:, :, t, None, :], beta[:, :, t, None, None]
            erased = k_t.detach()  # the defect
            S = S - b_t * erased * (erased.mT @ S) + b_t * k_t * v_t
            outputs.append((s * q[:, :, t, None, :] @ S)[:, :, 0])
        o = torch.stack(outputs, dim=2).transpose(1, 2)
        (grads["k"],) = torch.autograd.grad((o * do.double()).sum(), k)
    grads["k"] = grads["k"].transpose(1, 2)
    return grads


def deltanet_dk_without_erase(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                              scale: float | None = None) -> torch.Tensor:
    """DeltaNet whose dk misses the erase term: the dependence of -beta_t k_t k_t^T S_{t-1} on k_t is dropped (dk
    only through the write beta_t k_t v_t^T). o, dq, dv, dbeta are right; dk is wrong wherever a key erases a
    non-zero state (T >= 2, beta > 0). Caught by backward_matches_oracle[dk]."""
    return _broken_backward("deltanet", _deltanet_dk_without_erase, dict(q=q, k=k, v=v, beta=beta, scale=scale))


def _retnet_dq_without_scale(x: dict[str, Any], do: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = _oracle_gradients("retnet", x, do)
    grads["q"] = grads["q"] / _scale(x.get("scale"), x["q"].shape[-1])  # the defect: o = S^T (scale q), dq = scale S do
    return grads


def retnet_dq_without_scale(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            scale: float | None = None) -> torch.Tensor:
    """RetNet whose dq leaves out the scale: dq_t = S_t do_t instead of scale S_t do_t. o, dk, dv, dg are right;
    dq is off by the factor 1/scale (invisible only where scale is 1). Caught by backward_matches_oracle[dq]
    (and, less sharply in fp32, by the oracle-free backward_query_identity[dq]: <q, dq> = <o, do>)."""
    return _broken_backward("retnet", _retnet_dq_without_scale, dict(q=q, k=k, v=v, g=g, scale=scale))


def _softmax_dv_sees_earlier_do(x: dict[str, Any], do: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = _oracle_gradients("softmax", x, do)
    # dv_i = sum_t P_ti do_t, computed with position t reading do_{t-1} (do shifted one step later in time).
    grads["v"] = _oracle_gradients("softmax", x, _shift_in_time(do, 1))["v"]
    return grads


def softmax_dv_sees_earlier_do(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                               causal: bool = True) -> torch.Tensor:
    """Softmax attention whose dv reads an earlier position's do: dv_i = sum_t P_ti do_{t-1} (do_{-1} = 0) instead
    of sum_t P_ti do_t. o, dq, dk are right; dv is wrong. With do zero from position c on, dv_c = P_cc do_{c-1} is
    not zero: caught by backward_causality[dv] (and by backward_matches_oracle[dv])."""
    return _broken_backward("softmax", _softmax_dv_sees_earlier_do, dict(q=q, k=k, v=v, scale=scale, causal=causal))


def _rwkv4_naive_exp_gradients(x: dict[str, Any], do: torch.Tensor) -> dict[str, torch.Tensor]:
    from attnlab.oracle import oracle

    # Autograd through the naive recurrence (exp(k) accumulated directly) in the input dtype: the defect.
    dtype = x["k"].dtype
    names = ("w", "u", "k", "v")
    leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
    naive = oracle("rwkv4", "recurrent", precision=str(dtype).replace("torch.", ""), stable=False)
    with torch.enable_grad():
        o = naive(**leaves)
        grads = torch.autograd.grad((o * do.to(o.dtype)).sum(), [leaves[n] for n in names])
    return dict(zip(names, grads))


def rwkv4_naive_exp_backward(*, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """RWKV-4 with a stable forward (the float64 oracle, rounded once) and a naive backward: autograd through
    exp(k) accumulated directly in the input dtype, which overflows once a key passes the dtype's exp threshold
    (11.09 fp16, 88.72 fp32 and bf16) while o stays finite. Every gradient then comes back non-finite (and in
    fp16, below the threshold, merely imprecise). Caught by backward_finite[dk] (non-finite where
    the float64 gradient is finite) on keys drawn past the threshold."""
    return _broken_backward("rwkv4", _rwkv4_naive_exp_gradients, dict(w=w, u=u, k=k, v=v))


@dataclass(frozen=True)
class Specimen:
    """A broken kernel: its formulation, its defect, and the property that must catch it."""

    name: str
    formulation: str
    function: Callable[..., Any]
    defect: str
    expected_property: str
    broken_pass: str = FORWARD  # FORWARD: a wrong o; BACKWARD: the right o, a wrong gradient


SPECIMENS: tuple[Specimen, ...] = (
    Specimen("rwkv4_naive_exp", "rwkv4", rwkv4_naive_exp,
             "naive exp(k) accumulation in the input dtype", "overflow"),
    Specimen("gla_split_exp", "gla", gla_split_exp,
             "q*exp(G) / k*exp(-G) split of the chunk decay", "overflow"),
    Specimen("retnet_sees_next_token", "retnet", retnet_sees_next_token,
             "sees one future token in its last partial chunk", "causality"),
    Specimen("deltanet_state_not_carried", "deltanet", deltanet_state_not_carried,
             "state not carried between chunks", "matches_oracle"),
    Specimen("kda_gate_after_update", "kda", kda_gate_after_update,
             "gate applied on the wrong side of the delta update", "matches_oracle"),
    Specimen("gla_decay_off_by_one", "gla", gla_decay_off_by_one,
             "off-by-one decay (the current write decays too)", "matches_oracle"),
    Specimen("softmax_default_scale_one", "softmax", softmax_default_scale_one,
             "default scale 1 instead of K ** -0.5", "matches_oracle"),
    Specimen("gla_dg_one_step_short", "gla", gla_dg_one_step_short,
             "dg's reverse cumulative sum one step short", "backward_matches_oracle[dg]", BACKWARD),
    Specimen("deltanet_dk_without_erase", "deltanet", deltanet_dk_without_erase,
             "dk misses the delta rule's erase term", "backward_matches_oracle[dk]", BACKWARD),
    Specimen("retnet_dq_without_scale", "retnet", retnet_dq_without_scale,
             "dq without its scale", "backward_matches_oracle[dq]", BACKWARD),
    Specimen("softmax_dv_sees_earlier_do", "softmax", softmax_dv_sees_earlier_do,
             "dv reads do one position earlier", "backward_causality[dv]", BACKWARD),
    Specimen("rwkv4_naive_exp_backward", "rwkv4", rwkv4_naive_exp_backward,
             "naive exp(k) accumulation in the backward, input dtype", "backward_finite[dk]", BACKWARD),
)
