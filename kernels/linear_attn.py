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
- phi(q), phi(k) of elu1 are not exact input-dtype values;
  ``feature_precision`` says how they enter the dots. "auto" (default) is
  "fp16" for bf16 inputs, "split" for fp16 and exact fp32 features for fp32
  ("split" and "round" change nothing there; "fp16" applies when named).
  "fp16" rounds each feature row once to fp16, scaled by a power of two
  (``_numerics.fp16_rows``: the row's peak into [2^14, 2^15), so elu1's
  unbounded x + 1, up to bf16's 3e38, cannot overflow, and features down to
  2^-28 of the row's peak keep 11 bits instead of falling into fp16's
  subnormals); with fq = diag(2^a) fq16, fk = diag(2^b) fk16 (a power of two
  per row), A = diag(2^a) (fq16 fk16^T) diag(2^b) is one fp16 dot (exact
  products); fq S takes
  the fp32 state as fp16 hi + lo scaled per column by a power of two
  (``dot_fp16_rows_f32``, two dots, S to ~2^-22); A v stays the input-dtype
  split above (with "tf32" or "ieee" fq S is one fp32 dot at that precision,
  exact on fq for both); the state update and z take the rounded fk's exact
  fp32 values (fp16's 11 bits are a bf16 hi + lo exactly, so fk^T v is two
  exact bf16 dots into S, with no scaling of v). The same rounded features in
  numerator, denominator, S and z: the kernel computes the exact function of
  features perturbed by at most 2^-11 relative, 1/8 of bf16's rounding, so
  even with few keys and features, where it does not average, the bf16 excess
  stays near 1 (the T=1, K=7 regression of properties/regressions.py 1.00, the
  worst of 240 small draws 1.009, on the CPU with bf16's roundings). Seven
  dots a chunk (14 wgmma) against split's ten; on fp16 inputs the rounding is
  the output's own, as "round" (a speed setting there).
  "split" keeps the features in fp32 as hi + lo (three dots for phi(Q)
  phi(K)^T and phi(Q) S, two for phi(K)^T V: about 1.8x the tensor-core work;
  its sm_90 ptxas spills stay above 0.5 KB a thread at every V block and warp
  count tried, K = V = 128, bf16). "round" rounds them once to the input dtype
  and uses those same rounded values in numerator, denominator and z, so the
  kernel computes the exact function of slightly perturbed features: over many
  keys the perturbation averages to about u / sqrt(K) relative, a small
  fraction of the output's rounding floor, but with few keys and features it
  does not average, and the excess goes well over the bound (a property-suite
  counterexample at T=1, K=7: properties/regressions.py); unscaled, fp16
  features below 6e-5 go subnormal. The identity feature map needs none of
  these (its features are the inputs).

Measurements behind these choices (emulated excess): reports/bench.md,
"Design history moved from the kernel docstrings".

Backward (``BACKWARD``; attnlab.kernel's autograd node). With fq = phi(q),
fk = phi(k), num_t = S_t^T fq_t, den_t = fq_t . z_t, the output's weight
w_t = 1 / den_t (normalized) or scale, and do_o_t = do_t . o_t (0 when not
normalized), the cotangents of num_t and den_t are w_t do_t and -w_t do_o_t
(the quotient rule), and the state's cotangents run backwards from the final
state's (d_state, or zero):

    dS_{t-1} = dS_t + w_t fq_t do_t^T,      dz_{t-1} = dz_t - w_t do_o_t fq_t
    dfq_t = w_t (S_t do_t - do_o_t z_t)
    dfk_t = dS_t v_t + dz_t,                dv_t = dS_t^T fk_t
    dq = dfq phi'(q),  dk = dfk phi'(k)     (elu1: phi' = 1 for x > 0, else exp(x))

and the initial state's gradient is (dS_0, dz_0). dfq_t cancels: fq_t . dfq_t
= 0 (o_t is a weighted mean of the values), its terms several times its size.
So do_o there must come from an unrounded o (o rounded to fp16 alone measured
dq at 2x its rounding floor), formed from the same quantities as S_t do_t so
that the cancellation holds in their rounding too; w multiplies the
difference, and divides (1 / den then a product would round twice). dk's dz
term uses do . o of the returned o (o carried to ~22 bits there measured dk 1.00,
the fp16 o 1.01). Nothing is gated: no exponent appears but phi's and
phi''s, exp(min(x, 0)).

- ``chunkwise``: the forward saves den per row (fp32, when normalized) and
  nothing else (o comes from the wrapper). The backward recomputes S and z
  at every chunk's start (fp32 [B, H, chunks, K, V], by the forward's own
  operations), as fla does: saving them in the forward made its registers
  spill on sm_90 (4 -> 120 bytes per thread, K = V = 128, bf16) and would
  hold K V / C fp32 per token and head (4x o's bf16 bytes at C = 64) from
  the forward to the backward; recomputing reads k and v once more. So
  the backward's chunks are its own where nothing ties them to the
  forward's: 128 rows on unnormalized input-tile features (half the chunk
  states, and their traffic, of the forward's 64), the forward's chunk_size
  where normalized (den, saved, must be the recomputed states' own to the
  last bit) or on elu1's fp32 features (128 rows spill). Then:
  do . o per row (normalized); a reverse pass over chunks per (V block,
  head) that writes dS, dz after every chunk and returns (dS_0, dz_0); and
  every chunk in parallel: dv per (V block, chunk, head), and dq, dk per
  (chunk, head), all of K, looping over V blocks (_chunk_query_key_kernel,
  which forms do . num from its own tiles, do v^T and do S^T, for dq). Dots
  take the forward's ``precision`` and ``feature_precision`` (do, v and the
  identity's q, k are exact input tiles; A, elu1's features, the states and
  their cotangents fp32 operands), so "round" features differentiate the
  rounded features' function (a speed setting: dq measured 2.2x its floor in
  fp16 at T=40, K=16). "fp16" features are, in the backward, the forward's
  rounded features held exactly in fp32 and multiplied as "split" features
  (``features``): the function of the rounded features again, and the
  recomputed states are the forward's own (its state update already took
  their fp32 values), so den matches them.
- ``recurrent``: saves nothing; two sequential sweeps per (V block, head),
  every sum in fp32 and compensated (Kahan: a running sum of T terms keeps
  ~1 rounding instead of ~sqrt(T), measured fp32 dq 5.2 -> 3.9, dS_0 5.0 ->
  0.7): forward for S_t, z_t, the parts of S_t do_t and do . num_t per V
  block (summed on the host into dq), then reverse for dk, dv and the state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels._numerics import (
    INPUT_SPLIT_PRECISIONS, dot_f32_f32, dot_f32_lowp, dot_fp16_rows_f32, dot_lowp_f32, fp16_rows, input_split_config,
)
from attnlab.kernels._util import (
    Launch, block_size, default_block_v, gpu_shape_known_bad, launch_after_checks, no_pending_checks, state_block,
)
from attnlab.runtime import interpreter_active

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),
        "precision": ("split", INPUT_SPLIT_PRECISIONS),
        "feature_precision": ("auto", ("auto", "fp16", "split", "round")),
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
        "num_stages": (2, (1, 2, 3, 4)),
    },
    "recurrent": {
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
    },
}

# The chunkwise kernels' smallest V tile on the GPU: at V tiles of 32 their sm_90 builds (triton 3.6) made illegal
# memory accesses (K = 64, V = 32, 4 warps; K = 128, 8 warps), as the delta rules' products of in-register tiles
# with [C, 32] ones did (reports/bench.md); 64 and 128 are right. The interpreter keeps every tile.
GPU_MIN_BLOCK_V = 64


# The chunkwise backward's chunk where nothing ties it to the forward's (see _backward_chunk). Its query/key
# kernel holds three [chunk, K] fp32 accumulators beside the [chunk, chunk] scores: at 128 rows it spills
# 0.3 KB a thread on input tiles, 3.9 KB on elu1's fp32 features (sm_90 ptxas, K = V = 128, bf16, 8 warps).
UNTIED_BACKWARD_CHUNK = 128


@triton.jit
def elu1(x):
    """elu(x) + 1 in fp32: x + 1 for x > 0, exp(x) otherwise (the exponent is clamped to <= 0)."""
    return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def _chunkwise_kernel(
    q, k, v, o,
    initial_S, initial_z, final_S, final_z,
    saved_den,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, FEATURES: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    SAVE_DEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: V block pid_v of head (b, h). Per chunk of rows i, j (features fq = phi(q), fk = phi(k)):
    #   A   = tril(fq fk^T)                               (fp32)
    #   num = A v + fq S,   den = rowsum(A) + fq . z      (S, z: the state before the chunk)
    #   o   = num / den  (normalize)  or  scale * num
    #   S  += fk^T v,   z += colsum(fk)
    # SAVE_DEN (for the backward, normalized): den per row. FEATURES (see _feature_mode): how fq, fk enter the dots.
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    dtype = q.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    causal = rows[:, None] >= rows[None, :]

    # Within a chunk, row i of q and k is i * H * K elements after row 0 (int32 tiles, fixed);
    # the chunk's first row is a scalar int64 offset stepped per chunk, so no 64-bit tile is carried.
    qk_tile = rows[:, None] * (H * K) + keys[None, :]
    v_tile = rows[:, None] * (H * V) + values[None, :]
    qk_chunk = (b.to(tl.int64) * T * H + h) * K  # element (b, start, h, 0) of q and k
    v_chunk = (b.to(tl.int64) * T * H + h) * V
    z_offsets = pid_bh.to(tl.int64) * K + keys
    if HAS_INITIAL_STATE:
        S = tl.load(initial_S + S_offsets, mask=S_mask, other=0.0)
        z = tl.load(initial_z + z_offsets, mask=key_ok, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)

    den_start = b.to(tl.int64) * T * H + h  # element (b, start, h) of den
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
            if FEATURES == "input":
                fq = fq.to(dtype)
                fk = fk.to(dtype)
        else:
            fq = q_c
            fk = k_c

        zeros = tl.zeros([CHUNK, BV], dtype=tl.float32)
        if FEATURES == "fp16":
            # fq = fq16 * fq_down, fk = fk16 * fk_down (per row): the rounded features, used everywhere below.
            fq16, fq_down = fp16_rows(fq)
            fk16, fk_down = fp16_rows(fk)
            A = tl.dot(fq16, tl.trans(fk16)) * fq_down[:, None] * fk_down[None, :]
            numerator = dot_fp16_rows_f32(fq16, fq_down, S, PRECISION)
            fk = fk16.to(tl.float32) * fk_down[:, None]  # fp32 carriers of the rounded fk, for S and z
        elif FEATURES == "fp32":
            A = dot_f32_f32(fq, tl.trans(fk), tl.zeros([CHUNK, CHUNK], dtype=tl.float32), dtype, PRECISION, RESCALE)
            numerator = dot_f32_f32(fq, S, zeros, dtype, PRECISION, RESCALE)
        else:
            A = tl.dot(fq, tl.trans(fk), input_precision=INPUT_PRECISION)
            numerator = dot_lowp_f32(fq, S, zeros, PRECISION, RESCALE)
        A = tl.where(causal, A, 0.0)
        numerator = dot_f32_lowp(A, v_c, numerator, PRECISION, RESCALE)
        if NORMALIZE:
            if FEATURES == "fp16":
                query_z = tl.sum(fq16.to(tl.float32) * z[None, :], axis=1) * fq_down  # exactly fq_rounded . z
            else:
                query_z = tl.sum(fq.to(tl.float32) * z[None, :], axis=1)
            denominator = tl.sum(A, axis=1) + query_z
            o_c = numerator / tl.where(row_ok, denominator, 1.0)[:, None]
            if SAVE_DEN:
                tl.store(saved_den + den_start + rows * H, denominator, mask=row_ok & (pid_v == 0))
        else:
            o_c = scale * numerator
        tl.store(o + v_chunk + v_tile, o_c.to(o.dtype.element_ty), mask=v_mask)

        if FEATURES == "input":
            S = tl.dot(tl.trans(fk), v_c, S, input_precision=INPUT_PRECISION)
        else:
            S = dot_f32_lowp(tl.trans(fk), v_c, S, PRECISION, RESCALE)
        z += tl.sum(fk.to(tl.float32), axis=0)
        qk_chunk += CHUNK * H * K
        v_chunk += CHUNK * H * V
        den_start += CHUNK * H

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
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
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
    feature_precision: str = "auto",
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    saved: dict | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Chunkwise linear attention; see the module docstring for the options and for what ``saved`` gets."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V):
        return recurrent(q=q, k=k, v=v, scale=scale, feature_map=feature_map, normalize=normalize, state=state,
                         return_state=return_state, saved=saved, await_checks=await_checks)
    BK = block_size(K)
    BV = _chunkwise_block_v(V, BK, block_v)
    input_precision, fp32_precision, rescale = input_split_config(q.dtype, precision)
    o = torch.empty_like(v)
    initial_S, initial_z, final_S, final_z = _state_buffers(q, V, state, return_state)
    den = None
    if saved is not None and normalize:
        den = saved["den"] = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(V, BV), B * H)
    launch_after_checks(await_checks, Launch(
        _chunkwise_kernel, grid,
        q, k, v, o, initial_S, initial_z, final_S, final_z,
        den,
        T, H, K, V, scale,
        CHUNK=chunk_size, BK=BK, BV=BV,
        ELU1=feature_map == "elu1", NORMALIZE=normalize,
        FEATURES=_feature_mode(q.dtype, feature_map, feature_precision),
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        SAVE_DEN=den is not None,
        INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=num_warps, num_stages=num_stages,
    ))
    return o, ((final_S, final_z) if return_state else None)


def _feature_mode(dtype: torch.dtype, feature_map: str, feature_precision: str) -> str:
    """The FEATURES constexpr of the chunkwise kernels for a ``feature_precision`` option (module docstring):
    "input" (the identity's inputs, or "round": elu1 rounded to the input dtype, which for fp32 inputs is their
    exact fp32 features), "fp32" ("split": fp32 features as hi + lo) or "fp16" (rounded to fp16, scaled per row;
    on fp32 inputs only when asked for by name). "auto" is "fp16" for bf16 inputs, "split" for fp16, exact for
    fp32."""
    modes = {"fp16": "fp16", "split": "fp32", "round": "input"}  # the value is checked against OPTIONS before
    if feature_map != "elu1":
        return "input"
    if feature_precision == "auto":
        feature_precision = {torch.bfloat16: "fp16", torch.float16: "split"}.get(dtype, "round")
    if dtype == torch.float32 and feature_precision != "fp16":
        return "input"
    return modes[feature_precision]


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
    saved: dict | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Token-by-token linear attention with the fp32 state in registers. ``saved`` is left empty: the recurrent
    backward recomputes everything it needs (module docstring)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = _recurrent_block_v(V, block_v)
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


def _chunkwise_block_v(V: int, BK: int, block_v: int | None) -> int:
    """The chunkwise kernels' V tile (default_block_v), at least GPU_MIN_BLOCK_V on the GPU: a smaller tile asked
    for there is refused before any launch."""
    BV = default_block_v(V, BK, block_v)
    if interpreter_active() or BV >= GPU_MIN_BLOCK_V:
        return BV
    if block_v is not None:
        raise ValueError(f"linear_attn's chunkwise kernels take block_v of at least {GPU_MIN_BLOCK_V} on the GPU "
                         f"(smaller V tiles fault in triton 3.6's sm_90 build); got block_v={block_v}")
    return GPU_MIN_BLOCK_V


def _recurrent_block_v(V: int, block_v: int | None) -> int:
    return block_v if block_v is not None else min(block_size(V), 32)


# ------------------------------------------------------------------------------------------------ backward


@triton.jit
def elu1_derivative(x):
    """d/dx (elu(x) + 1) in fp32: 1 for x > 0, exp(x) otherwise (the exponent is clamped to <= 0)."""
    return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))


@triton.jit
def mixed_dot(a, b, acc, DTYPE: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr):
    """acc + a @ b for operands that are each an exact input-dtype tile or an fp32 tile (the _numerics dots):
    two input tiles multiply exactly on the tensor cores; an fp32 one enters at PRECISION (split into hi + lo)."""
    if tl.constexpr(a.dtype != tl.float32) and tl.constexpr(b.dtype != tl.float32):
        return tl.dot(a, b, acc)
    elif tl.constexpr(b.dtype != tl.float32):
        return dot_f32_lowp(a, b, acc, PRECISION, RESCALE)
    elif tl.constexpr(a.dtype != tl.float32):
        return dot_lowp_f32(a, b, acc, PRECISION, RESCALE)
    else:
        return dot_f32_f32(a, b, acc, DTYPE, PRECISION, RESCALE)


@triton.jit
def blocked_dot_f32(a, b, PRECISION: tl.constexpr):
    """a @ b of fp32 tiles [M, N] x [N, P] (N a multiple of 16), summed over N in blocks of 16 whose products are
    then added: one fp32 dot sums its N terms one after another, and the error of a running sum of random-sign
    terms grows like sqrt(N / 2) roundings of the result (dv within a chunk of 64: 4.5x its floor in fp32,
    blocked 2.8-3.2)."""
    BLOCKS: tl.constexpr = a.shape[1] // 16
    a_blocks = tl.permute(tl.reshape(a, [a.shape[0], BLOCKS, 16]), (1, 0, 2))
    b_blocks = tl.reshape(b, [BLOCKS, 16, b.shape[1]])
    return tl.sum(tl.dot(a_blocks, b_blocks, input_precision=PRECISION), axis=0)


@triton.jit
def features(x, mask, ELU1: tl.constexpr, FEATURES: tl.constexpr):
    """phi(x) of an input tile, as the forward multiplies it: the input itself (identity), elu1 in fp32 (FEATURES
    "fp32"), elu1 rounded to fp16 per row as the forward's fp16_rows does (FEATURES "fp16", held exactly in fp32)
    or elu1 rounded once to the input dtype ("input"); zero where masked (phi(0) = 1 must not leak in)."""
    if ELU1:
        f = tl.where(mask, elu1(x.to(tl.float32)), 0.0)
        if FEATURES == "fp16":
            f16, down = fp16_rows(f)
            f = f16.to(tl.float32) * down[:, None]
        elif FEATURES == "input":
            f = f.to(x.dtype)
        return f
    else:
        return x


@triton.jit
def _do_dot_o_kernel(
    do, o, do_o, rows_total, V,
    BLOCK_ROWS: tl.constexpr, BV: tl.constexpr,
):
    # do_o_t = do_t . o_t: -do_o_t / den_t is the cotangent of den_t = phi(q_t)^T z_t (o_t = num_t / den_t). From
    # the returned o, for the reverse state pass's dz only: dq forms its own from unrounded tiles.
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    values = tl.arange(0, BV)
    row_ok = rows < rows_total
    mask = row_ok[:, None] & (values < V)[None, :]
    offsets = rows.to(tl.int64)[:, None] * V + values[None, :]
    o_row = tl.load(o + offsets, mask=mask, other=0.0).to(tl.float32)
    do_row = tl.load(do + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(do_o + rows, tl.sum(do_row * o_row, axis=1), mask=row_ok)


def _do_dot_o(do: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """do . o per row, [B, T, H] fp32 (see _do_dot_o_kernel)."""
    B, T, H, V = o.shape
    do_o = torch.empty(B, T, H, dtype=torch.float32, device=o.device)
    BLOCK_ROWS = 16
    _do_dot_o_kernel[(triton.cdiv(B * T * H, BLOCK_ROWS),)](
        do, o, do_o, B * T * H, V, BLOCK_ROWS=BLOCK_ROWS, BV=block_size(V),
    )
    return do_o


@triton.jit
def _chunk_states_kernel(
    k, v, chunk_S, chunk_z, initial_S, initial_z,
    T, H, K, V,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, FEATURES: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr, TRACK_Z: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # The forward's state pass again, one V block of one head: S (and z) at every chunk's start, by the forward's
    # very operations (so den and o are those of these states):  S += fk^T v,  z += colsum(fk)
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    rows = tl.arange(0, CHUNK)
    S_tile = keys[:, None] * V + values[None, :]  # within one stored state
    if HAS_INITIAL_STATE:
        S = tl.load(initial_S + S_offsets, mask=S_mask, other=0.0)
        z = tl.load(initial_z + pid_bh.to(tl.int64) * K + keys, mask=key_ok, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)
    z_start = pid_bh.to(tl.int64) * tl.cdiv(T, CHUNK) * K  # chunk 0's z of head (b, h); its S at z_start * V
    k_chunk = (b.to(tl.int64) * T * H + h) * K  # element (b, start, h, 0) of k
    v_chunk = (b.to(tl.int64) * T * H + h) * V
    for start in range(0, T, CHUNK):
        tl.store((chunk_S + z_start * V) + S_tile, S, mask=S_mask)
        if TRACK_Z:
            tl.store(chunk_z + z_start + keys, z, mask=key_ok & (pid_v == 0))
        row_ok = rows < T - start
        k_mask = row_ok[:, None] & key_ok[None, :]
        k_c = tl.load(k + k_chunk + rows[:, None] * (H * K) + keys[None, :], mask=k_mask, other=0.0)
        v_c = tl.load(v + v_chunk + rows[:, None] * (H * V) + values[None, :],
                      mask=row_ok[:, None] & value_ok[None, :], other=0.0)
        fk = features(k_c, k_mask, ELU1, FEATURES)
        if FEATURES == "input":
            S = tl.dot(tl.trans(fk), v_c, S, input_precision=INPUT_PRECISION)
        else:
            S = dot_f32_lowp(tl.trans(fk), v_c, S, PRECISION, RESCALE)
        z += tl.sum(fk.to(tl.float32), axis=0)
        z_start += K
        k_chunk += CHUNK * H * K
        v_chunk += CHUNK * H * V


@triton.jit
def _state_cotangent_kernel(
    q, do, den, do_o,
    d_final_S, d_final_z, chunk_dS, chunk_dz, d_initial_S, d_initial_z,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, FEATURES: tl.constexpr,
    HAS_D_STATE: tl.constexpr, TRACK_Z: tl.constexpr, STORE_INITIAL: tl.constexpr,
    PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # The reverse pass over chunks, one V block of one head: dS, dz, the cotangents of the state after chunk c,
    # are stored for chunk c's gradients, then carried back past its rows:
    #   dS <- dS + (w fq)^T do,   dz <- dz - (w fq)^T do_o    (w = 1 / den, or scale when not normalized)
    # A plain reverse sum: no gates, nothing to decay, no cancellation beyond the sum's own.
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    dtype = q.dtype.element_ty

    rows = tl.arange(0, CHUNK)
    z_offsets = pid_bh.to(tl.int64) * K + keys
    if HAS_D_STATE:
        dS = tl.load(d_final_S + S_offsets, mask=S_mask, other=0.0)
        dz = tl.load(d_final_z + z_offsets, mask=key_ok, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
        dz = tl.zeros([BK], dtype=tl.float32)

    NC = tl.cdiv(T, CHUNK)
    for i in range(0, NC):
        c = NC - 1 - i
        chunk_state = pid_bh.to(tl.int64) * NC + c
        tl.store(chunk_dS + chunk_state * K * V + keys[:, None] * V + values[None, :], dS, mask=S_mask)
        if TRACK_Z:
            tl.store(chunk_dz + chunk_state * K + keys, dz, mask=key_ok & (pid_v == 0))
        t = c * CHUNK + rows
        row_ok = t < T
        row = (b.to(tl.int64) * T + t) * H + h
        qk_mask = row_ok[:, None] & key_ok[None, :]
        q_c = tl.load(q + row[:, None] * K + keys[None, :], mask=qk_mask, other=0.0)
        do_c = tl.load(do + row[:, None] * V + values[None, :], mask=row_ok[:, None] & value_ok[None, :], other=0.0)
        fq = features(q_c, qk_mask, ELU1, FEATURES)
        if NORMALIZE:
            den_c = tl.load(den + row, mask=row_ok, other=1.0)
            dS = mixed_dot(tl.trans(fq.to(tl.float32) / den_c[:, None]), do_c, dS, dtype, PRECISION, RESCALE)
            dz -= tl.sum(fq.to(tl.float32) * (tl.load(do_o + row, mask=row_ok, other=0.0) / den_c)[:, None], axis=0)
        else:
            # fq^T do exactly where both are input tiles; the scale once, on the sum.
            dS += scale * mixed_dot(tl.trans(fq), do_c, tl.zeros([BK, BV], dtype=tl.float32), dtype, PRECISION,
                                    RESCALE)

    if STORE_INITIAL:
        tl.store(d_initial_S + S_offsets, dS, mask=S_mask)
        tl.store(d_initial_z + z_offsets, dz, mask=key_ok & (pid_v == 0))


@triton.jit
def _chunk_features(q, k, c, pid_bh, T, H, K, CHUNK: tl.constexpr, BK: tl.constexpr,
                    ELU1: tl.constexpr, FEATURES: tl.constexpr):
    """Chunk c of head pid_bh, as the backward's per-chunk kernels read it: its rows' element indices into
    [B, T, H, *] and their mask, the key lanes and their mask, the causal mask, q's and k's [CHUNK, BK] tiles
    (their offsets, mask and values) and their features fq, fk."""
    t = c * CHUNK + tl.arange(0, CHUNK)
    keys = tl.arange(0, BK)
    row_ok = t < T
    key_ok = keys < K
    causal = tl.arange(0, CHUNK)[:, None] >= tl.arange(0, CHUNK)[None, :]
    row = ((pid_bh // H).to(tl.int64) * T + t) * H + pid_bh % H
    qk_offsets = row[:, None] * K + keys[None, :]
    qk_mask = row_ok[:, None] & key_ok[None, :]
    q_c = tl.load(q + qk_offsets, mask=qk_mask, other=0.0)
    k_c = tl.load(k + qk_offsets, mask=qk_mask, other=0.0)
    fq = features(q_c, qk_mask, ELU1, FEATURES)
    fk = features(k_c, qk_mask, ELU1, FEATURES)
    return row, row_ok, keys, key_ok, causal, qk_offsets, qk_mask, q_c, k_c, fq, fk


@triton.jit
def _chunk_query_key_kernel(
    q, k, v, do, dq, dk,
    den, chunk_S, chunk_z, chunk_dS, chunk_dz,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, FEATURES: tl.constexpr, TRACK_Z: tl.constexpr,
    PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: chunk c of head (b, h), all of K, looping over V blocks. With S, z the state before the
    # chunk, dS', dz' the cotangents of the state after it (from _state_cotangent_kernel), A = tril(fq fk^T),
    # w = 1 / den (or scale) and do_o = do . o per row (0 when not normalized; den's cotangent is -w do_o):
    #   do_o = w rowsum((do v^T) * A + (do S^T) * fq)      (do . num, from the tiles below: o unrounded)
    #   dA' = tril(do v^T - do_o 1^T)                       (den_i = sum_j A_ij + fq_i . z)
    #   dfq = w (dA' fk + do S^T - do_o z^T)
    #   dfk = (w dA')^T fq + v dS'^T + 1 dz'^T
    #   dq  = dfq phi'(q),  dk = dfk phi'(k)
    # dfq cancels (fq . dfq = 0: o is a weighted mean of the values), so do_o is formed from the very tiles
    # dfq is (the cancellation then holds in their rounding too), and w multiplies the difference, not each
    # term, so that its rounding is not amplified.
    c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    dtype = q.dtype.element_ty
    row, row_ok, keys, key_ok, causal, qk_offsets, qk_mask, q_c, k_c, fq, fk = _chunk_features(
        q, k, c, pid_bh, T, H, K, CHUNK, BK, ELU1, FEATURES)

    chunk_state = pid_bh.to(tl.int64) * tl.cdiv(T, CHUNK) + c
    do_v = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)   # do v^T
    do_S = tl.zeros([CHUNK, BK], dtype=tl.float32)      # do S^T
    dfk = tl.zeros([CHUNK, BK], dtype=tl.float32)
    for v_start in range(0, V, BV):
        values = v_start + tl.arange(0, BV)
        value_ok = values < V
        v_mask = row_ok[:, None] & value_ok[None, :]
        S_offsets = chunk_state * K * V + keys[:, None] * V + values[None, :]
        S_mask = key_ok[:, None] & value_ok[None, :]
        v_c = tl.load(v + row[:, None] * V + values[None, :], mask=v_mask, other=0.0)
        do_c = tl.load(do + row[:, None] * V + values[None, :], mask=v_mask, other=0.0)
        S = tl.load(chunk_S + S_offsets, mask=S_mask, other=0.0)
        dS = tl.load(chunk_dS + S_offsets, mask=S_mask, other=0.0)
        do_v = mixed_dot(do_c, tl.trans(v_c), do_v, dtype, PRECISION, RESCALE)
        do_S = mixed_dot(do_c, tl.trans(S), do_S, dtype, PRECISION, RESCALE)
        dfk = mixed_dot(v_c, tl.trans(dS), dfk, dtype, PRECISION, RESCALE)

    if NORMALIZE:
        # w as a division by den: one rounding where 1 / den and a product make two.
        den_c = tl.load(den + row, mask=row_ok, other=1.0)
        A = tl.where(causal, mixed_dot(fq, tl.trans(fk), tl.zeros([CHUNK, CHUNK], dtype=tl.float32), dtype,
                                       PRECISION, RESCALE), 0.0)
        do_o_c = (tl.sum(do_v * A, axis=1) + tl.sum(do_S * fq.to(tl.float32), axis=1)) / den_c
        z = tl.load(chunk_z + chunk_state * K + keys, mask=key_ok, other=0.0)
        dA = tl.where(causal, do_v - do_o_c[:, None], 0.0)
        dfq = mixed_dot(dA, fk, do_S - do_o_c[:, None] * z[None, :], dtype, PRECISION, RESCALE) / den_c[:, None]
        dA /= den_c[:, None]
    else:
        dA = tl.where(causal, do_v, 0.0)
        dfq = scale * mixed_dot(dA, fk, do_S, dtype, PRECISION, RESCALE)
        dA *= scale
    if TRACK_Z:
        dfk += tl.load(chunk_dz + chunk_state * K + keys, mask=key_ok, other=0.0)[None, :]
    dfk = mixed_dot(tl.trans(dA), fq, dfk, dtype, PRECISION, RESCALE)
    if ELU1:
        dfq *= elu1_derivative(q_c.to(tl.float32))
        dfk *= elu1_derivative(k_c.to(tl.float32))
    tl.store(dq + qk_offsets, dfq.to(dtype), mask=qk_mask)
    tl.store(dk + qk_offsets, dfk.to(dtype), mask=qk_mask)


@triton.jit
def _chunk_value_kernel(
    q, k, do, dv, den, chunk_dS,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, FEATURES: tl.constexpr,
    PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: V block pid_v of chunk c of head (b, h). With A = tril(fq fk^T), w = 1 / den (or scale) and
    # dS' the cotangent of the state after the chunk:
    #   dv = (w A)^T do + fk dS'
    # Its own kernel: beside dq and dk's three [CHUNK, K] accumulators, A and dv's tiles spill (sm_90 ptxas).
    pid_v = tl.program_id(0)
    c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    dtype = q.dtype.element_ty
    row, row_ok, keys, key_ok, causal, _, _, _, _, fq, fk = _chunk_features(
        q, k, c, pid_bh, T, H, K, CHUNK, BK, ELU1, FEATURES)
    values = pid_v * BV + tl.arange(0, BV)
    value_ok = values < V
    v_mask = row_ok[:, None] & value_ok[None, :]
    A = tl.where(causal, mixed_dot(fq, tl.trans(fk), tl.zeros([CHUNK, CHUNK], dtype=tl.float32), dtype, PRECISION,
                                   RESCALE), 0.0)
    if NORMALIZE:
        A_weighted = A / tl.load(den + row, mask=row_ok, other=1.0)[:, None]  # one rounding, as dq's w
    else:
        A_weighted = A * scale
    chunk_state = pid_bh.to(tl.int64) * tl.cdiv(T, CHUNK) + c
    dS = tl.load(chunk_dS + chunk_state * K * V + keys[:, None] * V + values[None, :],
                 mask=key_ok[:, None] & value_ok[None, :], other=0.0)
    do_c = tl.load(do + row[:, None] * V + values[None, :], mask=v_mask, other=0.0)
    dv_c = mixed_dot(fk, dS, tl.zeros([CHUNK, BV], dtype=tl.float32), dtype, PRECISION, RESCALE)
    if tl.constexpr(dtype == tl.float32):
        dv_c += blocked_dot_f32(tl.trans(A_weighted), do_c, PRECISION)
    else:
        dv_c = mixed_dot(tl.trans(A_weighted), do_c, dv_c, dtype, PRECISION, RESCALE)
    tl.store(dv + row[:, None] * V + values[None, :], dv_c.to(dtype), mask=v_mask)


def _initial_state_grads(q: torch.Tensor, V: int, state) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if state is None:
        return None, None
    B, _, H, K = q.shape
    return (torch.empty(B, H, K, V, dtype=torch.float32, device=q.device),
            torch.empty(B, H, K, dtype=torch.float32, device=q.device))


def _gradients(q, k, v, d_initial_S, d_initial_z) -> dict:
    grads = {"q": q, "k": k, "v": v}
    if d_initial_S is not None:
        grads["initial_state"] = (d_initial_S, d_initial_z)
    return grads


def _backward_chunk(forward_chunk: int, T: int, K: int, normalize: bool, fp32_features: bool) -> int:
    """The backward's chunk. It recomputes the chunk states, so it may take its own; but normalized, the
    forward's den (saved) must be the recomputed states' own to the last bit, or fq . dfq = 0 no longer
    cancels at fp32's rounding; and on fp32 features, or past 128 key channels, 128 rows spill. Otherwise
    UNTIED_BACKWARD_CHUNK."""
    if normalize or fp32_features or K > 128:
        return forward_chunk
    return min(UNTIED_BACKWARD_CHUNK, block_size(T))


def chunkwise_backward(
    *,
    o: torch.Tensor,
    saved: dict,
    do: torch.Tensor,
    d_state: tuple[torch.Tensor, torch.Tensor] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    feature_map: str,
    normalize: bool,
    state: tuple[torch.Tensor, torch.Tensor] | None,
    chunk_size: int = 64,
    precision: str = "split",
    feature_precision: str = "auto",
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    **ignored: object,
) -> dict:
    """Gradients of the chunkwise kernel: the chunk states again, the reverse pass for their cotangents, then every
    chunk in parallel (module docstring)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V):  # the forward ran the recurrent kernel
        return recurrent_backward(o=o, saved=saved, do=do, d_state=d_state, q=q, k=k, v=v, scale=scale,
                                  feature_map=feature_map, normalize=normalize, state=state)
    BK = block_size(K)
    BV = _chunkwise_block_v(V, BK, block_v)
    input_precision, fp32_precision, rescale = input_split_config(q.dtype, precision)
    feature_mode = _feature_mode(q.dtype, feature_map, feature_precision)
    chunk_size = _backward_chunk(chunk_size, T, K, normalize, feature_mode != "input")
    chunks = triton.cdiv(T, chunk_size)
    chunk_S = torch.empty(B, H, chunks, K, V, dtype=torch.float32, device=q.device)
    chunk_z = torch.empty(B, H, chunks, K, dtype=torch.float32, device=q.device) if normalize else None
    initial_S, initial_z = state if state is not None else (None, None)
    _chunk_states_kernel[(triton.cdiv(V, BV), B * H)](
        k, v, chunk_S, chunk_z, initial_S, initial_z,
        T, H, K, V,
        CHUNK=chunk_size, BK=BK, BV=BV, ELU1=feature_map == "elu1", FEATURES=feature_mode,
        HAS_INITIAL_STATE=state is not None, TRACK_Z=normalize,
        INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=num_warps, num_stages=num_stages,
    )
    do_o = _do_dot_o(do, o) if normalize else None
    track_z = normalize or d_state is not None
    chunk_dS = torch.empty(B, H, chunks, K, V, dtype=torch.float32, device=q.device)
    chunk_dz = torch.empty(B, H, chunks, K, dtype=torch.float32, device=q.device) if track_z else None
    d_final_S, d_final_z = d_state if d_state is not None else (None, None)
    d_initial_S, d_initial_z = _initial_state_grads(q, V, state)
    constants = dict(CHUNK=chunk_size, BK=BK, ELU1=feature_map == "elu1", NORMALIZE=normalize,
                     FEATURES=feature_mode, PRECISION=fp32_precision, RESCALE=rescale,
                     num_warps=num_warps, num_stages=num_stages)
    _state_cotangent_kernel[(triton.cdiv(V, BV), B * H)](
        q, do, saved.get("den"), do_o,
        d_final_S, d_final_z, chunk_dS, chunk_dz, d_initial_S, d_initial_z,
        T, H, K, V, scale,
        BV=BV, HAS_D_STATE=d_state is not None, TRACK_Z=track_z, STORE_INITIAL=state is not None, **constants,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _chunk_value_kernel[(triton.cdiv(V, BV), chunks, B * H)](
        q, k, do, dv, saved.get("den"), chunk_dS,
        T, H, K, V, scale,
        BV=BV, **constants,
    )
    # Three [CHUNK, K] fp32 accumulators: 8 warps at least (sm_90 ptxas, K = V = 128, bf16, chunks of 64: no
    # spills at 8 warps, 680 bytes per thread at 4).
    _chunk_query_key_kernel[(chunks, B * H)](
        q, k, v, do, dq, dk,
        saved.get("den"), chunk_S, chunk_z, chunk_dS, chunk_dz,
        T, H, K, V, scale,
        BV=BV, TRACK_Z=track_z, **{**constants, "num_warps": max(num_warps, 8)},
    )
    return _gradients(dq, dk, dv, d_initial_S, d_initial_z)


@triton.jit
def compensated_add(total, error, term):
    """Kahan summation: total + term, with ``error`` (the rounding total has lost so far, negated) fed back in.
    The recurrent backward sums T terms one at a time; total - error is the sum to ~1 rounding, not ~sqrt(T)."""
    corrected = term - error
    new_total = total + corrected
    return new_total, (new_total - total) - corrected


@triton.jit
def _recurrent_query_kernel(
    q, k, v, do, S_do_parts, do_num_parts, z_seen, den,
    initial_S, initial_z,
    T, H, K, V, part_stride,
    BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr,
):
    # The forward sweep of the recurrent backward, for one V block of one head: S_t, z_t (compensated sums), and
    # per token this block's part of S_t do_t (a K vector) and of do_t . num_t = phi(q_t) . (S_t do_t); block 0
    # writes z_t and den_t = phi(q_t) . z_t (the forward's, from the compensated z). The host sums the parts:
    #   dfq_t = (S_t do_t - do_o_t z_t) / den_t,  do_o_t = do_t . num_t / den_t     (or scale S_t do_t)
    # do . o is formed from these S_t do_t, so that the cancellation in dfq (phi(q_t) . dfq_t = 0) holds in their
    # rounding too.
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    part = pid_v.to(tl.int64) * part_stride
    if HAS_INITIAL_STATE:
        S = tl.load(initial_S + S_offsets, mask=S_mask, other=0.0)
        z = tl.load(initial_z + pid_bh.to(tl.int64) * K + keys, mask=key_ok, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        z = tl.zeros([BK], dtype=tl.float32)
    S_error = tl.zeros([BK, BV], dtype=tl.float32)
    z_error = tl.zeros([BK], dtype=tl.float32)
    row = b.to(tl.int64) * T * H + h  # element (b, t, h); row * K + keys: of q, k; row * V + values: of v, do
    for _ in range(0, T):
        fk = tl.load(k + row * K + keys, mask=key_ok, other=0.0).to(tl.float32)
        if ELU1:
            fk = tl.where(key_ok, elu1(fk), 0.0)
        v_t = tl.load(v + row * V + values, mask=value_ok, other=0.0).to(tl.float32)
        S, S_error = compensated_add(S, S_error, fk[:, None] * v_t[None, :])
        do_t = tl.load(do + row * V + values, mask=value_ok, other=0.0).to(tl.float32)
        S_do = tl.sum((S - S_error) * do_t[None, :], axis=1)
        tl.store(S_do_parts + part * K + row * K + keys, S_do, mask=key_ok)
        if NORMALIZE:
            z, z_error = compensated_add(z, z_error, fk)
            fq = tl.load(q + row * K + keys, mask=key_ok, other=0.0).to(tl.float32)
            if ELU1:
                fq = tl.where(key_ok, elu1(fq), 0.0)
            tl.store(do_num_parts + part + row, tl.sum(fq * S_do, axis=0))
            tl.store(z_seen + row * K + keys, z - z_error, mask=key_ok & (pid_v == 0))
            tl.store(den + row, tl.sum(fq * (z - z_error), axis=0), mask=pid_v == 0)
        row += H


@triton.jit
def _recurrent_key_value_kernel(
    q, k, v, do, dk_parts, dv,
    den, do_o, d_final_S, d_final_z, d_initial_S, d_initial_z,
    T, H, K, V, scale, part_stride,
    BK: tl.constexpr, BV: tl.constexpr,
    ELU1: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_D_STATE: tl.constexpr, STORE_INITIAL: tl.constexpr,
):
    # The reverse sweep of the recurrent backward, for one V block of one head, in fp32, dS and dz compensated
    # sums (their errors dS_error, dz_error). With
    # w = 1 / den (or scale) and do_o = do . o (0 when not normalized; den's cotangent is -w do_o), dS and dz
    # are the cotangents of S_t and z_t:
    #   dS <- dS + w_t phi(q_t) do_t^T,   dz <- dz - w_t do_o_t phi(q_t)
    #   dfk_t = dS v_t + dz,   dv_t = dS^T phi(k_t)
    # dfk_t sums over V: each V block writes its part (dz in block 0's); the host sums them.
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    z_offsets = pid_bh.to(tl.int64) * K + keys
    part = pid_v.to(tl.int64) * part_stride
    if HAS_D_STATE:
        dS = tl.load(d_final_S + S_offsets, mask=S_mask, other=0.0)
        dz = tl.load(d_final_z + z_offsets, mask=key_ok, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)
        dz = tl.zeros([BK], dtype=tl.float32)
    dS_error = tl.zeros([BK, BV], dtype=tl.float32)
    dz_error = tl.zeros([BK], dtype=tl.float32)
    row = (b.to(tl.int64) * T + T - 1) * H + h  # element (b, T - 1, h), stepped back
    for _ in range(0, T):
        q_t = tl.load(q + row * K + keys, mask=key_ok, other=0.0).to(tl.float32)
        k_t = tl.load(k + row * K + keys, mask=key_ok, other=0.0).to(tl.float32)
        v_t = tl.load(v + row * V + values, mask=value_ok, other=0.0).to(tl.float32)
        do_t = tl.load(do + row * V + values, mask=value_ok, other=0.0).to(tl.float32)
        fq = tl.where(key_ok, elu1(q_t), 0.0) if ELU1 else q_t
        fk = tl.where(key_ok, elu1(k_t), 0.0) if ELU1 else k_t
        if NORMALIZE:
            den_t = tl.load(den + row)
            dS, dS_error = compensated_add(dS, dS_error, fq[:, None] * (do_t / den_t)[None, :])
            dz, dz_error = compensated_add(dz, dz_error, -(tl.load(do_o + row) / den_t) * fq)
        else:
            dS, dS_error = compensated_add(dS, dS_error, fq[:, None] * (scale * do_t)[None, :])
        dfk = tl.sum((dS - dS_error) * v_t[None, :], axis=1) + tl.where(pid_v == 0, dz - dz_error, 0.0)
        if ELU1:
            dfk *= elu1_derivative(k_t)
        tl.store(dk_parts + part + row * K + keys, dfk, mask=key_ok)
        dv_t = tl.sum((dS - dS_error) * fk[:, None], axis=0)
        tl.store(dv + row * V + values, dv_t.to(dv.dtype.element_ty), mask=value_ok)
        row -= H

    if STORE_INITIAL:
        tl.store(d_initial_S + S_offsets, dS - dS_error, mask=S_mask)
        tl.store(d_initial_z + z_offsets, dz - dz_error, mask=key_ok & (pid_v == 0))


def recurrent_backward(
    *,
    o: torch.Tensor,
    saved: dict,
    do: torch.Tensor,
    d_state: tuple[torch.Tensor, torch.Tensor] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    feature_map: str,
    normalize: bool,
    state: tuple[torch.Tensor, torch.Tensor] | None,
    block_v: int | None = None,
    num_warps: int = 4,
    **ignored: object,
) -> dict:
    """Gradients of the recurrent kernel: a forward sweep for dq, then a reverse sweep for dk, dv and the state's."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BV = _recurrent_block_v(V, block_v)
    blocks = triton.cdiv(V, BV)
    elu = feature_map == "elu1"
    grid = (blocks, B * H)
    S_do_parts = torch.empty(blocks, B, T, H, K, dtype=torch.float32, device=q.device)
    do_num_parts = torch.empty(blocks, B, T, H, dtype=torch.float32, device=q.device) if normalize else None
    z_seen = torch.empty(B, T, H, K, dtype=torch.float32, device=q.device) if normalize else None
    den = torch.empty(B, T, H, dtype=torch.float32, device=q.device) if normalize else None
    initial_S, initial_z = state if state is not None else (None, None)
    _recurrent_query_kernel[grid](
        q, k, v, do, S_do_parts, do_num_parts, z_seen, den, initial_S, initial_z,
        T, H, K, V, B * T * H,
        BK=block_size(K), BV=BV, ELU1=elu, NORMALIZE=normalize, HAS_INITIAL_STATE=state is not None,
        num_warps=num_warps,
    )
    q32 = q.to(torch.float32)
    derivative = torch.where(q32 > 0, 1.0, torch.exp(q32.clamp(max=0.0))) if elu else 1.0
    if normalize:
        do_o = do_num_parts.sum(0) / den
        dq = (S_do_parts.sum(0) - do_o[..., None] * z_seen) / den[..., None] * derivative
    else:
        do_o = None
        dq = scale * S_do_parts.sum(0) * derivative

    dk_parts = torch.empty(blocks, B, T, H, K, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(v)
    d_final_S, d_final_z = d_state if d_state is not None else (None, None)
    d_initial_S, d_initial_z = _initial_state_grads(q, V, state)
    _recurrent_key_value_kernel[grid](
        q, k, v, do, dk_parts, dv,
        den, do_o, d_final_S, d_final_z, d_initial_S, d_initial_z,
        T, H, K, V, scale, B * T * H * K,
        BK=block_size(K), BV=BV, ELU1=elu, NORMALIZE=normalize,
        HAS_D_STATE=d_state is not None, STORE_INITIAL=state is not None,
        num_warps=num_warps,
    )
    return _gradients(dq.to(q.dtype), dk_parts.sum(0).to(k.dtype), dv, d_initial_S, d_initial_z)


BACKWARD = {"chunkwise": chunkwise_backward, "recurrent": recurrent_backward}
