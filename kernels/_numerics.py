"""Triton numerics shared by the kernel modules: how fp32 values enter 16-bit tensor-core dots, and the UT inverse.

Every helper is a ``@triton.jit`` function (inlined into the kernel that calls it) unless it is one of the few
host-side functions at the end of a section, which pick a helper's constexpr arguments for a launch.

- Power-of-two scaling (``pow2_scale``): a scale 2^s that moves a tile's peak into one binade, so that the tile
  rounds to fp16 without overflow and with fp16's full 11 bits; a power of two is exact both ways.
- Operands stored and multiplied through fp16 (``scaled_dot`` and the ``*_scratch`` helpers), the "fp16"
  precision of kda and the delta rules.
- hi/lo splits (``split``, ``bf16_split``, ``tf32_split``) and the dots built on them: an fp32 operand carried as
  two 16-bit (or TF32) parts, each product exact on the tensor cores, about 2^-16 (bf16) to 2^-22 (fp16, TF32)
  relative per operand.
- Gate sums (``span_sums``): direct sums of log gates as a 0/1 matrix times the gates.
- The UT inverse (``unit_lower_inverse``): (I + L)^-1 of a strictly lower-triangular L in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.runtime import interpreter_active

# ------------------------------------------------------------------------------------------------ peaks and scales


@triton.jit
def peak(x):
    """max |x| over a whole tile (a scalar)."""
    return tl.max(tl.abs(x))


@triton.jit
def pow2_scale(peak, EXPONENT: tl.constexpr):
    """Powers of two (2^s, 2^-s) with peak * 2^s in [2^EXPONENT, 2^(EXPONENT + 1)), for a scalar peak or a
    vector of peaks (>= 0): x * 2^s of any |x| <= peak then rounds to fp16 without overflow (EXPONENT 13 or 14,
    below fp16's 65504) and with fp16's 11 bits down to 2^-(EXPONENT + 14) of the peak. Built from the exponent
    field of ``peak`` rather than from exp2/log2, whose GPU approximations can miss a binade, so both factors
    are exact.

    One set of clamps serves every use. The biased exponent field of 2^s is clamped to [1, 253], so that 2^s
    and 2^-s are both normal fp32 numbers (2^-126 .. 2^126): products with either stay exact power-of-two
    rescalings, and an all-zero tile (peak 0) gets the largest scale, 2^126, harmlessly (0 * 2^126 = 0). No
    finite peak meets the lower clamp (the largest, just under 2^128, gets 2^(EXPONENT - 127)), so every
    finite peak of at least 2^(EXPONENT - 126) lands in the target binade and none can overflow fp16. A
    narrower clamp such as 2^-100 .. 2^100 would put peaks from 2^(EXPONENT + 101) above the binade (and into
    fp16 overflow two binades later) and leave peaks below 2^(EXPONENT - 100) under it, their small entries
    fp16-subnormal. A non-finite peak (an inf or NaN in the tile) gets 1: no scale could fit it, and 1 keeps
    the tile's finite entries as they are, where the scale its exponent field asks for, 2^(EXPONENT - 128),
    would round them to zero.
    """
    biased = (peak.to(tl.int32, bitcast=True) >> 23) & 0xFF
    field = tl.where(biased == 0xFF, 127, tl.minimum(tl.maximum((254 + EXPONENT) - biased, 1), 253))
    return (field << 23).to(tl.float32, bitcast=True), ((254 - field) << 23).to(tl.float32, bitcast=True)


# ------------------------------------------------------------------------------------------------ fp16 operands

# Dot precisions the Triton interpreter's builder accepts; it computes all of them exactly in fp32.
INTERPRETER_PRECISIONS = ("tf32", "tf32x3", "ieee")


@triton.jit
def scaled_dot(a, b, PRECISION: tl.constexpr):
    """a @ b of fp32 tiles: "bf16" rounds both operands to bf16 first (one bf16 tensor-core
    product, as fla does); "fp16" scales each operand by a power of two (exact) into fp16's
    range and rounds it to fp16 (one fp16 product, 2^-11 relative per operand, 4x below bf16's);
    "bf16_emulated" and "fp16_emulated" are the same roundings for the Triton interpreter,
    whose 16-bit dots are wrong (it multiplies the rounded values as fp32 exactly); any other
    PRECISION is tl.dot's input_precision."""
    if PRECISION == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PRECISION == "bf16_emulated":
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    elif PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return scaled_dot_within(a, peak(a), b, peak(b), PRECISION)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def scaled_dot_within(a, a_peak, b, b_peak, PRECISION: tl.constexpr):
    """scaled_dot for operands known to lie within |a| <= a_peak and |b| <= b_peak: "fp16" takes its
    scales from these bounds instead of from a max-reduction over each tile (a barrier across
    the warps). An operand far below its bound keeps 2^-11 relative error down to 2^-27 of
    the bound, where fp16 goes subnormal (such terms are that much smaller than the largest)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return dot_scratch(to_scratch(a, a_peak, PRECISION), a_peak, b, b_peak, PRECISION)
    else:
        return scaled_dot(a, b, PRECISION)


@triton.jit
def to_scratch(a, a_bound, PRECISION: tl.constexpr):
    """An operand as it is stored between kernels: for "fp16" scaled by the power of two of its
    bound |a| <= a_bound and rounded to fp16, the rounding its product would do anyway (half the
    bytes of fp32), else unchanged (fp32)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        a_up, _ = pow2_scale(a_bound, 13)
        return (a * a_up).to(tl.float16)
    else:
        return a


@triton.jit
def scratch_residual(a, a_stored, a_bound):
    """What the "fp16" to_scratch left out of ``a`` (stored as ``a_stored`` against ``a_bound``), on the same scale
    and rounded to fp16 in turn: a_stored + this is ``a`` to about 2^-22 (each fp16 value 2^-11 of its own size),
    so that a product that cancels can take both tiles where one would keep only the first's 2^-11."""
    a_up, _ = pow2_scale(a_bound, 13)
    return (a * a_up - a_stored.to(tl.float32)).to(tl.float16)


@triton.jit
def from_scratch(a, a_bound, PRECISION: tl.constexpr):
    """The fp32 value of an operand that to_scratch stored with the same bound (unscaled for "fp16")."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        _, a_down = pow2_scale(a_bound, 13)
        return a.to(tl.float32) * a_down
    else:
        return a


@triton.jit
def dot_scratch(a, a_bound, b, b_peak, PRECISION: tl.constexpr):
    """a @ b for an operand a as to_scratch made it (with the same bound) and an fp32 b, |b| <= b_peak."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return dot_scratches(a, a_bound, to_scratch(b, b_peak, PRECISION), b_peak, PRECISION)
    else:
        return scaled_dot(a, b, PRECISION)


@triton.jit
def dot_scratches(a, a_bound, b, b_bound, PRECISION: tl.constexpr):
    """a @ b for two operands as to_scratch made them (with these bounds): for "fp16" one fp16 product of the
    stored tiles as they are, no scale taken from the tiles (no max-reduction), the two bounds' powers of two
    applied to the fp32 result; otherwise scaled_dot of the fp32 operands."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        _, a_down = pow2_scale(a_bound, 13)
        _, b_down = pow2_scale(b_bound, 13)
        if PRECISION == "fp16":
            product = tl.dot(a, b)
        else:
            product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return product * (a_down * b_down)
    else:
        return scaled_dot(a, b, PRECISION)


def dot_precision(precision: str) -> str:
    """The PRECISION of scaled_dot and the scratch helpers for a ``precision`` option other than "auto" (which the
    caller resolves by the inputs: _state_pass.auto_precision): the option itself, but under the interpreter "bf16"
    and "fp16" become their emulations, and "bf16x3", which its builder does not know, "ieee"."""
    if interpreter_active() and precision not in INTERPRETER_PRECISIONS:
        # "bf16" and "fp16" are no input_precision (scaled_dot casts the operands itself), and the interpreter's
        # 16-bit dots are wrong: round the operands and multiply them in fp32 instead.
        precision = {"bf16": "bf16_emulated", "fp16": "fp16_emulated"}.get(precision, "ieee")
    return precision


# ------------------------------------------------------------------------------------------------ hi/lo splits


@triton.jit
def split(x, DTYPE: tl.constexpr):
    """fp32 x = hi + lo, hi and lo in DTYPE (hi = x rounded, lo = the remainder rounded): x to about 2^-16
    relative in bf16, 2^-22 in fp16 (where neither part leaves fp16's range)."""
    hi = x.to(DTYPE)
    return hi, (x - hi.to(tl.float32)).to(DTYPE)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32: integer RTNE on the bit pattern."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def bf16_split(x, EMULATE_BF16: tl.constexpr):
    """x (fp32) = hi + lo + O(2^-17 |x|) with hi, lo bf16 values (fp32 carriers when emulating: the Triton
    interpreter computes bf16 on raw bit patterns, so the rounding is done by integer RTNE instead)."""
    if EMULATE_BF16:
        hi = _round_to_bf16(x)
        lo = _round_to_bf16(x - hi)
    else:
        hi, lo = split(x, tl.bfloat16)
    return hi, lo


@triton.jit
def tf32_split(x):
    """x = hi + lo with hi = x rounded to tf32 (to nearest, ties away: cvt.rna's rounding, by integer ops)."""
    hi = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def split_dot_into(a, b, acc, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """acc + a @ b with fp32 accumulation; a and b are input tiles (fp16/bf16/fp32) or fp32 tiles.

    Two 16-bit tiles of one dtype go straight to the tensor cores (exact products). Otherwise
    PRECISION decides: "split" multiplies bf16 hi/lo parts (a bf16 b is its own hi part); "tf32x3"
    is tl.dot's written out (the same split: hi rounded to tf32, lo the exact rest, truncated to
    tf32 by the tensor cores; without its NaN clean-up of the small products, which only an infinite
    input needs; two products where one tile is 16-bit); anything else is tl.dot's input_precision.
    Every product accumulates into acc on the tensor cores (one fp32 tile of registers, where a sum
    of separate products would hold one per product).
    """
    if tl.constexpr(a.dtype == b.dtype) and tl.constexpr(a.dtype != tl.float32):
        acc = tl.dot(a, b, acc)
    elif PRECISION == "tf32x3":
        # A 16-bit tile is exact in TF32 (its lo part is 0): it is not split, and the product with its lo part is
        # left out, which changes no bit of the sum (but the sign of a zero).
        if tl.constexpr(a.dtype == tl.float32):
            a_hi, a_lo = tf32_split(a)
        else:
            a_hi = a.to(tl.float32)
        if tl.constexpr(b.dtype == tl.float32):
            b_hi, b_lo = tf32_split(b)
        else:
            b_hi = b.to(tl.float32)
        if tl.constexpr(a.dtype == tl.float32):
            acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
        if tl.constexpr(b.dtype == tl.float32):
            acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    elif PRECISION == "split":
        if tl.constexpr(b.dtype == tl.bfloat16):
            a_hi, a_lo = bf16_split(a.to(tl.float32), EMULATE_BF16)
            acc = tl.dot(a_lo, b, acc)
            acc = tl.dot(a_hi, b, acc)
        else:
            a_hi, a_lo = bf16_split(a.to(tl.float32), EMULATE_BF16)
            b_hi, b_lo = bf16_split(b.to(tl.float32), EMULATE_BF16)
            acc = tl.dot(a_hi, b_lo, acc)
            acc = tl.dot(a_lo, b_hi, acc)
            acc = tl.dot(a_hi, b_hi, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)
    return acc


@triton.jit
def split_dot(a, b, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """a @ b with fp32 accumulation, at PRECISION (see split_dot_into)."""
    return split_dot_into(a, b, tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32), PRECISION, EMULATE_BF16)


# The dots of linear_attn and retnet, where one or both operands are fp32 (a score block, the state, decayed values)
# and the other, if any, an exact input-dtype tile. Each returns acc + x @ y in fp32, accumulating into acc in place
# where it can (a state or an output tile), so that no second fp32 tile is live. PRECISION "split": an fp32
# operand becomes hi + lo in the input dtype (split), two dots against an exact input-dtype operand. With RESCALE
# (fp16 inputs) the fp32 operand is first scaled per row (left operand) or per column (right operand) to a peak of
# 16384 (fp16's maximum is 65504) and the product scaled back, which commutes with the dot and keeps both parts
# finite. Otherwise PRECISION ("tf32", "ieee") is the input_precision of one fp32 dot.

INPUT_SPLIT_PRECISIONS = ("split", "tf32", "ieee")


@triton.jit
def dot_f32_lowp(x, b, acc, PRECISION: tl.constexpr, RESCALE: tl.constexpr):
    """acc + x @ b for fp32 x [M, N] and b [N, P] in the input dtype."""
    if PRECISION != "split":
        return tl.dot(x, b.to(tl.float32), acc, input_precision=PRECISION)
    elif RESCALE:
        row_peak = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
        hi, lo = split(x * (16384.0 / row_peak)[:, None], b.dtype)
        return acc + tl.dot(lo, b, tl.dot(hi, b)) * (row_peak * (1.0 / 16384.0))[:, None]
    else:
        hi, lo = split(x, b.dtype)
        return tl.dot(lo, b, tl.dot(hi, b, acc))


@triton.jit
def dot_lowp_f32(a, x, acc, PRECISION: tl.constexpr, RESCALE: tl.constexpr):
    """acc + a @ x for a [M, N] in the input dtype and fp32 x [N, P]."""
    if PRECISION != "split":
        return tl.dot(a.to(tl.float32), x, acc, input_precision=PRECISION)
    elif RESCALE:
        column_peak = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30)
        hi, lo = split(x * (16384.0 / column_peak)[None, :], a.dtype)
        return acc + tl.dot(a, lo, tl.dot(a, hi)) * (column_peak * (1.0 / 16384.0))[None, :]
    else:
        hi, lo = split(x, a.dtype)
        return tl.dot(a, lo, tl.dot(a, hi, acc))


@triton.jit
def dot_f32_f32(x, y, acc, DTYPE: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr):
    """acc + x @ y for fp32 x [M, N], y [N, P]: x_hi y_hi + x_hi y_lo + x_lo y_hi in DTYPE (x_lo y_lo < 2^-16)."""
    if PRECISION != "split":
        return tl.dot(x, y, acc, input_precision=PRECISION)
    elif RESCALE:
        x_peak = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
        y_peak = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-30)
        x_hi, x_lo = split(x * (16384.0 / x_peak)[:, None], DTYPE)
        y_hi, y_lo = split(y * (16384.0 / y_peak)[None, :], DTYPE)
        product = tl.dot(x_lo, y_hi, tl.dot(x_hi, y_lo, tl.dot(x_hi, y_hi)))
        return acc + product * (x_peak * (1.0 / 16384.0))[:, None] * (y_peak * (1.0 / 16384.0))[None, :]
    else:
        x_hi, x_lo = split(x, DTYPE)
        y_hi, y_lo = split(y, DTYPE)
        return tl.dot(x_lo, y_hi, tl.dot(x_hi, y_lo, tl.dot(x_hi, y_hi, acc)))


@triton.jit
def fp16_rows(x):
    """fp32 x [M, N] as fp16 scaled per row by a power of two (pow2_scale, each row's peak into [2^14, 2^15)):
    (x16, down) with x16 * down[:, None] = x rounded to fp16's 11 bits, relative 2^-11 down to 2^-28 of the row's
    peak (fp16's subnormals below), whatever the row's range (bf16's 3e38 included). Scales per row factor out
    of a dot that contracts over the columns."""
    up, down = pow2_scale(tl.max(tl.abs(x), axis=1), 14)
    return (x * up[:, None]).to(tl.float16), down


@triton.jit
def fp16_columns_split(x):
    """fp32 x [M, N] = (hi + lo) * down[None, :], hi and lo fp16 tiles of x scaled per column by a power of two
    (each column's peak into [2^14, 2^15)): x to about 2^-22 relative (down to where lo goes subnormal, 2^-17 of
    the column's peak), whatever its range."""
    up, down = pow2_scale(tl.max(tl.abs(x), axis=0), 14)
    hi, lo = split(x * up[None, :], tl.float16)
    return hi, lo, down


@triton.jit
def dot_fp16_rows_f32(a16, a_down, x, PRECISION: tl.constexpr):
    """a @ x for a = a16 * a_down[:, None] as fp16_rows gives it and fp32 x [N, P]: "split" carries x as
    fp16_columns_split's hi + lo (two fp16 dots, products exact, both scales applied to the fp32 result);
    otherwise one fp32 dot of a's exact fp32 value at input_precision PRECISION ("tf32" is exact on a: 11 bits)."""
    if PRECISION == "split":
        hi, lo, x_down = fp16_columns_split(x)
        return tl.dot(a16, lo, tl.dot(a16, hi)) * a_down[:, None] * x_down[None, :]
    else:
        return tl.dot(a16.to(tl.float32) * a_down[:, None], x, input_precision=PRECISION)


def input_split_config(dtype: torch.dtype, precision: str) -> tuple[str | None, str, bool]:
    """(INPUT_PRECISION, PRECISION, RESCALE) constexprs of a kernel using the dots above, for inputs of ``dtype``
    and a ``precision`` option among INPUT_SPLIT_PRECISIONS: fp32 inputs take one fp32 dot ("ieee", or "tf32" when
    asked for); 16-bit inputs multiply their own tiles exactly (no input_precision) and carry fp32 operands at
    ``precision``, rescaled for fp16."""
    if precision not in INPUT_SPLIT_PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, INPUT_SPLIT_PRECISIONS))}; got {precision!r}")
    if dtype == torch.float32:
        fp32_precision = "tf32" if precision == "tf32" else "ieee"
        return fp32_precision, fp32_precision, False
    return None, precision, precision == "split" and dtype == torch.float16


# ------------------------------------------------------------------------------------------------ gate sums


def native_gates(dtype: torch.dtype) -> bool:
    """span_sums' NATIVE for gates of ``dtype``: their own 16-bit tensor-core dot on the GPU (the interpreter's
    16-bit dots are wrong)."""
    return dtype in (torch.float16, torch.bfloat16) and not interpreter_active()


@triton.jit
def span_sums(span, g, NATIVE: tl.constexpr):
    """span @ g in fp32 for a 0/1 matrix span [M, N] and log gates g [N, C]: row m gets the direct sum of the
    gate rows it spans. Gates of one sign sum with no cancellation, so each sum's rounding is relative to
    itself, as for a sequential sum, with no scan and no layout change. NATIVE: one tensor-core dot in g's
    own 16-bit dtype (exact products, fp32 sums); otherwise an exact fp32 dot on CUDA cores (fp32 gates)."""
    if NATIVE:
        return tl.dot(span.to(g.dtype), g)
    else:
        return tl.dot(span.to(tl.float32), g.to(tl.float32), input_precision="ieee")


# ------------------------------------------------------------------------------------------------ the UT inverse


@triton.jit
def unit_lower_inverse(L, BC: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr,
                       EMULATE_BF16: tl.constexpr):
    """(I + L)^-1 for strictly lower-triangular L [BC, BC], in fp32.

    The diagonal blocks of size BC >> LEVELS are inverted by column-oriented
    forward substitution, all at once as one [blocks, size, size] tile (step r
    subtracts column r of each block of L times row r of its block of X; the
    reductions run along one block's row or column, inside a warp), then
    merged pairwise LEVELS times on the full tile (split_dot_into at PRECISION):
    for a block [[A, 0], [B, D]] whose halves are already inverted,
    X <- X + X (-B X) fills in -D^-1 B A^-1 (-B X is nonzero only where X is 0,
    so the accumulation into X is exact).
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
        X = split_dot_into(X, split_dot_into(tl.where(lower_left, -L, 0.0), X, zero, PRECISION, EMULATE_BF16), X,
                           PRECISION, EMULATE_BF16)
    return X
