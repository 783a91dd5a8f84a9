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

Three launches: the chunk states (sequential over chunks, h_c kept in fp32),
the intra-chunk scores A (fp32), the outputs (parallel over chunks).

Every log decay is computed as a direct sum of the gates it spans (a prefix
sum, or a suffix sum of the next row's gate), never as a difference of two
cumulative sums: a difference G_t - G_j of chunk-level sums carries the
rounding of |G_t| (up to BT * |g|), which alone costs fp32 inputs 4-6x their
rounding floor, while a direct sum's error scales with the decay exponent
itself. Sums of gates <= 0 are <= 0, so no positive exponent is evaluated.

A per-channel decay cannot be factored out of a dot as a whole, and the
``q * exp(G)`` / ``k * exp(-G)`` split overflows on strong gates. The intra
terms use a binary hierarchy of reference rows instead: a pair t > j is taken
at the level ``HALF`` of the highest bit where t and j differ (indices in the
chunk), so both lie in one aligned block of 2 HALF rows, t in its upper half,
j in its lower half, and the last row r of the lower half sits between them
(j <= r < t). Then

    exp(Gk_t - Gk_j) = exp(sum_{s in (r, t]} gk_s) * exp(sum_{s in (j, r]} gk_s),

both factors <= 1, and each level is one tensor-core dot over full tiles
(rows outside a level's halves zeroed before the dot, pairs across blocks
masked after it): log2(BT) dots instead of BT^2 element-wise decays. The
diagonal A_tt needs no decay. The value gate gv gets the same treatment on
the V side of A @ v.

Precision (``precision`` option, for fp16/bf16 inputs; fp32 inputs always use
exact fp32 dots unless "tf32"/"tf32x3" is asked for): the decayed operands
(q * exp(G), k * exp(...), v * exp(...)), the fp32 state and the fp32 scores
are not values of the input dtype, so a dot on them is done as

- "split" (default): x = hi + lo with hi, lo in the input dtype, three
  tensor-core dots (hi.hi + hi.lo + lo.hi; two when the other operand is an
  input-dtype tensor). About 16 bits (bf16) or 22 bits (fp16) per operand.
- "tf32x3": fp32 operands through ``input_precision="tf32x3"``.
- "tf32": fp32 operands through TF32 (11 significant bits).
- "ieee": exact fp32 dots (CUDA cores; slow).
- "input": round the fp32 operand to the input dtype, one dot (what
  flash-linear-attention does; fastest, least accurate).

fp16 has a narrow exponent range, so in "split" and "input" modes the rows of
the left operand and the columns of the right one are first scaled to a
maximum of 1 (the state can exceed 65504; tiny decayed values would lose
their low part to underflow) and the scales reapplied to the fp32 product.

Intermediates stay in fp32: the per-chunk states h and the scores A; only with
"input" on bf16 are they stored in bf16 (every dot reading them rounds them to
bf16 anyway), which halves the dominant memory traffic (h: B H T K V / BT).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attnlab.kernels._util import block_size, triton_dtype

PRECISIONS = ("split", "tf32x3", "tf32", "ieee", "input")
CHUNK_SIZES = (16, 32, 64)

# The fastest chunkwise setting (one bf16/fp16 tensor-core dot per product, h and A stored in
# bf16 for bf16 inputs), as flash-linear-attention computes; ``attnlab bench`` times it beside
# the default.
SPEED_OPTIONS = {"precision": "input"}

# The chunkwise kernels' tunables (name -> (default, allowed values)); attnlab.kernel checks
# them before a launch. chunk_size is the largest chunk (short sequences use one chunk of
# next_pow2(T), at least 16); block_k / block_v are the K and V tiles (head dimensions above
# them are looped over or split across programs); num_warps / num_stages go to every launch
# (8 warps: at 4 the sm_90 build of the scores kernel spills ~1 KB a thread at 64-wide tiles).
CHUNKWISE_OPTIONS = {
    "chunk_size": (64, CHUNK_SIZES),
    "precision": ("split", PRECISIONS),
    "block_k": (64, (16, 32, 64, 128)),
    "block_v": (64, (16, 32, 64, 128)),
    "num_warps": (8, (1, 2, 4, 8)),
    "num_stages": (2, (1, 2, 3, 4)),
}


# --------------------------------------------------------------------------------------------
# Dots on fp32 operands
# --------------------------------------------------------------------------------------------


@triton.jit
def _normalise(x, AXIS: tl.constexpr):
    """x = scale * y with max |y| = 1 along AXIS (rows: 1, columns: 0); scale 1 where x is 0."""
    peak = tl.max(tl.abs(x), axis=AXIS, keep_dims=True)
    scale = tl.where(peak > 0, peak, 1.0)
    return x / scale, scale


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b in fp32, where a and b are each fp32 or of the input dtype DT.

    PRECISION is "split", "input", or a tl.dot input_precision ("ieee", "tf32x3", "tf32"),
    which the driver always uses for fp32 inputs. DT operands are exact in every mode.
    """
    if PRECISION == "split":
        return _dot_narrow(a, b, acc, True, DT)
    elif PRECISION == "input":
        return _dot_narrow(a, b, acc, False, DT)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PRECISION)


@triton.jit
def _dot_narrow(a, b, acc, SPLIT: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b by tensor-core dots in DT (fp16/bf16): an fp32 operand x is rounded to
    hi = DT(x) and, with SPLIT, its remainder lo = DT(x - hi) gets its own dot (lo.lo dropped).
    For fp16 the fp32 operands are first normalised (rows of a, columns of b) to max 1."""
    A_WIDE: tl.constexpr = a.dtype == tl.float32
    B_WIDE: tl.constexpr = b.dtype == tl.float32
    NARROW: tl.constexpr = DT == tl.float16
    if A_WIDE and NARROW:
        a, a_scale = _normalise(a, 1)
    if B_WIDE and NARROW:
        b, b_scale = _normalise(b, 0)
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
def _level_masks(local, LEVEL: tl.constexpr):
    """The masks of level HALF = 2^LEVEL over chunk rows: ``upper`` [BT, 1] (the row lies in the
    upper half of its aligned block of 2 HALF rows) and ``same_block`` [BT, BT] (both rows lie in
    one such block)."""
    HALF: tl.constexpr = 1 << LEVEL
    upper = ((local % (2 * HALF)) >= HALF)[:, None]
    same_block = (local[:, None] // (2 * HALF)) == (local[None, :] // (2 * HALF))
    return upper, same_block


@triton.jit
def _level_exponents(g, g_next, local, LEVEL: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """Log decays to the reference rows of level HALF = 2^LEVEL (module docstring), per row x of a
    chunk tile. (LEVEL, not HALF, is the argument: a static_range loop variable stays a constexpr
    only as such; ``1 << level`` in the loop body would be a tensor on the GPU compiler.)

    Rows pair up in aligned halves of HALF rows; r is the last row of a lower half. A row x of an
    upper half gets sum_{s in (r, x]} g_s (an inclusive prefix sum within its half), a row of a
    lower half sum_{s in (x, r]} g_s (a suffix sum of ``g_next``, g_next[x] = g[x + 1], within its
    half). Sums of gates <= 0, so every result is <= 0.
    """
    HALF: tl.constexpr = 1 << LEVEL
    upper = (local % (2 * HALF)) >= HALF
    if HALF == 1:
        # (r, x] = {x} on an upper row; (x, r] is empty on a lower one.
        return tl.where(upper[:, None], g, 0.0)
    else:
        halves: tl.constexpr = BT // HALF
        inside = tl.where(((local % HALF) == HALF - 1)[:, None], 0.0, g_next)
        prefix = tl.reshape(tl.cumsum(tl.reshape(g, [halves, HALF, BD]), axis=1), [BT, BD])
        suffix = tl.reshape(tl.cumsum(tl.reshape(inside, [halves, HALF, BD]), axis=1, reverse=True), [BT, BD])
        return tl.where(upper[:, None], prefix, suffix)


@triton.jit
def _load_gate(g_ptr, b, h, rows, cols, T, H, D: tl.constexpr, chunk_end):
    """The gate tile g[b, rows, h, cols] and its next-row tile g[b, rows + 1, h, cols] in fp32,
    both 0 outside the sequence; the next-row tile is also 0 past ``chunk_end``."""
    col_mask = (cols < D)[None, :]
    offsets = ((b * T + rows[:, None]) * H + h) * D + cols[None, :]
    g = tl.load(g_ptr + offsets, mask=(rows < T)[:, None] & col_mask, other=0.0).to(tl.float32)
    next_mask = ((rows + 1 < T) & (rows + 1 < chunk_end))[:, None] & col_mask
    g_next = tl.load(g_ptr + offsets + H * D, mask=next_mask, other=0.0).to(tl.float32)
    return g, g_next


@triton.jit
def _chunk_states_kernel(
    k_ptr, v_ptr, gk_ptr, gv_ptr, h_ptr, initial_ptr, final_ptr,
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
    """
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    kb = pid % NK
    vb = (pid // NK) % NV
    bh = pid // (NK * NV)
    b = (bh // H).to(tl.int64)
    h = bh % H
    bh64 = bh.to(tl.int64)
    local = tl.arange(0, BT)
    keys = kb * BK + tl.arange(0, BK)
    values = vb * BV + tl.arange(0, BV)
    key_mask = keys < K
    value_mask = values < V
    state_offsets = keys[:, None] * V + values[None, :]
    state_mask = key_mask[:, None] & value_mask[None, :]

    if HAS_INITIAL:
        S = tl.load(initial_ptr + bh64 * K * V + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for c in range(0, NT):
        tl.store(h_ptr + (bh64 * NT + c) * K * V + state_offsets, S.to(h_ptr.dtype.element_ty), mask=state_mask)
        rows = c * BT + local
        row_mask = rows < T
        k = tl.load(k_ptr + ((b * T + rows[:, None]) * H + h) * K + keys[None, :],
                    mask=row_mask[:, None] & key_mask[None, :], other=0.0)
        v = tl.load(v_ptr + ((b * T + rows[:, None]) * H + h) * V + values[None, :],
                    mask=row_mask[:, None] & value_mask[None, :], other=0.0)
        if HAS_GK:
            gk, gk_next = _load_gate(gk_ptr, b, h, rows, keys, T, H, K, c * BT + BT)
            k = k.to(tl.float32) * tl.exp(tl.cumsum(gk_next, axis=0, reverse=True))
            S = S * tl.exp(tl.sum(gk, axis=0))[:, None]
        if HAS_GV:
            gv, gv_next = _load_gate(gv_ptr, b, h, rows, values, T, H, V, c * BT + BT)
            v = v.to(tl.float32) * tl.exp(tl.cumsum(gv_next, axis=0, reverse=True))
            S = S * tl.exp(tl.sum(gv, axis=0))[None, :]
        S = _dot(tl.trans(k), v, S, PRECISION, DT)

    if STORE_FINAL:
        tl.store(final_ptr + bh64 * K * V + state_offsets, S, mask=state_mask)


@triton.jit
def _chunk_scores_kernel(
    q_ptr, k_ptr, gk_ptr, A_ptr,
    T, H, NT,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, LEVELS: tl.constexpr,
    HAS_GK: tl.constexpr, PRECISION: tl.constexpr, DT: tl.constexpr,
):
    """The intra-chunk scores A_tj = sum_k q_t[k] k_j[k] exp(Gk_t[k] - Gk_j[k]) for j <= t, 0 above.

    With a key gate, level HALF = 2^l (l < LEVELS = log2 BT) takes the pairs t > j in one aligned
    block of 2 HALF rows, t in its upper half, j in its lower half; with E = exp(_level_exponents)
        A += same_block * (upper * q * E) @ (lower * k * E)^T
    and the diagonal is sum_k q_t[k] k_t[k]. A is not scaled. One program per (chunk, batch*head).
    """
    pid = tl.program_id(0)
    c = pid % NT
    bh = pid // NT
    b = (bh // H).to(tl.int64)
    h = bh % H
    local = tl.arange(0, BT)
    rows = c * BT + local
    row_mask = rows < T
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    diagonal = tl.zeros([BT], dtype=tl.float32)

    for k0 in range(0, K, BK):
        keys = k0 + tl.arange(0, BK)
        offsets = ((b * T + rows[:, None]) * H + h) * K + keys[None, :]
        mask = row_mask[:, None] & (keys < K)[None, :]
        q = tl.load(q_ptr + offsets, mask=mask, other=0.0)
        k = tl.load(k_ptr + offsets, mask=mask, other=0.0)
        if HAS_GK:
            gk, gk_next = _load_gate(gk_ptr, b, h, rows, keys, T, H, K, c * BT + BT)
            q = q.to(tl.float32)
            k = k.to(tl.float32)
            diagonal += tl.sum(q * k, axis=1)
            for level in tl.static_range(LEVELS):
                upper, same_block = _level_masks(local, level)
                decay = tl.exp(_level_exponents(gk, gk_next, local, level, BT, BK))
                q_decayed = tl.where(upper, q * decay, 0.0)
                k_decayed = tl.where(upper, 0.0, k * decay)
                level_scores = _dot(q_decayed, tl.trans(k_decayed), tl.zeros([BT, BT], dtype=tl.float32),
                                    PRECISION, DT)
                scores += tl.where(same_block, level_scores, 0.0)
        else:
            scores = _dot(q, tl.trans(k), scores, PRECISION, DT)

    if HAS_GK:
        scores = tl.where(local[:, None] == local[None, :], diagonal[:, None], scores)
    scores = tl.where(local[:, None] >= local[None, :], scores, 0.0)
    A_offsets = (bh.to(tl.int64) * NT + c) * BT * BT + local[:, None] * BT + local[None, :]
    tl.store(A_ptr + A_offsets, scores.to(A_ptr.dtype.element_ty))


@triton.jit
def _chunk_output_kernel(
    q_ptr, v_ptr, gk_ptr, gv_ptr, h_ptr, A_ptr, o_ptr,
    scale, T, H, NT,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    LEVELS: tl.constexpr, HAS_GK: tl.constexpr, HAS_GV: tl.constexpr,
    PRECISION: tl.constexpr, DT: tl.constexpr,
):
    """o = scale * (exp(Gv) * ((q * exp(Gk)) @ S_c) + intra), one program per (V block, chunk, batch*head).

    Gk, Gv are the gates' prefix sums over the chunk. Without gv, intra = A @ v. With gv the
    value-side decay acts per value channel, so intra reuses the scores kernel's levels on the
    V side, with E = exp(_level_exponents(gv)):
        intra = diag(A) v + sum_levels (upper * E) * ((same_block * A) @ (lower * v * E))
    """
    NV: tl.constexpr = (V + BV - 1) // BV
    pid = tl.program_id(0)
    vb = pid % NV
    c = (pid // NV) % NT
    bh = pid // (NV * NT)
    b = (bh // H).to(tl.int64)
    h = bh % H
    bh64 = bh.to(tl.int64)
    local = tl.arange(0, BT)
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
            gk = tl.load(gk_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32)
            q = q.to(tl.float32) * tl.exp(tl.cumsum(gk, axis=0))
        state_offsets = (bh64 * NT + c) * K * V + keys[:, None] * V + values[None, :]
        S = tl.load(h_ptr + state_offsets, mask=key_mask[:, None] & value_mask[None, :], other=0.0)
        inter = _dot(q, S, inter, PRECISION, DT)

    v_offsets = ((b * T + rows[:, None]) * H + h) * V + values[None, :]
    v_mask = row_mask[:, None] & value_mask[None, :]
    v = tl.load(v_ptr + v_offsets, mask=v_mask, other=0.0)
    A = tl.load(A_ptr + (bh64 * NT + c) * BT * BT + local[:, None] * BT + local[None, :]).to(tl.float32)

    if HAS_GV:
        gv, gv_next = _load_gate(gv_ptr, b, h, rows, values, T, H, V, c * BT + BT)
        v = v.to(tl.float32)
        diagonal = tl.sum(tl.where(local[:, None] == local[None, :], A, 0.0), axis=1)
        o = inter * tl.exp(tl.cumsum(gv, axis=0)) + diagonal[:, None] * v
        for level in tl.static_range(LEVELS):
            upper, same_block = _level_masks(local, level)
            decay = tl.exp(_level_exponents(gv, gv_next, local, level, BT, BV))
            level_o = _dot(tl.where(same_block, A, 0.0), tl.where(upper, 0.0, v * decay),
                           tl.zeros([BT, BV], dtype=tl.float32), PRECISION, DT)
            o += tl.where(upper, decay, 0.0) * level_o
    else:
        o = _dot(A, v, inter, PRECISION, DT)

    tl.store(o_ptr + v_offsets, (o * scale).to(o_ptr.dtype.element_ty), mask=v_mask)


# --------------------------------------------------------------------------------------------
# Recurrent kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, gk_ptr, gv_ptr, o_ptr, initial_ptr, final_ptr,
    scale, T, H,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_GK: tl.constexpr, HAS_GV: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
):
    """The literal recurrence, one token at a time, fp32 state [K, BV] in registers.

    S = exp(gk_t)[:, None] * exp(gv_t)[None, :] * S + k_t v_t^T;  o_t = S^T (scale q_t).
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
    state_offsets = bh.to(tl.int64) * K * V + keys[:, None] * V + values[None, :]
    state_mask = key_mask[:, None] & value_mask[None, :]
    if HAS_INITIAL:
        S = tl.load(initial_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for t in range(0, T):
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
# Drivers
# --------------------------------------------------------------------------------------------


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
    precision: str = "split",
    block_k: int = 64,
    block_v: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The chunkwise forward: chunk states, intra-chunk scores, outputs (three launches).

    The options are CHUNKWISE_OPTIONS, already checked by attnlab.kernel.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    BT = min(chunk_size, block_size(T))
    NT = triton.cdiv(T, BT)
    BK = min(block_k, block_size(K))
    BV = min(block_v, block_size(V))
    levels = BT.bit_length() - 1
    DT = triton_dtype(q.dtype)
    if DT == tl.float32 and precision in ("split", "input"):
        precision = "ieee"  # the operands already are fp32: splitting or rounding changes nothing
    device = q.device

    gk_arg = gk if gk is not None else q  # never read when absent
    gv_arg = gv if gv is not None else v
    initial = state[0] if state is not None else q
    # "input" rounds h and A to the input dtype before every dot that reads them, so storing them
    # rounded changes nothing and halves their memory traffic (h alone is B*H*T*K*V/BT floats).
    # Not for fp16, whose "input" dots first normalise the fp32 values (the state may exceed 65504).
    rounded = precision == "input" and DT == tl.bfloat16
    intermediate_dtype = q.dtype if rounded else torch.float32
    h = torch.empty((B * H, NT, K, V), dtype=intermediate_dtype, device=device)
    final = torch.empty((B, H, K, V), dtype=torch.float32, device=device) if return_state else h
    A = torch.empty((B * H, NT, BT, BT), dtype=intermediate_dtype, device=device)
    o = torch.empty_like(v)
    flags = dict(HAS_GK=gk is not None, PRECISION=precision, DT=DT, num_warps=num_warps, num_stages=num_stages)

    _chunk_states_kernel[(triton.cdiv(K, BK) * triton.cdiv(V, BV) * B * H,)](
        k, v, gk_arg, gv_arg, h, initial, final, T, H, NT,
        K=K, V=V, BT=BT, BK=BK, BV=BV, HAS_GV=gv is not None,
        HAS_INITIAL=state is not None, STORE_FINAL=return_state, **flags,
    )
    _chunk_scores_kernel[(NT * B * H,)](q, k, gk_arg, A, T, H, NT, K=K, BT=BT, BK=BK, LEVELS=levels, **flags)
    _chunk_output_kernel[(triton.cdiv(V, BV) * NT * B * H,)](
        q, v, gk_arg, gv_arg, h, A, o, scale, T, H, NT,
        K=K, V=V, BT=BT, BK=BK, BV=BV, LEVELS=levels, HAS_GV=gv is not None, **flags,
    )
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
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The literal recurrence: one program per (V block, batch*head), a loop over T."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    # Keep the fp32 state tile at <= 4096 entries per program (32 registers a thread at 4 warps).
    BV = min(block_size(V), max(16, 4096 // BK))
    o = torch.empty_like(v)
    final = torch.empty((B, H, K, V), dtype=torch.float32, device=q.device) if return_state else o
    _recurrent_kernel[(triton.cdiv(V, BV) * B * H,)](
        q, k, v,
        gk if gk is not None else q, gv if gv is not None else v,
        o, state[0] if state is not None else o, final,
        scale, T, H,
        K=K, V=V, BK=BK, BV=BV,
        HAS_GK=gk is not None, HAS_GV=gv is not None,
        HAS_INITIAL=state is not None, STORE_FINAL=return_state,
        num_warps=4,
    )
    return o, ((final,) if return_state else None)
