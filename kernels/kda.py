"""kda (Kimi Delta Attention): chunkwise and recurrent Triton kernels.

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

Conventions (FORMULATIONS.md, attnlab/registry.py): q, k, g are [B, T, H, K],
v and o are [B, T, H, V], beta is [B, T, H], the state S is [B, H, K, V] in
fp32. g holds per-key-channel log gates (<= 0): exp(g_t) scales the rows of S.
Inputs are fp16, bf16 or fp32 (one dtype); o comes back in that dtype.
Everything inside is fp32: gates, cumulative gates, the UT inverse, every
intermediate block, the scratch buffers between the kernels and the carried
state; the fp32 dots run at the ``precision`` OPTION (see below), which for
bf16 inputs rounds their operands to fp16 after a power-of-two scaling.

Chunkwise form: seed 000's UT transform with the per-channel gates folded in,
exactly oracles/_chunks.py's ``delta_chunk``. For one chunk of C positions
with chunk-local cumulative gates G [C, K] (G_t = sum_{s<=t} g_s, fp32):

    A_kk[t, j] = sum_c k_tc k_jc exp(G_tc - G_jc)              (t > j)
    A_qk[t, j] = scale sum_c q_tc k_jc exp(G_tc - G_jc)        (t >= j)
    L = Diag(beta) A_kk,   T = (I + L)^-1 Diag(beta)           (fp32, never rounded)
    W = T (K * exp(G)),  U = T V,  Qg = scale Q * exp(G),  Kd = K * exp(G_C - G)
    Delta = U - W S
    O = Qg S + A_qk Delta
    S_next = exp(G_C) * S (rows) + Kd^T Delta

Four kernels do it; the first three need no carried state and run all
chunks in parallel, writing scratch buffers ([B*H, chunks*C, *], the last
chunk padded):

1. ``_kda_a_rows_kernel``, grid (chunks * C/16, B*H): one 16-row block row
   of A_kk and A_qk per program (secondary chunking). The pairwise decay
   exp(G_t - G_j) does not factor out of a dot as a whole; for the block's
   query rows starting at row r, the key rows j of each earlier block J are
   paired through the anchor r: exp(G_t - G_r) exp(G_r - G_j), both
   exponents <= 0 because j < r <= t, one [16, BKC] x [BKC, 16] dot per
   block J. The anchor is the block's FIRST row, so it is never later than
   the query it serves (no future row enters, also in a partial trailing
   block). The diagonal 16 x 16 block uses the same anchors by halving: at
   level h (8, 4, 2, 1) each group of 2h rows pairs its later half with its
   earlier half through the later half's first row, so every pair t > j is
   formed once, by one [16, BKC] x [BKC, 16] dot per level (the former
   [16, 16, 16] exp tiles, summed over channels with shuffles, and 16-channel
   steps with a barrier each kept the kernel latency-bound: 6.9 ms at the
   bench shape). A_qk's diagonal t = j is sum_c q_tc k_tc.
2. ``_kda_ut_inverse_kernel``, grid (chunks, B*H): T from A_kk by block
   forward substitution, fp32.
3. ``_kda_chunk_operands_kernel``, grid (chunks, B*H): W, U, Qg, Kd, exp(G_C)
   and per-chunk bounds on |W|, |Qg|, |Kd|, |A_qk| for the state pass.
   These three were one kernel until 2026-11-25 (4.1 ms at the bench shape
   on an H100, 255 registers, a 16.6k-instruction unrolled body stalled on
   instruction fetch); split, each runs at the warps its tiles want (one
   warp for the A rows, whose small products hold whole operands in every
   warp, block J by block J: [16, 16] tiles, 143 registers): 0.75 + 0.22 +
   0.77 ms at C = 64; at C = 16, which "auto" takes at the bench shape, the
   A rows are the diagonal block alone: 0.29 + 0.07 + 0.64 ms, and the state
   pass 0.62 against 0.52 (H100, session 11). Tried and dropped (session 11):
   one program a chunk forming all of A by halving over the whole chunk
   (log2 C levels of [C, slice] x [slice, C] dots with [C, C] pair masks):
   2.24 ms at C = 64 on 4 warps, 1.44 with 32-channel slices, 3.80 on 8
   warps, against 0.74; the masks and layout conversions of the wide tiles
   cost more than the small tiles' latency.
4. ``_kda_state_pass_kernel``, grid (V blocks, B*H), sequential over chunks:
   the fp32 state stays in registers as up to four blocks of 64 key channels
   (as fla does: a whole [K, BV] fp32 tile and its [C, K] operands do not fit
   the registers and shared memory at K >= 128); per chunk four dots
   (W S, Qg S, A_qk Delta, Kd^T Delta) and no exp or cumsum: all gate work is
   in kernels 1 and 3. Fusing the output here saves storing per-chunk states (fp32
   [B, H, T/C, K, V] would cost more traffic than q, k, v and o together).

Every exponent evaluated is <= 0 (cross-time factors exp(G_t - G_j) with
t >= j, exp(G) and exp(G_C - G)); entries that would have a positive exponent
are masked to -inf first, so strong decays (-20 per step and beyond) only
underflow to 0. Each exponent is summed over just the steps it spans, as
a product span @ g of a 0/1 matrix with the gates (``_span_sums``: one
tensor-core dot in the gates' own 16-bit dtype, exact products and fp32
sums of same-signed terms; fp32 on CUDA cores for fp32 gates), never taken
as a difference of two cumulative sums: its
rounding error is then relative to itself, not to the decay accumulated
before it (a difference of cumulative sums loses about u * |G| to
cancellation, which at -20 per step tripled the fp32 error).

OPTIONS (chunkwise):
- ``chunk_size`` ("auto"; 16, 32 or 64): C, a multiple of the 16-row sub-chunk.
  "auto" (``auto_chunk_size``) is 16 where the state pass's programs
  (B*H*ceil(V/block_v)) fill at least 2/3 of the GPU's SMs, else 64 (and 64
  off the GPU). Smaller chunks shrink the parallel kernels' work (fewer
  off-diagonal A blocks, a smaller UT inverse, [C, C] products) but give the
  sequential state pass more steps, which only pays while its programs keep
  the SMs busy. H100, bf16, K=V=128, ms at C = 16 / 32 / 64 against fla's
  chunk_kda (session 11, all in one run): B=8 H=16 T=4096 (256 programs) 1.730 /
  1.892 / 2.381 against 2.067; B=4 H=16 T=4096 (128) 1.131 / 1.119 / 1.274
  against 1.103; B=8 H=16 T=4096 V=64 (128) 1.058 / 1.144 / 1.351 against
  1.150; B=2 H=16 T=4096 (64) 1.023 / 0.938 / 0.920 against 1.062; B=2 H=8
  T=8192 (32) 1.372 / 1.057 / 1.044 against 1.057; B=1 H=16 T=8192 (32)
  1.370 / 1.108 / 1.042 against 1.030; B=1 H=4 T=16384 (8) 2.205 / 1.489 /
  1.271 against 1.199.
- ``precision`` ("auto"): how the fp32 x fp32 dots run. "auto" is "fp16"
  for bf16 inputs, "bf16x3" for fp16 inputs and "ieee" for fp32 inputs.
  "fp16" scales each operand tile by a power of two (exact) so that a bound
  on its magnitude lands in [2^13, 2^14), rounds it to fp16 and does one fp16
  tensor-core product: 2^-11 relative per operand (down to 2^-27 of the
  bound), 4x below bf16's output rounding, at the cost of one bf16 product.
  The bound is the tile's own peak (a max-reduction across the warps) only
  where nothing cheaper bounds it: the A blocks' and W's operands are q or k
  times decays <= 1 (the peaks of |q| and |k| bound them); the state pass's
  W, Qg and Kd are stored already scaled and rounded to fp16 by kernel 3
  (``_to_scratch``: the rounding their products would do anyway, at half the
  bytes), with their bounds and A_qk's per chunk, so the state pass reduces
  only S and Delta, once a chunk each (H100, bench shape: state pass 1.07 ->
  0.85 ms for the bounds, -> 0.52 for the fp16 operands). Emulated in torch
  (bf16 inputs, K=V=128, T=64..4096) its excess is 1.016-1.019, against
  1.000 for fp32 dots and 1.68-1.78 for "bf16". Known defect (session 10):
  on the property suite's case K = V = 1, no decay, nearly parallel keys,
  T = 65, it reaches 1.59, over the bf16 bound ("bf16x3" and "ieee" 1.00;
  properties/regressions.py, a strict xfail in tests/kernels/test_kda.py).
  For fp16 inputs it would sit
  at their own floor, so they keep "bf16x3" (each fp32 operand split into
  bf16 hi + lo, three bf16 products, about 2^-16 relative per product).
  "tf32x3" (three TF32 products, about 2^-21) costs twice "bf16x3" on tensor
  cores; "tf32" (2^-11) is faster but costs accuracy (fp16 especially);
  "bf16" rounds both operands to bf16 and does one product, fla's own choice,
  at about fla's accuracy; it was the fastest until "fp16" stored the state
  pass's operands in fp16, and is now slower (H100, bench shape: 2.500 ms
  against 2.394, reports/bench.md session 9), so kda, like the delta rules,
  offers no speed setting; "ieee" is exact
  fp32 on CUDA cores (slow). The Triton interpreter computes every fp32 dot
  exactly whatever is asked (its builder does not know "bf16x3", which is
  passed to it as "ieee"); "bf16" and "fp16" are emulated there by rounding
  the operands and multiplying them exactly.
- ``block_v`` (64; 16, 32, 64 or 128): V columns per program of the state
  pass. On an H200 (B=8, T=4096, H=16, K=V=128, bf16) the state pass took
  1.01 ms at 64 against 1.36 at 32 (each program reads its chunk's W, Qg and
  Kd once for twice the columns) and 2.66 at 16.
- ``num_warps`` (4) and ``num_stages`` ("auto": 2 up to K = 128 except with
  "tf32" dots, else 1) of the state pass. Compiled offline for sm_90 (ptxas
  of triton 3.6, .ci/sm90_compile.py, bf16 inputs, K=V=128, C=64, "fp16"):
  A rows 143 registers at 1 warp, no spills; UT inverse 255 at 1 warp (32
  bytes of spills); operands 255 at 2 warps (76 bytes); state pass at 2
  stages 255 registers, 32 bytes of spill stores, 144 KB of shared memory
  ("bf16x3" 280 bytes of spills, 152 KB; "tf32x3" 168 KB), "tf32" 272 KB (48 KB at 1
  stage); the limit is 227 KB (KB = 1024 bytes throughout).

Scratch traffic: W, U, Qg, Kd are [B*H, T, K or V] each, A_qk, A_kk and T
[B*H, T, C], fp32 but W, Qg, Kd fp16 with "fp16" dots: at B=8, H=16, T=4096,
K=V=128 about 0.7 GB for the state pass to read, 1.1 GB with fp32 operands.

Recurrent form (``_kda_recurrent_kernel``): one program per (B*H, V block),
the literal recurrence token by token with the fp32 state in registers.
OPTIONS: ``block_v`` (32), ``num_warps`` (4).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._util import Launch, block_size, launch_after_checks, no_pending_checks, zero_state

SUB_CHUNK = 16
INTRA_OUTPUT_BLOCK = 32  # key or value channels per W, U, Qg, Kd block of the operands kernel (see its warps below)
# The A rows kernel's [16, 16] products hold whole [16, slice] operands in every warp, so it runs one
# warp a program, 16 channels a slice (sm_90 build: 143 registers, none spilled; 230 at 32 channels).
# H100, bench shape: 0.75 ms; 0.96 at 32 channels, 1.69 at 2 warps and 32 channels.
A_ROWS_CHANNEL_SLICE = 16
A_ROWS_NUM_WARPS = 1
UT_INVERSE_NUM_WARPS = 1  # H100, bench shape: 0.21 ms at 1 warp, 0.37 at 4
OPERANDS_NUM_WARPS = 2  # 0.77 ms at 2 warps and 32 channels a block; 0.87 at 4 warps, 0.86 at 16 channels
STATE_CHANNEL_BLOCK = 64  # key channels per state block S0..S3 of the state pass (K <= 4 blocks = 256)

OPTIONS = {
    "chunkwise": {
        "chunk_size": ("auto", ("auto", 16, 32, 64)),
        "precision": ("auto", ("auto", "fp16", "tf32x3", "bf16x3", "ieee", "tf32", "bf16")),
        "block_v": (64, (16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8, 16)),
        "num_stages": ("auto", ("auto", 1, 2, 3, 4)),
    },
    "recurrent": {
        "block_v": (32, (16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
    },
}

# Dot precisions the Triton interpreter's builder accepts; it computes all of them exactly in fp32.
_INTERPRETER_PRECISIONS = ("tf32", "tf32x3", "ieee")


def _check_choice(form: str, name: str, value: object) -> None:
    choices = OPTIONS[form][name][1]
    if value not in choices:
        raise ValueError(f"kda {form}: {name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _dot_precision(precision: str, dtype: torch.dtype) -> str:
    """The tl.dot input_precision for fp32 operands (see the module docstring)."""
    if precision == "auto":
        precision = {torch.float32: "ieee", torch.bfloat16: "fp16"}.get(dtype, "bf16x3")
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and precision not in _INTERPRETER_PRECISIONS:
        # "bf16" and "fp16" are no input_precision (_dot casts the operands itself), and the interpreter's
        # 16-bit dots are wrong: round the operands and multiply them in fp32 instead.
        precision = {"bf16": "bf16_emulated", "fp16": "fp16_emulated"}.get(precision, "ieee")
    return precision


def _gate_dot(dtype: torch.dtype) -> str:
    """How _span_sums multiplies the 16-bit gates: natively on tensor cores on the GPU."""
    if dtype in (torch.float16, torch.bfloat16) and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "native"
    return "ieee"


# ---------------------------------------------------------------------------
# Chunkwise, kernels 1-3 (parallel over chunks): everything that does not need the carried state
# ---------------------------------------------------------------------------


@triton.jit
def _fp16_scale(peak):
    """Powers of two (2^s, 2^-s) bringing a peak magnitude into [2^13, 2^14): x * 2^s of any x
    with |x| <= peak rounds to fp16 without overflow, with 2^-11 relative error at the top
    (s is clamped to [-100, 100] so both factors stay normal fp32 numbers)."""
    peak_exponent = (peak.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased
    biased = tl.minimum(tl.maximum(267 - peak_exponent, 27), 227)  # 127 + s, s = 140 - peak_exponent
    return (biased << 23).to(tl.float32, bitcast=True), ((254 - biased) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _peak(x):
    return tl.max(tl.abs(x))


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
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
        return _dot_within(a, _peak(a), b, _peak(b), PRECISION)
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_within(a, a_peak, b, b_peak, PRECISION: tl.constexpr):
    """_dot for operands known to lie within |a| <= a_peak and |b| <= b_peak: "fp16" takes its
    scales from these bounds instead of from a max-reduction over each tile (a barrier across
    the warps). The A blocks' operands are q or k times decays <= 1, so the peaks of |q| and
    |k| bound them; an operand far below its bound keeps 2^-11 relative error down to 2^-27 of
    the bound, where fp16 goes subnormal (such terms are that much smaller than the largest)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        return _dot_scratch(_to_scratch(a, a_peak, PRECISION), a_peak, b, b_peak, PRECISION)
    else:
        return _dot(a, b, PRECISION)


@triton.jit
def _to_scratch(a, a_bound, PRECISION: tl.constexpr):
    """An operand of the state pass's dots as it is stored between the kernels: for "fp16" scaled
    by the power of two of its bound |a| <= a_bound and rounded to fp16, the rounding its product
    would do anyway (half the bytes of fp32), else unchanged (fp32)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        a_up, _ = _fp16_scale(a_bound)
        return (a * a_up).to(tl.float16)
    else:
        return a


@triton.jit
def _from_scratch(a, a_bound, PRECISION: tl.constexpr):
    """The fp32 value of an operand that _to_scratch stored with the same bound (unscaled for "fp16")."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        _, a_down = _fp16_scale(a_bound)
        return a.to(tl.float32) * a_down
    else:
        return a


@triton.jit
def _dot_scratch(a, a_bound, b, b_peak, PRECISION: tl.constexpr):
    """a @ b for an operand a as _to_scratch made it (with the same bound) and an fp32 b, |b| <= b_peak."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        _, a_down = _fp16_scale(a_bound)
        b_up, b_down = _fp16_scale(b_peak)
        b16 = (b * b_up).to(tl.float16)
        if PRECISION == "fp16":
            product = tl.dot(a, b16)
        else:
            product = tl.dot(a.to(tl.float32), b16.to(tl.float32), input_precision="ieee")
        return product * (a_down * b_down)
    else:
        return _dot(a, b, PRECISION)


@triton.jit
def _span_sums(span, g, GATE_DOT: tl.constexpr):
    """span @ g for a 0/1 matrix span [M, N] and gates g [N, BKC] (all <= 0): every output sums
    only the steps it spans, with no cancellation (rounding relative to itself). "native" runs
    one tensor-core product in g's own 16-bit dtype (exact products, fp32 sums); "ieee" is
    fp32 on CUDA cores (fp32 gates, and the Triton interpreter)."""
    if GATE_DOT == "native":
        return tl.dot(span.to(g.dtype), g)
    else:
        return tl.dot(span.to(tl.float32), g.to(tl.float32), input_precision="ieee")


@triton.jit
def _kda_a_rows_kernel(
    q_ptr, k_ptr, g_ptr, akk_ptr, aqk_ptr,
    T, H, K, scale,
    C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr,
    PRECISION: tl.constexpr, GATE_DOT: tl.constexpr,
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
        q_peak = _peak(q)
        k_peak = _peak(k)
        for level in tl.static_range(LOG_SUB):
            half = SUB >> (level + 1)
            anchor = (local // (2 * half)) * (2 * half) + half
            later_half = local >= anchor
            # Exponents G_t - G_a (t >= a) and G_a - G_j (j < a): sums of the steps spanned.
            span = tl.where(later_half[:, None],
                            (anchor[:, None] < local[None, :]) & (local[None, :] <= local[:, None]),
                            (local[:, None] < local[None, :]) & (local[None, :] <= anchor[:, None]))
            decay = tl.exp(_span_sums(span, g16, GATE_DOT))
            keys = tl.trans(tl.where(later_half[:, None], 0.0, k * decay))  # [BKC, SUB], rows j < a
            pair = ((local[:, None] // (2 * half)) == (local[None, :] // (2 * half))) & later_half[:, None]
            later_k = tl.where(later_half[:, None], k * decay, 0.0)
            later_q = tl.where(later_half[:, None], q * decay, 0.0)
            akk_diag += tl.where(pair, _dot_within(later_k, k_peak, keys, k_peak, PRECISION), 0.0)
            aqk_diag += tl.where(pair, _dot_within(later_q, q_peak, keys, k_peak, PRECISION), 0.0)
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
            to_anchor = tl.exp(_span_sums(to_anchor_span, g16, GATE_DOT))
            keys = tl.trans(k_J * tl.exp(_span_sums(within_block, g_J, GATE_DOT) + after[None, :]))  # [BKC, SUB]
            k_J_peak = _peak(k_J)
            akk_block += _dot_within(k * to_anchor, _peak(k), keys, k_J_peak, PRECISION)
            aqk_block += _dot_within(q * to_anchor, _peak(q), keys, k_J_peak, PRECISION)
        tl.store(akk_ptr + row_ptrs + (J * SUB + local)[None, :], akk_block)
        tl.store(aqk_ptr + row_ptrs + (J * SUB + local)[None, :], aqk_block * scale)


@triton.jit
def _kda_ut_inverse_kernel(
    beta_ptr, akk_ptr, t_ptr,
    T, H,
    C: tl.constexpr, SUB: tl.constexpr, PRECISION: tl.constexpr,
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
            rhs -= _dot(beta_I[:, None] * akk_before, tl.reshape(X3, (C, C)), PRECISION)
        X_I = _dot(X_II, rhs, PRECISION)
        X3 = tl.where((blocks == I)[:, None, None], X_I[None, :, :], X3)

    tl.store(t_ptr + (scratch_base + rows)[:, None] * C + cols[None, :], tl.reshape(X3, (C, C)) * beta[None, :])


@triton.jit
def _store_u(u_ptr, u_peak_ptr, u, scratch_row, peak_offset, values, value_ok, V, U_PRECISION: tl.constexpr):
    """Stores a block of U's columns for the state pass. Stored in fp16 (U_PRECISION "fp16": the
    delta rules, StateOperands.allocate), each column is scaled by its own peak |U| over the chunk,
    stored beside it: every entry keeps 2^-11 relative precision down to 2^-27 of its column's peak,
    the size of the rounding of W S, which Delta = U - W S subtracts from it."""
    if U_PRECISION == "fp16" or U_PRECISION == "fp16_emulated":
        u_peak = tl.max(tl.abs(u), axis=0)
        tl.store(u_peak_ptr + peak_offset + values, u_peak, mask=value_ok)
        u = _to_scratch(u, u_peak[None, :], U_PRECISION)
    tl.store(u_ptr + scratch_row[:, None] * V + values[None, :], u, mask=value_ok[None, :])


@triton.jit
def _load_u(u_ptr, u_peak_ptr, scratch_row, peak_offset, values, value_ok, V, U_PRECISION: tl.constexpr):
    """A block of U's columns as _store_u stored them, in fp32."""
    u = tl.load(u_ptr + scratch_row[:, None] * V + values[None, :], mask=value_ok[None, :], other=0.0)
    if U_PRECISION == "fp16" or U_PRECISION == "fp16_emulated":
        u_peak = tl.load(u_peak_ptr + peak_offset + values, mask=value_ok, other=0.0)
        u = _from_scratch(u, u_peak[None, :], U_PRECISION)
    return u


@triton.jit
def _kda_chunk_operands_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, t_ptr, w_ptr, u_ptr, u_peak_ptr, qg_ptr, kd_ptr, gc_ptr, bounds_ptr,
    T, H, K, V, scale,
    C: tl.constexpr, BK: tl.constexpr, BKW: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, U_PRECISION: tl.constexpr, GATE_DOT: tl.constexpr,
):
    """One chunk's operands of the state pass, from the UT matrix T:
      W = T (K exp(G)),  U = T V,  Qg = scale Q exp(G),  Kd = K exp(G_C - G),  gC = exp(G_C),
    BKW key (BV value) channels at a time; G is summed from the chunk start (exp(G) <= 1) and
    G_C - G over the later steps only (a suffix sum, exp <= 1). Then per-chunk bounds on |W|
    (largest row sum of |T| times peak|k|), |Qg|, |Kd| and |A_qk| (|sum_c q_tc k_jc decay| <= K peak|q|
    peak|k|), from which the state pass takes its fp16 scales with no reduction on its sequential
    path; W, Qg and Kd are stored as _to_scratch makes them with these bounds.
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
        q_peak = tl.maximum(q_peak, _peak(tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)))
        k_peak = tl.maximum(k_peak, _peak(tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)))

    t_matrix = tl.load(t_ptr + scratch_row[:, None] * C + cols[None, :])
    t_peak = _peak(t_matrix)
    # |W_tc| = |sum_j T_tj k_jc exp(G_jc)| <= max_t sum_j |T_tj| peak|k|; |Qg| <= |scale| peak|q|; |Kd| <= peak|k|.
    w_bound = tl.max(tl.sum(tl.abs(t_matrix), axis=1)) * k_peak
    qg_bound = tl.abs(scale) * q_peak
    # T enters every product of W and U: rounded for them once (fp16 for "fp16"), not once a block.
    t_operand = _to_scratch(t_matrix, t_peak, PRECISION)
    for channel_start in range(0, BK, BKW):
        channels = channel_start + tl.arange(0, BKW)
        channel_ok = channels < K
        ptrs = token[:, None] * K + channels[None, :]
        mask = row_ok[:, None] & channel_ok[None, :]
        q = tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + ptrs, mask=mask, other=0.0)
        from_start = tl.exp(_span_sums(cols[None, :] <= rows[:, None], g, GATE_DOT))
        to_end = tl.exp(_span_sums(cols[None, :] > rows[:, None], g, GATE_DOT))
        out_ptrs = scratch_row[:, None] * K + channels[None, :]
        w = _dot_scratch(t_operand, t_peak, k * from_start, k_peak, PRECISION)
        tl.store(w_ptr + out_ptrs, _to_scratch(w, w_bound, PRECISION), mask=channel_ok[None, :])
        tl.store(qg_ptr + out_ptrs, _to_scratch((q * scale) * from_start, qg_bound, PRECISION), mask=channel_ok[None, :])
        tl.store(kd_ptr + out_ptrs, _to_scratch(k * to_end, k_peak, PRECISION), mask=channel_ok[None, :])
        tl.store(gc_ptr + (bh.to(tl.int64) * tl.num_programs(0) + chunk) * K + channels,
                 tl.exp(tl.sum(g.to(tl.float32), axis=0)), mask=channel_ok)
    for value_start in range(0, V, BV):
        values = value_start + tl.arange(0, BV)
        value_ok = values < V
        v = tl.load(v_ptr + token[:, None] * V + values[None, :], mask=row_ok[:, None] & value_ok[None, :],
                    other=0.0).to(tl.float32)
        u = _dot_scratch(t_operand, t_peak, v, _peak(v), PRECISION)
        _store_u(u_ptr, u_peak_ptr, u, scratch_row, (bh.to(tl.int64) * tl.num_programs(0) + chunk) * V, values,
                 value_ok, V, U_PRECISION)
    which = tl.arange(0, 4)
    bounds = tl.where(which == 0, w_bound, tl.where(which == 1, qg_bound,
                      tl.where(which == 2, k_peak, qg_bound * K * k_peak)))
    tl.store(bounds_ptr + (bh.to(tl.int64) * tl.num_programs(0) + chunk) * 4 + which, bounds)


# ---------------------------------------------------------------------------
# Chunkwise, kernel 2: the state pass over chunks, writing the output
# ---------------------------------------------------------------------------


@triton.jit
def _project_block(w_ptr, qg_ptr, S, scratch_row, qg_row, row_ok, channel_start, K, ws, qs, w_bound, qg_bound,
                   BKB: tl.constexpr, PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """Adds one block of BKB key channels to ws = W S and qs = Qg S (with SCALAR_GATE, Q S: qg_ptr
    is the input q, qg_row its rows' offsets, qg_bound peak|q|)."""
    channels = channel_start + tl.arange(0, BKB)
    mask = (channels < K)[None, :]
    s_peak = _peak(S)
    ws += _dot_scratch(tl.load(w_ptr + scratch_row[:, None] * K + channels[None, :], mask=mask, other=0.0), w_bound,
                       S, s_peak, PRECISION)
    qg = tl.load(qg_ptr + qg_row[:, None] + channels[None, :], mask=row_ok[:, None] & mask, other=0.0)
    if SCALAR_GATE:
        qg = _to_scratch(qg.to(tl.float32), qg_bound, PRECISION)
    qs += _dot_scratch(qg, qg_bound, S, s_peak, PRECISION)
    return ws, qs


@triton.jit
def _advance_block(kd_ptr, gc_ptr, S, delta, kd_row, row_ok, gc_offset, channel_start, K, kd_bound, delta_peak,
                   BKB: tl.constexpr, PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """One block of BKB key channels of S_next = gC * S (rows) + Kd^T Delta (with SCALAR_GATE, K^T
    Delta: kd_ptr is the input k, kd_row its rows' offsets, kd_bound peak|k|)."""
    channels = channel_start + tl.arange(0, BKB)
    channel_ok = channels < K
    kd_t = tl.load(kd_ptr + kd_row[None, :] + channels[:, None],
                   mask=channel_ok[:, None] & row_ok[None, :], other=0.0)  # [BKB, C]
    if SCALAR_GATE:
        kd_t = _to_scratch(kd_t.to(tl.float32), kd_bound, PRECISION)
    decay = tl.load(gc_ptr + gc_offset + channels, mask=channel_ok, other=0.0)
    return decay[:, None] * S + _dot_scratch(kd_t, kd_bound, delta, delta_peak, PRECISION)


@triton.jit
def _kda_state_pass_kernel(
    w_ptr, u_ptr, u_peak_ptr, qg_ptr, kd_ptr, gc_ptr, aqk_ptr, bounds_ptr, q_ptr, k_ptr, o_ptr, state_in_ptr,
    state_out_ptr, T, H, K, V, num_chunks,
    C: tl.constexpr, BKB: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, PRECISION: tl.constexpr,
    U_PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr,
):
    """S [NKB * BKB, BV] fp32 in registers, held as NKB (1, 2 or 4) blocks S0..S3 of BKB key
    channels (as fla does: one [K, BV] fp32 tile does not fit at K >= 128). Per chunk, from
    kernels 1-3's W, U, Qg, Kd, gC and Aqk:
      Delta  = U - W S
      O      = Qg S + Aqk Delta
      S_next = gC * S + Kd^T Delta      (block by block)
    The fp16 scales of W, Qg, Kd and Aqk come from kernel 3's bounds, those of S and Delta from one
    reduction each per chunk (a product of "fp16" otherwise reduces both of its operands).

    SCALAR_GATE (the delta rules, kernels/_delta.py: one gate per head): Qg and Kd are the input q
    and k (q_ptr, k_ptr) times per-row factors, which qg and kd then hold ([rows] fp32: scale exp(G_t)
    and exp(G_C - G_t)); the factors go on the rows of Q S and of Delta, so the prepare kernel writes
    no Qg or Kd tiles, and q and k enter the dots exactly (fp16 scaled by peak|q|, peak|k|, the
    bounds' places of |Qg| and |Kd|). A_qk is stored as _to_scratch makes it (fp16 for "fp16" dots).
    """
    v_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H

    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    block_channels = tl.arange(0, BKB)
    values = v_block * BV + tl.arange(0, BV)
    value_ok = values < V

    state_ptrs = bh.to(tl.int64) * K * V + block_channels[:, None] * V + values[None, :]
    S0 = tl.zeros((BKB, BV), dtype=tl.float32)
    S1 = tl.zeros((BKB, BV), dtype=tl.float32)
    S2 = tl.zeros((BKB, BV), dtype=tl.float32)
    S3 = tl.zeros((BKB, BV), dtype=tl.float32)
    if HAS_INITIAL_STATE:
        S0 = tl.load(state_in_ptr + state_ptrs, mask=(block_channels < K)[:, None] & value_ok[None, :], other=0.0)
        if NKB > 1:
            S1 = tl.load(state_in_ptr + state_ptrs + BKB * V,
                         mask=(BKB + block_channels < K)[:, None] & value_ok[None, :], other=0.0)
        if NKB > 2:
            S2 = tl.load(state_in_ptr + state_ptrs + 2 * BKB * V,
                         mask=(2 * BKB + block_channels < K)[:, None] & value_ok[None, :], other=0.0)
            S3 = tl.load(state_in_ptr + state_ptrs + 3 * BKB * V,
                         mask=(3 * BKB + block_channels < K)[:, None] & value_ok[None, :], other=0.0)

    for n in range(num_chunks):
        positions = n * C + rows
        row_ok = positions < T
        token = (b * T + positions).to(tl.int64) * H + h
        scratch_row = (bh.to(tl.int64) * num_chunks + n) * C + rows
        gc_offset = (bh.to(tl.int64) * num_chunks + n) * K
        bounds = bounds_ptr + (bh.to(tl.int64) * num_chunks + n) * 4
        w_bound, qg_bound = tl.load(bounds), tl.load(bounds + 1)
        kd_bound, aqk_bound = tl.load(bounds + 2), tl.load(bounds + 3)

        if SCALAR_GATE:
            qk_base, qk_row, qk_ok = q_ptr, token * K, row_ok  # the inputs' rows
            kd_base = k_ptr
        else:
            qk_base, qk_row, qk_ok = qg_ptr, scratch_row * K, rows >= 0  # scratch rows, padding included
            kd_base = kd_ptr
        ws = tl.zeros((C, BV), dtype=tl.float32)
        qs = tl.zeros((C, BV), dtype=tl.float32)
        ws, qs = _project_block(w_ptr, qk_base, S0, scratch_row, qk_row, qk_ok, 0, K, ws, qs, w_bound, qg_bound,
                                BKB, PRECISION, SCALAR_GATE)
        if NKB > 1:
            ws, qs = _project_block(w_ptr, qk_base, S1, scratch_row, qk_row, qk_ok, BKB, K, ws, qs, w_bound,
                                    qg_bound, BKB, PRECISION, SCALAR_GATE)
        if NKB > 2:
            ws, qs = _project_block(w_ptr, qk_base, S2, scratch_row, qk_row, qk_ok, 2 * BKB, K, ws, qs, w_bound,
                                    qg_bound, BKB, PRECISION, SCALAR_GATE)
            ws, qs = _project_block(w_ptr, qk_base, S3, scratch_row, qk_row, qk_ok, 3 * BKB, K, ws, qs, w_bound,
                                    qg_bound, BKB, PRECISION, SCALAR_GATE)

        u = _load_u(u_ptr, u_peak_ptr, scratch_row, (bh.to(tl.int64) * num_chunks + n) * V, values, value_ok, V,
                    U_PRECISION)
        delta = u - ws
        delta_peak = _peak(delta)
        aqk = tl.load(aqk_ptr + scratch_row[:, None] * C + cols[None, :])
        if SCALAR_GATE:
            qs = qs * tl.load(qg_ptr + scratch_row)[:, None]
            o = qs + _dot_scratch(aqk, aqk_bound, delta, delta_peak, PRECISION)
            # |exp(G_C - G_t) Delta_t| <= |Delta_t|: delta_peak still bounds it.
            delta = delta * tl.load(kd_ptr + scratch_row)[:, None]
        else:
            o = qs + _dot_within(aqk, aqk_bound, delta, delta_peak, PRECISION)
        tl.store(o_ptr + token[:, None] * V + values[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & value_ok[None, :])

        S0 = _advance_block(kd_base, gc_ptr, S0, delta, qk_row, qk_ok, gc_offset, 0, K, kd_bound,
                            delta_peak, BKB, PRECISION, SCALAR_GATE)
        if NKB > 1:
            S1 = _advance_block(kd_base, gc_ptr, S1, delta, qk_row, qk_ok, gc_offset, BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION, SCALAR_GATE)
        if NKB > 2:
            S2 = _advance_block(kd_base, gc_ptr, S2, delta, qk_row, qk_ok, gc_offset, 2 * BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION, SCALAR_GATE)
            S3 = _advance_block(kd_base, gc_ptr, S3, delta, qk_row, qk_ok, gc_offset, 3 * BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION, SCALAR_GATE)

    if STORE_FINAL_STATE:
        tl.store(state_out_ptr + state_ptrs, S0, mask=(block_channels < K)[:, None] & value_ok[None, :])
        if NKB > 1:
            tl.store(state_out_ptr + state_ptrs + BKB * V, S1,
                     mask=(BKB + block_channels < K)[:, None] & value_ok[None, :])
        if NKB > 2:
            tl.store(state_out_ptr + state_ptrs + 2 * BKB * V, S2,
                     mask=(2 * BKB + block_channels < K)[:, None] & value_ok[None, :])
            tl.store(state_out_ptr + state_ptrs + 3 * BKB * V, S3,
                     mask=(3 * BKB + block_channels < K)[:, None] & value_ok[None, :])


class StateOperands(NamedTuple):
    """What the state pass reads, rows [B*H, chunks*C] (the last chunk padded, its padding rows 0):
    W, U, Qg, Kd, A_qk by row, exp(G_C) and the bounds on |W|, |Qg|, |Kd|, |A_qk| by chunk; W, Qg and
    Kd as _to_scratch stores them (fp16 scaled by their bound for "fp16" dots, else fp32), the others
    fp32. kernels/_delta.py fills them for the delta rules, with per-row gate factors in place of the
    Qg and Kd tiles (``allocate``'s scalar_gate; their padding rows' factors meet q = k = 0 there),
    and with U in fp16 for "fp16" dots, scaled by its column peaks by chunk (u_peak, else None)."""

    w: torch.Tensor
    u: torch.Tensor
    u_peak: torch.Tensor | None
    qg: torch.Tensor
    kd: torch.Tensor
    gc: torch.Tensor
    aqk: torch.Tensor
    bounds: torch.Tensor

    @staticmethod
    def allocate(B: int, H: int, num_chunks: int, C: int, K: int, V: int, device: torch.device,
                 dot_precision: str, scalar_gate: bool = False) -> StateOperands:
        """Buffers for kda's operands, or with ``scalar_gate`` the delta rules' (the state pass's
        SCALAR_GATE): qg and kd then hold per-row factors [rows] (scale exp(G_t), exp(G_C - G_t)),
        bounds[:, 1:3] peak|q| and peak|k|, A_qk is stored like W, and so is U, with its column peaks.

        kda keeps U in fp32: its state pass, which holds Qg and Kd tiles where the delta rules' holds
        row factors, spilled with an fp16 U (ptxas: 84 bytes against 12) and took 0.650 ms against
        0.529 (H100, bench shape), more than its operands kernel saved (0.733 against 0.781 ms); the
        delta rules' prepare kernel and state pass each gained (0.598 / 0.415 against 0.637 / 0.431 ms)."""
        rows = B * H * num_chunks * C
        chunks = B * H * num_chunks
        operand = torch.float16 if dot_precision in ("fp16", "fp16_emulated") else torch.float32

        def new(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        if scalar_gate:
            u_peak = new(chunks, V) if operand == torch.float16 else None
            return StateOperands(new(rows, K, dtype=operand), new(rows, V, dtype=operand), u_peak, new(rows),
                                 new(rows), new(chunks, K), new(rows, C, dtype=operand), new(chunks, 4))
        return StateOperands(new(rows, K, dtype=operand), new(rows, V), None, new(rows, K, dtype=operand),
                             new(rows, K, dtype=operand), new(chunks, K), new(rows, C), new(chunks, 4))

    def u_precision(self, dot_precision: str) -> str:
        """How U is stored (the U_PRECISION of _store_u and _load_u): as W is, or in fp32."""
        return dot_precision if self.u.dtype == torch.float16 else "ieee"

    def u_peak_or_u(self) -> torch.Tensor:
        """The u_peak pointer argument: U itself where U is fp32 and has no peaks (never read then)."""
        return self.u if self.u_peak is None else self.u_peak


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


def resolve_state_pass(precision: str, num_stages: int | str, dtype: torch.dtype, K: int) -> tuple[str, int]:
    """(the dot precision, the number of stages) of the state pass for the ``precision`` and
    ``num_stages`` options (checked by the caller) and inputs of ``dtype`` with K key channels."""
    dot_precision = _dot_precision(precision, dtype)
    if num_stages == "auto":
        # Two stages of the state pass's fp32 operand tiles need 272 KB of shared memory with "tf32" dots
        # (sm_90 has 227 KB; the other precisions need 144-168 KB), and more than it has at K > 128.
        num_stages = 2 if block_size(K) <= 128 and dot_precision != "tf32" else 1
    return dot_precision, num_stages


def _value_block(block_v: int, V: int) -> int:
    """kda's V columns per program of the state pass (the delta rules keep the option's whole block)."""
    return min(block_v, block_size(V))


def bind_state_pass(operands: StateOperands, o: torch.Tensor, initial: torch.Tensor | None,
                    final: torch.Tensor | None, T: int, C: int, block_v: int, dot_precision: str,
                    num_warps: int, num_stages: int, scalar_gate_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> Launch:
    """Kernel 4 over ``operands``, bound: writes o [B, T, H, V] and, if given, the final state (fp32).
    ``scalar_gate_inputs`` (q, k) selects the delta rules' operands (StateOperands.allocate's scalar_gate)."""
    B, _, H, V = o.shape
    K = operands.gc.shape[1]
    num_chunks = triton.cdiv(T, C)
    BK = block_size(K)
    BKB = min(BK, STATE_CHANNEL_BLOCK)
    # The delta rules' q and k tiles are converted in registers before their dots; against V blocks of 16
    # (V <= 16) the H100 build gave wrong outputs (bf16, K = 44, V = 12) that the interpreter does not show,
    # so their V blocks are never narrower than the option (64 or 128), whatever V.
    BV = block_v if scalar_gate_inputs is not None else _value_block(block_v, V)
    return Launch(
        _kda_state_pass_kernel, (triton.cdiv(V, BV), B * H),
        operands.w, operands.u, operands.u_peak_or_u(), operands.qg, operands.kd, operands.gc, operands.aqk,
        operands.bounds, *(scalar_gate_inputs or (o, o)), o,
        initial if initial is not None else operands.gc, final if final is not None else operands.gc,
        T, H, K, V, num_chunks,
        C=C, BKB=BKB, NKB=BK // BKB, BV=BV, HAS_INITIAL_STATE=initial is not None,
        STORE_FINAL_STATE=final is not None, PRECISION=dot_precision, U_PRECISION=operands.u_precision(dot_precision),
        SCALAR_GATE=scalar_gate_inputs is not None,
        num_warps=num_warps, num_stages=num_stages,
    )


def _bind_intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      scale: float, scratch: _IntraScratch, dot_precision: str) -> list[Launch]:
    """The three kernels that need no carried state, each parallel over chunks (module docstring), bound."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    operands = scratch.operands
    C = operands.aqk.shape[1]
    num_chunks = triton.cdiv(T, C)
    BK = block_size(K)
    common = dict(PRECISION=dot_precision, GATE_DOT=_gate_dot(q.dtype))
    return [
        Launch(
            _kda_a_rows_kernel, (num_chunks * (C // SUB_CHUNK), B * H),
            q, k, g, scratch.akk, operands.aqk, T, H, K, scale,
            C=C, SUB=SUB_CHUNK, BK=BK, BKC=min(BK, A_ROWS_CHANNEL_SLICE), num_warps=A_ROWS_NUM_WARPS, **common,
        ),
        Launch(
            _kda_ut_inverse_kernel, (num_chunks, B * H),
            beta, scratch.akk, scratch.ut_matrix, T, H,
            C=C, SUB=SUB_CHUNK, PRECISION=dot_precision, num_warps=UT_INVERSE_NUM_WARPS,
        ),
        Launch(
            _kda_chunk_operands_kernel, (num_chunks, B * H),
            q, k, v, g, scratch.ut_matrix, operands.w, operands.u, operands.u_peak_or_u(), operands.qg, operands.kd,
            operands.gc, operands.bounds, T, H, K, V, scale,
            C=C, BK=BK, BKW=min(BK, INTRA_OUTPUT_BLOCK), BV=min(block_size(V), INTRA_OUTPUT_BLOCK),
            U_PRECISION=operands.u_precision(dot_precision), num_warps=OPERANDS_NUM_WARPS, **common,
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
    num_stages: int | str = "auto", await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    for name, value in (("chunk_size", chunk_size), ("precision", precision), ("block_v", block_v),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        _check_choice("chunkwise", name, value)
    B, T, H, K = k.shape
    V = v.shape[-1]
    if chunk_size == "auto":
        multiprocessors = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else None
        chunk_size = auto_chunk_size(B * H * triton.cdiv(V, _value_block(block_v, V)), multiprocessors)
    dot_precision, num_stages = resolve_state_pass(precision, num_stages, q.dtype, K)
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


@triton.jit
def _kda_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_in_ptr, state_out_ptr,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    """Token by token, S [BK, BV] fp32:
      S = exp(g_t)[:, None] * S
      S = S + beta_t k_t (v_t - S^T k_t)^T
      o_t = S^T (scale q_t)
    """
    v_block = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H

    channels = tl.arange(0, BK)
    values = v_block * BV + tl.arange(0, BV)
    channel_ok = channels < K
    value_ok = values < V

    state_ptrs = bh.to(tl.int64) * K * V + channels[:, None] * V + values[None, :]
    state_mask = channel_ok[:, None] & value_ok[None, :]
    if HAS_INITIAL_STATE:
        S = tl.load(state_in_ptr + state_ptrs, mask=state_mask, other=0.0)
    else:
        S = tl.zeros((BK, BV), dtype=tl.float32)

    for t in range(T):
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
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
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
    launch_after_checks(await_checks, Launch(
        _kda_recurrent_kernel, (triton.cdiv(V, BV), B * H),
        q, k, v, g, beta, o,
        initial if initial is not None else unused, final if final is not None else unused,
        T, H, K, V, scale,
        BK=BK, BV=BV, HAS_INITIAL_STATE=initial is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    ))
    return o, ((final,) if return_state else None)
