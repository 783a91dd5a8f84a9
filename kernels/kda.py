"""kda (Kimi Delta Attention): chunkwise and recurrent Triton kernels.

    S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T (scale q_t)

Conventions (FORMULATIONS.md, attnlab/registry.py): q, k, g are [B, T, H, K],
v and o are [B, T, H, V], beta is [B, T, H], the state S is [B, H, K, V] in
fp32. g holds per-key-channel log gates (<= 0): exp(g_t) scales the rows of S.
Inputs are fp16, bf16 or fp32 (one dtype); o comes back in that dtype.
Everything inside is fp32: gates, cumulative gates, the UT inverse, every
intermediate block and the carried state. No tensor is rounded to 16 bits
before a dot; the fp32 dots run at the ``precision`` OPTION (see below).

Chunkwise form: seed 000's UT transform with the per-channel gates folded in,
exactly oracles/_chunks.py's ``delta_chunk``. For one chunk of C positions
with chunk-local cumulative gates G [C, K] (G_t = sum_{s<=t} g_s, fp32):

    A_kk[t, j] = sum_c k_tc k_jc exp(G_tc - G_jc)              (t > j)
    A_qk[t, j] = scale sum_c q_tc k_jc exp(G_tc - G_jc)        (t >= j)
    L = Diag(beta) A_kk,   T = (I + L)^-1 Diag(beta)           (fp32, never rounded)
    Delta = T (V - (K * exp(G)) S)                             (= U - W S of the seed)
    O = scale (Q * exp(G)) S + A_qk Delta
    S_next = exp(G_C) * S (rows) + (K * exp(G_C - G))^T Delta

Two kernels do it:

1. ``_kda_intra_chunk_kernel``, grid (chunks, B*H), all chunks in parallel:
   A_kk and A_qk by secondary chunking (sub-chunks of 16 rows), the inverse by
   block forward substitution, then T and A_qk (fp32) go to scratch buffers.
   The pairwise decay exp(G_t - G_j) does not factor out of a dot as a whole;
   for a sub-chunk of query rows starting at row r, every key row j < r is
   paired through the anchor r: exp(G_t - G_r) exp(G_r - G_j), both exponents
   <= 0 because j < r <= t. The anchor is the sub-chunk's FIRST row, so it is
   never later than the query it serves (no future row enters, also in a
   partial trailing sub-chunk). Diagonal 16 x 16 blocks are computed
   elementwise in fp32 with the exponent masked to -inf above the diagonal
   before exp. Key channels are summed in slices of 32 (the decays are per
   channel), which keeps the M=16 dot operands small: compiled offline for
   sm_90 (ptxas) at K=128 it uses 255 registers at 4 warps and does not spill.
2. ``_kda_state_pass_kernel``, grid (V blocks, B*H), sequential over chunks:
   the fp32 state stays in registers as up to four blocks of 64 key channels
   (as fla does: a whole [K, BV] fp32 tile and its [C, K] operands do not fit
   the registers and shared memory at K >= 128); per chunk it forms Delta,
   writes O and advances S, one key-channel block at a time. Fusing the output here saves storing per-chunk states (fp32
   [B, H, T/C, K, V] would cost more traffic than q, k, v and o together).

Every exponent evaluated is <= 0 (cross-time factors exp(G_t - G_j) with
t >= j, exp(G) and exp(G_C - G)); entries that would have a positive exponent
are masked to -inf first, so strong decays (-20 per step and beyond) only
underflow to 0. Each exponent is summed over just the steps it spans
(G_t - G_j = sum_{j<s<=t} g_s by a masked cumsum, suffix sums for G_r - G_j
and G_C - G_t), never taken as a difference of two cumulative sums: its
rounding error is then relative to itself, not to the decay accumulated
before it (a difference of cumulative sums loses about u * |G| to
cancellation, which at -20 per step tripled the fp32 error).

OPTIONS (chunkwise):
- ``chunk_size`` (64; 16, 32 or 64): C, a multiple of the 16-row sub-chunk.
- ``precision`` ("auto"): tl.dot input precision of the fp32 x fp32 dots.
  "auto" is "bf16x3" for fp16/bf16 inputs (each fp32 operand split into bf16
  hi + lo, three bf16 tensor-core products, about 2^-16 relative per product:
  far below the rounding floors 2^-9 of bf16 and 2^-11 of fp16) and "ieee"
  for fp32 inputs (whose floor no split reaches). "tf32x3" (three TF32
  products, about 2^-21) costs twice "bf16x3" on tensor cores and spills more
  registers; "tf32" (2^-11) is faster but costs accuracy (fp16 especially);
  "bf16" rounds both operands to bf16 and does one product, fla's own choice
  and the fastest (SPEED_OPTIONS), at about fla's accuracy; "ieee" is exact
  fp32 on CUDA cores (slow). The Triton interpreter computes every fp32 dot
  exactly whatever is asked (its builder does not know "bf16x3", which is
  passed to it as "ieee").
- ``block_v`` (32; 16, 32, 64 or 128): V columns per program of the state
  pass (32 gives B*H*4 programs at V=128, two resident per SM at 4 warps).
- ``num_warps`` (4) and ``num_stages`` ("auto": 2 up to K = 128, else 1) of the
  state pass. Compiled offline for sm_90 (ptxas, bf16 inputs, defaults): K=V=128
  255 registers, no spills, 140 KB shared memory; K=V=256 (1 stage) 96 bytes
  of spills, 24 KB shared memory; the limit is 227 KB.

Recurrent form (``_kda_recurrent_kernel``): one program per (B*H, V block),
the literal recurrence token by token with the fp32 state in registers.
OPTIONS: ``block_v`` (32), ``num_warps`` (4).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._util import block_size, zero_state

SUB_CHUNK = 16
INTRA_CHANNEL_SLICE = 32  # key channels per step of the intra-chunk kernel (register budget)
STATE_CHANNEL_BLOCK = 64  # key channels per state block S0..S3 of the state pass (K <= 4 blocks = 256)

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64)),
        "precision": ("auto", ("auto", "tf32x3", "bf16x3", "ieee", "tf32", "bf16")),
        "block_v": (32, (16, 32, 64, 128)),
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
        precision = "ieee" if dtype == torch.float32 else "bf16x3"
    if os.environ.get("TRITON_INTERPRET", "0") == "1" and precision not in _INTERPRETER_PRECISIONS:
        # "bf16" is no input_precision (_dot casts the operands itself), and the interpreter's
        # bf16 dots are wrong: round the operands to bf16 and multiply them in fp32 instead.
        precision = "bf16_emulated" if precision == "bf16" else "ieee"
    return precision


# ---------------------------------------------------------------------------
# Chunkwise, kernel 1: the intra-chunk blocks T = (I + L)^-1 Diag(beta) and A_qk
# ---------------------------------------------------------------------------


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """a @ b of fp32 tiles: "bf16" rounds both operands to bf16 first (one bf16 tensor-core
    product, as fla does); "bf16_emulated" is the same rounding for the Triton interpreter,
    whose bf16 dots are wrong (it multiplies the values as fp32 exactly after rounding);
    any other PRECISION is tl.dot's input_precision."""
    if PRECISION == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PRECISION == "bf16_emulated":
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _kda_intra_chunk_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, t_out_ptr, aqk_out_ptr,
    T, H, K, scale,
    C: tl.constexpr, SUB: tl.constexpr, BK: tl.constexpr, BKC: tl.constexpr, PRECISION: tl.constexpr,
):
    """One chunk: T = (I + Diag(beta) A_kk)^-1 Diag(beta) and scale * A_qk, both [C, C] fp32.

    Block row I (query rows r = I*SUB .. r+SUB-1) of A against key rows j, summed
    over key channels in slices of BKC (the decays are per channel, so slices
    are independent; narrow slices keep the dot operands small in registers):
      j < r (earlier sub-chunks): (k_I exp(G_I - G_r)) . (k_j exp(G_r - G_j)), one dot;
      j in the same sub-chunk:    sum_c k_tc k_jc exp(G_tc - G_jc), elementwise, t >= j.
    Inverse X = (I + L)^-1, block row by block row (L strictly lower):
      X_II = (I + L_II)^-1 by column-oriented forward substitution,
      X_I  = X_II (E_I - L_I,<r X_<r),  E_I the identity's rows of the block.
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    NC: tl.constexpr = C // SUB

    rows = tl.arange(0, C)
    cols = tl.arange(0, C)
    local = tl.arange(0, SUB)
    slice_channels = tl.arange(0, BKC)
    blocks = tl.arange(0, NC)

    positions = chunk * C + rows
    row_ok = positions < T
    row_offsets = ((b * T + positions).to(tl.int64) * H + h) * K
    # Rows past T load as 0: g = 0 there adds no decay, k = q = beta = 0 zero their entries.
    beta = tl.load(beta_ptr + (b * T + positions).to(tl.int64) * H + h, mask=row_ok, other=0.0).to(tl.float32)
    next_ok = (rows + 1 < C) & (positions + 1 < T)  # g_next[j] = g[j+1] inside the chunk

    out_base = (bh.to(tl.int64) * tl.num_programs(0) + chunk) * C * C
    X3 = tl.zeros((NC, SUB, C), dtype=tl.float32)  # block rows of (I + L)^-1 found so far
    for I in tl.static_range(NC):
        r = I * SUB
        strip_positions = chunk * C + r + local
        strip_ok = strip_positions < T
        strip_offsets = ((b * T + strip_positions).to(tl.int64) * H + h) * K
        beta_I = tl.load(beta_ptr + (b * T + strip_positions).to(tl.int64) * H + h, mask=strip_ok, other=0.0).to(tl.float32)

        aqk_strip = tl.zeros((SUB, C), dtype=tl.float32)  # A_qk[I, :]
        akk_before = tl.zeros((SUB, C), dtype=tl.float32)  # A_kk[I, :r]
        akk_diag = tl.zeros((SUB, SUB), dtype=tl.float32)  # A_kk[I, I]
        for channel_start in range(0, BK, BKC):
            channels = channel_start + slice_channels
            channel_ok = channels < K
            strip_ptrs = strip_offsets[:, None] + channels[None, :]
            strip_mask = strip_ok[:, None] & channel_ok[None, :]
            q_I = tl.load(q_ptr + strip_ptrs, mask=strip_mask, other=0.0).to(tl.float32)
            k_I = tl.load(k_ptr + strip_ptrs, mask=strip_mask, other=0.0).to(tl.float32)
            g_I = tl.load(g_ptr + strip_ptrs, mask=strip_mask, other=0.0).to(tl.float32)
            if I > 0:
                # Anchor row r: G_t - G_r = sum_{r < s <= t} g_s for the query rows t >= r, and
                # G_r - G_j = sum_{j < s <= r} g_s = sum of g_next[j..r-1] for the key rows j < r.
                tile_ptrs = row_offsets[:, None] + channels[None, :]
                to_anchor = tl.exp(tl.cumsum(tl.where(local[:, None] > 0, g_I, 0.0), axis=0))
                g_next = tl.load(g_ptr + tile_ptrs + H * K, mask=next_ok[:, None] & channel_ok[None, :], other=0.0)
                up_to_anchor = tl.cumsum(tl.where(rows[:, None] < r, g_next.to(tl.float32), 0.0), axis=0, reverse=True)
                from_anchor = tl.exp(tl.where(rows[:, None] < r, up_to_anchor, float("-inf")))
                # Key rows j < r only (earlier sub-chunks); rows from r on are 0 here.
                k_before = tl.load(k_ptr + tile_ptrs, mask=((rows < r) & row_ok)[:, None] & channel_ok[None, :], other=0.0)
                keys_before = tl.trans(k_before.to(tl.float32) * from_anchor)  # [BKC, C]
                aqk_strip += _dot(q_I * to_anchor, keys_before, PRECISION)
                akk_before += _dot(k_I * to_anchor, keys_before, PRECISION)
            # Diagonal block, one key column jj at a time, elementwise in fp32.
            for jj in range(SUB):
                pick = local[:, None] == jj
                k_j = tl.sum(tl.where(pick, k_I, 0.0), axis=0)
                # G_t - G_j = sum_{j < s <= t} g_s; rows t < j are masked to -inf before exp.
                spanned = tl.cumsum(tl.where(local[:, None] > jj, g_I, 0.0), axis=0)
                decay = tl.exp(tl.where(local[:, None] >= jj, spanned, float("-inf")))
                k_j_decayed = k_j[None, :] * decay
                a_kk = tl.sum(k_I * k_j_decayed, axis=1)
                a_qk = tl.sum(q_I * k_j_decayed, axis=1)
                akk_diag += tl.where(local[None, :] == jj, a_kk[:, None], 0.0)
                aqk_strip += tl.where(cols[None, :] == r + jj, a_qk[:, None], 0.0)

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

        out_ptrs = out_base + (r + local)[:, None] * C + cols[None, :]
        tl.store(t_out_ptr + out_ptrs, X_I * beta[None, :])
        tl.store(aqk_out_ptr + out_ptrs, aqk_strip * scale)


# ---------------------------------------------------------------------------
# Chunkwise, kernel 2: the state pass over chunks, writing the output
# ---------------------------------------------------------------------------


@triton.jit
def _project_block(q_ptr, k_ptr, g_ptr, S, token, row_ok, channel_start, K, scale, ks, qs,
                   BKB: tl.constexpr, PRECISION: tl.constexpr):
    """Adds one block of BKB key channels to ks = (K * exp(G)) S and qs = (scale Q * exp(G)) S."""
    channels = channel_start + tl.arange(0, BKB)
    ptrs = token[:, None] * K + channels[None, :]
    mask = row_ok[:, None] & (channels < K)[None, :]
    q = tl.load(q_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    # G_t = sum_{s <= t} g_s, chunk-local; rows past T have g = 0 and add nothing.
    from_start = tl.exp(tl.cumsum(g, axis=0))
    ks += _dot(k * from_start, S, PRECISION)
    qs += _dot((q * scale) * from_start, S, PRECISION)
    return ks, qs


@triton.jit
def _advance_block(k_ptr, g_ptr, S, delta, token, row_ok, next_ok, channel_start, H, K,
                   BKB: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BKB key channels of S_next = exp(G_C) * S + (K * exp(G_C - G))^T Delta."""
    channels = channel_start + tl.arange(0, BKB)
    channel_ok = channels < K
    ptrs = token[:, None] * K + channels[None, :]
    mask = row_ok[:, None] & channel_ok[None, :]
    k = tl.load(k_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    # g_next[t] = g[t + 1] inside the chunk (the next token is H * K elements on).
    g_next = tl.load(g_ptr + ptrs + H * K, mask=next_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
    # G_C - G_t = sum_{s > t} g_s, summed over its own steps only (no cancellation).
    k_to_end = k * tl.exp(tl.cumsum(g_next, axis=0, reverse=True))
    return tl.exp(tl.sum(g, axis=0))[:, None] * S + _dot(tl.trans(k_to_end), delta, PRECISION)


@triton.jit
def _kda_state_pass_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, t_in_ptr, aqk_in_ptr, o_ptr, state_in_ptr, state_out_ptr,
    T, H, K, V, scale, num_chunks,
    C: tl.constexpr, BKB: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, PRECISION: tl.constexpr,
):
    """S [NKB * BKB, BV] fp32 in registers, held as NKB (1, 2 or 4) blocks S0..S3 of BKB key
    channels (as fla does: one [K, BV] fp32 tile does not fit at K >= 128). Per chunk, with
    G the chunk-local cumulative gates:
      Delta  = T (V - (K * exp(G)) S)
      O      = (scale Q * exp(G)) S + A_qk Delta
      S_next = exp(G_C) * S + (K * exp(G_C - G))^T Delta      (block by block)
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
        next_ok = (rows + 1 < C) & (positions + 1 < T)
        token = (b * T + positions).to(tl.int64) * H + h
        vo_ptrs = token[:, None] * V + values[None, :]
        vo_mask = row_ok[:, None] & value_ok[None, :]

        ks = tl.zeros((C, BV), dtype=tl.float32)
        qs = tl.zeros((C, BV), dtype=tl.float32)
        ks, qs = _project_block(q_ptr, k_ptr, g_ptr, S0, token, row_ok, 0, K, scale, ks, qs, BKB, PRECISION)
        if NKB > 1:
            ks, qs = _project_block(q_ptr, k_ptr, g_ptr, S1, token, row_ok, BKB, K, scale, ks, qs, BKB, PRECISION)
        if NKB > 2:
            ks, qs = _project_block(q_ptr, k_ptr, g_ptr, S2, token, row_ok, 2 * BKB, K, scale, ks, qs, BKB, PRECISION)
            ks, qs = _project_block(q_ptr, k_ptr, g_ptr, S3, token, row_ok, 3 * BKB, K, scale, ks, qs, BKB, PRECISION)

        block_ptrs = (bh.to(tl.int64) * num_chunks + n) * C * C + rows[:, None] * C + cols[None, :]
        v = tl.load(v_ptr + vo_ptrs, mask=vo_mask, other=0.0).to(tl.float32)
        delta = _dot(tl.load(t_in_ptr + block_ptrs), v - ks, PRECISION)
        o = qs + _dot(tl.load(aqk_in_ptr + block_ptrs), delta, PRECISION)
        tl.store(o_ptr + vo_ptrs, o.to(o_ptr.dtype.element_ty), mask=vo_mask)

        S0 = _advance_block(k_ptr, g_ptr, S0, delta, token, row_ok, next_ok, 0, H, K, BKB, PRECISION)
        if NKB > 1:
            S1 = _advance_block(k_ptr, g_ptr, S1, delta, token, row_ok, next_ok, BKB, H, K, BKB, PRECISION)
        if NKB > 2:
            S2 = _advance_block(k_ptr, g_ptr, S2, delta, token, row_ok, next_ok, 2 * BKB, H, K, BKB, PRECISION)
            S3 = _advance_block(k_ptr, g_ptr, S3, delta, token, row_ok, next_ok, 3 * BKB, H, K, BKB, PRECISION)

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


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    state: tuple[torch.Tensor] | None, return_state: bool,
    chunk_size: int = 64, precision: str = "auto", block_v: int = 32, num_warps: int = 4,
    num_stages: int | str = "auto",
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
        # Prefetching the next chunk's tiles (2 stages) fits in shared memory up to K = 128 only.
        num_stages = 2 if BK <= 128 else 1

    t_blocks = torch.empty((B * H, num_chunks, C, C), dtype=torch.float32, device=q.device)
    aqk_blocks = torch.empty_like(t_blocks)
    _kda_intra_chunk_kernel[(num_chunks, B * H)](
        q, k, g, beta, t_blocks, aqk_blocks, T, H, K, scale,
        C=C, SUB=SUB_CHUNK, BK=BK, BKC=min(BK, INTRA_CHANNEL_SLICE), PRECISION=dot_precision, num_warps=4,
    )

    o = torch.empty_like(v)
    initial = state[0] if state is not None else None
    final = zero_state((B, H, K, V), q.device) if return_state else None
    _kda_state_pass_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, t_blocks, aqk_blocks, o,
        initial if initial is not None else t_blocks, final if final is not None else t_blocks,
        T, H, K, V, scale, num_chunks,
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
    _kda_recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g, beta, o,
        initial if initial is not None else unused, final if final is not None else unused,
        T, H, K, V, scale,
        BK=BK, BV=BV, HAS_INITIAL_STATE=initial is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    )
    return o, ((final,) if return_state else None)
