"""Triton kernels for RetNet retention (FORMULATIONS.md 3): ``chunkwise`` and ``recurrent``.

    S_t = exp(g) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)

with g [H] a per-head log decay (g <= 0). Conventions: q, k [B, T, H, K],
v and o [B, T, H, V], g [H], one dtype (fp16, bf16 or fp32); the state
S [B, H, K, V] is fp32 in and out; o is returned in the input dtype.

Both kernels run on a grid of (V blocks, B*H): a program owns one V block of
one head's state in fp32 registers and loops over time. At the reference
shape (B=8, H=16, K=V=128, 64-row chunks) the fused chunkwise pass does about
6 MFLOP of tensor-core work per 64 KiB of q, k, v, o traffic and chunk (two
V blocks of 64), so it is memory-bound; a two-pass design (per-chunk states
written out, then an output pass parallel over chunks) would add a state of
K*V*4 = 64 KiB per chunk in fp32 to write and read back, doubling the
traffic, so states stay in registers instead. B*H*2 = 256 programs fill the
H100's 132 SMs; ``block_v`` trades parallelism against recomputing Q K^T.

Decays are applied in log space with every exponent <= 0, the masks applied
before the exponential: within a chunk exp((i - j) g) for i >= j, to the
state from the queries exp((i + 1) g) as a row factor after the dot (so q
stays an exact operand), and to the values exp((C - 1 - j) g) for the state
update (C the chunk's length). The state's own decay is applied as
S + expm1(C g) S, and the recurrent kernel's as S + expm1(g) S, because
exp(g) rounded to fp32 next to 1 (g = log(1 - 2^-20) for RetNet's last
heads) would bias S by 2^-25 per step, 5e-4 relative after 16384 steps.

``precision`` and the fp32-operand dots are linear_attn's (kernels/_numerics.py,
``dot_f32_lowp`` and ``dot_lowp_f32``): "split" (default) carries the fp32 score
block, state and decayed values as hi + lo parts in the input dtype (two dots
each), "tf32" and "ieee" use one fp32 dot of that input_precision.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels._numerics import INPUT_SPLIT_PRECISIONS, dot_f32_lowp, dot_lowp_f32, input_split_config
from attnlab.kernels._util import (
    Launch, block_size, default_block_v, gpu_shape_known_bad, launch_after_checks, no_pending_checks,
)

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),
        "precision": ("split", INPUT_SPLIT_PRECISIONS),
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
        "num_stages": (2, (1, 2, 3, 4)),
    },
    "recurrent": {
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
    },
}


@triton.jit
def expm1(x):
    """exp(x) - 1 in fp32 for x <= 0 without cancellation near 0 (a few ulps relative everywhere).

    Taylor to x^9 for x > -0.5 (truncation below 1e-9 relative), else exp(x) - 1 (|result| > 0.39).
    """
    taylor = x * (1.0 + x * (1.0 / 2 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (
        1.0 / 720 + x * (1.0 / 5040 + x * (1.0 / 40320 + x * (1.0 / 362880)))))))))
    return tl.where(x > -0.5, taylor, tl.exp(tl.minimum(x, 0.0)) - 1.0)


@triton.jit
def _chunkwise_kernel(
    q, k, v, g, o, initial_state, final_state,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: V block pid_v of head (b, h), decay g = g[h]. Per chunk of C rows i, j:
    #   o_i = scale sum_{j<=i} exp((i-j) g) (q_i.k_j) v_j + scale exp((i+1) g) q_i S
    #   S   = exp(C g) S + sum_j k_j (exp((C-1-j) g) v_j)^T
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H

    rows = tl.arange(0, CHUNK)
    keys = tl.arange(0, BK)
    values = pid_v * BV + tl.arange(0, BV)
    key_ok = keys < K
    value_ok = values < V

    log_decay = tl.load(g + h).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    distance = tl.where(causal, rows[:, None] - rows[None, :], 0).to(tl.float32)  # i - j, 0 above the diagonal
    query_decay = scale * tl.exp((rows + 1).to(tl.float32) * log_decay)

    # Within a chunk, row i of q and k is i * H * K elements after row 0 (int32 tiles, fixed);
    # the chunk's first row is a scalar int64 offset stepped per chunk, so no 64-bit tile is carried.
    qk_tile = rows[:, None] * (H * K) + keys[None, :]
    v_tile = rows[:, None] * (H * V) + values[None, :]
    qk_chunk = (b.to(tl.int64) * T * H + h) * K  # element (b, start, h, 0) of q and k
    v_chunk = (b.to(tl.int64) * T * H + h) * V
    S_offsets = pid_bh.to(tl.int64) * K * V + keys[:, None] * V + values[None, :]
    S_mask = key_ok[:, None] & value_ok[None, :]
    if HAS_INITIAL_STATE:
        S = tl.load(initial_state + S_offsets, mask=S_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for start in range(0, T, CHUNK):
        row_ok = rows < T - start
        qk_mask = row_ok[:, None] & key_ok[None, :]
        v_mask = row_ok[:, None] & value_ok[None, :]
        q_c = tl.load(q + qk_chunk + qk_tile, mask=qk_mask, other=0.0)
        k_c = tl.load(k + qk_chunk + qk_tile, mask=qk_mask, other=0.0)
        v_c = tl.load(v + v_chunk + v_tile, mask=v_mask, other=0.0)

        o_c = query_decay[:, None] * dot_lowp_f32(q_c, S, tl.zeros([CHUNK, BV], dtype=tl.float32), PRECISION, RESCALE)
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=INPUT_PRECISION)
        A = tl.where(causal, scale * scores * tl.exp(distance * log_decay), 0.0)
        o_c = dot_f32_lowp(A, v_c, o_c, PRECISION, RESCALE)
        tl.store(o + v_chunk + v_tile, o_c.to(o.dtype.element_ty), mask=v_mask)

        # Rows past the chunk's length have v = 0; their exponent is clamped to 0, never positive.
        length = tl.minimum(T - start, CHUNK)
        to_end = tl.exp(tl.where(rows < length, (length - 1 - rows).to(tl.float32), 0.0) * log_decay)
        S = dot_lowp_f32(tl.trans(k_c), v_c.to(tl.float32) * to_end[:, None], S + expm1(length.to(tl.float32) * log_decay) * S, PRECISION, RESCALE)
        qk_chunk += CHUNK * H * K
        v_chunk += CHUNK * H * V

    if STORE_FINAL_STATE:
        tl.store(final_state + S_offsets, S, mask=S_mask)


@triton.jit
def _recurrent_kernel(
    q, k, v, g, o, initial_state, final_state,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    # The literal recurrence, one token at a time, in fp32:
    #   S = S + expm1(g) S + k_t v_t^T,   o_t = S^T (scale q_t)
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H

    keys = tl.arange(0, BK)
    values = pid_v * BV + tl.arange(0, BV)
    key_ok = keys < K
    value_ok = values < V
    decay_minus_one = expm1(tl.load(g + h).to(tl.float32))

    S_offsets = pid_bh.to(tl.int64) * K * V + keys[:, None] * V + values[None, :]
    S_mask = key_ok[:, None] & value_ok[None, :]
    if HAS_INITIAL_STATE:
        S = tl.load(initial_state + S_offsets, mask=S_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    q_t = q + (b.to(tl.int64) * T * H + h) * K + keys
    k_t = k + (b.to(tl.int64) * T * H + h) * K + keys
    v_t = v + (b.to(tl.int64) * T * H + h) * V + values
    o_t = o + (b.to(tl.int64) * T * H + h) * V + values
    for _ in range(0, T):
        q_now = scale * tl.load(q_t, mask=key_ok, other=0.0).to(tl.float32)
        k_now = tl.load(k_t, mask=key_ok, other=0.0).to(tl.float32)
        v_now = tl.load(v_t, mask=value_ok, other=0.0).to(tl.float32)
        S += decay_minus_one * S + k_now[:, None] * v_now[None, :]
        out = tl.sum(q_now[:, None] * S, axis=0)
        tl.store(o_t, out.to(o.dtype.element_ty), mask=value_ok)
        q_t += H * K
        k_t += H * K
        v_t += H * V
        o_t += H * V

    if STORE_FINAL_STATE:
        tl.store(final_state + S_offsets, S, mask=S_mask)


def _final_state(q: torch.Tensor, V: int, return_state: bool) -> torch.Tensor | None:
    B, _, H, K = q.shape
    return torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if return_state else None


def chunkwise(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    state: tuple[torch.Tensor] | None,
    return_state: bool,
    chunk_size: int = 64,
    precision: str = "split",
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """Chunkwise retention in one fused pass; see the module docstring for the options."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V):
        return recurrent(q=q, k=k, v=v, g=g, scale=scale, state=state, return_state=return_state,
                         await_checks=await_checks)
    BK = block_size(K)
    BV = default_block_v(V, BK, block_v)
    input_precision, fp32_precision, rescale = input_split_config(q.dtype, precision)
    o = torch.empty_like(v)
    final = _final_state(q, V, return_state)
    grid = (triton.cdiv(V, BV), B * H)
    launch_after_checks(await_checks, Launch(
        _chunkwise_kernel, grid,
        q, k, v, g, o, state[0] if state is not None else None, final,
        T, H, K, V, scale,
        CHUNK=chunk_size, BK=BK, BV=BV,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=num_warps, num_stages=num_stages,
    ))
    return o, ((final,) if return_state else None)


def recurrent(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    state: tuple[torch.Tensor] | None,
    return_state: bool,
    block_v: int | None = None,
    num_warps: int = 4,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """Token-by-token retention with the fp32 state in registers."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = block_v if block_v is not None else min(block_size(V), 32)
    o = torch.empty_like(v)
    final = _final_state(q, V, return_state)
    grid = (triton.cdiv(V, BV), B * H)
    launch_after_checks(await_checks, Launch(
        _recurrent_kernel, grid,
        q, k, v, g, o, state[0] if state is not None else None, final,
        T, H, K, V, scale,
        BK=BK, BV=BV,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    ))
    return o, ((final,) if return_state else None)
