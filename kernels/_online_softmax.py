"""What softmax's two kernels share: a program's place in the grid, its key range, and the online softmax's
step over one block of scores.

``@triton.jit`` functions: they compile inside softmax.py's Triton kernel and inside _softmax_sm90's Gluon
kernel alike (the same PTX as Gluon copies of them), so both run the same arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_softmax(scores, row_max, row_sum, offs_m, offs_n, T, qk_scale,
                  MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, P_EXP2_SHIFT: tl.constexpr):
    """(P, m_new, exp2(m_old - m_new), the rescaled row sum l) of one block of raw scores q.k (fp32):
    m_new = max(m_old, max_j s_j qk_scale) and P = exp2(s qk_scale - m_new + P_EXP2_SHIFT), every exponent
    <= P_EXP2_SHIFT. MASK_KEYS: keys offs_n past T or (causal) after the query offs_m score -inf first.

    Every query sees key 0 in the first block, so m is finite after it, and exp2(-inf - finite) = 0 on the
    first block clears the empty state (m = -inf, l = 0).
    """
    if MASK_KEYS:
        scores = scores * qk_scale
        visible = (offs_n < T)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        scores = tl.where(visible, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.exp2(scores - (new_max - P_EXP2_SHIFT)[:, None])
    else:
        # qk_scale >= 0 (the wrappers fold a negative scale into q), so max(s) * qk_scale = max(s * qk_scale)
        # and the scaling and the shift fuse into one FMA per score.
        new_max = tl.maximum(row_max, tl.max(scores, 1) * qk_scale)
        p = tl.exp2(scores * qk_scale - (new_max - P_EXP2_SHIFT)[:, None])
    rescale = tl.exp2(row_max - new_max)
    return p, new_max, rescale, row_sum * rescale + tl.sum(p, 1)


@triton.jit
def program_head(T, H, K, V):
    """(query block, batch * H + head, offset of the head's q and k rows, of its v and o rows) of this program
    in the grid (query blocks, B*H), [B, T, H, D] tensors. Query blocks run in reverse: with causal masking
    the last have the most keys; they start first."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // H).to(tl.int64)
    head = pid_bh % H
    return pid_m, pid_bh, batch * T * H * K + head * K, batch * T * H * V + head * V


@triton.jit
def key_range(pid_m, T, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """(unmasked_end, end) of query block pid_m's keys: those in [0, unmasked_end) need no mask (they precede
    every query of the block, or are whole key blocks inside T when not causal); the blocks from
    unmasked_end to end hold the diagonal or the tail."""
    if CAUSAL:
        unmasked_end = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        end = tl.minimum((pid_m + 1) * BLOCK_M, T)
    else:
        unmasked_end = T // BLOCK_N * BLOCK_N
        end = T
    return unmasked_end, end
