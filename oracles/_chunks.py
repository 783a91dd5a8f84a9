"""Exact one-chunk evaluation shared by the chunkwise and parallel forms.

Two families share their chunk algebra: the gated linear family (linear_attn,
retnet, gla, general) and the delta rules (deltanet, gated_deltanet, kda).
Each oracle module's recurrent form is written out literally on its own, so
the forms-agree and special-case tests compare independent code.

Layout inside: heads first, ``q, k [B, H, C, K]``, ``v [B, H, C, V]``,
state ``S [B, H, K, V]``. Gates arrive as chunk-local cumulative log gates
(``G_t = sum_{s<=t} g_s``), so every decay between positions t >= j is
``exp(G_t - G_j)`` with a non-positive exponent; entries with t < j are
masked to 0 before the exponential and their products discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from attnlab.oracles._backend import Array


def heads_first(x: Array | None) -> Array | None:
    """[B, T, H, D] -> [B, H, T, D]."""
    return None if x is None else x.swapaxes(1, 2)


def chunk_spans(T: int, chunk_size: int) -> Iterator[slice]:
    """Consecutive chunks of ``chunk_size`` positions; the last may be partial."""
    for start in range(0, T, chunk_size):
        yield slice(start, min(start + chunk_size, T))


def pairwise_decay(xp: Any, G: Array, causal_mask: Array) -> Array:
    """``exp(G_t - G_j)`` as a [..., C, C, D] array for t >= j (1 elsewhere, to be masked).

    ``G`` is [..., C, D] chunk-local cumulative log gates.
    """
    diff = G[..., :, None, :] - G[..., None, :, :]
    return xp.exp(xp.where(causal_mask[..., None], diff, 0.0))


def gated_linear_chunk(
    xp: Any, q: Array, k: Array, v: Array, Gk: Array | None, Gv: Array | None, S: Array, scale: Any
) -> tuple[Array, Array]:
    """One chunk of ``S_t = (exp(gk_t) exp(gv_t)^T) * S_{t-1} + k_t v_t^T``, ``o_t = S_t^T (scale q_t)``.

    With cumulative gates ``Gk [.., C, K]``, ``Gv [.., C, V]`` (None: no gate):
      inter:  o_t[v] = exp(Gv_t[v]) sum_k scale q_t[k] exp(Gk_t[k]) S0[k, v]
      intra:  o_t[v] = sum_{j<=t} exp(Gv_t[v] - Gv_j[v]) v_j[v] sum_k scale q_t[k] k_j[k] exp(Gk_t[k] - Gk_j[k])
      state:  S_C = (exp(Gk_C) exp(Gv_C)^T) * S0 + sum_j (k_j exp(Gk_C - Gk_j)) (v_j exp(Gv_C - Gv_j))^T
    """
    C = q.shape[-2]
    mask = xp.tril_mask(C)
    qs = q * scale
    if Gk is None:
        scores = qs @ k.mT
        q_inter, k_to_end = qs, k
    else:
        scores = xp.sum(qs[..., :, None, :] * k[..., None, :, :] * pairwise_decay(xp, Gk, mask), axis=-1)
        q_inter = qs * xp.exp(Gk)
        k_to_end = k * xp.exp(Gk[..., -1:, :] - Gk)
    scores = xp.where(mask, scores, 0.0)
    if Gv is None:
        o = q_inter @ S + scores @ v
        v_to_end = v
        S_decayed = S
    else:
        o = (q_inter @ S) * xp.exp(Gv) + xp.sum(scores[..., None] * pairwise_decay(xp, Gv, mask) * v[..., None, :, :], axis=-2)
        v_to_end = v * xp.exp(Gv[..., -1:, :] - Gv)
        S_decayed = S * xp.exp(Gv[..., -1:, :])
    if Gk is not None:
        S_decayed = S_decayed * xp.exp(Gk[..., -1, :])[..., :, None]
    return o, S_decayed + k_to_end.mT @ v_to_end


def unit_lower_inverse(xp: Any, L: Array) -> Array:
    """``(I + L)^-1`` for strictly lower-triangular ``L [..., C, C]``, by forward substitution.

    Row i of the inverse X solves ``X_i = e_i - sum_{j<i} L_ij X_j`` at the
    backend's working precision. The rows are kept in a list and stacked, not
    written into X in place: autograd saves the rows above for each product.
    """
    C = L.shape[-1]
    identity = xp.zeros(L.shape) + xp.eye(C)
    rows = [identity[..., 0, :]]
    for i in range(1, C):
        above = xp.stack(rows, axis=-2)  # X_0 .. X_{i-1}: [..., i, C]
        rows.append(identity[..., i, :] - (L[..., i : i + 1, :i] @ above)[..., 0, :])
    return xp.stack(rows, axis=-2)


def delta_chunk(
    xp: Any, q: Array, k: Array, v: Array, beta: Array, G: Array | None, S: Array, scale: Any
) -> tuple[Array, Array]:
    """One chunk of ``S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T`` by the UT transform.

    ``G [.., C, K]`` holds chunk-local cumulative log gates (None: ungated),
    ``beta [.., C]``. Seed 000's algorithm with the gates folded in:
      L   = tril(Diag(beta) (K K^T * Gamma), -1),  Gamma_tj = exp(G_t - G_j) per channel
      T   = (I + L)^-1 Diag(beta),  W = T (K * exp(G)),  U = T V
      Delta = U - W S0          (the corrected values)
      O   = scale (Q * exp(G)) S0 + (scale Q K^T * Gamma * M) Delta
      S_C = exp(G_C) * S0 + (K * exp(G_C - G))^T Delta
    """
    C = q.shape[-2]
    mask = xp.tril_mask(C)
    strict = xp.tril_mask(C, diagonal=-1)
    qs = q * scale
    if G is None:
        kk = k @ k.mT
        qk = qs @ k.mT
        k_gated, q_gated, k_to_end, S_decayed = k, qs, k, S
    else:
        decay = pairwise_decay(xp, G, mask)
        kk = xp.sum(k[..., :, None, :] * k[..., None, :, :] * decay, axis=-1)
        qk = xp.sum(qs[..., :, None, :] * k[..., None, :, :] * decay, axis=-1)
        k_gated, q_gated = k * xp.exp(G), qs * xp.exp(G)
        k_to_end = k * xp.exp(G[..., -1:, :] - G)
        S_decayed = S * xp.exp(G[..., -1, :])[..., :, None]
    L = xp.where(strict, beta[..., :, None] * kk, 0.0)
    T = unit_lower_inverse(xp, L) * beta[..., None, :]
    W, U = T @ k_gated, T @ v
    delta = U - W @ S
    o = q_gated @ S + xp.where(mask, qk, 0.0) @ delta
    return o, S_decayed + k_to_end.mT @ delta


def chunkwise(
    xp: Any, T: int, chunk_size: int, step: Callable[[slice, Any], tuple[Array, Any]], state: Any
) -> tuple[Array, Any]:
    """Run ``step(span, state) -> (o_chunk [B, H, C, V], state)`` over the chunks; concatenate on time."""
    outputs = []
    for span in chunk_spans(T, chunk_size):
        o, state = step(span, state)
        outputs.append(o)
    return xp.concat(outputs, axis=-2), state
