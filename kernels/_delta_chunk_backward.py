"""The chunkwise backward of DeltaNet, Gated DeltaNet and kda (FORMULATIONS.md 8 to 10): the UT transform's dual.

Per chunk of C positions (heads apart), with G_t the chunk-local cumulative log gate (G = 0 ungated; kda: one per
key channel, G_tc), G_C its last value, Gamma_tj = exp(G_t - G_j) for t >= j, M the causal mask and N the strict
one, the forward is (kernels/_delta.py, kernels/kda.py; with per-channel gates K K^T * Gamma stands for
sum_c k_tc k_jc exp(G_tc - G_jc), exp(G) * K for the channelwise product, exp(G_C) S for the rows of S scaled):

    L = N * Diag(beta) (K K^T * Gamma),   X = (I + L)^-1,   T = X Diag(beta)
    Kg = exp(G) * K,   Qg = scale exp(G) * Q,   Kd = exp(G_C - G) * K     (row factors)
    W = T Kg,   U = T V,   A = scale (Q K^T * Gamma * M)
    Delta = U - W S,   O = Qg S + A Delta,   S' = exp(G_C) S + Kd^T Delta

Its dual, from the cotangents dO of O and dS' of the state leaving the chunk, is

    dDelta = A^T dO + Kd dS'                       (= dU)
    dS     = exp(G_C) dS' + Qg^T dO - W^T dDelta   (the cotangent of the state entering the chunk)
    dQg = dO S^T,   dW = -dDelta S^T,   dKd = Delta dS'^T,   dA = M * (dO Delta^T)
    dT  = dDelta V^T + dW Kg^T,   dV = T^T dDelta,   dKg = T^T dW
    dX  = dT Diag(beta),   dbeta_j = sum_i dT_ij X_ij,   dL = -N * (X^T dX X^T)
    dbeta_i += sum_j dL_ij (K K^T * Gamma)_ij,   dE = Diag(beta) dL * Gamma  (E = K K^T)
    dK  = (dE + dE^T) K + scale (dA * Gamma)^T Q + exp(G) dKg + exp(G_C - G) dKd
    dQ  = scale (dA * Gamma) K + scale exp(G) dQg

and, gated, the log gates' cotangent dG_t collects d/dG_t of every factor above: the pairwise decays of L and A
(row sums minus column sums of dL * L and dA * A), the row factors (dQg * Qg, dKg * Kg, minus dKd * Kd, whose sum
also goes to G_C) and exp(G_C) <S, dS'>; G_C is the last row's G, and dg = the reverse cumulative sum of dG over the
chunk (per key channel for kda). Every term is a product of factors exp(<= 0): no exponent is positive, none cancels
across chunks. A gate per head factors out of every channel sum, so the grams above are dots times Gamma. Per-channel
gates do not: kda's grams (and, in reverse, their cotangents' pairwise terms) go block by block of SUB = 16 rows,
each pair of blocks I > J through the anchor a = I's first row, sum_c (a_tc exp(G_tc - G_ac)) (b_jc exp(G_ac - G_jc)),
both exponents <= 0 (j < a <= t), one dot per pair and CHANNEL_SLICE key channels; inside a block by halving (the
later half of each group of 2h rows against its earlier half, through the later half's first row; h = 8, 4, 2, 1),
as kernels/kda.py's forward forms its A rows. Every exponent is a direct sum of the gates it spans (span_sums), kda's
row factors' too (G_t over [0, t], G_C - G_t over (t, C)); a gate per head comes as kernels/_delta.py's compensated
pair, its differences taken part by part.

The arithmetic is ACC = fp32 for 16-bit inputs, nothing rounded to 16 bits before the gradients are written but the
tiles the "fp16" path (below) stores between kernels. The inverse and kda's grams (what T's conditioning
amplifies) use "tf32x3" dots (TF32 hi/lo pairs, about 2^-22), as do dL's two factors of X; W = T Kg and U = T V
take wy_precision: for bf16 inputs the forward's own "split" (bf16 hi/lo parts of T, about 2^-16; a bf16 product
runs at twice a TF32 one's rate, and its parts take half the registers), "tf32x3" at narrow tiles (SPLIT_MIN_TILE)
and for fp16 inputs. In the inverse's merges and dL "split" measured worse on adversarial chunks (beta near 2,
nearly parallel keys: dbeta 1.4 -> 2.4 times bf16's floor), in W and U no worse (reports/bench.md, session 38).
The other products (the sequential passes, the sums over V, the cotangent products) use PRECISION: for bf16 inputs
"fp16", each fp32 operand scaled by a power of two and rounded to fp16 (2^-11 relative, 4x below bf16's floor; one
tensor-core product instead of tf32x3's three TF32 ones, 2.4x faster at the bench shape: reports/bench.md has its
speed and excess against tf32x3's), but "tf32x3" for bf16 heads of fewer than 16 key or value channels (products of
so few terms keep the cancellations' 2^-11: FP16_PRODUCTS_MIN_CHANNELS) and for fewer than 64 positions B * H * T
(one entry's cancellation is then a gradient's figure: FP16_PRODUCTS_MIN_POSITIONS); for fp16 inputs "tf32x3"
("fp16" would sit at their own floor).

On the "fp16" path every operand of the sequential passes' and the sums kernel's products is rounded as
_numerics.to_scratch stores it: fp16, scaled by the power of two of a peak (2^-11 relative down to 2^-27 of the
peak, the rounding scaled_dot does), the peak taken where the tile is made (_bound, one max-reduction) and stored;
every product multiplies such tiles as they are (_dot_stored), no reduction per step. The local kernel, before the
passes, stores what no state enters: A ([C, C]) against its peak, and W, Kd and Qg ([C, K] each) piece by piece of
LOCAL_KEY_BLOCK key channels, the step in which it forms them, each piece against its own peak (all per chunk, in
``bounds``); and the peaks of dO and v per chunk and V block (``peaks``; those inputs are rounded where they are
multiplied). A piece's bound is at most its tile's: a piece whose peak lies below 2^-27 of another's keeps its 11
bits where one bound for the tile would flush it. The passes hold all K channels in one tile and take the pieces'
bounds as they are: a product that sums over the key channels (W S, Kd dS') is a sum in fp32 of one fp16 product
per piece, each scaled by its piece's bound (_dot_pieces); one whose rows are key channels (Kd^T Delta, Qg^T dO,
W^T dDelta) is one fp16 product, each row scaled by its own piece's bound (_row_bounds). So the passes' loops form
no row factor, scan no gate and reduce only what the recursion makes: S and Delta (_states_kernel), dS' and dDelta
(_reverse_kernel), each [K, BV] or [C, BV] tile of a chunk and V block stored at half the bytes against its peak
(``peaks``), which the pass that makes it and the sums kernel multiply as stored. The sums kernel stores its [C, K]
sums the same way, each [C, SUMS_KEY_BLOCK] tile of a chunk against its own peak (``sum_bounds``): dQg and dKd,
which the gradients kernel reads back in ACC, and -dW (in W's buffer), which it multiplies as stored. Its [C, C]
sums, dA and dDelta V^T, and <S, dS'> stay in ACC: dA reaches the gates' gradient elementwise, as the row sums minus
the column sums of dA * A and then dg's reverse cumulative sum, and dDelta V^T through dT, dL and the same row and
column sums of dL * L; those sums cancel, so a rounding 2^-11 of a tile's peak is not small beside what is left
(stored in fp16, they measure gated_deltanet's g up to 1.2 times bf16's floor, 1.0 in ACC: reports/bench.md). They
are sums over V of dO and v (exact in fp16) against Delta and dDelta, and one of them can be a single cancelling
dot: with do zero from position 1, dbeta_0 = A_00 (dO_0 . v_0); at 2^-11, dDelta made that 16.5 times bf16's floor
(reports/bench.md, session 27). So on the "fp16" path the passes also store what rounding Delta and dDelta left, in
fp16 on the same scale (_numerics.scratch_residual, 2^-22 with the stored tile), and the [C, C] sums multiply both
tiles. -dW, dT's other term, takes dDelta as stored, as the reverse pass's W^T dDelta does: its part of dG
(through dKg) must be of the same dDelta as theirs, and -dW is itself stored at 2^-11 of its peak. The
other paths store the same tiles in ACC, unrounded (W and -dW in one buffer, A: its own tile), and no peaks but v's.

For fp32 inputs ACC is fp64: the chunk algebra cancels (S' = (exp(G_C) I - Kd^T W) S + ..., dL's two factors of X),
and evaluated in fp32 it measured 4 to 7 times fp32's floor on the registry's inputs (the float64 blueprint of these
equations rounded to fp32 does the same), where the recurrent backward sits at 1. X comes from the fp32 inverse
(_numerics.unit_lower_inverse), refined for fp64 by one Newton step, X + X (I - (I + L) X), which squares its error.

Five launches, seven with per-channel gates:

- ``_channel_grams_kernel`` (kda only; grid (chunks, B*H)): A and K K^T * Gamma of every chunk by anchors.
- ``_local_kernel`` (grid (chunks, B*H), parallel): the grams (kda: given, and taken into the tensor cores'
  accumulator layout, in which the inverse's reductions stay inside a warp: _gram_in_dot_layout), X, W and U of
  every chunk, stored in ACC; kda's row factors exp(G), exp(G_C - G), which the gradients kernel reads instead of
  repeating their sums, and a gate's exp(G_C) per key channel; the sequential passes' W, A, Kd and Qg ("fp16":
  rounded, W, Kd and Qg piece by piece of key channels, with their peaks); the peaks of each [C, BV] block of v and
  dO.
- ``_states_kernel`` (grid (V blocks, B*H), the chunks in order): the state entering every chunk and its Delta,
  recomputed from W, Kd and U (the forward keeps no chunk states: [B, H, T/C, K, V], K/C times v's size;
  recomputing costs one sequential pass); "fp16": stored in fp16 with their peaks.
- ``_reverse_kernel`` (grid (V blocks, B*H), the chunks backwards): dDelta of every chunk and the state's
  cotangent leaving it, from A, Kd, Qg, W and dO; the last dS is the initial state's gradient; "fp16": stored in
  fp16 with their peaks.
- ``_sums_kernel`` (grid (K blocks of SUMS_KEY_BLOCK + 1, chunks, B*H), parallel): the sums over V above: each
  key block's program (two at K = 128) dQg, -dW, dKd ([C, SUMS_KEY_BLOCK] each; "fp16": stored in fp16 with their
  peaks) and <S, dS'> on its keys, the last program dA (unmasked) and dDelta V^T ([C, C] each; "fp16": Delta's and
  dDelta's residuals too), those two and <S, dS'> in ACC, and dv; every product of stored tiles.
- ``_gradients_kernel`` (grid (chunks, B*H), parallel): from those, the chunk algebra, key block by key block: dT,
  dL, the chunk's dbeta and, with a gate per head or none, dq, dk and dg, written once each in the input dtype;
  kda's go to scratch as the row factors' parts and the grams' cotangents.
- ``_channel_cotangents_kernel`` (kda only; grid (chunks, B*H, K / CHANNEL_SLICE)): dq, dk and dg from those, by
  anchors, the blocks last first (dg's reverse sum carries into earlier blocks), a program per slice of key channels.

S and dS, columns of V apart, never mix: the two sequential passes split V into blocks of BV columns.

The sums over V and the algebra were one kernel, its five fp32 accumulators ([C, K] x 3, [C, C] x 2, 128 KB at C = 64,
K = 128) live through the V loop and the [C, K] tiles of the algebra after it: ptxas spilled 1.5 to 2.7 KB a thread at
8 warps, 5.5 to 8.7 KB at 4. Apart, the sums kernel holds its three [C, SUMS_KEY_BLOCK] sums and [SUMS_KEY_BLOCK,
SUMS_BV] tiles, the gradients kernel [C, SUMS_KEY_BLOCK] tiles on the keys' side; at the bench's tiles and bf16 inputs
(sm_90a ptxas) the sums kernel at 4 warps takes 255 registers a thread and spills 8 bytes (4 bytes of spill loads),
the gradients kernel none at 4 warps ungated and 172 bytes with a gate per head, none with per-channel gates at 8
(GRADIENTS_NUM_WARPS). The price is the sums' round trip through memory, written once and read once (-dW twice, once
for dT and once for dKg): at the bench shape (B = 8, T = 4096, H = 16, K = V = 128, C = 64, bf16
inputs, fp32 ACC) dQg and dKd 256 MiB in fp16 (512 in ACC), -dW 128 MiB in W's fp16 buffer (which no kernel reads
after the reverse pass; 256 MiB in ACC), dA and dDelta V^T 256 MiB and <S, dS'> 4 MiB in ACC, plus 192 KiB of bounds:
about 1.4 GiB of traffic instead of 2.3 in ACC. The sequential passes' outputs there: S and dS' 512 MiB each, Delta
and dDelta 256 MiB each in ACC; 256 and 128 MiB in fp16 on the "fp16" path (bf16 inputs), with Delta's and dDelta's
residuals 1 GiB in all instead of 1.5, plus 0.75 MiB of peaks. The sums kernel reads S and dS' once, Delta, dDelta and
dO three times (its two key programs and its value program) and the residuals once: 1.9 GiB at the bench's bf16
instead of 2.9 (fp32 tiles). The passes' inputs from the local kernel: Kd and Qg 512 MiB in ACC, 256 MiB in fp16; on
the "fp16" path W and A rounded, 128 and 64 MiB (W instead of its ACC tile, A beside its own, which a gate per head's
dg reads, ungated not stored; the other paths read the ACC tiles): 448 MiB in all at the bench's bf16, plus 256 KiB of
bounds and, gated, 4 MiB of exp(G_C). Each of a head's V blocks reads them every chunk, 88 KB in fp16 at K = 128 (W
and Kd in both passes, A and Qg in the reverse one).

Per-channel gates make the row factors [C, K] fp32 tiles where a gate per head has [C, 1] columns, and the anchored
kernels one warp a program; held live across the products, those tiles spill. So the local kernel forms W, the
factors (G by span sums) and the passes' Kd and Qg LOCAL_KEY_BLOCK key channels at a time after the inverse, each
piece rounded and stored where it is formed, and the anchored kernels address a block by an int64 base and int32
offsets (_rows_from). reports/bench.md (session 22) has the spills and times before and after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.kernels._delta import SUB, _chunk_cumulative_gate, _chunk_total_gate
from attnlab.kernels._numerics import (
    dot_precision, dot_scratches, from_scratch, native_gates, peak, scaled_dot, scratch_residual, span_sums,
    split_dot_into, to_scratch, unit_lower_inverse,
)
from attnlab.kernels._util import block_size, state_block
from attnlab.runtime import interpreter_active

# fp32 entries of one [K, BV] state tile in the sequential passes (they hold S or dS and their products): V blocks
# of 64 columns at K = 128. The passes wait mostly on each chunk's loads (W, Kd, Qg, A, dO and their bounds, the
# same for every V block of a head), so wider blocks load them for more columns at once; 128 columns spill.
STATE_TILE = 8192
# The backward's chunk of positions, C (any chunk size gives the same gradients): CHUNK, halved past 128 key channels,
# where the local kernel's and the sequential passes' whole-K tiles ([C, BK]: q, k, W) would double. A smaller chunk
# shrinks the parallel kernels' [C, C] and [C, K] tiles and gives the sequential passes more steps: at 32 the
# training step measured 1.3 times slower at the bench shape, though kda's anchored kernels gained (reports/bench.md,
# session 39).
CHUNK = 64
NUM_WARPS = 4
# The fewest key and value channels at which bf16 inputs' products take "fp16" (products_precision). Below, a
# product is a sum of a few terms, and the chunk algebra's cancellations (dS = exp(G_C) dS' + Qg^T dO - W^T dDelta,
# dT's two terms) keep the operands' 2^-11 where a sum over many channels would not land on one: at K = V = 1 and
# T = 1 with a drawn initial state, "fp16" measured excess 14 (d initial_state) and, with beta near 0, 102 (dk)
# against bf16's floor, 1.0 at tf32x3; at K = V = 4 and 16 up to 1.2 (reports/bench.md, session 26). Heads this
# narrow cost nothing to multiply at tf32x3.
FP16_PRODUCTS_MIN_CHANNELS = 16
# The fewest positions (B * H * T) at which bf16 inputs' products take "fp16". The figure is normwise over a
# gradient's entries, and with few positions one entry's cancellation is the figure: dbeta_t and a gate per head's
# dg_t are a position's sums over V and K channels (dT_tt = dDelta_t . (v_t - S^T kg_t); dg_t also the chunk's
# <S, dS'>), which cancel down to a small value now and then, and the "fp16" path's operands (S, dS', Delta, dDelta
# stored at 2^-11) then leave 2^-11 of the parts: at T = 1 with a drawn state, Gated DeltaNet's dg measured 168
# times bf16's floor (tf32x3: 1.00); at T = 4, 3.4; at T = 16, 1.35; from 64 positions on, where "fp16" stays, up
# to 2.05 (dbeta), under the correctness bound (reports/bench.md, session 27). Problems this small are launch-bound:
# tf32x3 costs them nothing.
FP16_PRODUCTS_MIN_POSITIONS = 64
# Key channels a program of the sums kernel (its three [C, SUMS_KEY_BLOCK] fp32 sums) and a step of the gradients
# kernel (which takes the sums' bounds key block by key block); the sums kernel's V step (the [SUMS_KEY_BLOCK,
# SUMS_BV] tiles of S and dS', the [C, SUMS_BV] ones of dO, Delta and dDelta; it divides the sequential passes' BV,
# whose blocks' bounds it takes); the two kernels' warps. At C = 64, K = V = 128 (sm_90a ptxas, bf16 inputs) 64
# keys at 4 warps and a V step of 32 take 255 registers and spill 8 bytes a thread (4 of loads). All 128 keys in one
# program at 8 warps (Delta, dDelta and dO read once, not twice) is slower (reports/bench.md) and faults on an H100
# with tf32x3 products (an illegal memory access the interpreter does not reproduce).
SUMS_KEY_BLOCK = 64
SUMS_BV = 32
SUMS_NUM_WARPS = 4
# The gradients kernel's warps, with a gate per head or none and with per-channel gates. Every backward kernel waits
# on its own chain of loads, products and reductions (reports/bench.md, sessions 32 and 40); at 4 warps and 255
# registers two programs share an SM and hide each other's waits, where at 8 (229 to 255 registers) one has it to
# itself. At the bench shape 4 warps took the kernel from 1.19 to 0.75 ms (deltanet) and 1.66 to 1.28 (a gate per
# head) though ptxas spilled 96 and 636 bytes a thread there (none at 8). With X loaded after the first key loop and
# a gate's sums taken where their operands are formed, not held across the products, those spills went to none and
# 172 bytes, and a gate per head's kernel to 1.11 ms (reports/bench.md, session 41). Per-channel gates' variant
# spills 552 bytes at 4 and measured 1.69 ms there against 1.51 at 8, so keeps 8.
GRADIENTS_NUM_WARPS = 4
CHANNEL_GRADIENTS_NUM_WARPS = 8
# Pipeline stages of each kernel's loop with fp32 ACC (a kernel absent here takes one, and every kernel takes one
# in fp64, where Triton's default of 3 multiplies the shared buffers past sm_90's 227 KB: 360 KB for the reverse
# pass at K = 128). The sums kernel streams its V steps' tiles and gains most from loads issued ahead; the states
# pass gains at two and loses at three; the reverse pass and the local and gradients kernels do not gain
# (reports/bench.md, session 22, has the sweep).
NUM_STAGES: dict[str, int] = {"sums": 4, "states": 2, "channel": 2}
# The narrowest key piece and V block of the local kernel at which bf16 inputs' W = T Kg and U = T V take "split"
# (wy_precision). Triton 3.6's Hopper code for a bf16 product whose second operand is a loaded 16-bit tile
# 16 columns wide (U = T V at V blocks of 16; W = T K, ungated, at key pieces of 16) gave deltanet's and kda's
# gradients off by 700 to 1600 times bf16's floor (dq, dk, d initial_state) or faulted (an illegal memory access),
# where tf32x3, which converts that tile to fp32 first, is right (reports/bench.md, session 38).
SPLIT_MIN_TILE = 64
# Key channels a step of the per-channel gates' anchored grams and a program of their cotangents ([SUB,
# CHANNEL_SLICE] tiles). At one warp and K = 128 (sm_90a ptxas, bf16 inputs) the grams kernel spills 4 bytes a
# thread at 32, none at 16 (147 registers), 0.3 KB at 64; the cotangents kernel 0.3 KB at 32, 40 bytes at 16, 7 KB
# at 64.
CHANNEL_SLICE = 32
# Key channels a step of the local kernel after the inverse (W's columns; kda's row factors, their span sums and
# exps; the sequential passes' W, Kd and Qg, each rounded against its own peak), so the pieces whose bounds the
# passes take (one product a piece where they sum over the key channels, _dot_pieces). At K = 128 (4 warps, bf16
# inputs) 64 spills 12 (a gate per head) to 64 bytes a thread (ungated; kda 76 to 100); 32, 0 to 8 (kda 76), but
# the passes' sums over the key channels take four products each and up to 254 registers; all 128 at once (one
# bound a tile) 12 to 136 bytes, and for kda 0.6 to 0.8 KB.
LOCAL_KEY_BLOCK = 64
# The fewest key channels of a piece at which the local kernel's span sums of per-channel gates ([C, C] 0/1 spans
# times a [C, piece] gate tile as loaded, _channel_factors) take the gates' own 16-bit tensor-core dot. Triton 3.6's
# Hopper code for that dot reads a 16- or 32-channel bf16 tile wrongly: an illegal shared-memory read (16 channels,
# V = 1 or 64) or gradients off by up to 1e10 (17 to 32 channels); 64 is right (reports/bench.md, session 26;
# triton-lang/triton#11366 is a fault of the same kind). Narrower pieces take the exact fp32 dot on CUDA cores.
NATIVE_SPAN_KEYS = 64
# Their [SUB, SUB] products hold whole operands in one warp (as kda's forward A rows do). At 4 warps the
# cotangents kernel spills nothing (195 registers) and the grams kernel 16 bytes, each reduction then across warps.
CHANNEL_NUM_WARPS = 1
# Halvings of a SUB-row block down to single rows (_level_factors).
SUB_LEVELS = tl.constexpr(SUB.value.bit_length() - 1)
# The "fp16" path's bounds (_bound), one per (chunk, V block of the sequential passes' BV columns) and operand, in
# ``peaks`` [B*H*chunks*V blocks, PEAKS]: S, Delta (_states_kernel), dS', dDelta (_reverse_kernel), dO, V
# (_local_kernel).
PEAK_S = tl.constexpr(0)
PEAK_DELTA = tl.constexpr(1)
PEAK_D_S = tl.constexpr(2)
PEAK_D_DELTA = tl.constexpr(3)
PEAK_DO = tl.constexpr(4)
PEAK_V = tl.constexpr(5)
PEAKS = tl.constexpr(6)
# And the bounds of the sequential passes' operands that no state enters (_local_kernel), per chunk in ``bounds``
# [B*H*chunks, BOUNDS * pieces]: a row of ``pieces`` per operand, one per piece of LOCAL_KEY_BLOCK key channels
# (the local kernel's step, where each piece is formed) of W, Kd and Qg; A, a [C, C] tile made whole, has one,
# the first of its row.
BOUND_A = tl.constexpr(0)
BOUND_W = tl.constexpr(1)
BOUND_KD = tl.constexpr(2)
BOUND_QG = tl.constexpr(3)
BOUNDS = tl.constexpr(4)
# And the bounds of _sums_kernel's sums on the "fp16" path, per chunk in ``sum_bounds`` [B*H*chunks, SUM_BOUNDS *
# key blocks]: a row of ``key blocks`` (of SUMS_KEY_BLOCK channels: the sums kernel's key programs, the gradients
# kernel's steps) for each of dQg, dKd and -dW.
SUM_QG = tl.constexpr(0)
SUM_KD = tl.constexpr(1)
SUM_W = tl.constexpr(2)
SUM_BOUNDS = tl.constexpr(3)


@triton.jit
def _chunk_of(chunk, bh, chunks, C: tl.constexpr, T, H):
    """The C rows of chunk ``chunk`` of head ``bh``: their validity (before T), tokens and rows of the scratch
    buffers."""
    rows = tl.arange(0, C)
    pos = chunk * C + rows
    token = ((bh // H) * T + pos).to(tl.int64) * H + bh % H
    return pos < T, token, (bh.to(tl.int64) * chunks + chunk) * C + rows


@triton.jit
def _chunk_rows(C: tl.constexpr, T, H):
    """The program's chunk and head (grid (chunks, B*H)): its rows, their validity, tokens and scratch rows."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    valid, token, scratch_row = _chunk_of(chunk, bh, tl.num_programs(0), C, T, H)
    return chunk, bh, tl.arange(0, C), valid, token, scratch_row


@triton.jit
def _dot(a, b, acc, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b in ACC: fp64 products, or fp32 at PRECISION: "fp16" (_numerics.scaled_dot, each fp32 operand
    scaled by a power of two and rounded to fp16), "split" (bf16 hi/lo parts; "split_emulated" under the
    interpreter) or "tf32x3" (_numerics.split_dot_into)."""
    if ACC == tl.float64:
        acc = tl.dot(a.to(tl.float64), b.to(tl.float64), acc, out_dtype=tl.float64)
    elif (PRECISION == "fp16" or PRECISION == "fp16_emulated") and not (
            tl.constexpr(a.dtype == b.dtype) and tl.constexpr(a.dtype != tl.float32)):
        acc += scaled_dot(a.to(tl.float32), b.to(tl.float32), PRECISION)
    elif PRECISION == "split_emulated":
        acc = split_dot_into(a, b, acc, "split", True)
    else:
        acc = split_dot_into(a, b, acc, PRECISION, False)
    return acc


@triton.jit
def _mm(a, b, ACC: tl.constexpr, PRECISION: tl.constexpr):
    return _dot(a, b, tl.zeros([a.shape[0], b.shape[1]], dtype=ACC), ACC, PRECISION)


@triton.jit
def _bound(x, PRECISION: tl.constexpr):
    """The bound a tile is rounded against on the "fp16" path: its peak (one max-reduction, taken once where the
    tile is made); on the other paths 0, unused (no reduction)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return peak(x.to(tl.float32))
    else:
        return tl.full([], 0.0, tl.float32)


@triton.jit
def _load_bound(bound_ptr, PRECISION: tl.constexpr):
    """A stored bound (``peaks``, ``bounds``) on the "fp16" path (0, unused, on the others, which store no bounds)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return tl.load(bound_ptr)
    else:
        return tl.full([], 0.0, tl.float32)


@triton.jit
def _operand(x, PRECISION: tl.constexpr):
    """(x as to_scratch stores it against its peak, that peak): on the "fp16" path fp16 scaled by its peak,
    otherwise x; for _product."""
    bound = _bound(x, PRECISION)
    return to_scratch(x, bound, PRECISION), bound


@triton.jit
def _product(a, a_bound, b, b_bound, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b of two operands as _operand made them (with these bounds): _mm's products, each rounding done once."""
    return _dot_stored(a, a_bound, b, b_bound, tl.zeros([a.shape[0], b.shape[1]], dtype=ACC), ACC, PRECISION)


@triton.jit
def _dot_stored(a, a_bound, b, b_bound, acc, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b of operands as _numerics.to_scratch stores them with these bounds: on the "fp16" path one fp16
    product of the tiles as they are (_numerics.dot_scratches: no scale taken from them); otherwise _dot (ACC
    tiles, stored unrounded)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        acc += dot_scratches(a, a_bound, b, b_bound, PRECISION)
    else:
        acc = _dot(a, b, acc, ACC, PRECISION)
    return acc


@triton.jit
def _peaks_at(chunk_row, v_block, V, BV: tl.constexpr):
    """The first of the PEAKS bounds of chunk ``chunk_row`` (bh * chunks + chunk) and V block ``v_block``."""
    return (chunk_row * tl.cdiv(V, BV) + v_block) * PEAKS


@triton.jit
def _bounds_at(chunk_row, OPERAND: tl.constexpr, PIECES: tl.constexpr):
    """The first of OPERAND's ``bounds`` (one per piece of key channels) of chunk ``chunk_row``."""
    return (chunk_row * BOUNDS + OPERAND) * PIECES


@triton.jit
def _sum_bounds_at(chunk_row, OPERAND: tl.constexpr, key_blocks):
    """The first of OPERAND's ``sum_bounds`` (one per key block) of chunk ``chunk_row``."""
    return (chunk_row * SUM_BOUNDS + OPERAND) * key_blocks


@triton.jit
def _store_operand(x_ptr, x, mask, bound_ptr, PRECISION: tl.constexpr):
    """Store x as to_scratch makes it against its own peak and, on the "fp16" path, that peak (at ``bound_ptr``):
    x unrounded on the other paths, which read no bound."""
    bound = _bound(x, PRECISION)
    tl.store(x_ptr, to_scratch(x, bound, PRECISION), mask=mask)
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        tl.store(bound_ptr, bound)


@triton.jit
def _dot_pieces(a, a_bounds, b, b_bound, acc, K, BKC: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b summed over a's columns, key channels that _local_kernel stored piece by piece of BKC, each piece
    against its own bound (``a_bounds``, one a piece), and b as to_scratch stored it: on the "fp16" path a sum in
    fp32 of one fp16 product per piece, each scaled by its piece's bound and b's (_dot_stored), the piece picked by
    zeroing b's other rows (b, [BK, BV], is the smaller operand: at K = 128 zeroing a's columns instead took the
    passes from 175 to 240 registers a thread to 255, and spilled); otherwise one _dot. A piece past K (K < BK)
    has no bound stored: its rows of b are zero, and so is its bound here."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        piece_of = tl.arange(0, b.shape[0]) // BKC
        for piece in tl.static_range(b.shape[0] // BKC):
            acc = _dot_stored(a, tl.load(a_bounds + piece, mask=piece * BKC < K, other=0.0),
                              tl.where((piece_of == piece)[:, None], b, 0.0), b_bound, acc, ACC, PRECISION)
    else:
        acc = _dot(a, b, acc, ACC, PRECISION)
    return acc


@triton.jit
def _row_bounds(a_bounds, keys, K, BKC: tl.constexpr, PRECISION: tl.constexpr):
    """For a product whose rows are key channels (the transpose of a tile _local_kernel stored piece by piece of
    BKC, each against its own bound, ``a_bounds``): each row's piece's bound as a [BK, 1] column, which
    _dot_stored's one fp16 product takes on its own rows (0 past K, on rows that are zero); on the other paths 0,
    unused (no load)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return tl.load(a_bounds + keys // BKC, mask=keys < K, other=0.0)[:, None]
    else:
        return tl.full([], 0.0, tl.float32)


@triton.jit
def _scale_in(scale_hi, scale_lo, ACC: tl.constexpr):
    """The scale as two fp32 parts (Triton passes a float argument as fp32): exact in fp64 to about 2^-48."""
    return (tl.full([], 0.0, ACC) + scale_hi) + scale_lo


@triton.jit
def _chunk_gate(g_ptr, token, valid, GATED: tl.constexpr, ACC: tl.constexpr):
    """(G_hi, G_lo, G_C's hi, G_C's lo) of one chunk with a gate per head, in ACC: G as an fp32 pair
    (kernels/_delta.py's compensated scan, on [C]) and its total; ungated, zeros. The factors below take their
    differences part by part, so that each is accurate to its own size."""
    if GATED:
        G_hi, G_lo = _chunk_cumulative_gate(g_ptr, token, valid)
        end_hi, end_lo = _chunk_total_gate(g_ptr, token, valid)
        return G_hi.to(ACC), G_lo.to(ACC), end_hi.to(ACC), end_lo.to(ACC)
    else:
        zeros = tl.zeros(token.shape, ACC)
        return zeros, zeros, tl.zeros([], ACC), tl.zeros([], ACC)


@triton.jit
def _pairwise_decay_of(gate, GATED: tl.constexpr, C: tl.constexpr):
    """Gamma * M of a chunk from _chunk_gate's ``gate``, [C, C]: exp(G_t - G_j) for t >= j, the exponent clamped to
    <= 0, and 0 above the diagonal (masked to -inf before the exponential); ungated M."""
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    G_hi, G_lo, _end_hi, _end_lo = gate
    if GATED:
        pairwise = tl.minimum((G_hi[:, None] - G_hi[None, :]) + (G_lo[:, None] - G_lo[None, :]), 0.0)
        return tl.exp(tl.where(causal, pairwise, float("-inf")))
    else:
        return tl.where(causal, 1.0, 0.0).to(G_hi.dtype)


@triton.jit
def _row_factors_of(gate, GATED: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, ACC: tl.constexpr):
    """(exp(G_t), exp(G_C - G_t), exp(G_C)) of a chunk from _chunk_gate's ``gate``: [C, 1] columns (the same in every
    channel) and [BK]; every exponent clamped to <= 0; ungated 1, 1, 1."""
    G_hi, G_lo, end_hi, end_lo = gate
    if GATED:
        from_start = tl.exp(tl.minimum(G_hi + G_lo, 0.0))[:, None]
        to_end = tl.exp(tl.minimum((end_hi - G_hi) + (end_lo - G_lo), 0.0))[:, None]
        chunk_decay = tl.full([BK], 1.0, ACC) * tl.exp(tl.minimum(end_hi + end_lo, 0.0))
    else:
        from_start = tl.full([C, 1], 1.0, ACC)
        to_end = tl.full([C, 1], 1.0, ACC)
        chunk_decay = tl.full([BK], 1.0, ACC)
    return from_start, to_end, chunk_decay


@triton.jit
def _channel_gate_factors(factors_ptr, decays_ptr, scratch_row, chunk_row, keys, K):
    """Per-channel gates' row factors of one key block as _local_kernel stored them, whose scans every later kernel
    would otherwise repeat: (exp(G_t), exp(G_C - G_t)) from ``factors`` ([rows, 2K]), [C, BK] each, and exp(G_C)
    from ``decays`` ([chunks, K]), [BK]."""
    key_ok = (keys < K)[None, :]
    offsets = scratch_row[:, None] * (2 * K) + keys[None, :]
    from_start = tl.load(factors_ptr + offsets, mask=key_ok, other=0.0)
    to_end = tl.load(factors_ptr + offsets + K, mask=key_ok, other=0.0)
    chunk_decay = tl.load(decays_ptr + chunk_row * K + keys, mask=keys < K, other=0.0)
    return from_start, to_end, chunk_decay


@triton.jit
def _channel_factors(g, C: tl.constexpr, ACC: tl.constexpr, NATIVE_GATES: tl.constexpr):
    """Per-channel gates' row factors of one chunk from its log gates g [C, channels], in ACC: exp(G_t) and
    exp(G_C - G_t) [C, channels] and exp(G_C) [channels], each exponent the direct sum of the steps it spans ([0, t]
    and (t, C), _span_exponents: two tensor-core dots), as the anchored grams and kernels/kda.py's forward take
    theirs; G_C is the last row's [0, C) (rows past T load g = 0). A compensated scan of the [C, channels] gates (a
    pair per entry, Knuth's TwoSum at every step of a scan across threads and warps) was half the local kernel's
    instructions at K = 128 (sm_90a), more than DeltaNet's whole local kernel."""
    rows = tl.arange(0, C)
    G = _span_exponents(rows[None, :] <= rows[:, None], g, ACC, NATIVE_GATES)
    to_end = tl.exp(_span_exponents(rows[None, :] > rows[:, None], g, ACC, NATIVE_GATES))
    return tl.exp(G), to_end, tl.exp(tl.sum(tl.where(rows[:, None] == C - 1, G, 0.0), axis=0))


@triton.jit
def _rows_of(x_ptr, token, valid, channels, K):
    """The chunk's rows of x [B, T, H, K] on ``channels`` (0 past T and past K), in x's dtype."""
    return tl.load(x_ptr + token[:, None] * K + channels[None, :], mask=valid[:, None] & (channels < K)[None, :],
                   other=0.0)


@triton.jit
def _key_rows(x_ptr, rows, keys, K, width):
    """Rows ``rows`` of a scratch buffer [.., width] on ``keys`` (0 past K)."""
    return tl.load(x_ptr + rows[:, None] * width + keys[None, :], mask=(keys < K)[None, :], other=0.0)


@triton.jit
def _span_exponents(span, g, ACC: tl.constexpr, NATIVE_GATES: tl.constexpr):
    """span @ g in ACC for a 0/1 matrix span: each row the direct sum of the log gates it spans, same-signed terms
    (_numerics.span_sums; fp64 sums in the fp64 arithmetic)."""
    if ACC == tl.float64:
        return tl.dot(span.to(tl.float64), g.to(tl.float64), out_dtype=tl.float64)
    else:
        return span_sums(span, g, NATIVE_GATES).to(ACC)


@triton.jit
def _rows_from(bh, chunk, first, N: tl.constexpr, C: tl.constexpr, T, H):
    """Rows first .. first + N - 1 of a chunk, in a grid (chunks, B*H, ..), for the one-warp anchored kernels: their
    validity, the first row's token and scratch row (int64) and each row's token step from it (int32). Addresses
    are a base and int32 offsets (_block_of): int64 [SUB, channels] offset tiles, kept in registers through the
    blocks' loops, were a third of the cotangents kernel's spills."""
    rows = tl.arange(0, N)
    pos = chunk * C + first
    token = ((bh // H) * T + pos).to(tl.int64) * H + bh % H
    return pos + rows < T, token, rows * H, (bh.to(tl.int64) * tl.num_programs(0) + chunk) * C + first


@triton.jit
def _block_rows(bh, chunk, block, C: tl.constexpr, T, H):
    """Block ``block`` (SUB rows) of a chunk (_rows_from)."""
    return _rows_from(bh, chunk, block * SUB, SUB, C, T, H)


@triton.jit
def _block_of(x_ptr, token, steps, valid, channels, K):
    """The rows (token + steps) of x [B, T, H, K] on ``channels`` (0 past T and past K), in x's dtype."""
    return tl.load(x_ptr + token * K + (steps[:, None] * K + channels[None, :]),
                   mask=valid[:, None] & (channels < K)[None, :], other=0.0)


@triton.jit
def _to_anchor(g_block, ACC: tl.constexpr, NATIVE_GATES: tl.constexpr):
    """exp(G_t - G_a) of a block's rows t, a its first row: the steps (a, t]."""
    local = tl.arange(0, SUB)
    return tl.exp(_span_exponents((local[None, :] > 0) & (local[None, :] <= local[:, None]), g_block, ACC,
                                  NATIVE_GATES))


@triton.jit
def _from_block_end(g_block, ACC: tl.constexpr, NATIVE_GATES: tl.constexpr):
    """The exponents of a block's rows j to its end: the sums of the steps (j, end of the block]."""
    local = tl.arange(0, SUB)
    return _span_exponents(local[:, None] < local[None, :], g_block, ACC, NATIVE_GATES)


@triton.jit
def _first_row(g_block, ACC: tl.constexpr):
    """A block's first step (its anchor's gate) per channel."""
    return tl.sum(tl.where((tl.arange(0, SUB) == 0)[:, None], g_block.to(ACC), 0.0), axis=0)


@triton.jit
def _level_factors(g_block, level, ACC: tl.constexpr, NATIVE_GATES: tl.constexpr):
    """Pairs inside one block, by halving (kernels/kda.py's A rows): at ``level`` each group of 2h rows (h = SUB/2,
    SUB/4, ..) pairs its later half (t >= a, the later half's first row) with its earlier half (j < a). Returns
    (the later rows' mask, exp(G_t - G_a) on later rows and exp(G_a - G_j) on earlier ones [SUB, channels], the
    pairs' mask [SUB, SUB])."""
    local = tl.arange(0, SUB)
    half = SUB >> (level + 1)
    anchor = (local // (2 * half)) * (2 * half) + half
    later = local >= anchor
    span = tl.where(later[:, None], (anchor[:, None] < local[None, :]) & (local[None, :] <= local[:, None]),
                    (local[:, None] < local[None, :]) & (local[None, :] <= anchor[:, None]))
    factor = tl.exp(_span_exponents(span, g_block, ACC, NATIVE_GATES))
    pair = ((local[:, None] // (2 * half)) == (local[None, :] // (2 * half))) & later[:, None]
    return later, factor, pair


@triton.jit
def _channel_grams_kernel(
    q_ptr, k_ptr, g_ptr, a_ptr, kk_ptr, T, H, K, scale_hi, scale_lo,
    C: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    NATIVE_GATES: tl.constexpr,
):
    """One chunk of one head with per-channel gates: A = scale (Q K^T * Gamma * M) and K K^T * Gamma * M (0 above
    the diagonal), sum_c a_tc b_jc exp(G_tc - G_jc), which does not factor into one dot: block by block of SUB rows,
    one dot per block pair and channel slice of BKC channels, every exponent <= 0. Left of the diagonal block, the
    pair I > J through the anchor a, I's first row: exp(G_t - G_a) for I's rows t (_to_anchor, the steps (a, t]) and
    exp(G_a - G_j) for J's rows j, the steps (j, J's end] (_from_block_end) plus those from J's end up to a, carried
    down the J loop (the last key block first) per channel: a's own step, then each key block's sum. Inside the
    diagonal block by halving (_level_factors)."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    SLICES: tl.constexpr = BK // BKC
    scale = _scale_in(scale_hi, scale_lo, ACC)
    local = tl.arange(0, SUB)
    slice_of = tl.arange(0, SLICES)[:, None]
    every_channel = slice_of * BKC + tl.arange(0, BKC)[None, :]  # [SLICES, BKC]: all BK channels, a row a slice
    for I in range(0, C // SUB):
        valid_I, token_I, steps_I, scratch_I = _block_rows(bh, chunk, I, C, T, H)
        out = scratch_I * C + local[:, None] * C
        # The steps from the end of key block J up to the anchor, per channel: the anchor's step first.
        anchor_ok = chunk * C + I * SUB < T
        between = tl.load(g_ptr + token_I * K + every_channel, mask=(every_channel < K) & anchor_ok,
                          other=0.0).to(ACC)
        for step in range(0, I):
            J = I - 1 - step
            valid_J, token_J, steps_J, _ = _block_rows(bh, chunk, J, C, T, H)
            qk = tl.zeros([SUB, SUB], dtype=ACC)
            kk = tl.zeros([SUB, SUB], dtype=ACC)
            for channel_slice in range(0, SLICES):
                channels = channel_slice * BKC + tl.arange(0, BKC)
                this_slice = slice_of == channel_slice
                g_J = _block_of(g_ptr, token_J, steps_J, valid_J, channels, K)
                to_t = _to_anchor(_block_of(g_ptr, token_I, steps_I, valid_I, channels, K), ACC, NATIVE_GATES)
                from_j = tl.exp(_from_block_end(g_J, ACC, NATIVE_GATES)
                                + tl.sum(tl.where(this_slice, between, 0.0), axis=0)[None, :])
                keys = tl.trans(_block_of(k_ptr, token_J, steps_J, valid_J, channels, K).to(ACC) * from_j)
                qk = _dot(_block_of(q_ptr, token_I, steps_I, valid_I, channels, K).to(ACC) * to_t, keys, qk, ACC,
                          PRECISION)
                kk = _dot(_block_of(k_ptr, token_I, steps_I, valid_I, channels, K).to(ACC) * to_t, keys, kk, ACC,
                          PRECISION)
                between += tl.where(this_slice, tl.sum(g_J.to(ACC), axis=0)[None, :], 0.0)
            tl.store(a_ptr + out + (local + J * SUB)[None, :], scale * qk)
            tl.store(kk_ptr + out + (local + J * SUB)[None, :], kk)
        qk = tl.zeros([SUB, SUB], dtype=ACC)
        kk = tl.zeros([SUB, SUB], dtype=ACC)
        for channel_start in range(0, K, BKC):
            channels = channel_start + tl.arange(0, BKC)
            g = _block_of(g_ptr, token_I, steps_I, valid_I, channels, K)
            q = _block_of(q_ptr, token_I, steps_I, valid_I, channels, K).to(ACC)
            k = _block_of(k_ptr, token_I, steps_I, valid_I, channels, K).to(ACC)
            qk += tl.where(local[:, None] == local[None, :], tl.sum(q * k, axis=1)[:, None], 0.0)
            for level in tl.static_range(SUB_LEVELS):
                later, factor, pair = _level_factors(g, level, ACC, NATIVE_GATES)
                keys = tl.trans(tl.where(later[:, None], 0.0, k * factor))
                qk += tl.where(pair, _mm(tl.where(later[:, None], q * factor, 0.0), keys, ACC, PRECISION), 0.0)
                kk += tl.where(pair, _mm(tl.where(later[:, None], k * factor, 0.0), keys, ACC, PRECISION), 0.0)
        tl.store(a_ptr + out + (local + I * SUB)[None, :], scale * qk)
        tl.store(kk_ptr + out + (local + I * SUB)[None, :], kk)
        for J in range(I + 1, C // SUB):
            tl.store(a_ptr + out + (local + J * SUB)[None, :], tl.zeros([SUB, SUB], dtype=ACC))
            tl.store(kk_ptr + out + (local + J * SUB)[None, :], tl.zeros([SUB, SUB], dtype=ACC))


@triton.jit
def _gram_in_dot_layout(kk, C: tl.constexpr, ACC: tl.constexpr):
    """kk (loaded: per-channel gates) in the tensor cores' accumulator layout, as the accumulator of a product of
    zeros: kk + 0, the same values (none is -0). A gate per head's kk, itself a product, has that layout; a loaded one
    keeps the load's, which splits each block of unit_lower_inverse's rows across warps, so that every step of its
    substitution reduces across warps, through shared memory and a barrier (reports/bench.md, session 25: kda's
    local kernel 3.4 -> 1.5 ms). fp64 ACC (fp32 inputs): kk as it is."""
    if ACC == tl.float32:
        kk = tl.dot(tl.zeros([C, 16], dtype=tl.float16), tl.zeros([16, C], dtype=tl.float16), kk)
    return kk


@triton.jit
def _local_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, do_ptr, x_ptr, u_ptr, a_ptr, kk_ptr, factors_ptr, decays_ptr,
    stored_w_ptr, stored_a_ptr, kd_qg_ptr, bounds_ptr, peaks_ptr, T, H, K, V,
    scale_hi, scale_lo,
    GATED: tl.constexpr, CHANNEL: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
    BV: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr, WY_PRECISION: tl.constexpr,
    PASS_PRECISION: tl.constexpr, ACC: tl.constexpr, NATIVE_GATES: tl.constexpr,
):
    """One chunk of one head: the grams A = scale (Q K^T * Gamma * M) and K K^T * Gamma * M (per-channel gates:
    given, by _channel_grams_kernel), X = (I + L)^-1 (PRECISION's products), W = X Diag(beta) Kg and U = X Diag(beta)
    V (WY_PRECISION's), in ACC; per-channel
    gates' row factors for the kernels after it (_channel_factors, read back by _channel_gate_factors); and what the
    sequential passes multiply that no state enters, stored as to_scratch makes it at their PRECISION
    (PASS_PRECISION): W, Kd = exp(G_C - G) K and Qg = scale exp(G) Q piece by piece of BKC key channels, each piece
    against its own peak, and A against its whole tile's (the peaks in ``bounds``); a gate's exp(G_C)
    (``decays``, per key channel); and the peak of each [C, BV] block of dO and of v (PEAK_DO, the bound of the
    reverse pass's and _sums_kernel's dO; PEAK_V, _sums_kernel's). W is stored only there (``stored_w``, -dW's
    later); A in ACC as well where a kernel reads it (a gate per head's dg in _gradients_kernel; the reverse pass off
    the "fp16" path)."""
    ROUNDED: tl.constexpr = PASS_PRECISION == "fp16" or PASS_PRECISION == "fp16_emulated"
    PIECES: tl.constexpr = BK // BKC
    chunk, bh, rows, valid, token, scratch_row = _chunk_rows(C, T, H)
    chunk_row = bh.to(tl.int64) * tl.num_programs(0) + chunk
    scale = _scale_in(scale_hi, scale_lo, ACC)
    beta = tl.load(beta_ptr + token, mask=valid, other=0.0).to(ACC)
    gram_offsets = scratch_row[:, None] * C + rows[None, :]
    if CHANNEL:
        kk = _gram_in_dot_layout(tl.load(kk_ptr + gram_offsets), C, ACC)
    else:
        k = _rows_of(k_ptr, token, valid, tl.arange(0, BK), K)
        gate = _chunk_gate(g_ptr, token, valid, GATED, ACC)
        decay = _pairwise_decay_of(gate, GATED, C)
        from_start, to_end, chunk_decay = _row_factors_of(gate, GATED, C, BK, ACC)
        kk = _mm(k, tl.trans(k), ACC, PRECISION) * decay
        q = _rows_of(q_ptr, token, valid, tl.arange(0, BK), K)
        A = scale * _mm(q, tl.trans(k), ACC, PRECISION) * decay
        if GATED or not ROUNDED:  # read by _gradients_kernel (a gate's dG) or, unrounded, by the reverse pass
            tl.store(a_ptr + gram_offsets, A)
        tl.store(kk_ptr + gram_offsets, kk)
        if ROUNDED:
            _store_operand(stored_a_ptr + gram_offsets, A, None, bounds_ptr + _bounds_at(chunk_row, BOUND_A, PIECES),
                           PASS_PRECISION)
        if GATED:
            tl.store(decays_ptr + chunk_row * K + tl.arange(0, BK), chunk_decay, mask=tl.arange(0, BK) < K)
    L = tl.where(rows[:, None] > rows[None, :], beta[:, None] * kk, 0.0)
    X = unit_lower_inverse(L.to(tl.float32), C, LEVELS, "tf32x3", False).to(ACC)
    if ACC == tl.float64:  # one Newton step: the fp32 inverse's error squared
        residual = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0) - X - _mm(L, X, ACC, PRECISION)
        X = _dot(X, residual, X, ACC, PRECISION)
    # After the inverse the chunk's rows are addressed from their first token and scratch row by int32 offsets
    # (_rows_from): the int64 [C] tokens and scratch rows, live across the inverse, spilled.
    in_chunk, first_token, steps, first_row = _rows_from(bh, chunk, 0, C, C, T, H)
    grams = rows[:, None] * C + rows[None, :]
    tl.store(x_ptr + first_row * C + grams, X)
    ut = X * beta[None, :]
    # Then a piece of BKC key channels at a time: per-channel gates' row factors on them, and each pass operand's
    # piece, rounded against its own peak where it is formed (the passes scale each piece's products by it:
    # _dot_pieces, _row_bounds). One bound over all K channels would wait for every piece: [C, K] fp32 tiles held
    # across the pieces spill (LOCAL_KEY_BLOCK), and forming the pieces again after the peaks made this kernel
    # slower by more than the passes gained (reports/bench.md, session 23). W is formed last: its product's
    # operands and accumulator are live while Kd's and Qg's peaks are taken otherwise, and spilled.
    for key_start in range(0, K, BKC):
        keys = key_start + tl.arange(0, BKC)
        key_ok = (keys < K)[None, :]
        key_rows = rows[:, None] * K + keys[None, :]
        paired_rows = rows[:, None] * (2 * K) + keys[None, :]  # in factors and kd_qg, [rows, 2K]
        if CHANNEL:
            from_start, to_end, chunk_decay = _channel_factors(_block_of(g_ptr, first_token, steps, in_chunk, keys, K),
                                                               C, ACC, NATIVE_GATES)
            tl.store(factors_ptr + first_row * (2 * K) + paired_rows, from_start, mask=key_ok)
            tl.store(factors_ptr + first_row * (2 * K) + K + paired_rows, to_end, mask=key_ok)
            tl.store(decays_ptr + chunk_row * K + keys, chunk_decay, mask=keys < K)
        bounds = bounds_ptr + _bounds_at(chunk_row, 0, PIECES) + key_start // BKC
        key_piece = _block_of(k_ptr, first_token, steps, in_chunk, keys, K).to(ACC)
        _store_operand(kd_qg_ptr + first_row * (2 * K) + paired_rows, key_piece * to_end, key_ok,
                       bounds + BOUND_KD * PIECES, PASS_PRECISION)
        qg_piece = _block_of(q_ptr, first_token, steps, in_chunk, keys, K).to(ACC) * scale * from_start
        _store_operand(kd_qg_ptr + first_row * (2 * K) + K + paired_rows, qg_piece, key_ok,
                       bounds + BOUND_QG * PIECES, PASS_PRECISION)
        if GATED:
            w_piece = _mm(ut, key_piece * from_start, ACC, WY_PRECISION)
        else:  # Kg = K loaded again as a 16-bit tile: _numerics.split_dot_into's two products, the same sum as three
            w_piece = _mm(ut, _block_of(k_ptr, first_token, steps, in_chunk, keys, K), ACC, WY_PRECISION)
        _store_operand(stored_w_ptr + first_row * K + key_rows, w_piece, key_ok, bounds + BOUND_W * PIECES,
                       PASS_PRECISION)
    for value_start in range(0, V, BV):
        values = value_start + tl.arange(0, BV)
        value_ok = values < V
        in_values = in_chunk[:, None] & value_ok[None, :]
        inputs = steps[:, None] * V + values[None, :]
        v = tl.load(v_ptr + first_token * V + inputs, mask=in_values, other=0.0)
        tl.store(u_ptr + first_row * V + (rows[:, None] * V + values[None, :]), _mm(ut, v, ACC, WY_PRECISION),
                 mask=value_ok[None, :])
        peaks = peaks_ptr + _peaks_at(chunk_row, value_start // BV, V, BV)
        tl.store(peaks + PEAK_V, peak(v.to(tl.float32)))
        if ROUNDED:
            do = tl.load(do_ptr + first_token * V + inputs, mask=in_values, other=0.0)
            tl.store(peaks + PEAK_DO, peak(do.to(tl.float32)))
    # Per-channel gates' A, given, is rounded last, where the fewest values are live (loaded before the inverse, it
    # added 230 bytes a thread to this kernel's spills at K = 128).
    if CHANNEL and ROUNDED:
        _store_operand(stored_a_ptr + first_row * C + grams, tl.load(a_ptr + first_row * C + grams), None,
                       bounds_ptr + _bounds_at(chunk_row, BOUND_A, PIECES), PASS_PRECISION)


@triton.jit
def _chunk_state_offsets(bh, chunk, chunks, K, V, keys, values):
    return ((bh.to(tl.int64) * chunks + chunk) * K + keys[:, None]) * V + values[None, :]


@triton.jit
def _state_tile(ptr, offsets, mask, PRESENT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """This program's [BK, BV] block of a given fp32 state (the initial state, the final state's cotangent) in ACC,
    or zeros where none is given."""
    if PRESENT:
        tile = tl.load(ptr + offsets, mask=mask, other=0.0).to(ACC)
    else:
        tile = tl.zeros([BK, BV], dtype=ACC)
    return tile


@triton.jit
def _decayed(S, decays_ptr, chunk_row, keys, K, GATED: tl.constexpr):
    """exp(G_C) S for a [BK, BV] state tile: each key channel's row times its chunk decay as _local_kernel stored it
    (a gate per head: the same in every channel); ungated S."""
    if GATED:
        S = S * tl.load(decays_ptr + chunk_row * K + keys, mask=keys < K, other=0.0)[:, None]
    return S


@triton.jit
def _states_kernel(
    stored_w_ptr, kd_qg_ptr, bounds_ptr, decays_ptr, u_ptr, s0_ptr, states_ptr, delta_ptr, delta_low_ptr, peaks_ptr,
    T, H, K, V, GATED: tl.constexpr, HAS_INITIAL: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
    BV: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):
    """The state entering every chunk and its Delta, in order: Delta = U - W S, S' = exp(G_C) S + Kd^T Delta (in
    ACC), W and Kd as _local_kernel stored them, piece by piece of BKC key channels: on the "fp16" path W S sums
    one product per piece, each scaled by its piece's bound (_dot_pieces), and Kd^T Delta scales each row by its
    piece's (_row_bounds). S and Delta are stored as to_scratch makes them against their peaks (_bound; stored in
    ``peaks``), and this pass multiplies the stored tiles (_dot_stored): each rounding, which _sums_kernel's
    products need too, made once; the peaks of S and Delta are the loop's only reductions."""
    PIECES: tl.constexpr = BK // BKC
    v_block, bh, _batch, _head, keys, values, _key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    S = _state_tile(s0_ptr, S_offsets, S_mask, HAS_INITIAL, BK, BV, ACC)
    chunks = tl.cdiv(T, C)
    for chunk in range(0, chunks):
        chunk_row = bh.to(tl.int64) * chunks + chunk
        peaks = peaks_ptr + _peaks_at(chunk_row, v_block, V, BV)
        s_bound = _bound(S, PRECISION)
        S_stored = to_scratch(S, s_bound, PRECISION)
        tl.store(states_ptr + _chunk_state_offsets(bh, chunk, chunks, K, V, keys, values), S_stored, mask=S_mask)
        _valid, _token, scratch_row = _chunk_of(chunk, bh, chunks, C, T, H)
        scratch = scratch_row[:, None] * V + values[None, :]
        u = tl.load(u_ptr + scratch, mask=value_ok[None, :], other=0.0)
        w = _key_rows(stored_w_ptr, scratch_row, keys, K, K)
        delta = u - _dot_pieces(w, bounds_ptr + _bounds_at(chunk_row, BOUND_W, PIECES), S_stored, s_bound,
                                tl.zeros([C, BV], dtype=ACC), K, BKC, ACC, PRECISION)
        delta_bound = _bound(delta, PRECISION)
        delta_stored = to_scratch(delta, delta_bound, PRECISION)
        tl.store(delta_ptr + scratch, delta_stored, mask=value_ok[None, :])
        if PRECISION == "fp16" or PRECISION == "fp16_emulated":
            tl.store(delta_low_ptr + scratch, scratch_residual(delta, delta_stored, delta_bound),
                     mask=value_ok[None, :])
            tl.store(peaks + PEAK_S, s_bound)
            tl.store(peaks + PEAK_DELTA, delta_bound)
        kd = _key_rows(kd_qg_ptr, scratch_row, keys, K, 2 * K)
        kd_bounds = _row_bounds(bounds_ptr + _bounds_at(chunk_row, BOUND_KD, PIECES), keys, K, BKC, PRECISION)
        S = _dot_stored(tl.trans(kd), kd_bounds, delta_stored, delta_bound,
                        _decayed(S, decays_ptr, chunk_row, keys, K, GATED), ACC, PRECISION)


@triton.jit
def _reverse_kernel(
    stored_w_ptr, stored_a_ptr, kd_qg_ptr, bounds_ptr, decays_ptr, do_ptr, d_final_ptr, d_states_ptr, d_delta_ptr,
    d_delta_low_ptr, d_initial_ptr, peaks_ptr, T, H, K, V,
    GATED: tl.constexpr, HAS_D_FINAL: tl.constexpr, STORE_D_INITIAL: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BKC: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):
    """The chunks backwards from dS = the final state's cotangent (or 0): store dS (the cotangent of the state
    leaving the chunk), then dDelta = A^T dO + Kd dS and dS <- exp(G_C) dS + Qg^T dO - W^T dDelta, A, Kd, Qg and W
    as _local_kernel stored them, dO rounded against the bound it stored for it. On the "fp16" path Kd dS sums one
    product per piece of BKC key channels, each scaled by its piece's bound (_dot_pieces), and Qg^T dO and W^T
    dDelta scale each row by its piece's (_row_bounds). dS and dDelta are stored as to_scratch makes them against
    their peaks (_bound; stored in ``peaks``, the scales of _sums_kernel's products with them too), and this pass
    multiplies the stored tiles: their peaks are the loop's only reductions."""
    PIECES: tl.constexpr = BK // BKC
    v_block, bh, _batch, _head, keys, values, _key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    dS = _state_tile(d_final_ptr, S_offsets, S_mask, HAS_D_FINAL, BK, BV, ACC)
    chunks = tl.cdiv(T, C)
    for i in range(0, chunks):
        chunk = chunks - 1 - i
        chunk_row = bh.to(tl.int64) * chunks + chunk
        peaks = peaks_ptr + _peaks_at(chunk_row, v_block, V, BV)
        # The chunk's scalar bounds first, beside dS's peak and store: the rounding of a product's operand waits on
        # each. Its tiles stay where they are used: issued here as well, Triton 3.6 miscompiled one of its fp16
        # products at V blocks of 32 (reports/bench.md, session 32).
        do_bound = _load_bound(peaks + PEAK_DO, PRECISION)
        a_bound = _load_bound(bounds_ptr + _bounds_at(chunk_row, BOUND_A, PIECES), PRECISION)
        ds_bound = _bound(dS, PRECISION)
        dS_stored = to_scratch(dS, ds_bound, PRECISION)
        tl.store(d_states_ptr + _chunk_state_offsets(bh, chunk, chunks, K, V, keys, values), dS_stored, mask=S_mask)
        valid, token, scratch_row = _chunk_of(chunk, bh, chunks, C, T, H)
        do = to_scratch(tl.load(do_ptr + token[:, None] * V + values[None, :], mask=valid[:, None] & value_ok[None, :],
                                other=0.0).to(ACC), do_bound, PRECISION)
        A = tl.load(stored_a_ptr + scratch_row[:, None] * C + tl.arange(0, C)[None, :])
        d_delta = _dot_stored(tl.trans(A), a_bound, do, do_bound, tl.zeros([C, BV], dtype=ACC), ACC, PRECISION)
        kd = _key_rows(kd_qg_ptr, scratch_row, keys, K, 2 * K)
        d_delta = _dot_pieces(kd, bounds_ptr + _bounds_at(chunk_row, BOUND_KD, PIECES), dS_stored, ds_bound, d_delta,
                              K, BKC, ACC, PRECISION)
        dd_bound = _bound(d_delta, PRECISION)
        d_delta_stored = to_scratch(d_delta, dd_bound, PRECISION)
        tl.store(d_delta_ptr + scratch_row[:, None] * V + values[None, :], d_delta_stored, mask=value_ok[None, :])
        if PRECISION == "fp16" or PRECISION == "fp16_emulated":
            tl.store(d_delta_low_ptr + scratch_row[:, None] * V + values[None, :],
                     scratch_residual(d_delta, d_delta_stored, dd_bound), mask=value_ok[None, :])
            tl.store(peaks + PEAK_D_S, ds_bound)
            tl.store(peaks + PEAK_D_DELTA, dd_bound)
        qg = _key_rows(kd_qg_ptr + K, scratch_row, keys, K, 2 * K)
        qg_bounds = _row_bounds(bounds_ptr + _bounds_at(chunk_row, BOUND_QG, PIECES), keys, K, BKC, PRECISION)
        dS = _dot_stored(tl.trans(qg), qg_bounds, do, do_bound, _decayed(dS, decays_ptr, chunk_row, keys, K, GATED),
                         ACC, PRECISION)
        w = _key_rows(stored_w_ptr, scratch_row, keys, K, K)
        w_bounds = _row_bounds(bounds_ptr + _bounds_at(chunk_row, BOUND_W, PIECES), keys, K, BKC, PRECISION)
        dS = _dot_stored(tl.trans(-w), w_bounds, d_delta_stored, dd_bound, dS, ACC, PRECISION)
    if STORE_D_INITIAL:
        tl.store(d_initial_ptr + S_offsets, dS, mask=S_mask)


@triton.jit
def _from_stored(x, bound, ACC: tl.constexpr, PRECISION: tl.constexpr):
    """A tile as to_scratch stored it with this bound, in ACC: on the "fp16" path unscaled (from_scratch)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return from_scratch(x, bound, PRECISION)
    else:
        return x.to(ACC)


@triton.jit
def _sums_kernel(
    v_ptr, beta_ptr, x_ptr, states_ptr, d_states_ptr, delta_ptr, d_delta_ptr, delta_low_ptr, d_delta_low_ptr, do_ptr,
    dv_ptr, key_sums_ptr, dw_ptr, value_sums_ptr, pairing_ptr, sum_bounds_ptr, peaks_ptr, T, H, K, V,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STATE_BV: tl.constexpr, PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):
    """One chunk of one head (grid (key blocks + 1, chunks, B*H)): the sums over V of the module docstring's dual,
    V block by V block, accumulated in ACC, for _gradients_kernel. A key block's program: dO S^T (= dQg), dDelta S^T
    (= -dW), Delta dS'^T (= dKd) on its BK keys, [C, BK] each, and <S, dS'> per key channel; the last program:
    dO Delta^T (dA before the mask) and dDelta V^T (dT's first term), [C, C] each, and dv = T^T dDelta. The [C, BK]
    sums are stored as to_scratch makes them against their own peaks (_store_operand; on the "fp16" path fp16, the
    peaks in ``sum_bounds``), the [C, C] ones and <S, dS'> in ACC; on the "fp16" path the [C, C] ones add the
    products with Delta's and dDelta's residuals (the module docstring).

    Every product is of stored tiles: on the "fp16" path S, dS', Delta and dDelta as the sequential passes stored
    them (fp16, scaled by their bounds) and dO and v scaled by theirs into fp16 (exact: 16-bit inputs), the bounds
    those of the sequential passes' V blocks of STATE_BV columns (BV divides STATE_BV), so that no step reduces
    over a tile (_dot_stored); X, the one fp32 operand, is rounded once, before the V loop. <S, dS'>, the one
    elementwise sum, is taken from the same stored tiles: on the "fp16" path each of S and dS' rounded once (2^-11),
    their products exact in fp32, the roundings of a product of fp16 operands; its terms accumulate elementwise, one
    reduction after the loop. (_reverse_kernel, which holds dS' unrounded, could pair it with the stored S at one
    rounding instead of two, but at 255 registers it spills 100 to 200 bytes a thread more with S's tile.)"""
    chunk = tl.program_id(1)
    bh = tl.program_id(2)
    chunks = tl.num_programs(1)
    chunk_row = bh.to(tl.int64) * chunks + chunk
    valid, token, scratch_row = _chunk_of(chunk, bh, chunks, C, T, H)
    rows = tl.arange(0, C)
    key_block = tl.program_id(0)
    if key_block < tl.cdiv(K, BK):
        keys = key_block * BK + tl.arange(0, BK)
        key_ok = keys < K
        d_qg = tl.zeros([C, BK], dtype=ACC)
        minus_dw = tl.zeros([C, BK], dtype=ACC)
        d_kd = tl.zeros([C, BK], dtype=ACC)
        pairing = tl.zeros([BV, BK], dtype=ACC)  # S^T * dS'^T, summed over the V steps
        for value_start in range(0, V, BV):
            values = value_start + tl.arange(0, BV)
            value_ok = values < V
            peaks = peaks_ptr + _peaks_at(chunk_row, value_start // STATE_BV, V, STATE_BV)
            s_bound = _load_bound(peaks + PEAK_S, PRECISION)
            S_offsets = _chunk_state_offsets(bh, chunk, chunks, K, V, keys, values)
            S_mask = key_ok[:, None] & value_ok[None, :]
            S_t = tl.trans(tl.load(states_ptr + S_offsets, mask=S_mask, other=0.0))
            scratch = scratch_row[:, None] * V + values[None, :]
            do_bound = _load_bound(peaks + PEAK_DO, PRECISION)
            do = to_scratch(tl.load(do_ptr + token[:, None] * V + values[None, :],
                                    mask=valid[:, None] & value_ok[None, :], other=0.0).to(tl.float32), do_bound,
                            PRECISION)
            d_qg = _dot_stored(do, do_bound, S_t, s_bound, d_qg, ACC, PRECISION)
            d_delta = tl.load(d_delta_ptr + scratch, mask=value_ok[None, :], other=0.0)
            minus_dw = _dot_stored(d_delta, _load_bound(peaks + PEAK_D_DELTA, PRECISION), S_t, s_bound, minus_dw,
                                   ACC, PRECISION)
            delta = tl.load(delta_ptr + scratch, mask=value_ok[None, :], other=0.0)
            dS_t = tl.trans(tl.load(d_states_ptr + S_offsets, mask=S_mask, other=0.0))
            ds_bound = _load_bound(peaks + PEAK_D_S, PRECISION)
            d_kd = _dot_stored(delta, _load_bound(peaks + PEAK_DELTA, PRECISION), dS_t, ds_bound, d_kd, ACC,
                               PRECISION)
            pairing += _from_stored(S_t, s_bound, ACC, PRECISION) * _from_stored(dS_t, ds_bound, ACC, PRECISION)
        key_sums = scratch_row[:, None] * (2 * K) + keys[None, :]
        key_blocks = tl.num_programs(0) - 1
        sum_bounds = sum_bounds_ptr + key_block
        _store_operand(key_sums_ptr + key_sums, d_qg, key_ok[None, :],
                       sum_bounds + _sum_bounds_at(chunk_row, SUM_QG, key_blocks), PRECISION)
        _store_operand(key_sums_ptr + key_sums + K, d_kd, key_ok[None, :],
                       sum_bounds + _sum_bounds_at(chunk_row, SUM_KD, key_blocks), PRECISION)
        _store_operand(dw_ptr + scratch_row[:, None] * K + keys[None, :], minus_dw, key_ok[None, :],
                       sum_bounds + _sum_bounds_at(chunk_row, SUM_W, key_blocks), PRECISION)
        tl.store(pairing_ptr + chunk_row * K + keys, tl.sum(pairing, axis=0), mask=key_ok)
    else:
        X = tl.load(x_ptr + scratch_row[:, None] * C + rows[None, :])
        x_bound = _bound(X, PRECISION)
        X_t = to_scratch(tl.trans(X), x_bound, PRECISION)
        beta = tl.load(beta_ptr + token, mask=valid, other=0.0).to(ACC)
        dA = tl.zeros([C, C], dtype=ACC)
        dT = tl.zeros([C, C], dtype=ACC)
        for value_start in range(0, V, BV):
            values = value_start + tl.arange(0, BV)
            in_values = valid[:, None] & (values < V)[None, :]
            peaks = peaks_ptr + _peaks_at(chunk_row, value_start // STATE_BV, V, STATE_BV)
            scratch = scratch_row[:, None] * V + values[None, :]
            d_delta = tl.load(d_delta_ptr + scratch, mask=(values < V)[None, :], other=0.0)
            dd_bound = _load_bound(peaks + PEAK_D_DELTA, PRECISION)
            v_bound = _load_bound(peaks + PEAK_V, PRECISION)
            v = to_scratch(tl.load(v_ptr + token[:, None] * V + values[None, :], mask=in_values,
                                   other=0.0).to(tl.float32), v_bound, PRECISION)
            dT = _dot_stored(d_delta, dd_bound, tl.trans(v), v_bound, dT, ACC, PRECISION)
            if PRECISION == "fp16" or PRECISION == "fp16_emulated":
                d_delta_low = tl.load(d_delta_low_ptr + scratch, mask=(values < V)[None, :], other=0.0)
                dT = _dot_stored(d_delta_low, dd_bound, tl.trans(v), v_bound, dT, ACC, PRECISION)
            dv = _dot_stored(X_t, x_bound, d_delta, dd_bound, tl.zeros([C, BV], dtype=ACC), ACC, PRECISION)
            dv = dv * beta[:, None]  # T^T dDelta
            tl.store(dv_ptr + token[:, None] * V + values[None, :], dv.to(dv_ptr.dtype.element_ty), mask=in_values)
            delta = tl.load(delta_ptr + scratch, mask=(values < V)[None, :], other=0.0)
            do_bound = _load_bound(peaks + PEAK_DO, PRECISION)
            do = to_scratch(tl.load(do_ptr + token[:, None] * V + values[None, :], mask=in_values,
                                    other=0.0).to(tl.float32), do_bound, PRECISION)
            delta_bound = _load_bound(peaks + PEAK_DELTA, PRECISION)
            dA = _dot_stored(do, do_bound, tl.trans(delta), delta_bound, dA, ACC, PRECISION)
            if PRECISION == "fp16" or PRECISION == "fp16_emulated":
                delta_low = tl.load(delta_low_ptr + scratch, mask=(values < V)[None, :], other=0.0)
                dA = _dot_stored(do, do_bound, tl.trans(delta_low), delta_bound, dA, ACC, PRECISION)
        value_sums = scratch_row[:, None] * (2 * C) + rows[None, :]
        tl.store(value_sums_ptr + value_sums, dA)
        tl.store(value_sums_ptr + value_sums + C, dT)


@triton.jit
def _gradients_kernel(
    q_ptr, k_ptr, beta_ptr, g_ptr, factors_ptr, decays_ptr, x_ptr, a_ptr, kk_ptr, key_sums_ptr, dw_ptr,
    value_sums_ptr, pairing_ptr, sum_bounds_ptr, dq_ptr, dk_ptr, dbeta_ptr, dg_ptr, parts_ptr, d_kk_ptr, d_a_ptr,
    T, H, K, scale_hi, scale_lo,
    GATED: tl.constexpr, CHANNEL: tl.constexpr, C: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
    ACC: tl.constexpr,
):
    """One chunk of one head: from _sums_kernel's sums, the chunk algebra of the module docstring's dual, key block
    by key block of BK channels: dT (its dW Kg^T a sum over the blocks), dX and dL, then dbeta and, with a gate per
    head or none, dq, dk and dg of the chunk's rows (per-channel gates: the row factors' parts and the grams'
    cotangents, for _channel_cotangents_kernel). Only [C, BK] tiles of the keys' side are live at once. BK is the
    sums kernel's key block, whose sums' bounds each step takes: dQg and dKd are read back in ACC (_from_stored), -dW
    enters its two products as stored (_dot_stored)."""
    scale = _scale_in(scale_hi, scale_lo, ACC)
    chunk, bh, rows, valid, token, scratch_row = _chunk_rows(C, T, H)
    chunk_row = bh.to(tl.int64) * tl.num_programs(0) + chunk
    gram_offsets = scratch_row[:, None] * C + rows[None, :]
    value_sums = scratch_row[:, None] * (2 * C) + rows[None, :]
    key_blocks = tl.cdiv(K, BK)
    beta = tl.load(beta_ptr + token, mask=valid, other=0.0).to(ACC)
    if CHANNEL:  # at 8 warps there are registers to hold X through the first key loop, which its load overlaps
        X = tl.load(x_ptr + gram_offsets)
    else:  # a gate per head (or none): the same row factors in every key block, computed once
        gate = _chunk_gate(g_ptr, token, valid, GATED, ACC)
        from_start, to_end, chunk_decay = _row_factors_of(gate, GATED, C, BK, ACC)
    dT = tl.load(value_sums_ptr + value_sums + C)  # dDelta V^T
    for key_start in range(0, K, BK):  # + dW Kg^T
        keys = key_start + tl.arange(0, BK)
        if CHANNEL:
            from_start, _to_end, _chunk_decay = _channel_gate_factors(factors_ptr, decays_ptr, scratch_row, chunk_row,
                                                                      keys, K)
        dw = -tl.load(dw_ptr + scratch_row[:, None] * K + keys[None, :], mask=(keys < K)[None, :], other=0.0)
        dw_bound = _load_bound(sum_bounds_ptr + _sum_bounds_at(chunk_row, SUM_W, key_blocks) + key_start // BK,
                               PRECISION)
        kg, kg_bound = _operand(tl.trans(_rows_of(k_ptr, token, valid, keys, K).to(ACC) * from_start), PRECISION)
        dT = _dot_stored(dw, dw_bound, kg, kg_bound, dT, ACC, PRECISION)
    if not CHANNEL:  # at 4 warps X held through the first key loop spilled (reports/bench.md, session 41)
        X = tl.load(x_ptr + gram_offsets)
    dbeta = tl.sum(dT * X, axis=0)
    # dL's two factors of X amplify their operands' rounding by X's conditioning: TF32 pairs even for "fp16".
    dL = -_mm(_mm(tl.trans(X), dT * beta[None, :], ACC, "tf32x3"), tl.trans(X), ACC, "tf32x3")
    dL = tl.where(rows[:, None] > rows[None, :], dL, 0.0)
    ut_t, ut_bound = _operand(tl.trans(X * beta[None, :]), PRECISION)  # T^T, rounded once for every key block
    kk = tl.load(kk_ptr + gram_offsets)
    dbeta += tl.sum(dL * kk, axis=1)
    tl.store(dbeta_ptr + token, dbeta.to(dbeta_ptr.dtype.element_ty), mask=valid)
    dA = tl.where(rows[:, None] >= rows[None, :], tl.load(value_sums_ptr + value_sums), 0.0)
    if GATED and not CHANNEL:  # here, not after dE and dP are formed: held across them, dL, kk and dA spilled
        pairs = beta[:, None] * dL * kk + dA * tl.load(a_ptr + gram_offsets)  # dL * L + dA * A
        dG = tl.sum(pairs, axis=1) - tl.sum(pairs, axis=0)  # the pairwise decays' parts
    if CHANNEL:  # per-channel gates' pairwise decays are in the grams and their cotangents
        decay = tl.where(rows[:, None] >= rows[None, :], 1.0, 0.0).to(ACC)
    else:  # from the chunk's G, [C] each, rather than the [C, C] tile held in registers through the first key loop
        decay = _pairwise_decay_of(gate, GATED, C)
    dE = beta[:, None] * dL * decay  # the cotangent of K K^T through L
    dE += tl.trans(dE)  # E = K K^T is symmetric
    dP = scale * dA * decay  # the cotangent of Q K^T through A
    if CHANNEL:  # the grams' cotangents go to _channel_cotangents_kernel
        tl.store(d_kk_ptr + gram_offsets, beta[:, None] * dL)
        tl.store(d_a_ptr + gram_offsets, scale * dA)
    if not CHANNEL:  # dP and dE, rounded once for every key block: each rounding a max-reduction on the "fp16" path
        dP_operand, dP_bound = _operand(dP, PRECISION)
        dE_operand, dE_bound = _operand(dE, PRECISION)
    for key_start in range(0, K, BK):
        keys = key_start + tl.arange(0, BK)
        key_ok = keys < K
        if CHANNEL:
            from_start, to_end, chunk_decay = _channel_gate_factors(factors_ptr, decays_ptr, scratch_row, chunk_row,
                                                                    keys, K)
        kf = _rows_of(k_ptr, token, valid, keys, K).to(ACC)
        qf = _rows_of(q_ptr, token, valid, keys, K).to(ACC)
        key_rows = scratch_row[:, None] * K + keys[None, :]
        key_sums = scratch_row[:, None] * (2 * K) + keys[None, :]
        sum_bounds = sum_bounds_ptr + key_start // BK
        d_kg = _product(ut_t, ut_bound, -tl.load(dw_ptr + key_rows, mask=key_ok[None, :], other=0.0),
                        _load_bound(sum_bounds + _sum_bounds_at(chunk_row, SUM_W, key_blocks), PRECISION), ACC,
                        PRECISION)
        d_kd = _from_stored(tl.load(key_sums_ptr + key_sums + K, mask=key_ok[None, :], other=0.0),
                            _load_bound(sum_bounds + _sum_bounds_at(chunk_row, SUM_KD, key_blocks), PRECISION), ACC,
                            PRECISION)
        # The row factors' parts: Qg = scale exp(G) Q, Kg = exp(G) K, Kd = exp(G_C - G) K, and G_C's (the last row's).
        d_qg = _from_stored(tl.load(key_sums_ptr + key_sums, mask=key_ok[None, :], other=0.0),
                            _load_bound(sum_bounds + _sum_bounds_at(chunk_row, SUM_QG, key_blocks), PRECISION), ACC,
                            PRECISION)
        dq_rows = scale * from_start * d_qg
        dk_rows = from_start * d_kg + to_end * d_kd
        state_pairing = tl.load(pairing_ptr + chunk_row * K + keys, mask=key_ok, other=0.0)
        if CHANNEL:
            to_end_terms = to_end * kf * d_kd
            dG_rows = qf * dq_rows + from_start * kf * d_kg - to_end_terms
            d_end = tl.sum(to_end_terms, axis=0) + chunk_decay * state_pairing  # the cotangent of G_C, per channel
            dG_rows += tl.where(rows[:, None] == C - 1, d_end[None, :], 0.0)  # rows past T carry g = 0: G_C the last
            part = scratch_row[:, None] * (3 * K) + keys[None, :]
            tl.store(parts_ptr + part, dq_rows, mask=key_ok[None, :])
            tl.store(parts_ptr + part + K, dk_rows, mask=key_ok[None, :])
            tl.store(parts_ptr + part + 2 * K, dG_rows, mask=key_ok[None, :])
        else:
            if GATED:  # the row factors' parts, each row's factor taken out of its sums over the key channels
                # Summed before the products below: held across them, q, k and the three sums ([C, BK] fp32 each)
                # spilled (reports/bench.md, session 41).
                to_end_sums = tl.sum(kf * d_kd, axis=1) * tl.reshape(to_end, [C])
                dG += (scale * tl.sum(qf * d_qg, axis=1) + tl.sum(kf * d_kg, axis=1)) * tl.reshape(from_start, [C])
                dG -= to_end_sums
                d_end = tl.sum(to_end_sums) + tl.sum(chunk_decay * state_pairing)  # G_C's, summed over the channels
                dG += tl.where(rows == C - 1, d_end, 0.0)
            in_keys = valid[:, None] & key_ok[None, :]
            k_operand, k_bound = _operand(kf, PRECISION)  # rounded once for its two products
            q_operand, q_bound = _operand(qf, PRECISION)
            dq = _dot_stored(dP_operand, dP_bound, k_operand, k_bound, dq_rows, ACC, PRECISION)
            tl.store(dq_ptr + token[:, None] * K + keys[None, :], dq.to(dq_ptr.dtype.element_ty), mask=in_keys)
            dk = _dot_stored(dE_operand, dE_bound, k_operand, k_bound, dk_rows, ACC, PRECISION)
            dk = _dot_stored(tl.trans(dP_operand), dP_bound, q_operand, q_bound, dk, ACC, PRECISION)
            tl.store(dk_ptr + token[:, None] * K + keys[None, :], dk.to(dk_ptr.dtype.element_ty), mask=in_keys)
    if GATED and not CHANNEL:
        tl.store(dg_ptr + token, tl.cumsum(dG, 0, reverse=True).to(dg_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _channel_cotangents_kernel(
    q_ptr, k_ptr, g_ptr, parts_ptr, d_kk_ptr, d_a_ptr, dq_ptr, dk_ptr, dg_ptr, T, H, K,
    C: tl.constexpr, BKC: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr, NATIVE_GATES: tl.constexpr,
):
    """dq, dk and dg of one chunk of one head with per-channel gates, from the row factors' parts (``parts``) and
    the cotangents of the two grams, d_kk (of K K^T * Gamma, strictly lower) and d_qk (of Q K^T * Gamma, with
    the scale), D_tjc = exp(G_tc - G_jc):

        dq_t += P1_t = sum_j d_qk_tj D_tj * k_j,      dk_t += P2_t + P3_t + P4_t, with
        P2_t = sum_j d_kk_tj D_tj * k_j,   P3_t = sum_i d_kk_it D_it * k_i,   P4_t = sum_i d_qk_it D_it * q_i,
        dG_t += q_t * P1_t + k_t * P2_t - k_t * (P3_t + P4_t),   dg = the reverse cumulative sum of dG.

    Block by block of SUB rows, last first (the reverse sum carries into earlier blocks), through the grams'
    anchors (_channel_grams_kernel's, _level_factors): every term a dot of a [SUB, SUB] cotangent block with decayed
    rows, every exponent <= 0. A program per slice of BKC key channels (grid (chunks, B*H, K / BKC)): the slices
    share nothing, and one slice's loop carries fewer values than the slices' loop around it did."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    NB: tl.constexpr = C // SUB
    local = tl.arange(0, SUB)
    channels = tl.program_id(2) * BKC + tl.arange(0, BKC)
    channel_ok = (channels < K)[None, :]
    later_sum = tl.zeros([BKC], dtype=ACC)  # dG summed over the blocks after this one
    for i in range(0, NB):
        B = NB - 1 - i
        valid, token, steps, scratch = _block_rows(bh, chunk, B, C, T, H)
        q = _block_of(q_ptr, token, steps, valid, channels, K).to(ACC)
        k = _block_of(k_ptr, token, steps, valid, channels, K).to(ACC)
        g = _block_of(g_ptr, token, steps, valid, channels, K)
        grams = scratch * C + (local[:, None] * C + (local + B * SUB)[None, :])
        d_qk = tl.load(d_a_ptr + grams)
        d_kk = tl.load(d_kk_ptr + grams)
        same = tl.sum(tl.where(local[:, None] == local[None, :], d_qk, 0.0), axis=1)[:, None]  # t = j
        P1 = same * k
        P2 = tl.zeros([SUB, BKC], dtype=ACC)
        P3 = tl.zeros([SUB, BKC], dtype=ACC)
        P4 = same * q
        # An operand of two products is rounded for them once (_operand): the "fp16" path's max-reductions
        # and fp16 conversions, not the one-warp [SUB, SUB] products, are most of this kernel's instructions.
        # A loop, not unrolled: unrolled, ptxas (sm_90a) spilled 156 bytes a thread at K = 128, and the kernel
        # took 4% longer at the bench shape (reports/bench.md, session 34).
        for level in range(SUB_LEVELS):
            later, factor, pair = _level_factors(g, level, ACC, NATIVE_GATES)
            pair_qk, qk_bound = _operand(tl.where(pair, d_qk, 0.0), PRECISION)
            pair_kk, kk_bound = _operand(tl.where(pair, d_kk, 0.0), PRECISION)
            earlier_k, earlier_bound = _operand(tl.where(later[:, None], 0.0, k * factor), PRECISION)
            to_later = tl.where(later[:, None], factor, 0.0)
            P1 += to_later * _product(pair_qk, qk_bound, earlier_k, earlier_bound, ACC, PRECISION)
            P2 += to_later * _product(pair_kk, kk_bound, earlier_k, earlier_bound, ACC, PRECISION)
            from_earlier = tl.where(later[:, None], 0.0, factor)
            later_k, later_bound = _operand(tl.where(later[:, None], k * factor, 0.0), PRECISION)
            P3 += from_earlier * _product(tl.trans(pair_kk), kk_bound, later_k, later_bound, ACC, PRECISION)
            later_q, later_bound = _operand(tl.where(later[:, None], q * factor, 0.0), PRECISION)
            P4 += from_earlier * _product(tl.trans(pair_qk), qk_bound, later_q, later_bound, ACC, PRECISION)
        # The anchor factors of this block, the same for every pair it enters: exp(G_t - G_a) as the later
        # block (a its first row), the exponents to its end as the earlier one.
        to_t = _to_anchor(g, ACC, NATIVE_GATES)
        within = _from_block_end(g, ACC, NATIVE_GATES)
        # The steps after key block J up to this block's anchor (its first row), carried from block to block
        # down the J loop (the last key block first): the anchor's own step, then each key block's whole sum.
        between = _first_row(g, ACC)
        for step in range(0, B):  # key blocks before this one: P1, P2
            J = B - 1 - step
            valid_J, token_J, steps_J, _ = _block_rows(bh, chunk, J, C, T, H)
            g_J = _block_of(g_ptr, token_J, steps_J, valid_J, channels, K)
            from_j = tl.exp(_from_block_end(g_J, ACC, NATIVE_GATES) + between[None, :])
            k_J, k_bound = _operand(_block_of(k_ptr, token_J, steps_J, valid_J, channels, K).to(ACC) * from_j,
                                    PRECISION)
            blocks = scratch * C + (local[:, None] * C + (local + J * SUB)[None, :])
            d_qk_J, qk_bound = _operand(tl.load(d_a_ptr + blocks), PRECISION)
            P1 += to_t * _product(d_qk_J, qk_bound, k_J, k_bound, ACC, PRECISION)
            d_kk_J, kk_bound = _operand(tl.load(d_kk_ptr + blocks), PRECISION)
            P2 += to_t * _product(d_kk_J, kk_bound, k_J, k_bound, ACC, PRECISION)
            between += tl.sum(g_J.to(ACC), axis=0)
        between = tl.zeros([BKC], dtype=ACC)  # the steps of the query blocks between this one and block I
        for I in range(B + 1, NB):  # query blocks after this one: P3, P4
            valid_I, token_I, steps_I, scratch_I = _block_rows(bh, chunk, I, C, T, H)
            g_I = _block_of(g_ptr, token_I, steps_I, valid_I, channels, K)
            to_I = _to_anchor(g_I, ACC, NATIVE_GATES)
            from_j = tl.exp(within + (between + _first_row(g_I, ACC))[None, :])
            blocks = scratch_I * C + (local[:, None] * C + (local + B * SUB)[None, :])
            P3 += from_j * _mm(tl.trans(tl.load(d_kk_ptr + blocks)),
                               _block_of(k_ptr, token_I, steps_I, valid_I, channels, K).to(ACC) * to_I, ACC, PRECISION)
            P4 += from_j * _mm(tl.trans(tl.load(d_a_ptr + blocks)),
                               _block_of(q_ptr, token_I, steps_I, valid_I, channels, K).to(ACC) * to_I, ACC, PRECISION)
            between += tl.sum(g_I.to(ACC), axis=0)
        parts = parts_ptr + scratch * (3 * K) + (local[:, None] * (3 * K) + channels[None, :])
        dq = tl.load(parts, mask=channel_ok, other=0.0) + P1
        dk = tl.load(parts + K, mask=channel_ok, other=0.0) + P2 + P3 + P4
        dG = tl.load(parts + 2 * K, mask=channel_ok, other=0.0) + q * P1 + k * (P2 - P3 - P4)
        dg = tl.cumsum(dG, 0, reverse=True) + later_sum[None, :]
        later_sum += tl.sum(dG, axis=0)
        out = token * K + (steps[:, None] * K + channels[None, :])
        in_block = valid[:, None] & channel_ok
        tl.store(dq_ptr + out, dq.to(dq_ptr.dtype.element_ty), mask=in_block)
        tl.store(dk_ptr + out, dk.to(dk_ptr.dtype.element_ty), mask=in_block)
        tl.store(dg_ptr + out, dg.to(dg_ptr.dtype.element_ty), mask=in_block)


def products_precision(dtype: torch.dtype, K: int, V: int, positions: int) -> str:
    """PRECISION of the sequential passes', the sums kernel's and the gradients kernel's dots for inputs of
    ``dtype``, head dims K, V and ``positions`` = B * H * T (the module docstring): "fp16" for bf16 inputs with at
    least FP16_PRODUCTS_MIN_CHANNELS key and value channels and FP16_PRODUCTS_MIN_POSITIONS positions, "tf32x3" for
    narrower or smaller bf16 problems and for fp16 (whose own floor "fp16" would reach), fp32 inputs fp64 whatever
    it says; the interpreter's emulation of "fp16" under it (_numerics.dot_precision)."""
    fp16 = (dtype == torch.bfloat16 and min(K, V) >= FP16_PRODUCTS_MIN_CHANNELS
            and positions >= FP16_PRODUCTS_MIN_POSITIONS)
    return dot_precision("fp16" if fp16 else "tf32x3")


def wy_precision(dtype: torch.dtype, K: int, V: int) -> str:
    """PRECISION of the local kernel's W = T Kg and U = T V for inputs of ``dtype`` and head dims K, V: the forward's
    own choice for them (kernels/_delta.py), "split" for bf16 inputs (bf16 hi/lo parts of T, about 2^-16;
    "split_emulated" under the interpreter, whose bf16 arithmetic is rounded by integers) where the local kernel's key
    pieces and V blocks are at least SPLIT_MIN_TILE wide; "tf32x3" (about 2^-22) for narrower bf16 heads and for
    fp16 inputs ("split" would sit near their own floor); fp32 inputs' products are fp64 whatever it says."""
    _, BK, BV, _, _ = tiles(K, V)
    if dtype != torch.bfloat16 or min(BK, LOCAL_KEY_BLOCK, BV) < SPLIT_MIN_TILE:
        return "tf32x3"
    return "split_emulated" if interpreter_active() else "split"


def tiles(K: int, V: int) -> tuple[int, int, int, int, int]:
    """(C, BK, BV of the sequential passes and the local kernel, BK and BV of the sums kernel) for head dims K, V.
    The sums kernel's BV divides the sequential passes' (whose blocks' bounds it takes); its BK is also the gradients
    kernel's (whose steps take the sums' bounds key block by key block).

    The chunk is the backward's own (CHUNK)."""
    BK = block_size(K)
    BV = min(block_size(V), max(16, STATE_TILE // BK))
    return (CHUNK // 2 if BK > 128 else CHUNK), BK, BV, min(BK, SUMS_KEY_BLOCK), min(BV, SUMS_BV)


def chunkwise_backward(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None, scale: float,
    state: tuple[torch.Tensor] | None, do: torch.Tensor, d_state: tuple[torch.Tensor] | None,
    grad_dtype: torch.dtype | None = None, **forward_options,
) -> dict[str, torch.Tensor | tuple[torch.Tensor]]:
    """Gradients of q, k, v, beta, g (gated only) in their dtypes (or ``grad_dtype``: tools/bf16_on_cpu.py takes
    fp32, to round them once to bf16 as the GPU writes them) and, with an initial state, "initial_state" in fp32, by
    the launches of the module docstring. g None is DeltaNet, g [B, T, H] Gated DeltaNet, g [B, T, H, K] kda
    (per-channel gates). ``do`` may be of any float dtype: the kernels read it in ACC. The forward's options (its
    chunk size, the state pass's precision and tiles) do not apply: the backward takes its own tiles
    (:func:`tiles`)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    C, BK, BV, key_block, sums_BV = tiles(K, V)
    channel = g is not None and g.dim() == 4
    chunks = triton.cdiv(T, C)
    fp64 = q.dtype == torch.float32  # the module docstring: fp32 inputs are differentiated in fp64
    acc = dict(dtype=torch.float64 if fp64 else torch.float32, device=q.device)
    precision = products_precision(q.dtype, K, V, B * H * T)
    # The sequential passes' operands as to_scratch stores them: fp16 on the "fp16" path, each tile against its
    # bound (``peaks``: S, dS', Delta, dDelta of each (chunk, V block), their outputs; ``bounds``: W, Kd, Qg of each
    # chunk and piece of key channels, and A of each chunk, the local kernel's), else ACC.
    rounded = precision in ("fp16", "fp16_emulated")
    piece_keys = min(BK, LOCAL_KEY_BLOCK)  # key channels of a piece
    stored = dict(acc, dtype=torch.float16) if rounded else acc
    X = torch.empty((B * H * chunks * C, C), **acc)
    A, kk = torch.empty_like(X), torch.empty_like(X)
    # W for the passes, then -dW (_sums_kernel: the passes read W before it overwrites it), each as to_scratch stores
    # it; A rounded for the passes beside its own ACC tile (which a gate per head's dg reads), unrounded that tile.
    w = torch.empty((B * H * chunks * C, K), **stored)
    u = torch.empty((B * H * chunks * C, V), **acc)
    stored_a = torch.empty((B * H * chunks * C, C), **stored) if rounded else A
    kd_qg = torch.empty((B * H * chunks * C, 2 * K), **stored)
    bounds = torch.empty((B * H * chunks, BOUNDS.value * (BK // piece_keys)), dtype=torch.float32, device=q.device)
    delta = torch.empty((B * H * chunks * C, V), **stored)
    states = torch.empty((B * H, chunks, K, V), **stored)
    d_states = torch.empty_like(states)
    d_delta = torch.empty_like(delta)
    # On the "fp16" path what rounding Delta and dDelta left (_numerics.scratch_residual), for _sums_kernel's [C, C]
    # sums; unused pointers otherwise.
    delta_low, d_delta_low = (torch.empty_like(delta), torch.empty_like(delta)) if rounded else (delta, delta)
    peaks = torch.empty((B * H * chunks * triton.cdiv(V, BV), PEAKS.value), dtype=torch.float32, device=q.device)
    dq, dk, dv, dbeta = (torch.empty_like(x, dtype=grad_dtype) for x in (q, k, v, beta))
    dg = torch.empty_like(g, dtype=grad_dtype) if g is not None else None
    d_initial = torch.empty((B, H, K, V), **acc) if state is not None else None
    gate = g if g is not None else beta  # an unused pointer when ungated
    scale_hi = float(torch.tensor(scale, dtype=torch.float32))
    scale_lo = float(scale) - scale_hi
    ACC = tl.float64 if fp64 else tl.float32
    stages = {name: 1 if fp64 else NUM_STAGES.get(name, 1)
              for name in ("local", "states", "reverse", "sums", "gradients", "channel")}
    common = dict(GATED=g is not None, CHANNEL=channel, C=C, BK=BK, ACC=ACC, num_warps=NUM_WARPS)
    if channel:
        parts = torch.empty((B * H * chunks * C, 3 * K), **acc)  # the row factors' parts of dq, dk, dG
        d_kk, d_a = torch.empty_like(X), torch.empty_like(X)
        factors = torch.empty((B * H * chunks * C, 2 * K), **acc)  # exp(G_t), exp(G_C - G_t)
        channel_slice = dict(BKC=min(BK, CHANNEL_SLICE), ACC=ACC, NATIVE_GATES=native_gates(g.dtype),
                             num_warps=CHANNEL_NUM_WARPS, num_stages=stages["channel"])
        _channel_grams_kernel[(chunks, B * H)](q, k, g, A, kk, T, H, K, scale_hi, scale_lo, C=C, BK=BK,
                                               PRECISION="tf32x3", **channel_slice)
    else:
        parts, d_kk, d_a, factors = X, X, X, X  # unused pointers
    decays = torch.empty((B * H * chunks, K), **acc) if g is not None else X  # exp(G_C) per key channel
    _local_kernel[(chunks, B * H)](q, k, v, beta, gate, do, X, u, A, kk, factors, decays, w, stored_a, kd_qg,
                                   bounds, peaks, T, H, K, V, scale_hi, scale_lo,
                                   BKC=piece_keys, BV=BV, LEVELS=(C // SUB.value).bit_length() - 1,
                                   PRECISION="tf32x3", WY_PRECISION=wy_precision(q.dtype, K, V),
                                   PASS_PRECISION=precision,
                                   NATIVE_GATES=native_gates(gate.dtype) and piece_keys >= NATIVE_SPAN_KEYS,
                                   num_stages=stages["local"], **common)
    common["PRECISION"] = precision
    passes = {n: value for n, value in common.items() if n != "CHANNEL"}  # they read no row factors
    _states_kernel[(triton.cdiv(V, BV), B * H)](
        w, kd_qg, bounds, decays, u, state[0] if state is not None else w, states, delta, delta_low, peaks, T, H, K, V,
        HAS_INITIAL=state is not None, BKC=piece_keys, BV=BV, num_stages=stages["states"], **passes)
    _reverse_kernel[(triton.cdiv(V, BV), B * H)](
        w, stored_a, kd_qg, bounds, decays, do, d_state[0] if d_state is not None else w, d_states, d_delta,
        d_delta_low, d_initial if d_initial is not None else w, peaks, T, H, K, V, HAS_D_FINAL=d_state is not None,
        STORE_D_INITIAL=d_initial is not None, BKC=piece_keys, BV=BV, num_stages=stages["reverse"], **passes)
    # The sums over V: dQg and dKd beside each other and -dW in W's buffer (no kernel reads W after the reverse pass),
    # as to_scratch stores them (fp16 on the "fp16" path, against their peaks in ``sum_bounds``); dA and dDelta V^T
    # beside each other and <S, dS'> per chunk and key channel in ACC.
    key_sums = torch.empty((B * H * chunks * C, 2 * K), **stored)
    value_sums = torch.empty((B * H * chunks * C, 2 * C), **acc)
    pairing = torch.empty((B * H * chunks, K), **acc)
    key_blocks = triton.cdiv(K, key_block)
    sum_bounds = (torch.empty((B * H * chunks, SUM_BOUNDS.value * key_blocks), dtype=torch.float32, device=q.device)
                  if rounded else peaks)  # an unused pointer off the "fp16" path
    _sums_kernel[(key_blocks + 1, chunks, B * H)](
        v, beta, X, states, d_states, delta, d_delta, delta_low, d_delta_low, do, dv, key_sums, w, value_sums, pairing,
        sum_bounds, peaks,
        T, H, K, V, C=C,
        BK=key_block, BV=sums_BV, STATE_BV=BV, PRECISION=precision, ACC=ACC, num_warps=SUMS_NUM_WARPS,
        num_stages=stages["sums"])
    _gradients_kernel[(chunks, B * H)](
        q, k, beta, gate, factors, decays, X, A, kk, key_sums, w, value_sums, pairing, sum_bounds, dq, dk, dbeta,
        dg if dg is not None else dbeta, parts, d_kk, d_a, T, H, K, scale_hi, scale_lo,
        num_stages=stages["gradients"],
        **common | dict(BK=key_block, num_warps=CHANNEL_GRADIENTS_NUM_WARPS if channel else GRADIENTS_NUM_WARPS))
    if channel:
        _channel_cotangents_kernel[(chunks, B * H, triton.cdiv(K, channel_slice["BKC"]))](
            q, k, g, parts, d_kk, d_a, dq, dk, dg, T, H, K, C=C, PRECISION=common["PRECISION"], **channel_slice)
    grads: dict[str, torch.Tensor | tuple[torch.Tensor]] = {"q": dq, "k": dk, "v": dv, "beta": dbeta}
    if dg is not None:
        grads["g"] = dg
    if d_initial is not None:
        grads["initial_state"] = (d_initial.float(),)
    return grads
