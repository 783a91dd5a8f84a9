"""Triton kernels for RetNet retention (FORMULATIONS.md #3): ``chunkwise`` and ``recurrent``.

    S_t = exp(g) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)

with g [H] a per-head log decay (g <= 0). Conventions: q, k [B, T, H, K],
v and o [B, T, H, V], g [H], one dtype (fp16, bf16 or fp32); the state
S [B, H, K, V] is fp32 in and out; o is returned in the input dtype.

The chunkwise form runs in two passes, as flash-linear-attention's
chunk_simple_gla does:

1. ``_chunk_states_kernel``, grid (K blocks, V blocks, B*H): walks the chunks
   in order with the state tile in fp32 registers, writes the state before
   every chunk (fp32, [B, H, chunks, K, V]) and applies the chunk:
   S = exp(C g) S + sum_j k_j (exp((C-1-j) g) v_j)^T (C the chunk's length).
   This is the only sequential work.
2. ``_chunk_output_kernel``, grid (V blocks, chunks, B*H): every chunk at once,
   from the state S before it:
   o_i = scale sum_{j<=i} exp((i-j) g) (q_i.k_j) v_j + scale exp((i+1) g) q_i S.

Decays are applied in log space with every exponent <= 0, the masks applied
before the exponential: exp((i - j) g) for i >= j within a chunk, to the
state from the queries exp((i + 1) g) as a row factor after the dot (so q
stays an exact operand), and to the values exp((C - 1 - j) g) for the state
update. The state's own decay is applied as S + expm1(C g) S, and the
recurrent kernel's as S + expm1(g) S, because exp(g) rounded to fp32 next to
1 (g = log(1 - 2^-20) for RetNet's last heads) would bias S by 2^-25 per
step, 5e-4 relative after 16384 steps.

``precision`` and the fp32-operand dots are those of kernels/_dots.py:
"split" (default) carries the fp32 score block, state and decayed values as
hi + lo parts in the input dtype (two dots each); "round" rounds them once to
the input dtype (one dot each: the fast setting of ``SPEED_OPTIONS``, about
flash-linear-attention's accuracy); "tf32" and "ieee" use one fp32 dot of that
input_precision. Tiles are at least 32 wide (kernels/_dots.py, ``tile``); K is
covered in blocks of at most 64 (the output pass loops over them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.kernels._dots import PRECISIONS, dot_config, dot_f32_lowp, dot_lowp_f32, expm1, tile
from attnlab.kernels._util import block_size

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),
        "precision": ("split", PRECISIONS),
        "block_v": (None, (None, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
        "num_stages": (2, (1, 2, 3, 4)),
    },
    "recurrent": {
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
    },
}

# The fastest setting offered: the score block, state and decayed values rounded once to the input dtype.
SPEED_OPTIONS = {"chunkwise": {"precision": "round"}}


@triton.jit
def _chunk_states_kernel(
    k, v, g, initial_state, chunk_S, final_state,
    T, H, K, V, NT,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: key block pid_k and value block pid_v of head (b, h), decay g = g[h]. For chunk c of length C:
    #   chunk_S[c] = S;   then  S = exp(C g) S + K_c^T (exp((C-1-j) g) v_j)_j
    pid_k = tl.program_id(0)
    pid_v = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H

    cols = tl.arange(0, CHUNK)
    keys = pid_k * BK + tl.arange(0, BK)
    values = pid_v * BV + tl.arange(0, BV)
    key_ok = keys < K
    value_ok = values < V
    log_decay = tl.load(g + h).to(tl.float32)

    # K^T is loaded transposed, [BK, CHUNK]: column j is row j of k, H * K elements after row 0.
    kT_tile = keys[:, None] + cols[None, :] * (H * K)
    v_tile = cols[:, None] * (H * V) + values[None, :]
    k_chunk = (b.to(tl.int64) * T * H + h) * K  # element (b, chunk start, h, 0) of k, stepped per chunk
    v_chunk = (b.to(tl.int64) * T * H + h) * V
    S_tile = keys[:, None] * V + values[None, :]
    S_mask = key_ok[:, None] & value_ok[None, :]
    if HAS_INITIAL_STATE:
        S = tl.load(initial_state + pid_bh.to(tl.int64) * K * V + S_tile, mask=S_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    S_out = chunk_S + pid_bh.to(tl.int64) * NT * K * V
    for c in range(0, NT):
        tl.store(S_out + S_tile, S, mask=S_mask)
        length = tl.minimum(T - c * CHUNK, CHUNK)
        col_ok = cols < length
        kT = tl.load(k + k_chunk + kT_tile, mask=key_ok[:, None] & col_ok[None, :], other=0.0)
        v_c = tl.load(v + v_chunk + v_tile, mask=col_ok[:, None] & value_ok[None, :], other=0.0)
        # Columns past the chunk's length have v = 0; their exponent is clamped to 0, never positive.
        to_end = tl.exp(tl.where(col_ok, (length - 1 - cols).to(tl.float32), 0.0) * log_decay)
        S = S + expm1(length.to(tl.float32) * log_decay) * S
        S = dot_lowp_f32(kT, v_c.to(tl.float32) * to_end[:, None], S, PRECISION, RESCALE)
        S_out += K * V
        k_chunk += CHUNK * H * K
        v_chunk += CHUNK * H * V

    if STORE_FINAL_STATE:
        tl.store(final_state + pid_bh.to(tl.int64) * K * V + S_tile, S, mask=S_mask)


@triton.jit
def _chunk_output_kernel(
    q, k, v, g, o, chunk_S,
    T, H, K, V, NT, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: value block pid_v of chunk c of head (b, h), rows i, j; S the state before the chunk:
    #   o_i = scale sum_{j<=i} exp((i-j) g) (q_i.k_j) v_j + scale exp((i+1) g) q_i S
    pid_v = tl.program_id(0)
    c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H

    rows = tl.arange(0, CHUNK)
    values = pid_v * BV + tl.arange(0, BV)
    row_ok = rows < T - c * CHUNK
    value_ok = values < V
    log_decay = tl.load(g + h).to(tl.float32)

    start = b.to(tl.int64) * T + c * CHUNK  # the chunk's first row of batch b, as a row of [B*T]
    qk_chunk = (start * H + h) * K
    v_rows = (start * H + h) * V + rows[:, None] * (H * V) + values[None, :]
    v_mask = row_ok[:, None] & value_ok[None, :]
    state = (pid_bh.to(tl.int64) * NT + c) * K * V

    scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    from_state = tl.zeros([CHUNK, BV], dtype=tl.float32)
    for key_start in range(0, K, BK):
        keys = key_start + tl.arange(0, BK)
        key_ok = keys < K
        q_c = tl.load(q + qk_chunk + rows[:, None] * (H * K) + keys[None, :],
                      mask=row_ok[:, None] & key_ok[None, :], other=0.0)
        kT = tl.load(k + qk_chunk + keys[:, None] + rows[None, :] * (H * K),
                     mask=key_ok[:, None] & row_ok[None, :], other=0.0)
        S = tl.load(chunk_S + state + keys[:, None] * V + values[None, :],
                    mask=key_ok[:, None] & value_ok[None, :], other=0.0)
        scores = tl.dot(q_c, kT, scores, input_precision=INPUT_PRECISION)
        from_state = dot_lowp_f32(q_c, S, from_state, PRECISION, RESCALE)

    causal = rows[:, None] >= rows[None, :]
    distance = tl.where(causal, rows[:, None] - rows[None, :], 0).to(tl.float32)  # i - j, 0 above the diagonal
    A = tl.where(causal, scale * scores * tl.exp(distance * log_decay), 0.0)
    query_decay = scale * tl.exp((rows + 1).to(tl.float32) * log_decay)
    v_c = tl.load(v + v_rows, mask=v_mask, other=0.0)
    o_c = dot_f32_lowp(A, v_c, query_decay[:, None] * from_state, PRECISION, RESCALE)
    tl.store(o + v_rows, o_c.to(o.dtype.element_ty), mask=v_mask)


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
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """Chunkwise retention in two passes; see the module docstring for the options."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    input_precision, fp32_precision, rescale = dot_config(q.dtype, precision)
    final = _final_state(q, V, return_state)
    chunk_S = torch.empty(B, H, NT, K, V, dtype=torch.float32, device=q.device)
    BK, BV = tile(K, 64), tile(V, 64)
    _chunk_states_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        k, v, g, state[0] if state is not None else None, chunk_S, final,
        T, H, K, V, NT,
        CHUNK=chunk_size, BK=BK, BV=BV,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=4, num_stages=num_stages,
    )
    o = torch.empty_like(v)
    BK, BV = tile(K, 64), block_v if block_v is not None else tile(V, 64)
    _chunk_output_kernel[(triton.cdiv(V, BV), NT, B * H)](
        q, k, v, g, o, chunk_S,
        T, H, K, V, NT, scale,
        CHUNK=chunk_size, BK=BK, BV=BV,
        INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=num_warps, num_stages=num_stages,
    )
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
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """Token-by-token retention with the fp32 state in registers."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = block_v if block_v is not None else min(block_size(V), 32)
    o = torch.empty_like(v)
    final = _final_state(q, V, return_state)
    grid = (triton.cdiv(V, BV), B * H)
    _recurrent_kernel[grid](
        q, k, v, g, o, state[0] if state is not None else None, final,
        T, H, K, V, scale,
        BK=BK, BV=BV,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    )
    return o, ((final,) if return_state else None)
