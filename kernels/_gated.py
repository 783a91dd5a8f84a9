"""Triton kernels of the gated linear family with per-channel gates (gla, general).

Recurrence (FORMULATIONS.md, ``general``; gla is ``gk = g``, ``gv = None``):

    S_t = (exp(gk_t) exp(gv_t)^T) * S_{t-1} + k_t v_t^T,    o_t = S_t^T (scale q_t)

Conventions: ``q, k, gk [B, T, H, K]``, ``v, gv, o [B, T, H, V]``, the state
``S [B, H, K, V]`` in fp32; inputs are fp16, bf16 or fp32 (one dtype,
contiguous); log gates ``<= 0`` (either gate may be None: no decay on that
side). ``o`` comes back in the input dtype, the state in fp32.

Chunkwise algorithm (chunks of BT positions; Gk_t, Gv_t are the gates' prefix
sums over the chunk up to and including t; C is the chunk's last row):

    inter:  o_t[v] = exp(Gv_t[v]) sum_k q_t[k] exp(Gk_t[k]) S_c[k, v]
    intra:  o_t[v] = sum_{j<=t} A_tj exp(Gv_t[v] - Gv_j[v]) v_j[v],
            A_tj   = sum_k q_t[k] k_j[k] exp(Gk_t[k] - Gk_j[k])
    state:  S_{c+1} = (exp(Gk_C) exp(Gv_C)^T) * S_c
                      + (k * exp(Gk_C - Gk))^T (v * exp(Gv_C - Gv))

Three launches: the chunk states (sequential over chunks, the state kept in
fp32), the intra-chunk scores A, the outputs (parallel over chunks).

Every log decay is a direct sum of the gates it spans, never a difference of
two cumulative sums: a difference G_t - G_j of chunk-level sums carries the
rounding of |G_t| (up to BT * |g|), several times fp32 inputs' rounding
floor on strong gates, while a direct sum's error scales with the decay
exponent itself. The sums are tensor-core dots of a 0/1 row-selection matrix
with the gate tile (``_numerics.span_sums``): the gates are values of the
input dtype, so each product is exact and the dot accumulates in fp32 (an
exact fp32 dot for fp32 inputs); one dot replaces a scan. Sums of gates <= 0
are <= 0, so no positive exponent is evaluated.

A per-channel decay cannot be factored out of a dot as a whole, and the
``q * exp(G)`` / ``k * exp(-G)`` split overflows on strong gates. The intra
terms use a binary hierarchy of reference rows instead: a pair t > j is taken
at the level ``HALF`` of the highest bit where t and j differ (indices in the
chunk), so both lie in one aligned block of 2 HALF rows, t in its upper half,
j in its lower half, and the last row r of the lower half sits between them
(j <= r < t). Then

    exp(Gk_t - Gk_j) = exp(sum_{s in (r, t]} gk_s) * exp(sum_{s in (j, r]} gk_s),

both factors <= 1, and each level is one tensor-core dot over full tiles
(rows outside a level's halves zeroed before the dot; a pair keeps the value
of the last level with t in an upper and j in a lower half, its own level):
log2(BT) dots instead of BT^2 element-wise decays. The diagonal A_tt needs no
decay. The scores kernel runs the levels HALF >= 16 on full [BT, BT] tiles and
the levels below, which stay inside the 16 x 16 diagonal blocks, as batched
dots over the chunk's sub-chunks of 16 rows ([BT / 16, 16, 16]): the same
sums, without full-tile dots that are mostly zeros. The value gate gv gets
the same treatment (full tiles, every level) on the V side of A @ v.

Precision (``precision`` option): the decayed operands (q * exp(G),
k * exp(...), v * exp(...)), the fp32 state and the fp32 scores are not values
of the input dtype, so a dot on them is done as

- "auto" (default): "fp16" for bf16 inputs, "split" for fp16, "ieee" for fp32.
- "fp16": both operands through fp16 in one tensor-core dot. Each operand
  tile is scaled by a power of two to a peak in [2^13, 2^14)
  (``_numerics.pow2_scale``), so bf16 values convert exactly (8 of fp16's 11
  bits), fp32 ones carry 2^-11 relative error (4x below bf16's output
  rounding), nothing overflows and values down to 2^-27 of the tile's peak
  stay normal; the scales come out of the fp32 product exactly. One scale per
  tile, not per row or column (per row they round the same values to the
  same 11 bits), and taken from a bound where one is known (a decay <= 1 only
  lowers a tile; q and k, or k and v, share one): a reduction across warps
  costs more than the dot it feeds. h and A are stored in fp16, already
  scaled, with one fp32 inverse scale per tile (h's from a running bound on
  |S|, A's from |A| <= sum_K |q| |k|): half the bytes of fp32 and no scaling
  pass in the output kernel. Its bf16 excess is near 1, where "input" is
  about 1.5.
- "split": x = hi + lo with hi, lo in the input dtype, three
  tensor-core dots (hi.hi + hi.lo + lo.hi; two when the other operand is an
  input-dtype tensor). About 16 bits (bf16) or 22 bits (fp16) per operand.
- "tf32x3": fp32 operands through ``input_precision="tf32x3"``.
- "tf32": fp32 operands through TF32 (11 significant bits).
- "ieee": exact fp32 dots (CUDA cores; slow).
- "input": round the fp32 operand to the input dtype, one dot (what
  flash-linear-attention does; fastest, least accurate).

fp32 inputs use exact fp32 dots in "auto", "fp16", "split" and "input". fp16
has a narrow exponent range, so in "split" and "input" modes the rows of the
left operand and the columns of the right one are first scaled to a maximum
of 1 (the state can exceed 65504; tiny decayed values would lose their low
part to underflow) and the scales reapplied to the fp32 product.

The per-chunk states h and the scores A are stored in fp32, except with "fp16"
(scaled fp16, above) and with "input" on bf16 (bf16: every dot reading them
rounds them to bf16 anyway); both halve the dominant memory traffic
(h: B H T K V / BT).

Measurements behind these choices (timings, emulated excess): reports/bench.md,
"Design history moved from the kernel docstrings".

Backward. The cotangents are do (o's) and dS_T (the final state's, or none); dS_c is the
cotangent of the state entering chunk c (dS_NT = dS_T, dS_0 the initial state's gradient):

    dS_c  = (exp(Gk_C) exp(Gv_C)^T) * dS_{c+1} + scale (q * exp(Gk))^T (do * exp(Gv))
    dA_tj = scale sum_v do_t[v] v_j[v] exp(Gv_t[v] - Gv_j[v])            (j <= t)
    dq_t  = scale exp(Gk_t) * (S_c (do_t * exp(Gv_t)))        + sum_{j<=t} dA_tj exp(Gk_t - Gk_j) * k_j
    dk_j  = exp(Gk_C - Gk_j) * (dS_{c+1} (v_j * exp(Gv_C - Gv_j))) + sum_{t>=j} dA_tj exp(Gk_t - Gk_j) * q_t
    dv_j  = exp(Gv_C - Gv_j) * (dS_{c+1}^T (k_j * exp(Gk_C - Gk_j)))
            + scale sum_{t>=j} A_tj exp(Gv_t - Gv_j) * do_t

Every decay is the forward's: prefix and suffix span sums, and the reference-row levels for the
intra-chunk pairs (dq, o on a level's upper rows, dk, dv on its lower rows), so no exponent is
positive. The log gate gk_s (s in chunk c) acts on exactly the terms whose decay spans s: the
state's decay across the chunk, the inter terms q_t S_c with t >= s and k_j dS_{c+1} with j < s,
and the intra pairs j < s <= t. Its gradient sums those terms directly:

    dgk_s = exp(Gk_C) * sum_v (exp(Gv_C) * S_c * dS_{c+1}) + sum_{t>=s} q_t dq_t^inter
            + sum_{j<s} k_j dk_j^inter + sum_levels spanning @ (q * dq_level + k * dk_level)

and dgv_s the same on the value side (do, o in place of q, dq; v, dv in place of k, dk). The
textbook route, a reverse cumulative sum of q * dq - k * dk over the sequence, is the same number
written as a difference: each pair enters with + at t and - at j, and on fp32 inputs the
cancellation cost 7x to 23x the rounding floor on the registry's inputs (1.3x to 1.6x here). A
level's spanning sums are masked sums of products within one half-block (a dot of a 0/1 matrix
with the products), and none crosses a chunk: the chunk's view takes S_c and dS_{c+1} as given.

Chunkwise launches: the chunk states h (the forward's kernel, again), the state cotangents dh
(sequential over chunks, from the last), dA (the forward's scores kernel on (do, v, gv) in place of
(q, k, gk)), then dq, dk, dgk (per K block) and dv, dgv (per V block), parallel over chunks.
The backward takes its own chunks of at most BACKWARD_CHUNK rows, at most the forward's chunk_size:
the dq/dk and dv kernels hold about eight [BT, BK] fp32 tiles beside [BT, BT] ones, which at BT = 64
on 4 warps spill (reports/bench.md). What the forward saves: its scores A (B H T BT_f entries, fp16
in "fp16" mode, fp32 in most others: half to once q's bytes at BT_f = 64), which the dv kernel reads
where it needs A, each backward chunk's pairs a diagonal block of a forward tile (the forward's
chunk is a power-of-two multiple of the backward's); recomputing them cost a scores launch as long
as the forward's own. Except for fp16 inputs in "fp16" mode: there the forward's A carries fp16
operand roundings as large as the output's own (harmless for bf16, whose rounding is 8x larger), so
the backward recomputes A in "split" (on strong gates, dv 1.09 -> 1.35 and dgv 1.75 -> 2.35 times the
floor when it read the forward's). Not h: it is B H T K V / BT floats, V / BT times q's size, too much to keep
for a recomputation that costs one sequential pass of dots. The backward keeps h and dA in fp32
(the kernel recomputing h runs "fp16" as "split"), and dh in fp32 except in "fp16" mode (bf16's
default) without a value gate, where its tiles are fp16, scaled by a power of two from their peak:
the dots that read it round it so anyway, and at 32-row chunks the states are the backward's largest
traffic (1.07 GB each in fp32 at the bench shape, written once, read twice). With a value gate the
dq/dk and dv kernels do more work per tile and the conversions cost more than the bytes saved
(measured: reports/bench.md). Its own kernels take every mode as the forward's do; o's inter and
level terms, which dgv multiplies by do, are recomputed in fp32 (the returned o is rounded, and
holds them only as a sum).

Recurrent backward: dgk_t = sum_v dS_t * D_t * S_{t-1} needs the forward's states in reverse order.
The forward (with ``saved``) stores the state every RECURRENT_SEGMENT steps (B H T K V / 64 floats);
the backward walks the segments from the last, replays each one's states into a per-program
scratch, then runs the dual recurrence backwards through it (dS += scale q_t do_t^T; dq_t, dk_t, dv_t,
dgk_t, dgv_t; dS = D_t * dS): each step's gate gradient is its own sum of products, no cumulative
sum. dq, dk and dgk sum over V blocks: one fp32 part per block, added after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels._numerics import peak, pow2_scale, span_sums
from attnlab.kernels._util import (
    Launch, block_size, gpu_shape_known_bad, launch_after_checks, no_pending_checks, triton_dtype,
)

PRECISIONS = ("auto", "fp16", "split", "tf32x3", "tf32", "ieee", "input")
CHUNK_SIZES = (16, 32, 64)
# The recurrent backward's segment: the forward checkpoints the state every RECURRENT_SEGMENT steps, and
# the backward replays one segment at a time (module docstring, "Backward").
RECURRENT_SEGMENT = 64
# The chunkwise backward's largest chunk (module docstring, "Backward").
BACKWARD_CHUNK = 32

# The fastest chunkwise setting (one bf16/fp16 tensor-core dot per product, h and A stored in
# bf16 for bf16 inputs), as flash-linear-attention computes; ``attnlab bench`` times it beside
# the default.
SPEED_OPTIONS = {"precision": "input"}

# The chunkwise kernels' tunables (name -> (default, allowed values)); attnlab.kernel checks
# them before a launch. chunk_size is the largest chunk (short sequences use one chunk of
# next_pow2(T), at least 16); block_k / block_v are the K and V tiles (head dimensions above
# them are looped over or split across programs); num_warps / num_stages go to every launch.
# The defaults are the fastest measured at the bench shape, at the same accuracy (reports/bench.md).
CHUNKWISE_OPTIONS = {
    "chunk_size": (64, CHUNK_SIZES),
    "precision": ("auto", PRECISIONS),
    "block_k": (64, (16, 32, 64, 128)),
    "block_v": (128, (16, 32, 64, 128)),
    "num_warps": (4, (1, 2, 4, 8)),
    "num_stages": (2, (1, 2, 3, 4)),
}


# --------------------------------------------------------------------------------------------
# Dots on fp32 operands
# --------------------------------------------------------------------------------------------


@triton.jit
def _normalise(x, AXIS: tl.constexpr):
    """x = scale * y with scale = 2^floor(log2(max |x|)) along AXIS (1 where the line is 0).

    A power of two makes the rescaling exact, so each y rounds to fp16 exactly as x would at its
    own magnitude: an entry's rounding does not depend on the other entries of its line (apart
    from fp16 subnormals, 2^14 below the line's peak). Dividing by the peak itself would make every
    entry's rounding depend on the line's largest entry, which for a chunk's key rows includes
    future positions, and break bitwise causality.
    """
    line_peak = tl.max(tl.abs(x), axis=AXIS, keep_dims=True)
    power = (line_peak.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    scale = tl.where(line_peak >= 1.1754943508222875e-38, power, 1.0)
    return x / scale, scale


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b in fp32, where a and b are each fp32 or of the input dtype DT.

    PRECISION is "fp16", "split", "input", or a tl.dot input_precision ("ieee", "tf32x3", "tf32"),
    which the driver always uses for fp32 inputs. DT operands are exact in every mode.
    """
    if PRECISION == "fp16":
        a_scale, a_inverse = pow2_scale(peak(a.to(tl.float32)), 13)
        b_scale, b_inverse = pow2_scale(peak(b.to(tl.float32)), 13)
        product = tl.dot((a * a_scale).to(tl.float16), (b * b_scale).to(tl.float16), out_dtype=tl.float32)
        # One inverse at a time: their product alone may leave fp32's range.
        return acc + (product * a_inverse) * b_inverse
    elif PRECISION == "split":
        return _dot_narrow(a, b, acc, True, DT)
    elif PRECISION == "input":
        return _dot_narrow(a, b, acc, False, DT)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)


@triton.jit
def _dot_narrow(a, b, acc, SPLIT: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b by tensor-core dots in DT (fp16/bf16): an fp32 operand x is rounded to
    hi = DT(x) and, with SPLIT, its remainder lo = DT(x - hi) gets its own dot (lo.lo dropped).
    For fp16 the fp32 operands are first normalised (rows of a, columns of b) to max |.| in [1, 2); 3-D
    operands are batches of 2-D ones."""
    A_WIDE: tl.constexpr = a.dtype == tl.float32
    B_WIDE: tl.constexpr = b.dtype == tl.float32
    NARROW: tl.constexpr = DT == tl.float16
    if A_WIDE and NARROW:
        a, a_scale = _normalise(a, len(a.shape) - 1)
    if B_WIDE and NARROW:
        b, b_scale = _normalise(b, len(b.shape) - 2)
    a_hi = a.to(DT)
    b_hi = b.to(DT)
    product = tl.dot(a_hi, b_hi, out_dtype=tl.float32)
    if SPLIT and A_WIDE:
        product = tl.dot((a - a_hi.to(tl.float32)).to(DT), b_hi, product, out_dtype=tl.float32)
    if SPLIT and B_WIDE:
        product = tl.dot(a_hi, (b - b_hi.to(tl.float32)).to(DT), product, out_dtype=tl.float32)
    if A_WIDE and NARROW:
        product = product * a_scale
    if B_WIDE and NARROW:
        product = product * b_scale
    return acc + product


# --------------------------------------------------------------------------------------------
# Chunkwise kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _level_select(local, LEVEL: tl.constexpr):
    """The masks of level HALF = 2^LEVEL over chunk rows (module docstring), each from row indices.

    ``upper`` [BT, 1], ``lower`` [1, BT]: the row (column) lies in the upper (lower) half of its
    aligned block of 2 HALF rows.
    ``same_block`` [BT, BT]: both rows lie in one such block.
    ``select`` [BT, BT]: the gate rows whose sum is a row's log decay to its reference row r, the
    last row of the lower half: (r, x] for an upper row x, (x, r] for a lower row x; in both cases
    the rows s of x's own half with s <= x (upper) or s > x (lower).
    (LEVEL, not HALF, is the argument: a static_range loop variable stays a constexpr only as
    such; ``1 << level`` in the loop body would be a tensor on the GPU compiler.)
    """
    HALF: tl.constexpr = 1 << LEVEL
    upper = ((local % (2 * HALF)) >= HALF)[:, None]
    lower = ((local % (2 * HALF)) < HALF)[None, :]
    same_block = (local[:, None] // (2 * HALF)) == (local[None, :] // (2 * HALF))
    same_half = (local[:, None] // HALF) == (local[None, :] // HALF)
    after = local[None, :] > local[:, None]
    select = same_half & (upper != after)
    return upper, lower, same_block, select


@triton.jit
def _program_indices(N0, N1, H):
    """The program's place in a grid of N0 * N1 * B * H programs, the fastest first: (i0, i1, batch, head, and
    batch * H + head), the batch and the flat head as int64 for offsets."""
    pid = tl.program_id(0)
    i0 = pid % N0
    i1 = (pid // N0) % N1
    bh = pid // (N0 * N1)
    return i0, i1, (bh // H).to(tl.int64), bh % H, bh.to(tl.int64)


# NT is not specialized: specialized to NT == 1 (one chunk), the GPU build returns a wrong final state for
# general with a value gate while every longer sequence is right (reports/bench.md); a generic trip count
# keeps the single-chunk case on the code path the longer ones take.
@triton.jit(do_not_specialize=["NT"])
def _chunk_states_kernel(
    k_ptr, v_ptr, gk_ptr, gv_ptr, h_ptr, h_scale_ptr, v_scale_ptr, initial_ptr, final_ptr,
    T, H, NT,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
    PRECISION: tl.constexpr, DT: tl.constexpr,
):
    """The state entering every chunk, h[bh, c] = S_c, and the final state.

    S_{c+1} = (exp(gk_total) exp(gv_total)^T) * S_c + (k * exp(gk_after))^T (v * exp(gv_after)),
    gk_after[j] = sum of gk over the chunk's rows after j (a suffix sum), gk_total over all of it.
    One program per (K block, V block, batch*head), looping over the chunks in order; the gates
    act per row and per column of S, so K and V blocks are independent.

    With "fp16" k and v are scaled by one power of two from the joint peak of their input
    tiles (decays <= 1 only lower them), and h is stored as fp16 S * s with the inverse scale per
    (chunk, K block, V block) in h_scale: s comes from a running bound on |S| (the initial peak
    plus BT peak^2 per chunk), so no reduction over S is needed, and the values stay normal fp16
    down to 2^-27 of the bound. The V tile's inverse scale goes to v_scale for the output
    kernel's A @ v.
    """
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    kb, vb, b, h, bh64 = _program_indices(NK, NV, H)
    local = tl.arange(0, BT)
    # Suffix sums within the chunk (rows past T load as gate 0).
    after = local[None, :] > local[:, None]
    keys = kb * BK + tl.arange(0, BK)
    values = vb * BV + tl.arange(0, BV)
    key_mask = keys < K
    value_mask = values < V
    state_offsets = keys[:, None] * V + values[None, :]
    state_mask = key_mask[:, None] & value_mask[None, :]

    if HAS_INITIAL:
        S = tl.load(initial_ptr + bh64 * K * V + state_offsets, mask=state_mask, other=0.0)
        bound = peak(S)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
        bound = tl.full([], 0.0, tl.float32)

    for c in range(0, NT):
        h_offsets = (bh64 * NT + c) * K * V + state_offsets
        if PRECISION == "fp16":
            S_scale, S_inverse = pow2_scale(bound, 13)
            tl.store(h_ptr + h_offsets, (S * S_scale).to(tl.float16), mask=state_mask)
            tl.store(h_scale_ptr + ((bh64 * NT + c) * NK + kb) * NV + vb, S_inverse)
        else:
            tl.store(h_ptr + h_offsets, S.to(h_ptr.dtype.element_ty), mask=state_mask)
        rows = c * BT + local
        row_mask = rows < T
        k_offsets = ((b * T + rows[:, None]) * H + h) * K + keys[None, :]
        k_mask = row_mask[:, None] & key_mask[None, :]
        v_offsets = ((b * T + rows[:, None]) * H + h) * V + values[None, :]
        v_mask = row_mask[:, None] & value_mask[None, :]
        k = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0)
        if PRECISION == "fp16":
            # One scale for k and v: one reduction across warps instead of two.
            kv_peak = tl.max(tl.maximum(tl.max(tl.abs(k.to(tl.float32)), axis=1),
                                        tl.max(tl.abs(v.to(tl.float32)), axis=1)), axis=0)
            kv_scale, kv_inverse = pow2_scale(kv_peak, 13)
            tl.store(v_scale_ptr + (bh64 * NT + c) * NV + vb, kv_inverse, mask=kb == 0)
            bound += BT * kv_peak * kv_peak
        if HAS_GK:
            gk = tl.load(gk_ptr + k_offsets, mask=k_mask, other=0.0)
            k = k.to(tl.float32) * tl.exp(span_sums(after, gk, DT != tl.float32))
            S = S * tl.exp(tl.sum(gk.to(tl.float32), axis=0))[:, None]
        if HAS_GV:
            gv = tl.load(gv_ptr + v_offsets, mask=v_mask, other=0.0)
            v = v.to(tl.float32) * tl.exp(span_sums(after, gv, DT != tl.float32))
            S = S * tl.exp(tl.sum(gv.to(tl.float32), axis=0))[None, :]
        if PRECISION == "fp16":
            update = tl.dot(tl.trans((k * kv_scale).to(tl.float16)), (v * kv_scale).to(tl.float16),
                            out_dtype=tl.float32)
            S += (update * kv_inverse) * kv_inverse
        else:
            S = _dot(tl.trans(k), v, S, PRECISION, DT)

    if STORE_FINAL:
        tl.store(final_ptr + bh64 * K * V + state_offsets, S, mask=state_mask)


@triton.jit
def _chunk_scores_kernel(
    q_ptr, k_ptr, gk_ptr, A_ptr, A_scale_ptr,
    T, H, NT,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
    LEVELS: tl.constexpr, SUB_LEVELS: tl.constexpr,
    HAS_GK: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr,
):
    """The intra-chunk scores A_tj = sum_k q_t[k] k_j[k] exp(Gk_t[k] - Gk_j[k]) for j <= t, 0 above.

    With a key gate the chunk is cut into NC = BT / BC sub-chunks of BC rows. Pairs in different
    sub-chunks take the levels HALF = BC, 2 BC, ..., BT / 2 of the reference-row hierarchy on the
    whole chunk (one full-tile dot each, per K block of BK); with E = exp(select_l @ gk)
        A += (upper * q * E) @ (lower * k * E)^T    (kept where t is upper and j lower)
    Pairs within a sub-chunk (its BC x BC diagonal block) take the levels HALF = 1, ..., BC / 2
    on the same rows viewed as [NC, BC, BK] (batched dots over the sub-chunks), and
    A_tt = sum_k q_t[k] k_t[k]: full-tile levels would spend most of their work on zeros there.
    One program per (chunk, batch*head).

    With "fp16", q and k are scaled together per K block by a power of two (|q * E| <= |q|, so
    every level's operands then fit fp16) and A is stored as fp16 A * s with the inverse scale in
    A_scale; s comes from the bound |A| <= sum over K blocks of BK peak^2 (no reduction over A).
    """
    NC: tl.constexpr = BT // BC
    pid = tl.program_id(0)
    c = pid % NT
    bh = pid // NT
    b = (bh // H).to(tl.int64)
    h = bh % H
    local = tl.arange(0, BT)
    rows = c * BT + local
    row_mask = rows < T
    # The chunk's rows as [NC, BC, 1]: sub-chunk m, row i is chunk row m * BC + i.
    sub = tl.arange(0, BC)
    rows3 = c * BT + tl.arange(0, NC)[:, None, None] * BC + sub[None, :, None]
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    blocks = tl.zeros([NC, BC, BC], dtype=tl.float32)
    diagonal = tl.zeros([NC, BC], dtype=tl.float32)
    bound = tl.full([], 0.0, tl.float32)

    for k0 in range(0, K, BK):
        keys = k0 + tl.arange(0, BK)
        offsets = ((b * T + rows[:, None]) * H + h) * K + keys[None, :]
        mask = row_mask[:, None] & (keys < K)[None, :]
        q = tl.load(q_ptr + offsets, mask=mask, other=0.0)
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
        if HAS_GK:
            gk = tl.load(gk_ptr + offsets, mask=mask, other=0.0)
            q = q.to(tl.float32)
            k = k.to(tl.float32)
            if PRECISION == "fp16":
                qk_peak = peak(tl.maximum(tl.abs(q), tl.abs(k)))
                bound += BK * qk_peak * qk_peak
                qk_scale, qk_inverse = pow2_scale(qk_peak, 13)
            if BT > BC:
                if PRECISION == "fp16":
                    q = q * qk_scale
                    k = k * qk_scale
                zero = tl.zeros([BT, BT], dtype=tl.float32)
                block_scores = zero
                for level in tl.static_range(SUB_LEVELS, LEVELS):
                    upper, lower, _, select = _level_select(local, level)
                    block_scores = tl.where(upper & lower, _level_scores(q, k, gk, upper, select, zero, PRECISION, DT),
                                            block_scores)
                # A pair t > j keeps the value of the last level with bit LEVEL set in t and clear in
                # j: its highest differing bit, its own level (in one aligned block).
                if PRECISION == "fp16":
                    block_scores = (block_scores * qk_inverse) * qk_inverse
                scores += block_scores

            offsets3 = ((b * T + rows3) * H + h) * K + keys[None, None, :]
            mask3 = (rows3 < T) & (keys < K)[None, None, :]
            q3 = tl.load(q_ptr + offsets3, mask=mask3, other=0.0).to(tl.float32)
            k3 = tl.load(k_ptr + offsets3, mask=mask3, other=0.0).to(tl.float32)
            gk3 = tl.load(gk_ptr + offsets3, mask=mask3, other=0.0)
            diagonal += tl.sum(q3 * k3, axis=2)
            if PRECISION == "fp16":
                q3 = q3 * qk_scale
                k3 = k3 * qk_scale
            zero3 = tl.zeros([NC, BC, BC], dtype=tl.float32)
            block_scores3 = zero3
            for level in tl.static_range(SUB_LEVELS):
                upper, lower, _, select = _level_select(sub, level)
                select3 = tl.broadcast_to(select[None, :, :], (NC, BC, BC))
                block_scores3 = tl.where(upper[None, :, :] & lower[None, :, :],
                                         _level_scores(q3, k3, gk3, upper[None, :, :], select3,
                                                       zero3, PRECISION, DT),
                                         block_scores3)
            if PRECISION == "fp16":
                block_scores3 = (block_scores3 * qk_inverse) * qk_inverse
            blocks += block_scores3
        else:
            scores = _dot(q, tl.trans(k), scores, PRECISION, DT)

    if PRECISION == "fp16":
        if not HAS_GK:
            bound = peak(scores)
        A_scale, A_inverse = pow2_scale(bound, 13)
        tl.store(A_scale_ptr + bh.to(tl.int64) * NT + c, A_inverse)
    else:
        A_scale = 1.0
    A_base = A_ptr + (bh.to(tl.int64) * NT + c) * BT * BT
    causal = local[:, None] >= local[None, :]
    if HAS_GK:
        # Everything but the diagonal blocks here (the pairs in different sub-chunks, zeros above
        # the diagonal); the diagonal blocks below.
        tl.store(A_base + local[:, None] * BT + local[None, :],
                 (tl.where(causal, scores, 0.0) * A_scale).to(A_ptr.dtype.element_ty),
                 mask=(local[:, None] // BC) != (local[None, :] // BC))
        blocks = tl.where(sub[:, None] == sub[None, :], diagonal[:, :, None], blocks)
        blocks = tl.where(sub[:, None] >= sub[None, :], blocks, 0.0)
        block_rows = rows3 - c * BT
        tl.store(A_base + block_rows * BT + (block_rows - sub[None, :, None]) + sub[None, None, :],
                 (blocks * A_scale).to(A_ptr.dtype.element_ty))
    else:
        tl.store(A_base + local[:, None] * BT + local[None, :],
                 (tl.where(causal, scores, 0.0) * A_scale).to(A_ptr.dtype.element_ty))


@triton.jit
def _level_scores(q, k, g, upper, select, zero, PRECISION: tl.constexpr, DT: tl.constexpr):
    """One level of the hierarchy: (upper * q * E) @ (lower * k * E)^T with E = exp(select @ g),
    over the last two dimensions (2-D tiles, or batches of them); zero has the result's shape.
    With "fp16", q and k are already scaled to fp16's range."""
    decay = tl.exp(span_sums(select, g, DT != tl.float32))
    q_decayed = tl.where(upper, q * decay, 0.0)
    k_decayed = tl.where(upper, 0.0, k * decay)
    if len(q.shape) == 3:
        k_decayed = tl.permute(k_decayed, (0, 2, 1))
    else:
        k_decayed = tl.trans(k_decayed)
    if PRECISION == "fp16":
        return tl.dot(q_decayed.to(tl.float16), k_decayed.to(tl.float16), out_dtype=tl.float32)
    else:
        return _dot(q_decayed, k_decayed, zero, PRECISION, DT)


@triton.jit
def _chunk_output_kernel(
    q_ptr, v_ptr, gk_ptr, gv_ptr, h_ptr, h_scale_ptr, v_scale_ptr, A_ptr, A_scale_ptr, o_ptr,
    scale, T, H, NT,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    LEVELS: tl.constexpr, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr,
    PRECISION: tl.constexpr, DT: tl.constexpr,
):
    """o = scale * (exp(Gv) * ((q * exp(Gk)) @ S_c) + intra), one program per (V block, chunk, batch*head).

    Gk, Gv are the gates' prefix sums over the chunk. Without gv, intra = A @ v. With gv the
    value-side decay acts per value channel, so intra reuses the scores kernel's levels on the
    V side, with E = exp(select_l @ gv):
        intra = diag(A) v + sum_levels (upper * E) * ((same_block * A) @ (lower * v * E))
    With "fp16", h and A arrive as scaled fp16 with their inverse scales, v's tile scale comes
    from the states kernel, and q * exp(Gk) is scaled per row (a reduction within a warp): no
    reduction across warps.
    """
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    vb, c, b, h, bh64 = _program_indices(NV, NT, H)
    local = tl.arange(0, BT)
    # Prefix sums within the chunk, each row's own gate included.
    upto = local[None, :] <= local[:, None]
    rows = c * BT + local
    row_mask = rows < T
    values = vb * BV + tl.arange(0, BV)
    value_mask = values < V

    inter = tl.zeros([BT, BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        keys = k0 + tl.arange(0, BK)
        key_mask = keys < K
        q_offsets = ((b * T + rows[:, None]) * H + h) * K + keys[None, :]
        q_mask = row_mask[:, None] & key_mask[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        if HAS_GK:
            gk = tl.load(gk_ptr + q_offsets, mask=q_mask, other=0.0)
            q = q.to(tl.float32) * tl.exp(span_sums(upto, gk, DT != tl.float32))
        state_offsets = (bh64 * NT + c) * K * V + keys[:, None] * V + values[None, :]
        S = tl.load(h_ptr + state_offsets, mask=key_mask[:, None] & value_mask[None, :], other=0.0)
        if PRECISION == "fp16":
            q = q.to(tl.float32)
            q_scale, q_inverse = pow2_scale(tl.max(tl.abs(q), axis=1, keep_dims=True), 13)
            S_inverse = tl.load(h_scale_ptr + ((bh64 * NT + c) * NK + k0 // BK) * NV + vb)
            product = tl.dot((q * q_scale).to(tl.float16), S, out_dtype=tl.float32)
            inter += (product * q_inverse) * S_inverse
        else:
            inter = _dot(q, S, inter, PRECISION, DT)

    v_offsets = ((b * T + rows[:, None]) * H + h) * V + values[None, :]
    v_mask = row_mask[:, None] & value_mask[None, :]
    v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0)
    A = tl.load(A_ptr + (bh64 * NT + c) * BT * BT + local[:, None] * BT + local[None, :])
    if PRECISION == "fp16":
        # Exact powers of two: A is A_scaled * A_inverse, and v * v_scale fits fp16 (the states
        # kernel's scale for this tile); masking and decays (<= 1) only lower them.
        A_scaled = A
        A_inverse = tl.load(A_scale_ptr + bh64 * NT + c)
        v_inverse = tl.load(v_scale_ptr + (bh64 * NT + c) * NV + vb)
        v_scale = 1.0 / v_inverse
        A = A.to(tl.float32) * A_inverse
    else:
        A = A.to(tl.float32)

    if HAS_GV:
        gv = tl.load(gv_ptr + v_offsets, mask=v_mask, other=0.0)
        v = v.to(tl.float32)
        diagonal = tl.sum(tl.where(local[:, None] == local[None, :], A, 0.0), axis=1)
        o = inter * tl.exp(span_sums(upto, gv, DT != tl.float32)) + diagonal[:, None] * v
        if PRECISION == "fp16":
            v_scaled = v * v_scale
        for level in tl.static_range(LEVELS):
            upper, _, same_block, select = _level_select(local, level)
            decay = tl.exp(span_sums(select, gv, DT != tl.float32))
            if PRECISION == "fp16":
                level_o = tl.dot(tl.where(same_block, A_scaled, 0.0).to(tl.float16),
                                 tl.where(upper, 0.0, v_scaled * decay).to(tl.float16), out_dtype=tl.float32)
                level_o = (level_o * A_inverse) * v_inverse
            else:
                level_o = _dot(tl.where(same_block, A, 0.0), tl.where(upper, 0.0, v * decay),
                               tl.zeros([BT, BV], dtype=tl.float32), PRECISION, DT)
            o += tl.where(upper, decay, 0.0) * level_o
    elif PRECISION == "fp16":
        product = tl.dot(A_scaled, (v.to(tl.float32) * v_scale).to(tl.float16), out_dtype=tl.float32)
        o = inter + (product * A_inverse) * v_inverse
    else:
        o = _dot(A, v, inter, PRECISION, DT)

    tl.store(o_ptr + v_offsets, (o * scale).to(o_ptr.dtype.element_ty), mask=v_mask)


# --------------------------------------------------------------------------------------------
# Recurrent kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, gk_ptr, gv_ptr, o_ptr, initial_ptr, final_ptr, checkpoint_ptr,
    scale, T, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
    SEGMENT: tl.constexpr,
):
    """The literal recurrence, one token at a time, fp32 state [K, BV] in registers.

    S = exp(gk_t)[:, None] * exp(gv_t)[None, :] * S + k_t v_t^T;  o_t = S^T (scale q_t).
    One program per (V block, batch*head). With SEGMENT > 0 (gradients wanted) the state entering
    every SEGMENT-th step is stored in checkpoint [B*H, cdiv(T, SEGMENT), K, V] for the backward.
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    vb = pid % NV
    bh = pid // NV
    b = (bh // H).to(tl.int64)
    h = bh % H
    keys = tl.arange(0, BK)
    values = vb * BV + tl.arange(0, BV)
    key_mask = keys < K
    value_mask = values < V
    state_offsets = bh.to(tl.int64) * K * V + keys[:, None] * V + values[None, :]
    state_mask = key_mask[:, None] & value_mask[None, :]
    if HAS_INITIAL:
        S = tl.load(initial_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for t in range(0, T):
        if SEGMENT > 0:
            checkpoint_offsets = (bh.to(tl.int64) * tl.cdiv(T, SEGMENT) + t // SEGMENT) * K * V
            tl.store(checkpoint_ptr + checkpoint_offsets + keys[:, None] * V + values[None, :], S,
                     mask=state_mask & (t % SEGMENT == 0))
        k_offsets = ((b * T + t) * H + h) * K + keys
        v_offsets = ((b * T + t) * H + h) * V + values
        q = tl.load(q_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + v_offsets, mask=value_mask, other=0.0).to(tl.float32)
        if HAS_GK:
            gk = tl.load(gk_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32)
            S = S * tl.exp(gk)[:, None]
        if HAS_GV:
            gv = tl.load(gv_ptr + v_offsets, mask=value_mask, other=0.0).to(tl.float32)
            S = S * tl.exp(gv)[None, :]
        S += k[:, None] * v[None, :]
        o = tl.sum(S * q[:, None], axis=0) * scale
        tl.store(o_ptr + v_offsets, o.to(o_ptr.dtype.element_ty), mask=value_mask)

    if STORE_FINAL:
        tl.store(final_ptr + state_offsets, S, mask=state_mask)


# --------------------------------------------------------------------------------------------
# Backward kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _store_cotangent(ptrs, mask, scale_ptr, dS, FP16_COTANGENTS: tl.constexpr):
    """A state cotangent's [BK, BV] tile to the backward's scratch: fp32, or with FP16_COTANGENTS fp16 dS * s with
    s a power of two that puts the tile's peak in [2^13, 2^14), and 1 / s at scale_ptr. An "fp16" _dot rounds its
    operand so (one scale per tile, from its peak), so the dots that read it lose nothing, and it has half the
    bytes."""
    if FP16_COTANGENTS:
        dS_scale, dS_inverse = pow2_scale(peak(dS), 13)
        tl.store(ptrs, (dS * dS_scale).to(tl.float16), mask=mask)
        tl.store(scale_ptr, dS_inverse)
    else:
        tl.store(ptrs, dS, mask=mask)


@triton.jit
def _load_cotangent(ptrs, mask, scale_ptr, FP16_COTANGENTS: tl.constexpr):
    """A state cotangent's tile from the backward's scratch in fp32: with FP16_COTANGENTS the stored fp16 tile times
    its inverse scale (a power of two: exact)."""
    dS = tl.load(ptrs, mask=mask, other=0.0)
    if FP16_COTANGENTS:
        dS = dS.to(tl.float32) * tl.load(scale_ptr)
    return dS


# NT is not specialized, as in the forward's states kernel.
@triton.jit(do_not_specialize=["NT"])
def _chunk_state_grads_kernel(
    q_ptr, do_ptr, gk_ptr, gv_ptr, dh_ptr, dh_scale_ptr, d_final_ptr, d_initial_ptr,
    scale, T, H, NT,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, HAS_D_FINAL: tl.constexpr, STORE_D_INITIAL: tl.constexpr,
    PRECISION: tl.constexpr, DT: tl.constexpr, FP16_COTANGENTS: tl.constexpr,
):
    """dh[bh, c] = dS_{c+1}, the cotangent of the state leaving chunk c, and the initial state's gradient dS_0.

    dS_c = (exp(Gk_C) exp(Gv_C)^T) * dS_{c+1} + scale (q * exp(Gk))^T (do * exp(Gv)),
    the forward's state recurrence run backwards (prefix sums Gk, Gv where the forward has suffix
    sums; q, do where it has k, v). One program per (K block, V block, batch*head), looping over
    the chunks from the last. With FP16_COTANGENTS dh is fp16 tiles with their inverse scales in dh_scale
    (_store_cotangent).
    """
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    kb, vb, b, h, bh64 = _program_indices(NK, NV, H)
    local = tl.arange(0, BT)
    upto = local[None, :] <= local[:, None]
    keys = kb * BK + tl.arange(0, BK)
    values = vb * BV + tl.arange(0, BV)
    key_mask = keys < K
    value_mask = values < V
    state_offsets = keys[:, None] * V + values[None, :]
    state_mask = key_mask[:, None] & value_mask[None, :]
    if HAS_D_FINAL:
        dS = tl.load(d_final_ptr + bh64 * K * V + state_offsets, mask=state_mask, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)

    for i in range(0, NT):
        c = NT - 1 - i
        _store_cotangent(dh_ptr + (bh64 * NT + c) * K * V + state_offsets, state_mask,
                         dh_scale_ptr + ((bh64 * NT + c) * NK + kb) * NV + vb, dS, FP16_COTANGENTS)
        rows = c * BT + local
        row_mask = rows < T
        q_offsets = ((b * T + rows[:, None]) * H + h) * K + keys[None, :]
        q_mask = row_mask[:, None] & key_mask[None, :]
        do_offsets = ((b * T + rows[:, None]) * H + h) * V + values[None, :]
        do_mask = row_mask[:, None] & value_mask[None, :]
        q = tl.load(q_ptr + q_offsets, mask=q_mask, other=0.0)
        do = tl.load(do_ptr + do_offsets, mask=do_mask, other=0.0)
        if HAS_GK:
            gk = tl.load(gk_ptr + q_offsets, mask=q_mask, other=0.0)
            q = q.to(tl.float32) * tl.exp(span_sums(upto, gk, DT != tl.float32))
            dS = dS * tl.exp(tl.sum(gk.to(tl.float32), axis=0))[:, None]
        if HAS_GV:
            gv = tl.load(gv_ptr + do_offsets, mask=do_mask, other=0.0)
            do = do.to(tl.float32) * tl.exp(span_sums(upto, gv, DT != tl.float32))
            dS = dS * tl.exp(tl.sum(gv.to(tl.float32), axis=0))[None, :]
        dS += scale * _dot(tl.trans(q), do, tl.zeros([BK, BV], dtype=tl.float32), PRECISION, DT)

    if STORE_D_INITIAL:
        tl.store(d_initial_ptr + bh64 * K * V + state_offsets, dS, mask=state_mask)


@triton.jit
def _spanning(local, LEVEL: tl.constexpr):
    """[BT, BT] 0/1: row s, column x, where x's level-LEVEL term spans s (module docstring, "Backward"):
    x in s's own half of its block of 2 HALF rows, x >= s in an upper half (the later position t of
    pairs (t, j), j in the lower half, with j < s <= t), x < s in a lower half (the earlier one, j)."""
    HALF: tl.constexpr = 1 << LEVEL
    # This is _level_select's select, transposed; built in this layout, since transposing select in registers
    # spilled 36 more bytes in gla's bf16 dq/dk kernel (sm_90 ptxas).
    same_half = (local[:, None] // HALF) == (local[None, :] // HALF)
    upper = ((local % (2 * HALF)) >= HALF)[:, None]
    return same_half & (upper == (local[None, :] >= local[:, None]))


@triton.jit
def _level_gradients(scores, later, earlier, gate, factor, later_sum, earlier_sum, dgate, local, zero,
                     LEVELS: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr):
    """The intra-chunk pair terms of one side's gate, over the reference-row levels (module docstring), and
    their share of that gate's gradient. For pairs (t, j), j < t, of one chunk with weights ``scores`` [BT, BT]
    (dA_tj for the key side, A_tj for the value side), ``later`` the tile at t (q; do), ``earlier`` the tile at
    j (k; v) and E = exp(select_l @ gate) at each level l:
        later_l   = factor (upper * E) * ((same_block * scores) @ (lower * earlier * E))       (dq_l; o_l)
        earlier_l = factor (lower * E) * ((same_block * scores)^T @ (upper * later * E))     (dk_l; dv_l)
        dgate    += spanning_l @ (later * later_l + earlier * earlier_l)
    Returns (later_sum + sum_l later_l, earlier_sum + sum_l earlier_l, dgate), each level added in turn."""
    for level in tl.static_range(LEVELS):
        upper, _, same_block, select = _level_select(local, level)
        decay = tl.exp(span_sums(select, gate, DT != tl.float32))
        pairs = tl.where(same_block, scores, 0.0)
        later_level = (factor * tl.where(upper, decay, 0.0)) * _dot(
            pairs, tl.where(upper, 0.0, earlier * decay), zero, PRECISION, DT)
        earlier_level = (factor * tl.where(upper, 0.0, decay)) * _dot(
            tl.trans(pairs), tl.where(upper, later * decay, 0.0), zero, PRECISION, DT)
        dgate = _dot(_spanning(local, level).to(DT), later * later_level + earlier * earlier_level, dgate,
                     PRECISION, DT)
        later_sum += later_level
        earlier_sum += earlier_level
    return later_sum, earlier_sum, dgate


@triton.jit
def _chunk_dqk_kernel(
    q_ptr, k_ptr, v_ptr, gk_ptr, gv_ptr, do_ptr, h_ptr, dh_ptr, dh_scale_ptr, dA_ptr, dq_ptr, dk_ptr, dgk_ptr,
    scale, T, H, NT,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    LEVELS: tl.constexpr, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr,
    PRECISION: tl.constexpr, DT: tl.constexpr, FP16_COTANGENTS: tl.constexpr,
):
    """dq, dk and the key gate's gradient of one chunk; one program per (K block, chunk, batch*head).

    With dA_tj = scale sum_v do_t[v] v_j[v] exp(Gv_t[v] - Gv_j[v]) (the scores kernel on do, v, gv):
        dq_t = scale exp(Gk_t) * (S_c (do_t * exp(Gv_t))) + sum_{j<=t} dA_tj exp(Gk_t - Gk_j) * k_j
        dk_j = exp(Gk_C - Gk_j) * (dS_{c+1} (v_j * exp(Gv_C - Gv_j))) + sum_{t>=j} dA_tj exp(Gk_t - Gk_j) * q_t
    The intra sums take the forward's reference-row levels on the K side (module docstring): at
    each level, with E = exp(select_l @ gk),
        dq_l = (upper * E) * ((same_block * dA) @ (lower * k * E)),
        dk_l = (lower * E) * ((same_block * dA)^T @ (upper * q * E)),
    and the diagonal dA_tt needs no decay. dgk_s sums the terms whose decay spans s, each once:
        dgk_s = exp(Gk_C) * sum_v (S_c * dS_{c+1}) + sum_{t>=s} q_t dq_t^inter + sum_{j<s} k_j dk_j^inter
                + sum_l spanning_l @ (q * dq_l + k * dk_l)
    (masked sums of products: no difference of two large sums).
    """
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    kb, c, b, h, bh64 = _program_indices(NK, NT, H)
    local = tl.arange(0, BT)
    upto = local[None, :] <= local[:, None]
    after = local[None, :] > local[:, None]
    rows = c * BT + local
    row_mask = rows < T
    keys = kb * BK + tl.arange(0, BK)
    key_mask = keys < K
    k_offsets = ((b * T + rows[:, None]) * H + h) * K + keys[None, :]
    k_mask = row_mask[:, None] & key_mask[None, :]
    q = tl.load(q_ptr + k_offsets, mask=k_mask, other=0.0)
    k = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)

    # The inter-chunk terms, before their key decays: (do * exp(Gv)) @ S_c^T and (v * exp(Gv_C - Gv)) @ dS_{c+1}^T;
    # and sum_v S_c * dS_{c+1}, the state's decay across the chunk.
    from_state = tl.zeros([BT, BK], dtype=tl.float32)
    to_state = tl.zeros([BT, BK], dtype=tl.float32)
    through_state = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        values = v0 + tl.arange(0, BV)
        value_mask = values < V
        v_offsets = ((b * T + rows[:, None]) * H + h) * V + values[None, :]
        v_mask = row_mask[:, None] & value_mask[None, :]
        do = tl.load(do_ptr + v_offsets, mask=v_mask, other=0.0)
        v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0)
        if HAS_GV:
            gv = tl.load(gv_ptr + v_offsets, mask=v_mask, other=0.0)
            do = do.to(tl.float32) * tl.exp(span_sums(upto, gv, DT != tl.float32))
            v = v.to(tl.float32) * tl.exp(span_sums(after, gv, DT != tl.float32))
            gv_total = tl.sum(gv.to(tl.float32), axis=0)
        state_offsets = (bh64 * NT + c) * K * V + keys[None, :] * V + values[:, None]
        state_mask = key_mask[None, :] & value_mask[:, None]
        tile = ((bh64 * NT + c) * NK + kb) * NV + v0 // BV
        S_transposed = tl.load(h_ptr + state_offsets, mask=state_mask, other=0.0)
        dS_transposed = _load_cotangent(dh_ptr + state_offsets, state_mask, dh_scale_ptr + tile, FP16_COTANGENTS)
        from_state = _dot(do, S_transposed, from_state, PRECISION, DT)
        to_state = _dot(v, dS_transposed, to_state, PRECISION, DT)
        if HAS_GK:
            if HAS_GV:
                S_transposed = S_transposed * tl.exp(gv_total)[:, None]
            through_state += tl.sum(S_transposed * dS_transposed, axis=0)

    dA = scale * tl.load(dA_ptr + (bh64 * NT + c) * BT * BT + local[:, None] * BT + local[None, :])
    zero = tl.zeros([BT, BK], dtype=tl.float32)
    if HAS_GK:
        gk = tl.load(gk_ptr + k_offsets, mask=k_mask, other=0.0)
        q = q.to(tl.float32)
        k = k.to(tl.float32)
        dq = scale * from_state * tl.exp(span_sums(upto, gk, DT != tl.float32))
        dk = to_state * tl.exp(span_sums(after, gk, DT != tl.float32))
        dgk = through_state[None, :] * tl.exp(tl.sum(gk.to(tl.float32), axis=0))[None, :] + zero
        dgk = _dot((local[None, :] >= local[:, None]).to(DT), q * dq, dgk, PRECISION, DT)
        dgk = _dot((local[None, :] < local[:, None]).to(DT), k * dk, dgk, PRECISION, DT)
        diagonal = tl.sum(tl.where(local[:, None] == local[None, :], dA, 0.0), axis=1)[:, None]
        dq += diagonal * k
        dk += diagonal * q
        dq, dk, dgk = _level_gradients(dA, q, k, gk, 1.0, dq, dk, dgk, local, zero, LEVELS, PRECISION, DT)
        tl.store(dgk_ptr + k_offsets, dgk.to(dgk_ptr.dtype.element_ty), mask=k_mask)
    else:
        dq = _dot(dA, k, scale * from_state, PRECISION, DT)
        dk = _dot(tl.trans(dA), q, to_state, PRECISION, DT)
    tl.store(dq_ptr + k_offsets, dq.to(dq_ptr.dtype.element_ty), mask=k_mask)
    tl.store(dk_ptr + k_offsets, dk.to(dk_ptr.dtype.element_ty), mask=k_mask)


@triton.jit
def _chunk_dv_kernel(
    q_ptr, k_ptr, v_ptr, gk_ptr, gv_ptr, do_ptr, h_ptr, dh_ptr, dh_scale_ptr, A_ptr, A_scale_ptr, dv_ptr, dgv_ptr,
    scale, T, H, NT, NT_A,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT_A: tl.constexpr,
    LEVELS: tl.constexpr, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, A_SCALED: tl.constexpr,
    PRECISION: tl.constexpr, DT: tl.constexpr, FP16_COTANGENTS: tl.constexpr,
):
    """dv and the value gate's gradient of one chunk; one program per (V block, chunk, batch*head).

        dv_j = exp(Gv_C - Gv_j) * (dS_{c+1}^T (k_j * exp(Gk_C - Gk_j))) + scale sum_{t>=j} A_tj exp(Gv_t - Gv_j) * do_t
    with the forward's scores A. With gv the intra sum takes the reference-row levels on the V side,
        dv_l = scale (lower * E) * ((same_block * A)^T @ (upper * do * E)),   E = exp(select_l @ gv),
    and dgv is the dual of the key gate's (the dqk kernel) with do, o in place of q, dq and v, dv:
        dgv_s = exp(Gv_C) * sum_k (S_c * dS_{c+1}) + sum_{t>=s} do_t o_t^inter + sum_{j<s} v_j dv_j^inter
                + sum_l spanning_l @ (do * o_l + v * dv_l),
    o's terms recomputed in fp32 as the forward's output kernel does.
    A is the forward's: NT_A tiles of BT_A rows (a multiple of BT), this chunk's pairs the diagonal block
    c % (BT_A / BT) of tile c // (BT_A / BT); with A_SCALED ("fp16"), fp16 tiles times their inverse scale.
    """
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    A_RATIO: tl.constexpr = BT_A // BT
    vb, c, b, h, bh64 = _program_indices(NV, NT, H)
    local = tl.arange(0, BT)
    upto = local[None, :] <= local[:, None]
    after = local[None, :] > local[:, None]
    rows = c * BT + local
    row_mask = rows < T
    values = vb * BV + tl.arange(0, BV)
    value_mask = values < V
    v_offsets = ((b * T + rows[:, None]) * H + h) * V + values[None, :]
    v_mask = row_mask[:, None] & value_mask[None, :]
    v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0)
    do = tl.load(do_ptr + v_offsets, mask=v_mask, other=0.0)

    # The inter-chunk terms, before their value decays: (k * exp(Gk_C - Gk)) @ dS_{c+1}; with gv also o's
    # (q * exp(Gk)) @ S_c and sum_k S_c * dS_{c+1}, the state's decay across the chunk.
    to_state = tl.zeros([BT, BV], dtype=tl.float32)
    from_state = tl.zeros([BT, BV], dtype=tl.float32)
    through_state = tl.zeros([BV], dtype=tl.float32)
    for k0 in range(0, K, BK):
        keys = k0 + tl.arange(0, BK)
        key_mask = keys < K
        k_offsets = ((b * T + rows[:, None]) * H + h) * K + keys[None, :]
        k_mask = row_mask[:, None] & key_mask[None, :]
        state_offsets = (bh64 * NT + c) * K * V + keys[:, None] * V + values[None, :]
        state_mask = key_mask[:, None] & value_mask[None, :]
        tile = ((bh64 * NT + c) * NK + k0 // BK) * NV + vb
        k = tl.load(k_ptr + k_offsets, mask=k_mask, other=0.0)
        if HAS_GK:
            gk = tl.load(gk_ptr + k_offsets, mask=k_mask, other=0.0)
            k = k.to(tl.float32) * tl.exp(span_sums(after, gk, DT != tl.float32))
        dS = _load_cotangent(dh_ptr + state_offsets, state_mask, dh_scale_ptr + tile, FP16_COTANGENTS)
        to_state = _dot(k, dS, to_state, PRECISION, DT)
        if HAS_GV:
            q = tl.load(q_ptr + k_offsets, mask=k_mask, other=0.0)
            S = tl.load(h_ptr + state_offsets, mask=state_mask, other=0.0)
            if HAS_GK:
                q = q.to(tl.float32) * tl.exp(span_sums(upto, gk, DT != tl.float32))
                S_decayed = S * tl.exp(tl.sum(gk.to(tl.float32), axis=0))[:, None]
            else:
                S_decayed = S
            from_state = _dot(q, S, from_state, PRECISION, DT)
            through_state += tl.sum(S_decayed * dS, axis=0)

    A_tile = bh64 * NT_A + c // A_RATIO
    A_block = A_tile * BT_A * BT_A + (c % A_RATIO) * BT * (BT_A + 1)
    A = tl.load(A_ptr + A_block + local[:, None] * BT_A + local[None, :]).to(tl.float32)
    if A_SCALED:
        A = A * tl.load(A_scale_ptr + A_tile)
    zero = tl.zeros([BT, BV], dtype=tl.float32)
    if HAS_GV:
        gv = tl.load(gv_ptr + v_offsets, mask=v_mask, other=0.0)
        v = v.to(tl.float32)
        do = do.to(tl.float32)
        dv = to_state * tl.exp(span_sums(after, gv, DT != tl.float32))
        o = scale * from_state * tl.exp(span_sums(upto, gv, DT != tl.float32))
        dgv = through_state[None, :] * tl.exp(tl.sum(gv.to(tl.float32), axis=0))[None, :] + zero
        dgv = _dot((local[None, :] >= local[:, None]).to(DT), do * o, dgv, PRECISION, DT)
        dgv = _dot((local[None, :] < local[:, None]).to(DT), v * dv, dgv, PRECISION, DT)
        diagonal = tl.sum(tl.where(local[:, None] == local[None, :], A, 0.0), axis=1)[:, None]
        dv += scale * diagonal * do
        # o's level terms enter dgv only: their sum is not kept.
        _, dv, dgv = _level_gradients(A, do, v, gv, scale, zero, dv, dgv, local, zero, LEVELS, PRECISION, DT)
        tl.store(dgv_ptr + v_offsets, dgv.to(dgv_ptr.dtype.element_ty), mask=v_mask)
    else:
        dv = to_state + scale * _dot(tl.trans(A), do, zero, PRECISION, DT)
    tl.store(dv_ptr + v_offsets, dv.to(dv_ptr.dtype.element_ty), mask=v_mask)


@triton.jit
def _recurrent_backward_kernel(
    q_ptr, k_ptr, v_ptr, gk_ptr, gv_ptr, do_ptr, checkpoint_ptr, scratch_ptr,
    dq_ptr, dk_ptr, dv_ptr, dgk_ptr, dgv_ptr, d_final_ptr, d_initial_ptr,
    scale, B, T, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, SEGMENT: tl.constexpr,
    HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, HAS_D_FINAL: tl.constexpr, STORE_D_INITIAL: tl.constexpr,
):
    """The recurrence's dual, backwards in time, the state's cotangent dS [K, BV] in fp32:

        dS += scale q_t do_t^T
        dq_t = scale S_t do_t,  dk_t = dS v_t,  dv_t = dS^T k_t
        dgk_t = sum_v dS * D_t * S_{t-1},  dgv_t = sum_k dS * D_t * S_{t-1},   D_t = exp(gk_t) exp(gv_t)^T
        dS = D_t * dS
    from the final state's cotangent to the initial state's gradient. The states S_{t-1}, S_t are
    replayed one segment at a time from the forward's checkpoints into this program's scratch
    [SEGMENT + 1, BK, BV] (slot i: the state after i steps of the segment), then read backwards.
    dq, dk and dgk are sums over V: this V block's part goes to its own slice [vb] of theirs.
    One program per (V block, batch*head).
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    vb = pid % NV
    bh = pid // NV
    b = (bh // H).to(tl.int64)
    h = bh % H
    keys = tl.arange(0, BK)
    values = vb * BV + tl.arange(0, BV)
    key_mask = keys < K
    value_mask = values < V
    state_offsets = keys[:, None] * V + values[None, :]
    state_mask = key_mask[:, None] & value_mask[None, :]
    scratch = scratch_ptr + pid.to(tl.int64) * (SEGMENT + 1) * BK * BV + keys[:, None] * BV + tl.arange(0, BV)[None, :]
    part = vb.to(tl.int64) * B * T * H * K  # this V block's slice of dq, dk, dgk
    if HAS_D_FINAL:
        dS = tl.load(d_final_ptr + bh.to(tl.int64) * K * V + state_offsets, mask=state_mask, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)

    segments = tl.cdiv(T, SEGMENT)
    for i in range(0, segments):
        start = (segments - 1 - i) * SEGMENT
        steps = tl.minimum(SEGMENT, T - start)
        S = tl.load(checkpoint_ptr + (bh.to(tl.int64) * segments + start // SEGMENT) * K * V + state_offsets,
                    mask=state_mask, other=0.0)
        tl.store(scratch, S)
        for s in range(0, steps):
            t = start + s
            k_offsets = ((b * T + t) * H + h) * K + keys
            v_offsets = ((b * T + t) * H + h) * V + values
            k = tl.load(k_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + v_offsets, mask=value_mask, other=0.0).to(tl.float32)
            if HAS_GK:
                S = S * tl.exp(tl.load(gk_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32))[:, None]
            if HAS_GV:
                S = S * tl.exp(tl.load(gv_ptr + v_offsets, mask=value_mask, other=0.0).to(tl.float32))[None, :]
            S += k[:, None] * v[None, :]
            tl.store(scratch + (s + 1) * BK * BV, S)
        tl.debug_barrier()  # the replayed states are read back in another thread layout

        for j in range(0, steps):
            s = steps - 1 - j
            t = start + s
            k_offsets = ((b * T + t) * H + h) * K + keys
            v_offsets = ((b * T + t) * H + h) * V + values
            q = tl.load(q_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + v_offsets, mask=value_mask, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + v_offsets, mask=value_mask, other=0.0).to(tl.float32)
            S = tl.load(scratch + (s + 1) * BK * BV)
            dS += (scale * q)[:, None] * do[None, :]
            tl.store(dq_ptr + part + k_offsets, tl.sum(S * do[None, :], axis=1) * scale, mask=key_mask)
            tl.store(dk_ptr + part + k_offsets, tl.sum(dS * v[None, :], axis=1), mask=key_mask)
            tl.store(dv_ptr + v_offsets, tl.sum(dS * k[:, None], axis=0).to(dv_ptr.dtype.element_ty),
                     mask=value_mask)
            if HAS_GK or HAS_GV:
                decay = tl.full([BK, BV], 1.0, tl.float32)
                if HAS_GK:
                    gk = tl.load(gk_ptr + k_offsets, mask=key_mask, other=0.0).to(tl.float32)
                    decay = decay * tl.exp(gk)[:, None]
                if HAS_GV:
                    gv = tl.load(gv_ptr + v_offsets, mask=value_mask, other=0.0).to(tl.float32)
                    decay = decay * tl.exp(gv)[None, :]
                dS_decayed = dS * decay
                through = dS_decayed * tl.load(scratch + s * BK * BV)
                if HAS_GK:
                    tl.store(dgk_ptr + part + k_offsets, tl.sum(through, axis=1), mask=key_mask)
                if HAS_GV:
                    tl.store(dgv_ptr + v_offsets, tl.sum(through, axis=0).to(dgv_ptr.dtype.element_ty),
                             mask=value_mask)
                dS = dS_decayed
        tl.debug_barrier()  # the next segment overwrites the scratch

    if STORE_D_INITIAL:
        tl.store(d_initial_ptr + bh.to(tl.int64) * K * V + state_offsets, dS, mask=state_mask)


# --------------------------------------------------------------------------------------------
# Drivers
# --------------------------------------------------------------------------------------------


def _resolve_precision(precision: str, DT: tl.dtype) -> str:
    """The dot mode a launch runs: "auto" by input dtype, and exact fp32 dots for fp32 inputs."""
    if precision == "auto":
        precision = {tl.bfloat16: "fp16", tl.float16: "split", tl.float32: "ieee"}[DT]
    if DT == tl.float32 and precision in ("fp16", "split", "input"):
        precision = "ieee"  # the operands already are fp32: splitting or rounding changes nothing
    return precision


def chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None,
    gv: torch.Tensor | None,
    scale: float,
    state: tuple[torch.Tensor, ...] | None,
    return_state: bool,
    chunk_size: int = 64,
    precision: str = "auto",
    block_k: int = 64,
    block_v: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The chunkwise forward: chunk states, intra-chunk scores, outputs (three launches).

    The options are CHUNKWISE_OPTIONS, already checked by attnlab.kernel. ``saved`` (gradients wanted)
    receives the scores A and their inverse scales, which the backward reads (module docstring, "Backward").
    Head dims that are not multiples of 16 go to the recurrent kernel on the GPU (kernels/_util.gpu_shape_known_bad).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V, max_K=256):
        return recurrent(q, k, v, gk, gv, scale, state, return_state, saved=saved, await_checks=await_checks)
    BT = min(chunk_size, block_size(T))
    NT = triton.cdiv(T, BT)
    BK = min(block_k, block_size(K))
    BV = min(block_v, block_size(V))
    levels = BT.bit_length() - 1
    BC = min(16, BT)  # the scores kernel's sub-chunks
    DT = triton_dtype(q.dtype)
    precision = _resolve_precision(precision, DT)
    device = q.device

    gk_arg = gk if gk is not None else q  # never read when absent
    gv_arg = gv if gv is not None else v
    initial = state[0] if state is not None else q
    # "input" rounds h and A to the input dtype before every dot that reads them, so storing them
    # rounded changes nothing and halves their memory traffic (h alone is B*H*T*K*V/BT floats).
    # Not for fp16, whose "input" dots first normalise the fp32 values (the state may exceed 65504).
    # "fp16" stores them as scaled fp16 (what its dots read) with one fp32 inverse scale per tile.
    rounded = precision == "input" and DT == tl.bfloat16
    intermediate_dtype = torch.float16 if precision == "fp16" else q.dtype if rounded else torch.float32
    h = torch.empty((B * H, NT, K, V), dtype=intermediate_dtype, device=device)
    final = torch.empty((B, H, K, V), dtype=torch.float32, device=device) if return_state else h
    A = torch.empty((B * H, NT, BT, BT), dtype=intermediate_dtype, device=device)
    NK, NV = triton.cdiv(K, BK), triton.cdiv(V, BV)
    fp16 = precision == "fp16"
    h_scale = torch.empty((B * H, NT, NK, NV) if fp16 else (1,), dtype=torch.float32, device=device)
    v_scale = torch.empty((B * H, NT, NV) if fp16 else (1,), dtype=torch.float32, device=device)
    A_scale = torch.empty((B * H, NT) if fp16 else (1,), dtype=torch.float32, device=device)
    o = torch.empty_like(v)
    flags = dict(HAS_GK=gk is not None, PRECISION=precision, DT=DT, num_warps=num_warps, num_stages=num_stages)
    launch_after_checks(
        await_checks,
        Launch(
            _chunk_states_kernel, (NK * NV * B * H,),
            k, v, gk_arg, gv_arg, h, h_scale, v_scale, initial, final, T, H, NT,
            K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_GV=gv is not None,
            HAS_INITIAL=state is not None, STORE_FINAL=return_state, **flags,
        ),
        Launch(
            _chunk_scores_kernel, (NT * B * H,),
            q, k, gk_arg, A, A_scale, T, H, NT, K=K, BT=BT, BK=BK, BC=BC,
            LEVELS=levels, SUB_LEVELS=BC.bit_length() - 1, **flags,
        ),
        Launch(
            _chunk_output_kernel, (NV * NT * B * H,),
            q, v, gk_arg, gv_arg, h, h_scale, v_scale, A, A_scale, o, scale, T, H, NT,
            K=K, V=V, BT=BT, BK=BK, BV=BV, LEVELS=levels, HAS_GV=gv is not None, **flags,
        ),
    )
    if saved is not None:
        saved["scores"], saved["scores_scale"] = A, A_scale
    return o, ((final,) if return_state else None)


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None,
    gv: torch.Tensor | None,
    scale: float,
    state: tuple[torch.Tensor, ...] | None,
    return_state: bool,
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The literal recurrence: one program per (V block, batch*head), a loop over T. With ``saved``
    (gradients wanted) it also stores the state entering every RECURRENT_SEGMENT-th step there, as
    "checkpoints" (module docstring, "Backward")."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    # Keep the fp32 state tile at <= 4096 entries per program (32 registers a thread at 4 warps).
    BV = min(block_size(V), max(16, 4096 // BK))
    o = torch.empty_like(v)
    final = torch.empty((B, H, K, V), dtype=torch.float32, device=q.device) if return_state else o
    if saved is not None:
        saved["checkpoints"] = torch.empty((B * H, triton.cdiv(T, RECURRENT_SEGMENT), K, V), dtype=torch.float32,
                                           device=q.device)
    launch_after_checks(await_checks, Launch(
        _recurrent_kernel, (triton.cdiv(V, BV) * B * H,),
        q, k, v,
        gk if gk is not None else q, gv if gv is not None else v,
        o, state[0] if state is not None else o, final, saved["checkpoints"] if saved is not None else o,
        scale, T, H,
        K=K, V=V, BK=BK, BV=BV,
        HAS_GK=gk is not None, HAS_GV=gv is not None,
        HAS_INITIAL=state is not None, STORE_FINAL=return_state,
        SEGMENT=RECURRENT_SEGMENT if saved is not None else 0,
        num_warps=4,
    ))
    return o, ((final,) if return_state else None)


# --------------------------------------------------------------------------------------------
# Backward drivers
# --------------------------------------------------------------------------------------------


def chunkwise_options(keywords: dict[str, object]) -> dict[str, object]:
    """The chunkwise kernel options among a backward's keywords (the forward call's, which hold more)."""
    return {name: value for name, value in keywords.items() if name in CHUNKWISE_OPTIONS}


def chunkwise_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None,
    gv: torch.Tensor | None,
    scale: float,
    state: tuple[torch.Tensor, ...] | None,
    do: torch.Tensor,
    d_state: tuple[torch.Tensor, ...] | None,
    chunk_size: int = 64,
    precision: str = "auto",
    block_k: int = 64,
    block_v: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
    saved: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...] | None]:
    """The chunkwise backward (module docstring, "Backward"): gradients of q, k, v, gk, gv (None where the
    gate is absent) and, with an initial state, "initial_state"."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V, max_K=256):  # the forward ran the recurrent kernel
        return recurrent_backward(q, k, v, gk, gv, scale, state, do, d_state, saved)
    BT = min(chunk_size, BACKWARD_CHUNK, block_size(T))
    NT = triton.cdiv(T, BT)
    BK = min(block_k, block_size(K))
    # The backward's kernels hold more fp32 tiles than the forward's: V tiles of at most 64.
    BV = min(block_v, block_size(V), 64)
    levels = BT.bit_length() - 1
    BC = min(16, BT)
    DT = triton_dtype(q.dtype)
    precision = _resolve_precision(precision, DT)
    NK, NV = triton.cdiv(K, BK), triton.cdiv(V, BV)
    # h and dA stay in fp32: the forward's kernels that recompute them run "fp16" as "split" (with "fp16"
    # they would store scaled fp16 tiles); the backward's own kernels take the mode as is. In "fp16" mode
    # and without a value gate, dh is fp16 tiles, one inverse scale each (_store_cotangent): half the bytes
    # (module docstring, "Backward").
    fp16_cotangents = precision == "fp16" and gv is None
    recompute = dict(PRECISION="split" if precision == "fp16" else precision, DT=DT, num_warps=num_warps,
                     num_stages=num_stages)
    device = q.device
    f32 = dict(dtype=torch.float32, device=device)
    gk_arg = gk if gk is not None else q  # never read when absent
    gv_arg = gv if gv is not None else v
    h = torch.empty((B * H, NT, K, V), **f32)
    dh = torch.empty((B * H, NT, K, V), dtype=torch.float16 if fp16_cotangents else torch.float32, device=device)
    dh_scale = torch.empty((B * H, NT, NK, NV) if fp16_cotangents else (1,), **f32)
    dA = torch.empty((B * H, NT, BT, BT), **f32)
    d_initial = torch.empty((B, H, K, V), **f32) if state is not None else None
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dgk = torch.empty_like(gk) if gk is not None else None
    dgv = torch.empty_like(gv) if gv is not None else None
    unused = torch.empty((1,), **f32)  # the scale buffers of stored "fp16" tiles, which the backward does not use
    flags = dict(PRECISION=precision, DT=DT, num_warps=num_warps, num_stages=num_stages)
    cotangents = dict(FP16_COTANGENTS=fp16_cotangents, **flags)
    gates = dict(HAS_GK=gk is not None, HAS_GV=gv is not None)
    # Recomputed: the chunk states h (the forward's kernel), dA (the scores kernel on (do, v, gv) in place of
    # (q, k, gk)) and, for fp16 inputs in "fp16" mode only, A.
    _chunk_states_kernel[(NK * NV * B * H,)](
        k, v, gk_arg, gv_arg, h, unused, unused, state[0] if state is not None else h, h, T, H, NT,
        K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_INITIAL=state is not None, STORE_FINAL=False,
        **gates, **recompute,
    )
    _chunk_state_grads_kernel[(NK * NV * B * H,)](
        q, do, gk_arg, gv_arg, dh, dh_scale, d_state[0] if d_state is not None else dh,
        d_initial if d_initial is not None else dh, scale, T, H, NT,
        K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_D_FINAL=d_state is not None, STORE_D_INITIAL=state is not None,
        **gates, **cotangents,
    )
    scores = dict(BT=BT, BC=BC, LEVELS=levels, SUB_LEVELS=BC.bit_length() - 1, **recompute)
    _chunk_scores_kernel[(NT * B * H,)](
        do, v, gv_arg, dA, unused, T, H, NT, K=V, BK=min(block_k, block_size(V)), HAS_GK=gv is not None, **scores,
    )
    if precision == "fp16" and DT == tl.float16:  # the forward's A carries fp16's own rounding: recompute it
        A, A_scale = torch.empty((B * H, NT, BT, BT), **f32), unused
        _chunk_scores_kernel[(NT * B * H,)](
            q, k, gk_arg, A, unused, T, H, NT, K=K, BK=BK, HAS_GK=gk is not None, **scores,
        )
    else:
        A, A_scale = saved["scores"], saved["scores_scale"]  # the forward's, in its chunks and storage
    _chunk_dqk_kernel[(NK * NT * B * H,)](
        q, k, v, gk_arg, gv_arg, do, h, dh, dh_scale, dA, dq, dk, dgk if dgk is not None else unused,
        scale, T, H, NT, K=K, V=V, BT=BT, BK=BK, BV=BV, LEVELS=levels, **gates, **cotangents,
    )
    _chunk_dv_kernel[(NV * NT * B * H,)](
        q, k, v, gk_arg, gv_arg, do, h, dh, dh_scale, A, A_scale, dv, dgv if dgv is not None else unused,
        scale, T, H, NT, A.shape[1], K=K, V=V, BT=BT, BK=BK, BV=BV, BT_A=A.shape[-1], LEVELS=levels,
        A_SCALED=A.dtype == torch.float16, **gates, **cotangents,
    )
    grads = {"q": dq, "k": dk, "v": dv, "gk": dgk, "gv": dgv}
    if d_initial is not None:
        grads["initial_state"] = (d_initial,)
    return grads


def recurrent_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    gk: torch.Tensor | None,
    gv: torch.Tensor | None,
    scale: float,
    state: tuple[torch.Tensor, ...] | None,
    do: torch.Tensor,
    d_state: tuple[torch.Tensor, ...] | None,
    saved: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...] | None]:
    """The recurrent backward (module docstring, "Backward"): one reverse pass over time, replaying the
    forward's checkpointed states a segment at a time. Gradients of q, k, v, gk, gv (None where the gate
    is absent) and, with an initial state, "initial_state"."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    # Two fp32 tiles (S, dS) live across steps: half the forward's tile, <= 2048 entries each.
    BV = min(block_size(V), max(16, 2048 // BK))
    NV = triton.cdiv(V, BV)
    f32 = dict(dtype=torch.float32, device=q.device)
    # Sums over V of the V blocks' parts (one part, written in place, when one block spans V).
    dq_parts = torch.empty((NV, B, T, H, K), **f32)
    dk_parts = torch.empty((NV, B, T, H, K), **f32)
    dgk_parts = torch.empty((NV, B, T, H, K), **f32) if gk is not None else None
    dv = torch.empty_like(v)
    dgv = torch.empty_like(gv) if gv is not None else None
    d_initial = torch.empty((B, H, K, V), **f32) if state is not None else None
    scratch = torch.empty((NV * B * H, RECURRENT_SEGMENT + 1, BK, BV), **f32)
    _recurrent_backward_kernel[(NV * B * H,)](
        q, k, v, gk if gk is not None else q, gv if gv is not None else v, do, saved["checkpoints"], scratch,
        dq_parts, dk_parts, dv, dgk_parts if dgk_parts is not None else dq_parts, dgv if dgv is not None else dv,
        d_state[0] if d_state is not None else scratch, d_initial if d_initial is not None else scratch,
        scale, B, T, H,
        K=K, V=V, BK=BK, BV=BV, SEGMENT=RECURRENT_SEGMENT, HAS_GK=gk is not None, HAS_GV=gv is not None,
        HAS_D_FINAL=d_state is not None, STORE_D_INITIAL=state is not None, num_warps=4,
    )
    grads = {
        "q": dq_parts.sum(0).to(q.dtype), "k": dk_parts.sum(0).to(k.dtype), "v": dv,
        "gk": dgk_parts.sum(0).to(gk.dtype) if gk is not None else None, "gv": dgv,
    }
    if d_initial is not None:
        grads["initial_state"] = (d_initial,)
    return grads
