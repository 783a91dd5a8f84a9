"""Triton kernels shared by DeltaNet and Gated DeltaNet (FORMULATIONS.md, 8 and 9).

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

(DeltaNet is g = 0, compiled without the gate code.) Layout: q, k [B, T, H, K],
v and o [B, T, H, V], beta and g [B, T, H], the state S [B, H, K, V] in fp32.

Chunkwise form: seed 000's UT transform in the [K, V] layout, exactly as
oracles/_chunks.py's ``delta_chunk`` writes it. Within a chunk of C positions,
with chunk-local cumulative log gates G_t = sum_{s<=t} g_s (G = 0 ungated),
Gamma_tj = exp(G_t - G_j) for t >= j, and M the causal mask:

    L     = tril(Diag(beta) (K K^T * Gamma), -1)
    T     = (I + L)^-1 Diag(beta)                       (forward substitution in fp32)
    W     = T (K * exp(G)),  U = T V
    Delta = U - W S
    O     = scale exp(G) * (Q S) + (scale Q K^T * Gamma * M) Delta
    S'    = exp(G_C) S + K^T (exp(G_C - G) * Delta)

Every exponent is <= 0: pairwise differences are masked to -inf above the
diagonal before the exponential, and the others clamped to <= 0. G is kept
as an fp32 pair (a compensated scan), so that G_t - G_j is accurate to its
own size even when |G| reaches C * 20 inside a chunk.

Three launches, so that only two dots per chunk stay in the sequential part:

- ``_chunk_prepare_kernel`` (one program per chunk and head, all parallel):
  T in fp32, then W and U, written to memory with the chunk-local
  cumulative gates (G_hi, G_lo), so that the other two passes load G
  instead of repeating its scan (on the H200 the scan and the reductions
  for G_C cost the sequential state pass 8 barriers a chunk).
- ``_chunk_state_kernel`` (one program per head and block of V columns, the
  chunks in order): Delta = U - W S and the state update; writes each
  chunk's incoming state S and its Delta. It holds the transposed state
  S^T [BV, K], so that the per-V-column fp16 scale of S is a row maximum
  inside a quad of threads, and S^T and Delta^T enter their products from
  registers (held as [K, BV], the scale was a column maximum across the
  four warps through shared memory, every chunk); each chunk issues all of
  its loads first. Nsight Compute on the H200 (bench shape, gated): 105.6M
  instructions against fla's 43.7M before, 85.9M after; the pass took
  0.476 ms, now 0.389 (deltanet 0.424 -> 0.311; fla 0.21).
- ``_chunk_output_kernel`` (one program per chunk, head and block of 128 V
  columns, all parallel): O from Q, K, g, that chunk's S and Delta, the V
  block in slices of OUTPUT_V_SLICE columns (Q K^T once per block; 255
  registers and spills with the whole block at once: 0.33 -> 0.31 ms).

Precision (the ``precision`` option) decides how W, U, S, Delta are stored and
how each dot with an fp32 operand is done. Products of two input tiles (Q K^T,
K K^T) are exact in fp32 on tensor cores for fp16/bf16 inputs. "fp16 scaled"
below means: each row or column of an fp32 tile is multiplied by a power of
two that brings its peak into [2^14, 2^15), then rounded to fp16 (relative
error 2^-11, no overflow, small entries stay normal); the scale is undone
exactly on the fp32 result. bf16 and fp16 input tiles convert to fp16 exactly
this way.

- "mixed" (default for bf16 inputs): W and S fp16 scaled (one fp16 dot for
  W S and Q S, S stored in 16 bits), U and Delta fp32, the score block times
  Delta on bf16 hi/lo parts (x = hi + lo to 2^-16, three dots accumulated
  into O; bf16 keeps fp32's range, so no scale and no peak reduction: the
  fp16 hi/lo parts it replaces cost the output pass a row and a column
  reduction, 0.402 -> 0.325 ms on the H200, gated, at the bench shape).
  Emulated at K = V = 128, T = 64..4096: bf16 excess <= 1.03 on the
  registry's inputs; on the ill-conditioned regression (beta = 2, nearly
  parallel keys; fp16 inputs) 1.01 against the fp16 floor (tests), where
  rounding U or the score block to fp16 costs 1.5: their errors are
  amplified by the UT inverse's conditioning.
- "fp16" (SPEED_OPTIONS): W, U, S, Delta all fp16 scaled and W S, Q S and
  the score block times Delta one fp16 dot each: half the intermediate
  bytes, bf16 excess <= 1.04 on the registry's inputs but 1.5 on the
  regression.
- "split": fp32 intermediates; each fp32 operand split into bf16 hi + lo
  (2^-16) and multiplied as hi*hi + hi*lo + lo*hi.
- "tf32x3", "tf32", "ieee": fp32 intermediates; passed to ``tl.dot`` as
  ``input_precision`` (~2^-22, 2^-11 and exact fp32).
- "auto" (default): "mixed" for bf16 inputs, "tf32x3" for fp16 inputs (the
  fp16 output rounding, 2^-11, is too fine for fp16-rounded W and S: excess
  ~1.8 emulated), "ieee" for fp32 inputs (whose target is fp32 rounding).

In "mixed" and "fp16" the state update K^T Delta splits Delta into bf16 hi + lo (2^-16)
against the exact input K: two dots, and no conversion of K.

In the 16-bit modes ("mixed", "fp16") T's inverse uses tf32x3 dots (its merge
errors are amplified by the inverse's conditioning) and W = T K, U = T V bf16
hi/lo T against the exact K, V (2 dots, 2^-16, amplified only ~3x); else both
use the chosen precision.

The inverse (``_unit_lower_inverse``) is latency-bound: one program per
chunk and head, two resident per SM. Its diagonal SUB x SUB blocks (16) are
inverted by substitution on one [C/16, 16, 16] tile, the K K^T accumulator
reshaped, so that each step's reductions stay inside a warp (masked [C, C]
tiles cost ~4x the instructions per step and 3 barriers); then log2(C/16)
merge levels of two dots each on the full tile, tf32x3 written out
(``_mm_into``: tl.dot's split, but accumulated on the tensor cores and
without its NaN clean-up of the small products). On the H200 (B=8, T=4096,
H=16, K=V=128, bf16) this took the prepare pass from 0.66 to 0.42 ms
(deltanet) and 0.71 to 0.47 ms (gated); 8-blocks with 3 levels took 0.46 /
0.51, at the same accuracy (excess 1.011 / 1.000 at T=1024).

Under the Triton interpreter bf16 arithmetic is broken, so "split" rounds to
bf16 by integer RTNE on the fp32 bit pattern and multiplies the parts as fp32
(exact, like the tensor cores' bf16 products); tf32 precisions are exact fp32
there.

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

from ._util import block_size, no_pending_checks

PRECISIONS = ("auto", "mixed", "fp16", "split", "tf32x3", "tf32", "ieee")
# When the intermediates are 16-bit: the dots of T's inverse (tf32x3, ~2^-22: its merge products'
# errors are amplified by the inverse's conditioning, ~4000x on the regression) and of W = T K,
# U = T V (bf16 hi/lo T, 2^-16, against the exact 16-bit K and V: amplified only by |T||V| / |U| ~ 3).
PREPARE_PRECISION_16 = "tf32x3"
PRODUCT_PRECISION_16 = "split"
CHUNK_SIZES = (16, 32, 64)
BLOCK_VS = (None, 16, 32, 64, 128)
# The chunkwise kernels offer only V blocks of 64 and 128: at 32 the H200 build (Triton 3.6, bf16 inputs,
# K = V = 128) gave wrong outputs (gated, excess 715) or an illegal memory access (ungated), which the
# interpreter does not reproduce; not understood yet.
CHUNKWISE_BLOCK_VS = (None, 64, 128)
# 4 warps for every launch: on an H200 (B=8, T=4096, H=16, K=V=128, bf16, gated) the state pass at 4 warps
# took 0.49 ms against 0.77 at 8 (two programs resident per SM instead of one), the others unchanged.
NUM_WARPS = (1, 2, 4, 8)
NUM_STAGES = (1, 2, 3)
# Columns of S, Delta and O the output pass holds at once (its V block is walked in slices of this many).
OUTPUT_V_SLICE = 64
# Diagonal blocks of T are inverted by substitution at this size, then merged by dots. On
# [C/SUB, SUB, SUB] tiles a step costs under a tenth of a merge level in instructions; at C = 64 the sm_90
# build (ptxas) has 3750 instructions and 18 barriers with 16 steps + 2 levels, 3940 and 22 with 8 + 3,
# 6260 and 110 with 32 + 1 (its reductions cross warps). The masked [C, C] substitution with Triton's
# tf32x3 merges it replaces had ~7800 (8 steps + 3 levels) and ~41. Timed on the H200: 16 beat 8 (module
# docstring).
SUB = tl.constexpr(16)
# fp16 scaling puts each row's or column's peak in [2^14, 2^15); the scale itself stays in [2^-100, 2^100].
FP16_PEAK_EXPONENT = tl.constexpr(14)
SCALE_EXPONENT_LIMIT = tl.constexpr(100)


def options(chunkwise: bool) -> dict[str, tuple]:
    """The kernel options of one form, as kernels/__init__.py's OPTIONS entry."""
    common = {"block_v": (None, BLOCK_VS), "num_warps": (4, NUM_WARPS)}
    if not chunkwise:
        return common
    return {"chunk_size": (64, CHUNK_SIZES), "precision": ("auto", PRECISIONS), "num_stages": (1, NUM_STAGES), **common,
            "block_v": (None, CHUNKWISE_BLOCK_VS)}


# The fast setting: every intermediate in 16 bits (see the module docstring for its accuracy).
SPEED_OPTIONS = {"precision": "fp16"}


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
def _power_of_two(exponent):
    """2^exponent in fp32 for an int32 exponent in [-126, 127], built from the bit pattern (exact)."""
    return ((exponent + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp16_parts(x, ROWS: tl.constexpr, SPLIT: tl.constexpr):
    """x = (hi + lo) * inverse, per row (ROWS) or column: hi, lo fp16, inverse a power of two.

    Each row (column) is scaled by the power of two that puts its peak in
    [2^14, 2^15), so nothing overflows fp16 and entries down to 2^-28 of the
    peak stay normal. hi carries x to 2^-11; with SPLIT, lo = the rest to
    another 2^-11 (x = hi + lo to ~2^-22), else lo is hi (unused). A 16-bit
    input tile converts exactly (its 8 or 11 significant bits fit).
    """
    x = x.to(tl.float32)
    if ROWS:
        peak = tl.max(tl.abs(x), axis=1)
    else:
        peak = tl.max(tl.abs(x), axis=0)
    # floor(log2(peak)) from the exponent field; 0 and subnormal peaks get the largest scale.
    exponent = ((peak.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    shift = tl.minimum(tl.maximum(FP16_PEAK_EXPONENT - exponent, -SCALE_EXPONENT_LIMIT), SCALE_EXPONENT_LIMIT)
    if ROWS:
        scaled = x * _power_of_two(shift)[:, None]
    else:
        scaled = x * _power_of_two(shift)[None, :]
    hi = scaled.to(tl.float16)
    if SPLIT:
        lo = (scaled - hi.to(tl.float32)).to(tl.float16)
    else:
        lo = hi
    return hi, lo, _power_of_two(-shift)


@triton.jit
def _fp16_scaled(x, ROWS: tl.constexpr):
    """x ~ x16 * inverse to 2^-11, x16 fp16 scaled per row (ROWS) or column: _fp16_parts' hi part."""
    x16, _, inverse = _fp16_parts(x, ROWS, False)
    return x16, inverse


@triton.jit
def _mm_fp16(a, b, PRECISION: tl.constexpr):
    """a @ b for the fp16-scaled precisions: "fp16" rounds each side to fp16 scaled per row of a and
    column of b (one dot); "fp16x3" multiplies fp16 scaled hi/lo parts (a 16-bit input side is exact
    in fp16: two dots). The scales are undone on the fp32 product."""
    SPLIT_A: tl.constexpr = PRECISION == "fp16x3" and a.dtype == tl.float32
    SPLIT_B: tl.constexpr = PRECISION == "fp16x3" and b.dtype == tl.float32
    a_hi, a_lo, a_inverse = _fp16_parts(a, True, SPLIT_A)
    b_hi, b_lo, b_inverse = _fp16_parts(b, False, SPLIT_B)
    out = tl.dot(a_hi, b_hi)
    if SPLIT_B:
        out = tl.dot(a_hi, b_lo, out)
    if SPLIT_A:
        out = tl.dot(a_lo, b_hi, out)
    return out * a_inverse[:, None] * b_inverse[None, :]


@triton.jit
def _mm_into(a, b, acc, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """acc + a @ b with fp32 accumulation; a and b are input tiles (fp16/bf16/fp32) or fp32 tiles.

    Two 16-bit tiles of one dtype go straight to the tensor cores (exact
    products). Otherwise PRECISION decides: "split" multiplies bf16 hi/lo parts
    (a bf16 operand is its own hi part); "tf32x3" is tl.dot's written out (the
    same split: hi rounded to tf32, lo the exact rest, truncated to tf32 by the
    tensor cores; without its NaN clean-up of the small products, which only an
    infinite input needs); "fp16" and "fp16x3" are _mm_fp16's; anything else is
    tl.dot's input_precision. Every product but the fp16-scaled ones (whose
    scales are undone on their result) accumulates into acc on the tensor
    cores: one fp32 tile of registers, where a sum of products held one a
    product (the prepare pass's [C, K] W at 240-255 registers).
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
        if tl.constexpr(a.dtype == tl.bfloat16):
            b_hi, b_lo = _bf16_parts(b.to(tl.float32), EMULATE_BF16)
            acc = tl.dot(a, b_lo, acc)
            acc = tl.dot(a, b_hi, acc)
        elif tl.constexpr(b.dtype == tl.bfloat16):
            a_hi, a_lo = _bf16_parts(a.to(tl.float32), EMULATE_BF16)
            acc = tl.dot(a_lo, b, acc)
            acc = tl.dot(a_hi, b, acc)
        else:
            a_hi, a_lo = _bf16_parts(a.to(tl.float32), EMULATE_BF16)
            b_hi, b_lo = _bf16_parts(b.to(tl.float32), EMULATE_BF16)
            acc = tl.dot(a_hi, b_lo, acc)
            acc = tl.dot(a_lo, b_hi, acc)
            acc = tl.dot(a_hi, b_hi, acc)
    elif PRECISION == "fp16" or PRECISION == "fp16x3":
        acc += _mm_fp16(a, b, PRECISION)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """a @ b with fp32 accumulation, at PRECISION (see _mm_into)."""
    if PRECISION == "fp16" or PRECISION == "fp16x3":
        out = _mm_fp16(a, b, PRECISION)
    else:
        out = _mm_into(a, b, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), PRECISION, EMULATE_BF16)
    return out


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
def _chunk_gates(gate_hi_ptr, gate_lo_ptr, row, valid):
    """The chunk's (G_hi, G_lo), as the prepare pass stored them at rows ``row`` (0 past the sequence end)."""
    return (tl.load(gate_hi_ptr + row, mask=valid, other=0.0), tl.load(gate_lo_ptr + row, mask=valid, other=0.0))


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


@triton.jit
def _chunk_prepare_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr, gate_hi_ptr, gate_lo_ptr, w_ptr, w_inverse_ptr, u_ptr, u_inverse_ptr,
    T, H, K, V,
    GATED: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, LEVELS: tl.constexpr,
    PRECISION: tl.constexpr, PRODUCT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
    STATE16: tl.constexpr, VALUE16: tl.constexpr,
):
    """The state-independent part of one chunk of one head:

      T = (I + L)^-1 Diag(beta),  L = tril(Diag(beta) (K K^T * Gamma), -1)   (dots at PRECISION)
      W = (T * exp(G)^T) K  -> w [B*H, T, K]: fp16 scaled per row with STATE16 (inverse scales in
                             w_inverse [B*H, T]), else fp32
      U = T V             -> u [B*H, T, V]: fp16 scaled per column of the chunk with VALUE16 (inverse
                             scales in u_inverse [B*H, NT, V]), else fp32

    W and U are dots at PRODUCT_PRECISION, exp(G) going into T's columns so
    that K stays an exact input tile. G_hi, G_lo -> gate_hi, gate_lo [B*H, T] (GATED). Grid (NT, B*H). Rows past the sequence end load k = beta = g = 0, so their
    rows and columns of T are 0; they are not stored.
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    pos = chunk * BC + tl.arange(0, BC)
    valid = pos < T
    token = (b * T + pos).to(tl.int64) * H + h
    kcol = tl.arange(0, BK)
    k_mask = valid[:, None] & (kcol[None, :] < K)
    k = tl.load(k_ptr + token[:, None] * K + kcol[None, :], mask=k_mask, other=0.0)
    beta = tl.load(beta_ptr + token, mask=valid, other=0.0).to(tl.float32)

    rows = tl.arange(0, BC)[:, None]
    cols = tl.arange(0, BC)[None, :]
    L = beta[:, None] * _mm(k, tl.trans(k), PRECISION, EMULATE_BF16)
    row = bh.to(tl.int64) * T + pos  # the chunk's rows of w, u and the gates
    if GATED:
        G_hi, G_lo = _chunk_cumulative_gate(g_ptr, token, valid)
        tl.store(gate_hi_ptr + row, G_hi, mask=valid)
        tl.store(gate_lo_ptr + row, G_lo, mask=valid)
        L = L * _pairwise_decay(G_hi, G_lo, BC)
    L = tl.where(rows > cols, L, 0.0)
    ut = _unit_lower_inverse(L, BC, LEVELS, PRECISION, EMULATE_BF16) * beta[None, :]

    if GATED:
        w = _mm(ut * tl.exp(tl.minimum(G_hi + G_lo, 0.0))[None, :], k, PRODUCT_PRECISION, EMULATE_BF16)
    else:
        w = _mm(ut, k, PRODUCT_PRECISION, EMULATE_BF16)
    if STATE16:
        w, w_inverse = _fp16_scaled(w, True)
        tl.store(w_inverse_ptr + row, w_inverse, mask=valid)
    tl.store(w_ptr + row[:, None] * K + kcol[None, :], w, mask=k_mask)

    for v0 in range(0, V, BV):
        vcol = v0 + tl.arange(0, BV)
        v_mask = valid[:, None] & (vcol[None, :] < V)
        v = tl.load(v_ptr + token[:, None] * V + vcol[None, :], mask=v_mask, other=0.0)
        u = _mm(ut, v, PRODUCT_PRECISION, EMULATE_BF16)
        if VALUE16:
            u, u_inverse = _fp16_scaled(u, False)
            tl.store(u_inverse_ptr + (bh.to(tl.int64) * tl.num_programs(0) + chunk) * V + vcol, u_inverse,
                     mask=vcol < V)
        tl.store(u_ptr + row[:, None] * V + vcol[None, :], u, mask=v_mask)


# --------------------------------------------------------------------------- state pass


@triton.jit
def _chunk_state_kernel(
    k_ptr, gate_hi_ptr, gate_lo_ptr, w_ptr, w_inverse_ptr, u_ptr, u_inverse_ptr, s0_ptr,
    h_ptr, h_inverse_ptr, d_ptr, d_inverse_ptr, s_out_ptr,
    T, H, K, V,
    GATED: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, UPDATE_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr, STATE16: tl.constexpr,
    VALUE16: tl.constexpr,
):
    """The chunks of one head in order, for V columns [BV * pid0, BV * (pid0 + 1)), on the transposed
    state S^T [BV, K]. Per chunk:

      h       <- S^T (the state entering the chunk)
      Delta^T  = U^T - S^T W^T                                      -> d (as Delta)
      S^T     <- exp(G_C) S^T + (exp(G_C - G) * Delta)^T K

    Transposed, every per-V-column quantity is a row of a tile: the fp16 scale of S's columns is a row
    maximum, inside a quad of threads (S [K, BV] needed a column maximum across the 4 warps, through
    shared memory and a barrier, every chunk), and S^T and Delta^T enter their products as the first
    operand, straight from registers. With STATE16, S^T enters S^T W^T (and h) fp16 scaled per row
    (inverse scales in h_inverse [B*H, NT, V]); with VALUE16, Delta is stored the same way (d_inverse),
    else in fp32. Delta^T K is done at UPDATE_PRECISION. h is [B*H, NT, V, K]. Grid (cdiv(V, BV), B*H).
    """
    vblock = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kcol = tl.arange(0, BK)
    vrow = vblock * BV + tl.arange(0, BV)
    k_in, v_in = kcol < K, vrow < V
    state_mask = v_in[:, None] & k_in[None, :]
    # S^T [BV, K] as S [B, H, K, V] is laid out: entry (v, k) at k * V + v.
    state_offsets = bh.to(tl.int64) * K * V + kcol[None, :] * V + vrow[:, None]
    if HAS_INITIAL:
        S = tl.load(s0_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BV, BK], dtype=tl.float32)

    n_chunks = tl.cdiv(T, BC)
    for chunk in range(0, n_chunks):
        pos = chunk * BC + tl.arange(0, BC)
        valid = pos < T
        token = (b * T + pos).to(tl.int64) * H + h
        row = bh.to(tl.int64) * T + pos
        k_mask = valid[:, None] & k_in[None, :]
        vt_mask = v_in[:, None] & valid[None, :]
        per_chunk = (bh.to(tl.int64) * n_chunks + chunk) * V + vrow  # h_inverse, u_inverse, d_inverse
        h_offsets = (bh.to(tl.int64) * n_chunks + chunk) * V * K + vrow[:, None] * K + kcol[None, :]
        vt_offsets = row[None, :] * V + vrow[:, None]  # [BV, BC] tiles of u and d, transposed
        # Every load of the chunk first, so that their latencies overlap one another and the products.
        w = tl.load(w_ptr + row[:, None] * K + kcol[None, :], mask=k_mask, other=0.0)
        k = tl.load(k_ptr + token[:, None] * K + kcol[None, :], mask=k_mask, other=0.0)
        u = tl.load(u_ptr + vt_offsets, mask=vt_mask, other=0.0).to(tl.float32)
        if VALUE16:
            u = u * tl.load(u_inverse_ptr + per_chunk, mask=v_in, other=1.0)[:, None]
        if GATED:
            G_hi, G_lo = _chunk_gates(gate_hi_ptr, gate_lo_ptr, row, valid)
            last = bh.to(tl.int64) * T + tl.minimum(chunk * BC + BC, T) - 1
            G_end_hi, G_end_lo = tl.load(gate_hi_ptr + last), tl.load(gate_lo_ptr + last)
            delta_decay = tl.exp(_gate_difference(G_end_hi, G_end_lo, G_hi, G_lo))  # exp(G_C - G_t)
            state_decay = tl.exp(tl.minimum(G_end_hi + G_end_lo, 0.0))  # exp(G_C)
        if STATE16:
            w_inverse = tl.load(w_inverse_ptr + row, mask=valid, other=1.0)
            S16, s_inverse = _fp16_scaled(S, True)
            tl.store(h_ptr + h_offsets, S16, mask=state_mask)
            tl.store(h_inverse_ptr + per_chunk, s_inverse, mask=v_in)
            delta = u - tl.dot(S16, tl.trans(w)) * s_inverse[:, None] * w_inverse[None, :]
        else:
            tl.store(h_ptr + h_offsets, S, mask=state_mask)
            delta = u - _mm(S, tl.trans(w), PRECISION, EMULATE_BF16)
        if VALUE16:
            d16, d_inverse = _fp16_scaled(delta, True)
            tl.store(d_ptr + vt_offsets, d16, mask=vt_mask)
            tl.store(d_inverse_ptr + per_chunk, d_inverse, mask=v_in)
        else:
            tl.store(d_ptr + vt_offsets, delta, mask=vt_mask)

        if GATED:
            delta = delta * delta_decay[None, :]
            S = S * state_decay
        S = _mm_into(delta, k, S, UPDATE_PRECISION, EMULATE_BF16)

    if STORE_FINAL:
        tl.store(s_out_ptr + state_offsets, S, mask=state_mask)


# --------------------------------------------------------------------------- output pass


@triton.jit
def _chunk_output_kernel(
    q_ptr, k_ptr, gate_hi_ptr, gate_lo_ptr, h_ptr, h_inverse_ptr, d_ptr, d_inverse_ptr, o_ptr,
    T, H, K, V, scale,
    GATED: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, V_SLICES: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr, STATE16: tl.constexpr, VALUE16: tl.constexpr,
):
    """O = scale exp(G) * (Q S) + (scale Q K^T * Gamma * M) Delta for one chunk, head and V block.

    S and Delta are the state pass's h and d (fp16 scaled or fp32, as there).
    Grid (NT, B*H, cdiv(V, BV)).
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    vblock = tl.program_id(2)
    b, h = bh // H, bh % H
    pos = chunk * BC + tl.arange(0, BC)
    valid = pos < T
    token = (b * T + pos).to(tl.int64) * H + h
    row = bh.to(tl.int64) * T + pos
    kcol = tl.arange(0, BK)
    k_in = kcol < K
    k_mask = valid[:, None] & k_in[None, :]
    chunk_base = bh.to(tl.int64) * tl.num_programs(0) + chunk  # this chunk's index in [B*H, NT]

    q = tl.load(q_ptr + token[:, None] * K + kcol[None, :], mask=k_mask, other=0.0)
    k = tl.load(k_ptr + token[:, None] * K + kcol[None, :], mask=k_mask, other=0.0)
    # scale exp(G_t), per row of O (exp(G) = 1 ungated): one factor for the Q S product's rows.
    row_factor = tl.full([BC], scale, tl.float32)
    if GATED:
        G_hi, G_lo = _chunk_gates(gate_hi_ptr, gate_lo_ptr, row, valid)
        row_factor = row_factor * tl.exp(tl.minimum(G_hi + G_lo, 0.0))
    rows = tl.arange(0, BC)[:, None]
    cols = tl.arange(0, BC)[None, :]
    scores = scale * _mm(q, tl.trans(k), PRECISION, EMULATE_BF16)
    if GATED:
        scores = scores * _pairwise_decay(G_hi, G_lo, BC)
    else:
        scores = tl.where(rows >= cols, scores, 0.0)

    if STATE16:
        q16, q_inverse = _fp16_scaled(q, True)
        row_factor = row_factor * q_inverse
    # The V block in slices of VS columns: Q K^T and its splits once per block, the [K, VS] and [BC, VS]
    # tiles of S, Delta and O one slice at a time (at VS = BV = 128 the program held 255 registers and
    # spilled).
    VS: tl.constexpr = BV // V_SLICES
    for slice_index in tl.static_range(V_SLICES):
        scol = vblock * BV + slice_index * VS + tl.arange(0, VS)
        s_in = scol < V
        S = tl.load(h_ptr + chunk_base * V * K + scol[None, :] * K + kcol[:, None], mask=k_in[:, None] & s_in[None, :],
                    other=0.0)  # h holds S^T
        if STATE16:
            s_inverse = tl.load(h_inverse_ptr + chunk_base * V + scol, mask=s_in, other=1.0)
            o = tl.dot(q16, S) * row_factor[:, None] * s_inverse[None, :]
        else:
            o = _mm(q, S, PRECISION, EMULATE_BF16) * row_factor[:, None]
        slice_mask = valid[:, None] & s_in[None, :]
        delta = tl.load(d_ptr + row[:, None] * V + scol[None, :], mask=slice_mask, other=0.0)
        if VALUE16:
            scores16, scores_inverse = _fp16_scaled(scores, True)
            d_inverse = tl.load(d_inverse_ptr + chunk_base * V + scol, mask=s_in, other=1.0)
            o += tl.dot(scores16, delta) * scores_inverse[:, None] * d_inverse[None, :]
        else:
            o = _mm_into(scores, delta, o, PRECISION, EMULATE_BF16)
        tl.store(o_ptr + token[:, None] * V + scol[None, :], o.to(o_ptr.dtype.element_ty), mask=slice_mask)


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


def _block_v(V: int, block_v: int | None, default: int = 64) -> int:
    """V columns per program of the state pass or the recurrent kernel: the option, else ``default``."""
    return min(block_v or default, block_size(V))


def _output_block_v(V: int, block_v: int | None) -> int:
    """V columns per program of the output pass: the option, else up to 128 (Q K^T is computed once per
    block: 0.41 ms against 0.48 at 64 on the H200 at V = 128)."""
    return min(block_v or 128, block_size(V))


def _resolve_precision(precision: str, dtype: torch.dtype) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}")
    if precision == "auto":
        return {torch.float32: "ieee", torch.float16: "tf32x3"}.get(dtype, "mixed")
    return precision


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _outputs(q: torch.Tensor, v: torch.Tensor, return_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, _, H, K = q.shape
    o = torch.empty_like(v)
    final = torch.empty((B, H, K, v.shape[-1]), dtype=torch.float32, device=v.device) if return_state else None
    return o, final


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor] | None, return_state: bool,
    chunk_size: int = 64, precision: str = "auto", block_v: int | None = None, num_warps: int = 4,
    num_stages: int = 1, await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The chunkwise UT-transform kernels; g None is DeltaNet. Returns (o, (S,) or None)."""
    _check_choice("chunk_size", chunk_size, CHUNK_SIZES)
    _check_choice("num_stages", num_stages, NUM_STAGES)
    _check_choice("block_v", block_v, CHUNKWISE_BLOCK_VS)
    _check_choice("num_warps", num_warps, NUM_WARPS)
    resolved = _resolve_precision(precision, q.dtype)
    state16 = resolved in ("mixed", "fp16")  # W and S in fp16
    value16 = resolved == "fp16"  # U and Delta in fp16
    dot_precision = {"mixed": "split"}.get(resolved, resolved)
    # K^T Delta in the state pass: bf16 hi/lo Delta (2^-16) against the exact input K, two dots.
    update_precision = "split" if state16 else resolved
    prepare_precision = PREPARE_PRECISION_16 if state16 else resolved
    product_precision = PRODUCT_PRECISION_16 if state16 else resolved
    modes = dict(EMULATE_BF16=(resolved == "split" or state16) and interpreter_active(), STATE16=state16,
                 VALUE16=value16)
    B, T, H, K = q.shape
    V = v.shape[-1]
    BC, BK, BV = chunk_size, block_size(K), _block_v(V, block_v)
    n_chunks = triton.cdiv(T, BC)
    gated = g is not None
    g_arg = g if gated else beta  # an unused pointer when ungated
    o, final = _outputs(q, v, return_state)

    def buffer(*shape: int, low: bool) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float16 if low else torch.float32, device=q.device)

    w, u = buffer(B * H, T, K, low=state16), buffer(B * H, T, V, low=value16)
    h, d = buffer(B * H, n_chunks, V, K, low=state16), buffer(B * H, T, V, low=value16)  # h: each chunk's S^T
    # Inverse scales of the fp16 tiles (allocated small and unused in the fp32 modes).
    w_inverse = buffer(B * H, T if state16 else 1, low=False)
    h_inverse = buffer(B * H, n_chunks if state16 else 1, V, low=False)
    u_inverse, d_inverse = (buffer(B * H, n_chunks if value16 else 1, V, low=False) for _ in range(2))
    # The chunk-local cumulative gates (G_hi, G_lo), computed once by the prepare pass for the other two.
    gate_hi, gate_lo = (buffer(B * H, T if gated else 1, low=False) for _ in range(2))
    await_checks()
    _chunk_prepare_kernel[(n_chunks, B * H)](
        k, v, beta, g_arg, gate_hi, gate_lo, w, w_inverse, u, u_inverse, T, H, K, V,
        GATED=gated, BC=BC, BK=BK, BV=min(64, block_size(V)), LEVELS=int(math.log2(BC // SUB.value)),
        PRECISION=prepare_precision, PRODUCT_PRECISION=product_precision, num_warps=num_warps, **modes,
    )
    initial = state[0] if state is not None else None
    _chunk_state_kernel[(triton.cdiv(V, BV), B * H)](
        k, gate_hi, gate_lo, w, w_inverse, u, u_inverse, w if initial is None else initial,
        h, h_inverse, d, d_inverse, w if final is None else final, T, H, K, V,
        GATED=gated, HAS_INITIAL=initial is not None, STORE_FINAL=final is not None,
        BC=BC, BK=BK, BV=BV, PRECISION=dot_precision, UPDATE_PRECISION=update_precision,
        num_warps=num_warps, num_stages=num_stages, **modes,
    )
    output_block_v = _output_block_v(V, block_v)
    _chunk_output_kernel[(n_chunks, B * H, triton.cdiv(V, output_block_v))](
        q, k, gate_hi, gate_lo, h, h_inverse, d, d_inverse, o, T, H, K, V, float(scale),
        GATED=gated, BC=BC, BK=BK, BV=output_block_v, V_SLICES=max(1, output_block_v // OUTPUT_V_SLICE),
        PRECISION=dot_precision, num_warps=num_warps, **modes,
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
    BV = _block_v(V, block_v, 64 if BK <= 128 else 32)  # bounds the [K, BV] fp32 state tile
    o, final = _outputs(q, v, return_state)
    initial = state[0] if state is not None else None
    gated = g is not None
    await_checks()
    _recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, beta, g if gated else beta, initial if initial is not None else o, o,
        final if final is not None else o,
        T, H, K, V, float(scale),
        GATED=gated, HAS_INITIAL=initial is not None, STORE_FINAL=final is not None,
        BK=BK, BV=BV, num_warps=num_warps,
    )
    return o, ((final,) if return_state else None)
