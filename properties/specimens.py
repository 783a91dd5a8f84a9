"""Known-bad specimens: deliberately broken kernels, in plain torch, that the properties must catch.

Each follows the attnlab convention (keyword inputs with FORMULATIONS.md
names, returns ``o`` in the input dtype), runs on the CPU in any dtype, and
carries exactly one defect. Apart from that defect they compute in fp32
and round once (except the naive RWKV-4 loop, whose defect *is* computing in
the input dtype), so that only the defect can be what a property catches.
``SPECIMENS`` names the property expected to catch each; ``attnlab
selftest`` checks that it does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Specimen", "SPECIMENS"]


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


@dataclass(frozen=True)
class Specimen:
    """A broken kernel: its formulation, its defect, and the property that must catch it."""

    name: str
    formulation: str
    function: Callable[..., Any]
    defect: str
    expected_property: str


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
)
