"""Triton kernels for linear attention (FORMULATIONS.md #2): ``chunkwise`` and ``recurrent``.

    S_t = S_{t-1} + phi(k_t) v_t^T,   z_t = z_{t-1} + phi(k_t)
    o_t = phi(q_t)^T S_t / phi(q_t)^T z_t    (normalize=True)
    o_t = scale phi(q_t)^T S_t               (normalize=False)

phi is elu(x)+1 ("elu1", evaluated in fp32 inside the kernels) or the
identity. Conventions: q, k [B, T, H, K], v and o [B, T, H, V], one dtype
(fp16, bf16 or fp32); the state (S [B, H, K, V], z [B, H, K]) is fp32 in and
out; o is returned in the input dtype.

The chunkwise form runs in two passes, as flash-linear-attention does:

1. ``_chunk_states_kernel``, grid (K blocks, V blocks, B*H): walks the chunks
   in order with the state tile in fp32 registers, writes the state before
   every chunk (fp32, [B, H, chunks, K, V], and z [B, H, chunks, K]) and adds
   the chunk's phi(K)^T V (one exact tensor-core dot: both operands are in
   the input dtype, accumulated in fp32). This is the only sequential work.
2. ``_chunk_output_kernel``, grid (V blocks, chunks, B*H): every chunk at once,
   from the state before it: with A = tril(phi(Q) phi(K)^T) in fp32,
   o = (A V + phi(Q) S) / (rowsum(A) + phi(Q) z), or scale (A V + phi(Q) S).

Numerics (the knobs are ``OPTIONS``):

- A and S are fp32 operands of tensor-core dots; ``precision`` decides how
  they enter them (kernels/_dots.py): "split" (default) as hi + lo in the
  input dtype, two dots each, no intermediate rounded to the input dtype;
  "round" rounds them once to the input dtype (one dot each, the fast
  setting of ``SPEED_OPTIONS``, about as accurate as flash-linear-attention:
  the output is an average over many values, so one rounding of every weight
  adds about one more rounding floor in quadrature, excess ~1.4-1.6 in
  bf16); "tf32" one tf32 dot (operands to 10 mantissa bits); "ieee" one
  exact fp32 dot (slow, the accuracy reference). fp32 inputs always use
  "ieee" unless "tf32" is asked for.
- phi(q), phi(k) of elu1 are not exact input-dtype values.
  ``feature_precision="round"`` (default) rounds them once to the input
  dtype and uses those same rounded values in numerator, denominator and z,
  so the kernel computes the exact function of slightly perturbed features:
  the output is an average over many keys and the perturbation costs about
  u / sqrt(K) relative (measured in float64 emulation: 0.15-0.2 of the
  rounding floor at K=128, 0.35-0.55 at K=16, adding in quadrature: excess
  +2% at K=128). "split" keeps them in fp32 as hi + lo (three dots for
  phi(Q) phi(K)^T and phi(Q) S, two for phi(K)^T V).
- Tiles are at least 32 wide (kernels/_dots.py, ``tile``); K is covered in
  blocks of at most 64 (the output pass loops over them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.kernels._dots import PRECISIONS, dot_config, dot_f32_f32, dot_f32_lowp, dot_lowp_f32, expm1, tile
from attnlab.kernels._util import block_size

__all__ = ["OPTIONS", "SPEED_OPTIONS", "chunkwise", "recurrent", "expm1"]

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),
        "precision": ("split", PRECISIONS),
        "feature_precision": ("round", ("round", "split")),
        "block_v": (None, (None, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
        "num_stages": (2, (1, 2, 3, 4)),
    },
    "recurrent": {
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
    },
}

# The fastest setting offered: A and S rounded once to the input dtype before their dots.
SPEED_OPTIONS = {"chunkwise": {"precision": "round"}}


@triton.jit
def elu1(x):
    """elu(x) + 1 in fp32: x + 1 for x > 0, exp(x) otherwise (the exponent is clamped to <= 0)."""
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _features(x, mask, ELU1: tl.constexpr, FP32_FEATURES: tl.constexpr):
    """phi(x) of a loaded tile: elu1 in fp32 (zero where masked, since phi(0) = 1), rounded to x's dtype
    unless FP32_FEATURES; the identity leaves x as loaded."""
    if ELU1:
        f = tl.where(mask, elu1(x.to(tl.float32)), 0.0)
        if not FP32_FEATURES:
            f = f.to(x.dtype)
        return f
    else:
        return x


@triton.jit
def _chunk_states_kernel(
    k, v, initial_S, initial_z, chunk_S, chunk_z, final_S, final_z,
    T, H, K, V, NT,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, FP32_FEATURES: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: key block pid_k and value block pid_v of head (b, h). For chunk c = 0, 1, ...:
    #   chunk_S[c] = S,  chunk_z[c] = z;   then  S += phi(K_c)^T V_c,  z += colsum(phi(K_c))
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

    # phi(K)^T is loaded transposed, [BK, CHUNK]: column j is row j of k, H * K elements after row 0.
    kT_tile = keys[:, None] + cols[None, :] * (H * K)
    v_tile = cols[:, None] * (H * V) + values[None, :]
    k_chunk = (b.to(tl.int64) * T * H + h) * K  # element (b, chunk start, h, 0) of k, stepped per chunk
    v_chunk = (b.to(tl.int64) * T * H + h) * V
    S_tile = keys[:, None] * V + values[None, :]
    S_mask = key_ok[:, None] & value_ok[None, :]
    z_mask = key_ok & (pid_v == 0)  # the V blocks of a head compute the same z; the first one writes it
    if HAS_INITIAL_STATE:
        S = tl.load(initial_S + pid_bh.to(tl.int64) * K * V + S_tile, mask=S_mask, other=0.0)
        z = tl.load(initial_z + pid_bh.to(tl.int64) * K + keys, mask=key_ok, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)

    S_out = chunk_S + pid_bh.to(tl.int64) * NT * K * V
    z_out = chunk_z + pid_bh.to(tl.int64) * NT * K
    for c in range(0, NT):
        tl.store(S_out + S_tile, S, mask=S_mask)
        if NORMALIZE:
            tl.store(z_out + keys, z, mask=z_mask)
        col_ok = cols < T - c * CHUNK
        kT_mask = key_ok[:, None] & col_ok[None, :]
        kT = tl.load(k + k_chunk + kT_tile, mask=kT_mask, other=0.0)
        v_c = tl.load(v + v_chunk + v_tile, mask=col_ok[:, None] & value_ok[None, :], other=0.0)
        fkT = _features(kT, kT_mask, ELU1, FP32_FEATURES)
        if FP32_FEATURES:
            S = dot_f32_lowp(fkT, v_c, S, PRECISION, RESCALE)
        else:
            S = tl.dot(fkT, v_c, S, input_precision=INPUT_PRECISION)
        z += tl.sum(fkT.to(tl.float32), axis=1)  # part of the returned state even when not normalizing
        S_out += K * V
        z_out += K
        k_chunk += CHUNK * H * K
        v_chunk += CHUNK * H * V

    if STORE_FINAL_STATE:
        tl.store(final_S + pid_bh.to(tl.int64) * K * V + S_tile, S, mask=S_mask)
        tl.store(final_z + pid_bh.to(tl.int64) * K + keys, z, mask=z_mask)


@triton.jit
def _chunk_output_kernel(
    q, k, v, o, chunk_S, chunk_z,
    T, H, K, V, NT, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, FP32_FEATURES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: value block pid_v of chunk c of head (b, h), rows i, j; S, z the state before the chunk:
    #   A = tril(fq fk^T)  (fp32),  num = A v + fq S,  den = rowsum(A) + fq . z
    #   o = num / den  (normalize)  or  scale * num
    pid_v = tl.program_id(0)
    c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    dtype = q.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    values = pid_v * BV + tl.arange(0, BV)
    row_ok = rows < T - c * CHUNK
    value_ok = values < V

    start = b.to(tl.int64) * T + c * CHUNK  # the chunk's first row of batch b, as a row of [B*T]
    qk_chunk = (start * H + h) * K
    v_rows = (start * H + h) * V + rows[:, None] * (H * V) + values[None, :]
    v_mask = row_ok[:, None] & value_ok[None, :]
    state = pid_bh.to(tl.int64) * NT + c

    A = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    numerator = tl.zeros([CHUNK, BV], dtype=tl.float32)
    query_dot_z = tl.zeros([CHUNK], dtype=tl.float32)
    for key_start in range(0, K, BK):
        keys = key_start + tl.arange(0, BK)
        key_ok = keys < K
        q_mask = row_ok[:, None] & key_ok[None, :]
        kT_mask = key_ok[:, None] & row_ok[None, :]
        q_c = tl.load(q + qk_chunk + rows[:, None] * (H * K) + keys[None, :], mask=q_mask, other=0.0)
        kT = tl.load(k + qk_chunk + keys[:, None] + rows[None, :] * (H * K), mask=kT_mask, other=0.0)
        S = tl.load(chunk_S + state * K * V + keys[:, None] * V + values[None, :],
                    mask=key_ok[:, None] & value_ok[None, :], other=0.0)
        fq = _features(q_c, q_mask, ELU1, FP32_FEATURES)
        fkT = _features(kT, kT_mask, ELU1, FP32_FEATURES)
        if FP32_FEATURES:
            A = dot_f32_f32(fq, fkT, A, dtype, PRECISION, RESCALE)
            numerator = dot_f32_f32(fq, S, numerator, dtype, PRECISION, RESCALE)
        else:
            A = tl.dot(fq, fkT, A, input_precision=INPUT_PRECISION)
            numerator = dot_lowp_f32(fq, S, numerator, PRECISION, RESCALE)
        if NORMALIZE:
            z = tl.load(chunk_z + state * K + keys, mask=key_ok, other=0.0)
            query_dot_z += tl.sum(fq.to(tl.float32) * z[None, :], axis=1)

    A = tl.where(rows[:, None] >= rows[None, :], A, 0.0)
    v_c = tl.load(v + v_rows, mask=v_mask, other=0.0)
    numerator = dot_f32_lowp(A, v_c, numerator, PRECISION, RESCALE)
    if NORMALIZE:
        # Padded rows have A = 0 and fq = 0: their denominator is replaced by 1 (they are not stored).
        o_c = numerator / tl.where(row_ok, tl.sum(A, axis=1) + query_dot_z, 1.0)[:, None]
    else:
        o_c = scale * numerator
    tl.store(o + v_rows, o_c.to(o.dtype.element_ty), mask=v_mask)


@triton.jit
def _recurrent_kernel(
    q, k, v, o,
    initial_S, initial_z, final_S, final_z,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    # The literal recurrence, one token at a time, everything in fp32:
    #   S += phi(k_t) v_t^T,  z += phi(k_t),  o_t = phi(q_t)^T S / phi(q_t)^T z  or  scale phi(q_t)^T S
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H

    keys = tl.arange(0, BK)
    values = pid_v * BV + tl.arange(0, BV)
    key_ok = keys < K
    value_ok = values < V

    S_offsets = pid_bh.to(tl.int64) * K * V + keys[:, None] * V + values[None, :]
    S_mask = key_ok[:, None] & value_ok[None, :]
    z_offsets = pid_bh.to(tl.int64) * K + keys
    if HAS_INITIAL_STATE:
        S = tl.load(initial_S + S_offsets, mask=S_mask, other=0.0)
        z = tl.load(initial_z + z_offsets, mask=key_ok, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)

    q_t = q + (b.to(tl.int64) * T * H + h) * K + keys
    k_t = k + (b.to(tl.int64) * T * H + h) * K + keys
    v_t = v + (b.to(tl.int64) * T * H + h) * V + values
    o_t = o + (b.to(tl.int64) * T * H + h) * V + values
    for _ in range(0, T):
        fq = tl.load(q_t, mask=key_ok, other=0.0).to(tl.float32)
        fk = tl.load(k_t, mask=key_ok, other=0.0).to(tl.float32)
        if ELU1:
            fq = tl.where(key_ok, elu1(fq), 0.0)
            fk = tl.where(key_ok, elu1(fk), 0.0)
        v_now = tl.load(v_t, mask=value_ok, other=0.0).to(tl.float32)
        S += fk[:, None] * v_now[None, :]
        z += fk
        numerator = tl.sum(fq[:, None] * S, axis=0)
        if NORMALIZE:
            out = numerator / tl.sum(fq * z, axis=0)
        else:
            out = scale * numerator
        tl.store(o_t, out.to(o.dtype.element_ty), mask=value_ok)
        q_t += H * K
        k_t += H * K
        v_t += H * V
        o_t += H * V

    if STORE_FINAL_STATE:
        tl.store(final_S + S_offsets, S, mask=S_mask)
        tl.store(final_z + z_offsets, z, mask=key_ok & (pid_v == 0))


def _state_buffers(q: torch.Tensor, V: int, state, return_state: bool):
    B, _, H, K = q.shape
    initial_S, initial_z = state if state is not None else (None, None)
    final_S = final_z = None
    if return_state:
        final_S = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device)
        final_z = torch.empty(B, H, K, dtype=torch.float32, device=q.device)
    return initial_S, initial_z, final_S, final_z


def chunkwise(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    feature_map: str,
    normalize: bool,
    state: tuple[torch.Tensor, torch.Tensor] | None,
    return_state: bool,
    chunk_size: int = 64,
    precision: str = "split",
    feature_precision: str = "round",
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Chunkwise linear attention in two passes; see the module docstring for the options."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = triton.cdiv(T, chunk_size)
    input_precision, fp32_precision, rescale = dot_config(q.dtype, precision)
    flags = dict(
        ELU1=feature_map == "elu1", NORMALIZE=normalize,
        FP32_FEATURES=feature_map == "elu1" and feature_precision == "split" and q.dtype != torch.float32,
        INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
    )
    initial_S, initial_z, final_S, final_z = _state_buffers(q, V, state, return_state)
    chunk_S = torch.empty(B, H, NT, K, V, dtype=torch.float32, device=q.device)
    chunk_z = torch.empty(B, H, NT, K, dtype=torch.float32, device=q.device)
    BK, BV = tile(K, 64), tile(V, 64)
    _chunk_states_kernel[(triton.cdiv(K, BK), triton.cdiv(V, BV), B * H)](
        k, v, initial_S, initial_z, chunk_S, chunk_z, final_S, final_z,
        T, H, K, V, NT,
        CHUNK=chunk_size, BK=BK, BV=BV,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state, **flags,
        num_warps=4, num_stages=num_stages,
    )
    o = torch.empty_like(v)
    BK, BV = tile(K, 64), block_v if block_v is not None else tile(V, 64)
    _chunk_output_kernel[(triton.cdiv(V, BV), NT, B * H)](
        q, k, v, o, chunk_S, chunk_z,
        T, H, K, V, NT, scale,
        CHUNK=chunk_size, BK=BK, BV=BV, **flags,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, ((final_S, final_z) if return_state else None)


def recurrent(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    feature_map: str,
    normalize: bool,
    state: tuple[torch.Tensor, torch.Tensor] | None,
    return_state: bool,
    block_v: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Token-by-token linear attention with the fp32 state in registers."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = block_v if block_v is not None else min(block_size(V), 32)
    o = torch.empty_like(v)
    initial_S, initial_z, final_S, final_z = _state_buffers(q, V, state, return_state)
    grid = (triton.cdiv(V, BV), B * H)
    _recurrent_kernel[grid](
        q, k, v, o, initial_S, initial_z, final_S, final_z,
        T, H, K, V, scale,
        BK=BK, BV=BV,
        ELU1=feature_map == "elu1", NORMALIZE=normalize,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    )
    return o, ((final_S, final_z) if return_state else None)
