"""softmax: a FlashAttention-2 style forward (the chunkwise form; no state).

    o_t = sum_{i<=t} exp(scale q_t.k_i) v_i / sum_{i<=t} exp(scale q_t.k_i)   (all i when causal=False)

Conventions: q, k [B, T, H, K], v [B, T, H, V], o [B, T, H, V] in the input
dtype (fp16, bf16 or fp32). One program owns BLOCK_M queries of one (batch,
head) and walks the key blocks of ``chunk_size`` (BLOCK_N) keys with the
online softmax: a running row maximum m and row sum l in fp32, the output
accumulator in fp32, rescaled by exp2(m_old - m_new) whenever m grows.
Scores are taken in base 2, s = (q.k) * scale * log2(e), so every
exponential is one exp2 of a non-positive argument; masked scores are -inf
before the exp2. The grid is (query blocks, B*H), query blocks in reverse
order so the longest causal rows start first, and the blocks of one head run
side by side and share its keys and values in L2.

Numerics (OPTIONS["chunkwise"]["precision"]):

- P = exp2(s - m) is computed in fp32. With 16-bit inputs it is
  pre-multiplied by 2^15, folded into the exponent at no cost: P then fills
  fp16's normal range and its small entries keep their relative precision;
  the factor cancels in acc / l. (The shifted exponent rounds to 2^-20
  absolute, invisible at 16-bit precision but 10x fp32's, so fp32 inputs
  skip it.)
- "input" (default): P is rounded once to the input dtype for the P @ V dot,
  as FlashAttention does. That rounding is the kernel's only error beyond
  the fp32 accumulation; emulated in float64 on the registry's inputs it
  gives excess (rel_err / rounding floor) 1.18 at T=64, 1.25 at T=1024 and
  1.27 at T=4096 in bf16 (the same in fp16), below the 1.5 target; the
  interpreter measures 1.20 to 1.30 in fp16 at T=37 to 200.
- "split": P = hi + lo with hi = P rounded to the input dtype and lo the
  rounded remainder, two P @ V dots; P is then exact to about 2^-16 and the
  excess drops to 1.00 (emulated, and measured in fp16 under the
  interpreter), for about 1.5x the tensor-core work.
- fp32 inputs keep P in fp32 and run both dots with input_precision="ieee"
  (exact fp32 products; TF32 would round scores to 10 bits). precision has
  no effect there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attnlab.kernels._util import block_size

LOG2E = math.log2(math.e)
# With 16-bit inputs P is computed as exp2(s - m + 15) = 2^15 P: at most 32768, inside fp16's range (max 65504).
P_EXP2_SHIFT_16BIT = 15.0

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),  # BLOCK_N: keys per block
        "block_m": (None, (None, 16, 32, 64, 128)),  # queries per program; None: 128, or 64 for head dims > 128
        "num_warps": (None, (None, 1, 2, 4, 8, 16)),  # None: 8 for 128 x 128 tiles and larger, else 4
        "num_stages": (None, (None, 1, 2, 3, 4, 5)),  # None: 3 for head dims <= 128, else 2
        "precision": ("input", ("input", "split")),
    }
}


@triton.jit
def _online_softmax_step(
    acc, row_max, row_sum, q, k_ptrs, v_ptrs, k_mask, v_mask,
    offs_m, offs_n, T, qk_scale,
    MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr, DOT_PRECISION: tl.constexpr,
    P_EXP2_SHIFT: tl.constexpr,
):
    """One key block: fold exp2(s - m) v into the running (acc, row_max, row_sum).

    MASK_KEYS: the block may hold keys past T or (causal) after a query; their
    scores become -inf before the max and the exp2.
    """
    if MASK_KEYS:
        k_block = tl.load(k_ptrs, mask=k_mask & (offs_n[None, :] < T), other=0.0)
        v_block = tl.load(v_ptrs, mask=v_mask & (offs_n[:, None] < T), other=0.0)
        scores = tl.dot(q, k_block, input_precision=DOT_PRECISION) * qk_scale
        visible = offs_n[None, :] < T
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        scores = tl.where(visible, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.exp2(scores - (new_max - P_EXP2_SHIFT)[:, None])
    else:
        k_block = tl.load(k_ptrs, mask=k_mask, other=0.0)
        v_block = tl.load(v_ptrs, mask=v_mask, other=0.0)
        scores = tl.dot(q, k_block, input_precision=DOT_PRECISION)
        # qk_scale >= 0 (the wrapper folds a negative scale into q), so max(s) * qk_scale = max(s * qk_scale)
        # and the scaling and the shift fuse into one FMA per score.
        new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
        p = tl.exp2(scores * qk_scale - (new_max - P_EXP2_SHIFT)[:, None])
    # Every query sees key 0 in the first block, so row_max is finite after it
    # and exp2(-inf - finite) = 0 on the first block clears the empty state.
    rescale = tl.exp2(row_max - new_max)
    row_sum = row_sum * rescale + tl.sum(p, 1)
    acc = acc * rescale[:, None]
    if SPLIT_P:
        p_hi = p.to(v_block.dtype)
        p_lo = (p - p_hi.to(tl.float32)).to(v_block.dtype)
        acc = tl.dot(p_lo, v_block, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(p_hi, v_block, acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(p.to(v_block.dtype), v_block, acc, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _softmax_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    T, H, K, V, qk_scale,
    CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr, DOT_PRECISION: tl.constexpr, P_EXP2_SHIFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Reverse order: with causal masking the last query blocks have the most keys; start them first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // H).to(tl.int64)
    head = pid_bh % H
    qk_base = batch * T * H * K + head * K
    vo_base = batch * T * H * V + head * V

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)
    k_mask = offs_k[:, None] < K  # [BLOCK_K, BLOCK_N] tiles of k^T
    v_mask = offs_v[None, :] < V  # [BLOCK_N, BLOCK_V] tiles of v

    q = tl.load(
        q_ptr + qk_base + offs_m[:, None] * (H * K) + offs_k[None, :],
        mask=(offs_m[:, None] < T) & (offs_k[None, :] < K), other=0.0,
    )
    k_ptrs = k_ptr + qk_base + offs_n[None, :] * (H * K) + offs_k[:, None]
    v_ptrs = v_ptr + vo_base + offs_n[:, None] * (H * V) + offs_v[None, :]

    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)

    # Keys [0, unmasked_end) need no mask: they precede every query of the
    # block (causal) or are whole blocks inside T (non-causal). The blocks in
    # [unmasked_end, end) hold the diagonal or the tail and are masked.
    if CAUSAL:
        unmasked_end = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        end = tl.minimum((pid_m + 1) * BLOCK_M, T)
    else:
        unmasked_end = T // BLOCK_N * BLOCK_N
        end = T
    for start_n in range(0, unmasked_end, BLOCK_N):
        acc, row_max, row_sum = _online_softmax_step(
            acc, row_max, row_sum, q,
            k_ptrs + start_n * (H * K), v_ptrs + start_n * (H * V), k_mask, v_mask,
            offs_m, start_n + offs_n, T, qk_scale,
            False, CAUSAL, SPLIT_P, DOT_PRECISION, P_EXP2_SHIFT,
        )
    for start_n in range(unmasked_end, end, BLOCK_N):
        acc, row_max, row_sum = _online_softmax_step(
            acc, row_max, row_sum, q,
            k_ptrs + start_n * (H * K), v_ptrs + start_n * (H * V), k_mask, v_mask,
            offs_m, start_n + offs_n, T, qk_scale,
            True, CAUSAL, SPLIT_P, DOT_PRECISION, P_EXP2_SHIFT,
        )

    o = acc / row_sum[:, None]
    tl.store(
        o_ptr + vo_base + offs_m[:, None] * (H * V) + offs_v[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=(offs_m[:, None] < T) & (offs_v[None, :] < V),
    )


def chunkwise(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    chunk_size: int = 64,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    precision: str = "input",
) -> tuple[torch.Tensor, None]:
    """Softmax attention forward; returns (o [B, T, H, V] in the input dtype, None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BLOCK_K, BLOCK_V = block_size(K), block_size(V)
    widest = max(BLOCK_K, BLOCK_V)
    if block_m is None:
        block_m = 128 if widest <= 128 else 64
    if num_warps is None:
        num_warps = 8 if block_m * widest >= 128 * 128 else 4
    if num_stages is None:
        num_stages = 3 if widest <= 128 else 2
    if scale < 0:
        # Negating q is exact; it keeps qk_scale >= 0, which the unmasked step relies on.
        q, scale = -q, -scale
    fp32 = q.dtype == torch.float32
    o = torch.empty((B, T, H, V), dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(T, block_m), B * H)
    _softmax_fwd_kernel[grid](
        q, k, v, o,
        T, H, K, V, scale * LOG2E,
        CAUSAL=causal,
        SPLIT_P=(precision == "split") and not fp32,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        P_EXP2_SHIFT=0.0 if fp32 else P_EXP2_SHIFT_16BIT,
        BLOCK_M=block_m, BLOCK_N=chunk_size, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, None
