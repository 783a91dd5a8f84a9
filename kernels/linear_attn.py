"""Triton kernels for linear attention (FORMULATIONS.md 2): ``chunkwise`` and ``recurrent``.

    S_t = S_{t-1} + phi(k_t) v_t^T,   z_t = z_{t-1} + phi(k_t)
    o_t = phi(q_t)^T S_t / phi(q_t)^T z_t    (normalize=True)
    o_t = scale phi(q_t)^T S_t               (normalize=False)

phi is elu(x)+1 ("elu1", evaluated in fp32 inside the kernels) or the
identity. Conventions: q, k [B, T, H, K], v and o [B, T, H, V], one dtype
(fp16, bf16 or fp32); the state (S [B, H, K, V], z [B, H, K]) is fp32 in and
out; o is returned in the input dtype. Grids are (V blocks, B*H): every
program owns one V block of one head's state and loops over time, keeping its
state in fp32 registers; the V blocks of a head recompute the same z.

Numerics of the chunkwise kernel (the knobs are ``OPTIONS``):

- Within a chunk the score block A = tril(phi(Q) phi(K)^T) is formed in fp32
  and kept there; the output is A V + phi(Q) S (over the denominator
  rowsum(A) + phi(Q) z when normalized). A and S are fp32 operands of
  tensor-core dots, so ``precision`` decides how they enter them
  (kernels/_numerics.py, ``dot_f32_lowp`` and its siblings):
  "split" (default) writes each as hi + lo in the input dtype and does two
  dots (the fp32 operand is carried to ~2^-16 relative in bf16, ~2^-22 in
  fp16: no intermediate is rounded to the input dtype; fp16 tiles are first
  scaled per row or column to a peak of 16384, so that states above fp16's
  65504 cannot overflow);
  "tf32" does one tf32 dot (operands rounded to 10 mantissa bits: about 1/8
  of bf16's rounding, comparable to fp16's); "ieee" one exact fp32 dot
  (slow, the accuracy reference). fp32 inputs always use "ieee" unless
  "tf32" is asked for.
- phi(q), phi(k) of elu1 are not exact input-dtype values.
  ``feature_precision="split"`` (default) keeps them in fp32 as hi + lo
  (three dots for phi(Q) phi(K)^T and phi(Q) S, two for phi(K)^T V: about
  1.8x the tensor-core work). "round" rounds them once to the input dtype
  and uses those same rounded values in numerator, denominator and z, so the
  kernel computes the exact function of slightly perturbed features: over
  many keys the perturbation averages to about u / sqrt(K) relative, a small
  fraction of the output's rounding floor, but with few keys and features it
  does not average, and the excess goes well over the bound (a property-suite
  counterexample at T=1, K=7: properties/regressions.py). The identity
  feature map needs neither (its features are the inputs).

Measurements behind these choices (emulated excess): reports/bench.md,
"Design history moved from the kernel docstrings".
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels._numerics import (
    INPUT_SPLIT_PRECISIONS, dot_f32_f32, dot_f32_lowp, dot_lowp_f32, input_split_config,
)
from attnlab.kernels._util import (
    Launch, block_size, default_block_v, gpu_shape_known_bad, launch_after_checks, no_pending_checks,
)

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),
        "precision": ("split", INPUT_SPLIT_PRECISIONS),
        "feature_precision": ("split", ("round", "split")),
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
def elu1(x):
    """elu(x) + 1 in fp32: x + 1 for x > 0, exp(x) otherwise (the exponent is clamped to <= 0)."""
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _chunkwise_kernel(
    q, k, v, o,
    initial_S, initial_z, final_S, final_z,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, FP32_FEATURES: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: V block pid_v of head (b, h). Per chunk of rows i, j (features fq = phi(q), fk = phi(k)):
    #   A   = tril(fq fk^T)                               (fp32)
    #   num = A v + fq S,   den = rowsum(A) + fq . z      (S, z: the state before the chunk)
    #   o   = num / den  (normalize)  or  scale * num
    #   S  += fk^T v,   z += colsum(fk)
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    dtype = q.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    keys = tl.arange(0, BK)
    values = pid_v * BV + tl.arange(0, BV)
    key_ok = keys < K
    value_ok = values < V
    causal = rows[:, None] >= rows[None, :]

    # Within a chunk, row i of q and k is i * H * K elements after row 0 (int32 tiles, fixed);
    # the chunk's first row is a scalar int64 offset stepped per chunk, so no 64-bit tile is carried.
    qk_tile = rows[:, None] * (H * K) + keys[None, :]
    v_tile = rows[:, None] * (H * V) + values[None, :]
    qk_chunk = (b.to(tl.int64) * T * H + h) * K  # element (b, start, h, 0) of q and k
    v_chunk = (b.to(tl.int64) * T * H + h) * V
    S_offsets = pid_bh.to(tl.int64) * K * V + keys[:, None] * V + values[None, :]
    S_mask = key_ok[:, None] & value_ok[None, :]
    z_offsets = pid_bh.to(tl.int64) * K + keys
    if HAS_INITIAL_STATE:
        S = tl.load(initial_S + S_offsets, mask=S_mask, other=0.0)
        z = tl.load(initial_z + z_offsets, mask=key_ok, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)

    for start in range(0, T, CHUNK):
        row_ok = rows < T - start
        qk_mask = row_ok[:, None] & key_ok[None, :]
        v_mask = row_ok[:, None] & value_ok[None, :]
        q_c = tl.load(q + qk_chunk + qk_tile, mask=qk_mask, other=0.0)
        k_c = tl.load(k + qk_chunk + qk_tile, mask=qk_mask, other=0.0)
        v_c = tl.load(v + v_chunk + v_tile, mask=v_mask, other=0.0)
        if ELU1:
            # phi(0) = 1: padded rows and key columns must be zeroed after the map.
            fq = tl.where(qk_mask, elu1(q_c.to(tl.float32)), 0.0)
            fk = tl.where(qk_mask, elu1(k_c.to(tl.float32)), 0.0)
            if not FP32_FEATURES:
                fq = fq.to(dtype)
                fk = fk.to(dtype)
        else:
            fq = q_c
            fk = k_c

        zeros = tl.zeros([CHUNK, BV], dtype=tl.float32)
        if FP32_FEATURES:
            A = dot_f32_f32(fq, tl.trans(fk), tl.zeros([CHUNK, CHUNK], dtype=tl.float32), dtype, PRECISION, RESCALE)
            numerator = dot_f32_f32(fq, S, zeros, dtype, PRECISION, RESCALE)
        else:
            A = tl.dot(fq, tl.trans(fk), input_precision=INPUT_PRECISION)
            numerator = dot_lowp_f32(fq, S, zeros, PRECISION, RESCALE)
        A = tl.where(causal, A, 0.0)
        numerator = dot_f32_lowp(A, v_c, numerator, PRECISION, RESCALE)
        if NORMALIZE:
            denominator = tl.sum(A, axis=1) + tl.sum(fq.to(tl.float32) * z[None, :], axis=1)
            o_c = numerator / tl.where(row_ok, denominator, 1.0)[:, None]
        else:
            o_c = scale * numerator
        tl.store(o + v_chunk + v_tile, o_c.to(o.dtype.element_ty), mask=v_mask)

        if FP32_FEATURES:
            S = dot_f32_lowp(tl.trans(fk), v_c, S, PRECISION, RESCALE)
        else:
            S = tl.dot(tl.trans(fk), v_c, S, input_precision=INPUT_PRECISION)
        z += tl.sum(fk.to(tl.float32), axis=0)
        qk_chunk += CHUNK * H * K
        v_chunk += CHUNK * H * V

    if STORE_FINAL_STATE:
        tl.store(final_S + S_offsets, S, mask=S_mask)
        tl.store(final_z + z_offsets, z, mask=key_ok & (pid_v == 0))


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
    feature_precision: str = "split",
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Chunkwise linear attention; see the module docstring for the options."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V):
        return recurrent(q=q, k=k, v=v, scale=scale, feature_map=feature_map, normalize=normalize, state=state,
                         return_state=return_state, await_checks=await_checks)
    BK = block_size(K)
    BV = default_block_v(V, BK, block_v)
    input_precision, fp32_precision, rescale = input_split_config(q.dtype, precision)
    o = torch.empty_like(v)
    initial_S, initial_z, final_S, final_z = _state_buffers(q, V, state, return_state)
    grid = (triton.cdiv(V, BV), B * H)
    launch_after_checks(await_checks, Launch(
        _chunkwise_kernel, grid,
        q, k, v, o, initial_S, initial_z, final_S, final_z,
        T, H, K, V, scale,
        CHUNK=chunk_size, BK=BK, BV=BV,
        ELU1=feature_map == "elu1", NORMALIZE=normalize,
        FP32_FEATURES=feature_map == "elu1" and feature_precision == "split" and q.dtype != torch.float32,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=num_warps, num_stages=num_stages,
    ))
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
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Token-by-token linear attention with the fp32 state in registers."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = block_v if block_v is not None else min(block_size(V), 32)
    o = torch.empty_like(v)
    initial_S, initial_z, final_S, final_z = _state_buffers(q, V, state, return_state)
    grid = (triton.cdiv(V, BV), B * H)
    launch_after_checks(await_checks, Launch(
        _recurrent_kernel, grid,
        q, k, v, o, initial_S, initial_z, final_S, final_z,
        T, H, K, V, scale,
        BK=BK, BV=BV,
        ELU1=feature_map == "elu1", NORMALIZE=normalize,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    ))
    return o, ((final_S, final_z) if return_state else None)
