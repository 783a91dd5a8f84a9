"""aft (AFT-full, FORMULATIONS.md 6): the chunkwise form as matrix products on precomputed factors (no state).

    o_t = sum_{i<=t} exp(w_{t,i} + k_i) * v_i / sum_{i<=t} exp(w_{t,i} + k_i)
    (elementwise over D; all i when causal=False)

Conventions: w [T, T], k, v [B, T, H, D], o [B, T, H, D] in the input dtype (fp16, bf16 or fp32).

Two forwards compute o. The anchored forward takes 16-bit inputs with "single" operands (bf16's default) where
their checks pass; the running forward takes every row the anchored one marks, and every call of other inputs.

Anchored forward (_visible_bias_kernel, _anchored_keys_kernel, _aft_anchored_fwd_kernel). One reference per row of
w and one per channel, for the whole sequence:

    A_ts = exp(w_ts - M_t) 2^15  over row t's visible keys (0 past the diagonal), M_t their largest bias
    E_sd = exp(k_sd - k_0d)        k_0 the head's first key: a key every row sees, so the reference is causal
    num_td = (A @ (E * v 2^s))_td,   den_td = (A @ E)_td,   o = num / den / 2^s

with 2^s the power of two that moves max_d |v_0d| to [2, 4) (_value_scale; also from the first key). The main
loop is then a plain product, no rescale and no own tile: one [128, 256] fp32 accumulator (den and num side by
side, _pairs) per program of 128 queries and 128 channels, A and [E, E * v] read through tensor descriptors, A's
zeros past the diagonal standing in for the causal mask. Its operands are fp16, rounded once each, and its checks
keep every one of them in fp16's normal range, or where not, inside one rounding of what it serves:

- a key fails where |k_sd - k_0d| > KEY_WINDOW (9.5 nats: E in [2^-13.7, 2^13.7]) in any channel of its head,
  where E * v 2^s leaves fp16's range, where min_d E_sd times max_d |v_sd 2^s| is below EV_FLOOR (2^-13: an
  E * v entry below fp16's normal range then errs by 2^-25 at most, under one fp16 rounding of the key's largest
  entry), or where k or v is not finite; its operands are stored as 0 (0 * inf would be NaN for the rows before
  it, whose A is 0 there), and it marks its row and every later row of its head (every row without causality);
- a row fails where its visible bias spreads over more than BIAS_WINDOW (20 nats: A >= 2^-13.8) or holds a
  non-finite entry, and marks itself.

Nothing then underflows: den >= E of the row's best-biased key >= 2^-13.7. E's exponent may be positive, unlike
every other exponent here: a reference fixed for the whole sequence and seen by every row cannot be a running
maximum; the window bounds it by 9.5 before any exp is taken. A marked row's o is NaN and its tiles of
the running forward's grid are listed; the running forward computes those tiles over the list and writes only the
marked entries (_aft_listed_kernel), its factor kernels returning at once where the list is empty. Row t's
mark depends on keys <= t and on row t's bias alone, so which forward answers row t is causal, as each forward
is. The registry's inputs mark no row (measured at the bench shape and at T = 16384, bf16 and fp16), nor do keys
shifted by +-60 (k_0 moves with them: a shift of k changes nothing, bitwise). Accuracy is the running forward's with
"single" (bf16 excess 1.013 against its 1.012 at T = 1024); the time is a product's (reports/bench.md, session 31).
The anchored forward's operands take the running forward's buffers: the two never need them at once.

Running forward (tensor cores). exp(w_ti + k_id) factorizes into a bias factor and a key factor, so both sums
are matrix products per (batch, head):

    A_ti = exp(w_ti - M_t)     M_t = max of w_ti over row t's factorized keys (below): the row's anchor
    E_id = exp(k_id - C_d)     C_d = a running maximum of k_d over the keys (below)
    num_td = (A @ (E * v))_td,   den_td = (A @ E)_td   (both relative to exp(M_t + C_d))

Every exponent is <= 0. A depends on w alone and E, E * v on no query, so each factor is computed once, in launches of
its own, rather than once per head (A) or per query tile (E); the main loop is loads and two products. Launches:

1. _bias_factors_kernel: A as a [T, T] dot operand (shared by all B * H heads) and the anchors M_t; causal, also
   W_t, the largest w_ti over the keys of row t's own tile up to t (below).
2. The key factors, over the keys in blocks of BLOCK_K (chunk_size): the running maximum of k, C(j) at every
   block's end, and the peaks of |E * v| relative to it (each block's, and the running one over every key so far);
   per block j the operands E = exp(k - C(j)) and E * v S(j) (S(j): the block's E * v scale), and the per-channel
   factors that move sums made so far from one block to the next. E and E * v are stored side by side, channel
   d's in columns 2 d and 2 d + 1 of one [B * H, T, 2 D] operand, and so are the two sums' move factors. The
   running values are prefixes over the sequence, so three launches, each parallel over key blocks or channels,
   make them: _key_block_stats_kernel (each block's own maximum of k and peak of |E * v| relative to it, per
   channel), _key_prefix_kernel (an associative scan over the blocks per channel: C(j), S(j) and the running
   peak's scale S_run(j), the units of the next tile's own E * v operands),
   _key_factors_kernel (the operands and move factors, per block, from C and S at the block and the one before).
3. _aft_fwd_kernel: one program per BLOCK_Q queries x BLOCK_D channels of one (batch, head), grid (query
   blocks, B * H, channel blocks), causal tiles longest first: the products over the key blocks, then (causal)
   every row's own tile, all in one lower-triangular product over the tile's own rows (below). den and num are
   likewise side by side in one [BLOCK_Q, 2 BLOCK_D] accumulator, so each key block is one product
   (A @ [E, E * v]) and one per-column rescale, its operand tiles read through tensor descriptors (TMA on sm_90;
   option tma) where their rows are 16-byte aligned; a block's move factors are loaded during the block before,
   so the rescale never waits on memory.
4. Causal with 16-bit inputs, the redo pass (_aft_listed_kernel with REDO_OWN): the tiles where only the own
   tile's fp16 operands failed (below), their marked entries summed again with fp32 own operands; a few programs
   per SM take in turn the tiles the main kernel listed.
5. _aft_fallback_kernel: the entries whose factorized sums lost their precision, summed exactly (below); a few
   programs per SM take in turn the tiles the main kernel and the redo pass listed.

The references move forward by vectors. Block j's products are relative to exp(M_t + C(j)), C(j) <= C(j+1); the
accumulators move from C(j-1) to C(j) by exp(C(j-1) - C(j)) <= 1 per channel (no [BLOCK_Q, BLOCK_D] exponential),
and the product accumulates inside the dot: num is kept in units of the current E * v scale (below), which its
columns' move factor carries. Adding a constant to k moves every C and K with it and changes nothing else.

Causality (bitwise): output t may depend only on w_t,i, k_i and v_i for i <= t, including through the rounding.
A block's references (C(j), S(j)) are taken over all its keys, so when causal (chunk_size must divide block_q):

- Row t's factorized keys are those before its own tile of BLOCK_Q rows, i < BLOCK_Q floor(t / BLOCK_Q); M_t is
  their maximum (rows of the first tile have none).
- The main loop covers the key blocks before the tile, which end exactly at its first query (BLOCK_K divides
  BLOCK_Q). So every row of a tile ends relative to exp(M_t + C(n-1)) in units of S(n-1), n-1 the block just
  before the tile, which no key of the tile touches.
- Row t's own keys, BLOCK_Q floor(t / BLOCK_Q) .. t, are rows of its tile, so they are one product for the whole
  tile: A_own [BLOCK_Q, BLOCK_Q] with A_own_ti = exp(w_ti - ref_t) for i <= t (0 after: lower triangular), and
  [E_own, E_own * v] made from the tile's own k and v. ref_t = max(M_t, W_t) (W_t the largest w over those keys;
  rows of the first tile: W_t), so A_own <= 1. E_own_id = exp(k_id - R_d) with R = C(n-1), the factorized sums'
  reference (k_0, a key every row sees, for the first tile), and E_own * v takes the units S_run(n-1) of the
  running peak of |E * v| over every key before the tile (for the first tile 2^(14 - 8 + 4), which makes its
  E_own * v operands v / 2 times its E_own ones): an own key's |E v| has to pass all of theirs, not one block's,
  to overflow them. An own key may pass R (it comes after the blocks that set it): E_own is let up to 2^8 (2^32
  with fp32 operands) and scaled down by as much (OWN_HEADROOM_LOG2), E_own * v is scaled down by 2^4 (2^32;
  OWN_EV_HEADROOM_LOG2), and the factorized sums move to those units (den to E's, num to E * v's: from S(n-1) to
  S_run(n-1) / 2^4, powers of two) and to ref_t (by exp(M_t - ref_t) <= 1) before the product adds to them. A
  key row's operands serve the later rows of the tile while its 0 in A_own hides it from the earlier ones: they
  are made finite whatever k and v are (selected, 0 * inf being NaN), and rows whose keys so far were cut are
  sent to the redo pass (below).

When causal=False every key is factorized and the main loop covers them all.

Where the factorization loses: M_t + C_d bounds every logit w_ti + k_id from above, but the row's best w and
the channel's best k may sit at different keys, so every term of (t, d) can be far below exp(M_t + C_d), i.e.
den (relative to that reference) far below 1. fp32 keeps relative precision down to 2^-126, but the 16-bit
dot operands flush tiny values, and the product of two shifted exps can underflow outright (w = [0, -100], k =
[-100, 0] gives two terms of e^-100 relative to the reference: 0/0 in any dtype). Every entry whose factorized
den ends below DEN_FLOOR (2^-12 with fp16 operands, 2^-60 with fp32) is recomputed exactly over all its keys,
one key at a time with a running maximum per (t, d) (fp32, one exp per entry and key; logits w + (k - k_0) so
a shift of k still cancels); so is every entry whose den, own tile included, ends below DEN_FLOOR (the own
tile's W and its keys' k can sit at different keys too). Causal, the own tile adds three more reasons, per
row and over its keys up to t: an own key more than 2^8 (2^32) above R, or a non-finite one; an E_own * v
operand past fp16's range (2^15: |E v| more than 2^19 / S); and a nonzero E_own * v operand below fp16's normal
range (2^-14: v tiny, or the blocks before set a large S) where |num| is below 2^-11 (2^-22 split) of A_own's
row sum, so that such operands' absolute error (2^-25, 2^-36 split) could reach 2^-14 of num. The main kernel
marks those entries (their den, hence o, becomes NaN) and lists its tile for the pass it needs (OWN_ONLY or
WALK_ALL). The own tile's reasons come from its fp16 operands, not from the factorized sums, so where they are
all there is, the redo pass recomputes the tile with the own product in fp32 (own keys up to 2^32 above R, no
range or subnormal limit on E_own * v, exact products) and writes only the marked entries; whatever it still
marks, and every entry of a tile whose factorized den fell below the floor, the fallback kernel recomputes over
all keys. The choice is per entry (per row for the own tile's flags: the passes' cost is per tile) and made on
keys up to t, so it is causal too, and every entry not marked keeps the first pass's value. The fallback's walk
is slow (a late tile's is thousands of steps, milliseconds) but only meets inputs whose bias and keys together
span more than about 8 nats against each other; for the registry's N(0, 1) inputs den is near n_keys * e^-7.
The redo pass is one more main-loop product per tile it takes: on those inputs the odd first tile (where an
own key passes k_0 by 5.5 nats: about 5e-5 of those keys and channels) and a few later ones, 10 of the 4096
programs' tiles in all at B = 2, T = 4096, H = 16, D = 128. Above the floor, every term that matters keeps the
operands' relative precision.

Numerics of the dot operands (OPTIONS["chunkwise"]["precision"]):

- 16-bit inputs use fp16 operands, also for bf16 inputs: A and E lie in [0, 1] and are scaled by 2^15, E * v
  by a power of two S per channel (``_numerics.pow2_scale``: exact) that moves the peak of |E * v| over the
  operands it scales (a block's, relative to its C) to [2^14, 2^15), so fp16's range holds every operand and
  its 11-bit mantissa is 8x finer than bf16's. A large |E * v| earlier in the sequence (one that no row weighs
  much: a low bias) thus leaves the later blocks their precision. num is carried in the units of the latest S,
  so S is floored at 2^-64 of the running peak's (SCALE_REACH): num then stays under n_keys * 2^79.
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
fp32 inputs), E and E * v each one operand per element of k (twice with "split"); the anchors and own-tile bias
maxima (T each) and the per-block references, peaks, scales and running scales (B * H * D each per block) and
move factors (two per channel) are fp32. At B = 8, T = 4096, H = 16, D = 128 in bf16: A 32 MiB, E and E * v
256 MiB, the block references, peaks, scales and running scales 4 MiB each and their move factors 8 MiB: 312 MiB
in all (600 MiB with "split"). The anchored forward's A, E and E * v take A's and E, E * v's buffers; it adds each
row's bias spread (T, fp32), each head's first failed key (B * H, int32) and the list of tiles it leaves (an int32
per tile of the running forward's grid).

Backward (chunkwise_backward, BACKWARD["chunkwise"]). Per channel, o is a
softmax average: with P_tsd = exp(w_ts + k_sd - lse_td) (0 for s > t when
causal) and lse_td = log sum_s exp(w_ts + k_sd),

    dv_sd = sum_t P_tsd do_td
    dk_sd = sum_t P_tsd do_td (v_sd - o_td)          (so sum_s dk_sd = 0: a shift of k changes nothing)
    dw_ts = sum_{b,h,d} P_tsd do_td (v_sd - o_td)    (w is shared by batch and heads)

Two ways to the same sums, both without atomics (every fp32 sum in a fixed
order, deterministic):

- Factorized (16-bit inputs; the comment "backward, factorized" has its
  math): P_tsd = A_ts H_td exp(k_sd) with one reference per row of w
  (A = exp(w - M_t) in [0, 1], H = exp(M_t - lse)), so every sum is a
  product of operands made once each: A ([T, T], shared by every head), do H
  and do o H per query tile and channel for dk and dv (the forward's main
  loop turned over: one program per key block, head and channel block, over
  the query tiles), and, for dw, do H, do o H, exp(k) v and exp(k) as rows of
  [T, B * H * D], so that dw's sum over batch, heads and channels is one
  [T, B H D] x [B H D, T] product (two) per tile. Six launches: A; the key
  rows; the query rows; the query columns; dk and dv; dw. Every operand group
  is scaled to its own peak (fp16 at 2^-11, "split" for fp16 inputs) and
  every scale is kept as a logarithm, so no exponential of a large number is
  formed alone (keys shifted by 60 stay at the floor).
- Per tile (fp32 inputs; and any 16-bit call the factorized kernels flag):
  per (query block, key block) tile P = A_ts E_sd F_td with the tile's own
  maxima m_t, m_d (A = exp(w - m_t), E = exp(k - m_d), F = exp(m_t + m_d -
  lse)), G = do * F: dv = E * (A^T G), dk = E * (v * (A^T G) - A^T (G * o)),
  dw = A * sum_{b,h} (G (E * v)^T - (G * o) E^T). One program per (key
  block, b * h, channel block) loops over query blocks for dk and dv; one per
  (query block, key block) loops over b, h and channel blocks for dw. Every
  tile recomputes its exps and re-reads do, o and lse (the per-head loop of
  dw reads them B * H times per tile pair): some eight times the factorized
  kernels' time at the bench shape (reports/bench.md, session 30).

The factorized kernels flag the call (one int32 the per-tile kernels read
first: unflagged, their programs return at once) where their operands could
lose what matters: x = M_t - lse spread over more than SPREAD_LIMIT nats
across a query tile's rows or across a row's heads and channels, k across a
key's heads and channels, x_td + max_s k_sd (what A's entries are weighed
by) past it, a non-finite x or k, or a non-finite gradient. The registry's
inputs stay inside (bench shape: spreads up to 7.2 and 9.2 nats, x + max k up
to 7.6); wide bias or keys, a key far above the ones before it, a head's keys
far from another's, and the forward's fallback inputs take the per-tile path.

Per-tile numerics:

- F's exponent is small but made of large numbers (|lse| a few units, ~200
  for shifted keys): m_t + m_d - lse is summed with TwoSum (and lse's
  residual, below), so it is rounded once, at its own size.
- F is bounded by 1 / DEN_FLOOR: where m_t + m_d - lse passes
  log(1 / DEN_FLOOR) in a tile (the maxima of w and k at different keys,
  as in the forward's fallback) the tile is summed one key at a time with
  each P entry exact, exp(w + k - lse) <= 1. So are, in fp32 only, the
  causal diagonal tiles, where v_s - o_t is small and the factorized
  difference cancels (fp32 excess 4-5 without; the 16-bit floors hide it).
- T = 1 returns dv = do, dw = dk = 0 exactly (one key of weight 1), on either path.

Saved vs recomputed. The forward saves, per (b, t, h, d), "lse" in fp32 (a
softmax's row statistic, here per channel: the factorization cannot give it
back without a second forward), and the rounding residual of one more value:
o's (16-bit inputs, in the input dtype: o + residual is o to ~twice its
bits, which v - o needs where one key dominates a weight: fp16 excess 3.4 ->
1.0 with spread-8 inputs) or lse's (fp32 inputs, in fp32: at |lse| = 100
lse's own rounding moves every weight by 50 u). o is not saved (the wrapper
passes it). The factorized kernels make their operands from these once per
call (fp16, 2 bytes an element each: at the bench shape about 0.8 GiB of
scratch, freed on return); the per-tile kernels recompute A, E, F and P per
tile, BLOCK_Q * (BLOCK_K + BLOCK_D) exps in the dk/dv kernel and
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
LOG_OPERAND_MAX = tl.constexpr(15 * math.log(2.0))
LO_SCALE = tl.constexpr(2048.0)
DEN_FLOOR = {True: 2.0**-12, False: 2.0**-60}  # by "fp16 operands"
# Rows per program of _bias_factors_kernel: a power of two no larger than any block_q, so that a program's rows lie
# in one query tile and share their factorized keys.
GROUP = tl.constexpr(16)
# The own tile's keys may pass their reference (the running maximum of k before the tile) by up to
# 2^OWN_HEADROOM_LOG2 (fp16 operands; 2^32 with fp32 ones): E of those keys is scaled down by as much, and an own
# key beyond it sends its rows to the redo pass (_aft_fwd_kernel).
OWN_HEADROOM_LOG2 = {True: 8, False: 32}  # by "fp16 operands"
# The own tile's E * v operands are scaled down by 2^OWN_EV_HEADROOM_LOG2 in the units of the running peak: less
# than E's headroom, so that fewer of them fall below fp16's normal range (rows the redo pass then takes); an own
# E * v that passes fp16's range in these units sends its rows to the redo pass as well (_aft_fwd_kernel).
OWN_EV_HEADROOM_LOG2 = {True: 4, False: 32}  # by "fp16 operands"
# What a main-kernel program leaves to the passes after it, per tile: OWN_ONLY, entries whose own tile's fp16
# operands failed (causal, 16-bit inputs), which the redo pass (_aft_own_redo_kernel) sums again with fp32 own
# operands; WALK_ALL, entries for _aft_fallback_kernel, which walks every key one at a time. Each pass's tiles go to
# a list of its own (a count, then the tiles' indices): the main kernel appends to both, the redo pass to the
# fallback's.
OWN_ONLY = tl.constexpr(1)
WALK_ALL = tl.constexpr(2)
# Programs of the redo pass and of the fallback, which take their listed tiles in turn: two per SM of an H100.
PASS_PROGRAMS = 264
# How far below the running peak of |E * v| a block's own peak may set its scale: num, carried in the units of
# the latest scale, then stays under n_keys * 2^(15 + 64), far inside fp32 (_key_prefix_kernel).
SCALE_REACH = tl.constexpr(2.0**-64)
# Queries per program and warps where the caller gives none: the forward's main kernel at 64 queries on 4 warps
# (one warpgroup, [64, 2 BLOCK_D] products; faster than 128 on 8, reports/bench.md), the backward's at 64 (its
# factorized dk/dv kernel at 128 measured slower, its query tiles' operand kernel far slower), the per-tile kernels
# on 8 warps (they hold more tiles per program).
FORWARD_BLOCK_Q = 64
BACKWARD_BLOCK_Q = 64
FORWARD_NUM_WARPS = 4
BACKWARD_NUM_WARPS = 8
# On FORWARD_NUM_WARPS warps the forward's main kernel's registers are capped so that three programs share an SM
# (65536 / (3 * 128 threads), less the allocation's granularity): ptxas then spills only in the own tile's
# epilogue, once per tile, and the loop over key blocks, which sets the kernel's time, keeps its operands in
# registers (reports/bench.md). Other warp counts keep ptxas's choice.
FORWARD_MAX_REGISTERS = 168
BIAS_BLOCK_KEYS = 128  # keys per step of _bias_factors_kernel (its programs own GROUP rows)
# Most keys x channels per program of _key_block_stats_kernel and _key_factors_kernel (one key block each, 4 warps;
# 8 for blocks of 128 keys): 64 x 64 (64 bf16 channels are a 128-byte row segment of k and v). ptxas (sm_90) gives
# the factor kernel 70 registers there (124 with "split") and spills none of its blocks up to 128 x 64 on 8 warps.
KEY_FACTORS_TILE = 64 * 64
KEY_FACTORS_BLOCK_D = 64
# _key_prefix_kernel: channels per program, and key blocks per step of its scan (fewer when the sequence has fewer: the
# Triton interpreter runs a scan's combine once per entry, padding included).
PREFIX_BLOCK_D = 32
PREFIX_SCAN_BLOCKS = 64

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),  # BLOCK_K: keys per block of the products (causal: <= block_q)
        "block_q": (None, (None, 16, 32, 64, 128)),  # queries per program; None: FORWARD_ / BACKWARD_BLOCK_Q
        "block_d": (64, (16, 32, 64, 128, 256)),  # most channels per program (less when D is smaller)
        # None: FORWARD_NUM_WARPS; in the backward FACTORIZED_NUM_WARPS (dw's product: DW_NUM_WARPS whatever is
        # given) and, for the per-tile kernels, BACKWARD_NUM_WARPS.
        "num_warps": (None, (None, 1, 2, 4, 8, 16)),
        "num_stages": (3, (1, 2, 3, 4, 5)),
        "precision": ("auto", ("auto", "single", "split")),
        # The forward's main loop reads its operand tiles through tensor descriptors (TMA on sm_90) where the
        # shapes allow it (_util.tma_fits); False: pointer loads.
        "tma": (True, (False, True)),
        # 16-bit inputs with "single" operands take the anchored forward first (module docstring), in tiles of its
        # own (ANCHORED_*): the options above then shape the running forward, which takes the rows it marks.
        # False: the running forward alone.
        "anchored": (True, (False, True)),
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


# A_ti = exp(w_ti - M_t) over row t's factorized keys (all keys; causal: those before its own tile of BLOCK_Q rows),
# M_t their maximum (the anchor; 0 where there are none), stored scaled by OPERAND_SCALE as dot operands; causal,
# also W_t = max of w_ti over its tile's keys up to t. One program per GROUP rows (of one tile: they share their
# factorized keys); entries of A from the row's own tile on are neither written nor read.
@triton.jit
def _bias_factors_kernel(
    gate_ptr, w_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, own_bias_max_ptr, T,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, OPERAND_SCALE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
):
    if tl.load(gate_ptr) == 0:  # the anchored forward listed no tile (chunkwise's gate)
        return
    rows = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    row_in = rows < T
    row_offsets = rows.to(tl.int64)[:, None] * T
    if CAUSAL:
        key_end = tl.program_id(0) * GROUP // BLOCK_Q * BLOCK_Q  # the first row of the rows' tile
        own_keys = key_end + tl.arange(0, BLOCK_Q)
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


# Per channel d, over the keys in blocks of BLOCK_K, all in fp32: C(j) = max_i k_id over the keys up to block j's
# end (a running maximum), P(j) = max_i |exp(k_id - C(j)) v_id| over block j's own keys, floored at SCALE_REACH
# times the same peak over every key so far, and S(j) = the power of two moving P(j) to [2^14, 2^15) (stored as
# 1 / S(j)); per block j the dot operands E_id = exp(k_id - C(j)) (scaled by OPERAND_SCALE) and E_id v_id S(j),
# side by side in [B * H, T, 2 D] (_pairs), and the factors exp(C(j-1) - C(j)) (den) and that times S(j) / S(j-1)
# (num) that move sums made so far to block j's reference and units (0 for the first block), side by side
# (_vector_pairs). Every E * v operand is then at most 2^15.
#
# The running maximum and peak are prefixes over the whole sequence, so they take three launches, each parallel
# over key blocks or channels: _key_block_stats_kernel (each block's own maximum and peak), _key_prefix_kernel
# (C(j) and S(j) from their running values at each block's end), _key_factors_kernel (the operands and move
# factors, per block, from C and S at the block and the one before).


# Per key block j and channel d: m_j = max of k_d over the block's keys and q_j = max |exp(k_id - m_j) v_id| over
# them, its peak of |E * v| relative to its own maximum (no earlier key needed). One program per (key block, head,
# channel block).
@triton.jit
def _key_block_stats_kernel(
    gate_ptr, k_ptr, v_ptr, block_ref_ptr, block_peak_ptr, T, H, D,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    if tl.load(gate_ptr) == 0:  # the anchored forward listed no tile (chunkwise's gate)
        return
    pid_j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    kv_base = _head_base(pid_bh, T, H, D)
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


# Per channel, from the block statistics (m_j, q_j) of _key_block_stats_kernel: C(j) = max of k over the keys so
# far (in place of m_j), the block's scale, 1 / S(j) (its own peak q_j exp(m_j - C(j)), floored at SCALE_REACH
# times the running peak of |E * v| relative to C(j)), and the scale of that running peak itself, 1 / S_run(j):
# the units of the next tile's own E * v operands (_aft_fwd_kernel), which an own key overflows only where its
# |E v| passes every key's before it by the own headroom, not one block's. An associative scan over SCAN_BLOCKS
# blocks at a time, the running values at the last one carried to the next. One program per (head, channel
# block).
@triton.jit
def _key_prefix_kernel(
    gate_ptr, block_ref_ptr, block_peak_ptr, block_unscale_ptr, running_unscale_ptr, n_blocks, D,
    HALF_OPERANDS: tl.constexpr, SCAN_BLOCKS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    if tl.load(gate_ptr) == 0:  # the anchored forward listed no tile (chunkwise's gate)
        return
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
        tl.store(block_unscale_ptr + offsets, unscale, mask=mask)
        tl.store(running_unscale_ptr + offsets, _operand_scale(peak, HALF_OPERANDS)[1], mask=mask)
        # Past n_blocks the scan repeats the last block's values (no key: reference -inf, peak 0).
        carry_ref = _row(ref, SCAN_BLOCKS - 1, -float("inf"))
        carry_peak = _row(peak, SCAN_BLOCKS - 1, 0.0)


# The operands and move factors above for one key block, from C and S at the block and at the one before
# (_key_prefix_kernel's; none before the first block). One program per (key block, head, channel block).
@triton.jit
def _key_factors_kernel(
    gate_ptr, k_ptr, v_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr, block_ref_ptr, block_unscale_ptr, T, H, D,
    SPLIT: tl.constexpr, OPERAND_SCALE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    if tl.load(gate_ptr) == 0:  # the anchored forward listed no tile (chunkwise's gate)
        return
    pid_j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    kv_base = _head_base(pid_bh, T, H, D)
    factors_base = pid_bh.to(tl.int64) * T * D
    block_base = pid_bh.to(tl.int64) * tl.cdiv(T, BLOCK_K) * D
    keys = pid_j * BLOCK_K + tl.arange(0, BLOCK_K)
    key_in = keys < T
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_in = offs_d < D
    offs_pairs = 2 * pid_d * BLOCK_D + tl.arange(0, 2 * BLOCK_D)  # (den, num) columns: 2 d, 2 d + 1
    pairs_in = offs_pairs < 2 * D

    block_offsets = block_base + pid_j * D + offs_d
    key_ref = tl.load(block_ref_ptr + block_offsets, mask=d_in, other=0.0)
    unscale = tl.load(block_unscale_ptr + block_offsets, mask=d_in, other=1.0)
    scale = _pow2_inverse(unscale)
    # The reference and units of the sums before the block: none before the first (its move factors are 0).
    before = d_in & (pid_j > 0)
    key_ref_before = tl.load(block_ref_ptr + block_offsets - D, mask=before, other=-float("inf"))
    unscale_before = tl.load(block_unscale_ptr + block_offsets - D, mask=before, other=1.0)

    mask = key_in[:, None] & d_in[None, :]
    kv_offsets = kv_base + keys[:, None] * (H * D) + offs_d[None, :]
    k = tl.load(k_ptr + kv_offsets, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + kv_offsets, mask=mask, other=0.0).to(tl.float32)
    e = tl.exp(k - key_ref[None, :])
    _store_operand(eev_hi_ptr, eev_lo_ptr, 2 * factors_base + keys[:, None] * (2 * D) + offs_pairs[None, :],
                   _pairs(e * OPERAND_SCALE, e * v * scale[None, :]), key_in[:, None] & pairs_in[None, :],
                   SPLIT, LO_SCALE)
    den_move = tl.exp(key_ref_before - key_ref)
    tl.store(move_ptr + 2 * block_base + pid_j * 2 * D + offs_pairs,
             _vector_pairs(den_move, _num_move(den_move, scale, unscale_before)), mask=pairs_in)


# The main kernel: one program per tile (_aft_tile).
@triton.jit
def _aft_fwd_kernel(
    w_ptr, k_ptr, v_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr, block_ref_ptr,
    block_unscale_ptr, running_unscale_ptr, own_bias_max_ptr, o_ptr, lse_ptr, lse_residual_ptr, o_residual_ptr,
    walk_ptr, redo_ptr,
    T, H, D, den_floor,
    STORE_LSE: tl.constexpr, STORE_LSE_RESIDUAL: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    OPERAND_SCALE: tl.constexpr, E_HEADROOM_LOG2: tl.constexpr, EV_HEADROOM_LOG2: tl.constexpr, TMA: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    _aft_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0), tl.num_programs(1),
              w_ptr, k_ptr, v_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr, block_ref_ptr,
              block_unscale_ptr, running_unscale_ptr, own_bias_max_ptr, o_ptr, lse_ptr, lse_residual_ptr,
              o_residual_ptr, walk_ptr, redo_ptr, T, H, D, den_floor,
              STORE_LSE, STORE_LSE_RESIDUAL, STORE_O_RESIDUAL, CAUSAL, SPLIT, HALF_OPERANDS, DOT_PRECISION,
              OPERAND_SCALE, E_HEADROOM_LOG2, EV_HEADROOM_LOG2, TMA, False, False, BLOCK_Q, BLOCK_K, BLOCK_D)


# The main kernel's work on a list of its tiles (list_ptr: a count, then the tiles' indices in its grid), writing only
# the entries already marked (o is NaN there): the tiles the anchored forward left (_aft_anchored_fwd_kernel), and,
# with REDO_OWN, the redo pass, the tiles the main kernel flagged OWN_ONLY summed again with fp32 own products. A few
# programs per SM take the listed tiles in turn: a grid of every tile, nearly all returning at once, each holding the
# main kernel's shared memory while it does, cost more than the few tiles it redoes, and so did programs walking
# every tile's flag, one load's latency per tile (reports/bench.md, session 23).
@triton.jit
def _aft_listed_kernel(
    list_ptr, w_ptr, k_ptr, v_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr, block_ref_ptr,
    block_unscale_ptr, running_unscale_ptr, own_bias_max_ptr, o_ptr, lse_ptr, lse_residual_ptr, o_residual_ptr,
    walk_ptr, redo_ptr,
    T, H, D, den_floor, n_bh,
    STORE_LSE: tl.constexpr, STORE_LSE_RESIDUAL: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    OPERAND_SCALE: tl.constexpr, E_HEADROOM_LOG2: tl.constexpr, EV_HEADROOM_LOG2: tl.constexpr, TMA: tl.constexpr,
    REDO_OWN: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n_t = tl.cdiv(T, BLOCK_Q)
    for i in range(tl.program_id(0), tl.load(list_ptr), tl.num_programs(0)):
        index = tl.load(list_ptr + 1 + i)
        _aft_tile(index % n_t, index // n_t % n_bh, index // (n_t * n_bh), n_t, n_bh,
                  w_ptr, k_ptr, v_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr,
                  block_ref_ptr, block_unscale_ptr, running_unscale_ptr, own_bias_max_ptr, o_ptr, lse_ptr,
                  lse_residual_ptr, o_residual_ptr, walk_ptr, redo_ptr, T, H, D, den_floor,
                  STORE_LSE, STORE_LSE_RESIDUAL, STORE_O_RESIDUAL, CAUSAL, SPLIT, HALF_OPERANDS, DOT_PRECISION,
                  OPERAND_SCALE, E_HEADROOM_LOG2, EV_HEADROOM_LOG2, TMA, True, REDO_OWN, BLOCK_Q, BLOCK_K, BLOCK_D)


# One program's tile of _aft_fwd_kernel (tile pid_t, pid_bh, pid_d of a grid (n_t, n_bh, channel blocks)): num_td =
# sum_i A_ti (E v)_id and den_td = sum_i A_ti E_id over row t's factorized keys, relative to exp(M_t + C): products
# over the key blocks before the tile (every key when causal=False), den and num side by side (one product each),
# the sums moved from one reference C to the next by exp(C_old - C_new) <= 1 per channel; then (causal) the terms
# of the row's own tile, one lower-triangular product for the tile, relative to max(M_t, W_t) + C; o = num / den.
# With ONLY_MARKED (_aft_listed_kernel) only the entries an earlier pass marked are written; with REDO_OWN (the redo
# pass) the own product takes fp32 operands.
@triton.jit
def _aft_tile(
    pid_t, pid_bh, pid_d, n_t, n_bh,
    w_ptr, k_ptr, v_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, eev_hi_ptr, eev_lo_ptr, move_ptr, block_ref_ptr,
    block_unscale_ptr, running_unscale_ptr, own_bias_max_ptr, o_ptr, lse_ptr, lse_residual_ptr, o_residual_ptr,
    walk_ptr, redo_ptr,
    T, H, D, den_floor,
    STORE_LSE: tl.constexpr, STORE_LSE_RESIDUAL: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    OPERAND_SCALE: tl.constexpr, E_HEADROOM_LOG2: tl.constexpr, EV_HEADROOM_LOG2: tl.constexpr, TMA: tl.constexpr,
    ONLY_MARKED: tl.constexpr, REDO_OWN: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tile_index = pid_t + n_t * (pid_bh + n_bh * pid_d)
    tile = n_t - 1 - pid_t if CAUSAL else pid_t  # causal: the longest tiles first
    kv_base = _head_base(pid_bh, T, H, D)
    row_stride = H * D
    factors_base = pid_bh.to(tl.int64) * T * D
    block_base = pid_bh.to(tl.int64) * tl.cdiv(T, BLOCK_K) * D
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
        n_blocks = tile * BLOCK_Q // BLOCK_K  # the blocks before the tile (BLOCK_K divides BLOCK_Q)
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

    # Every row's sums are relative to exp(M_t + C) and in units of S, C and S those of the loop's last block (the
    # block before the tile, causal; the sequence's last), one [BLOCK_D] vector each for the tile. Causal, the rows
    # of the first tile have no factorized keys (and their sums are 0).
    has_keys = n_blocks > 0
    last_block = block_base + (n_blocks - 1) * D + offs_d
    key_ref = tl.load(block_ref_ptr + last_block, mask=d_in & has_keys, other=0.0)
    unscale = tl.load(block_unscale_ptr + last_block, mask=d_in & has_keys, other=1.0)
    anchor = tl.load(anchor_ptr + offs_t, mask=row_in, other=0.0)
    # Entries whose factorized den fell below the floor are marked (NaN) for _aft_fallback_kernel; den_td depends
    # only on row t's factorized keys, so the choice is causal too.
    den, num = tl.split(tl.reshape(sums, [BLOCK_Q, BLOCK_D, 2]))
    factorized_low = in_tile & ~(den * (UNIT * UNIT) >= den_floor) & has_keys
    den = tl.where(factorized_low, float("nan"), den)
    if CAUSAL:
        # Row t's own keys, its tile's from the first row to t, in one product: A_own [BLOCK_Q, BLOCK_Q] is lower
        # triangular, and every row meets only keys of its own tile, relative to the one reference of the tile.
        # Rows: relative to ref_t = max(M_t, W_t) (W_t, the largest w_ti over the own keys up to t, bounds them).
        # Channels: R = C of the block before the tile (the factorized sums' reference; k_0 for the first tile, a
        # key every row sees) and E * v in units S_run of the running peak of |E v| there, both known before the
        # tile (the factorized num moves from its block's units S to S_run, a power of two). An own key may pass
        # R: E = exp(k - R) is let up to 2^E_HEADROOM_LOG2 and its operand scaled down by as much, E * v's by
        # 2^EV_HEADROOM_LOG2; den and num then count in units those powers of two below the factorized ones.
        # The first tile's E * v units, FIRST_SCALE, make its E * v operands v / 2 times its E operands (fp16
        # operands): k_0, unlike a running maximum, is often passed by several nats, and an own key up to E's
        # headroom with |v| < 2 still fits fp16.
        # The redo pass (REDO_OWN) takes the own tile's operands in fp32 (exact products, E_HEADROOM_LOG2 and
        # EV_HEADROOM_LOG2 then fp32's), the factorized sums as the first pass made them.
        OWN_HALF: tl.constexpr = HALF_OPERANDS and not REDO_OWN
        OWN_DTYPE: tl.constexpr = tl.float16 if OWN_HALF else tl.float32
        OWN_SPLIT: tl.constexpr = SPLIT and not REDO_OWN
        OWN_PRECISION: tl.constexpr = "ieee" if REDO_OWN else DOT_PRECISION
        E_HEADROOM: tl.constexpr = 2.0 ** E_HEADROOM_LOG2
        EV_HEADROOM: tl.constexpr = 2.0 ** EV_HEADROOM_LOG2
        FIRST_SCALE: tl.constexpr = 2.0 ** (14 - E_HEADROOM_LOG2 + EV_HEADROOM_LOG2) if OWN_HALF else 1.0
        OWN_MAX: tl.constexpr = OPERAND_MAX if OWN_HALF else 2.0 ** 127
        own_bias_max = tl.load(own_bias_max_ptr + offs_t, mask=row_in, other=0.0)
        row_ref = tl.where(has_keys, tl.maximum(anchor, own_bias_max), own_bias_max)
        first_key = tl.load(k_ptr + kv_base + offs_d, mask=d_in, other=0.0).to(tl.float32)
        key_ref = tl.where(has_keys, key_ref, first_key)
        own_unscale = tl.load(running_unscale_ptr + last_block, mask=d_in & has_keys, other=1.0 / FIRST_SCALE)
        # A key row serves the later rows of the tile, and its 0 in A the earlier ones: its operands must be finite
        # whatever its k and v are (0 * inf is NaN), so they are selected, and what was dropped is flagged.
        tile_k = tl.load(k_ptr + kv_base + offs_t[:, None] * row_stride + offs_d[None, :], mask=in_tile,
                         other=0.0).to(tl.float32)
        tile_v = tl.load(v_ptr + kv_base + offs_t[:, None] * row_stride + offs_d[None, :], mask=in_tile,
                         other=0.0).to(tl.float32)
        exponent = tile_k - key_ref[None, :]
        fits = exponent <= E_HEADROOM_LOG2 * 0.6931471805599453  # False for NaN as well
        e = tl.where(fits, tl.exp(exponent), 0.0)
        ev = e * tile_v * (_pow2_inverse(own_unscale) * (1.0 / EV_HEADROOM))[None, :]
        fits &= tl.abs(ev) < OWN_MAX  # fp16's range (fp32's: only non-finite v)
        ev = tl.where(fits, ev, 0.0)
        # Flags per key row, over its channels: 2, an operand was dropped; 1 (fp16 operands), an E * v operand is
        # below fp16's normal range, its absolute error up to 2^-25 (hi) or 2^-36 (split: lo is exact where hi is
        # not). OR-ed over the tile's keys up to the row, so the flags of row t come from keys <= t; per row, not
        # per entry: the fallback's cost is per tile, and any more entries it takes come out exact.
        flags = tl.where(fits, 0, 2)
        if OWN_HALF:
            flags |= ((ev != 0.0) & (tl.abs(ev) < 2.0**-14)).to(tl.int32)
        # OR-ed down the rows as two running counts, one per flag bit (a sum is a builtin scan, fast under the
        # Triton interpreter, where a scan with its own combine calls it once per entry).
        flags = tl.max(flags, 1)
        flags = (tl.cumsum(flags & 2, 0) > 0).to(tl.int32) * 2 | (tl.cumsum(flags & 1, 0) > 0).to(tl.int32)
        eev_hi, eev_lo = _operand_parts(_pairs(e * (OPERAND_SCALE / E_HEADROOM), ev), OWN_SPLIT, OWN_DTYPE,
                                        LO_SCALE)
        # The tile's whole square of w is loaded (masked by T alone: vector loads), the keys after t selected out.
        w_own = tl.load(w_ptr + a_rows + offs_t[None, :], mask=row_in[:, None] & row_in[None, :],
                        other=-float("inf")).to(tl.float32)
        a_own = tl.where(offs_t[None, :] <= offs_t[:, None], tl.exp(w_own - row_ref[:, None]) * OPERAND_SCALE, 0.0)
        a_hi, a_lo = _operand_parts(a_own, OWN_SPLIT, OWN_DTYPE, 1.0)
        own_weight = tl.sum(a_own, 1) * (2.0**-22 if OWN_SPLIT else 2.0**-11)
        # The factorized sums move to ref_t and the own sums' units (powers of two: S_run / S <= 1, since the running
        # peak bounds the block's), and the own product lands in them (den in units OPERAND_SCALE^2 / E_HEADROOM, num
        # OPERAND_SCALE * S_run / EV_HEADROOM).
        move = tl.where(has_keys, tl.exp(anchor - row_ref), 0.0)
        moved = _pairs(den * (move * (1.0 / E_HEADROOM))[:, None],
                       num * (move * (1.0 / EV_HEADROOM))[:, None] * (unscale * _pow2_inverse(own_unscale))[None, :])
        sums = _dot_into(a_hi, a_lo, eev_hi, eev_lo, moved, OWN_SPLIT, OWN_PRECISION)
        den, num = tl.split(tl.reshape(sums, [BLOCK_Q, BLOCK_D, 2]))
        # Subnormal E * v operands err by at most A's row sum times 2^-25 (2^-36 split) in num's units: the
        # entries where that could pass 2^-14 |num| are marked.
        lost = (flags >= 2)[:, None] | (((flags & 1) != 0)[:, None] & ~(tl.abs(num) >= own_weight[:, None]))
        den *= UNIT * UNIT * E_HEADROOM
        num *= own_unscale[None, :] * (UNIT * EV_HEADROOM)
        # The own tile's E and E * v went through the operands too: so is every den that ends below the floor.
        den = tl.where(lost | ~(den >= den_floor), float("nan"), den)
        refs, refs_err = _two_sum(row_ref[:, None], key_ref[None, :])  # the reference, as the pair whose sum it is
    else:
        den *= UNIT * UNIT
        num *= unscale[None, :] * UNIT
        refs, refs_err = _two_sum(anchor[:, None], key_ref[None, :])
    out_offsets = kv_base + offs_t[:, None] * row_stride + offs_d[None, :]
    if ONLY_MARKED:
        # Only the entries an earlier pass marked (o is NaN there) are written again: the marks are causal, and
        # every other entry keeps that pass's value bitwise.
        first_pass = tl.load(o_ptr + out_offsets, mask=in_tile, other=0.0)
        written = in_tile & (first_pass != first_pass)
    else:
        written = in_tile
    # What is left for _aft_fallback_kernel (every key, one at a time): WALK_ALL; OWN_ONLY where only the own
    # tile's fp16 operands failed (causal, 16-bit inputs), which the redo pass takes first.
    marked = written & (den != den)
    if CAUSAL and HALF_OPERANDS and not REDO_OWN:
        code = tl.where(tl.max(factorized_low.to(tl.int32)) > 0, WALK_ALL, tl.max(marked.to(tl.int32)) * OWN_ONLY)
    else:
        code = tl.max(marked.to(tl.int32)) * WALK_ALL
    if code == OWN_ONLY:
        tl.store(redo_ptr + 1 + tl.atomic_add(redo_ptr, 1), tile_index)
    if code == WALK_ALL:
        tl.store(walk_ptr + 1 + tl.atomic_add(walk_ptr, 1), tile_index)

    o = num / den
    o_rounded = o.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + out_offsets, o_rounded, mask=written)
    if STORE_O_RESIDUAL:
        # What rounding o to 16 bits dropped, itself in 16 bits: o + residual carries about twice o's bits.
        tl.store(o_residual_ptr + out_offsets, (o - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty),
                 mask=written)
    if STORE_LSE:
        # log sum_i exp(w_ti + k_id) in absolute terms, the backward's normalizer: the reference plus log(den).
        # Its two parts are a few units each (far more for shifted keys), log(den) smaller: summed with TwoSum,
        # the result is lse + its rounding residual, which fp32 inputs keep (16-bit ones need not).
        lse, lse_residual = _two_sum(refs, tl.log(den) + refs_err)
        tl.store(lse_ptr + out_offsets, lse, mask=written)
        if STORE_LSE_RESIDUAL:
            tl.store(lse_residual_ptr + out_offsets, lse_residual, mask=written)


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


# The entries the main kernel and the redo pass left marked (o is NaN there), in the tiles they listed WALK_ALL
# (walk_ptr: a count, then the tiles' indices in the main kernel's grid (n_t, n_bh, channel blocks)), summed exactly
# over all their keys: o_td = num / den with one key at a time and a running maximum per (t, d) (_aft_keys_exact).
# A few programs per SM take the listed tiles in turn, as the redo pass does; the registry's inputs list none.
@triton.jit
def _aft_fallback_kernel(
    w_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lse_residual_ptr, o_residual_ptr, walk_ptr,
    T, H, D, n_bh,
    STORE_LSE: tl.constexpr, STORE_LSE_RESIDUAL: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n_t = tl.cdiv(T, BLOCK_Q)
    for i in range(tl.program_id(0), tl.load(walk_ptr), tl.num_programs(0)):
        index = tl.load(walk_ptr + 1 + i)
        pid_t = index % n_t
        pid_bh = index // n_t % n_bh
        pid_d = index // (n_t * n_bh)
        tile = n_t - 1 - pid_t if CAUSAL else pid_t
        kv_base = _head_base(pid_bh, T, H, D)
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


# ------------------------------------------------------------------------------------------------ forward, anchored

# The anchored forward (16-bit inputs, "single" operands; module docstring, "Anchored forward"): one reference per
# channel for the whole sequence, so that the main loop is a plain product, A @ [E, E * v], in large tiles.
# Queries, keys and channels per program of its main kernel, its warps and pipeline stages (reports/bench.md).
ANCHORED_BLOCK_Q = 128
ANCHORED_BLOCK_K = 64
ANCHORED_BLOCK_D = 128
ANCHORED_NUM_WARPS = 8
ANCHORED_NUM_STAGES = 3
# A key whose k passes k_0 (its channel's first key) by more than KEY_WINDOW nats either way, in any channel of its
# head, sends its row and every later row of the head to the running forward: E = exp(k - k_0) then stays inside
# [2^-13.7, 2^13.7], fp16's normal range. So does a row whose visible bias spreads over more than BIAS_WINDOW nats:
# A = exp(w - M_t) * 2^15 then stays at or above 2^-13.8.
KEY_WINDOW = tl.constexpr(9.5)
BIAS_WINDOW = tl.constexpr(20.0)
# E * v is scaled by the power of two moving max_d |v_0d| (the head's first key) to [2^VALUE_EXPONENT,
# 2^(VALUE_EXPONENT + 1)); a key is let through only where every E * v operand of it is inside fp16's range and
# min_d E_sd * max_d |v_sd| (scaled) is at least EV_FLOOR: its entries that fall below fp16's normal range then err
# by at most 2^-25, 2^-12 of that product, no more than one fp16 rounding of its largest entry.
VALUE_EXPONENT = tl.constexpr(1)
EV_FLOOR = tl.constexpr(2.0**-13)


@triton.jit
def _value_scale(v_ptr, head_base, D, FULL_D: tl.constexpr):
    """(2^s, 2^-s) moving max_d |v_0d| of a head (head_base: its first key's offset) to [2^VALUE_EXPONENT,
    2^(VALUE_EXPONENT + 1)); (1, 1) where that row is all zero or not finite (a non-finite one fails key 0's
    check)."""
    offs = tl.arange(0, FULL_D)
    peak = tl.max(tl.abs(tl.load(v_ptr + head_base + offs, mask=offs < D, other=0.0).to(tl.float32)))
    scale, unscale = pow2_scale(peak, VALUE_EXPONENT)
    usable = (peak > 0.0) & (peak <= LARGEST_FP32)
    return tl.where(usable, scale, 1.0), tl.where(usable, unscale, 1.0)


# Per key and channel of one head, E = exp(k - k_0) and E * v * 2^s (_value_scale), fp16, side by side (_pairs) in
# [B * H, T, 2 D]; an operand that fails its check is stored as 0 (rows before its key meet it with A = 0, and
# 0 * inf would be NaN). first_bad_ptr[head] takes the first key that fails (KEY_WINDOW, fp16's range, EV_FLOOR, or a
# non-finite k or v). One program per (key block, batch * head), every channel.
@triton.jit
def _anchored_keys_kernel(
    k_ptr, v_ptr, eev_ptr, first_bad_ptr, T, H, D,
    BLOCK_K: tl.constexpr, FULL_D: tl.constexpr,
):
    pid_j = tl.program_id(0)
    pid_bh = tl.program_id(1)
    keys = pid_j * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, FULL_D)
    key_in = keys < T
    d_in = offs_d < D
    valid = key_in[:, None] & d_in[None, :]
    head_base = _head_base(pid_bh, T, H, D)
    offsets = _head_offsets(pid_bh, keys, offs_d, T, H, D)
    k = tl.load(k_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    first_key = tl.load(k_ptr + head_base + offs_d, mask=d_in, other=0.0).to(tl.float32)
    v_scale, _ = _value_scale(v_ptr, head_base, D, FULL_D)
    exponent = k - first_key[None, :]
    e_fits = tl.abs(exponent) <= KEY_WINDOW  # False for NaN as well
    e = tl.exp(tl.where(e_fits, exponent, -float("inf")))
    v_scaled = v * v_scale
    ev = e * v_scaled
    fits = e_fits & (tl.abs(ev) < OPERAND_MAX)
    value_peak = tl.max(tl.where(valid, tl.abs(v_scaled), 0.0), 1)
    e_least = tl.min(tl.where(valid, e, float("inf")), 1)
    coarse = (value_peak > 0.0) & ~(e_least * value_peak >= EV_FLOOR)
    bad = key_in & ((tl.max(tl.where(valid & ~fits, 1, 0), 1) > 0) | coarse)
    tl.atomic_min(first_bad_ptr + pid_bh, tl.min(tl.where(bad, keys, T)))
    offs_pairs = tl.arange(0, 2 * FULL_D)
    tl.store(eev_ptr + pid_bh.to(tl.int64) * T * 2 * D + keys[:, None] * (2 * D) + offs_pairs[None, :],
             _pairs(tl.where(fits, e, 0.0), tl.where(fits, ev, 0.0)).to(eev_ptr.dtype.element_ty),
             mask=key_in[:, None] & (offs_pairs < 2 * D)[None, :])


# The anchored forward's main kernel: per tile of BLOCK_Q rows and BLOCK_D channels of one head, den_td = sum_s A_ts
# E_sd and num_td = sum_s A_ts (E v 2^s)_sd, side by side in one [BLOCK_Q, 2 BLOCK_D] accumulator, one product per
# key block (A is 0 past the diagonal, causal: every block up to it is taken whole); o = num / den / 2^s, lse =
# M_t + k_0d + log(den / 2^15). Rows that a failed key or bias check reaches are marked (o NaN) and their tiles of the
# running forward's grid (LISTED_BLOCK_Q x LISTED_BLOCK_D) listed for _aft_listed_kernel; row t's mark depends on
# keys <= t and on row t's bias alone, so it is causal, as the values are. Grid (query tiles, B * H, channel blocks),
# causal tiles longest first.
@triton.jit
def _aft_anchored_fwd_kernel(
    a_ptr, eev_ptr, anchor_ptr, bias_spread_ptr, first_bad_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, o_residual_ptr,
    list_ptr, T, H, D,
    STORE_LSE: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, FULL_D: tl.constexpr,
    LISTED_BLOCK_Q: tl.constexpr, LISTED_BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    n_t = tl.cdiv(T, BLOCK_Q)
    tile = n_t - 1 - pid_t if CAUSAL else pid_t
    offs_t = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_k = tl.arange(0, BLOCK_K)
    row_in = offs_t < T
    d_in = offs_d < D
    offs_pairs = 2 * pid_d * BLOCK_D + tl.arange(0, 2 * BLOCK_D)
    pairs_in = offs_pairs < 2 * D
    eev_base = pid_bh.to(tl.int64) * T * 2 * D
    key_end = tl.minimum((tile + 1) * BLOCK_Q, T) if CAUSAL else T
    sums = tl.zeros([BLOCK_Q, 2 * BLOCK_D], tl.float32)
    if TMA:
        a_src = tl.make_tensor_descriptor(a_ptr, [T, T], [T, 1], [BLOCK_Q, BLOCK_K])
        eev_src = tl.make_tensor_descriptor(eev_ptr + eev_base, [T, 2 * D], [2 * D, 1], [BLOCK_K, 2 * BLOCK_D])
    for start in range(0, key_end, BLOCK_K):
        if TMA:
            a = a_src.load([tile * BLOCK_Q, start])
            eev = eev_src.load([start, 2 * pid_d * BLOCK_D])
        else:
            key_in = start + offs_k < T
            a = tl.load(a_ptr + offs_t.to(tl.int64)[:, None] * T + (start + offs_k)[None, :],
                        mask=row_in[:, None] & key_in[None, :], other=0.0)
            eev = tl.load(eev_ptr + eev_base + (start + offs_k)[:, None] * (2 * D) + offs_pairs[None, :],
                          mask=key_in[:, None] & pairs_in[None, :], other=0.0)
        sums = tl.dot(a, eev, sums)

    den, num = tl.split(tl.reshape(sums, [BLOCK_Q, BLOCK_D, 2]))
    head_base = _head_base(pid_bh, T, H, D)
    first_key = tl.load(k_ptr + head_base + offs_d, mask=d_in, other=0.0).to(tl.float32)
    _, v_unscale = _value_scale(v_ptr, head_base, D, FULL_D)
    anchor = tl.load(anchor_ptr + offs_t, mask=row_in, other=0.0)
    spread = tl.load(bias_spread_ptr + offs_t, mask=row_in, other=0.0)
    first_bad = tl.load(first_bad_ptr + pid_bh)
    if CAUSAL:
        keys_failed = offs_t >= first_bad
    else:
        keys_failed = (offs_t >= 0) & (first_bad < T)
    marked = row_in & (keys_failed | ~(spread <= BIAS_WINDOW))
    o = tl.where(marked[:, None], float("nan"), num / den * v_unscale)
    in_tile = row_in[:, None] & d_in[None, :]
    out_offsets = _head_offsets(pid_bh, offs_t, offs_d, T, H, D)
    o_rounded = o.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + out_offsets, o_rounded, mask=in_tile)
    if STORE_O_RESIDUAL:
        tl.store(o_residual_ptr + out_offsets, (o - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty),
                 mask=in_tile)
    if STORE_LSE:
        refs, refs_err = _two_sum(anchor[:, None], first_key[None, :])
        lse, _ = _two_sum(refs, (tl.log(den) - LOG_OPERAND_MAX) + refs_err)
        tl.store(lse_ptr + out_offsets, lse, mask=in_tile)

    # The running forward's tiles that hold marked rows: its grid is (row tiles, B * H, channel blocks), causal
    # longest first, and each of its tiles lies inside one of these (LISTED_BLOCK_Q divides BLOCK_Q, LISTED_BLOCK_D
    # BLOCK_D).
    N_SUB: tl.constexpr = BLOCK_Q // LISTED_BLOCK_Q
    N_SUB_D: tl.constexpr = BLOCK_D // LISTED_BLOCK_D
    sub_marked = tl.max(tl.reshape(marked.to(tl.int32), [N_SUB, LISTED_BLOCK_Q]), 1)
    if tl.max(sub_marked) > 0:
        n_listed_t = tl.cdiv(T, LISTED_BLOCK_Q)
        listed_rows = tile * N_SUB + tl.arange(0, N_SUB)
        listed_t = n_listed_t - 1 - listed_rows if CAUSAL else listed_rows
        listed_d = pid_d * N_SUB_D + tl.arange(0, N_SUB_D)
        take = (sub_marked > 0)[:, None] & (listed_d < tl.cdiv(D, LISTED_BLOCK_D))[None, :]
        index = listed_t[:, None] + n_listed_t * (pid_bh + tl.num_programs(1) * listed_d[None, :])
        take = tl.reshape(take.to(tl.int32), [N_SUB * N_SUB_D])
        start = tl.atomic_add(list_ptr, tl.sum(take))
        tl.store(list_ptr + 1 + start + tl.cumsum(take, 0) - take, tl.reshape(index, [N_SUB * N_SUB_D]),
                 mask=take > 0)


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
    anchored: bool = True,
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, None]:
    """AFT-full forward; returns (o [B, T, H, D] in the input dtype, None). With ``saved`` (a dict) it also
    stores there what chunkwise_backward needs: "lse", the fp32 log-normalizer per (b, t, h, d), and the part
    of it or of o that rounding dropped, "o_residual" for 16-bit inputs, "lse_residual" for fp32 (module
    docstring, "Saved vs recomputed").

    16-bit inputs with "single" operands take the anchored forward first (unless ``anchored`` is False or
    block_d passes ANCHORED_BLOCK_D), the running forward only for the rows it marks; other inputs take the
    running forward alone (module docstring)."""
    B, T, H, D = k.shape
    half_operands = k.dtype != torch.float32
    if precision == "auto":
        precision = "split" if k.dtype == torch.float16 else "single"
    split = half_operands and precision == "split"
    block_q = FORWARD_BLOCK_Q if block_q is None else block_q
    if causal and block_q % chunk_size:
        raise ValueError(f"causal aft needs chunk_size to divide block_q (its key blocks end where a query tile "
                         f"starts: chunk_size <= block_q); got chunk_size={chunk_size}, block_q={block_q}")
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
    running_unscale = torch.empty_like(block_ref)

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
    # The redo pass's and the fallback's lists of tiles: a count, then the tiles.
    redo_tiles = torch.zeros(1 + math.prod(grid), dtype=torch.int32, device=device)
    walk_tiles = torch.zeros(1 + math.prod(grid), dtype=torch.int32, device=device)
    stores = dict(STORE_LSE=saved is not None, STORE_LSE_RESIDUAL=saved is not None and not half_operands,
                  STORE_O_RESIDUAL=saved is not None and half_operands)
    key_block_d = min(block_size(D), KEY_FACTORS_BLOCK_D, KEY_FACTORS_TILE // chunk_size)
    key_warps = 8 if chunk_size > 64 else 4
    prefix_block_d = min(block_size(D), PREFIX_BLOCK_D)
    tile_args = (w, k, v, a_hi, a_lo, anchor, eev_hi, eev_lo, move, block_ref, block_unscale, running_unscale,
                 own_bias_max, o, lse, lse_residual, o_residual, walk_tiles, redo_tiles, T, H, D,
                 DEN_FLOOR[half_operands])
    tile_options = dict(CAUSAL=causal, SPLIT=split, HALF_OPERANDS=half_operands,
                        DOT_PRECISION="tf32" if half_operands else "ieee", OPERAND_SCALE=operand_scale, TMA=use_tma,
                        BLOCK_Q=block_q, BLOCK_K=chunk_size, BLOCK_D=BLOCK_D, num_warps=num_warps,
                        num_stages=num_stages, **stores)
    pass_programs = min(math.prod(grid), PASS_PROGRAMS)
    anchored_block_d = min(block_size(D), ANCHORED_BLOCK_D)
    if anchored and half_operands and not split and BLOCK_D <= anchored_block_d:
        # The running forward's tiles the anchored one leaves (a count, then the tiles): its kernels before the
        # listed pass read the count and return at once where it is 0.
        gate = torch.zeros(1 + math.prod(grid), dtype=torch.int32, device=device)
        running = [Launch(_aft_listed_kernel, (pass_programs,), gate, *tile_args, B * H, **tile_options,
                          E_HEADROOM_LOG2=OWN_HEADROOM_LOG2[True], EV_HEADROOM_LOG2=OWN_EV_HEADROOM_LOG2[True],
                          REDO_OWN=False)]
        first = _anchored_launches(w, k, v, a_hi, eev_hi, anchor, o, lse, o_residual, gate, causal, use_tma, stores,
                                   block_q, BLOCK_D)
    else:
        gate = torch.ones(1, dtype=torch.int32, device=device)
        running = [Launch(_aft_fwd_kernel, grid, *tile_args, **tile_options,
                          E_HEADROOM_LOG2=OWN_HEADROOM_LOG2[half_operands],
                          EV_HEADROOM_LOG2=OWN_EV_HEADROOM_LOG2[half_operands],
                          maxnreg=FORWARD_MAX_REGISTERS if num_warps == FORWARD_NUM_WARPS else None)]
        first = []
    # Causal with 16-bit inputs, the redo pass sums again, with fp32 own-tile operands, the tiles whose own fp16
    # operands failed (OWN_ONLY): a few tiles on the registry's inputs, where the fallback's walk over every key would
    # cost a late tile milliseconds.
    launch_after_checks(
        await_checks,
        *first,
        Launch(_bias_factors_kernel, (triton.cdiv(T, GROUP.value),), gate, w, a_hi, a_lo, anchor, own_bias_max, T,
               CAUSAL=causal, SPLIT=split, OPERAND_SCALE=operand_scale, BLOCK_Q=block_q, BLOCK_KEYS=BIAS_BLOCK_KEYS,
               num_warps=4),
        Launch(_key_block_stats_kernel, (n_blocks, B * H, triton.cdiv(D, key_block_d)),
               gate, k, v, block_ref, block_peak, T, H, D, BLOCK_K=chunk_size, BLOCK_D=key_block_d,
               num_warps=key_warps),
        Launch(_key_prefix_kernel, (B * H, triton.cdiv(D, prefix_block_d)),
               gate, block_ref, block_peak, block_unscale, running_unscale, n_blocks, D,
               HALF_OPERANDS=half_operands, SCAN_BLOCKS=min(PREFIX_SCAN_BLOCKS, triton.next_power_of_2(n_blocks)),
               BLOCK_D=prefix_block_d, num_warps=4),
        Launch(_key_factors_kernel, (n_blocks, B * H, triton.cdiv(D, key_block_d)),
               gate, k, v, eev_hi, eev_lo, move, block_ref, block_unscale, T, H, D,
               SPLIT=split, OPERAND_SCALE=operand_scale, BLOCK_K=chunk_size, BLOCK_D=key_block_d,
               num_warps=key_warps),
        *running,
        *([Launch(_aft_listed_kernel, (pass_programs,), redo_tiles, *tile_args, B * H,
                  **tile_options, E_HEADROOM_LOG2=OWN_HEADROOM_LOG2[False],
                  EV_HEADROOM_LOG2=OWN_EV_HEADROOM_LOG2[False], REDO_OWN=True)] if causal and half_operands else []),
        Launch(_aft_fallback_kernel, (pass_programs,),
               w, k, v, o, lse, lse_residual, o_residual, walk_tiles, T, H, D, B * H,
               CAUSAL=causal, BLOCK_Q=block_q, BLOCK_D=BLOCK_D, num_warps=num_warps, **stores),
    )
    return o, None


def _anchored_launches(w, k, v, a, eev, anchor, o, lse, o_residual, listed, causal, use_tma, stores, listed_block_q,
                       listed_block_d) -> list[Launch]:
    """The anchored forward's launches: A and the bias checks, the key operands and checks, the main kernel, which
    lists the running forward's tiles it leaves in ``listed``. Its operands take the running forward's buffers
    (``a``, ``eev``, ``anchor``: the same shapes), which that forward overwrites only after the main kernel."""
    B, T, H, D = k.shape
    full_d = block_size(D)
    block_d = min(full_d, ANCHORED_BLOCK_D)
    bias_spread = torch.empty(T, dtype=torch.float32, device=k.device)
    first_bad = torch.full((B * H,), T, dtype=torch.int32, device=k.device)
    return [
        Launch(_visible_bias_kernel, (triton.cdiv(T, GROUP.value),), w, a, a, anchor, bias_spread, T,
               CAUSAL=causal, SPLIT=False, BLOCK_KEYS=BIAS_BLOCK_KEYS, num_warps=4),
        Launch(_anchored_keys_kernel, (triton.cdiv(T, ANCHORED_BLOCK_K), B * H), k, v, eev, first_bad, T, H, D,
               BLOCK_K=ANCHORED_BLOCK_K, FULL_D=full_d, num_warps=4 if full_d <= 128 else 8),
        Launch(_aft_anchored_fwd_kernel, (triton.cdiv(T, ANCHORED_BLOCK_Q), B * H, triton.cdiv(D, block_d)),
               a, eev, anchor, bias_spread, first_bad, k, v, o, lse, o_residual, listed, T, H, D,
               STORE_LSE=stores["STORE_LSE"], STORE_O_RESIDUAL=stores["STORE_O_RESIDUAL"], CAUSAL=causal,
               TMA=use_tma, BLOCK_Q=ANCHORED_BLOCK_Q, BLOCK_K=ANCHORED_BLOCK_K, BLOCK_D=block_d, FULL_D=full_d,
               LISTED_BLOCK_Q=listed_block_q, LISTED_BLOCK_D=listed_block_d, num_warps=ANCHORED_NUM_WARPS,
               num_stages=ANCHORED_NUM_STAGES),
    ]


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
    flag_ptr, w_ptr, k_ptr, v_ptr, o_ptr, o_residual_ptr, lse_ptr, lse_residual_ptr, do_ptr, dk_ptr, dv_ptr,
    T, H, D, log_factor_limit,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    if tl.load(flag_ptr) == 0:
        return
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
    flag_ptr, w_ptr, k_ptr, v_ptr, o_ptr, o_residual_ptr, lse_ptr, lse_residual_ptr, do_ptr, dw_ptr,
    B, T, H, D, log_factor_limit,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, EXACT_DIAGONAL: tl.constexpr,
):
    if tl.load(flag_ptr) == 0:
        return
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


# ------------------------------------------------------------------------------------------------ backward, factorized
#
# P_tsd = exp(w_ts + k_sd - lse_td) separates into a bias factor, a per-(t, d) factor and a key factor, with one
# reference per row of the bias (the exponents split, the references cancel):
#
#     P_tsd = A_ts H_td exp(k_sd),   A_ts = exp(w_ts - M_t) in [0, 1],   H_td = exp(M_t - lse_td),
#
# M_t the largest w_ts over row t's visible keys. A is shared by every (batch, head); H and exp(k) are per element.
# Each sum of the backward is then a product of stored 16-bit operands, each group of them scaled by its own power
# of two (its peak to [2^14, 2^15)), the scales kept as logarithms so that no exponential of a large number is
# formed alone:
#
#     dv_sd = exp(k_sd) sum_t A_ts (do H)_td
#     dk_sd = v_sd dv_sd - exp(k_sd) sum_t A_ts (do o H)_td
#         over queries, per (batch, head): H's operands per query tile and channel, relative to the tile's largest
#         x_td = M_t - lse_td of the channel; the tiles met by an online maximum of their units;
#     dw_ts = A_ts sum_{b,h,d} (do H)_td (exp(k) v)_sd - (do o H)_td exp(k)_sd
#         over the channels of every (batch, head) at once: a [T, B H D] x [B H D, T] product (two), each row of
#         both sides relative to its largest x (queries) or k (keys) over all heads and channels.
#
# An operand entry keeps fp16's 11 bits down to 2^-29 of its group's peak. That holds for every entry that matters
# while the exponents x spread over less than SPREAD_LIMIT nats across a query tile's rows (per channel) and across
# a row's heads and channels, k across a key's heads and channels, and x_td + max_s k_sd (which bounds what A's
# entries are weighed by) stays under it; a call whose inputs pass those limits (wide bias or keys, a key far above
# the ones before it, non-finite values), or whose gradients come out non-finite, is flagged, and the per-tile
# kernels above (their exact per-key paths included) then compute every gradient again. fp32 inputs take those
# kernels alone, so the kernels below make fp16 operands (and read o's saved residual) unconditionally.

# Nats past which an operand's small entries could fall below fp16's normal range in their group's scale: e^-12 is
# 2^-17.3, leaving 2^11 for the spread of |do| or |v| before 2^-29.
SPREAD_LIMIT = 12.0
# Warps of the factorized dk/dv kernel and of the operand kernels where the caller gives none: one warpgroup, as the
# forward's [64, 2 BLOCK_D] products (the per-tile kernels keep BACKWARD_NUM_WARPS).
FACTORIZED_NUM_WARPS = 4
# _factorized_dw_kernel's tiles: queries and keys per program (two [128, 128] fp32 sums on 8 warps), and the
# (head, channel) columns per step of its products, by "split" (whose eight operand tiles a step, at three stages,
# must fit sm_90's 227 KB of shared memory); the operand row kernels' rows per program.
DW_BLOCK = 128
DW_BLOCK_COLUMNS = {False: 64, True: 32}
DW_NUM_WARPS = 8
OPERAND_ROWS = 16
LARGEST_FP32 = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _head_base(bh, T, H, D):
    """Offset of (batch, head) bh = batch * H + head's first key in a [B, T, H, D] tensor."""
    return (bh // H).to(tl.int64) * T * H * D + (bh % H) * D


@triton.jit
def _head_offsets(bh, rows, channels, T, H, D):
    """Offsets of the [rows, channels] tile of (batch, head) bh = batch * H + head in a [B, T, H, D] tensor."""
    return _head_base(bh, T, H, D) + rows[:, None] * (H * D) + channels[None, :]


@triton.jit
def _flag_if(flag_ptr, condition):
    """Raise the call's flag (an int32 read by the per-tile kernels) where condition (a scalar) holds."""
    tl.store(flag_ptr, 1, mask=condition)


@triton.jit
def _any_nonfinite(x, valid):
    """Whether an entry of x inside valid is inf or NaN (a comparison NaN fails; no x - x, which ptxas may fuse)."""
    return tl.max(tl.where(valid & ~(tl.abs(x) <= LARGEST_FP32), 1, 0)) > 0


# A_ts = exp(w_ts - M_t) for the visible keys s of row t (0 elsewhere), scaled by OPERAND_MAX, and M_t; also the
# spread of w over the row's visible keys (max - min; inf where one is not finite), which the anchored forward
# checks. Used by the factorized backward and the anchored forward. One program per GROUP rows; two passes over the
# keys (the extremes, then the operands).
@triton.jit
def _visible_bias_kernel(
    w_ptr, a_hi_ptr, a_lo_ptr, anchor_ptr, bias_spread_ptr, T,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, BLOCK_KEYS: tl.constexpr,
):
    rows = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    row_in = rows < T
    row_offsets = rows.to(tl.int64)[:, None] * T
    key_end = tl.minimum(tl.program_id(0) * GROUP + GROUP, T) if CAUSAL else T
    running_max = tl.full([GROUP, BLOCK_KEYS], -float("inf"), tl.float32)
    running_min = tl.full([GROUP, BLOCK_KEYS], float("inf"), tl.float32)
    nonfinite = tl.zeros([GROUP, BLOCK_KEYS], tl.int32)
    for start in range(0, key_end, BLOCK_KEYS):
        keys = start + tl.arange(0, BLOCK_KEYS)
        visible = row_in[:, None] & (keys < T)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        w = tl.load(w_ptr + row_offsets + keys[None, :], mask=visible, other=-float("inf")).to(tl.float32)
        running_max = tl.maximum(running_max, w)
        running_min = tl.minimum(running_min, tl.where(visible, w, float("inf")))
        nonfinite = tl.maximum(nonfinite, tl.where(visible & ~(tl.abs(w) <= LARGEST_FP32), 1, 0))
    anchor = tl.where(row_in, tl.max(running_max, 1), 0.0)
    tl.store(anchor_ptr + rows, anchor, mask=row_in)
    tl.store(bias_spread_ptr + rows, tl.where(tl.max(nonfinite, 1) > 0, float("inf"), anchor - tl.min(running_min, 1)),
             mask=row_in)
    for start in range(0, T, BLOCK_KEYS):
        keys = start + tl.arange(0, BLOCK_KEYS)
        stored = row_in[:, None] & (keys < T)[None, :]
        visible = stored
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        w = tl.load(w_ptr + row_offsets + keys[None, :], mask=visible, other=-float("inf")).to(tl.float32)
        a = tl.where(visible, tl.exp(w - anchor[:, None]), 0.0) * OPERAND_MAX
        _store_operand(a_hi_ptr, a_lo_ptr, row_offsets + keys[None, :], a, stored, SPLIT, LO_SCALE)


@triton.jit
def _spread(x, valid, axis: tl.constexpr):
    """max - min of x over its valid entries along axis (0 where there are none)."""
    top = tl.max(tl.where(valid, x, -float("inf")), axis)
    bottom = tl.min(tl.where(valid, x, float("inf")), axis)
    return tl.where(top >= bottom, top - bottom, 0.0)


@triton.jit
def _column_operand(x, valid):
    """x (fp32) scaled per column by the power of two moving its peak to [2^14, 2^15), and the natural logarithm
    of each column's inverse scale (x = scaled * exp(log_unscale))."""
    scale, unscale = _operand_scale(tl.max(tl.where(valid, tl.abs(x), 0.0), 0), True)
    return x * scale[None, :], tl.log(unscale)


# dk/dv's query operands, one program per query tile of BLOCK_Q rows and (batch, head), all channels: per channel,
# (do H) and (do o H) relative to the tile's largest x_td = M_t - lse_td of the channel, scaled to their peaks, side
# by side (_pairs); each scale's logarithm (that x plus the power of two's) beside them. Also the checks of x: finite,
# its spread over the tile's rows, and x_td + max_s k_sd (key_max).
@triton.jit
def _query_columns_kernel(
    do_ptr, o_ptr, o_residual_ptr, lse_ptr, anchor_ptr, key_max_ptr, cols_hi_ptr, cols_lo_ptr, col_log_ptr, flag_ptr,
    T, H, D, spread_limit,
    SPLIT: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    rows = pid_t * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    row_in = rows < T
    d_in = offs_d < D
    valid = row_in[:, None] & d_in[None, :]
    offsets = _head_offsets(pid_bh, rows, offs_d, T, H, D)
    do = tl.load(do_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    o = _load_o(o_ptr, o_residual_ptr, offsets, valid, True)
    lse = tl.load(lse_ptr + offsets, mask=valid, other=0.0)
    x = tl.where(valid, tl.load(anchor_ptr + rows, mask=row_in, other=0.0)[:, None] - lse, 0.0)
    key_max = tl.load(key_max_ptr + pid_bh * D + offs_d, mask=d_in, other=0.0)
    _flag_if(flag_ptr, _any_nonfinite(x, valid) | (tl.max(_spread(x, valid, 0)) > spread_limit)
             | (tl.max(tl.where(valid, x + key_max[None, :], 0.0)) > spread_limit))
    ref = tl.where(d_in, tl.max(tl.where(valid, x, -float("inf")), 0), 0.0)
    h = tl.where(valid, tl.exp(x - ref[None, :]), 0.0)
    g, g_log = _column_operand(do * h, valid)
    go, go_log = _column_operand(do * o * h, valid)
    pairs = 2 * D
    pair_cols = tl.arange(0, 2 * BLOCK_D)
    pair_offsets = pid_bh.to(tl.int64) * T * pairs + rows[:, None] * pairs + pair_cols[None, :]
    _store_operand(cols_hi_ptr, cols_lo_ptr, pair_offsets, _pairs(g, go),
                   row_in[:, None] & (pair_cols < pairs)[None, :], SPLIT, LO_SCALE)
    tl.store(col_log_ptr + (pid_bh.to(tl.int64) * tl.cdiv(T, BLOCK_Q) + pid_t) * pairs + pair_cols,
             _vector_pairs(ref + g_log, ref + go_log), mask=pair_cols < pairs)


# dw's query operands, one program per OPERAND_ROWS rows, every (batch, head) and channel of them: (do H) and
# (do o H) relative to the row's largest x over all of them, each scaled by the power of two of a bound on its row's
# peak (max |do|, max |do o|: H <= 1 there), stored as rows of [T, B * H * D]; each scale's logarithm beside them.
# Two passes over the heads: the maxima, then the operands.
@triton.jit
def _query_rows_kernel(
    do_ptr, o_ptr, o_residual_ptr, lse_ptr, anchor_ptr, g_hi_ptr, g_lo_ptr, go_hi_ptr, go_lo_ptr, row_log_ptr,
    flag_ptr, T, H, D, n_heads, spread_limit,
    SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    row_in = rows < T
    valid = row_in[:, None] & (offs_d < D)[None, :]
    anchor = tl.load(anchor_ptr + rows, mask=row_in, other=0.0)
    x_top = tl.full([ROWS, BLOCK_D], -float("inf"), tl.float32)
    x_bottom = tl.full([ROWS, BLOCK_D], float("inf"), tl.float32)
    do_peak = tl.zeros([ROWS, BLOCK_D], tl.float32)
    doo_peak = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for bh in range(0, n_heads):
        offsets = _head_offsets(bh, rows, offs_d, T, H, D)
        x = anchor[:, None] - tl.load(lse_ptr + offsets, mask=valid, other=0.0)
        do = tl.load(do_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        o = _load_o(o_ptr, o_residual_ptr, offsets, valid, True)
        x_top = tl.maximum(x_top, tl.where(valid, x, -float("inf")))
        x_bottom = tl.minimum(x_bottom, tl.where(valid, x, float("inf")))
        do_peak = tl.maximum(do_peak, tl.abs(do))
        doo_peak = tl.maximum(doo_peak, tl.abs(do * o))
    ref = tl.where(row_in, tl.max(x_top, 1), 0.0)
    _flag_if(flag_ptr, tl.max(tl.where(row_in, ref - tl.min(x_bottom, 1), 0.0)) > spread_limit)
    g_scale, g_unscale = _operand_scale(tl.max(do_peak, 1), True)
    go_scale, go_unscale = _operand_scale(tl.max(doo_peak, 1), True)
    width = n_heads * D
    for bh in range(0, n_heads):
        offsets = _head_offsets(bh, rows, offs_d, T, H, D)
        h = tl.where(valid, tl.exp(anchor[:, None] - tl.load(lse_ptr + offsets, mask=valid, other=0.0)
                                   - ref[:, None]), 0.0)
        do = tl.load(do_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        o = _load_o(o_ptr, o_residual_ptr, offsets, valid, True)
        row_offsets = rows.to(tl.int64)[:, None] * width + bh * D + offs_d[None, :]
        _store_operand(g_hi_ptr, g_lo_ptr, row_offsets, do * h * g_scale[:, None], valid, SPLIT, LO_SCALE)
        _store_operand(go_hi_ptr, go_lo_ptr, row_offsets, do * o * h * go_scale[:, None], valid, SPLIT, LO_SCALE)
    tl.store(row_log_ptr + rows * 2, ref + tl.log(g_unscale), mask=row_in)
    tl.store(row_log_ptr + rows * 2 + 1, ref + tl.log(go_unscale), mask=row_in)


# dw's key operands, one program per OPERAND_ROWS keys, every (batch, head) and channel of them: exp(k) v and exp(k)
# relative to the key's largest k over all of them, scaled (exp(k - max) by 2^14, exp(k - max) v by the power of
# two of max |v|), stored as rows of [T, B * H * D], the scales' logarithms beside them; and each (batch, head)'s
# channel maxima of k over every key (key_max, for _query_columns_kernel's check). Two passes over the heads.
@triton.jit
def _key_rows_kernel(
    k_ptr, v_ptr, ev_hi_ptr, ev_lo_ptr, e_hi_ptr, e_lo_ptr, key_log_ptr, key_max_ptr, flag_ptr,
    T, H, D, n_heads, spread_limit,
    SPLIT: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    keys = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_d = tl.arange(0, BLOCK_D)
    key_in = keys < T
    d_in = offs_d < D
    valid = key_in[:, None] & d_in[None, :]
    k_top = tl.full([ROWS, BLOCK_D], -float("inf"), tl.float32)
    k_bottom = tl.full([ROWS, BLOCK_D], float("inf"), tl.float32)
    v_peak = tl.zeros([ROWS, BLOCK_D], tl.float32)
    nonfinite = tl.zeros([ROWS, BLOCK_D], tl.int32)
    for bh in range(0, n_heads):
        offsets = _head_offsets(bh, keys, offs_d, T, H, D)
        k = tl.load(k_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        k_in = tl.where(valid, k, -float("inf"))
        k_top = tl.maximum(k_top, k_in)
        k_bottom = tl.minimum(k_bottom, tl.where(valid, k, float("inf")))
        v_peak = tl.maximum(v_peak, tl.abs(v))
        nonfinite = tl.maximum(nonfinite, tl.where(valid & ~(tl.abs(k) <= LARGEST_FP32), 1, 0))
        tl.atomic_max(key_max_ptr + bh * D + offs_d, tl.max(k_in, 0), mask=d_in)
    ref = tl.where(key_in, tl.max(k_top, 1), 0.0)
    _flag_if(flag_ptr, (tl.max(nonfinite) > 0) | (tl.max(tl.where(key_in, ref - tl.min(k_bottom, 1), 0.0))
                                                  > spread_limit))
    e_scale, e_unscale = _operand_scale(tl.full([ROWS], 1.0, tl.float32), True)
    ev_scale, ev_unscale = _operand_scale(tl.max(v_peak, 1), True)
    width = n_heads * D
    for bh in range(0, n_heads):
        offsets = _head_offsets(bh, keys, offs_d, T, H, D)
        k = tl.load(k_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
        e = tl.where(valid, tl.exp(k - ref[:, None]), 0.0)
        row_offsets = keys.to(tl.int64)[:, None] * width + bh * D + offs_d[None, :]
        _store_operand(ev_hi_ptr, ev_lo_ptr, row_offsets, e * v * ev_scale[:, None], valid, SPLIT, LO_SCALE)
        _store_operand(e_hi_ptr, e_lo_ptr, row_offsets, e * e_scale[:, None], valid, SPLIT, LO_SCALE)
    tl.store(key_log_ptr + keys * 2, ref + tl.log(ev_unscale), mask=key_in)
    tl.store(key_log_ptr + keys * 2 + 1, ref + tl.log(e_unscale), mask=key_in)


# dv_sd = exp(k_sd) sum_t A_ts (do H)_td and dk_sd = v_sd dv_sd - exp(k_sd) sum_t A_ts (do o H)_td: per query tile
# one product A^T [do H, do o H] (the pairs side by side, _pairs) in that tile's units per column; the sums carried
# relative to the largest of those units so far (a factor <= 1 per column each way). One program per (key block,
# batch * head, channel block), over the query tiles that see the block.
@triton.jit
def _factorized_dkdv_kernel(
    a_hi_ptr, a_lo_ptr, cols_hi_ptr, cols_lo_ptr, col_log_ptr, k_ptr, v_ptr, dk_ptr, dv_ptr, flag_ptr,
    T, H, D,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    keys = pid_s * BLOCK_K + tl.arange(0, BLOCK_K)
    key_in = keys < T
    pairs = 2 * D
    pair_cols = 2 * pid_d * BLOCK_D + tl.arange(0, 2 * BLOCK_D)
    pair_in = pair_cols < pairs
    n_tiles = tl.cdiv(T, BLOCK_Q)
    sums = tl.zeros([BLOCK_K, 2 * BLOCK_D], tl.float32)
    units = tl.full([2 * BLOCK_D], -float("inf"), tl.float32)
    first_tile = pid_s * BLOCK_K // BLOCK_Q if CAUSAL else 0
    for tile in range(first_tile, n_tiles):
        rows = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
        row_in = rows < T
        a_hi, a_lo = _load_operand(a_hi_ptr, a_lo_ptr, rows.to(tl.int64)[:, None] * T + keys[None, :],
                                   row_in[:, None] & key_in[None, :], SPLIT)
        b_hi, b_lo = _load_operand(cols_hi_ptr, cols_lo_ptr,
                                   pid_bh.to(tl.int64) * T * pairs + rows[:, None] * pairs + pair_cols[None, :],
                                   row_in[:, None] & pair_in[None, :], SPLIT)
        tile_units = tl.load(col_log_ptr + (pid_bh.to(tl.int64) * n_tiles + tile) * pairs + pair_cols,
                             mask=pair_in, other=0.0)
        product = _product(tl.trans(a_hi), tl.trans(a_lo), b_hi, b_lo, SPLIT, DOT_PRECISION)
        new_units = tl.maximum(units, tile_units)
        sums = sums * tl.exp(units - new_units)[None, :] + product * tl.exp(tile_units - new_units)[None, :]
        units = new_units
    x, y = tl.split(tl.reshape(sums, [BLOCK_K, BLOCK_D, 2]))
    x_units, y_units = tl.split(tl.reshape(units, [BLOCK_D, 2]))
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    valid = key_in[:, None] & (offs_d < D)[None, :]
    offsets = _head_offsets(pid_bh, keys, offs_d, T, H, D)
    k = tl.load(k_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=valid, other=0.0).to(tl.float32)
    # A's operands carry OPERAND_MAX (2^15): its logarithm joins the exponents.
    dv = x * tl.exp(k + x_units[None, :] - LOG_OPERAND_MAX)
    dk = v * dv - y * tl.exp(k + y_units[None, :] - LOG_OPERAND_MAX)
    _flag_if(flag_ptr, _any_nonfinite(dk, valid) | _any_nonfinite(dv, valid))
    tl.store(dv_ptr + offsets, dv.to(dv_ptr.dtype.element_ty), mask=valid)
    tl.store(dk_ptr + offsets, dk.to(dk_ptr.dtype.element_ty), mask=valid)


# dw_ts = exp(w_ts - M_t + r_t + c_s) (G_t . EV_s) - exp(w_ts - M_t + r'_t + c'_s) (GO_t . E_s), the dots over
# every (batch, head) and channel of the row operands ([T, B H D] each; r, c their rows' logarithms): one
# [DW_BLOCK, DW_BLOCK] tile of two products per program, the weights applied once at the end.
@triton.jit
def _factorized_dw_kernel(
    w_ptr, anchor_ptr, g_hi_ptr, g_lo_ptr, go_hi_ptr, go_lo_ptr, row_log_ptr,
    ev_hi_ptr, ev_lo_ptr, e_hi_ptr, e_lo_ptr, key_log_ptr, dw_ptr, flag_ptr, T, width,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_COLUMNS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    keys = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_in = rows < T
    key_in = keys < T
    visible = row_in[:, None] & key_in[None, :]
    n_columns = width
    if CAUSAL:
        visible = visible & (keys[None, :] <= rows[:, None])
        # A tile whose every key comes after every query has dw = 0: no work.
        n_columns = tl.where(tl.program_id(1) * BLOCK_K > tl.program_id(0) * BLOCK_Q + BLOCK_Q - 1, 0, width)
    columns = tl.arange(0, BLOCK_COLUMNS)
    q_rows = rows.to(tl.int64)[:, None] * width
    k_rows = keys.to(tl.int64)[:, None] * width
    gv = tl.zeros([BLOCK_Q, BLOCK_K], tl.float32)
    goe = tl.zeros([BLOCK_Q, BLOCK_K], tl.float32)
    for start in range(0, n_columns, BLOCK_COLUMNS):
        column_in = (start + columns < width)[None, :]
        q_offsets = q_rows + start + columns[None, :]
        k_offsets = k_rows + start + columns[None, :]
        g_hi, g_lo = _load_operand(g_hi_ptr, g_lo_ptr, q_offsets, row_in[:, None] & column_in, SPLIT)
        ev_hi, ev_lo = _load_operand(ev_hi_ptr, ev_lo_ptr, k_offsets, key_in[:, None] & column_in, SPLIT)
        gv += _product(g_hi, g_lo, tl.trans(ev_hi), tl.trans(ev_lo), SPLIT, DOT_PRECISION)
        go_hi, go_lo = _load_operand(go_hi_ptr, go_lo_ptr, q_offsets, row_in[:, None] & column_in, SPLIT)
        e_hi, e_lo = _load_operand(e_hi_ptr, e_lo_ptr, k_offsets, key_in[:, None] & column_in, SPLIT)
        goe += _product(go_hi, go_lo, tl.trans(e_hi), tl.trans(e_lo), SPLIT, DOT_PRECISION)
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * T + keys[None, :], mask=visible, other=0.0).to(tl.float32)
    bias = tl.where(visible, w - tl.load(anchor_ptr + rows, mask=row_in, other=0.0)[:, None], -float("inf"))
    g_log = tl.load(row_log_ptr + rows * 2, mask=row_in, other=0.0)
    go_log = tl.load(row_log_ptr + rows * 2 + 1, mask=row_in, other=0.0)
    ev_log = tl.load(key_log_ptr + keys * 2, mask=key_in, other=0.0)
    e_log = tl.load(key_log_ptr + keys * 2 + 1, mask=key_in, other=0.0)
    dw = (tl.exp(bias + g_log[:, None] + ev_log[None, :]) * gv
          - tl.exp(bias + go_log[:, None] + e_log[None, :]) * goe)
    _flag_if(flag_ptr, _any_nonfinite(dw, visible))
    tl.store(dw_ptr + rows.to(tl.int64)[:, None] * T + keys[None, :], dw.to(dw_ptr.dtype.element_ty),
             mask=row_in[:, None] & key_in[None, :])


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
    """Gradients of <do, o> for the chunkwise forward: {"w": dw [T, T], "k": dk, "v": dv}, in the input dtype.

    16-bit inputs take the factorized kernels; where those flag the call (their inputs' spreads, or a non-finite
    gradient), the per-tile kernels compute every gradient again; fp32 inputs take the per-tile kernels alone."""
    B, T, H, D = k.shape
    block_q = BACKWARD_BLOCK_Q if block_q is None else block_q
    if T == 1:
        # One key, weight 1 whatever w and k are: o = v. The factorized sums would leave a rounding residue
        # where the exact gradients of w and k are 0 (an infinite relative error).
        return {"w": torch.zeros_like(w), "k": torch.zeros_like(k), "v": do.clone()}
    half_operands = k.dtype != torch.float32
    if precision == "auto":
        precision = "split" if k.dtype == torch.float16 else "single"
    split = half_operands and precision == "split"
    # Channel blocks of at most 64 (dk/dv) and 32 (dw) whatever block_d is: a dk/dv program holds six [BLOCK_K,
    # BLOCK_D] fp32 tiles (dk, dv, A^T G, A^T (G o), v, E) and a dw program five [BLOCK_Q, BLOCK_D] ones besides its
    # [BLOCK_Q, BLOCK_K] pair;
    # ptxas (sm_90, 64 x 64 blocks, 8 warps, bf16) spills 1.7 KB a thread at 128 channels, none at 64 (dk/dv)
    # and 32 (dw). dw loops over channel blocks, so its width costs no parallelism. The factorized dk/dv kernel
    # takes the same channel blocks (its [BLOCK_K, 2 BLOCK_D] sums).
    dkdv_block_d = min(block_size(D), block_d, 64)
    dw_block_d = min(block_size(D), block_d, 32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dw = torch.empty_like(w)
    common = dict(CAUSAL=causal, SPLIT=split, DOT_PRECISION="tf32" if half_operands else "ieee", BLOCK_Q=block_q,
                  BLOCK_K=chunk_size, num_stages=num_stages)
    # Set (to 1) where the per-tile kernels must run: always for fp32 inputs.
    flag = torch.full((1,), 0 if half_operands else 1, dtype=torch.int32, device=k.device)
    if half_operands:
        _factorized_backward(o, saved, do, w, k, v, dk, dv, dw, flag, dkdv_block_d, common,
                             FACTORIZED_NUM_WARPS if num_warps is None else num_warps)
    per_tile = dict(common, HALF_OPERANDS=half_operands,
                    num_warps=BACKWARD_NUM_WARPS if num_warps is None else num_warps)
    limit = LOG_FACTOR_LIMIT[half_operands]
    # The pointers of what a dtype did not save are never read (constexpr branches): any tensor stands in.
    o_residual = saved.get("o_residual", o)
    lse_residual = saved.get("lse_residual", saved["lse"])
    # fp32's floor is below what the factorized sums' cancellation near the diagonal leaves (excess 4-5 measured).
    exact_diagonal = causal and not half_operands
    _aft_bwd_dkdv_kernel[(triton.cdiv(T, chunk_size), B * H, triton.cdiv(D, dkdv_block_d))](
        flag, w, k, v, o, o_residual, saved["lse"], lse_residual, do, dk, dv, T, H, D, limit,
        EXACT_DIAGONAL=exact_diagonal, BLOCK_D=dkdv_block_d, **per_tile)
    _aft_bwd_dw_kernel[(triton.cdiv(T, block_q), triton.cdiv(T, chunk_size))](
        flag, w, k, v, o, o_residual, saved["lse"], lse_residual, do, dw, B, T, H, D, limit,
        EXACT_DIAGONAL=exact_diagonal, BLOCK_D=dw_block_d, **per_tile)
    return {"w": dw, "k": dk, "v": dv}


def _factorized_backward(o, saved, do, w, k, v, dk, dv, dw, flag, dkdv_block_d, common, num_warps):
    """The factorized kernels' launches (16-bit inputs): the operands of A, of the key side and of the query side,
    then dk, dv and dw; ``flag`` is set where they cannot be trusted."""
    B, T, H, D = k.shape
    split, block_q, chunk_size = common["SPLIT"], common["BLOCK_Q"], common["BLOCK_K"]
    device = k.device

    def operand(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        hi = torch.empty(shape, dtype=torch.float16, device=device)
        return hi, (torch.empty_like(hi) if split else hi)  # lo is never touched unless split

    a = operand(T, T)
    anchor = torch.empty(T, dtype=torch.float32, device=device)
    cols = operand(B * H, T, 2 * D)  # do H and do o H per channel of a query tile, alternating (_pairs)
    col_log = torch.empty((B * H, triton.cdiv(T, block_q), 2 * D), dtype=torch.float32, device=device)
    g, go = operand(T, B * H * D), operand(T, B * H * D)  # the same per row, over every head
    row_log = torch.empty((T, 2), dtype=torch.float32, device=device)
    ev, e = operand(T, B * H * D), operand(T, B * H * D)  # exp(k) v and exp(k) per key, over every head
    key_log = torch.empty((T, 2), dtype=torch.float32, device=device)
    key_max = torch.full((B * H, D), -float("inf"), dtype=torch.float32, device=device)
    full_d = block_size(D)
    rows = dict(SPLIT=split, ROWS=OPERAND_ROWS, BLOCK_D=full_d, num_warps=num_warps)
    _visible_bias_kernel[(triton.cdiv(T, GROUP.value),)](
        w, *a, anchor, torch.empty_like(anchor), T, CAUSAL=common["CAUSAL"], SPLIT=split, BLOCK_KEYS=BIAS_BLOCK_KEYS, num_warps=4)
    _key_rows_kernel[(triton.cdiv(T, OPERAND_ROWS),)](
        k, v, *ev, *e, key_log, key_max, flag, T, H, D, B * H, SPREAD_LIMIT, **rows)
    _query_rows_kernel[(triton.cdiv(T, OPERAND_ROWS),)](
        do, o, saved.get("o_residual", o), saved["lse"], anchor, *g, *go, row_log, flag, T, H, D, B * H,
        SPREAD_LIMIT, **rows)
    _query_columns_kernel[(triton.cdiv(T, block_q), B * H)](
        do, o, saved.get("o_residual", o), saved["lse"], anchor, key_max, *cols, col_log, flag, T, H, D,
        SPREAD_LIMIT, SPLIT=split, BLOCK_Q=block_q, BLOCK_D=full_d, num_warps=num_warps)
    _factorized_dkdv_kernel[(triton.cdiv(T, chunk_size), B * H, triton.cdiv(D, dkdv_block_d))](
        *a, *cols, col_log, k, v, dk, dv, flag, T, H, D, BLOCK_D=dkdv_block_d, num_warps=num_warps, **common)
    _factorized_dw_kernel[(triton.cdiv(T, DW_BLOCK), triton.cdiv(T, DW_BLOCK))](
        w, anchor, *g, *go, row_log, *ev, *e, key_log, dw, flag, T, B * H * D,
        CAUSAL=common["CAUSAL"], SPLIT=split, DOT_PRECISION=common["DOT_PRECISION"], BLOCK_Q=DW_BLOCK,
        BLOCK_K=DW_BLOCK, BLOCK_COLUMNS=DW_BLOCK_COLUMNS[split], num_warps=DW_NUM_WARPS, num_stages=common["num_stages"])


BACKWARD = {"chunkwise": chunkwise_backward}
