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

Two kernels do it:

1. ``_kda_intra_chunk_kernel``, grid (chunks, B*H), all chunks in parallel:
   everything that does not need the carried state. A_kk and A_qk by
   secondary chunking (sub-chunks of 16 rows), the inverse by block forward
   substitution, then W, U, Qg, Kd, exp(G_C) and A_qk go to fp32 scratch
   buffers ([B*H, chunks*C, *], the last chunk padded). The pairwise decay
   exp(G_t - G_j) does not factor out of a dot as a whole; for a sub-chunk
   of query rows starting at row r, every key row j < r is paired through
   the anchor r: exp(G_t - G_r) exp(G_r - G_j), both exponents <= 0 because
   j < r <= t. The anchor is the sub-chunk's FIRST row, so it is never later
   than the query it serves (no future row enters, also in a partial
   trailing sub-chunk). Diagonal 16 x 16 blocks use the same anchors by
   halving: at level h (8, 4, 2, 1) each group of 2h rows pairs its later
   half with its earlier half through the later half's first row, so every
   pair t > j is formed once, by one [16, BKC] x [BKC, 16] dot per level
   (the former [16, 16, 16] exp tiles, summed over channels with shuffles,
   and 16-channel steps with a barrier each kept the kernel latency-bound:
   6.9 ms at the bench shape). A_qk's diagonal t = j is sum_c q_tc k_tc.
2. ``_kda_state_pass_kernel``, grid (V blocks, B*H), sequential over chunks:
   the fp32 state stays in registers as up to four blocks of 64 key channels
   (as fla does: a whole [K, BV] fp32 tile and its [C, K] operands do not fit
   the registers and shared memory at K >= 128); per chunk four dots
   (W S, Qg S, A_qk Delta, Kd^T Delta) and no exp or cumsum: all gate work is
   in kernel 1. Fusing the output here saves storing per-chunk states (fp32
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
- ``chunk_size`` (64; 16, 32 or 64): C, a multiple of the 16-row sub-chunk.
- ``precision`` ("auto"): how the fp32 x fp32 dots run. "auto" is "fp16"
  for bf16 inputs, "bf16x3" for fp16 inputs and "ieee" for fp32 inputs.
  "fp16" scales each operand tile by a power of two (exact) so that a bound
  on its magnitude lands in [2^13, 2^14), rounds it to fp16 and does one fp16
  tensor-core product: 2^-11 relative per operand (down to 2^-27 of the
  bound), 4x below bf16's output rounding, at the cost of one bf16 product.
  The bound is the tile's own peak (a max-reduction across the warps) only
  where nothing cheaper bounds it: the A blocks' and W's operands are q or k
  times decays <= 1 (the chunk's peak |q| and |k| bound them, taken once);
  the state pass reads kernel 1's per-chunk bounds of W, Qg, Kd and Aqk and
  reduces only S and Delta, once a chunk each (H100, bench shape: the intra
  kernel 4.94 -> 4.12 ms, the state pass 1.07 -> 0.85 against a reduction
  per operand). Emulated in torch
  (bf16 inputs, K=V=128, T=64..4096) its excess is 1.016-1.019, against
  1.000 for fp32 dots and 1.68-1.78 for "bf16". For fp16 inputs it would sit
  at their own floor, so they keep "bf16x3" (each fp32 operand split into
  bf16 hi + lo, three bf16 products, about 2^-16 relative per product).
  "tf32x3" (three TF32 products, about 2^-21) costs twice "bf16x3" on tensor
  cores; "tf32" (2^-11) is faster but costs accuracy (fp16 especially);
  "bf16" rounds both operands to bf16 and does one product, fla's own choice
  and the fastest (SPEED_OPTIONS), at about fla's accuracy; "ieee" is exact
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
  of triton 3.6, .ci/sm90_compile.py, bf16 inputs, K=V=128, C=64): intra
  kernel (4 warps) 255 registers, 364 / 644 bytes of spill stores / loads
  ("fp16"), 40 KB shared memory; state pass at 2 stages 255 registers with
  128 ("fp16"), 280 ("bf16x3") or 28 ("bf16") bytes of spill stores and
  144-152 KB of shared memory ("tf32x3" 168 KB), "tf32" 272 KB (48 KB at 1
  stage); the limit is 227 KB (KB = 1024 bytes throughout).

Scratch traffic (fp32): W, U, Qg, Kd are [B*H, T, 128] each, A_qk [B*H, T, C]
(and four bounds per chunk):
at B=8, H=16, T=4096, K=V=128 that is 1.2 GB written by kernel 1 and read by
the state pass (about 0.55 ms at 4.3 TB/s); storing them in 16 bits would
halve it.

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

from ._util import block_size, no_pending_checks, zero_state

SUB_CHUNK = 16
INTRA_CHANNEL_SLICE = 128  # key channels per step of the intra-chunk A blocks (few, large steps: each costs barriers)
INTRA_OUTPUT_BLOCK = 32  # key or value channels per W, U, Qg, Kd block of the intra-chunk kernel (no spills at 32)
STATE_CHANNEL_BLOCK = 64  # key channels per state block S0..S3 of the state pass (K <= 4 blocks = 256)

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64)),
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

# The fastest setting (bench times it beside the default): fla's own rounding of every dot operand
# to bf16, about fla's accuracy (excess 1.4 to 2.9), not the lab's target.
SPEED_OPTIONS: dict[str, dict[str, object]] = {"chunkwise": {"precision": "bf16"}}

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
# Chunkwise, kernel 1 (parallel over chunks): everything that does not need the carried state
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
    the warps). The A blocks' operands are q or k times decays <= 1, so the chunk's peak |q| and
    |k| bound them; an operand far below its bound keeps 2^-11 relative error down to 2^-27 of
    the bound, where fp16 goes subnormal (such terms are that much smaller than the largest)."""
    if PRECISION == "fp16" or PRECISION == "fp16_emulated":
        a_up, a_down = _fp16_scale(a_peak)
        b_up, b_down = _fp16_scale(b_peak)
        a16 = (a * a_up).to(tl.float16)
        b16 = (b * b_up).to(tl.float16)
        if PRECISION == "fp16":
            product = tl.dot(a16, b16)
        else:
            product = tl.dot(a16.to(tl.float32), b16.to(tl.float32), input_precision="ieee")
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
def _kda_intra_chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, qg_ptr, kd_ptr, gc_ptr, aqk_ptr, bounds_ptr,
    T, H, K, V, scale,
    C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, BKW: tl.constexpr,
    BV: tl.constexpr, PRECISION: tl.constexpr, GATE_DOT: tl.constexpr,
):
    """One chunk, fp32 throughout; rows past T read as 0 (g = 0 adds no decay).

    A [C, C] block row I (query rows t = r .. r+SUB-1, r = I*SUB) against key rows j,
    summed over key channels in slices of BKC (the decays are per channel):
      j < r:  (k_I exp(G_I - G_r)) . (k_j exp(G_r - G_j)), one dot through the anchor r;
      j in the sub-chunk: by halving, level h pairing rows t >= a with j < a in each
              group of 2h rows through its anchor a (one dot per level), plus t = j for A_qk.
    Inverse X = (I + Diag(beta) A_kk)^-1 by block rows:
      X_II = (I + L_II)^-1 by forward substitution, X_I = X_II (E_I - L_I,<r X_<r).
    Then, with T = X Diag(beta):
      W = T (K exp(G)),  U = T V,  Qg = scale Q exp(G),  Kd = K exp(G_C - G),  gC = exp(G_C),
      Aqk = scale A_qk (t >= j, 0 above the diagonal).
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    NC: tl.constexpr = C // SUB
    LOG_SUB: tl.constexpr = 4  # halving levels of a SUB = 16 row diagonal block

    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    local = tl.arange(0, SUB)
    slice_channels = tl.arange(0, BKC)
    blocks = tl.arange(0, NC)

    positions = chunk * C + rows
    row_ok = positions < T
    token = (b * T + positions).to(tl.int64) * H + h  # index of (b, t, h) in [B, T, H]
    beta = tl.load(beta_ptr + token, mask=row_ok, other=0.0).to(tl.float32)
    # Scratch rows of this chunk in the [B*H, chunks*C, *] buffers (partial chunks padded).
    scratch_row = bh.to(tl.int64) * tl.num_programs(0) * C + chunk * C + rows
    aqk_base = (bh.to(tl.int64) * tl.num_programs(0) + chunk) * C * C

    # Peaks of the chunk's |q| and |k|: every operand of the A blocks and of W is q or k times decays <= 1.
    q_peak = 0.0
    k_peak = 0.0
    for channel_start in range(0, BK, BKC):
        channels = channel_start + slice_channels
        ptrs = token[:, None] * K + channels[None, :]
        mask = row_ok[:, None] & (channels < K)[None, :]
        q_peak = tl.maximum(q_peak, _peak(tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)))
        k_peak = tl.maximum(k_peak, _peak(tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)))

    X3 = tl.zeros((NC, SUB, C), dtype=tl.float32)  # block rows of (I + L)^-1 found so far
    for I in tl.static_range(NC):
        r = I * SUB
        strip_positions = chunk * C + r + local
        strip_ok = strip_positions < T
        strip_token = (b * T + strip_positions).to(tl.int64) * H + h
        beta_I = tl.load(beta_ptr + strip_token, mask=strip_ok, other=0.0).to(tl.float32)

        aqk_before = tl.zeros((SUB, C), dtype=tl.float32)  # A_qk[I, :r]
        akk_before = tl.zeros((SUB, C), dtype=tl.float32)  # A_kk[I, :r]
        aqk_diag = tl.zeros((SUB, SUB), dtype=tl.float32)  # A_qk[I, I]
        akk_diag = tl.zeros((SUB, SUB), dtype=tl.float32)  # A_kk[I, I]
        for channel_start in range(0, BK, BKC):
            channels = channel_start + slice_channels
            channel_ok = channels < K
            strip_ptrs = strip_token[:, None] * K + channels[None, :]
            strip_mask = strip_ok[:, None] & channel_ok[None, :]
            q_I = tl.load(q_ptr + strip_ptrs, mask=strip_mask, other=0.0).to(tl.float32)
            k_I = tl.load(k_ptr + strip_ptrs, mask=strip_mask, other=0.0).to(tl.float32)
            g16_I = tl.load(g_ptr + strip_ptrs, mask=strip_mask, other=0.0)  # input dtype, for _span_sums
            if I > 0:
                # Anchor row r: G_t - G_r = sum_{r < s <= t} g_s for the query rows t >= r, and
                # G_r - G_j = sum_{j < s <= r} g_s for the key rows j < r (rows from r on: k is 0).
                tile_ptrs = token[:, None] * K + channels[None, :]
                to_anchor = tl.exp(_span_sums((local[None, :] > 0) & (local[None, :] <= local[:, None]), g16_I, GATE_DOT))
                g_chunk = tl.load(g_ptr + tile_ptrs, mask=row_ok[:, None] & channel_ok[None, :], other=0.0)
                from_anchor = tl.exp(_span_sums((rows[:, None] < cols[None, :]) & (cols[None, :] <= r), g_chunk, GATE_DOT))
                # Key rows j < r only (earlier sub-chunks); rows from r on are 0 here.
                k_before = tl.load(k_ptr + tile_ptrs, mask=((rows < r) & row_ok)[:, None] & channel_ok[None, :], other=0.0)
                keys_before = tl.trans(k_before.to(tl.float32) * from_anchor)  # [BKC, C]
                aqk_before += _dot_within(q_I * to_anchor, q_peak, keys_before, k_peak, PRECISION)
                akk_before += _dot_within(k_I * to_anchor, k_peak, keys_before, k_peak, PRECISION)
            # Diagonal block by halving: at level h every group of 2h rows pairs its later half
            # (t >= a) with its earlier half (j < a) through the anchor a, the later half's first
            # row, so each pair t > j is formed once, at the level that separates them.
            for level in tl.static_range(LOG_SUB):
                half = SUB >> (level + 1)
                anchor = (local // (2 * half)) * (2 * half) + half
                later_half = local >= anchor
                # Exponents G_t - G_a (t >= a) and G_a - G_j (j < a): sums of the steps spanned.
                span = tl.where(later_half[:, None],
                                (anchor[:, None] < local[None, :]) & (local[None, :] <= local[:, None]),
                                (local[:, None] < local[None, :]) & (local[None, :] <= anchor[:, None]))
                decay = tl.exp(_span_sums(span, g16_I, GATE_DOT))
                keys = tl.trans(tl.where(later_half[:, None], 0.0, k_I * decay))  # [BKC, SUB], rows j < a
                pair = ((local[:, None] // (2 * half)) == (local[None, :] // (2 * half))) & later_half[:, None]
                later_k = tl.where(later_half[:, None], k_I * decay, 0.0)
                later_q = tl.where(later_half[:, None], q_I * decay, 0.0)
                akk_diag += tl.where(pair, _dot_within(later_k, k_peak, keys, k_peak, PRECISION), 0.0)
                aqk_diag += tl.where(pair, _dot_within(later_q, q_peak, keys, k_peak, PRECISION), 0.0)
            aqk_diag += tl.where(local[:, None] == local[None, :], tl.sum(q_I * k_I, axis=1)[:, None], 0.0)

        # X_II = (I + L_II)^-1, column by column: X_II -= L[:, jj] X_II[jj, :] (row jj is final).
        l_diag = tl.where(local[:, None] > local[None, :], beta_I[:, None] * akk_diag, 0.0)
        X_II = (local[:, None] == local[None, :]).to(tl.float32)
        for jj in range(SUB):
            l_col = tl.sum(tl.where(local[None, :] == jj, l_diag, 0.0), axis=1)
            x_row = tl.sum(tl.where(local[:, None] == jj, X_II, 0.0), axis=0)
            X_II -= l_col[:, None] * x_row[None, :]
        rhs = (cols[None, :] == r + local[:, None]).to(tl.float32)  # E_I
        if I > 0:
            rhs -= _dot(beta_I[:, None] * akk_before, tl.reshape(X3, (C, C)), PRECISION)
        X_I = _dot(X_II, rhs, PRECISION)
        X3 = tl.where((blocks == I)[:, None, None], X_I[None, :, :], X3)

        # scale A_qk: the strip left of the diagonal block (0 right of it), then the block itself.
        aqk_rows = aqk_base + (r + local)[:, None] * C
        outside = (cols < r) | (cols >= r + SUB)
        tl.store(aqk_ptr + aqk_rows + cols[None, :], aqk_before * scale, mask=outside[None, :])
        tl.store(aqk_ptr + aqk_rows + (r + local)[None, :], aqk_diag * scale)

    # W, Qg, Kd and gC, BKW key channels at a time; G is summed from the chunk start (exp(G) <= 1)
    # and G_C - G over the later steps only (a suffix sum, exp <= 1).
    t_matrix = tl.reshape(X3, (C, C)) * beta[None, :]
    t_peak = _peak(t_matrix)
    w_peak = 0.0
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
        w = _dot_within(t_matrix, t_peak, k * from_start, k_peak, PRECISION)
        w_peak = tl.maximum(w_peak, _peak(w))
        tl.store(w_ptr + out_ptrs, w, mask=channel_ok[None, :])
        tl.store(qg_ptr + out_ptrs, (q * scale) * from_start, mask=channel_ok[None, :])
        tl.store(kd_ptr + out_ptrs, k * to_end, mask=channel_ok[None, :])
        tl.store(gc_ptr + (bh.to(tl.int64) * tl.num_programs(0) + chunk) * K + channels,
                 tl.exp(tl.sum(g.to(tl.float32), axis=0)), mask=channel_ok)
    for value_start in range(0, V, BV):
        values = value_start + tl.arange(0, BV)
        value_ok = values < V
        v = tl.load(v_ptr + token[:, None] * V + values[None, :], mask=row_ok[:, None] & value_ok[None, :],
                    other=0.0).to(tl.float32)
        u = _dot_within(t_matrix, t_peak, v, _peak(v), PRECISION)
        tl.store(u_ptr + scratch_row[:, None] * V + values[None, :], u, mask=value_ok[None, :])
    # Bounds on |W|, |Qg|, |Kd| and |Aqk| (|sum_c q_tc k_jc decay| <= K peak|q| peak|k|) for the state
    # pass's fp16 scales, which then need no reduction on its sequential path.
    which = tl.arange(0, 4)
    abs_scale = tl.abs(scale)
    bounds = tl.where(which == 0, w_peak, tl.where(which == 1, abs_scale * q_peak,
                      tl.where(which == 2, k_peak, abs_scale * K * q_peak * k_peak)))
    tl.store(bounds_ptr + (bh.to(tl.int64) * tl.num_programs(0) + chunk) * 4 + which, bounds)


# ---------------------------------------------------------------------------
# Chunkwise, kernel 2: the state pass over chunks, writing the output
# ---------------------------------------------------------------------------


@triton.jit
def _project_block(w_ptr, qg_ptr, S, scratch_row, channel_start, K, ws, qs, w_bound, qg_bound,
                   BKB: tl.constexpr, PRECISION: tl.constexpr):
    """Adds one block of BKB key channels to ws = W S and qs = Qg S."""
    channels = channel_start + tl.arange(0, BKB)
    ptrs = scratch_row[:, None] * K + channels[None, :]
    mask = (channels < K)[None, :]
    s_peak = _peak(S)
    ws += _dot_within(tl.load(w_ptr + ptrs, mask=mask, other=0.0), w_bound, S, s_peak, PRECISION)
    qs += _dot_within(tl.load(qg_ptr + ptrs, mask=mask, other=0.0), qg_bound, S, s_peak, PRECISION)
    return ws, qs


@triton.jit
def _advance_block(kd_ptr, gc_ptr, S, delta, scratch_row, gc_offset, channel_start, K, kd_bound, delta_peak,
                   BKB: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BKB key channels of S_next = gC * S (rows) + Kd^T Delta."""
    channels = channel_start + tl.arange(0, BKB)
    channel_ok = channels < K
    kd_t = tl.load(kd_ptr + scratch_row[None, :] * K + channels[:, None],
                   mask=channel_ok[:, None], other=0.0)  # [BKB, C]
    decay = tl.load(gc_ptr + gc_offset + channels, mask=channel_ok, other=0.0)
    return decay[:, None] * S + _dot_within(kd_t, kd_bound, delta, delta_peak, PRECISION)


@triton.jit
def _kda_state_pass_kernel(
    w_ptr, u_ptr, qg_ptr, kd_ptr, gc_ptr, aqk_ptr, bounds_ptr, o_ptr, state_in_ptr, state_out_ptr,
    T, H, K, V, num_chunks,
    C: tl.constexpr, BKB: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """S [NKB * BKB, BV] fp32 in registers, held as NKB (1, 2 or 4) blocks S0..S3 of BKB key
    channels (as fla does: one [K, BV] fp32 tile does not fit at K >= 128). Per chunk, from
    kernel 1's W, U, Qg, Kd, gC and Aqk:
      Delta  = U - W S
      O      = Qg S + Aqk Delta
      S_next = gC * S + Kd^T Delta      (block by block)
    The fp16 scales of W, Qg, Kd and Aqk come from kernel 1's bounds, those of S and Delta from one
    reduction each per chunk (a product of "fp16" otherwise reduces both of its operands).
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

        ws = tl.zeros((C, BV), dtype=tl.float32)
        qs = tl.zeros((C, BV), dtype=tl.float32)
        ws, qs = _project_block(w_ptr, qg_ptr, S0, scratch_row, 0, K, ws, qs, w_bound, qg_bound,
                                    BKB, PRECISION)
        if NKB > 1:
            ws, qs = _project_block(w_ptr, qg_ptr, S1, scratch_row, BKB, K, ws, qs, w_bound, qg_bound,
                                    BKB, PRECISION)
        if NKB > 2:
            ws, qs = _project_block(w_ptr, qg_ptr, S2, scratch_row, 2 * BKB, K, ws, qs, w_bound, qg_bound,
                                    BKB, PRECISION)
            ws, qs = _project_block(w_ptr, qg_ptr, S3, scratch_row, 3 * BKB, K, ws, qs, w_bound, qg_bound,
                                    BKB, PRECISION)

        u = tl.load(u_ptr + scratch_row[:, None] * V + values[None, :], mask=value_ok[None, :], other=0.0)
        delta = u - ws
        delta_peak = _peak(delta)
        aqk = tl.load(aqk_ptr + scratch_row[:, None] * C + cols[None, :])
        o = qs + _dot_within(aqk, aqk_bound, delta, delta_peak, PRECISION)
        tl.store(o_ptr + token[:, None] * V + values[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & value_ok[None, :])

        S0 = _advance_block(kd_ptr, gc_ptr, S0, delta, scratch_row, gc_offset, 0, K, kd_bound,
                                delta_peak, BKB, PRECISION)
        if NKB > 1:
            S1 = _advance_block(kd_ptr, gc_ptr, S1, delta, scratch_row, gc_offset, BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION)
        if NKB > 2:
            S2 = _advance_block(kd_ptr, gc_ptr, S2, delta, scratch_row, gc_offset, 2 * BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION)
            S3 = _advance_block(kd_ptr, gc_ptr, S3, delta, scratch_row, gc_offset, 3 * BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION)

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


class _IntraScratch(NamedTuple):
    """Kernel 1's fp32 outputs, rows [B*H, chunks*C] (the last chunk padded): W, U, Qg, Kd, A_qk by
    row, exp(G_C) and the bounds (peak |W|, then bounds on |Qg|, |Kd|, |A_qk|) by chunk."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kd: torch.Tensor
    gc: torch.Tensor
    aqk: torch.Tensor
    bounds: torch.Tensor

    @staticmethod
    def allocate(B: int, H: int, num_chunks: int, C: int, K: int, V: int, device: torch.device) -> _IntraScratch:
        rows = B * H * num_chunks * C
        new = lambda *shape: torch.empty(shape, dtype=torch.float32, device=device)  # noqa: E731
        return _IntraScratch(new(rows, K), new(rows, V), new(rows, K), new(rows, K), new(B * H * num_chunks, K),
                             new(rows, C), new(B * H * num_chunks, 4))


def _launch_intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        scale: float, scratch: _IntraScratch, dot_precision: str) -> None:
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = scratch.aqk.shape[1]
    BK = block_size(K)
    _kda_intra_chunk_kernel[(triton.cdiv(T, C), B * H)](
        q, k, v, g, beta, *scratch, T, H, K, V, scale,
        C=C, SUB=SUB_CHUNK, BK=BK, BKC=min(BK, INTRA_CHANNEL_SLICE), BKW=min(BK, INTRA_OUTPUT_BLOCK),
        BV=min(block_size(V), INTRA_OUTPUT_BLOCK), PRECISION=dot_precision, GATE_DOT=_gate_dot(q.dtype), num_warps=4,
    )


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    state: tuple[torch.Tensor] | None, return_state: bool,
    chunk_size: int = 64, precision: str = "auto", block_v: int = 64, num_warps: int = 4,
    num_stages: int | str = "auto", await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    for name, value in (("chunk_size", chunk_size), ("precision", precision), ("block_v", block_v),
                        ("num_warps", num_warps), ("num_stages", num_stages)):
        _check_choice("chunkwise", name, value)
    B, T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    num_chunks = triton.cdiv(T, C)
    BK = block_size(K)
    BKB = min(BK, STATE_CHANNEL_BLOCK)
    BV = min(block_v, block_size(V))
    dot_precision = _dot_precision(precision, q.dtype)
    if num_stages == "auto":
        # Two stages of the state pass's fp32 operand tiles need 272 KB of shared memory with "tf32" dots
        # (sm_90 has 227 KB; the other precisions need 144-168 KB), and more than it has at K > 128.
        num_stages = 2 if BK <= 128 and dot_precision != "tf32" else 1

    scratch = _IntraScratch.allocate(B, H, num_chunks, C, K, V, q.device)
    o = torch.empty_like(v)
    initial = state[0] if state is not None else None
    final = zero_state((B, H, K, V), q.device) if return_state else None
    await_checks()
    _launch_intra_chunk(q, k, v, g, beta, scale, scratch, dot_precision)
    w, u, qg, kd, gc, aqk, bounds = scratch
    _kda_state_pass_kernel[(triton.cdiv(V, BV), B * H)](
        w, u, qg, kd, gc, aqk, bounds, o,
        initial if initial is not None else gc, final if final is not None else gc,
        T, H, K, V, num_chunks,
        C=C, BKB=BKB, NKB=BK // BKB, BV=BV, HAS_INITIAL_STATE=initial is not None, STORE_FINAL_STATE=return_state,
        PRECISION=dot_precision, num_warps=num_warps, num_stages=num_stages,
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
    await_checks()
    _kda_recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, o,
        initial if initial is not None else unused, final if final is not None else unused,
        T, H, K, V, scale,
        BK=BK, BV=BV, HAS_INITIAL_STATE=initial is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    )
    return o, ((final,) if return_state else None)
