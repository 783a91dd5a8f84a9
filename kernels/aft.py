"""aft (AFT-full, FORMULATIONS.md 6): the chunkwise form as matrix products on precomputed factors (no state).

    o_t = sum_{i<=t} exp(w_{t,i} + k_i) * v_i / sum_{i<=t} exp(w_{t,i} + k_i)
    (elementwise over D; all i when causal=False)

Conventions: w [T, T], k, v [B, T, H, D], o [B, T, H, D] in the input dtype (fp16, bf16 or fp32).

Forward algorithm (tensor cores). exp(w_ti + k_id) factorizes into a bias factor and a key factor, so both sums
are matrix products per (batch, head):

    A_ti = exp(w_ti - M_t)     M_t = max of w_ti over row t's factorized keys (below): the row's anchor
    E_id = exp(k_id - C_d)     C_d = a running maximum of k_d over the keys (below)
    num_td = (A @ (E * v))_td,   den_td = (A @ E)_td   (both relative to exp(M_t + C_d))

Every exponent is <= 0. A depends on w alone and E, E * v on no query, so each factor is computed once, in launches of
its own, rather than once per head (A) or per query tile (E); the main loop is loads and two products. Launches:

1. _bias_factors_kernel: A as a [T, T] dot operand (shared by all B * H heads) and the anchors M_t; causal, also
   W_t, the largest w_ti over the keys of row t's own group up to t (below).
2. The key factors, over the keys in groups of GROUP = 16 and blocks of BLOCK_K (chunk_size): the running
   maximum of k, C16 at every group's end, and the peaks of |E * v| relative to it (each group's, each
   block's, and the running one over every key so far); per block j the operands E = exp(k - C(j)) and
   E * v S(j) (C(j), S(j): C16 and the E * v scale at the block's last group), and the per-channel factors
   that move sums made so far from one block (or group) to the next. E and E * v are stored side by side,
   channel d's in columns 2 d and 2 d + 1 of one [B * H, T, 2 D] operand, and so are the two sums' move
   factors. The running values are prefixes over the sequence, so three launches, each parallel over key
   blocks or channels, make them:
   _key_block_stats_kernel (each block's own maximum of k and peak of |E * v| relative to it, per channel),
   _key_prefix_kernel (an associative scan over the blocks per channel: the running maximum and peak at each
   block's end, and S(j)), _key_factors_kernel (the rest, per block, from the running values at the block
   before).
3. _aft_fwd_kernel: one program per BLOCK_Q queries x BLOCK_D channels of one (batch, head), grid (query
   blocks, B * H, channel blocks), causal tiles longest first: the products, then (causal) the diagonal. den and
   num are likewise side by side in one [BLOCK_Q, 2 BLOCK_D] accumulator, so each key block is one product
   (A @ [E, E * v]) and one per-column rescale, its operand tiles read through tensor descriptors (TMA on sm_90;
   option tma) where their rows are 16-byte aligned; a block's move factors, and a diagonal group's keys, values and
   move factors, are loaded during the block (group) before, so the rescale never waits on memory. Causal, then
   every row's own group, all in one block-diagonal product over the tile's own rows (below).
4. _aft_fallback_kernel: the entries whose factorized sums lost their precision, summed exactly (below); its
   programs return at once where no entry of their tile needs it.

The references move forward by vectors. Block j's products are relative to exp(M_t + C(j)), C(j) <= C(j+1); the
accumulators move from C(j-1) to C(j) by exp(C(j-1) - C(j)) <= 1 per channel (no [BLOCK_Q, BLOCK_D] exponential),
and the product accumulates inside the dot: num is kept in units of the current E * v scale (below), which its
columns' move factor carries. Adding a constant to k moves every C and K with it and changes nothing else.

Causality (bitwise): output t may depend only on w_t,i, k_i and v_i for i <= t, including through the rounding.
A block's references (C(j), S(j)) are taken over all its keys, so when causal:

- Row t's factorized keys are those before its own group of 16 rows, i < 16 floor(t / 16); M_t is their
  maximum (rows t < 16 have none).
- The main loop covers the key blocks that end at or before the tile's first query.
- The diagonal's groups before a row's own are added one at a time, each by a [BLOCK_Q, 16] x [16, BLOCK_D]
  product (E and E * v made on the fly relative to C16 and S16 at the group's end); only the rows after the
  group move to its reference and units (the others keep their sums, selected per row). So row t's sums end relative to
  exp(M_t + C16) in units of S16, both at the group before its own, which no later key touches.
- Row t's own group, keys 16 floor(t / 16) .. t, is one product for the whole tile: its rows are whole groups
  and those keys are tile rows, so A_own [BLOCK_Q, BLOCK_Q] with A_own_ti = exp(w_ti - ref_t) for i in t's
  group up to t (0 elsewhere) is block diagonal, and [E_own, E_own * v] are made from the tile's own k and v.
  ref_t = max(M_t, W_t) (W_t the largest w over those keys; rows t < 16: W_t), so A_own <= 1. E_own_id =
  exp(k_id - R_id) with R the reference of the factorized sums of i's rows, C16 at the group before (k_0, a key
  every row sees, for the first group), and E_own * v takes that group's units S16 (2^14 for the first group):
  each row meets only keys of its own group, all relative to its own R and S16. An own key may pass R (it
  comes after the group that set it): E_own is let up to 2^8 (2^32 with fp32 operands), both operands are scaled
  down by as much, and the factorized sums move to those units and to ref_t (by exp(M_t - ref_t) <= 1) before
  the product adds to them. A key row's operands serve the later rows of its group while its 0 in A_own hides
  it from the earlier ones: they are made finite whatever k and v are (selected, 0 * inf being NaN), and rows
  whose keys so far were cut are sent to the fallback (below).

When causal=False every key is factorized and the main loop covers them all.

Where the factorization loses: M_t + C_d bounds every logit w_ti + k_id from above, but the row's best w and
the channel's best k may sit at different keys, so every term of (t, d) can be far below exp(M_t + C_d), i.e.
den (relative to that reference) far below 1. fp32 keeps relative precision down to 2^-126, but the 16-bit
dot operands flush tiny values, and the product of two shifted exps can underflow outright (w = [0, -100], k =
[-100, 0] gives two terms of e^-100 relative to the reference: 0/0 in any dtype). Every entry whose factorized
den ends below DEN_FLOOR (2^-12 with fp16 operands, 2^-60 with fp32) is recomputed exactly over all its keys,
one key at a time with a running maximum per (t, d) (fp32, one exp per entry and key; logits w + (k - k_0) so
a shift of k still cancels); so is every entry whose den, own group included, ends below DEN_FLOOR (the own
group's W and its keys' k can sit at different keys too). Causal, the own group adds three more reasons, per
row and over its keys up to t: an own key more than 2^8 (2^32) above R, or a non-finite one; an E_own * v past
fp16's range (2^15); and a nonzero E_own * v below fp16's normal range (2^-14: v tiny, or the group before set
a large S16) where |num| is below 2^-11 (2^-22 split) of A_own's row sum, so that such operands' absolute error
(2^-25, 2^-36 split) could reach 2^-14 of num. The main kernel marks those entries (their den, hence o, becomes
NaN) and records per program whether its tile holds one; the fallback kernel recomputes the marked entries of
those tiles. The choice is per entry (per row for the own group's flags: the fallback's cost is per tile) and
made on keys up to t, so it is causal too. That is slow but only meets inputs whose bias and keys together span
more than about 8 nats against each other; for the registry's N(0, 1) inputs den is near n_keys * e^-7, and the
fallback only takes the odd first tile, the cheapest (where a key of the first group passes k_0 by 5.5 nats:
about 5e-5 of those keys and channels). Above the floor, every term that matters keeps the operands' relative
precision.

Numerics of the dot operands (OPTIONS["chunkwise"]["precision"]):

- 16-bit inputs use fp16 operands, also for bf16 inputs: A and E lie in [0, 1] and are scaled by 2^15, E * v
  by a power of two S per channel (``_numerics.pow2_scale``: exact) that moves the peak of |E * v| over the
  operands it scales (a group's, or a block's, relative to their C) to [2^14, 2^15), so fp16's range holds every
  operand and its 11-bit mantissa is 8x finer than bf16's. A large |E * v| earlier in the sequence (one that no
  row weighs much: a low bias) thus leaves the later keys their precision. num is carried in the units of the
  latest S, so S is floored at 2^-64 of the running peak's (SCALE_REACH): num then stays under n_keys * 2^79.
- "single": one fp16 rounding per operand, two products per key block.
- "split": each operand is hi + lo (lo the remainder, rounded to fp16 in turn), three products per sum
  (hi.hi, hi.lo, lo.hi) accumulated together, six per block. E's and E * v's lo are scaled up by 2^11 and
  the cross product's A down by as much, so those stay exact to about 2^-22 down to 2^-29 of their peak (one key
  of huge E * v and no weight leaves its block's others their precision); A's lo is not scaled: its entries
  below 2^-18 of the row's peak weigh too little for their rounding to matter.
- "auto" (default): "single" for bf16 inputs, "split" for fp16 inputs: one fp16 rounding per operand is
  already 8x below bf16's output rounding (excess near 1), but as large as fp16's own, so fp16 inputs need the
  split to reach their floor (bf16 operands rounded once would not reach bf16's).
- fp32 inputs use fp32 operands with input_precision="ieee" (exact products); precision has no effect there.

Memory of the precomputed factors: A is T * T operands (fp16 for 16-bit inputs, twice with "split"; fp32 for
fp32 inputs), E and E * v each one operand per element of k (twice with "split"); the anchors (T) and the
per-group and per-block references, scales, peaks and factors (B * H * D each per group or block, two per channel
for the move factors) are fp32. At B = 8, T = 4096, H = 16, D = 128 in bf16: A 32 MiB, E and E * v 256 MiB, the
group references and scales 16 MiB each and their move factors 32 MiB, the block references, peaks and scales
4 MiB each and their move factors 8 MiB: 372 MiB in all (660 MiB with "split").

Backward (chunkwise_backward, BACKWARD["chunkwise"]). Per channel, o is a
softmax average: with P_tsd = exp(w_ts + k_sd - lse_td) (0 for s > t when
causal) and lse_td = log sum_s exp(w_ts + k_sd),

    dv_sd = sum_t P_tsd do_td
    dk_sd = sum_t P_tsd do_td (v_sd - o_td)          (so sum_s dk_sd = 0: a shift of k changes nothing)
    dw_ts = sum_{b,h,d} P_tsd do_td (v_sd - o_td)    (w is shared by batch and heads)

Per (query block, key block) tile P factorizes like the forward's sums:
P = A_ts E_sd F_td with A = exp(w - m_t), E = exp(k - m_d) (the tile's
own maxima, both in [0, 1]) and F = exp(m_t + m_d - lse_td), so with G = do * F every
sum is two matrix products: dv = E * (A^T G), dk = E * (v * (A^T G) -
A^T (G * o)), dw = A * sum_{b,h} (G (E * v)^T - (G * o) E^T). Two kernels,
no atomics: one program per (key block, b * h, channel block) loops over
query blocks for dk and dv; one per (query block, key block) loops over b, h
and channel blocks for dw, its fp32 sum in a fixed order (deterministic).
Dot operands are fp16 scaled by powers of two for 16-bit inputs, split for
fp16 inputs (lo scaled by 2^11 and its cross products summed apart), fp32
with "ieee" for fp32 inputs.

- F's exponent is small but made of large numbers (|lse| a few units, ~200
  for shifted keys): m_t + m_d - lse is summed with TwoSum (and lse's
  residual, below), so it is rounded once, at its own size.
- F is bounded by 1 / DEN_FLOOR: where m_t + m_d - lse passes
  log(1 / DEN_FLOOR) in a tile (the maxima of w and k at different keys,
  as in the forward's fallback) the tile is summed one key at a time with
  each P entry exact, exp(w + k - lse) <= 1. So are, in fp32 only, the
  causal diagonal tiles, where v_s - o_t is small and the factorized
  difference cancels (fp32 excess 4-5 without; the 16-bit floors hide it).
- T = 1 returns dv = do, dw = dk = 0 exactly (one key of weight 1).

Saved vs recomputed. The forward saves, per (b, t, h, d), "lse" in fp32 (a
softmax's row statistic, here per channel: the factorization cannot give it
back without a second forward), and the rounding residual of one more value:
o's (16-bit inputs, in the input dtype: o + residual is o to ~twice its
bits, which v - o needs where one key dominates a weight: fp16 excess 3.4 ->
1.0 with spread-8 inputs) or lse's (fp32 inputs, in fp32: at |lse| = 100
lse's own rounding moves every weight by 50 u). o is not saved (the wrapper
passes it); A, E, F and P are recomputed in the backward, which costs
per tile BLOCK_Q * (BLOCK_K + BLOCK_D) exps in the dk/dv kernel and
BLOCK_D * (BLOCK_Q + BLOCK_K) in the dw kernel.

Measurements behind these choices (emulated excess): reports/bench.md,
"Design history moved from the kernel docstrings".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels._numerics import pow2_scale
from attnlab.kernels._util import (
    Launch, allow_device_descriptors, block_size, launch_after_checks, no_pending_checks, tma_fits,
)

# fp16 dot operands are scaled to at most 2^15 (fp16 max 65504); a split's lo part is scaled by 2^11 (_operand_parts).
OPERAND_MAX = tl.constexpr(32768.0)
LO_SCALE = tl.constexpr(2048.0)
DEN_FLOOR = {True: 2.0**-12, False: 2.0**-60}  # by "fp16 operands"
# Rows and keys of a causal diagonal group: a row's own group is one block-diagonal product, earlier ones one
# product each.
GROUP = tl.constexpr(16)
# The own group's keys may pass their reference (the running maximum of k before the group) by up to
# 2^OWN_HEADROOM_LOG2 (fp16 operands; 2^32 with fp32 ones): E and E * v of those keys are scaled down by as much,
# and an own key beyond it sends its rows to the fallback (_aft_fwd_kernel).
OWN_HEADROOM_LOG2 = {True: 8, False: 32}  # by "fp16 operands"
# How far below the running peak of |E * v| a group's own peak may set its scale: num, carried in the units of
# the latest scale, then stays under n_keys * 2^(15 + 64), far inside fp32 (_key_factors_kernel).
SCALE_REACH = tl.constexpr(2.0**-64)
# Queries per program and warps where the caller gives none: the forward's main kernel at 64 queries on 4 warps
# (one warpgroup, [64, 2 BLOCK_D] products; faster than 128 on 8, reports/bench.md), the backward's kernels at 64
# on 8 (they hold more tiles per program).
FORWARD_BLOCK_Q = 64
BACKWARD_BLOCK_Q = 64
FORWARD_NUM_WARPS = 4
BACKWARD_NUM_WARPS = 8
BIAS_BLOCK_KEYS = 128  # keys per step of _bias_factors_kernel (its programs own one group of rows)
# Most keys x channels per program of _key_block_stats_kernel and _key_factors_kernel (one key block each, 4 warps;
# 8 for blocks of 128 keys): 64 x 64 (64 bf16 channels are a 128-byte row segment of k and v). ptxas (sm_90) spills
# the factor kernel's blocks of 128 keys at 64 channels (8 warps) and at 32 (4 warps), not at 32 with 8 warps.
KEY_FACTORS_TILE = 64 * 64
KEY_FACTORS_BLOCK_D = 64
# _key_prefix_kernel: channels per program, and key blocks per step of its scan.
PREFIX_BLOCK_D = 32
PREFIX_SCAN_BLOCKS = 64

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),  # BLOCK_K: keys per block of the products
        "block_q": (None, (None, 16, 32, 64, 128)),  # queries per program; None: FORWARD_ / BACKWARD_BLOCK_Q
        "block_d": (64, (16, 32, 64, 128, 256)),  # most channels per program (less when D is smaller)
        "num_warps": (None, (None, 1, 2, 4, 8, 16)),  # None: FORWARD_ / BACKWARD_NUM_WARPS
        "num_stages": (3, (1, 2, 3, 4, 5)),
        "precision": ("auto", ("auto", "single", "split")),
        # The forward's main loop reads its operand tiles through tensor descriptors (TMA on sm_90) where the
        # shapes allow it (_util.tma_fits); False: pointer loads.
        "tma": (True, (False, True)),
    }
}


@triton.jit
def _two_sum(a, b):
    """(s, err) with s = fl(a + b) and s + err = a + b exactly (Knuth's TwoSum, no branch)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


# ------------------------------------------------------------------------------------------------ forward


@triton.jit
def _operand_parts(x, SPLIT: tl.constexpr, OP_DTYPE: tl.constexpr, LO_UNIT: tl.constexpr):
    """x (fp32, within the operand dtype's range) as dot operands (hi, lo): hi is x rounded, lo what that dropped
    times LO_UNIT, rounded in turn; lo is hi unless SPLIT. The forward's right operands (E, E * v) and every
    backward operand take LO_UNIT = LO_SCALE, which keeps lo out of fp16's subnormals down to 2^-14 of hi's unit
    (_dot_into and _product scale their cross products to match); the forward's left operand (A, whose row peak
    is OPERAND_MAX) takes 1."""
    hi = x.to(OP_DTYPE)
    if SPLIT:
        lo = ((x - hi.to(tl.float32)) * LO_UNIT).to(OP_DTYPE)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _store_operand(hi_ptr, lo_ptr, offsets, x, mask, SPLIT: tl.constexpr, LO_UNIT: tl.constexpr):
    """x as a stored operand: hi, and lo where SPLIT (_operand_parts)."""
    hi, lo = _operand_parts(x, SPLIT, hi_ptr.dtype.element_ty, LO_UNIT)
    tl.store(hi_ptr + offsets, hi, mask=mask)
    if SPLIT:
        tl.store(lo_ptr + offsets, lo, mask=mask)


@triton.jit
def _load_operand(hi_ptr, lo_ptr, offsets, mask, SPLIT: tl.constexpr):
    """A stored operand (hi, lo), 0 outside mask; lo is hi unless SPLIT."""
    hi = tl.load(hi_ptr + offsets, mask=mask, other=0.0)
    if SPLIT:
        lo = tl.load(lo_ptr + offsets, mask=mask, other=0.0)
    else:
        lo = hi
    return hi, lo


@triton.jit
def _operand_descriptors(hi_ptr, lo_ptr, rows, columns, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         SPLIT: tl.constexpr):
    """Tensor descriptors of a stored [rows, columns] operand (row-major) in [BLOCK_R, BLOCK_C] tiles: (hi, lo),
    lo hi's unless SPLIT."""
    hi = tl.make_tensor_descriptor(hi_ptr, [rows, columns], [columns, 1], [BLOCK_R, BLOCK_C])
    if SPLIT:
        lo = tl.make_tensor_descriptor(lo_ptr, [rows, columns], [columns, 1], [BLOCK_R, BLOCK_C])
    else:
        lo = hi
    return hi, lo


@triton.jit
def _load_descriptor_operand(src, row, column, SPLIT: tl.constexpr):
    """The tile at (row, column) of _operand_descriptors' operand, as _load_operand's (hi, lo)."""
    hi = src[0].load([row, column])
    if SPLIT:
        lo = src[1].load([row, column])
    else:
        lo = hi
    return hi, lo


@triton.jit
def _dot_into(a_hi, a_lo, b_hi, b_lo, acc, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a @ b in fp32; with SPLIT, a = a_hi + a_lo and b = b_hi + b_lo / LO_SCALE (_operand_parts), the lo @ lo
    term (2^-22) dropped. a_hi / LO_SCALE, the cross product's left operand, is exact for a_hi >= 2^-3, 2^-18 of
    A's row peak; smaller entries weigh too little for their rounding to reach the sum."""
    acc = tl.dot(a_hi, b_hi, acc, input_precision=DOT_PRECISION)
    if SPLIT:
        a_hi_down = (a_hi.to(tl.float32) * (1.0 / LO_SCALE)).to(a_hi.dtype)
        acc = tl.dot(a_hi_down, b_lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_lo, b_hi, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _operand_scale(peaks, HALF_OPERANDS: tl.constexpr):
    """(2^s, 2^-s) per peak (>= 0) moving it to [2^14, 2^15) for fp16 operands (exact both ways); (1, 1) for fp32
    operands. The forward's E * v scales and the backward's operand scales."""
    if HALF_OPERANDS:
        scale, unscale = pow2_scale(peaks, 14)
    else:
        scale = tl.full(peaks.shape, 1.0, tl.float32)
        unscale = scale
    return scale, unscale


# A_ti = exp(w_ti - M_t) over row t's factorized keys (all keys; causal: those before its group of GROUP rows),
# M_t their maximum (the anchor; 0 where there are none), stored scaled by OPERAND_SCALE as dot operands; causal,
# also W_t = max of w_ti over the keys of its own group up to t. One program per group of rows (which share their
# factorized keys); entries of A from the row's own group on are neither written nor read.
@triton.jit
def _bias_factors_kernel(
    w_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, own_bias_max_ptr, T,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, OPERAND_SCALE: tl.constexpr, BLOCK_KEYS: tl.constexpr,
):
    rows = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    row_in = rows < T
    row_offsets = rows.to(tl.int64)[:, None] * T
    if CAUSAL:
        key_end = tl.program_id(0) * GROUP
        own_keys = key_end + tl.arange(0, GROUP)
        own = row_in[:, None] & (own_keys[None, :] <= rows[:, None])
        w_own = tl.load(w_ptr + row_offsets + own_keys[None, :], mask=own, other=-float("inf")).to(tl.float32)
        tl.store(own_bias_max_ptr + rows, tl.max(w_own, 1), mask=row_in)
    else:
        key_end = T
    running_max = tl.full([GROUP, BLOCK_KEYS], -float("inf"), tl.float32)
    for start in range(0, key_end, BLOCK_KEYS):
        keys = start + tl.arange(0, BLOCK_KEYS)
        mask = row_in[:, None] & (keys < key_end)[None, :]
        w = tl.load(w_ptr + row_offsets + keys[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        running_max = tl.maximum(running_max, w)
    row_max = tl.max(running_max, 1)
    anchor = tl.where(row_max > -float("inf"), row_max, 0.0)
    tl.store(anchor_ptr + rows, anchor, mask=row_in)
    for start in range(0, key_end, BLOCK_KEYS):
        keys = start + tl.arange(0, BLOCK_KEYS)
        mask = row_in[:, None] & (keys < key_end)[None, :]
        w = tl.load(w_ptr + row_offsets + keys[None, :], mask=mask, other=-float("inf")).to(tl.float32)
        _store_operand(a_hi_ptr, a_lo_ptr, row_offsets + keys[None, :], tl.exp(w - anchor[:, None]) * OPERAND_SCALE,
                       mask, SPLIT, 1.0)


@triton.jit
def _either(a, b):
    """Combine of a running OR of flag bits (an associative scan)."""
    return a | b


@triton.jit
def _row(x, index, other):
    """Row index of a small [R, N] tensor, as an [N] vector (a reduction over the other rows, filled with other)."""
    return tl.max(tl.where(tl.arange(0, x.shape[0])[:, None] == index, x, other), 0)


@triton.jit
def _pow2_inverse(unscale):
    """1 / unscale for a power of two in [2^-126, 2^126] (as pow2_scale gives), exactly, from its exponent field."""
    return ((254 - ((unscale.to(tl.int32, bitcast=True) >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _num_move(den_move, scale, previous_unscale):
    """den_move * S / S_previous, the factor that moves num to new units and reference: at most 2^65 (S is at most
    2^64 times the scale of the running peak, which covers the sums before), and in this order neither product
    overflows (den_move <= 1)."""
    return den_move * scale * previous_unscale


@triton.jit
def _pairs(den_part, num_part):
    """Two [M, N] tensors as one [M, 2 N] whose columns alternate: den_part's column d at 2 d, num_part's at
    2 d + 1 (the layout of the forward's E, E * v operands and of its sums: both products are one dot)."""
    return tl.reshape(tl.join(den_part, num_part), [den_part.shape[0], 2 * den_part.shape[1]])


@triton.jit
def _vector_pairs(den_part, num_part):
    """Two [N] vectors as one [2 N], alternating as in _pairs (the move factors of both sums)."""
    return tl.reshape(tl.join(den_part, num_part), [2 * den_part.shape[0]])


# Per channel d, over the keys in groups of GROUP (16) and blocks of BLOCK_K, all in fp32:
#   C16_g = max_i k_id over the keys up to group g's end (a running maximum), P16_g = max_i |exp(k_id - C16_g) v_id|
#   over group g's own keys (over its block's keys for a block's last group), floored at SCALE_REACH times the
#   same peak over every key so far, S16_g = the power of two moving P16_g to [2^14, 2^15) (stored as 1 / S16_g),
#   and the factors exp(C16_g-1 - C16_g) (den) and that times S16_g / S16_g-1 (num) that move sums
#   made so far to group g's reference and units (0 for the first group), side by side (_vector_pairs);
#   per block j, with C(j), S(j) those of its last group: the dot operands E_id = exp(k_id - C(j)) (scaled by
#   OPERAND_SCALE) and E_id v_id S(j), side by side in [B * H, T, 2 D] (_pairs), and the factors
#   exp(C(j-1) - C(j)) (den) and that times S(j) / S(j-1) (num) that move sums made so far to block j's reference
#   and units (0 for the first block), side by side.
# Every E * v operand relative to some C16_g and scaled by S16_g is then at most 2^15.
#
# The running maximum and peak are prefixes over the whole sequence, so they take three launches, each parallel
# over key blocks or channels: _key_block_stats_kernel (each block's own maximum and peak), _key_prefix_kernel
# (their running values at each block's end, and S(j)), _key_factors_kernel (everything above, per block, from the
# running values at the block before). A block's scale S(j) is set once, by the prefix launch, since block j's
# factors and block j + 1's move factors both need it bitwise; the other groups' scales are the factor launch's.


# Per key block j and channel d: m_j = max of k_d over the block's keys and q_j = max |exp(k_id - m_j) v_id| over
# them, its peak of |E * v| relative to its own maximum (no earlier key needed). One program per (key block, head,
# channel block).
@triton.jit
def _key_block_stats_kernel(
    k_ptr, v_ptr, block_ref_ptr, block_peak_ptr, T, H, D,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    kv_base = (pid_bh // H).to(tl.int64) * T * H * D + (pid_bh % H) * D
    keys = pid_j * BLOCK_K + tl.arange(0, BLOCK_K)
    key_in = keys < T
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_in = offs_d < D
    mask = key_in[:, None] & d_in[None, :]
    kv_offsets = kv_base + keys[:, None] * (H * D) + offs_d[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=mask, other=0.0).to(tl.float32)
    k = tl.where(key_in[:, None], k, -float("inf"))  # every block starts inside T: the maximum is finite
    v = tl.load(v_ptr + kv_offsets, mask=mask, other=0.0).to(tl.float32)
    block_max = tl.max(k, 0)
    offsets = pid_bh.to(tl.int64) * tl.cdiv(T, BLOCK_K) * D + pid_j * D + offs_d
    tl.store(block_ref_ptr + offsets, block_max, mask=d_in)
    tl.store(block_peak_ptr + offsets, tl.max(tl.abs(tl.exp(k - block_max[None, :]) * v), 0), mask=d_in)


@triton.jit
def _peak_moved(peak, ref, new_ref):
    """A peak relative to exp(ref) as one relative to exp(new_ref >= ref): unchanged where the references are equal
    (also both -inf: no key yet)."""
    return tl.where(ref == new_ref, peak, peak * tl.exp(ref - new_ref))


@triton.jit
def _peak_combine(ref_a, peak_a, ref_b, peak_b):
    """Combine of (maximum of k, peak of |E * v| relative to it) over two runs of keys (an associative scan)."""
    ref = tl.maximum(ref_a, ref_b)
    return ref, tl.maximum(_peak_moved(peak_a, ref_a, ref), _peak_moved(peak_b, ref_b, ref))


# Per channel, the block statistics (m_j, q_j) of _key_block_stats_kernel become, in place, the running values at
# each block's end: C(j) = max of k over the keys so far and the running peak of |E * v| relative to it; and the
# block's scale, 1 / S(j) (that of its last group: its own peak q_j exp(m_j - C(j)), floored at SCALE_REACH times
# the running peak). An associative scan over SCAN_BLOCKS blocks at a time, the running values at the last one
# carried to the next. One program per (head, channel block).
@triton.jit
def _key_prefix_kernel(
    block_ref_ptr, block_peak_ptr, block_unscale_ptr, n_blocks, D,
    HALF_OPERANDS: tl.constexpr, SCAN_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_in = offs_d < D
    offs_j = tl.arange(0, SCAN_BLOCKS)
    base = pid_bh.to(tl.int64) * n_blocks * D
    carry_ref = tl.full([BLOCK_D], -float("inf"), tl.float32)
    carry_peak = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, n_blocks, SCAN_BLOCKS):
        mask = (start + offs_j < n_blocks)[:, None] & d_in[None, :]
        offsets = base + (start + offs_j)[:, None] * D + offs_d[None, :]
        block_max = tl.load(block_ref_ptr + offsets, mask=mask, other=-float("inf"))
        own_peak = tl.load(block_peak_ptr + offsets, mask=mask, other=0.0)
        ref, peak = tl.associative_scan((block_max, own_peak), 0, _peak_combine)
        ref, peak = _peak_combine(carry_ref[None, :], carry_peak[None, :], ref, peak)
        own_peak = _peak_moved(own_peak, block_max, ref)
        scale, unscale = _operand_scale(tl.maximum(own_peak, peak * SCALE_REACH), HALF_OPERANDS)
        tl.store(block_ref_ptr + offsets, ref, mask=mask)
        tl.store(block_peak_ptr + offsets, peak, mask=mask)
        tl.store(block_unscale_ptr + offsets, unscale, mask=mask)
        # Past n_blocks the scan repeats the last block's values (no key: reference -inf, peak 0).
        carry_ref = _row(ref, SCAN_BLOCKS - 1, -float("inf"))
        carry_peak = _row(peak, SCAN_BLOCKS - 1, 0.0)


# The factors above for one key block, from the running values at the block before (_key_prefix_kernel's; none
# before the first block) and the block's own keys. One program per (key block, head, channel block).
@triton.jit
def _key_factors_kernel(
    k_ptr, v_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr, block_ref_ptr, block_peak_ptr, block_unscale_ptr,
    group_ref_ptr, group_unscale_ptr, group_move_ptr, T, H, D,
    SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, OPERAND_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    kv_base = (pid_bh // H).to(tl.int64) * T * H * D + (pid_bh % H) * D
    row_stride = H * D
    factors_base = pid_bh.to(tl.int64) * T * D
    n_groups = tl.cdiv(T, GROUP)
    group_base = pid_bh.to(tl.int64) * n_groups * D
    block_base = pid_bh.to(tl.int64) * tl.cdiv(T, BLOCK_K) * D
    start = pid_j * BLOCK_K
    keys = start + tl.arange(0, BLOCK_K)
    key_in = keys < T
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_in = offs_d < D
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    offs_g = tl.arange(0, GROUPS)[:, None]
    offs_pairs = 2 * pid_d * BLOCK_D + tl.arange(0, 2 * BLOCK_D)  # (den, num) columns: 2 d, 2 d + 1
    pairs_in = offs_pairs < 2 * D

    # The running maximum, peak and units at the end of the block before.
    before = d_in & (pid_j > 0)
    before_offsets = block_base + (pid_j - 1) * D + offs_d
    running_max = tl.load(block_ref_ptr + before_offsets, mask=before, other=-float("inf"))
    running_peak = tl.load(block_peak_ptr + before_offsets, mask=before, other=0.0)
    unscale = tl.load(block_unscale_ptr + before_offsets, mask=before, other=1.0)
    block_unscale_before = unscale
    block_unscale = tl.load(block_unscale_ptr + block_base + pid_j * D + offs_d, mask=d_in, other=1.0)
    block_max_before = running_max

    mask = key_in[:, None] & d_in[None, :]
    kv_offsets = kv_base + keys[:, None] * row_stride + offs_d[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=mask, other=0.0).to(tl.float32)
    k = tl.where(key_in[:, None], k, -float("inf"))  # every block starts inside T: the maxima stay finite
    v = tl.load(v_ptr + kv_offsets, mask=mask, other=0.0).to(tl.float32)
    # The block's keys by group, [GROUPS, GROUP, BLOCK_D]: per-group maxima and peaks are one reduction each,
    # and the walk over the groups below handles [GROUPS, BLOCK_D] rows, not the whole block.
    k_groups = tl.reshape(k, [GROUPS, GROUP, BLOCK_D])
    # Each group's reference C16 (the running maximum at its end), then |E * v| relative to it (one
    # exponential per element) and its peak per group.
    group_maxima = tl.max(k_groups, 1)
    refs = tl.zeros([GROUPS, BLOCK_D], tl.float32)
    for g in tl.static_range(GROUPS):
        running_max = tl.maximum(running_max, _row(group_maxima, g, -float("inf")))
        refs = tl.where(offs_g == g, running_max[None, :], refs)
    key_ref = tl.reshape(tl.broadcast_to(refs[:, None, :], [GROUPS, GROUP, BLOCK_D]), [BLOCK_K, BLOCK_D])
    group_peaks = tl.max(tl.reshape(tl.abs(tl.exp(k - key_ref) * v), [GROUPS, GROUP, BLOCK_D]), 1)
    running_max = block_max_before
    for g in tl.static_range(GROUPS):
        group_max = _row(refs, g, -float("inf"))
        den_move = tl.exp(running_max - group_max)
        group_peak = _row(group_peaks, g, 0.0)
        running_peak = tl.maximum(running_peak * den_move, group_peak)
        # The group's own operands set its scale (the block's, S(j), at its last group inside T, whose scale the
        # block's operands take), so that a large |E v| earlier leaves later keys their precision; the running
        # peak only caps it (SCALE_REACH), so that num, carried in these units, stays inside fp32.
        ends_block = (g == GROUPS - 1) | (start // GROUP + g >= n_groups - 1)
        scale, new_unscale = _operand_scale(tl.maximum(group_peak, running_peak * SCALE_REACH), HALF_OPERANDS)
        scale = tl.where(ends_block, _pow2_inverse(block_unscale), scale)
        new_unscale = tl.where(ends_block, block_unscale, new_unscale)
        group_offsets = group_base + (start // GROUP + g) * D + offs_d
        group_in = d_in & (start // GROUP + g < n_groups)
        tl.store(group_ref_ptr + group_offsets, group_max, mask=group_in)
        tl.store(group_unscale_ptr + group_offsets, new_unscale, mask=group_in)
        tl.store(group_move_ptr + 2 * group_base + (start // GROUP + g) * 2 * D + offs_pairs,
                 _vector_pairs(den_move, _num_move(den_move, scale, unscale)),
                 mask=pairs_in & (start // GROUP + g < n_groups))
        running_max = group_max
        unscale = new_unscale

    e = tl.exp(k - running_max[None, :])
    _store_operand(eev_hi_ptr, eev_lo_ptr, 2 * factors_base + keys[:, None] * (2 * D) + offs_pairs[None, :],
                   _pairs(e * OPERAND_SCALE, e * v * scale[None, :]), key_in[:, None] & pairs_in[None, :],
                   SPLIT, LO_SCALE)
    den_move = tl.exp(block_max_before - running_max)
    tl.store(move_ptr + 2 * block_base + pid_j * 2 * D + offs_pairs,
             _vector_pairs(den_move, _num_move(den_move, scale, block_unscale_before)), mask=pairs_in)


@triton.jit
def _group_keys(k_ptr, v_ptr, group_move_ptr, kv_base, row_stride, group_base, offs_d, offs_pairs, group_start,
                diagonal_end, D):
    """k and v (fp32, [GROUP, BLOCK_D]) of the diagonal group from group_start and its move factors ([2 BLOCK_D],
    _pairs), zeros where group_start is diagonal_end (no group left)."""
    d_in = offs_d < D
    has_group = group_start < diagonal_end
    keys = tl.arange(0, GROUP) + group_start
    kv_offsets = kv_base + keys[:, None] * row_stride + offs_d[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=d_in[None, :] & has_group, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kv_offsets, mask=d_in[None, :] & has_group, other=0.0).to(tl.float32)
    move = tl.load(group_move_ptr + 2 * group_base + (group_start // GROUP) * 2 * D + offs_pairs,
                   mask=(offs_pairs < 2 * D) & has_group, other=0.0)
    return k, v, move


@triton.jit
def _row_group_offsets(group_base, offs_t, offs_d, T, D, CAUSAL: tl.constexpr):
    """Per (t, d), the offsets of row t's factorized sums' group in [B * H, cdiv(T, GROUP), D]: the group before its
    own (causal), the last group (all keys factorized); and where there is one."""
    if CAUSAL:
        group = offs_t // GROUP - 1
    else:
        group = tl.zeros_like(offs_t) + tl.cdiv(T, GROUP) - 1
    offsets = group_base + group[:, None] * D + offs_d[None, :]
    return offsets, ((group >= 0) & (offs_t < T))[:, None] & (offs_d < D)[None, :]


@triton.jit
def _row_key_ref(group_ref_ptr, group_base, offs_t, offs_d, T, D, CAUSAL: tl.constexpr):
    """C16 of row t's factorized sums (their reference is exp(M_t + C16)); 0 where there are none."""
    offsets, mask = _row_group_offsets(group_base, offs_t, offs_d, T, D, CAUSAL)
    return tl.load(group_ref_ptr + offsets, mask=mask, other=0.0)


@triton.jit
def _row_unscale(group_unscale_ptr, group_base, offs_t, offs_d, T, D, CAUSAL: tl.constexpr):
    """1 / S16 of row t's factorized num (its units are OPERAND_SCALE * S16); 1 where there are none."""
    offsets, mask = _row_group_offsets(group_base, offs_t, offs_d, T, D, CAUSAL)
    return tl.load(group_unscale_ptr + offsets, mask=mask, other=1.0)


# num_td = sum_i A_ti (E v)_id and den_td = sum_i A_ti E_id over row t's factorized keys, relative to
# exp(M_t + C): products over the key blocks before the tile (every key when causal=False), then over the
# diagonal's groups before each row's own (den and num side by side: one product each), the sums moved from one
# reference C to the next by exp(C_old - C_new) <= 1 per channel; then (causal) the terms of the row's own group,
# one block-diagonal product for the tile, relative to max(M_t, W_t) + C16; o = num / den.
@triton.jit
def _aft_fwd_kernel(
    w_ptr, k_ptr, v_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr, group_ref_ptr,
    group_unscale_ptr, group_move_ptr, own_bias_max_ptr, o_ptr, lse_ptr, lse_residual_ptr,
    o_residual_ptr, fallback_ptr,
    T, H, D, den_floor,
    STORE_LSE: tl.constexpr, STORE_LSE_RESIDUAL: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    OPERAND_SCALE: tl.constexpr, HEADROOM_LOG2: tl.constexpr, TMA: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    tile = tl.num_programs(0) - 1 - pid_t if CAUSAL else pid_t  # causal: the longest tiles first
    kv_base = (pid_bh // H).to(tl.int64) * T * H * D + (pid_bh % H) * D
    row_stride = H * D
    factors_base = pid_bh.to(tl.int64) * T * D
    group_base = pid_bh.to(tl.int64) * tl.cdiv(T, GROUP) * D
    block_base = pid_bh.to(tl.int64) * tl.cdiv(T, BLOCK_K) * D
    OP_DTYPE: tl.constexpr = tl.float16 if HALF_OPERANDS else tl.float32
    UNIT: tl.constexpr = 1.0 / OPERAND_SCALE  # of a scaled A or E

    offs_t = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    row_in = offs_t < T
    d_in = offs_d < D
    in_tile = row_in[:, None] & d_in[None, :]
    a_rows = offs_t.to(tl.int64)[:, None] * T
    # den and num side by side, den_td in column 2 d and num_td in 2 d + 1 (_pairs), as the operands E and E * v
    # are stored: both sums are one product per key block, and one move factor per column carries either.
    # den is in units of OPERAND_SCALE^2, num in units of OPERAND_SCALE * S (the current E * v scale).
    offs_pairs = 2 * pid_d * BLOCK_D + tl.arange(0, 2 * BLOCK_D)
    pairs_in = offs_pairs < 2 * D
    sums = tl.zeros([BLOCK_Q, 2 * BLOCK_D], tl.float32)

    if CAUSAL:
        n_blocks = tile * BLOCK_Q // BLOCK_K  # the blocks that end at or before the tile's first query
    else:
        n_blocks = tl.cdiv(T, BLOCK_K)
    # Block j's move factors are loaded during block j - 1, so that the rescale never waits on a global load.
    offs_k = tl.arange(0, BLOCK_K)
    move = tl.load(move_ptr + 2 * block_base + offs_pairs, mask=pairs_in & (n_blocks > 0), other=0.0)
    if TMA:
        # The operand tiles through tensor descriptors: no address or mask registers per entry, and TMA zero-fills
        # the rows past T (A's) and the keys past T (causal=False) as the pointer loads' masks do.
        a_src = _operand_descriptors(a_hi_ptr, a_lo_ptr, T, T, BLOCK_Q, BLOCK_K, SPLIT)
        eev_src = _operand_descriptors(eev_hi_ptr + 2 * factors_base, eev_lo_ptr + 2 * factors_base, T, 2 * D,
                                       BLOCK_K, 2 * BLOCK_D, SPLIT)
    for block in range(0, n_blocks):
        if TMA:
            a_hi, a_lo = _load_descriptor_operand(a_src, tile * BLOCK_Q, block * BLOCK_K, SPLIT)
            eev_hi, eev_lo = _load_descriptor_operand(eev_src, block * BLOCK_K, 2 * pid_d * BLOCK_D, SPLIT)
        else:
            keys = block * BLOCK_K + offs_k
            if CAUSAL:
                key_in = offs_k >= 0  # all: these blocks end before the tile's first query, inside T
            else:
                key_in = keys < T
            a_hi, a_lo = _load_operand(a_hi_ptr, a_lo_ptr, a_rows + keys[None, :],
                                       row_in[:, None] & key_in[None, :], SPLIT)
            eev_hi, eev_lo = _load_operand(eev_hi_ptr, eev_lo_ptr,
                                           2 * factors_base + keys[:, None] * (2 * D) + offs_pairs[None, :],
                                           key_in[:, None] & pairs_in[None, :], SPLIT)
        sums = _dot_into(a_hi, a_lo, eev_hi, eev_lo, sums * move[None, :], SPLIT, DOT_PRECISION)
        move = tl.load(move_ptr + 2 * block_base + (block + 1) * 2 * D + offs_pairs,
                       mask=pairs_in & (block + 1 < n_blocks), other=0.0)

    if CAUSAL:
        # The diagonal's groups before some row's own group, each moving the rows after it (and only those) from
        # the previous group's C16 and S16 to its own. Like the blocks' move factors, a group's keys, values and
        # move factors are loaded during the group before (all its keys lie inside T: a row comes after them).
        tile_end = tl.minimum((tile + 1) * BLOCK_Q, T)
        diagonal_start = n_blocks * BLOCK_K
        diagonal_end = (tile_end - 1) // GROUP * GROUP
        group_k, group_v, group_move = _group_keys(k_ptr, v_ptr, group_move_ptr, kv_base, row_stride, group_base,
                                                   offs_d, offs_pairs, diagonal_start, diagonal_end, D)
        for group_start in range(diagonal_start, diagonal_end, GROUP):
            keys = group_start + tl.arange(0, GROUP)
            reached = row_in & (offs_t >= group_start + GROUP)
            a_hi, a_lo = _load_operand(a_hi_ptr, a_lo_ptr, a_rows + keys[None, :], reached[:, None], SPLIT)
            group_offsets = group_base + (group_start // GROUP) * D + offs_d
            group_ref = tl.load(group_ref_ptr + group_offsets, mask=d_in, other=0.0)
            group_scale = _pow2_inverse(tl.load(group_unscale_ptr + group_offsets, mask=d_in, other=1.0))
            e = tl.exp(group_k - group_ref[None, :])
            eev_hi, eev_lo = _operand_parts(_pairs(e * OPERAND_SCALE, e * group_v * group_scale[None, :]), SPLIT,
                                            OP_DTYPE, LO_SCALE)
            move = group_move
            group_k, group_v, group_move = _group_keys(k_ptr, v_ptr, group_move_ptr, kv_base, row_stride, group_base,
                                                       offs_d, offs_pairs, group_start + GROUP, diagonal_end, D)
            # Selected, not masked by A's zeros: a non-finite k or v of the group would reach the rows before it
            # as 0 * inf in the product.
            sums = tl.where(reached[:, None],
                            _dot_into(a_hi, a_lo, eev_hi, eev_lo, sums * move[None, :], SPLIT, DOT_PRECISION),
                            sums)
        # Row t's sums are relative to exp(M_t + C16) and in units of S16, both at the group before its own; rows
        # of the first group have no factorized keys (and their sums are 0).
        has_keys = offs_t >= GROUP
    else:
        has_keys = row_in
    anchor = tl.load(anchor_ptr + offs_t, mask=row_in, other=0.0)
    key_ref = _row_key_ref(group_ref_ptr, group_base, offs_t, offs_d, T, D, CAUSAL)
    unscale = _row_unscale(group_unscale_ptr, group_base, offs_t, offs_d, T, D, CAUSAL)
    # Entries whose factorized den fell below the floor are marked (NaN) for _aft_fallback_kernel; den_td depends
    # only on row t's factorized keys, so the choice is causal too.
    den, num = tl.split(tl.reshape(sums, [BLOCK_Q, BLOCK_D, 2]))
    den = tl.where(~(den * (UNIT * UNIT) >= den_floor) & has_keys[:, None], float("nan"), den)
    if CAUSAL:
        # Row t's own group, keys 16 floor(t / 16) .. t, in one product: the tile's rows are whole groups and those
        # keys are tile rows, so A_own [BLOCK_Q, BLOCK_Q] is block diagonal (lower triangular per group), and every
        # row meets only keys of its own group, which share the reference R and the scale of that group's rows.
        # Rows: relative to ref_t = max(M_t, W_t) (W_t, the largest w_ti over the own keys up to t, bounds them).
        # Channels: R = C16 of the group before (the factorized sums' reference; k_0 for the first group, which
        # every row sees) and E * v in units of S16 of that group (a fixed 2^14 for the first group), both known
        # before the group. An own key may pass R: E = exp(k - R) is let up to 2^HEADROOM_LOG2, and both operands
        # are scaled down by as much; the sums then count in units 2^-HEADROOM_LOG2 of the factorized ones.
        HEADROOM: tl.constexpr = 2.0 ** HEADROOM_LOG2
        FIRST_SCALE: tl.constexpr = 16384.0 if HALF_OPERANDS else 1.0
        OWN_MAX: tl.constexpr = OPERAND_MAX if HALF_OPERANDS else 2.0 ** 127
        own_bias_max = tl.load(own_bias_max_ptr + offs_t, mask=row_in, other=0.0)
        row_ref = tl.where(has_keys, tl.maximum(anchor, own_bias_max), own_bias_max)
        first_key = tl.load(k_ptr + kv_base + offs_d, mask=d_in, other=0.0).to(tl.float32)
        key_ref = tl.where(has_keys[:, None], key_ref, first_key[None, :])
        unscale = tl.where(has_keys[:, None], unscale, 1.0 / FIRST_SCALE)
        # A key row serves the later rows of its group, and its 0 in A the earlier ones: its operands must be
        # finite whatever its k and v are (0 * inf is NaN), so they are selected, and what was dropped is flagged.
        tile_k = tl.load(k_ptr + kv_base + offs_t[:, None] * row_stride + offs_d[None, :], mask=in_tile,
                         other=0.0).to(tl.float32)
        tile_v = tl.load(v_ptr + kv_base + offs_t[:, None] * row_stride + offs_d[None, :], mask=in_tile,
                         other=0.0).to(tl.float32)
        exponent = tile_k - key_ref
        fits = exponent <= HEADROOM_LOG2 * 0.6931471805599453  # False for NaN as well
        e = tl.where(fits, tl.exp(exponent), 0.0)
        ev = e * tile_v * (_pow2_inverse(unscale) * (1.0 / HEADROOM))
        fits &= tl.abs(ev) < OWN_MAX  # fp16's range (fp32's: only non-finite v)
        ev = tl.where(fits, ev, 0.0)
        # Flags per key row, over its channels: 2, an operand was dropped; 1 (fp16 operands), an E * v operand is
        # below fp16's normal range, its absolute error up to 2^-25 (hi) or 2^-36 (split: lo is exact where hi is
        # not). OR-ed over each group's keys up to the row, so the flags of row t come from keys <= t; per row, not
        # per entry: the fallback's cost is per tile, and any more entries it takes come out exact.
        flags = tl.where(fits, 0, 2)
        if HALF_OPERANDS:
            flags |= ((ev != 0.0) & (tl.abs(ev) < 2.0**-14)).to(tl.int32)
        flags = tl.reshape(tl.associative_scan(tl.reshape(tl.max(flags, 1), [BLOCK_Q // GROUP, GROUP]), 1, _either),
                           [BLOCK_Q])
        eev_hi, eev_lo = _operand_parts(_pairs(e * (OPERAND_SCALE / HEADROOM), ev), SPLIT, OP_DTYPE, LO_SCALE)
        # Whole groups of w are loaded (a mask constant over 16 keys: vector loads), the keys after t selected out.
        w_own = tl.load(w_ptr + a_rows + offs_t[None, :],
                        mask=row_in[:, None] & (offs_t[None, :] // GROUP == offs_t[:, None] // GROUP),
                        other=-float("inf")).to(tl.float32)
        a_own = tl.where(offs_t[None, :] <= offs_t[:, None], tl.exp(w_own - row_ref[:, None]) * OPERAND_SCALE, 0.0)
        a_hi, a_lo = _operand_parts(a_own, SPLIT, OP_DTYPE, 1.0)
        own_weight = tl.sum(a_own, 1) * (2.0**-22 if SPLIT else 2.0**-11)
        # The factorized sums move to ref_t and the own sums' units (a power of two), and the own product lands in
        # them (den in units OPERAND_SCALE^2 / HEADROOM, num OPERAND_SCALE * S16 / HEADROOM).
        move = tl.where(has_keys, tl.exp(anchor - row_ref), 0.0) * (1.0 / HEADROOM)
        sums = _dot_into(a_hi, a_lo, eev_hi, eev_lo, _pairs(den, num) * move[:, None], SPLIT, DOT_PRECISION)
        den, num = tl.split(tl.reshape(sums, [BLOCK_Q, BLOCK_D, 2]))
        # Subnormal E * v operands err by at most A's row sum times 2^-25 (2^-36 split) in num's units: the
        # entries where that could pass 2^-14 |num| are marked.
        lost = (flags >= 2)[:, None] | (((flags & 1) != 0)[:, None] & ~(tl.abs(num) >= own_weight[:, None]))
        den *= UNIT * UNIT * HEADROOM
        num *= unscale * UNIT * HEADROOM
        # The own group's E and E * v went through the operands too: so is every den that ends below the floor.
        den = tl.where(lost | ~(den >= den_floor), float("nan"), den)
        refs, refs_err = _two_sum(row_ref[:, None], key_ref)  # the reference, as the pair of values whose sum it is
    else:
        den *= UNIT * UNIT
        num *= unscale * UNIT
        refs, refs_err = _two_sum(anchor[:, None], key_ref)
    marked = in_tile & (den != den)
    fallback_index = pid_t + tl.num_programs(0) * (pid_bh + tl.num_programs(1) * pid_d)
    tl.store(fallback_ptr + fallback_index, tl.max(marked.to(tl.int32)))

    o = num / den
    o_rounded = o.to(o_ptr.dtype.element_ty)
    out_offsets = kv_base + offs_t[:, None] * row_stride + offs_d[None, :]
    tl.store(o_ptr + out_offsets, o_rounded, mask=in_tile)
    if STORE_O_RESIDUAL:
        # What rounding o to 16 bits dropped, itself in 16 bits: o + residual carries about twice o's bits.
        tl.store(o_residual_ptr + out_offsets, (o - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty),
                 mask=in_tile)
    if STORE_LSE:
        # log sum_i exp(w_ti + k_id) in absolute terms, the backward's normalizer: the reference plus log(den).
        # Its two parts are a few units each (far more for shifted keys), log(den) smaller: summed with TwoSum,
        # the result is lse + its rounding residual, which fp32 inputs keep (16-bit ones need not).
        lse, lse_residual = _two_sum(refs, tl.log(den) + refs_err)
        tl.store(lse_ptr + out_offsets, lse, mask=in_tile)
        if STORE_LSE_RESIDUAL:
            tl.store(lse_residual_ptr + out_offsets, lse_residual, mask=in_tile)


@triton.jit
def _aft_keys_exact(w_ptr, k_ptrs_row, v_ptrs_row, offs_t, offs_d, T, D, key_start, key_end, row_stride,
                    k_ref, running_max, num, den, CAUSAL: tl.constexpr):
    """Keys key_start..key_end-1 added one at a time to (num, den), relative to exp(running_max) per (t, d).

    Logits are w_ti + (k_id - k_ref_d), so running_max is relative to k_ref too;
    with k_ref one of the keys, a shift of k cancels in k - k_ref (exactly
    where that subtraction is exact) as in the factorized form.

    Per key the larger of (running max, logit) becomes the reference and the
    other side is multiplied by exp(-|logit - running max|) <= 1: one exp.
    A key after t (causal) leaves row t's sums as they were, selected rather
    than added as zeros, so that a non-finite k or v there cannot reach row t
    (-inf + nan, 0 * inf).
    """
    for i in range(key_start, key_end):
        w_col = tl.load(w_ptr + offs_t.to(tl.int64) * T + i, mask=offs_t < T, other=0.0).to(tl.float32)
        k_row = tl.load(k_ptrs_row + i * row_stride, mask=offs_d < D, other=0.0).to(tl.float32)
        v_row = tl.load(v_ptrs_row + i * row_stride, mask=offs_d < D, other=0.0).to(tl.float32)
        logit = w_col[:, None] + (k_row - k_ref)[None, :]
        shrink = tl.exp(-tl.abs(logit - running_max))
        grew = logit > running_max
        new_den = tl.where(grew, den * shrink + 1.0, den + shrink)
        new_num = tl.where(grew, num * shrink + v_row[None, :], num + shrink * v_row[None, :])
        new_max = tl.maximum(running_max, logit)
        if CAUSAL:
            seen = (i <= offs_t)[:, None]
            new_den = tl.where(seen, new_den, den)
            new_num = tl.where(seen, new_num, num)
            new_max = tl.where(seen, new_max, running_max)
        den, num, running_max = new_den, new_num, new_max
    return running_max, num, den


# The entries _aft_fwd_kernel marked (o is NaN there), in tiles it flagged, summed exactly over all their keys:
# o_td = num / den with one key at a time and a running maximum per (t, d) (_aft_keys_exact).
@triton.jit
def _aft_fallback_kernel(
    w_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lse_residual_ptr, o_residual_ptr, fallback_ptr,
    T, H, D,
    STORE_LSE: tl.constexpr, STORE_LSE_RESIDUAL: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    if tl.load(fallback_ptr + pid_t + tl.num_programs(0) * (pid_bh + tl.num_programs(1) * pid_d)) != 0:
        tile = tl.num_programs(0) - 1 - pid_t if CAUSAL else pid_t
        kv_base = (pid_bh // H).to(tl.int64) * T * H * D + (pid_bh % H) * D
        row_stride = H * D
        offs_t = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        in_tile = (offs_t[:, None] < T) & (offs_d[None, :] < D)
        out_offsets = kv_base + offs_t[:, None] * row_stride + offs_d[None, :]
        marked = tl.load(o_ptr + out_offsets, mask=in_tile, other=0.0)
        redo = in_tile & (marked != marked)
        key_end = tl.minimum((tile + 1) * BLOCK_Q, T) if CAUSAL else T
        # Key 0, visible to every row, is the channel reference.
        k_ref = tl.load(k_ptr + kv_base + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        running_max, num, den = _aft_keys_exact(
            w_ptr, k_ptr + kv_base + offs_d, v_ptr + kv_base + offs_d, offs_t, offs_d, T, D, 0, key_end, row_stride,
            k_ref, tl.full([BLOCK_Q, BLOCK_D], -float("inf"), tl.float32), tl.zeros([BLOCK_Q, BLOCK_D], tl.float32),
            tl.zeros([BLOCK_Q, BLOCK_D], tl.float32), CAUSAL)
        o = num / den
        o_rounded = o.to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + out_offsets, o_rounded, mask=redo)
        if STORE_O_RESIDUAL:
            tl.store(o_residual_ptr + out_offsets, (o - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty),
                     mask=redo)
        if STORE_LSE:
            refs, refs_err = _two_sum(running_max, k_ref[None, :])
            lse, lse_residual = _two_sum(refs, tl.log(den) + refs_err)
            tl.store(lse_ptr + out_offsets, lse, mask=redo)
            if STORE_LSE_RESIDUAL:
                tl.store(lse_residual_ptr + out_offsets, lse_residual, mask=redo)


def chunkwise(
    *,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    chunk_size: int = 64,
    block_q: int | None = None,
    block_d: int = 64,
    num_warps: int | None = None,
    num_stages: int = 3,
    precision: str = "auto",
    tma: bool = True,
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, None]:
    """AFT-full forward; returns (o [B, T, H, D] in the input dtype, None). With ``saved`` (a dict) it also
    stores there what chunkwise_backward needs: "lse", the fp32 log-normalizer per (b, t, h, d), and the part
    of it or of o that rounding dropped, "o_residual" for 16-bit inputs, "lse_residual" for fp32 (module
    docstring, "Saved vs recomputed")."""
    B, T, H, D = k.shape
    half_operands = k.dtype != torch.float32
    if precision == "auto":
        precision = "split" if k.dtype == torch.float16 else "single"
    split = half_operands and precision == "split"
    block_q = FORWARD_BLOCK_Q if block_q is None else block_q
    num_warps = FORWARD_NUM_WARPS if num_warps is None else num_warps
    BLOCK_D = min(block_size(D), block_d)
    operand_dtype = torch.float16 if half_operands else torch.float32
    operand_scale = OPERAND_MAX.value if half_operands else 1.0
    device = k.device

    def operand(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        hi = torch.empty(shape, dtype=operand_dtype, device=device)
        return hi, (torch.empty_like(hi) if split else hi)  # lo is never touched unless split

    a_hi, a_lo = operand(T, T)
    eev_hi, eev_lo = operand(B * H, T, 2 * D)  # E and E * v, alternating per channel (_pairs)
    anchor = torch.empty(T, dtype=torch.float32, device=device)
    own_bias_max = torch.empty_like(anchor)
    n_blocks = triton.cdiv(T, chunk_size)
    move = torch.empty((B * H, n_blocks, 2 * D), dtype=torch.float32, device=device)
    block_ref = torch.empty((B * H, n_blocks, D), dtype=torch.float32, device=device)
    block_peak = torch.empty_like(block_ref)
    block_unscale = torch.empty_like(block_ref)
    group_ref = torch.empty((B * H, triton.cdiv(T, GROUP.value), D), dtype=torch.float32, device=device)
    group_unscale = torch.empty_like(group_ref)
    group_move = torch.empty((B * H, triton.cdiv(T, GROUP.value), 2 * D), dtype=torch.float32, device=device)

    use_tma = tma and tma_fits(a_hi, eev_hi)
    if use_tma:
        allow_device_descriptors(device)
    o = torch.empty_like(v)
    lse = lse_residual = o_residual = o
    if saved is not None:
        lse = saved["lse"] = torch.empty(v.shape, dtype=torch.float32, device=device)
        if half_operands:
            o_residual = saved["o_residual"] = torch.empty_like(v)
        else:
            lse_residual = saved["lse_residual"] = torch.empty_like(lse)
    grid = (triton.cdiv(T, block_q), B * H, triton.cdiv(D, BLOCK_D))
    fallback = torch.empty(math.prod(grid), dtype=torch.int32, device=device)
    stores = dict(STORE_LSE=saved is not None, STORE_LSE_RESIDUAL=saved is not None and not half_operands,
                  STORE_O_RESIDUAL=saved is not None and half_operands)
    key_block_d = min(block_size(D), KEY_FACTORS_BLOCK_D, KEY_FACTORS_TILE // chunk_size)
    key_warps = 8 if chunk_size > 64 else 4
    prefix_block_d = min(block_size(D), PREFIX_BLOCK_D)
    launch_after_checks(
        await_checks,
        Launch(_bias_factors_kernel, (triton.cdiv(T, GROUP.value),), w, a_hi, a_lo, anchor, own_bias_max, T,
               CAUSAL=causal, SPLIT=split, OPERAND_SCALE=operand_scale, BLOCK_KEYS=BIAS_BLOCK_KEYS, num_warps=4),
        Launch(_key_block_stats_kernel, (n_blocks, B * H, triton.cdiv(D, key_block_d)),
               k, v, block_ref, block_peak, T, H, D, BLOCK_K=chunk_size, BLOCK_D=key_block_d, num_warps=key_warps),
        Launch(_key_prefix_kernel, (B * H, triton.cdiv(D, prefix_block_d)),
               block_ref, block_peak, block_unscale, n_blocks, D,
               HALF_OPERANDS=half_operands, SCAN_BLOCKS=PREFIX_SCAN_BLOCKS, BLOCK_D=prefix_block_d, num_warps=4),
        Launch(_key_factors_kernel, (n_blocks, B * H, triton.cdiv(D, key_block_d)),
               k, v, eev_hi, eev_lo, move, block_ref, block_peak, block_unscale, group_ref, group_unscale, group_move,
               T, H, D,
               SPLIT=split, HALF_OPERANDS=half_operands, OPERAND_SCALE=operand_scale,
               BLOCK_K=chunk_size, BLOCK_D=key_block_d, num_warps=key_warps),
        Launch(_aft_fwd_kernel, grid,
               w, k, v, a_hi, a_lo, anchor, eev_hi, eev_lo, move, group_ref, group_unscale, group_move,
               own_bias_max, o, lse, lse_residual, o_residual, fallback,
               T, H, D, DEN_FLOOR[half_operands],
               CAUSAL=causal, SPLIT=split, HALF_OPERANDS=half_operands,
               DOT_PRECISION="tf32" if half_operands else "ieee", OPERAND_SCALE=operand_scale,
               HEADROOM_LOG2=OWN_HEADROOM_LOG2[half_operands], TMA=use_tma,
               BLOCK_Q=block_q, BLOCK_K=chunk_size, BLOCK_D=BLOCK_D,
               num_warps=num_warps, num_stages=num_stages, **stores),
        Launch(_aft_fallback_kernel, grid,
               w, k, v, o, lse, lse_residual, o_residual, fallback, T, H, D,
               CAUSAL=causal, BLOCK_Q=block_q, BLOCK_D=BLOCK_D, num_warps=num_warps, **stores),
    )
    return o, None


# ------------------------------------------------------------------------------------------------ backward

# The factor exp(m_t + m_d - lse_td) the two shifted exps leave to an entry stays below 1 / DEN_FLOOR; a tile
# where it would not is recomputed exactly, per key (the forward's fallback, met on the same inputs).
LOG_FACTOR_LIMIT = {half: -math.log(floor) for half, floor in DEN_FLOOR.items()}


@triton.jit
def _product(a_hi, a_lo, b_hi, b_lo, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b in fp32; with SPLIT, (a_hi + a_lo / LO_SCALE) @ (b_hi + b_lo / LO_SCALE) without the lo.lo term."""
    product = tl.dot(a_hi, b_hi, input_precision=DOT_PRECISION)
    if SPLIT:
        cross = tl.dot(a_hi, b_lo, input_precision=DOT_PRECISION)
        cross = tl.dot(a_lo, b_hi, cross, input_precision=DOT_PRECISION)
        product += cross * (1.0 / LO_SCALE)
    return product


@triton.jit
def _scaled_product(a, a_scale, b, b_scale, SPLIT: tl.constexpr, OP_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """a @ b of fp32 tiles whose rows of a (a_scale, [M]) and columns of b (b_scale, [N]) are already scaled into
    the operand range; returns the product with both scales divided out (a_scale, b_scale are the inverses)."""
    a_hi, a_lo = _operand_parts(a, SPLIT, OP_DTYPE, LO_SCALE)
    b_hi, b_lo = _operand_parts(b, SPLIT, OP_DTYPE, LO_SCALE)
    return _product(a_hi, a_lo, b_hi, b_lo, SPLIT, DOT_PRECISION) * a_scale[:, None] * b_scale[None, :]


@triton.jit
def _bias_tile(w_ptr, offs_t, offs_s, T, CAUSAL: tl.constexpr):
    """A (query block, key block) tile of w, -inf where a key is not visible, and its row references m_t
    (max over the tile's visible keys; 0 for rows that see none, whose A row is then 0)."""
    visible = (offs_t[:, None] < T) & (offs_s[None, :] < T)
    if CAUSAL:
        visible = visible & (offs_s[None, :] <= offs_t[:, None])
    w = tl.load(w_ptr + offs_t.to(tl.int64)[:, None] * T + offs_s[None, :], mask=visible, other=0.0).to(tl.float32)
    w = tl.where(visible, w, -float("inf"))
    row_max = tl.max(w, 1)
    sees_a_key = row_max > -float("inf")
    return w, tl.where(sees_a_key, row_max, 0.0), sees_a_key


@triton.jit
def _key_tile(k_ptr, base, offs_s, offs_d, T, D, row_stride):
    """A (key block, channel block) tile of k and E = exp(k - m_d), m_d its channel references (max over the
    block's keys, finite: every key block starts inside T); E is 0 for keys past T."""
    key_in = offs_s < T
    k = tl.load(k_ptr + base + offs_s[:, None] * row_stride + offs_d[None, :],
                mask=key_in[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    col_ref = tl.max(tl.where(key_in[:, None], k, -float("inf")), 0)
    return col_ref, tl.where(key_in[:, None], tl.exp(k - col_ref[None, :]), 0.0)


@triton.jit
def _log_factor(row_ref, sees_a_key, col_ref, lse, lse_residual, d_in):
    """log F_td = m_t + m_d - lse_td, -inf for rows that see no key and channels past D.

    A small number made of large ones (|lse| is a few units, far more for shifted keys): summed with TwoSum,
    its error is that of the result rather than of lse's magnitude, for every entry of P it scales."""
    refs, refs_err = _two_sum(row_ref[:, None], col_ref[None, :])
    log_factor, log_factor_err = _two_sum(refs, -lse)
    log_factor += refs_err + log_factor_err - lse_residual
    return tl.where(sees_a_key[:, None] & d_in[None, :], log_factor, -float("inf"))


@triton.jit
def _load_lse(lse_ptr, lse_residual_ptr, offsets, mask, HAS_RESIDUAL: tl.constexpr):
    """The forward's log-normalizer as (lse, its rounding residual; 0 where none was saved)."""
    lse = tl.load(lse_ptr + offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(lse_residual_ptr + offsets, mask=mask, other=0.0)
    else:
        residual = tl.zeros_like(lse)
    return lse, residual


@triton.jit
def _load_o(o_ptr, o_residual_ptr, offsets, mask, HAS_RESIDUAL: tl.constexpr):
    """The forward's fp32 o to about twice the 16-bit precision (o + its saved rounding residual): v - o is
    small where one key dominates a weight, and o's own rounding would show there."""
    o = tl.load(o_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        o += tl.load(o_residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    return o


@triton.jit
def _aft_key_weights(w_ptr, k_ptr, lse, lse_residual, base, key, offs_t, offs_d, T, D, row_stride,
                     CAUSAL: tl.constexpr):
    """P_{t,key,d} = exp(w_t,key + k_key,d - lse_td) for one key over a [BLOCK_Q, BLOCK_D] tile, exactly:
    lse_td bounds every logit of row t, so the exponent is <= 0 (up to its rounding). 0 outside the tile."""
    row_in = offs_t < T
    d_in = offs_d < D
    seen = row_in & (key < T)
    if CAUSAL:
        seen = seen & (key <= offs_t)
    w_col = tl.load(w_ptr + offs_t.to(tl.int64) * T + key, mask=seen, other=0.0).to(tl.float32)
    k_row = tl.load(k_ptr + base + key * row_stride + offs_d, mask=d_in & (key < T), other=0.0).to(tl.float32)
    # As in _log_factor: the exponent is small, its parts are not; TwoSum rounds it once.
    logit, logit_err = _two_sum(w_col[:, None], k_row[None, :])
    exponent, exponent_err = _two_sum(logit, -lse)
    exponent += logit_err + exponent_err - lse_residual
    return tl.where(seen[:, None] & d_in[None, :], tl.exp(exponent), 0.0)


# dv_sd = sum_t P_tsd do_td,   dk_sd = sum_t P_tsd do_td (v_sd - o_td),   P_tsd = exp(w_ts + k_sd - lse_td).
# Per (query block, key block) tile P factorizes as A_ts E_sd F_td with A = exp(w - m_t), E = exp(k - m_d),
# F = exp(m_t + m_d - lse): with G = do * F, dv = E * (A^T G) and dk = E * (v * (A^T G) - A^T (G * o)).
@triton.jit
def _aft_bwd_dkdv_kernel(
    w_ptr, k_ptr, v_ptr, o_ptr, o_residual_ptr, lse_ptr, lse_residual_ptr, do_ptr, dk_ptr, dv_ptr,
    T, H, D, log_factor_limit,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    batch = (pid_bh // H).to(tl.int64)
    head = pid_bh % H
    base = batch * T * H * D + head * D
    row_stride = H * D
    OP_DTYPE: tl.constexpr = tl.float16 if HALF_OPERANDS else tl.float32

    offs_s = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    kv_in = (offs_s[:, None] < T) & (offs_d[None, :] < D)
    kv_offsets = base + offs_s[:, None] * row_stride + offs_d[None, :]
    v = tl.load(v_ptr + kv_offsets, mask=kv_in, other=0.0).to(tl.float32)
    col_ref, e = _key_tile(k_ptr, base, offs_s, offs_d, T, D, row_stride)
    dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)

    # Causal: queries before the key block see none of its keys.
    first_query = (pid_s * BLOCK_K // BLOCK_Q) * BLOCK_Q if CAUSAL else 0
    for start in range(first_query, T, BLOCK_Q):
        offs_t = start + tl.arange(0, BLOCK_Q)
        td_in = (offs_t[:, None] < T) & (offs_d[None, :] < D)
        td_offsets = base + offs_t[:, None] * row_stride + offs_d[None, :]
        do = tl.load(do_ptr + td_offsets, mask=td_in, other=0.0).to(tl.float32)
        o = _load_o(o_ptr, o_residual_ptr, td_offsets, td_in, HALF_OPERANDS)
        lse, lse_residual = _load_lse(lse_ptr, lse_residual_ptr, td_offsets, td_in, not HALF_OPERANDS)
        w, row_ref, sees_a_key = _bias_tile(w_ptr, offs_t, offs_s, T, CAUSAL)
        log_factor = _log_factor(row_ref, sees_a_key, col_ref, lse, lse_residual, offs_d < D)
        exact = tl.max(log_factor) > log_factor_limit  # the shifted exps would be too small to carry P
        if EXACT_DIAGONAL:
            # Near the diagonal o_t is an average of few values, close to v_s: v * (A^T G) - A^T (G * o)
            # cancels there, where the per-key sum of P do (v - o) does not.
            exact = exact | (start < (pid_s + 1) * BLOCK_K - 1)
        if exact:
            for i in range(BLOCK_K):  # one key at a time, each P entry exact
                key = pid_s * BLOCK_K + i
                p_do = do * _aft_key_weights(w_ptr, k_ptr, lse, lse_residual, base, key, offs_t, offs_d, T, D,
                                             row_stride, CAUSAL)
                v_key = tl.load(v_ptr + base + key * row_stride + offs_d, mask=(offs_d < D) & (key < T),
                                other=0.0).to(tl.float32)
                is_key = (offs_s == key)[:, None]
                dv = tl.where(is_key, dv + tl.sum(p_do, 0)[None, :], dv)
                dk = tl.where(is_key, dk + tl.sum(p_do * (v_key[None, :] - o), 0)[None, :], dk)
        else:
            a = tl.exp(w - row_ref[:, None])  # [0, 1]; 0 where not visible
            g = do * tl.exp(log_factor)  # F <= 1 / DEN_FLOOR here
            g_scale, g_unscale = _operand_scale(tl.max(tl.abs(g), 0), HALF_OPERANDS)
            go = g * o
            go_scale, go_unscale = _operand_scale(tl.max(tl.abs(go), 0), HALF_OPERANDS)
            a_scale, a_unscale = _operand_scale(tl.full([BLOCK_K], 1.0, tl.float32), HALF_OPERANDS)  # A <= 1
            a_t = tl.trans(a) * a_scale[:, None]
            x = _scaled_product(a_t, a_unscale, g * g_scale[None, :], g_unscale, SPLIT, OP_DTYPE, DOT_PRECISION)
            y = _scaled_product(a_t, a_unscale, go * go_scale[None, :], go_unscale, SPLIT, OP_DTYPE, DOT_PRECISION)
            dv += e * x
            dk += e * (v * x - y)
    tl.store(dv_ptr + kv_offsets, dv.to(dv_ptr.dtype.element_ty), mask=kv_in)
    tl.store(dk_ptr + kv_offsets, dk.to(dk_ptr.dtype.element_ty), mask=kv_in)


# dw_ts = sum_{b,h,d} P_tsd do_td (v_sd - o_td). With the same factorization, A (shared by batch and heads)
# comes out of the sum: dw = A * sum_{b,h} (G @ (E * v)^T - (G * o) @ E^T), contracted over D.
@triton.jit
def _aft_bwd_dw_kernel(
    w_ptr, k_ptr, v_ptr, o_ptr, o_residual_ptr, lse_ptr, lse_residual_ptr, do_ptr, dw_ptr,
    B, T, H, D, log_factor_limit,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    row_stride = H * D
    OP_DTYPE: tl.constexpr = tl.float16 if HALF_OPERANDS else tl.float32
    offs_t = pid_t * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_s = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)
    dw = tl.zeros([BLOCK_Q, BLOCK_K], tl.float32)

    n_heads = B * H
    if CAUSAL:
        # A tile whose every key comes after every query has dw = 0: no work.
        n_heads = tl.where(pid_s * BLOCK_K > pid_t * BLOCK_Q + BLOCK_Q - 1, 0, n_heads)
    # As for dk: near the diagonal G @ (E * v)^T - (G * o) @ E^T cancels, the per-key sum does not.
    on_diagonal = pid_t * BLOCK_Q < (pid_s + 1) * BLOCK_K - 1
    w, row_ref, sees_a_key = _bias_tile(w_ptr, offs_t, offs_s, T, CAUSAL)
    a = tl.exp(w - row_ref[:, None])  # [0, 1]; 0 where not visible
    for bh in range(0, n_heads):
        base = (bh // H).to(tl.int64) * T * H * D + (bh % H) * D
        for d_start in range(0, D, BLOCK_D):
            offs_d = d_start + tl.arange(0, BLOCK_D)
            td_in = (offs_t[:, None] < T) & (offs_d[None, :] < D)
            td_offsets = base + offs_t[:, None] * row_stride + offs_d[None, :]
            do = tl.load(do_ptr + td_offsets, mask=td_in, other=0.0).to(tl.float32)
            o = _load_o(o_ptr, o_residual_ptr, td_offsets, td_in, HALF_OPERANDS)
            lse, lse_residual = _load_lse(lse_ptr, lse_residual_ptr, td_offsets, td_in, not HALF_OPERANDS)
            col_ref, e = _key_tile(k_ptr, base, offs_s, offs_d, T, D, row_stride)
            log_factor = _log_factor(row_ref, sees_a_key, col_ref, lse, lse_residual, offs_d < D)
            exact = tl.max(log_factor) > log_factor_limit
            if EXACT_DIAGONAL:
                exact = exact | on_diagonal
            if exact:
                for i in range(BLOCK_K):
                    key = pid_s * BLOCK_K + i
                    p_do = do * _aft_key_weights(w_ptr, k_ptr, lse, lse_residual, base, key, offs_t, offs_d, T, D,
                                                 row_stride, CAUSAL)
                    v_key = tl.load(v_ptr + base + key * row_stride + offs_d, mask=(offs_d < D) & (key < T),
                                    other=0.0).to(tl.float32)
                    column = tl.sum(p_do * (v_key[None, :] - o), 1)
                    dw = tl.where((offs_s == key)[None, :], dw + column[:, None], dw)
            else:
                v = tl.load(v_ptr + base + offs_s[:, None] * row_stride + offs_d[None, :],
                            mask=(offs_s[:, None] < T) & (offs_d[None, :] < D), other=0.0).to(tl.float32)
                ev = e * v
                g = do * tl.exp(log_factor)
                go = g * o
                g_scale, g_unscale = _operand_scale(tl.max(tl.abs(g), 1), HALF_OPERANDS)
                go_scale, go_unscale = _operand_scale(tl.max(tl.abs(go), 1), HALF_OPERANDS)
                ev_scale, ev_unscale = _operand_scale(tl.max(tl.abs(ev), 1), HALF_OPERANDS)
                e_scale, e_unscale = _operand_scale(tl.max(e, 1), HALF_OPERANDS)
                gv = _scaled_product(g * g_scale[:, None], g_unscale, tl.trans(ev * ev_scale[:, None]), ev_unscale,
                                     SPLIT, OP_DTYPE, DOT_PRECISION)
                gov = _scaled_product(go * go_scale[:, None], go_unscale, tl.trans(e * e_scale[:, None]), e_unscale,
                                      SPLIT, OP_DTYPE, DOT_PRECISION)
                dw += a * (gv - gov)
    ts_in = (offs_t[:, None] < T) & (offs_s[None, :] < T)
    tl.store(dw_ptr + offs_t.to(tl.int64)[:, None] * T + offs_s[None, :], dw.to(dw_ptr.dtype.element_ty), mask=ts_in)


def chunkwise_backward(
    *,
    o: torch.Tensor,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    chunk_size: int = 64,
    block_q: int | None = None,
    block_d: int = 64,
    num_warps: int | None = None,
    num_stages: int = 3,
    precision: str = "auto",
    **ignored: object,
) -> dict[str, torch.Tensor]:
    """Gradients of <do, o> for the chunkwise forward: {"w": dw [T, T], "k": dk, "v": dv}, in the input dtype."""
    B, T, H, D = k.shape
    block_q = BACKWARD_BLOCK_Q if block_q is None else block_q
    num_warps = BACKWARD_NUM_WARPS if num_warps is None else num_warps
    if T == 1:
        # One key, weight 1 whatever w and k are: o = v. The factorized sums would leave a rounding residue
        # where the exact gradients of w and k are 0 (an infinite relative error).
        return {"w": torch.zeros_like(w), "k": torch.zeros_like(k), "v": do.clone()}
    half_operands = k.dtype != torch.float32
    if precision == "auto":
        precision = "split" if k.dtype == torch.float16 else "single"
    # Channel blocks of at most 64 (dk/dv) and 32 (dw) whatever block_d is: a dk/dv program holds six [BLOCK_K,
    # BLOCK_D] fp32 tiles (dk, dv, A^T G, A^T (G o), v, E) and a dw program five [BLOCK_Q, BLOCK_D] ones besides its
    # [BLOCK_Q, BLOCK_K] pair;
    # ptxas (sm_90, 64 x 64 blocks, 8 warps, bf16) spills 1.7 KB a thread at 128 channels, none at 64 (dk/dv)
    # and 32 (dw). dw loops over channel blocks, so its width costs no parallelism.
    dkdv_block_d = min(block_size(D), block_d, 64)
    dw_block_d = min(block_size(D), block_d, 32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dw = torch.empty_like(w)
    common = dict(
        CAUSAL=causal,
        SPLIT=half_operands and precision == "split",
        HALF_OPERANDS=half_operands,
        DOT_PRECISION="tf32" if half_operands else "ieee",
        BLOCK_Q=block_q, BLOCK_K=chunk_size,
        num_warps=num_warps, num_stages=num_stages,
    )
    limit = LOG_FACTOR_LIMIT[half_operands]
    # The pointers of what a dtype did not save are never read (constexpr branches): any tensor stands in.
    o_residual = saved.get("o_residual", o)
    lse_residual = saved.get("lse_residual", saved["lse"])
    # fp32's floor is below what the factorized sums' cancellation near the diagonal leaves (excess 4-5 measured).
    exact_diagonal = causal and not half_operands
    _aft_bwd_dkdv_kernel[(triton.cdiv(T, chunk_size), B * H, triton.cdiv(D, dkdv_block_d))](
        w, k, v, o, o_residual, saved["lse"], lse_residual, do, dk, dv, T, H, D, limit,
        EXACT_DIAGONAL=exact_diagonal, BLOCK_D=dkdv_block_d, **common)
    _aft_bwd_dw_kernel[(triton.cdiv(T, block_q), triton.cdiv(T, chunk_size))](
        w, k, v, o, o_residual, saved["lse"], lse_residual, do, dw, B, T, H, D, limit,
        EXACT_DIAGONAL=exact_diagonal, BLOCK_D=dw_block_d, **common)
    return {"w": dw, "k": dk, "v": dv}


BACKWARD = {"chunkwise": chunkwise_backward}
