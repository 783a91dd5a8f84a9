"""kda (Kimi Delta Attention, FORMULATIONS.md 10): chunkwise and recurrent Triton kernels.

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

q, k, g are [B, T, H, K], v and o [B, T, H, V], beta [B, T, H], the state S
[B, H, K, V] in fp32; g holds per-key-channel log gates (<= 0), so exp(g_t)
scales the rows of S. Inputs are fp16, bf16 or fp32 (one dtype); o comes back
in that dtype. Everything inside is fp32 (gates, cumulative gates, the UT
inverse, every intermediate block, the scratch between kernels, the carried
state); how fp32 operands enter the tensor-core dots is the ``precision``
option.

Chunkwise form: seed 000's UT transform with the per-channel gates folded in,
exactly oracles/_chunks.py's ``delta_chunk``. For one chunk of C positions
with chunk-local cumulative gates G [C, K] (G_t = sum_{s<=t} g_s):

    A_kk[t, j] = sum_c k_tc k_jc exp(G_tc - G_jc)              (t > j)
    A_qk[t, j] = scale sum_c q_tc k_jc exp(G_tc - G_jc)        (t >= j)
    L = Diag(beta) A_kk,   T = (I + L)^-1 Diag(beta)           (fp32, never rounded)
    W = T (K * exp(G)),  U = T V,  Qg = scale Q * exp(G),  Kd = K * exp(G_C - G)
    Delta = U - W S
    O = Qg S + A_qk Delta
    S_next = exp(G_C) * S (rows) + Kd^T Delta

Four launches. The first three need no carried state and run all chunks in
parallel, each at the warp count its tiles want, writing scratch rows
([B*H, chunks*C, *], the last chunk padded):

1. ``_kda_a_rows_kernel``, grid (chunks * C/16, B*H): one 16-row block row of
   A_kk and A_qk per program. The pairwise decay exp(G_t - G_j) does not
   factor out of a dot as a whole; for the block's query rows starting at row
   r, the key rows j of each earlier block J are paired through the anchor r:
   exp(G_t - G_r) exp(G_r - G_j), both exponents <= 0 because j < r <= t, one
   [16, BKC] x [BKC, 16] dot per block J. The anchor is the block's FIRST row,
   so it is never later than the query it serves (no future row enters, also
   in a partial trailing block). The diagonal 16 x 16 block uses the same
   anchors by halving: at level h (8, 4, 2, 1) each group of 2h rows pairs its
   later half with its earlier half through the later half's first row, so
   every pair t > j is formed once, by one dot per level. A_qk's diagonal
   t = j is sum_c q_tc k_tc. Small [16, 16] products hold whole operands in
   every warp, so this kernel runs one warp a program.
2. ``_kda_ut_inverse_kernel``, grid (chunks, B*H): T from A_kk by block
   forward substitution, fp32, its products at _state_pass.inverse_precision
   (bf16 hi/lo parts of the fp32 operands for "fp16": T's conditioning
   amplifies an operand rounded to fp16 to 16 times bf16's floor on beta = 2
   with nearly parallel keys).
3. ``_kda_chunk_operands_kernel``, grid (chunks, B*H): W, U, Qg, Kd, exp(G_C)
   and per-chunk bounds on |W|, |Qg|, |Kd|, |A_qk| for the state pass; W and
   U multiply T as _state_pass.wy_precision says (its bf16 hi/lo parts for
   "fp16", as the delta rules' prepare kernel does).
4. The state pass (kernels/_state_pass.py, shared with the delta rules), grid
   (V blocks, B*H), sequential over chunks: four dots a chunk and no exp or
   cumsum (all gate work is in kernels 1 and 3), the output fused in.

Every exponent evaluated is <= 0 (cross-time factors exp(G_t - G_j) with
t >= j, exp(G) and exp(G_C - G)); entries that would have a positive exponent
are masked to -inf first, so strong decays (-20 per step and beyond) only
underflow to 0. Each exponent is summed over just the steps it spans, as a
product span @ g of a 0/1 matrix with the gates (``span_sums``: one
tensor-core dot in the gates' own 16-bit dtype, exact products and fp32 sums
of same-signed terms; fp32 on CUDA cores for fp32 gates and under the
interpreter), never taken as a difference of two cumulative sums: its
rounding error is then relative to itself, whereas a difference of
cumulative sums loses about u * |G| to cancellation, which strong gates make
large.

OPTIONS (chunkwise):
- ``chunk_size`` ("auto"; 16, 32 or 64): C, a multiple of the 16-row block.
  "auto" (``auto_chunk_size``) is 16 where the state pass's programs
  (B*H*ceil(V/block_v)) fill at least 2/3 of the GPU's SMs, else 64 (and 64
  off the GPU). Smaller chunks shrink the parallel kernels' work (fewer
  off-diagonal A blocks, a smaller UT inverse, [C, C] products) but give the
  sequential state pass more steps, which only pays while its programs keep
  the SMs busy.
- ``precision`` ("auto"): how the fp32 x fp32 dots run
  (``_numerics.scaled_dot``). "auto" is "fp16" for bf16 inputs (narrow heads:
  "bf16x3", below), "bf16x3" for fp16 inputs and "ieee" for fp32 inputs.
  "fp16" scales each operand tile by a power of two (exact) so that a bound on
  its magnitude lands in [2^13, 2^14), rounds it to fp16 and does one fp16
  tensor-core product: 2^-11 relative per operand (down to 2^-27 of the
  bound), 4x below bf16's output rounding, at the cost of one bf16 product.
  The bound is the tile's own peak (a max-reduction across the warps) only
  where nothing cheaper bounds it: the A blocks' and W's operands are q or k
  times decays <= 1 (the peaks of |q| and |k| bound them); the state pass's W,
  Qg and Kd are stored already scaled and rounded to fp16 by kernel 3 (the
  rounding their products would do anyway, at half the bytes), with their
  bounds and A_qk's per chunk, so the state pass reduces only S and Delta,
  once a chunk each. For fp16 inputs "fp16" would sit at their
  own floor, so they keep "bf16x3" (each fp32 operand split into bf16 hi +
  lo, three bf16 products, about 2^-16 relative per product). "tf32x3"
  (three TF32 products, about 2^-21) costs twice "bf16x3" on tensor cores;
  "tf32" (2^-11) is faster but costs accuracy (fp16 especially); "bf16"
  rounds both operands to bf16 and does one product, fla's own choice, at
  about fla's accuracy and no faster than "fp16", so kda offers no speed
  setting; "ieee" is exact fp32 on CUDA cores (slow). The Triton interpreter
  computes every fp32 dot exactly whatever is asked (its builder does not
  know "bf16x3", which is passed to it as "ieee"); "bf16" and "fp16" are
  emulated there by rounding the operands and multiplying them exactly.
  Known defect of "fp16": on the property suite's case K = V = 1, no decay,
  nearly parallel keys, T = 65, its excess is over the bf16 bound, where
  "bf16x3" and "ieee" are exact (properties/regressions.py; a strict xfail
  in tests/kernels/test_kda.py). So "auto" takes "bf16x3" for bf16 heads
  of fewer than 16 key or value channels (_state_pass.FP16_MIN_CHANNELS).
  On beta = 2 with nearly parallel keys and no decay (K = 27, V = 99, T =
  429) the UT inverse's products at the state pass's "fp16" took the output
  to 16 times bf16's floor; they multiply bf16 hi/lo parts instead (kernel 2
  above; 3.0 there, the delta rules' 3.2; reports/bench.md, session 40).
- ``block_v`` (64; 16, 32, 64 or 128): V columns per program of the state
  pass; each program reads its chunk's W, Qg and Kd once for all its columns,
  so wider blocks read them fewer times.
- ``num_warps`` (4) and ``num_stages`` ("auto") of the state pass
  (kernels/_state_pass.py: ``resolve_state_pass``).

Scratch traffic: W, U, Qg, Kd are [B*H, T, K or V] each, A_qk, A_kk and T
[B*H, T, C]; all fp32 but W, Qg, Kd, which are fp16 with "fp16" dots.

Recurrent form (``_kda_recurrent_kernel``): one program per (B*H, V block),
the literal recurrence token by token with the fp32 state in registers.
OPTIONS: ``block_v`` (32), ``num_warps`` (4).

Recurrent backward (``BACKWARD["recurrent"]``; the chunkwise form's,
``BACKWARD["chunkwise"]``, is kernels/_delta_chunk_backward.py's, shared with
the delta rules). Write step t as D_t = exp(g_t), the decayed state S'_t = D_t * S_{t-1}
(rows), the write u_t = beta_t (v_t - S'_t^T k_t), S_t = S'_t + k_t u_t^T.
With dS_T the final state's cotangent (0 where no loss reads it), for
t = T .. 1 the dual recurrence is

    dS_t  += scale q_t do_t^T,              dq_t = scale S_t do_t
    du_t   = dS_t^T k_t,                    dv_t = beta_t du_t
    dbeta_t = du_t . (v_t - S'_t^T k_t),    dk_t = dS_t u_t - beta_t S'_t du_t
    dS'_t  = (I - beta_t k_t k_t^T) dS_t
    dg_t   = sum_v S'_t * dS'_t  (one sum per key channel)
    dS_{t-1} = D_t * dS'_t

and dS_0 is the initial state's gradient. Each step's gate gradient is its
own sum of products of the step's decayed state and cotangent: no reverse
cumulative sum of q dq - k dk, which would be the same number as a
difference. Every exponent is a single step's g_t <= 0. The reflection
beta near 2 is taken as the forward takes it: fp32 throughout.

Saved vs recomputed: the dual walks backwards and needs S_{t-1} (and S_t)
in reverse order. Keeping every state is B H T K V floats (34 GB in fp32 at
the bench shape), and (I - beta k k^T) cannot be undone (singular at
beta = 1), so the forward, given ``saved``, stores only the state entering
every RECURRENT_SEGMENT = 64th step ("checkpoints", B H K V T / 64 fp32).
The backward walks the segments from the last: it replays one segment from
its checkpoint (the forward's exact fp32 operations) into a per-program
scratch of 64 states, then runs the dual backwards through it, carrying
S_t in registers from the step after. The replay doubles the state
arithmetic and rereads k, v, g, beta; o is not used. The V columns are
independent in both recurrences, so programs split V as the forward does
(B H ceil(V / BV) programs): dv is complete in each, while dq, dk, dg and
dbeta sum over V and each V block writes an fp32 part, added on the host.
BV is block_v, capped so that BK * BV <= 2048 (at least 16), for four live
fp32 tiles (S_t, S_{t-1}, S'_t, dS). Speed risks for a GPU run to check:
the per-program scratch (64 BK BV fp32 in global memory, 0.5 GB at the
bench shape, as much as the checkpoints; it is read back right after being
written, from L2 at best), register spills at BK = 256, the host sums of
the V parts, and the program count (1024 at the bench shape, BV = 16).

Measurements behind these choices (timings, registers, the designs tried):
reports/bench.md, "Design history moved from the kernel docstrings".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from attnlab.kernels import _delta_chunk_backward, _state_pass
from attnlab.kernels._numerics import (
    native_gates, peak, scaled_dot, scaled_dot_within, span_sums, split_dot, to_scratch,
)
from attnlab.kernels._state_pass import (
    StateOperands, bind_state_pass, inverse_precision, resolve_state_pass, store_u, value_block, wy_precision,
)
from attnlab.kernels._util import (
    Launch, block_size, launch_after_checks, no_pending_checks, state_block, zero_state,
)
from attnlab.runtime import interpreter_active

SUB_CHUNK = 16
# Launch shapes of the parallel kernels, each the fastest measured at the bench shape (reports/bench.md). The A rows
# kernel's [16, 16] products hold whole [16, slice] operands in every warp: one warp a program, 16 channels a slice
# keep them in registers.
A_ROWS_CHANNEL_SLICE = 16
A_ROWS_NUM_WARPS = 1
UT_INVERSE_NUM_WARPS = 1
# Key or value channels per W, U, Qg, Kd block of the operands kernel, whatever K and V (masked past them): T's bf16
# parts multiplied with [C, 32] or [C, 16] tiles gave wrong outputs on the GPU in the delta rules' prepare kernel
# (kernels/_delta.py, PREPARE_OUTPUT_BLOCK), at 64 they are right.
INTRA_OUTPUT_BLOCK = 64
OPERANDS_NUM_WARPS = 2

OPTIONS = {
    "chunkwise": {
        "chunk_size": ("auto", ("auto", 16, 32, 64)),
        **_state_pass.OPTIONS,
    },
    "recurrent": {
        "block_v": (32, (16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
    },
}


def _check_choice(form: str, name: str, value: object) -> None:
    choices = OPTIONS[form][name][1]
    if value not in choices:
        raise ValueError(f"kda {form}: {name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


# ---------------------------------------------------------------------------
# Chunkwise, kernels 1-3 (parallel over chunks): everything that does not need the carried state
# ---------------------------------------------------------------------------


@triton.jit
def _kda_a_rows_kernel(
    q_ptr, k_ptr, g_ptr, akk_ptr, aqk_ptr,
    T, H, K, scale,
    C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
    PRECISION: tl.constexpr, NATIVE_GATES: tl.constexpr,
):
    """One block row of a chunk's A_kk (t > j) and A_qk (t >= j) per program: the query rows
    t = r .. r+SUB-1 of block I (r = I*SUB) against the key rows j <= t, summed over key channels
    in slices of BKC (the decays are per channel):

      A_kk[t, j] = sum_c k_tc k_jc exp(G_tc - G_jc),   A_qk[t, j] = scale sum_c q_tc k_jc exp(G_tc - G_jc)

    Left of the diagonal, block J < I, one [SUB, BKC] x [BKC, SUB] dot through the anchor r:
    (k_t exp(G_t - G_r)) . (k_j exp(G_r - G_j)), both exponents <= 0 because j < r <= t; the anchor
    is the block's FIRST row, so no future row enters, also in a partial trailing block. G_r - G_j
    is the steps of block J after j plus those from J's end to r, both sums of same-signed gates.
    The diagonal block by halving: at level h every group of 2h rows pairs its later half (t >= a)
    with its earlier half (j < a) through the anchor a, the later half's first row, so each pair
    t > j is formed once, by one dot per level; A_qk's t = j is sum_c q_tc k_tc. Rows past T read
    as 0 (g = 0 adds no decay). Both block rows go to [rows, C] scratch (A_qk times scale): A_qk
    with 0 right of the diagonal block (the state pass reads whole rows), A_kk without (the UT
    inverse reads no further than the diagonal block).
    """
    sub_chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    NC: tl.constexpr = C // SUB
    LOG_SUB: tl.constexpr = 4  # halving levels of a SUB = 16 row block
    chunk = sub_chunk // NC
    I = sub_chunk % NC
    r = I * SUB

    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    local = tl.arange(0, SUB)
    slice_channels = tl.arange(0, BKC)
    block_positions = chunk * C + r + local
    block_ok = block_positions < T
    block_token = (b * T + block_positions).to(tl.int64) * H + h  # index of (b, t, h) in [B, T, H]
    chunk_ok = chunk * C + rows < T
    chunk_token = (b * T + chunk * C + rows).to(tl.int64) * H + h
    scratch_rows = bh.to(tl.int64) * tl.num_programs(0) * SUB + sub_chunk * SUB + local

    # The diagonal block by halving.
    akk_diag = tl.zeros((SUB, SUB), dtype=tl.float32)
    aqk_diag = tl.zeros((SUB, SUB), dtype=tl.float32)
    for channel_start in range(0, BK, BKC):
        channels = channel_start + slice_channels
        ptrs = block_token[:, None] * K + channels[None, :]
        mask = block_ok[:, None] & (channels < K)[None, :]
        q = tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        g16 = tl.load(g_ptr + ptrs, mask=mask, other=0.0)  # input dtype, for _span_sums
        # Every operand below is q or k times decays <= 1: the peaks of q and k bound them.
        q_peak = peak(q)
        k_peak = peak(k)
        for level in tl.static_range(LOG_SUB):
            half = SUB >> (level + 1)
            anchor = (local // (2 * half)) * (2 * half) + half
            later_half = local >= anchor
            # Exponents G_t - G_a (t >= a) and G_a - G_j (j < a): sums of the steps spanned.
            span = tl.where(later_half[:, None],
                            (anchor[:, None] < local[None, :]) & (local[None, :] <= local[:, None]),
                            (local[:, None] < local[None, :]) & (local[None, :] <= anchor[:, None]))
            decay = tl.exp(span_sums(span, g16, NATIVE_GATES))
            keys = tl.trans(tl.where(later_half[:, None], 0.0, k * decay))  # [BKC, SUB], rows j < a
            pair = ((local[:, None] // (2 * half)) == (local[None, :] // (2 * half))) & later_half[:, None]
            later_k = tl.where(later_half[:, None], k * decay, 0.0)
            later_q = tl.where(later_half[:, None], q * decay, 0.0)
            akk_diag += tl.where(pair, scaled_dot_within(later_k, k_peak, keys, k_peak, PRECISION), 0.0)
            aqk_diag += tl.where(pair, scaled_dot_within(later_q, q_peak, keys, k_peak, PRECISION), 0.0)
        aqk_diag += tl.where(local[:, None] == local[None, :], tl.sum(q * k, axis=1)[:, None], 0.0)
    row_ptrs = scratch_rows[:, None] * C
    tl.store(akk_ptr + row_ptrs + (r + local)[None, :], akk_diag)
    tl.store(aqk_ptr + row_ptrs + (r + local)[None, :], aqk_diag * scale)
    tl.store(aqk_ptr + row_ptrs + cols[None, :], tl.zeros((SUB, C), dtype=tl.float32), mask=(cols >= r + SUB)[None, :])

    # The blocks J < I left of it, through the anchor r.
    within_block = local[:, None] < local[None, :]  # steps j < s <= SUB-1 of block J
    to_anchor_span = (local[None, :] > 0) & (local[None, :] <= local[:, None])  # steps r < s <= t
    for J in range(0, I):
        after_block = (rows >= (J + 1) * SUB) & (rows <= r)  # steps from block J's end to r
        key_positions = chunk * C + J * SUB + local
        key_token = (b * T + key_positions).to(tl.int64) * H + h
        akk_block = tl.zeros((SUB, SUB), dtype=tl.float32)
        aqk_block = tl.zeros((SUB, SUB), dtype=tl.float32)
        for channel_start in range(0, BK, BKC):
            channels = channel_start + slice_channels
            channel_ok = channels < K
            ptrs = block_token[:, None] * K + channels[None, :]
            mask = block_ok[:, None] & channel_ok[None, :]
            q = tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
            g16 = tl.load(g_ptr + ptrs, mask=mask, other=0.0)
            key_ptrs = key_token[:, None] * K + channels[None, :]
            key_mask = (key_positions < T)[:, None] & channel_ok[None, :]
            k_J = tl.load(k_ptr + key_ptrs, mask=key_mask, other=0.0).to(tl.float32)
            g_J = tl.load(g_ptr + key_ptrs, mask=key_mask, other=0.0)
            g_between = tl.load(g_ptr + chunk_token[:, None] * K + channels[None, :],
                                mask=(after_block & chunk_ok)[:, None] & channel_ok[None, :], other=0.0)
            # G_r - G_j = (steps of block J after j) + (steps from J's end to r): same-signed sums.
            after = tl.sum(g_between.to(tl.float32), axis=0)
            to_anchor = tl.exp(span_sums(to_anchor_span, g16, NATIVE_GATES))
            keys = tl.trans(k_J * tl.exp(span_sums(within_block, g_J, NATIVE_GATES) + after[None, :]))  # [BKC, SUB]
            k_J_peak = peak(k_J)
            akk_block += scaled_dot_within(k * to_anchor, peak(k), keys, k_J_peak, PRECISION)
            aqk_block += scaled_dot_within(q * to_anchor, peak(q), keys, k_J_peak, PRECISION)
        tl.store(akk_ptr + row_ptrs + (J * SUB + local)[None, :], akk_block)
        tl.store(aqk_ptr + row_ptrs + (J * SUB + local)[None, :], aqk_block * scale)


@triton.jit
def _kda_ut_inverse_kernel(
    beta_ptr, akk_ptr, t_ptr,
    T, H,
    C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """One chunk's UT matrix T = (I + L)^-1 Diag(beta), L = Diag(beta) A_kk (strictly lower), fp32,
    from _kda_a_rows_kernel's A_kk to t [rows, C]; rows past T have beta = 0. By block rows I
    (r = I*SUB):  X_II = (I + L_II)^-1 by forward substitution,  X_I = X_II (E_I - L_I,<r X_<r).
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    NC: tl.constexpr = C // SUB

    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    local = tl.arange(0, SUB)
    blocks = tl.arange(0, NC)
    row_ok = chunk * C + rows < T
    beta = tl.load(beta_ptr + (b * T + chunk * C + rows).to(tl.int64) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    scratch_base = bh.to(tl.int64) * tl.num_programs(0) * C + chunk * C  # this chunk's first scratch row

    X3 = tl.zeros((NC, SUB, C), dtype=tl.float32)  # block rows of (I + L)^-1 found so far
    for I in tl.static_range(NC):
        r = I * SUB
        strip_rows = scratch_base + r + local
        strip_ok = chunk * C + r + local < T
        beta_I = tl.load(beta_ptr + (b * T + chunk * C + r + local).to(tl.int64) * H + h, mask=strip_ok,
                         other=0.0).to(tl.float32)
        # X_II = (I + L_II)^-1, column by column: X_II -= L[:, jj] X_II[jj, :] (row jj is final).
        akk_diag = tl.load(akk_ptr + strip_rows[:, None] * C + (r + local)[None, :])
        l_diag = tl.where(local[:, None] > local[None, :], beta_I[:, None] * akk_diag, 0.0)
        X_II = (local[:, None] == local[None, :]).to(tl.float32)
        for jj in range(SUB):
            l_col = tl.sum(tl.where(local[None, :] == jj, l_diag, 0.0), axis=1)
            x_row = tl.sum(tl.where(local[:, None] == jj, X_II, 0.0), axis=0)
            X_II -= l_col[:, None] * x_row[None, :]
        rhs = (cols[None, :] == r + local[:, None]).to(tl.float32)  # E_I
        if I > 0:
            akk_before = tl.load(akk_ptr + strip_rows[:, None] * C + cols[None, :], mask=(cols < r)[None, :], other=0.0)
            rhs -= split_dot(beta_I[:, None] * akk_before, tl.reshape(X3, (C, C)), PRECISION, EMULATE_BF16)
        X_I = split_dot(X_II, rhs, PRECISION, EMULATE_BF16)
        X3 = tl.where((blocks == I)[:, None, None], X_I[None, :, :], X3)

    tl.store(t_ptr + (scratch_base + rows)[:, None] * C + cols[None, :], tl.reshape(X3, (C, C)) * beta[None, :])


@triton.jit
def _kda_chunk_operands_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, t_ptr, w_ptr, u_ptr, u_peak_ptr, qg_ptr, kd_ptr, gc_ptr, bounds_ptr,
    T, H, K, V, scale,
    C: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, WY_PRECISION: tl.constexpr, U_PRECISION: tl.constexpr, NATIVE_GATES: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):
    """One chunk's operands of the state pass, from the UT matrix T:
      W = T (K exp(G)),  U = T V  (WY_PRECISION),  Qg = scale Q exp(G),  Kd = K exp(G_C - G),  gC = exp(G_C),
    BKW key (BV value) channels at a time; G is summed from the chunk start (exp(G) <= 1) and
    G_C - G over the later steps only (a suffix sum, exp <= 1). Then per-chunk bounds on |W|
    (largest row sum of |T| times peak|k|), |Qg|, |Kd| and |A_qk| (|sum_c q_tc k_jc decay| <= K peak|q|
    peak|k|), from which the state pass takes its fp16 scales with no reduction on its sequential
    path; W, Qg and Kd are stored as to_scratch makes them with these bounds.
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H

    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    positions = chunk * C + rows
    row_ok = positions < T
    token = (b * T + positions).to(tl.int64) * H + h  # index of (b, t, h) in [B, T, H]
    scratch_row = bh.to(tl.int64) * tl.num_programs(0) * C + chunk * C + rows

    q_peak = 0.0
    k_peak = 0.0
    for channel_start in range(0, BK, BKW):
        channels = channel_start + tl.arange(0, BKW)
        ptrs = token[:, None] * K + channels[None, :]
        mask = row_ok[:, None] & (channels < K)[None, :]
        q_peak = tl.maximum(q_peak, peak(tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)))
        k_peak = tl.maximum(k_peak, peak(tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)))

    t_matrix = tl.load(t_ptr + scratch_row[:, None] * C + cols[None, :])
    # |W_tc| = |sum_j T_tj k_jc exp(G_jc)| <= max_t sum_j |T_tj| peak|k|; |Qg| <= |scale| peak|q|; |Kd| <= peak|k|.
    w_bound = tl.max(tl.sum(tl.abs(t_matrix), axis=1)) * k_peak
    qg_bound = tl.abs(scale) * q_peak
    for channel_start in range(0, BK, BKW):
        channels = channel_start + tl.arange(0, BKW)
        channel_ok = channels < K
        ptrs = token[:, None] * K + channels[None, :]
        mask = row_ok[:, None] & channel_ok[None, :]
        q = tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + ptrs, mask=mask, other=0.0)
        from_start = tl.exp(span_sums(cols[None, :] <= rows[:, None], g, NATIVE_GATES))
        to_end = tl.exp(span_sums(cols[None, :] > rows[:, None], g, NATIVE_GATES))
        out_ptrs = scratch_row[:, None] * K + channels[None, :]
        w = split_dot(t_matrix, k * from_start, WY_PRECISION, EMULATE_BF16)
        tl.store(w_ptr + out_ptrs, to_scratch(w, w_bound, PRECISION), mask=channel_ok[None, :])
        tl.store(qg_ptr + out_ptrs, to_scratch((q * scale) * from_start, qg_bound, PRECISION), mask=channel_ok[None, :])
        tl.store(kd_ptr + out_ptrs, to_scratch(k * to_end, k_peak, PRECISION), mask=channel_ok[None, :])
        tl.store(gc_ptr + (bh.to(tl.int64) * tl.num_programs(0) + chunk) * K + channels,
                 tl.exp(tl.sum(g.to(tl.float32), axis=0)), mask=channel_ok)
    for value_start in range(0, V, BV):
        values = value_start + tl.arange(0, BV)
        value_ok = values < V
        v = tl.load(v_ptr + token[:, None] * V + values[None, :], mask=row_ok[:, None] & value_ok[None, :],
                    other=0.0)
        u = split_dot(t_matrix, v, WY_PRECISION, EMULATE_BF16)
        store_u(u_ptr, u_peak_ptr, u, scratch_row, (bh.to(tl.int64) * tl.num_programs(0) + chunk) * V, values,
                value_ok, V, U_PRECISION)
    which = tl.arange(0, 4)
    bounds = tl.where(which == 0, w_bound, tl.where(which == 1, qg_bound,
                      tl.where(which == 2, k_peak, qg_bound * K * k_peak)))
    tl.store(bounds_ptr + (bh.to(tl.int64) * tl.num_programs(0) + chunk) * 4 + which, bounds)


class _IntraScratch(NamedTuple):
    """The state pass's operands and, between the parallel kernels, A_kk and T by row (fp32)."""

    operands: StateOperands
    akk: torch.Tensor
    ut_matrix: torch.Tensor

    @staticmethod
    def allocate(B: int, H: int, num_chunks: int, C: int, K: int, V: int, device: torch.device,
                 dot_precision: str) -> _IntraScratch:
        rows = B * H * num_chunks * C
        return _IntraScratch(StateOperands.allocate(B, H, num_chunks, C, K, V, device, dot_precision),
                             torch.empty(rows, C, device=device), torch.empty(rows, C, device=device))


def _bind_intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, scratch: _IntraScratch, dot_precision: str) -> list[Launch]:
    """The three kernels that need no carried state, each parallel over chunks (module docstring), bound."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    operands = scratch.operands
    C = operands.aqk.shape[1]
    num_chunks = triton.cdiv(T, C)
    BK = block_size(K)
    common = dict(PRECISION=dot_precision, NATIVE_GATES=native_gates(q.dtype))
    return [
        Launch(
            _kda_a_rows_kernel, (num_chunks * (C // SUB_CHUNK), B * H),
            q, k, g, scratch.akk, operands.aqk, T, H, K, scale,
            C=C, SUB=SUB_CHUNK, BK=BK, BKC=min(BK, A_ROWS_CHANNEL_SLICE), num_warps=A_ROWS_NUM_WARPS, **common,
        ),
        Launch(
            _kda_ut_inverse_kernel, (num_chunks, B * H),
            beta, scratch.akk, scratch.ut_matrix, T, H,
            C=C, SUB=SUB_CHUNK, PRECISION=inverse_precision(dot_precision), EMULATE_BF16=interpreter_active(),
            num_warps=UT_INVERSE_NUM_WARPS,
        ),
        Launch(
            _kda_chunk_operands_kernel, (num_chunks, B * H),
            q, k, v, g, scratch.ut_matrix, operands.w, operands.u, operands.u_peak_or_u(), operands.qg, operands.kd,
            operands.gc, operands.bounds, T, H, K, V, scale,
            C=C, BK=BK, BKW=INTRA_OUTPUT_BLOCK, BV=INTRA_OUTPUT_BLOCK, WY_PRECISION=wy_precision(dot_precision),
            U_PRECISION=operands.u_precision(dot_precision), EMULATE_BF16=interpreter_active(),
            num_warps=OPERANDS_NUM_WARPS, **common,
        ),
    ]


def auto_chunk_size(state_programs: int, multiprocessors: int | None) -> int:
    """The chunk size "auto" picks (module docstring): 16 where the state pass's programs fill at least
    2/3 of the ``multiprocessors`` (None off the GPU), else 64."""
    if multiprocessors is not None and 3 * state_programs >= 2 * multiprocessors:
        return 16
    return 64


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    state: tuple[torch.Tensor] | None, return_state: bool,
    chunk_size: int | str = "auto", precision: str = "auto", block_v: int = 64, num_warps: int = 4,
    num_stages: int | str = "auto", saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The four launches of the module docstring. Nothing goes into ``saved`` (gradients wanted): the backward
    (kernels/_delta_chunk_backward.py) recomputes what it needs."""
    for name, value in (("chunk_size", chunk_size), ("precision", precision), ("block_v", block_v),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        _check_choice("chunkwise", name, value)
    B, T, H, K = k.shape
    V = v.shape[-1]
    if chunk_size == "auto":
        multiprocessors = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
        chunk_size = auto_chunk_size(B * H * triton.cdiv(V, value_block(block_v, V)), multiprocessors)
    dot_precision, num_stages = resolve_state_pass(precision, num_stages, q.dtype, K, V)
    scratch = _IntraScratch.allocate(B, H, triton.cdiv(T, chunk_size), chunk_size, K, V, q.device, dot_precision)
    o = torch.empty_like(v)
    initial = state[0] if state is not None else None
    final = zero_state((B, H, K, V), q.device) if return_state else None
    launch_after_checks(
        await_checks,
        *_bind_intra_chunk(q, k, v, g, beta, scale, scratch, dot_precision),
        bind_state_pass(scratch.operands, o, initial, final, T, chunk_size, block_v, dot_precision, num_warps,
                        num_stages),
    )
    return o, ((final,) if return_state else None)

# ---------------------------------------------------------------------------
# Recurrent
# ---------------------------------------------------------------------------

# The recurrent backward's replay segment: with ``saved`` the forward stores the state entering every
# RECURRENT_SEGMENT-th step, and the backward replays one segment at a time (module docstring, "Recurrent backward").
RECURRENT_SEGMENT = 64
# The backward keeps S_t, S_{t-1}, the decayed state and dS as fp32 tiles of [BK, BV]; BK * BV at most this many
# entries (16 fp32 registers a tile a thread at 4 warps), half the forward's default tile at K = 128.
RECURRENT_BACKWARD_TILE = 2048


@triton.jit
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_in_ptr, state_out_ptr, checkpoint_ptr,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    SEGMENT: tl.constexpr,
):
    """Token by token, S [BK, BV] fp32:
      S = exp(g_t)[:, None] * S
      S = S + beta_t k_t (v_t - S^T k_t)^T
      o_t = S^T (scale q_t)
    With SEGMENT > 0 (gradients wanted) the state entering every SEGMENT-th step also goes to
    checkpoint [B*H, cdiv(T, SEGMENT), K, V], this program's V columns of it.
    """
    v_block, bh, b, h, channels, values, channel_ok, value_ok, state_ptrs, state_mask = state_block(H, K, V, BK, BV)
    if HAS_INITIAL_STATE:
        S = tl.load(state_in_ptr + state_ptrs, mask=state_mask, other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)

    for t in range(T):
        if SEGMENT > 0:
            if t % SEGMENT == 0:
                checkpoint = (bh.to(tl.int64) * tl.cdiv(T, SEGMENT) + t // SEGMENT) * K * V
                tl.store(checkpoint_ptr + checkpoint + channels[:, None] * V + values[None, :], S, mask=state_mask)
        token = (b * T + t).to(tl.int64) * H + h
        q_t = tl.load(q_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
        k_t = tl.load(k_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
        g_t = tl.load(g_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
        v_t = tl.load(v_ptr + token * V + values, mask=value_ok, other=0.0).to(tl.float32)
        beta_t = tl.load(beta_ptr + token).to(tl.float32)

        S = tl.exp(g_t)[:, None] * S
        prediction = tl.sum(k_t[:, None] * S, axis=0)
        S += (beta_t * k_t)[:, None] * (v_t - prediction)[None, :]
        o_t = tl.sum((q_t * scale)[:, None] * S, axis=0)
        tl.store(o_ptr + token * V + values, o_t.to(o_ptr.dtype.element_ty), mask=value_ok)

    if STORE_FINAL_STATE:
        tl.store(state_out_ptr + state_ptrs, S, mask=state_mask)


def recurrent(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    state: tuple[torch.Tensor] | None, return_state: bool, block_v: int = 32, num_warps: int = 4,
    saved: dict[str, torch.Tensor] | None = None, await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The literal recurrence; with ``saved`` (gradients wanted) it also stores the state entering every
    RECURRENT_SEGMENT-th step there, as "checkpoints" [B*H, cdiv(T, RECURRENT_SEGMENT), K, V] fp32."""
    for name, value in (("block_v", block_v), ("num_warps", num_warps)):
        _check_choice("recurrent", name, value)
    B, T, H, K = k.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = min(block_v, block_size(V))
    o = torch.empty_like(v)
    initial = state[0] if state is not None else None
    final = zero_state((B, H, K, V), q.device) if return_state else None
    unused = zero_state((1,), q.device)  # stands in for an absent state pointer
    if saved is not None:
        saved["checkpoints"] = torch.empty((B * H, triton.cdiv(T, RECURRENT_SEGMENT), K, V), dtype=torch.float32,
                                           device=q.device)
    launch_after_checks(await_checks, Launch(
        _kda_recurrent_kernel, (triton.cdiv(V, BV), B * H),
        q, k, v, g, beta, o,
        initial if initial is not None else unused, final if final is not None else unused,
        saved["checkpoints"] if saved is not None else unused,
        T, H, K, V, scale,
        BK=BK, BV=BV, HAS_INITIAL_STATE=initial is not None, STORE_FINAL_STATE=return_state,
        SEGMENT=RECURRENT_SEGMENT if saved is not None else 0,
        num_warps=num_warps,
    ))
    return o, ((final,) if return_state else None)


# ---------------------------------------------------------------------------
# Recurrent backward
# ---------------------------------------------------------------------------


@triton.jit
def _kda_recurrent_backward_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, do_ptr, checkpoint_ptr, scratch_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr, dbeta_ptr, d_final_ptr, d_initial_ptr,
    B, T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr, SEGMENT: tl.constexpr,
    HAS_D_FINAL: tl.constexpr, STORE_D_INITIAL: tl.constexpr,
):
    """The recurrence's dual, backwards in time; dS [BK, BV] fp32 is the cotangent of S_t. Step t,
    with D = exp(g_t), the decayed state S' = D * S_{t-1} (rows), the write u = beta (v_t - S'^T k_t):

        dS += scale q_t do_t^T;            dq_t = scale S_t do_t
        du = dS^T k_t;                     dv_t = beta du;      dbeta_t = du . (v_t - S'^T k_t)
        dk_t = dS u - beta S' du
        dS' = dS - beta k_t du^T           (= (I - beta k_t k_t^T) dS)
        dg_t = sum_v S' * dS' (per row);   dS = D * dS' (rows)

    from the final state's cotangent to the initial state's gradient. The states S_{t-1} come from
    replaying one segment at a time from the forward's checkpoints into this program's scratch
    [SEGMENT, BK, BV] (slot s: the state entering the segment's step s), read back in reverse; S_t is
    the previous (later) step's S_{t-1}, carried in registers. dq, dk, dg and dbeta sum over V: this V
    block's part goes to its own slice [v_block] of theirs. One program per (V block, batch*head).
    """
    v_block, bh, b, h, channels, values, channel_ok, value_ok, state_ptrs, state_mask = state_block(H, K, V, BK, BV)
    program = v_block * tl.num_programs(1) + bh
    state_offsets = channels[:, None] * V + values[None, :]  # within one checkpoint
    tile = channels[:, None] * BV + tl.arange(0, BV)[None, :]  # a dense [BK, BV] tile in scratch
    scratch = scratch_ptr + program.to(tl.int64) * SEGMENT * BK * BV + tile
    key_part = v_block.to(tl.int64) * B * T * H * K  # this V block's slice of dq, dk, dg
    beta_part = v_block.to(tl.int64) * B * T * H  # and of dbeta
    if HAS_D_FINAL:
        dS = tl.load(d_final_ptr + state_ptrs, mask=state_mask, other=0.0)
    else:
        dS = tl.zeros((BK, BV), dtype=tl.float32)

    segments = tl.cdiv(T, SEGMENT)
    for i in range(0, segments):
        start = (segments - 1 - i) * SEGMENT
        steps = tl.minimum(SEGMENT, T - start)
        # Replay: the forward's steps on the checkpoint, each entering state to its slot. The state after
        # the segment's last step stays in S: it is S_t of the first step walked back.
        S = tl.load(checkpoint_ptr + (bh.to(tl.int64) * segments + start // SEGMENT) * K * V + state_offsets,
                    mask=state_mask, other=0.0)
        for s in range(0, steps):
            tl.store(scratch + s * BK * BV, S)
            token = (b * T + start + s).to(tl.int64) * H + h
            k_t = tl.load(k_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
            g_t = tl.load(g_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
            v_t = tl.load(v_ptr + token * V + values, mask=value_ok, other=0.0).to(tl.float32)
            beta_t = tl.load(beta_ptr + token).to(tl.float32)
            S = tl.exp(g_t)[:, None] * S
            S += (beta_t * k_t)[:, None] * (v_t - tl.sum(k_t[:, None] * S, axis=0))[None, :]
        tl.debug_barrier()  # the replayed states are read back in another thread layout

        for j in range(0, steps):
            s = steps - 1 - j
            token = (b * T + start + s).to(tl.int64) * H + h
            q_t = tl.load(q_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
            k_t = tl.load(k_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
            g_t = tl.load(g_ptr + token * K + channels, mask=channel_ok, other=0.0).to(tl.float32)
            v_t = tl.load(v_ptr + token * V + values, mask=value_ok, other=0.0).to(tl.float32)
            do_t = tl.load(do_ptr + token * V + values, mask=value_ok, other=0.0).to(tl.float32)
            beta_t = tl.load(beta_ptr + token).to(tl.float32)
            S_before = tl.load(scratch + s * BK * BV)  # S_{t-1}
            decay = tl.exp(g_t)  # g <= 0: at most 1
            decayed = decay[:, None] * S_before  # S', exactly as the forward formed it
            residual = v_t - tl.sum(k_t[:, None] * decayed, axis=0)  # v_t - S'^T k_t

            dS += (scale * q_t)[:, None] * do_t[None, :]
            du = tl.sum(k_t[:, None] * dS, axis=0)
            dk = tl.sum(dS * (beta_t * residual)[None, :], axis=1) - beta_t * tl.sum(decayed * du[None, :], axis=1)
            dq = scale * tl.sum(S * do_t[None, :], axis=1)
            tl.store(dq_ptr + key_part + token * K + channels, dq, mask=channel_ok)
            tl.store(dk_ptr + key_part + token * K + channels, dk, mask=channel_ok)
            tl.store(dv_ptr + token * V + values, (beta_t * du).to(dv_ptr.dtype.element_ty), mask=value_ok)
            tl.store(dbeta_ptr + beta_part + token, tl.sum(du * residual, axis=0))
            dS -= (beta_t * k_t)[:, None] * du[None, :]  # dS'
            # Each step's gate gradient is its own sum of products: no cumulative sum, nothing cancels.
            tl.store(dg_ptr + key_part + token * K + channels, tl.sum(decayed * dS, axis=1), mask=channel_ok)
            dS = decay[:, None] * dS
            S = S_before
        tl.debug_barrier()  # the next segment overwrites the scratch

    if STORE_D_INITIAL:
        tl.store(d_initial_ptr + state_ptrs, dS, mask=state_mask)


def recurrent_backward(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    state: tuple[torch.Tensor] | None, do: torch.Tensor, d_state: tuple[torch.Tensor] | None,
    saved: dict[str, torch.Tensor], block_v: int = 32, num_warps: int = 4, **ignored,
) -> dict[str, torch.Tensor | tuple[torch.Tensor]]:
    """Gradients of the recurrent form (module docstring, "Recurrent backward"): one reverse pass over time,
    replaying the forward's checkpoints a segment at a time; o is not needed. V tiles are block_v columns or
    fewer, so that BK * BV <= RECURRENT_BACKWARD_TILE."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = min(block_v, block_size(V), max(16, RECURRENT_BACKWARD_TILE // BK))
    NV = triton.cdiv(V, BV)
    f32 = dict(dtype=torch.float32, device=q.device)
    # One fp32 part per V block of the sums over V, added after.
    dq_parts = torch.empty((NV, B, T, H, K), **f32)
    dk_parts = torch.empty((NV, B, T, H, K), **f32)
    dg_parts = torch.empty((NV, B, T, H, K), **f32)
    dbeta_parts = torch.empty((NV, B, T, H), **f32)
    dv = torch.empty_like(v)
    d_initial = torch.empty((B, H, K, V), **f32) if state is not None else None
    scratch = torch.empty((NV * B * H, RECURRENT_SEGMENT, BK, BV), **f32)
    _kda_recurrent_backward_kernel[(NV, B * H)](
        q, k, v, g, beta, do, saved["checkpoints"], scratch,
        dq_parts, dk_parts, dv, dg_parts, dbeta_parts,
        d_state[0] if d_state is not None else scratch, d_initial if d_initial is not None else scratch,
        B, T, H, K, V, scale,
        BK=BK, BV=BV, SEGMENT=RECURRENT_SEGMENT, HAS_D_FINAL=d_state is not None,
        STORE_D_INITIAL=state is not None, num_warps=num_warps,
    )
    grads: dict[str, torch.Tensor | tuple[torch.Tensor]] = {
        "q": dq_parts.sum(0).to(q.dtype), "k": dk_parts.sum(0).to(k.dtype), "v": dv,
        "g": dg_parts.sum(0).to(g.dtype), "beta": dbeta_parts.sum(0).to(beta.dtype),
    }
    if d_initial is not None:
        grads["initial_state"] = (d_initial,)
    return grads


def chunkwise_backward(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       scale: float, state: tuple[torch.Tensor] | None, **rest) -> dict:
    """The chunkwise form's gradients: the delta rules' UT dual with per-channel gates (kernels/_delta_chunk_backward.py)."""
    return _delta_chunk_backward.chunkwise_backward(q=q, k=k, v=v, beta=beta, g=g, scale=scale, state=state, **rest)


BACKWARD = {"chunkwise": chunkwise_backward, "recurrent": recurrent_backward}
