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

This is kda's chunk algebra (kernels/kda.py) with one gate per head instead
of one per key channel: exp(g_t) is a scalar, so it commutes with
(I - beta k k^T) and the two recurrences agree with g_tc = g_t. The delta
rules therefore run kda's state pass (``kda.bind_state_pass``: the output
fused into the sequential pass, the fp32 state in 64-channel blocks, the
fp16 scales of its operands from per-chunk bounds) in its SCALAR_GATE mode:
Qg and Kd are never stored. The state pass reads q and k themselves and puts
the per-row factors scale exp(G_t) on the rows of Q S and exp(G_C - G_t) on
the rows of Delta (a scalar gate per row factors out of the channel sum).
For the same reason A_kk and A_qk are one K K^T and one Q K^T dot each, and G
is one scan per chunk. Two launches:

- ``_delta_prepare_kernel`` (grid (chunks, B*H), all parallel): K K^T and
  Q K^T over the key channels, Gamma, A_qk, L, T by ``_unit_lower_inverse``,
  W, U, the row factors, exp(G_C) and the per-chunk bounds.
- kda's state pass (grid (V blocks, B*H), the chunks in order).

Until 2026-11-25 the delta rules ran three launches of their own: a prepare
pass (T, W, U), a state pass that wrote each chunk's state S and Delta, and
an output pass over them. On the H100 at B=8, T=4096, H=16, K=V=128 (bf16)
that took 1.29 ms (deltanet) and 1.42 ms (gated) against fla's 1.22 and
1.03; now 0.92 and 1.00 against 1.20 and 1.01 (prepare 0.46 / 0.53 ms,
state pass 0.42, with U in fp16 and split merges; reports/bench.md, sessions
8-10). A first version stored Qg and
Kd as kda does: 1.33 / 1.37-1.42 ms, its prepare kernel writing 270 MB more.

Every exponent is <= 0: pairwise differences are masked to -inf above the
diagonal before the exponential, and the others clamped to <= 0. G is kept
as an fp32 pair (a compensated scan), so that G_t - G_j and G_C - G_t are
accurate to their own size even when |G| reaches C * 20 inside a chunk.

Precision (the ``precision`` option, kda's choices and meanings: "auto" is
"fp16" for bf16 inputs, "bf16x3" for fp16, "ieee" for fp32) decides the state
pass's dots and how W, A_qk and U are stored (fp16 pre-scaled for "fp16": W
and A_qk by per-chunk bounds, U by its per-chunk column peaks, so that each
entry of U keeps fp16's 2^-11, the size of W S's own rounding, which
Delta = U - W S subtracts from it). Measured on the H100 (bench shape, bf16):
excess 1.034 (deltanet) and 1.016 (gated) at T = 1024 with "fp16" (1.025 and
1.015 with U in fp32, which cost 0.06 ms a call more: reports/bench.md,
session 10); "bf16" (fla's rounding of every operand) 2.28 / 1.73, and slower
(1.84 / 2.00 ms in the first version), so the delta rules offer no speed
setting. On the ill-conditioned regression (beta = 2, nearly parallel keys,
fp16 inputs, tests) "fp16" costs about 12x the fp16 floor (Delta's fp16
rounding is amplified by T's conditioning), 1.3x the bf16 floor it is the
default for; "bf16x3", the fp16 inputs' default, sits at the fp16 floor.
Known defect of "fp16" (session 10): where the chunk algebra cancels, an
output that is exactly representable in bf16 can come out an ulp off (K = 1,
beta = 1: o_t = sum_j A_qk[t, j] U_j = +-v_t with |U_j| up to 2.4 for
|o_t| = 0.1, Delta rounded to fp16; gated, T = 2: 4.6% of o_1 = -0.0146,
an absolute error of 2^-12 of |U|), which the bf16 property suite counts as
a failure (properties/regressions.py; tests/kernels/test_deltanet.py, strict
xfails). "bf16x3" and "tf32x3" are exact there.
The prepare kernel keeps its own products more exact than the state pass's,
since their errors are amplified by T's conditioning: T's inverse merges
multiply bf16 hi/lo parts ("split", three bf16 products, ~2^-16) under
"fp16" and "bf16", tf32x3 (~2^-22) under "bf16x3" (the fp16 inputs'
default, whose own products are ~2^-16), and W = T K, U = T V multiply bf16
hi/lo parts of T with the exact 16-bit K and V ("split"); under "ieee",
"tf32" and "tf32x3" both follow the state pass's precision. The split
merges took gated_deltanet's prepare kernel from 0.598 to 0.524 ms against
tf32x3 (H100, bench shape) at the same excess (1.016 at T = 1024); on the
ill-conditioned regression below, "fp16" stays at 12.4x the fp16 floor
(12.3x with tf32x3 merges and U in fp32).
K K^T and Q K^T of 16-bit inputs are exact on the tensor cores.

The inverse (``_unit_lower_inverse``): its diagonal SUB x SUB blocks (16)
are inverted by substitution on one [C/16, 16, 16] tile, the K K^T
accumulator reshaped, so that each step's reductions stay inside a warp
(masked [C, C] tiles cost ~4x the instructions per step and 3 barriers);
then log2(C/16) merge levels of two dots each on the full tile, tf32x3
written out (``_mm_into``: tl.dot's split, but accumulated on the tensor
cores and without its NaN clean-up of the small products). On the H200
(bench shape, bf16) this took the former prepare pass from 0.66 to 0.42 ms
(deltanet) and 0.71 to 0.47 ms (gated); 8-blocks with 3 levels took 0.46 /
0.51, at the same accuracy.

Under the Triton interpreter bf16 arithmetic is broken, so "split" rounds to
bf16 by integer RTNE on the fp32 bit pattern and multiplies the parts as fp32
(exact, like the tensor cores' bf16 products); tf32 precisions are exact fp32
there, and kda emulates its "fp16" and "bf16" dots.

Recurrent form: one program per (head, block of V columns), the literal
recurrence token by token on the fp32 state (the read k^T S spans the whole
K column, so only V is split).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernel import interpreter_active

from . import kda
from ._util import Launch, block_size, launch_after_checks, no_pending_checks
from .kda import _store_u, _to_scratch

BLOCK_VS = (None, 16, 32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
# Diagonal blocks of T are inverted by substitution at this size, then merged by dots. On
# [C/SUB, SUB, SUB] tiles a step costs under a tenth of a merge level in instructions; at C = 64 the sm_90
# build (ptxas) has 3750 instructions and 18 barriers with 16 steps + 2 levels, 3940 and 22 with 8 + 3,
# 6260 and 110 with 32 + 1 (its reductions cross warps). The masked [C, C] substitution with Triton's
# tf32x3 merges it replaces had ~7800 (8 steps + 3 levels) and ~41. Timed on the H200: 16 beat 8 (module
# docstring).
SUB = tl.constexpr(16)
# The prepare kernel at 4 warps, sm_90 build (bf16, K = V = 128, C = 64, "fp16"): 255 registers, no spills;
# 8 warps spill. K K^T and Q K^T sum PREPARE_CHANNEL_SLICE key channels a step (H100, bench shape, gated:
# 0.58 ms at 128, 0.61 at 64). W and U are made PREPARE_OUTPUT_BLOCK channels at a time, whatever K and V:
# where T, an inverse's result in registers, met [C, 32] or [C, 16] tiles in a dot (blocks of 32, or
# K, V <= 16 with blocks of min(64, K)), the H100 build gave wrong outputs and illegal memory accesses that
# the interpreter does not show (.ci/gpu_shapes.py); at 64 and 128 it is right, and 128 was no faster.
PREPARE_CHANNEL_SLICE = 128
PREPARE_OUTPUT_BLOCK = 64
PREPARE_NUM_WARPS = 4


def options(chunkwise: bool) -> dict[str, tuple]:
    """The kernel options of one form, as kernels/__init__.py's OPTIONS entry: the chunkwise form's are
    kda's (its state pass does the sequential work), with V blocks of 64 or 128 only and a fixed chunk
    size (kda's "auto" choice was measured for kda's own parallel kernels, not for the prepare kernel)."""
    if chunkwise:
        # V blocks of 16 and 32 are not offered: see kda.bind_state_pass.
        return {**kda.OPTIONS["chunkwise"], "chunk_size": (64, (16, 32, 64)), "block_v": (64, (64, 128))}
    return {"block_v": (None, BLOCK_VS), "num_warps": (4, NUM_WARPS)}


# --------------------------------------------------------------------------- dots


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32: integer RTNE on the bit pattern."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_parts(x, EMULATE_BF16: tl.constexpr):
    """x (fp32) = hi + lo + O(2^-17 |x|) with hi, lo bf16 values (fp32 carriers when emulating)."""
    if EMULATE_BF16:
        hi = _round_to_bf16(x)
        lo = _round_to_bf16(x - hi)
    else:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def _mm_into(a, b, acc, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """acc + a @ b with fp32 accumulation; a and b are input tiles (fp16/bf16/fp32) or fp32 tiles.

    Two 16-bit tiles of one dtype go straight to the tensor cores (exact
    products). Otherwise PRECISION decides: "split" multiplies bf16 hi/lo
    parts (a bf16 b, the prepare kernel's K or V against T, is its own hi
    part); "tf32x3" is tl.dot's written out (the same split: hi rounded to
    tf32, lo the exact rest, truncated to tf32 by the tensor cores; without
    its NaN clean-up of the small products, which only an infinite input
    needs); anything else is tl.dot's input_precision. Every product
    accumulates into acc on the tensor cores (one fp32 tile of registers,
    where a sum of separate products would hold one per product).
    """
    if tl.constexpr(a.dtype == b.dtype) and tl.constexpr(a.dtype != tl.float32):
        acc = tl.dot(a, b, acc)
    elif PRECISION == "tf32x3":
        a_hi, a_lo = _tf32_parts(a.to(tl.float32))
        b_hi, b_lo = _tf32_parts(b.to(tl.float32))
        acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    elif PRECISION == "split":
        if tl.constexpr(b.dtype == tl.bfloat16):
            a_hi, a_lo = _bf16_parts(a.to(tl.float32), EMULATE_BF16)
            acc = tl.dot(a_lo, b, acc)
            acc = tl.dot(a_hi, b, acc)
        else:
            a_hi, a_lo = _bf16_parts(a.to(tl.float32), EMULATE_BF16)
            b_hi, b_lo = _bf16_parts(b.to(tl.float32), EMULATE_BF16)
            acc = tl.dot(a_hi, b_lo, acc)
            acc = tl.dot(a_lo, b_hi, acc)
            acc = tl.dot(a_hi, b_hi, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """a @ b with fp32 accumulation, at PRECISION (see _mm_into)."""
    return _mm_into(a, b, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), PRECISION, EMULATE_BF16)


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


# --------------------------------------------------------------------------- UT transform


@triton.jit
def _tf32_parts(x):
    """x = hi + lo with hi = x rounded to tf32 (to nearest, ties away: cvt.rna's rounding, by integer ops)."""
    hi = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def _unit_lower_inverse(L, BC: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr,
                        EMULATE_BF16: tl.constexpr):
    """(I + L)^-1 for strictly lower-triangular L [BC, BC], in fp32.

    The diagonal blocks of size BC >> LEVELS are inverted by column-oriented
    forward substitution, all at once as one [blocks, size, size] tile (step r
    subtracts column r of each block of L times row r of its block of X; the
    reductions run along one block's row or column, inside a warp), then
    merged pairwise LEVELS times on the full tile: for a block [[A, 0], [B, D]]
    whose halves are already inverted, X <- X + X (-B X) fills in -D^-1 B A^-1
    (-B X is nonzero only where X is 0, so the accumulation into X is exact).
    """
    SIZE: tl.constexpr = BC >> LEVELS
    BLOCKS: tl.constexpr = BC // SIZE
    # blocks[n, i, m, j] = L[n * SIZE + i, m * SIZE + j]; the diagonal blocks are m == n.
    block_row = tl.arange(0, BLOCKS)[:, None, None, None]
    block_col = tl.arange(0, BLOCKS)[None, None, :, None]
    L_blocks = tl.sum(tl.where(block_row == block_col, tl.reshape(L, [BLOCKS, SIZE, BLOCKS, SIZE]), 0.0), axis=2)
    i = tl.arange(0, SIZE)[None, :, None]
    j = tl.arange(0, SIZE)[None, None, :]
    X_blocks = tl.where(i == j, 1.0, 0.0) + tl.zeros([BLOCKS, SIZE, SIZE], dtype=tl.float32)
    for r in tl.static_range(SIZE):
        # Row r of each block of X is final after r steps; column r of L does not depend on X.
        l = tl.sum(tl.where(j == r, L_blocks, 0.0), axis=2)
        x = tl.sum(tl.where(i == r, X_blocks, 0.0), axis=1)
        X_blocks = X_blocks - l[:, :, None] * x[:, None, :]
    X = tl.reshape(tl.where(block_row == block_col, X_blocks[:, :, None, :], 0.0), [BC, BC])

    rows = tl.arange(0, BC)[:, None]
    cols = tl.arange(0, BC)[None, :]
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    for level in tl.static_range(LEVELS):
        half = SIZE << level
        lower_left = ((rows // (2 * half)) == (cols // (2 * half))) & ((rows // half) % 2 == 1) & ((cols // half) % 2 == 0)
        X = _mm_into(X, _mm_into(tl.where(lower_left, -L, 0.0), X, zero, PRECISION, EMULATE_BF16), X,
                     PRECISION, EMULATE_BF16)
    return X


# --------------------------------------------------------------------------- the state pass's operands


@triton.jit
def _delta_prepare_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, w_ptr, u_ptr, u_peak_ptr, q_factor_ptr, k_factor_ptr, gc_ptr, aqk_ptr,
    bounds_ptr, T, H, K, V, scale,
    GATED: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BKW: tl.constexpr,
    BV: tl.constexpr, LEVELS: tl.constexpr, INVERSE_PRECISION: tl.constexpr, PRODUCT_PRECISION: tl.constexpr,
    STATE_PRECISION: tl.constexpr, U_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """One chunk of one head: the operands of kda's state pass in its SCALAR_GATE mode (by scratch row).

      A_qk = scale (Q K^T * Gamma * M)                         (stored first: no registers held after)
      L    = tril(Diag(beta) (K K^T * Gamma), -1),   T = (I + L)^-1 Diag(beta)   (INVERSE_PRECISION)
      W = (T * exp(G)^T) K,  U = T V                           (PRODUCT_PRECISION)
      q_factor = scale exp(G),  k_factor = exp(G_C - G),  gC = exp(G_C)

    (Qg = q_factor * Q and Kd = k_factor * K: the state pass applies the factors to the rows of
    Q S and of Delta.) K K^T and Q K^T sum BKC key channels at a time; W takes BKW key channels and
    U BV value channels at a time, exp(G) going into T's columns so that K stays an exact input tile
    of W's product; U is stored as kda's _store_u makes it at U_PRECISION (with its column peaks).
    Then the bounds the state pass takes its fp16 scales from: |W| <= max_t sum_j |T_tj exp(G_j)|
    peak|k|, peak|q|, peak|k|, |A_qk| <= |scale| K peak|q| peak|k|; W and A_qk are stored as kda's
    _to_scratch makes them at STATE_PRECISION. gC, one value a chunk, is
    stored for each of the K channels (the state pass decays each row of S by its channel's gC).
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
        kk = _mm_into(k, tl.trans(k), kk, INVERSE_PRECISION, EMULATE_BF16)
        qk = _mm_into(q, tl.trans(k), qk, INVERSE_PRECISION, EMULATE_BF16)
        q_peak = tl.maximum(q_peak, tl.max(tl.abs(q.to(tl.float32))))
        k_peak = tl.maximum(k_peak, tl.max(tl.abs(k.to(tl.float32))))
    if GATED:
        G_hi, G_lo = _chunk_cumulative_gate(g_ptr, token, valid)
        decay = _pairwise_decay(G_hi, G_lo, C)  # Gamma * M
        kk = kk * decay
        qk = qk * decay
    else:
        qk = tl.where(rows[:, None] >= rows[None, :], qk, 0.0)
    aqk_bound = tl.abs(scale) * K * q_peak * k_peak
    tl.store(aqk_ptr + scratch_row[:, None] * C + rows[None, :], _to_scratch(scale * qk, aqk_bound, STATE_PRECISION))
    beta = tl.load(beta_ptr + token, mask=valid, other=0.0).to(tl.float32)
    L = tl.where(rows[:, None] > rows[None, :], beta[:, None] * kk, 0.0)
    ut = _unit_lower_inverse(L, C, LEVELS, INVERSE_PRECISION, EMULATE_BF16) * beta[None, :]

    # U is made before W so that T and T exp(G)^T are never live together.
    for value_start in range(0, V, BV):
        values = value_start + tl.arange(0, BV)
        value_ok = values < V
        v = tl.load(v_ptr + token[:, None] * V + values[None, :], mask=valid[:, None] & value_ok[None, :], other=0.0)
        u = _mm(ut, v, PRODUCT_PRECISION, EMULATE_BF16)
        _store_u(u_ptr, u_peak_ptr, u, scratch_row, chunk_index * V, values, value_ok, V, U_PRECISION)
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
        w = _mm(ut_w, k, PRODUCT_PRECISION, EMULATE_BF16)
        tl.store(w_ptr + scratch_row[:, None] * K + channels[None, :], _to_scratch(w, w_bound, STATE_PRECISION),
                 mask=channel_ok[None, :])
        tl.store(gc_ptr + chunk_index * K + channels, tl.full([BKW], chunk_decay, tl.float32), mask=channel_ok)
    which = tl.arange(0, 4)
    bounds = tl.where(which == 0, w_bound, tl.where(which == 1, q_peak, tl.where(which == 2, k_peak, aqk_bound)))
    tl.store(bounds_ptr + chunk_index * 4 + which, bounds)


# --------------------------------------------------------------------------- recurrent


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, s0_ptr, o_ptr, s_out_ptr,
    T, H, K, V, scale,
    GATED: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """Token by token: S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T (scale q).

    (The first two lines are exp(g) (I - beta k k^T) S + beta k v^T.) Grid (cdiv(V, BV), B*H).
    """
    vblock = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kcol = tl.arange(0, BK)
    vcol = vblock * BV + tl.arange(0, BV)
    k_in, v_in = kcol < K, vcol < V
    state_offsets = bh.to(tl.int64) * K * V + kcol[:, None] * V + vcol[None, :]
    state_mask = k_in[:, None] & v_in[None, :]
    if HAS_INITIAL:
        S = tl.load(s0_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for t in range(0, T):
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


# --------------------------------------------------------------------------- launchers


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _prepare_precisions(dot_precision: str) -> tuple[str, str]:
    """(T's inverse, W and U's products) for the state pass's dot precision (module docstring)."""
    if dot_precision in ("ieee", "tf32", "tf32x3"):
        return dot_precision, dot_precision
    if dot_precision == "bf16x3":
        return "tf32x3", "split"
    return "split", "split"


def _outputs(q: torch.Tensor, v: torch.Tensor, return_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, _, H, K = q.shape
    o = torch.empty_like(v)
    final = torch.empty((B, H, K, v.shape[-1]), dtype=torch.float32, device=v.device) if return_state else None
    return o, final


def _bind_prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
                  scale: float, operands: kda.StateOperands, C: int, dot_precision: str) -> Launch:
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
    num_stages: int | str = "auto", await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The prepare kernel, then kda's state pass; g None is DeltaNet. Returns (o, (S,) or None)."""
    choices = options(chunkwise=True)
    for name, value in (("chunk_size", chunk_size), ("precision", precision), ("block_v", block_v),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        _check_choice(name, value, choices[name][1])
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    dot_precision, num_stages = kda.resolve_state_pass(precision, num_stages, q.dtype, K)
    operands = kda.StateOperands.allocate(B, H, triton.cdiv(T, C), C, K, V, q.device, dot_precision, scalar_gate=True)
    o, final = _outputs(q, v, return_state)
    initial = state[0] if state is not None else None
    launch_after_checks(
        await_checks,
        _bind_prepare(q, k, v, beta, g, scale, operands, C, dot_precision),
        kda.bind_state_pass(operands, o, initial, final, T, C, block_v, dot_precision, num_warps, num_stages,
                            scalar_gate_inputs=(q, k)),
    )
    return o, ((final,) if return_state else None)


def recurrent(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor] | None, return_state: bool,
    block_v: int | None = None, num_warps: int = 4, await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The token-by-token kernel; g None is DeltaNet. Returns (o, (S,) or None)."""
    _check_choice("block_v", block_v, BLOCK_VS)
    _check_choice("num_warps", num_warps, NUM_WARPS)
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = min(block_v or (64 if BK <= 128 else 32), block_size(V))  # bounds the [K, BV] fp32 state tile
    o, final = _outputs(q, v, return_state)
    initial = state[0] if state is not None else None
    gated = g is not None
    launch_after_checks(await_checks, Launch(
        _recurrent_kernel, (triton.cdiv(V, BV), B * H),
        q, k, v, beta, g if gated else beta, initial if initial is not None else o, o,
        final if final is not None else o,
        T, H, K, V, float(scale),
        GATED=gated, HAS_INITIAL=initial is not None, STORE_FINAL=final is not None,
        BK=BK, BV=BV, num_warps=num_warps,
    ))
    return o, ((final,) if return_state else None)
