"""aft (AFT-full, FORMULATIONS.md 6): the chunkwise form as an online reduction over key blocks (no state).

    o_t = sum_{i<=t} exp(w_{t,i} + k_i) * v_i / sum_{i<=t} exp(w_{t,i} + k_i)   (elementwise over D; all i when causal=False)

Conventions: w [T, T], k, v [B, T, H, D], o [B, T, H, D] in the input dtype
(fp16, bf16 or fp32). One program owns BLOCK_Q queries x BLOCK_D channels of
one (batch, head); grid (query blocks, B*H, channel blocks).

Algorithm (tensor cores). exp(w_ti + k_id) factorizes, so a key block of
BLOCK_K keys is two matrix products:

    A_ti = exp(w_ti - m_t)     m_t = max_i w_ti over the block (per query row)
    E_id = exp(k_id - m_d)     m_d = max_i k_id over the block (per channel)
    num_td = (A @ (E * v))_td,   den_td = (A @ E)_td   (both relative to exp(m_t + m_d))

Across blocks the references are running maxima R_t = max m_t and R_d = max
m_d, kept apart, so the online rescale is exp(R_t,old - R_t) exp(R_d,old -
R_d): vectors, not a [BLOCK_Q, BLOCK_D] exponential per block. Every
exponent is <= 0 (masked logits are -inf before the exp). Adding a constant
to k moves m_d and R_d with it and changes nothing else.

Where the factorization loses: R_t + R_d bounds max_i (w_ti + k_id) from
above, but the row's best w and the channel's best k may sit at different
keys, so every term of (t, d) can be far below exp(R_t + R_d), i.e. den
(relative to that reference) far below 1. fp32 keeps relative precision down
to 2^-126, but the 16-bit dot operands flush tiny values, and the product of
two shifted exps can underflow outright (w = [0, -100], k = [-100, 0] gives
two terms of e^-100 relative to the reference: 0/0 in any dtype). The kernel
detects it: every den_td that ends below DEN_FLOOR (2^-12 with fp16
operands, 2^-60 with fp32) is discarded and recomputed exactly, one key at a
time with a running maximum per (t, d) (fp32, one exp per entry and key;
logits w + (k - k_0) so a shift of k still cancels). The choice is per
entry, so it never depends on another row. That is slow but only meets inputs whose bias and keys together
span more than about 8 nats against each other; for the registry's N(0, 1)
inputs den_td is near n_keys * e^-7 and the fallback never runs. Above the
floor, every term that matters keeps the operands' relative precision.

Causality (bitwise): output t may depend only on keys <= t, including
through the rounding. A reference taken over a key block that straddles
the queries (m_d over all its keys, the E * v scale, R_d and the rescales
that follow) would let later keys change earlier outputs. So when causal the
factorized loop covers only the key blocks that end at or before the tile's
first query (visible to every row: all their references are causal), and the
remaining keys (the diagonal, at most BLOCK_K - 1 + BLOCK_Q of them) are added
exactly, per key, continuing from the factorized sums with the reference
R_t + R_d per (t, d); a key after t adds exact zeros to row t. The fallback
test looks only at the factorized den_td, i.e. at keys <= t.

Numerics of the dot operands (OPTIONS["chunkwise"]["precision"]):

- 16-bit inputs use fp16 operands, also for bf16 inputs: A and E lie in
  [0, 1] and are scaled by 2^15, E * v is scaled per channel and block by a
  power of two to a maximum in [2^14, 2^15) (``_numerics.pow2_scale``: exact;
  divided out after the dot), so fp16's range holds them and its 11-bit
  mantissa is 8x finer than bf16's (bf16 values convert to fp16 exactly once
  scaled).
- "single": one fp16 rounding per operand, two dots per block.
- "split": each operand is hi + lo (lo the remainder, scaled by 2^11 before
  rounding so it stays normal), three dots per product (hi.hi, hi.lo, lo.hi),
  six per block; operands are then exact to about 2^-22.
- "auto" (default): "single" for bf16 inputs, "split" for fp16 inputs: one
  fp16 rounding per operand is already 8x below bf16's output rounding
  (excess near 1), but as large as fp16's own, so fp16 inputs need the split
  to reach their floor (bf16 operands rounded once would not reach bf16's).
- fp32 inputs use fp32 operands with input_precision="ieee" (exact
  products); precision has no effect there.

Backward (chunkwise_backward, BACKWARD["chunkwise"]). Per channel, o is a
softmax average: with P_tsd = exp(w_ts + k_sd - lse_td) (0 for s > t when
causal) and lse_td = log sum_s exp(w_ts + k_sd),

    dv_sd = sum_t P_tsd do_td
    dk_sd = sum_t P_tsd do_td (v_sd - o_td)          (so sum_s dk_sd = 0: a shift of k changes nothing)
    dw_ts = sum_{b,h,d} P_tsd do_td (v_sd - o_td)    (w is shared by batch and heads)

Per (query block, key block) tile P factorizes as in the forward:
P = A_ts E_sd F_td with A = exp(w - m_t), E = exp(k - m_d) (block maxima,
both in [0, 1]) and F = exp(m_t + m_d - lse_td), so with G = do * F every
sum is two matrix products: dv = E * (A^T G), dk = E * (v * (A^T G) -
A^T (G * o)), dw = A * sum_{b,h} (G (E * v)^T - (G * o) E^T). Two kernels,
no atomics: one program per (key block, b * h, channel block) loops over
query blocks for dk and dv; one per (query block, key block) loops over b, h
and channel blocks for dw, its fp32 sum in a fixed order (deterministic).
Dot operands are those of the forward ("precision": fp16 operands scaled by
powers of two, split for fp16 inputs; fp32 with "ieee").

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
BLOCK_D * (BLOCK_Q + BLOCK_K) in the dw kernel, against the forward's
BLOCK_K * (BLOCK_Q + BLOCK_D).

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
from attnlab.kernels._util import Launch, block_size, launch_after_checks, no_pending_checks

# fp16 dot operands are scaled to at most 2^15 (fp16 max 65504); the lo part of a split is scaled by 2^11.
OPERAND_MAX = tl.constexpr(32768.0)
LO_SCALE = tl.constexpr(2048.0)
DEN_FLOOR = {True: 2.0**-12, False: 2.0**-60}  # by "fp16 operands"

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),  # BLOCK_K: keys per block
        "block_q": (64, (16, 32, 64, 128)),  # queries per program
        "block_d": (128, (16, 32, 64, 128, 256)),  # most channels per program (less when D is smaller)
        "num_warps": (8, (1, 2, 4, 8, 16)),
        "num_stages": (2, (1, 2, 3, 4, 5)),
        "precision": ("auto", ("auto", "single", "split")),
    }
}


@triton.jit
def _to_operand(x, SPLIT: tl.constexpr, OP_DTYPE: tl.constexpr):
    """x (fp32, within fp16's range) as a dot operand: (hi, lo * LO_SCALE), lo zero unless SPLIT."""
    hi = x.to(OP_DTYPE)
    if SPLIT:
        lo = ((x - hi.to(tl.float32)) * LO_SCALE).to(OP_DTYPE)
    else:
        lo = hi
    return hi, lo


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
def _two_sum(a, b):
    """(s, err) with s = fl(a + b) and s + err = a + b exactly (Knuth's TwoSum, no branch)."""
    s = a + b
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


@triton.jit
def _aft_keys_exact(w_ptr, k_ptrs_row, v_ptrs_row, offs_t, offs_d, T, D, key_start, key_end, row_stride,
                    k_ref, running_max, num, den, CAUSAL: tl.constexpr):
    """Keys key_start..key_end-1 added one at a time to (num, den), relative to exp(running_max) per (t, d).

    Logits are w_ti + (k_id - k_ref_d), so running_max is relative to k_ref too;
    with k_ref one of the keys, a shift of k cancels in k - k_ref (exactly
    where that subtraction is exact) as in the factorized form.

    Per key the larger of (running max, logit) becomes the reference and the
    other side is multiplied by exp(-|logit - running max|) <= 1: one exp.
    A key after t (causal) has logit -inf: shrink = 0 and grew is false, so
    it adds exact zeros and leaves row t bitwise unchanged (the reference
    running_max must be finite for that: the first key added must be visible
    to every row of the tile).
    """
    for i in range(key_start, key_end):
        w_col = tl.load(w_ptr + offs_t.to(tl.int64) * T + i, mask=offs_t < T, other=0.0).to(tl.float32)
        if CAUSAL:
            w_col = tl.where(i <= offs_t, w_col, -float("inf"))
        k_row = tl.load(k_ptrs_row + i * row_stride, mask=offs_d < D, other=0.0).to(tl.float32)
        v_row = tl.load(v_ptrs_row + i * row_stride, mask=offs_d < D, other=0.0).to(tl.float32)
        logit = w_col[:, None] + (k_row - k_ref)[None, :]
        shrink = tl.exp(-tl.abs(logit - running_max))
        grew = logit > running_max
        den = tl.where(grew, den * shrink + 1.0, den + shrink)
        num = tl.where(grew, num * shrink + v_row[None, :], num + shrink * v_row[None, :])
        running_max = tl.maximum(running_max, logit)
    return running_max, num, den


@triton.jit
def _aft_fwd_kernel(
    w_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, lse_residual_ptr, o_residual_ptr,
    T, H, D, den_floor,
    STORE_LSE: tl.constexpr, STORE_LSE_RESIDUAL: tl.constexpr, STORE_O_RESIDUAL: tl.constexpr,
    CAUSAL: tl.constexpr, SPLIT: tl.constexpr, HALF_OPERANDS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_d = tl.program_id(2)
    batch = (pid_bh // H).to(tl.int64)
    head = pid_bh % H
    base = batch * T * H * D + head * D
    row_stride = H * D
    OP_DTYPE: tl.constexpr = tl.float16 if HALF_OPERANDS else tl.float32

    offs_t = pid_t * BLOCK_Q + tl.arange(0, BLOCK_Q)
    offs_i = tl.arange(0, BLOCK_K)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    w_ptrs = w_ptr + offs_t.to(tl.int64)[:, None] * T + offs_i[None, :]
    k_ptrs = k_ptr + base + offs_i[:, None] * row_stride + offs_d[None, :]
    v_ptrs = v_ptr + base + offs_i[:, None] * row_stride + offs_d[None, :]

    row_ref = tl.full([BLOCK_Q], -float("inf"), tl.float32)  # R_t
    col_ref = tl.full([BLOCK_D], -float("inf"), tl.float32)  # R_d
    num = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)  # relative to exp(R_t + R_d)
    den = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)

    if CAUSAL:
        key_end = tl.minimum((pid_t + 1) * BLOCK_Q, T)
        # Key blocks that lie wholly at or before the tile's first query are
        # visible to every row, so their references (m_t, m_d, the E * v scale)
        # depend on no future key; the rest (the diagonal) is added per key below.
        factorized_end = ((pid_t * BLOCK_Q + 1) // BLOCK_K) * BLOCK_K
    else:
        key_end = T
        factorized_end = T
    for start in range(0, factorized_end, BLOCK_K):
        keys = start + offs_i
        key_in = keys < T
        w = tl.load(w_ptrs + start, mask=(offs_t[:, None] < T) & key_in[None, :], other=0.0).to(tl.float32)
        visible = key_in[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_t[:, None])
        w = tl.where(visible, w, -float("inf"))
        k = tl.load(k_ptrs + start * row_stride, mask=key_in[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        k = tl.where(key_in[:, None], k, -float("inf"))
        v = tl.load(v_ptrs + start * row_stride, mask=key_in[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)

        row_max = tl.max(w, 1)  # -inf for rows that see no key of this block (causal, BLOCK_Q > BLOCK_K)
        col_max = tl.max(k, 0)  # finite: every block starts inside T
        a = tl.exp(w - tl.where(row_max > -float("inf"), row_max, 0.0)[:, None])  # [0, 1]; 0 where masked
        e = tl.exp(k - col_max[None, :])
        ev = e * v
        if HALF_OPERANDS:
            a = a * OPERAND_MAX
            e = e * OPERAND_MAX
            ev_scale, _ = pow2_scale(tl.max(tl.abs(ev), 0), 14)
            ev = ev * ev_scale[None, :]
            e_unscale = 1.0 / OPERAND_MAX
            a_unscale = 1.0 / OPERAND_MAX
        else:
            ev_scale = tl.full([BLOCK_D], 1.0, tl.float32)
            e_unscale = 1.0
            a_unscale = 1.0
        a_hi, a_lo = _to_operand(a, SPLIT, OP_DTYPE)
        e_hi, e_lo = _to_operand(e, SPLIT, OP_DTYPE)
        ev_hi, ev_lo = _to_operand(ev, SPLIT, OP_DTYPE)
        den_block = _product(a_hi, a_lo, e_hi, e_lo, SPLIT, DOT_PRECISION)
        num_block = _product(a_hi, a_lo, ev_hi, ev_lo, SPLIT, DOT_PRECISION)

        new_row_ref = tl.maximum(row_ref, row_max)
        new_col_ref = tl.maximum(col_ref, col_max)
        # The first block has key 0 visible to every row, so the references are
        # finite after it; exp(-inf - finite) = 0 clears the empty accumulators.
        keep = tl.exp(row_ref - new_row_ref)[:, None] * tl.exp(col_ref - new_col_ref)[None, :]
        row_factor = tl.exp(row_max - new_row_ref) * a_unscale
        col_factor = tl.exp(col_max - new_col_ref)
        den = den * keep + den_block * row_factor[:, None] * (col_factor * e_unscale)[None, :]
        num = num * keep + num_block * row_factor[:, None] * (col_factor / ev_scale)[None, :]
        row_ref = new_row_ref
        col_ref = new_col_ref

    in_tile = (offs_t[:, None] < T) & (offs_d[None, :] < D)
    # The sums relative to exp(R_t + R_d) as sums relative to a reference per (t, d)
    # (-inf, with empty sums, when no key was factorized).
    # Key 0, visible to every row, is the channel reference of the exact path.
    k_ref = tl.load(k_ptr + base + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
    col_shift, col_shift_err = _two_sum(col_ref, -k_ref)
    running_max, running_max_err = _two_sum(row_ref[:, None], col_shift[None, :])
    # running_max is R_t + R_d - k_ref rounded; rescaling by the exp of what the rounding dropped makes the sums
    # relative to exactly exp(running_max), as lse (below) and the exact path take them.
    dropped = tl.where(running_max > -float("inf"), running_max_err + col_shift_err[None, :], 0.0)
    num *= tl.exp(dropped)
    den *= tl.exp(dropped)
    # Entries whose factorized den fell below the floor are recomputed exactly,
    # entry by entry: den_td depends only on the factorized keys, which are all
    # at or before row t when causal, so the choice is causal too.
    fallback = ~(den >= den_floor) & (factorized_end > 0)
    if tl.max(tl.where(in_tile & fallback, 1, 0)) > 0:
        exact_max, exact_num, exact_den = _aft_keys_exact(
            w_ptr, k_ptr + base + offs_d, v_ptr + base + offs_d, offs_t, offs_d, T, D, 0, factorized_end, row_stride,
            k_ref, tl.full([BLOCK_Q, BLOCK_D], -float("inf"), tl.float32), tl.zeros([BLOCK_Q, BLOCK_D], tl.float32),
            tl.zeros([BLOCK_Q, BLOCK_D], tl.float32), CAUSAL)
        running_max = tl.where(fallback, exact_max, running_max)
        num = tl.where(fallback, exact_num, num)
        den = tl.where(fallback, exact_den, den)
    if CAUSAL:
        # The diagonal, keys factorized_end..key_end-1, one at a time with the
        # running maximum per (t, d): a key after row t adds exact zeros to it.
        # Key factorized_end is at or before the first query, so the reference
        # is finite from it on.
        running_max, num, den = _aft_keys_exact(
            w_ptr, k_ptr + base + offs_d, v_ptr + base + offs_d, offs_t, offs_d, T, D, factorized_end, key_end,
            row_stride, k_ref, running_max, num, den, CAUSAL)
    o = num / den
    o_rounded = o.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + base + offs_t[:, None] * row_stride + offs_d[None, :], o_rounded, mask=in_tile)
    if STORE_O_RESIDUAL:
        # What rounding o to 16 bits dropped, itself in 16 bits: o + residual carries about twice o's bits.
        residual = (o - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty)
        tl.store(o_residual_ptr + base + offs_t[:, None] * row_stride + offs_d[None, :], residual, mask=in_tile)
    if STORE_LSE:
        # log sum_i exp(w_ti + k_id) in absolute terms: the backward's normalizer.
        # running_max and k_ref are a few units each, log(den) smaller: TwoSum keeps the sum to one rounding.
        # running_max and k_ref are a few units each (far more for shifted keys), log(den) smaller: summed with
        # TwoSum, the result is lse + its rounding residual, which fp32 inputs keep (16-bit ones need not).
        refs, refs_err = _two_sum(running_max, k_ref[None, :])
        lse, lse_residual = _two_sum(refs, tl.log(den) + refs_err)
        tl.store(lse_ptr + base + offs_t[:, None] * row_stride + offs_d[None, :], lse, mask=in_tile)
        if STORE_LSE_RESIDUAL:
            tl.store(lse_residual_ptr + base + offs_t[:, None] * row_stride + offs_d[None, :], lse_residual,
                     mask=in_tile)


def chunkwise(
    *,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    chunk_size: int = 64,
    block_q: int = 64,
    block_d: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
    precision: str = "auto",
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
    BLOCK_D = min(block_size(D), block_d)
    o = torch.empty_like(v)
    lse = lse_residual = o_residual = o
    if saved is not None:
        lse = saved["lse"] = torch.empty(v.shape, dtype=torch.float32, device=v.device)
        if half_operands:
            o_residual = saved["o_residual"] = torch.empty_like(v)
        else:
            lse_residual = saved["lse_residual"] = torch.empty_like(lse)
    grid = (triton.cdiv(T, block_q), B * H, triton.cdiv(D, BLOCK_D))
    launch_after_checks(await_checks, Launch(
        _aft_fwd_kernel, grid,
        w, k, v, o, lse, lse_residual, o_residual,
        T, H, D, DEN_FLOOR[half_operands],
        STORE_LSE=saved is not None, STORE_LSE_RESIDUAL=saved is not None and not half_operands,
        STORE_O_RESIDUAL=saved is not None and half_operands, CAUSAL=causal,
        SPLIT=half_operands and precision == "split",
        HALF_OPERANDS=half_operands,
        DOT_PRECISION="tf32" if half_operands else "ieee",
        BLOCK_Q=block_q, BLOCK_K=chunk_size, BLOCK_D=BLOCK_D,
        num_warps=num_warps, num_stages=num_stages,
    ))
    return o, None


# ------------------------------------------------------------------------------------------------ backward

# The factor exp(m_t + m_d - lse_td) the two shifted exps leave to an entry stays below 1 / DEN_FLOOR; a tile
# where it would not is recomputed exactly, per key (the forward's fallback, met on the same inputs).
LOG_FACTOR_LIMIT = {half: -math.log(floor) for half, floor in DEN_FLOOR.items()}


@triton.jit
def _operand_scale(peaks, HALF_OPERANDS: tl.constexpr):
    """(2^s, 2^-s) per peak moving it to [2^14, 2^15) for fp16 operands (exact); (1, 1) for fp32 operands."""
    if HALF_OPERANDS:
        scale, unscale = pow2_scale(peaks, 14)
    else:
        scale = tl.full(peaks.shape, 1.0, tl.float32)
        unscale = scale
    return scale, unscale


@triton.jit
def _scaled_product(a, a_scale, b, b_scale, SPLIT: tl.constexpr, OP_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """a @ b of fp32 tiles whose rows of a (a_scale, [M]) and columns of b (b_scale, [N]) are already scaled into
    the operand range; returns the product with both scales divided out (a_scale, b_scale are the inverses)."""
    a_hi, a_lo = _to_operand(a, SPLIT, OP_DTYPE)
    b_hi, b_lo = _to_operand(b, SPLIT, OP_DTYPE)
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
    block_q: int = 64,
    block_d: int = 128,
    num_warps: int = 8,
    num_stages: int = 2,
    precision: str = "auto",
    **ignored: object,
) -> dict[str, torch.Tensor]:
    """Gradients of <do, o> for the chunkwise forward: {"w": dw [T, T], "k": dk, "v": dv}, in the input dtype."""
    B, T, H, D = k.shape
    if T == 1:
        # One key, weight 1 whatever w and k are: o = v. The factorized sums would leave a rounding residue
        # where the exact gradients of w and k are 0 (an infinite relative error).
        return {"w": torch.zeros_like(w), "k": torch.zeros_like(k), "v": do.clone()}
    half_operands = k.dtype != torch.float32
    if precision == "auto":
        precision = "split" if k.dtype == torch.float16 else "single"
    # Channel blocks narrower than the forward's: a dk/dv program holds six [BLOCK_K, BLOCK_D] fp32 tiles (dk, dv,
    # A^T G, A^T (G o), v, E) and a dw program five [BLOCK_Q, BLOCK_D] ones besides its [BLOCK_Q, BLOCK_K] pair;
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
