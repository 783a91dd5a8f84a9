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

Measurements behind these choices (emulated excess): reports/bench.md,
"Design history moved from the kernel docstrings".
"""

from __future__ import annotations

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
        w_col = tl.load(w_ptr + offs_t * T + i, mask=offs_t < T, other=0.0).to(tl.float32)
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
    w_ptr, k_ptr, v_ptr, o_ptr,
    T, H, D, den_floor,
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
    w_ptrs = w_ptr + offs_t[:, None] * T + offs_i[None, :]
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
    running_max = row_ref[:, None] + (col_ref - k_ref)[None, :]
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
    tl.store(o_ptr + base + offs_t[:, None] * row_stride + offs_d[None, :], o.to(o_ptr.dtype.element_ty), mask=in_tile)


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
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, None]:
    """AFT-full forward; returns (o [B, T, H, D] in the input dtype, None)."""
    B, T, H, D = k.shape
    half_operands = k.dtype != torch.float32
    if precision == "auto":
        precision = "split" if k.dtype == torch.float16 else "single"
    BLOCK_D = min(block_size(D), block_d)
    o = torch.empty_like(v)
    grid = (triton.cdiv(T, block_q), B * H, triton.cdiv(D, BLOCK_D))
    launch_after_checks(await_checks, Launch(
        _aft_fwd_kernel, grid,
        w, k, v, o,
        T, H, D, DEN_FLOOR[half_operands],
        CAUSAL=causal,
        SPLIT=half_operands and precision == "split",
        HALF_OPERANDS=half_operands,
        DOT_PRECISION="tf32" if half_operands else "ieee",
        BLOCK_Q=block_q, BLOCK_K=chunk_size, BLOCK_D=BLOCK_D,
        num_warps=num_warps, num_stages=num_stages,
    ))
    return o, None
