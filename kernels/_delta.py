"""Triton kernels shared by DeltaNet and Gated DeltaNet (FORMULATIONS.md, 8 and 9).

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

(DeltaNet is g = 0, compiled without the gate code.) Layout: q, k [B, T, H, K],
v and o [B, T, H, V], beta and g [B, T, H], the state S [B, H, K, V] in fp32.

Chunkwise form: seed 000's UT transform, exactly as oracles/_chunks.py's
``delta_chunk`` writes it. Within a chunk of C positions, with chunk-local
cumulative log gates G_t = sum_{s<=t} g_s (G = 0 ungated), Gamma_tj =
exp(G_t - G_j) for t >= j, and M the causal mask:

    L     = tril(Diag(beta) (K K^T * Gamma), -1)
    T     = (I + L)^-1 Diag(beta)                         (fp32)
    W     = T (K * exp(G)),  U = T V,  Qg = scale Q * exp(G),  Kd = K * exp(G_C - G)
    A_qk  = scale (Q K^T * Gamma * M)
    Delta = U - W S
    O     = Qg S + A_qk Delta
    S'    = exp(G_C) S + Kd^T Delta

This is kda's chunk algebra with one gate per head instead of one per key
channel: exp(g_t) is a scalar, so it commutes with (I - beta k k^T) and the
two recurrences agree with g_tc = g_t. The delta rules therefore run the
state pass kda runs (kernels/_state_pass.py: the output fused into the
sequential pass, the fp32 state in 64-channel blocks, the fp16 scales of its
operands from per-chunk bounds) in its SCALAR_GATE mode: Qg and Kd are never
stored; the state pass reads q and k themselves and puts the per-row factors
scale exp(G_t) on the rows of Q S and exp(G_C - G_t) on the rows of Delta (a
scalar gate per row factors out of the channel sum). For the same reason
A_kk and A_qk are one K K^T and one Q K^T dot each, and G is one scan per
chunk. Two launches:

- ``_delta_prepare_kernel`` (grid (chunks, B*H), all parallel): K K^T and
  Q K^T over the key channels, Gamma, A_qk, L, T by
  ``_numerics.unit_lower_inverse``, W, U, the row factors, exp(G_C) and the
  per-chunk bounds.
- the state pass (grid (V blocks, B*H), the chunks in order).

Every exponent is <= 0: pairwise differences are masked to -inf above the
diagonal before the exponential, and the others clamped to <= 0. G is kept
as an fp32 pair (a compensated scan), so that G_t - G_j and G_C - G_t are
accurate to their own size even when |G| reaches C * 20 inside a chunk.

Precision (the ``precision`` option, with kda's choices and meanings: "auto"
is "fp16" for bf16 inputs but narrow heads (below), "bf16x3" for fp16, "ieee"
for fp32) decides the state pass's dots and how W, A_qk and U are stored (fp16
pre-scaled for "fp16": W and A_qk by per-chunk bounds, U by its per-chunk
column peaks, so that each entry of U keeps fp16's 2^-11, the size of W S's
own rounding, which Delta = U - W S subtracts from it). "bf16" (fla's rounding
of every operand) is less accurate and no faster, so the delta rules offer no
speed setting. With fp16 inputs, "fp16" rounds Delta to fp16, and T's
conditioning amplifies that rounding on ill-conditioned chunks (beta = 2,
nearly parallel keys) far above the fp16 floor, though not above the bf16
floor it is the default for: fp16 inputs default to "bf16x3", which sits at
the fp16 floor there.
Known defect of "fp16": where the chunk algebra cancels, an output that is
exactly representable in bf16 can come out an ulp off (K = 1, beta = 1:
o_t = sum_j A_qk[t, j] U_j = +-v_t with |U_j| far above |o_t|, Delta
rounded to fp16, an absolute error of 2^-12 of |U|; properties/regressions.py,
tests/kernels/test_deltanet.py's strict xfails). "bf16x3" and "tf32x3" are
exact there, and "auto" takes "bf16x3" for bf16 heads of fewer than 16 key
or value channels (_state_pass.FP16_MIN_CHANNELS), where a sum over so few
channels averages no rounding away.
The prepare kernel keeps its own products more exact than the state pass's,
since their errors are amplified by T's conditioning: T's inverse merges
multiply bf16 hi/lo parts ("split", three bf16 products, ~2^-16) under
"fp16" and "bf16", tf32x3 (~2^-22) under "bf16x3" (the fp16 inputs'
default, whose own products are ~2^-16), and W = T K, U = T V multiply bf16
hi/lo parts of T with the exact 16-bit K and V ("split"); under "ieee",
"tf32" and "tf32x3" both follow the state pass's precision. K K^T and Q K^T
of 16-bit inputs are exact on the tensor cores.

The inverse (``_numerics.unit_lower_inverse``): its diagonal SUB x SUB blocks
(16) are inverted by substitution on one [C/16, 16, 16] tile, the K K^T
accumulator reshaped, so that each step's reductions stay inside a warp (on
masked [C, C] tiles every step reduces across warps, with barriers); then
log2(C/16) merge levels of two dots each on the full tile, tf32x3 written
out (``_numerics.split_dot_into``: tl.dot's split, but accumulated on the
tensor cores and without its NaN clean-up of the small products).

Under the Triton interpreter bf16 arithmetic is broken, so "split" rounds to
bf16 by integer RTNE on the fp32 bit pattern and multiplies the parts as fp32
(exact, like the tensor cores' bf16 products); tf32 precisions are exact fp32
there, and "fp16" and "bf16" dots are emulated (_numerics.dot_precision).

Recurrent form: one program per (head, block of V columns), the literal
recurrence token by token on the fp32 state (the read k^T S spans the whole
K column, so only V is split).

Recurrent backward (the chunkwise form's is kernels/_delta_chunk_backward.py). Write a step with the decayed state D_t = exp(g_t)
S_{t-1} and the write's error e_t = v_t - D_t^T k_t:

    S_t = D_t + beta_t k_t e_t^T,   o_t = S_t^T (scale q_t)

Its dual runs backwards from dS = the final state's cotangent (or 0), dS
being the cotangent of S_t, then of S_{t-1}, in fp32:

    dS     += scale q_t do_t^T
    dq_t    = scale S_t do_t
    de      = beta_t dS^T k_t                (the error's cotangent; dv_t = de)
    dbeta_t = k_t^T dS e_t
    dk_t    = beta_t dS e_t - D_t de         (the write, then the read D_t^T k_t)
    dD      = dS - k_t de^T                  (= (I - beta_t k_t k_t^T) dS)
    dg_t    = sum(D_t * dD)                  (D_t = exp(g_t) S_{t-1}: d/dg_t of D_t is D_t)
    dS      = exp(g_t) dD                    (the transpose of the step's linear map)

and the initial state's gradient is the last dS. Every exponent is a log gate
(<= 0). dg_t is each step's own sum over K x V, taken directly: the textbook
alternative, <S_t, dS_t> minus de . v_t with <S_t, dS_t> carried as a reverse
running sum of <o, do> and de . v terms, subtracts sums of the whole suffix
and cancels. beta near 2 makes I - beta k k^T a reflection; nothing leaves
fp32.

dk_t and dg_t read D_t next to dS, so the forward's states are needed in
reverse order. The forward, asked for gradients (``saved``), stores the state
entering every RECURRENT_SEGMENT-th step: B H cdiv(T, 64) K V fp32 floats
("checkpoints"), a 64th of the full state history, which is too large to keep
(K times v's size), and a recomputation costs one extra sequential pass. The
backward (one program per V block and head, as the forward) takes the segments
from the last: it replays a segment forwards from its checkpoint, storing D_t
and e_t of each step in the program's scratch and computing dq_t there (S_t is
at hand), then walks the segment backwards through the dual above. dq, dk,
dbeta and dg sum over V: each V block writes its fp32 part, added on the host;
dv needs only this block's columns. The backward's V blocks hold at most 2048
entries of a [K, BV] fp32 tile (the dual holds dS and reads D_t: BV = 16 at
K = 128, where the forward takes 64); block_v, when given, caps them too.

Measurements behind these choices (timings, the designs tried, instruction
counts): reports/bench.md, "Design history moved from the kernel docstrings".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels import _state_pass
from attnlab.kernels._numerics import peak, split_dot, split_dot_into, to_scratch, unit_lower_inverse
from attnlab.kernels._state_pass import (
    StateOperands, bind_state_pass, inverse_precision, resolve_state_pass, store_u, wy_precision,
)
from attnlab.kernels._util import Launch, block_size, launch_after_checks, no_pending_checks, state_block
from attnlab.runtime import interpreter_active

BLOCK_VS = (None, 16, 32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
# Diagonal blocks of T are inverted by substitution at this size, then merged by dots: a substitution step on
# [C/SUB, SUB, SUB] tiles costs a fraction of a merge level, and at 16 rows its reductions stay inside a warp
# (at 32 they cross warps); 16 also ran faster than 8.
SUB = tl.constexpr(16)
# The prepare kernel runs at 4 warps (8 spill). K K^T and Q K^T sum PREPARE_CHANNEL_SLICE key channels a step
# (faster than 64). W and U are made PREPARE_OUTPUT_BLOCK channels at a time, whatever K and V: where T, an
# inverse's result in registers, meets [C, 32] or [C, 16] tiles in a dot, the GPU build gives wrong outputs and
# illegal memory accesses that the interpreter does not show (tools/gpu/shapes.py); at 64 and 128 it is right,
# and 128 is no faster.
PREPARE_CHANNEL_SLICE = 128
PREPARE_OUTPUT_BLOCK = 64
PREPARE_NUM_WARPS = 4
# The recurrent backward's segment: the forward checkpoints the state every RECURRENT_SEGMENT steps, and the
# backward replays one segment at a time into a per-program scratch (module docstring, "Recurrent backward").
RECURRENT_SEGMENT = 64


def options(chunkwise: bool) -> dict[str, tuple]:
    """The kernel options of one form, as kernels/__init__.py's OPTIONS entry: the chunkwise form's are
    the state pass's (it does the sequential work), with V blocks of 64 or 128 only and a fixed chunk
    size (kda's "auto" choice was measured for kda's own parallel kernels, not for the prepare kernel)."""
    if chunkwise:
        # V blocks of 16 and 32 are not offered: see _state_pass.bind_state_pass.
        return {"chunk_size": (64, (16, 32, 64)), **_state_pass.OPTIONS, "block_v": (64, (64, 128))}
    return {"block_v": (None, BLOCK_VS), "num_warps": (4, NUM_WARPS)}


# --------------------------------------------------------------------------- gates


@triton.jit
def _two_sum(a_hi, a_lo, b_hi, b_lo):
    """(a_hi + a_lo) + (b_hi + b_lo) as an unevaluated fp32 pair (Knuth's TwoSum on the leading parts)."""
    total = a_hi + b_hi
    b_virtual = total - a_hi
    error = (a_hi - (total - b_virtual)) + (b_hi - b_virtual)
    return total, (a_lo + b_lo) + error


@triton.jit
def _chunk_cumulative_gate(g_ptr, token, valid):
    """G_t = sum_{s<=t} g_s over the chunk as a pair G_hi + G_lo carrying about 48 bits.

    A plain fp32 cumsum errs by ~u |G_t| in every G_t, and the pairwise
    differences G_t - G_j (|G| up to C * 20 on strong gates) would inherit that
    absolutely; the pair keeps each difference to ~u |G_t - G_j|. Rows past the
    sequence end load g = 0, so the last row holds G_C.
    """
    g = tl.load(g_ptr + token, mask=valid, other=0.0).to(tl.float32)
    return tl.associative_scan((g, tl.zeros_like(g)), 0, _two_sum)


@triton.jit
def _chunk_total_gate(g_ptr, token, valid):
    """G_C = sum_s g_s over the chunk as a pair, like _chunk_cumulative_gate's last row (one reduction of
    the pair, where reading that row out of the scan takes one reduction per part)."""
    g = tl.load(g_ptr + token, mask=valid, other=0.0).to(tl.float32)
    return tl.reduce((g, tl.zeros_like(g)), 0, _two_sum)


@triton.jit
def _gate_difference(G_hi, G_lo, other_hi, other_lo):
    """G - other from two (hi, lo) pairs, clamped to <= 0 (the exact value is, since g <= 0)."""
    return tl.minimum((G_hi - other_hi) + (G_lo - other_lo), 0.0)


@triton.jit
def _pairwise_decay(G_hi, G_lo, BC: tl.constexpr):
    """Gamma * M: exp(G_t - G_j) for t >= j, 0 above the diagonal (masked before the exponential)."""
    rows = tl.arange(0, BC)[:, None]
    cols = tl.arange(0, BC)[None, :]
    pairwise = _gate_difference(G_hi[:, None], G_lo[:, None], G_hi[None, :], G_lo[None, :])
    return tl.exp(tl.where(rows >= cols, pairwise, float("-inf")))


# --------------------------------------------------------------------------- the state pass's operands


@triton.jit
def _delta_prepare_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, w_ptr, u_ptr, u_peak_ptr, q_factor_ptr, k_factor_ptr, gc_ptr, aqk_ptr,
    bounds_ptr, T, H, K, V, scale,
    GATED: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BKW: tl.constexpr,
    BV: tl.constexpr, LEVELS: tl.constexpr, INVERSE_PRECISION: tl.constexpr, PRODUCT_PRECISION: tl.constexpr,
    STATE_PRECISION: tl.constexpr, U_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """One chunk of one head: the operands of the state pass in its SCALAR_GATE mode (by scratch row).

      A_qk = scale (Q K^T * Gamma * M)                         (stored first: no registers held after)
      L    = tril(Diag(beta) (K K^T * Gamma), -1),   T = (I + L)^-1 Diag(beta)   (INVERSE_PRECISION)
      W = (T * exp(G)^T) K,  U = T V                           (PRODUCT_PRECISION)
      q_factor = scale exp(G),  k_factor = exp(G_C - G),  gC = exp(G_C)

    (Qg = q_factor * Q and Kd = k_factor * K: the state pass applies the factors to the rows of
    Q S and of Delta.) K K^T and Q K^T sum BKC key channels at a time; W takes BKW key channels and
    U BV value channels at a time, exp(G) going into T's columns so that K stays an exact input tile
    of W's product; U is stored as _state_pass.store_u makes it at U_PRECISION (with its column
    peaks). Then the bounds the state pass takes its fp16 scales from: |W| <= max_t sum_j |T_tj
    exp(G_j)| peak|k|, peak|q|, peak|k|, |A_qk| <= |scale| K peak|q| peak|k|; W and A_qk are stored as
    _numerics.to_scratch makes them at STATE_PRECISION. gC, one value a chunk, is stored for each of
    the K channels (the state pass decays each row of S by its channel's gC).
    Every scratch row is written: rows past the sequence end load q = k = v = beta = g = 0, so
    their W, U and A_qk are 0 (their row factors are not, but meet q = k = 0 there).
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = tl.arange(0, C)
    pos = chunk * C + rows
    valid = pos < T
    token = (b * T + pos).to(tl.int64) * H + h
    chunk_index = bh.to(tl.int64) * tl.num_programs(0) + chunk
    scratch_row = chunk_index * C + rows

    kk = tl.zeros([C, C], dtype=tl.float32)
    qk = tl.zeros([C, C], dtype=tl.float32)
    q_peak = 0.0
    k_peak = 0.0
    for channel_start in tl.static_range(0, BK, BKC):
        channels = channel_start + tl.arange(0, BKC)
        mask = valid[:, None] & (channels < K)[None, :]
        k = tl.load(k_ptr + token[:, None] * K + channels[None, :], mask=mask, other=0.0)
        q = tl.load(q_ptr + token[:, None] * K + channels[None, :], mask=mask, other=0.0)
        kk = split_dot_into(k, tl.trans(k), kk, INVERSE_PRECISION, EMULATE_BF16)
        qk = split_dot_into(q, tl.trans(k), qk, INVERSE_PRECISION, EMULATE_BF16)
        q_peak = tl.maximum(q_peak, peak(q.to(tl.float32)))
        k_peak = tl.maximum(k_peak, peak(k.to(tl.float32)))
    if GATED:
        G_hi, G_lo = _chunk_cumulative_gate(g_ptr, token, valid)
        decay = _pairwise_decay(G_hi, G_lo, C)  # Gamma * M
        kk = kk * decay
        qk = qk * decay
    else:
        qk = tl.where(rows[:, None] >= rows[None, :], qk, 0.0)
    aqk_bound = tl.abs(scale) * K * q_peak * k_peak
    tl.store(aqk_ptr + scratch_row[:, None] * C + rows[None, :], to_scratch(scale * qk, aqk_bound, STATE_PRECISION))
    beta = tl.load(beta_ptr + token, mask=valid, other=0.0).to(tl.float32)
    L = tl.where(rows[:, None] > rows[None, :], beta[:, None] * kk, 0.0)
    ut = unit_lower_inverse(L, C, LEVELS, INVERSE_PRECISION, EMULATE_BF16) * beta[None, :]

    # U is made before W so that T and T exp(G)^T are never live together.
    for value_start in range(0, V, BV):
        values = value_start + tl.arange(0, BV)
        value_ok = values < V
        v = tl.load(v_ptr + token[:, None] * V + values[None, :], mask=valid[:, None] & value_ok[None, :], other=0.0)
        u = split_dot(ut, v, PRODUCT_PRECISION, EMULATE_BF16)
        store_u(u_ptr, u_peak_ptr, u, scratch_row, chunk_index * V, values, value_ok, V, U_PRECISION)
    if GATED:
        end_hi, end_lo = _chunk_total_gate(g_ptr, token, valid)
        from_start = tl.exp(tl.minimum(G_hi + G_lo, 0.0))  # exp(G_t)
        tl.store(q_factor_ptr + scratch_row, scale * from_start)
        tl.store(k_factor_ptr + scratch_row, tl.exp(_gate_difference(end_hi, end_lo, G_hi, G_lo)))  # exp(G_C - G_t)
        chunk_decay = tl.exp(tl.minimum(end_hi + end_lo, 0.0))  # exp(G_C)
        ut_w = ut * from_start[None, :]
    else:
        tl.store(q_factor_ptr + scratch_row, tl.full([C], scale, tl.float32))
        tl.store(k_factor_ptr + scratch_row, tl.full([C], 1.0, tl.float32))
        chunk_decay = 1.0
        ut_w = ut
    # |W_tc| = |sum_j T_tj exp(G_j) k_jc| <= max_t sum_j |T_tj exp(G_j)| peak|k|: with exp(G) in it, strong
    # early gates (W ~ e^-20) do not leave W 2^30 below its bound and fp16-subnormal.
    w_bound = tl.max(tl.sum(tl.abs(ut_w), axis=1)) * k_peak
    for channel_start in tl.static_range(0, BK, BKW):
        channels = channel_start + tl.arange(0, BKW)
        channel_ok = channels < K
        k = tl.load(k_ptr + token[:, None] * K + channels[None, :], mask=valid[:, None] & channel_ok[None, :], other=0.0)
        w = split_dot(ut_w, k, PRODUCT_PRECISION, EMULATE_BF16)
        tl.store(w_ptr + scratch_row[:, None] * K + channels[None, :], to_scratch(w, w_bound, STATE_PRECISION),
                 mask=channel_ok[None, :])
        tl.store(gc_ptr + chunk_index * K + channels, tl.full([BKW], chunk_decay, tl.float32), mask=channel_ok)
    which = tl.arange(0, 4)
    bounds = tl.where(which == 0, w_bound, tl.where(which == 1, q_peak, tl.where(which == 2, k_peak, aqk_bound)))
    tl.store(bounds_ptr + chunk_index * 4 + which, bounds)


# --------------------------------------------------------------------------- recurrent


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, s0_ptr, o_ptr, s_out_ptr, checkpoint_ptr,
    T, H, K, V, scale,
    GATED: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SEGMENT: tl.constexpr,
):
    """Token by token: S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T (scale q).

    (The first two lines are exp(g) (I - beta k k^T) S + beta k v^T.) Grid (cdiv(V, BV), B*H).
    With SEGMENT > 0 (gradients wanted) the state entering every SEGMENT-th step is also stored, in
    checkpoint [B*H, cdiv(T, SEGMENT), K, V], for the backward's replay.
    """
    vblock, bh, b, h, kcol, vcol, k_in, v_in, state_offsets, state_mask = state_block(H, K, V, BK, BV)
    if HAS_INITIAL:
        S = tl.load(s0_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for t in range(0, T):
        if SEGMENT > 0:
            segment_offsets = (bh.to(tl.int64) * tl.cdiv(T, SEGMENT) + t // SEGMENT) * K * V
            tl.store(checkpoint_ptr + segment_offsets + kcol[:, None] * V + vcol[None, :], S,
                     mask=state_mask & (t % SEGMENT == 0))
        token = (b * T + t).to(tl.int64) * H + h
        q = tl.load(q_ptr + token * K + kcol, mask=k_in, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + token * K + kcol, mask=k_in, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + token * V + vcol, mask=v_in, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + token).to(tl.float32)
        if GATED:
            S = S * tl.exp(tl.load(g_ptr + token).to(tl.float32))
        error = v - tl.sum(k[:, None] * S, axis=0)
        S = S + (beta * k)[:, None] * error[None, :]
        o = tl.sum((scale * q)[:, None] * S, axis=0)
        tl.store(o_ptr + token * V + vcol, o.to(o_ptr.dtype.element_ty), mask=v_in)

    if STORE_FINAL:
        tl.store(s_out_ptr + state_offsets, S, mask=state_mask)


@triton.jit
def _recurrent_backward_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, do_ptr, checkpoint_ptr, decayed_ptr, error_ptr,
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, d_final_ptr, d_initial_ptr,
    B, T, H, K, V, scale,
    GATED: tl.constexpr, HAS_D_FINAL: tl.constexpr, STORE_D_INITIAL: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, SEGMENT: tl.constexpr, SLOTS: tl.constexpr,
):
    """The recurrence's dual, backwards in time (module docstring, "Recurrent backward"). Grid (cdiv(V, BV), B*H).

    Each segment of SEGMENT steps, from the last: replay it forwards from its checkpoint, keeping the
    decayed state D_t = exp(g_t) S_{t-1} and the write's error e_t = v_t - D_t^T k_t of every step in
    this program's scratch (SLOTS steps), and dq_t = scale S_t do_t on the way; then walk it backwards
    with the state's cotangent dS [BK, BV] in fp32:

        dS += scale q_t do_t^T
        de = beta_t dS^T k_t                  (dv_t = de)
        dbeta_t = k_t^T dS e_t,   dk_t = beta_t dS e_t - D_t de
        dD = dS - k_t de^T,       dg_t = sum(D_t * dD),   dS = exp(g_t) dD

    dq, dk, dbeta and dg sum over V: this V block's part goes to its own slice [vblock] of theirs.
    """
    vblock, bh, b, h, kcol, vcol, k_in, v_in, state_offsets, state_mask = state_block(H, K, V, BK, BV)
    scratch = (bh.to(tl.int64) * tl.num_programs(0) + vblock) * SLOTS
    decayed = decayed_ptr + scratch * BK * BV + kcol[:, None] * BV + tl.arange(0, BV)[None, :]
    errors = error_ptr + scratch * BV + tl.arange(0, BV)
    part = vblock.to(tl.int64) * B * T * H  # this V block's slice of dq, dk, dbeta, dg (in tokens)
    if HAS_D_FINAL:
        dS = tl.load(d_final_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)

    segments = tl.cdiv(T, SEGMENT)
    for i in range(0, segments):
        segment = segments - 1 - i
        start = segment * SEGMENT
        steps = tl.minimum(SEGMENT, T - start)
        S = tl.load(checkpoint_ptr + (bh.to(tl.int64) * segments + segment) * K * V + kcol[:, None] * V
                    + vcol[None, :], mask=state_mask, other=0.0)
        for s in range(0, steps):
            token = (b * T + start + s).to(tl.int64) * H + h
            k = tl.load(k_ptr + token * K + kcol, mask=k_in, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + token * V + vcol, mask=v_in, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + token * V + vcol, mask=v_in, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + token).to(tl.float32)
            if GATED:
                S = S * tl.exp(tl.load(g_ptr + token).to(tl.float32))
            error = v - tl.sum(k[:, None] * S, axis=0)
            tl.store(decayed + s * BK * BV, S)
            tl.store(errors + s * BV, error)
            S = S + (beta * k)[:, None] * error[None, :]
            tl.store(dq_ptr + (part + token) * K + kcol, scale * tl.sum(S * do[None, :], axis=1), mask=k_in)
        tl.debug_barrier()  # the replayed steps are read back in another thread layout

        for j in range(0, steps):
            s = steps - 1 - j
            token = (b * T + start + s).to(tl.int64) * H + h
            q = tl.load(q_ptr + token * K + kcol, mask=k_in, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + token * K + kcol, mask=k_in, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + token * V + vcol, mask=v_in, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + token).to(tl.float32)
            D = tl.load(decayed + s * BK * BV)
            error = tl.load(errors + s * BV)
            dS += (scale * q)[:, None] * do[None, :]
            d_error = beta * tl.sum(dS * k[:, None], axis=0)
            tl.store(dv_ptr + token * V + vcol, d_error.to(dv_ptr.dtype.element_ty), mask=v_in)
            dS_error = tl.sum(dS * error[None, :], axis=1)
            tl.store(dbeta_ptr + part + token, tl.sum(k * dS_error))
            tl.store(dk_ptr + (part + token) * K + kcol, beta * dS_error - tl.sum(D * d_error[None, :], axis=1),
                     mask=k_in)
            dD = dS - k[:, None] * d_error[None, :]
            if GATED:
                tl.store(dg_ptr + part + token, tl.sum(tl.sum(D * dD, axis=1), axis=0))
                dS = dD * tl.exp(tl.load(g_ptr + token).to(tl.float32))
            else:
                dS = dD
        tl.debug_barrier()  # the next segment overwrites the scratch

    if STORE_D_INITIAL:
        tl.store(d_initial_ptr + state_offsets, dS, mask=state_mask)


# --------------------------------------------------------------------------- launchers


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _prepare_precisions(dot_precision: str) -> tuple[str, str]:
    """(T's inverse, W and U's products) for the state pass's dot precision (module docstring)."""
    return inverse_precision(dot_precision), wy_precision(dot_precision)


def _outputs(q: torch.Tensor, v: torch.Tensor, return_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, _, H, K = q.shape
    o = torch.empty_like(v)
    final = torch.empty((B, H, K, v.shape[-1]), dtype=torch.float32, device=v.device) if return_state else None
    return o, final


def _bind_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
                  scale: float, operands: StateOperands, C: int, dot_precision: str) -> Launch:
    """``_delta_prepare_kernel`` over every chunk and head, into ``operands`` (allocated with scalar_gate), bound."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    inverse_precision, product_precision = _prepare_precisions(dot_precision)
    return Launch(
        _delta_prepare_kernel, (triton.cdiv(T, C), B * H),
        q, k, v, beta, g if g is not None else beta,  # an unused pointer when ungated
        operands.w, operands.u, operands.u_peak_or_u(), operands.qg, operands.kd, operands.gc, operands.aqk,
        operands.bounds, T, H, K, V, float(scale),
        GATED=g is not None, C=C, BK=block_size(K), BKC=min(block_size(K), PREPARE_CHANNEL_SLICE),
        BKW=PREPARE_OUTPUT_BLOCK, BV=PREPARE_OUTPUT_BLOCK, LEVELS=int(math.log2(C // SUB.value)),
        INVERSE_PRECISION=inverse_precision, PRODUCT_PRECISION=product_precision, STATE_PRECISION=dot_precision,
        U_PRECISION=operands.u_precision(dot_precision), EMULATE_BF16=interpreter_active(), num_warps=PREPARE_NUM_WARPS,
    )


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor] | None, return_state: bool,
    chunk_size: int = 64, precision: str = "auto", block_v: int = 64, num_warps: int = 4,
    num_stages: int | str = "auto", saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The prepare kernel, then the state pass; g None is DeltaNet. Returns (o, (S,) or None). Nothing goes into
    ``saved`` (gradients wanted): the backward (kernels/_delta_chunk_backward.py) recomputes what it needs."""
    choices = options(chunkwise=True)
    for name, value in (("chunk_size", chunk_size), ("precision", precision), ("block_v", block_v),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        _check_choice(name, value, choices[name][1])
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    dot_precision, num_stages = resolve_state_pass(precision, num_stages, q.dtype, K, V)
    operands = StateOperands.allocate(B, H, triton.cdiv(T, C), C, K, V, q.device, dot_precision, scalar_gate=True)
    o, final = _outputs(q, v, return_state)
    initial = state[0] if state is not None else None
    launch_after_checks(
        await_checks,
        _bind_prepare(q, k, v, beta, g, scale, operands, C, dot_precision),
        bind_state_pass(operands, o, initial, final, T, C, block_v, dot_precision, num_warps, num_stages,
                            scalar_gate_inputs=(q, k)),
    )
    return o, ((final,) if return_state else None)


def recurrent(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor] | None, return_state: bool,
    block_v: int | None = None, num_warps: int = 4, saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The token-by-token kernel; g None is DeltaNet. Returns (o, (S,) or None). With ``saved`` (gradients
    wanted) it also stores the state entering every RECURRENT_SEGMENT-th step there, as "checkpoints"."""
    _check_choice("block_v", block_v, BLOCK_VS)
    _check_choice("num_warps", num_warps, NUM_WARPS)
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = min(block_v or (64 if BK <= 128 else 32), block_size(V))  # bounds the [K, BV] fp32 state tile
    o, final = _outputs(q, v, return_state)
    initial = state[0] if state is not None else None
    gated = g is not None
    if saved is not None:
        saved["checkpoints"] = torch.empty((B * H, triton.cdiv(T, RECURRENT_SEGMENT), K, V), dtype=torch.float32,
                                           device=q.device)
    launch_after_checks(await_checks, Launch(
        _recurrent_kernel, (triton.cdiv(V, BV), B * H),
        q, k, v, beta, g if gated else beta, initial if initial is not None else o, o,
        final if final is not None else o, saved["checkpoints"] if saved is not None else o,
        T, H, K, V, float(scale),
        GATED=gated, HAS_INITIAL=initial is not None, STORE_FINAL=final is not None,
        BK=BK, BV=BV, SEGMENT=RECURRENT_SEGMENT if saved is not None else 0, num_warps=num_warps,
    ))
    return o, ((final,) if return_state else None)


def recurrent_backward(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor] | None, saved: dict[str, torch.Tensor], do: torch.Tensor,
    d_state: tuple[torch.Tensor] | None, block_v: int | None = None, num_warps: int = 4, **ignored,
) -> dict[str, torch.Tensor | tuple[torch.Tensor]]:
    """The recurrent form's backward (module docstring, "Recurrent backward"): one program per (V block, head)
    replays the forward's checkpointed segments and runs the dual recurrence backwards. Gradients of q, k, v,
    beta, g (gated only) in their dtypes and, with an initial state, "initial_state" in fp32."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    # The dual keeps dS and reads D_t, two [BK, BV] fp32 tiles: at most 2048 entries each, and at most block_v
    # columns where it is given.
    BV = min(max(16, 2048 // BK), block_size(V), block_v or block_size(V))
    NV = triton.cdiv(V, BV)
    slots = min(RECURRENT_SEGMENT, T)
    f32 = dict(dtype=torch.float32, device=q.device)
    # The V blocks' parts of the sums over V, added below in fp32.
    dq_parts = torch.empty((NV, B, T, H, K), **f32)
    dk_parts = torch.empty((NV, B, T, H, K), **f32)
    dbeta_parts = torch.empty((NV, B, T, H), **f32)
    dg_parts = torch.empty((NV, B, T, H), **f32) if g is not None else None
    dv = torch.empty_like(v)
    d_initial = torch.empty((B, H, K, V), **f32) if state is not None else None
    decayed = torch.empty((NV * B * H, slots, BK, BV), **f32)
    errors = torch.empty((NV * B * H, slots, BV), **f32)
    _recurrent_backward_kernel[(NV, B * H)](
        q, k, v, beta, g if g is not None else beta, do, saved["checkpoints"], decayed, errors,
        dq_parts, dk_parts, dv, dbeta_parts, dg_parts if dg_parts is not None else dbeta_parts,
        d_state[0] if d_state is not None else decayed, d_initial if d_initial is not None else decayed,
        B, T, H, K, V, float(scale),
        GATED=g is not None, HAS_D_FINAL=d_state is not None, STORE_D_INITIAL=d_initial is not None,
        BK=BK, BV=BV, SEGMENT=RECURRENT_SEGMENT, SLOTS=slots, num_warps=num_warps,
    )
    grads = {"q": dq_parts.sum(0).to(q.dtype), "k": dk_parts.sum(0).to(k.dtype), "v": dv,
             "beta": dbeta_parts.sum(0).to(beta.dtype)}
    if dg_parts is not None:
        grads["g"] = dg_parts.sum(0).to(g.dtype)
    if d_initial is not None:
        grads["initial_state"] = (d_initial,)
    return grads
