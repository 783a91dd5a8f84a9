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

Speed (sm_90, no TMA): the block sizes come from _DEFAULT_CONFIGS, checked
with ptxas for registers, spills and shared memory; for 16-bit inputs with
head dims <= 128, 128 queries x 128 keys on 8 warps (the smallest tile
Triton's attention tutorial admits for 8 warps on Hopper; two warpgroups of
64 rows, each dot one wgmma per warpgroup) with 3 stages of K/V in shared
memory (224 KB at D = 128), which halves the per-key cost of the
accumulator rescale and of the dot waits against 64-key blocks. Unmasked
key blocks (all but the diagonal or the tail) load without masks when the
head dims fill their tiles (EVEN_K, EVEN_V constexpr). Key pointers are
rebuilt from the base each block rather than carried and incremented:
carried pointers across the two loops made the pipeliner keep more buffers
(196 KB and spills at 128 x 64, offline). With precision "fp16" each V tile
goes shared memory -> registers (scale, convert) -> shared memory before its
dot; the pipeliner then keeps 2 stages of V plus the converted tile in the
same 224 KB, and ptxas reports 255 registers with 8 bytes spilled once per
program, outside the key loops (D = 128, bf16).

Numerics (OPTIONS["chunkwise"]["precision"]):

- P = exp2(s - m) is computed in fp32. With 16-bit inputs it is
  pre-multiplied by 2^15, folded into the exponent at no cost: P then fills
  fp16's normal range and its small entries keep their relative precision;
  the factor cancels in acc / l. (The shifted exponent rounds to 2^-20
  absolute, invisible at 16-bit precision but 10x fp32's, so fp32 inputs
  skip it.) The row max m, the row sum l (of the unrounded P) and the
  accumulator stay fp32 in every mode; only the P @ V operands differ.
- "fp16" (the default for bf16 inputs): one P @ V dot in fp16. P in
  [0, 2^15] rounds to fp16 with 2^-11 relative error, 4x below bf16's
  output rounding (2^-9). V is made exact in fp16 by a power-of-two scale
  per (batch, head, value column), 2^(13 - floor(log2 max_t |v|)): bf16's
  8 significant bits fit fp16's 11 once the column peak lies in
  [2^13, 2^14); entries more than 2^30 below the peak become fp16
  subnormals, off by at most 2^-38 of the peak. The
  wrapper reads max |v| once (one reduction over T); the kernel turns it
  into the scale from its exponent bits, converts each V tile as it is
  used, and divides the scale out of the output. Emulated in float64
  (bf16, P rounded per mode, 128-key blocks): excess 1.001 at T=2, 1.003
  at T=64, 1.004 at T=1024, 1.005 at T=4096 on the registry's inputs; on
  2000 property-suite-like small cases (T 1..300, head dims 1..128, one
  value channel, logits up to 80) worst 1.33, where "input" fails 18
  (worst 5.6) and "split" stays at 1.00. For fp16 inputs it is "input"
  with the (exact) column scale.
- "input": P is rounded once to the input dtype for the P @ V dot,
  as FlashAttention does: the fastest. Emulated in bf16 on the registry's
  inputs: excess 1.15 at T=64, 1.23 at T=1024, 1.26 at T=4096 (the same
  in fp16), but on tiny outputs, where nothing averages out, up to 3 on
  the GPU (property suite, T=2, one value channel) and 5.6 emulated.
- "split" (the default for fp16 inputs): P = hi + lo with hi = P rounded to
  the input dtype and lo the rounded remainder, two P @ V dots; P is then
  exact to about 2^-16 and the excess is 1.00 (emulated, and measured in
  fp16 under the interpreter), for 1.5x the tensor-core work. In fp16,
  rounding P to fp16 costs as much as the output rounding itself, so only
  the split reaches the floor there.
- "auto" (default): "fp16" for bf16 inputs, "split" for fp16 inputs.
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
        "chunk_size": (128, (16, 32, 64, 128)),  # BLOCK_N, keys per block, at most the cap in _DEFAULT_CONFIGS
        "block_m": (None, (None, 16, 32, 64, 128)),  # queries per program; None: see _launch_config
        "num_warps": (None, (None, 1, 2, 4, 8, 16)),
        "num_stages": (None, (None, 1, 2, 3, 4, 5)),
        "precision": ("auto", ("auto", "input", "split", "fp16")),
    }
}
# The fast side of the precision trade: P rounded once, as FlashAttention does.
SPEED_OPTIONS: dict[str, dict[str, object]] = {"chunkwise": {"precision": "input"}}

# Default (block_m, largest chunk_size, num_warps, num_stages) by input width and the
# wider head-dim tile, chosen by compiling for sm_90 (ptxas -v): no spills and
# shared memory under 227 KB. 16-bit, tile <= 128: 128 x 128 score tiles on two
# warpgroups (one 64-row wgmma each), 3 stages of K and V (224 KB with D = 128),
# 252 registers, no spills. fp32 runs its
# "ieee" dots on CUDA cores, whose operands sit in registers: small tiles.
_DEFAULT_CONFIGS = {
    (2, 128): (128, 128, 8, 3),
    (2, 256): (128, 32, 8, 3),
    (4, 64): (32, 32, 4, 2),
    (4, 128): (32, 16, 4, 2),
    (4, 256): (32, 16, 8, 2),
}


def _launch_config(
    itemsize: int, widest: int, block_m: int | None, chunk_size: int, num_warps: int | None, num_stages: int | None
) -> tuple[int, int, int, int]:
    """(block_m, BLOCK_N, num_warps, num_stages): the entry above for the narrowest listed tile >= widest,
    for whatever the caller left None, and BLOCK_N = chunk_size capped by the entry."""
    width = min(w for (size, w) in _DEFAULT_CONFIGS if size == itemsize and w >= widest)
    default_m, largest_n, default_warps, default_stages = _DEFAULT_CONFIGS[(itemsize, width)]
    return (
        default_m if block_m is None else block_m,
        min(chunk_size, largest_n),
        default_warps if num_warps is None else num_warps,
        default_stages if num_stages is None else num_stages,
    )


@triton.jit
def _load_tile(ptrs, row_ok, col_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, masking only the dimensions that can run out of range (zeros there)."""
    if CHECK_ROWS and CHECK_COLS:
        tile = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    elif CHECK_ROWS:
        tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    elif CHECK_COLS:
        tile = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _v_column_scale(peak_ptrs, offs_v, V, INVERSE: tl.constexpr):
    """The power-of-two scale 2^(13 - floor(log2 peak)) of each value column (or its inverse), where peak
    is the column's max |v| over the head: peak * scale lies in [2^13, 2^14), so v * scale converts to fp16
    exactly (a bf16 value's 8 significant bits, no overflow). Built from peak's exponent bits, exact where
    exp2/log2 approximate; clamped to 2^[-126, 126] so that the scale and its inverse are normal fp32
    (an all-zero column gets 2^126). A non-finite peak (inf or NaN in the column) gets 1, so that the
    column's finite entries are not scaled away.
    """
    peak = tl.load(peak_ptrs + offs_v, mask=offs_v < V, other=0.0)
    exponent = (peak.to(tl.int32, bitcast=True) >> 23) & 0xFF
    biased = tl.where(exponent == 0xFF, 127, tl.minimum(tl.maximum(267 - exponent, 1), 253))
    if INVERSE:
        biased = 254 - biased
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _online_softmax_step(
    acc, row_max, row_sum, q, k_ptrs, v_ptrs, v_scale,
    offs_m, offs_n, offs_k, offs_v, T, K, V, qk_scale,
    MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr, PV_FP16: tl.constexpr,
    DOT_PRECISION: tl.constexpr, P_EXP2_SHIFT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
):
    """One key block: fold exp2(s - m) v into the running (acc, row_max, row_sum).

    MASK_KEYS: the block may hold keys past T or (causal) after a query; their
    scores become -inf before the max and the exp2. EVEN_K / EVEN_V: the head
    dims fill their tiles, so those loads need no mask. PV_FP16: v_scale holds
    the head's power-of-two column scales, which make V exact in fp16.
    """
    key_ok = offs_n < T
    # k is read as k^T tiles [BLOCK_K, BLOCK_N], v as [BLOCK_N, BLOCK_V].
    k_block = _load_tile(k_ptrs, offs_k < K, key_ok, not EVEN_K, MASK_KEYS)
    v_block = _load_tile(v_ptrs, key_ok, offs_v < V, MASK_KEYS, not EVEN_V)
    if PV_FP16:
        v_block = (v_block.to(tl.float32) * v_scale[None, :]).to(tl.float16)
    scores = tl.dot(q, k_block, input_precision=DOT_PRECISION)
    if MASK_KEYS:
        scores = scores * qk_scale
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        scores = tl.where(visible, scores, -float("inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.exp2(scores - (new_max - P_EXP2_SHIFT)[:, None])
    else:
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
    q_ptr, k_ptr, v_ptr, o_ptr, v_peak_ptr,
    T, H, K, V, qk_scale,
    CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr, PV_FP16: tl.constexpr, DOT_PRECISION: tl.constexpr,
    P_EXP2_SHIFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
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

    q = _load_tile(q_ptr + qk_base + offs_m[:, None] * (H * K) + offs_k[None, :], offs_m < T, offs_k < K, True, not EVEN_K)
    # One block of keys further is a fixed pointer step (int64 via the pointers: no int32 overflow at long T).
    k_ptrs = k_ptr + qk_base + offs_n[None, :] * (H * K) + offs_k[:, None]
    v_ptrs = v_ptr + vo_base + offs_n[:, None] * (H * V) + offs_v[None, :]

    if PV_FP16:
        v_scale = _v_column_scale(v_peak_ptr + pid_bh * V, offs_v, V, False)
    else:
        v_scale = tl.full([BLOCK_V], 1.0, tl.float32)

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
            acc, row_max, row_sum, q, k_ptrs + start_n * (H * K), v_ptrs + start_n * (H * V), v_scale,
            offs_m, start_n + offs_n, offs_k, offs_v, T, K, V, qk_scale,
            False, CAUSAL, SPLIT_P, PV_FP16, DOT_PRECISION, P_EXP2_SHIFT, EVEN_K, EVEN_V,
        )
    for start_n in range(unmasked_end, end, BLOCK_N):
        acc, row_max, row_sum = _online_softmax_step(
            acc, row_max, row_sum, q, k_ptrs + start_n * (H * K), v_ptrs + start_n * (H * V), v_scale,
            offs_m, start_n + offs_n, offs_k, offs_v, T, K, V, qk_scale,
            True, CAUSAL, SPLIT_P, PV_FP16, DOT_PRECISION, P_EXP2_SHIFT, EVEN_K, EVEN_V,
        )

    o = acc / row_sum[:, None]
    if PV_FP16:
        # Recomputed here rather than kept from before the loops: no [BLOCK_V] vector in the
        # accumulator's layout stays live across them (the loops already use 255 registers at 128 x 128).
        o = o * _v_column_scale(v_peak_ptr + pid_bh * V, offs_v, V, True)[None, :]
    o_ptrs = o_ptr + vo_base + offs_m[:, None] * (H * V) + offs_v[None, :]
    if EVEN_V:
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(offs_m < T)[:, None])
    else:
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(offs_m < T)[:, None] & (offs_v < V)[None, :])


def chunkwise(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    chunk_size: int = 128,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    precision: str = "auto",
) -> tuple[torch.Tensor, None]:
    """Softmax attention forward; returns (o [B, T, H, V] in the input dtype, None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BLOCK_K, BLOCK_V = block_size(K), block_size(V)
    block_m, chunk_size, num_warps, num_stages = _launch_config(
        q.element_size(), max(BLOCK_K, BLOCK_V), block_m, chunk_size, num_warps, num_stages
    )
    if scale < 0:
        # Negating q is exact; it keeps qk_scale >= 0, which the unmasked step relies on.
        q, scale = -q, -scale
    fp32 = q.dtype == torch.float32
    if precision == "auto":
        precision = "fp16" if q.dtype == torch.bfloat16 else "split"
    pv_fp16 = precision == "fp16" and not fp32
    # max |v| per (batch, head, value column), read once; the kernel turns it into a power-of-two scale.
    v_peak = torch.linalg.vector_norm(v, ord=math.inf, dim=1, dtype=torch.float32) if pv_fp16 else None
    o = torch.empty((B, T, H, V), dtype=q.dtype, device=q.device)
    grid = (triton.cdiv(T, block_m), B * H)
    _softmax_fwd_kernel[grid](
        q, k, v, o, v_peak,
        T, H, K, V, scale * LOG2E,
        CAUSAL=causal,
        SPLIT_P=(precision == "split") and not fp32,
        PV_FP16=pv_fp16,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        P_EXP2_SHIFT=0.0 if fp32 else P_EXP2_SHIFT_16BIT,
        BLOCK_M=block_m, BLOCK_N=chunk_size, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V,
        EVEN_K=K == BLOCK_K, EVEN_V=V == BLOCK_V,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, None
