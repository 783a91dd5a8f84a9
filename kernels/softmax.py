"""softmax (FORMULATIONS.md 1): a FlashAttention-2 style forward (the chunkwise form; no state).

    o_t = sum_{i<=t} exp(scale q_t.k_i) v_i / sum_{i<=t} exp(scale q_t.k_i)   (all i when causal=False)

Conventions: q, k [B, T, H, K], v [B, T, H, V], o [B, T, H, V] in the input
dtype (fp16, bf16 or fp32). One program owns BLOCK_M queries of one (batch,
head) and walks the key blocks of ``chunk_size`` (BLOCK_N) keys with the
online softmax (kernels/_online_softmax.py): a running row maximum m and row
sum l in fp32, the output accumulator in fp32, rescaled by exp2(m_old -
m_new) whenever m grows. Scores are taken in base 2, s = (q.k) * scale *
log2(e), so every exponential is one exp2 of a non-positive argument; masked
scores are -inf before the exp2. The grid is (query blocks, B*H), query
blocks in reverse order so the longest causal rows start first, and the
blocks of one head run side by side and share its keys and values in L2.

Launch shape (sm_90): the block sizes come from _DEFAULT_CONFIGS, checked with
ptxas for registers, spills and shared memory; for 16-bit inputs with head
dims <= 128, 128 queries x 128 keys on 8 warps (the smallest tile Triton's
attention tutorial admits for 8 warps on Hopper; two warpgroups of 64 rows,
each dot one wgmma per warpgroup) with 3 stages of K/V in shared memory,
which halves the per-key cost of the accumulator rescale and of the dot
waits against 64-key blocks. Unmasked key blocks (all but the diagonal or
the tail) load without masks when the head dims fill their tiles (EVEN_K,
EVEN_V constexpr). Key pointers are rebuilt from the base each block rather
than carried and incremented: carried pointers across the two loops make the
pipeliner keep more buffers, and spill.

Precision "fp16" converts V once per call, in a pre-pass of two launches
over [128, V] tiles, parallel over T: the column peaks (an atomic maximum
on |v|'s bit patterns), then v * scale in fp16 into a scratch copy of v's
shape. The key loop is then that of "input" with fp16 V tiles that go
straight to shared memory, where a conversion inside the key loop would
take every V tile through registers again for every query block.

Option warp_specialize (default True): on sm_90, where _warp_specialized_fits says so (16-bit inputs,
precision "fp16" or "input", head dims 64 or 128, TMA-aligned rows, the launch options below at their
defaults), the call runs _softmax_sm90's Gluon kernel instead: the same arithmetic (bit for bit with V in
fp16) on a FlashAttention-3 schedule, a loader warp and two consumer warpgroups that synchronise only
through shared-memory barriers, so that one's softmax overlaps the other's dots, and each warpgroup's
softmax of block j overlaps its own P_{j-1} V_{j-1}. The Triton kernel stays the path everywhere else
(other GPUs, head dims, "split", fp32, explicit launch options, the interpreter).

Option tma (default True) loads Q, K and V through tensor descriptors built
on the device, one [T, head dim] view per head (TMA on sm_90; the wrapper
sets triton.set_allocator, process-wide, for their scratch), where every
head's row starts 16 bytes aligned, and falls back to pointers elsewhere:
fewer registers and a faster attention kernel than pointer loads.

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
  per (batch, head, value column), 2^(13 - floor(log2 max_t |v|))
  (``_numerics.pow2_scale``): bf16's 8 significant bits fit fp16's 11 once
  the column peak lies in [2^13, 2^14); entries more than 2^30 below the
  peak become fp16 subnormals, off by at most 2^-38 of the peak. The
  pre-pass takes max |v| over T, turns it into the scale from its exponent
  bits and converts V; the attention kernel divides the scale out of its
  output. Its excess stays near 1 also on tiny outputs, where "input" does
  not. For fp16 inputs it is "input" with the (exact) column scale.
- "input": P is rounded once to the input dtype for the P @ V dot,
  as FlashAttention does: the fastest. On large outputs the roundings
  average out; on tiny outputs (one value channel, a few keys) nothing
  does, and its excess goes several times over the floor.
- "split" (the default for fp16 inputs): P = hi + lo with hi = P rounded to
  the input dtype and lo the rounded remainder (``_numerics.split``), two
  P @ V dots; P is then exact to about 2^-16 and the excess is 1.00, for 1.5x
  the tensor-core work. In fp16, rounding P to fp16 costs as much as the
  output rounding itself, so only the split reaches the floor there.
- "auto" (default): "fp16" for bf16 inputs, "split" for fp16 inputs.
- fp32 inputs keep P in fp32 and run both dots with input_precision="ieee"
  (exact fp32 products; TF32 would round scores to 10 bits). precision has
  no effect there.

Measurements behind these choices (timings against SDPA, registers, emulated
excess): reports/bench.md, "Design history moved from the kernel docstrings".

Backward (BACKWARD["chunkwise"], FlashAttention-2's algorithm). With s_ij = scale q_i.k_j,
P_ij = exp(s_ij - lse_i) and the cotangent do:

    dv_j = sum_i P_ij do_i          dP_ij = do_i.v_j          D_i = do_i.o_i = sum_j P_ij dP_ij
    dS_ij = P_ij (dP_ij - D_i)      dq_i = scale sum_j dS_ij k_j      dk_j = scale sum_i dS_ij q_i

What the forward saves (only when autograd asks, through ``saved``) and why:

- "row_max" and "log_row_sum" [B, H, T] fp32: the row's log-sum-exp in base 2 and score units
  scale log2(e) q.k, lse = m + log2(l), as its two terms. With them the backward recomputes
  P = exp2((s - m) - log2(l)) tile by tile (exponent <= 0, P <= 1) instead of storing the T x T matrix, as
  FlashAttention does. Kept apart because their sum rounds log2(l) to the ulp of m: on a row where one key
  dominates, exp2(s - lse) then carries |m| 2^-24 of error that s - m (0 for that key, as in the forward) does
  not; in fp32 this took dv's excess from 4.5-5.5 to 1.9 on rows with scores ~100 nats apart.
- "o_residual" (16-bit inputs): the forward's fp32 o minus the stored o, in the input dtype. D_i is the one
  term taken from o. On a row where one key dominates, dP_ij - D_i cancels to do_i.(v_j - o_i), a small
  difference; FlashAttention's D from the rounded o is off by the output rounding (2^-9 |do| |o| in bf16), which
  then dominates dS and dq. o + o_residual is the fp32 o to ~2^-16, and under autograd the forward splits P for
  its P @ V dot at every precision but "input", so that this fp32 o is itself accurate to ~2^-16 (the
  one-dot "fp16" path rounds P to 2^-11). o itself is not stored again: the wrapper hands it to the backward.
- Not saved: P, dP, dS (recomputed per tile: the two score dots S = Q K^T and dP = dO V^T cost less than
  reading a T x T matrix back) and D (a pre-pass, _delta_kernel, from o, o_residual and do).

Kernels: _delta_kernel (D per row, fp32), then _softmax_bwd_dkdv_kernel (a program per key block, stepping over
the query blocks that see it: dk and dv sum in registers) and _softmax_bwd_dq_kernel (a program per query block,
stepping over its keys: dq sums in registers). Two kernels rather than FlashAttention-2's atomic dq: no fp32 dq
scratch, no atomics (deterministic), each kernel holds only its own accumulators (fewer registers), at the cost
of recomputing S and dP in the dq kernel (7 tile dots per tile pair instead of 5). Causal masks only on the
diagonal tiles and the tail; all sums in fp32.

P and dS enter their dots (dv, dk, dq) by precision: fp32 inputs exact fp32 dots ("ieee"); "input" rounds P and
dS once to the input dtype (FlashAttention's rounding, the fastest); every other setting ("auto", "split",
"fp16") carries them as hi + lo in the input dtype (_numerics.dot_f32_lowp), about 2^-16 relative, each row
scaled to a peak of 2^14 first for fp16 so that small P and dS keep their bits: 3 of the 7 dots doubled. The
forward's launch options (block sizes, warps, stages, tma, warp_specialize) do not apply to the backward, whose
tile shapes come from _BACKWARD_CONFIGS. Gradients come back in the input dtype, rounded once from fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels import _softmax_sm90
from attnlab.kernels._numerics import dot_f32_lowp, pow2_scale, split
from attnlab.kernels._online_softmax import block_softmax, key_range, program_head
from attnlab.kernels._util import allow_device_descriptors, block_size, no_pending_checks, tma_fits
from attnlab.runtime import interpreter_active

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
        # Q, K and V tiles through tensor descriptors (TMA on sm_90) where the head dims allow it, see _util.tma_fits.
        "tma": (True, (False, True)),
        # On sm_90, the warp-specialized Gluon kernel of _softmax_sm90 where it applies, see _warp_specialized_fits.
        "warp_specialize": (True, (False, True)),
    }
}
# The Triton kernel's launch options (block_m, chunk_size, num_warps, num_stages) at their defaults: a call that
# sets none of them leaves the choice of kernel to chunkwise (see _warp_specialized_fits).
LAUNCH_OPTION_NAMES = ("block_m", "chunk_size", "num_warps", "num_stages")
DEFAULT_LAUNCH_OPTIONS = tuple(OPTIONS["chunkwise"][name][0] for name in LAUNCH_OPTION_NAMES)
# The fast side of the precision trade: P rounded once, as FlashAttention does.
SPEED_OPTIONS: dict[str, dict[str, object]] = {"chunkwise": {"precision": "input"}}

# Default (block_m, largest chunk_size, num_warps, num_stages) by input width and the
# wider head-dim tile, chosen by compiling for sm_90 (ptxas -v): no spills and
# shared memory under 227 KB. 16-bit, tile <= 128: 128 x 128 score tiles on two
# warpgroups (one 64-row wgmma each), 3 stages of K and V. fp32 runs its
# "ieee" dots on CUDA cores, whose operands sit in registers: small tiles.
_DEFAULT_CONFIGS = {
    (2, 128): (128, 128, 8, 3),
    (2, 256): (128, 32, 8, 3),
    (4, 64): (32, 32, 4, 2),
    (4, 128): (32, 16, 4, 2),
    (4, 256): (32, 16, 8, 2),
}

# Elements per [rows, V] tile of precision "fp16"'s V pre-pass: 128 rows at V = 128 (the fastest peak pass
# measured), fewer rows for wider heads so that a tile stays at 128 fp32 registers per thread on 4 warps.
V_CONVERT_TILE_ELEMENTS = 128 * 128
# Tiles per program of the peak pass, each program ending with one atomic maximum per column (2: the fastest
# measured, tools/gpu/configs.py's constants V_PEAK_TILES).
V_PEAK_TILES = 2


def _v_convert_rows(V: int) -> int:
    """Rows per tile of the V pre-pass for head dim V."""
    return V_CONVERT_TILE_ELEMENTS // block_size(V)


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


# Precision "fp16"'s operand, made once per call: for each (batch, head, value column)
#     s = 2^(13 - floor(log2 max_t |v_t|)),   v16_t = fp16(v_t * s)   (exact for bf16 v),
# and 1/s, which the attention kernel applies to its output. Two launches over [BLOCK_T, V] tiles, each
# parallel over T: the column peaks (an atomic maximum per V_PEAK_TILES tiles), then the conversion.
@triton.jit
def _v_tile(v_ptr, first_row, T, H, V, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """(offsets, mask, tile in fp32) of the [BLOCK_T, V] tile of v from first_row, head program_id(1)."""
    pid_bh = tl.program_id(1)
    batch = (pid_bh // H).to(tl.int64)
    head = pid_bh % H
    offs_t = first_row + tl.arange(0, BLOCK_T)
    offs_v = tl.arange(0, BLOCK_V)
    offsets = batch * T * H * V + head * V + offs_t[:, None] * (H * V) + offs_v[None, :]
    mask = (offs_t < T)[:, None] & (offs_v < V)[None, :]
    return offsets, mask, tl.load(v_ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _v_peak_kernel(v_ptr, peak_bits_ptr, T, H, V, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
                   TILES: tl.constexpr):
    """peak_bits[bh, c] = max over the program's TILES tiles of the bit pattern of |v[b, t, h, c]|
    (zero-initialised; one atomic maximum per program).

    Bit patterns of non-negative floats order as their values, and a NaN's lies above inf's, so a column
    holding a NaN keeps a non-finite peak (a float maximum may drop NaNs)."""
    offs_v = tl.arange(0, BLOCK_V)
    largest = tl.zeros([BLOCK_V], tl.int32)
    for tile_index in range(TILES):
        first_row = (tl.program_id(0) * TILES + tile_index) * BLOCK_T
        _, _, tile = _v_tile(v_ptr, first_row, T, H, V, BLOCK_T, BLOCK_V)
        largest = tl.maximum(largest, tl.max(tile.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
    tl.atomic_max(peak_bits_ptr + tl.program_id(1) * V + offs_v, largest, mask=offs_v < V)


@triton.jit
def _v_to_fp16_kernel(v_ptr, peak_bits_ptr, v16_ptr, inverse_ptr, T, H, V,
                      BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr):
    """v16 = fp16(v * s) for one [BLOCK_T, V] tile, s from the column peaks; the first tile of each head
    also writes 1/s."""
    offsets, mask, tile = _v_tile(v_ptr, tl.program_id(0) * BLOCK_T, T, H, V, BLOCK_T, BLOCK_V)
    offs_v = tl.arange(0, BLOCK_V)
    column_ok = offs_v < V
    peaks = peak_bits_ptr + tl.program_id(1) * V + offs_v
    peak = tl.load(peaks, mask=column_ok, other=0).to(tl.float32, bitcast=True)
    tl.store(inverse_ptr + tl.program_id(1) * V + offs_v, pow2_scale(peak, 13)[1],
             mask=column_ok & (tl.program_id(0) == 0))
    tl.store(v16_ptr + offsets, (tile * pow2_scale(peak, 13)[0][None, :]).to(tl.float16), mask=mask)


@triton.jit
def _online_softmax_step(
    acc, row_max, row_sum, q, k_src, v_src, start_n,
    offs_m, offs_n, offs_k, offs_v, T, H, K, V, qk_scale,
    MASK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, P_EXP2_SHIFT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
    TMA: tl.constexpr,
):
    """One key block, keys start_n + offs_n: fold exp2(s - m) v into the running (acc, row_max, row_sum).

    k_src, v_src: the head's keys and values, tensor descriptors (TMA: zero-filled past T and the head
    dims) or pointers to its key 0 spread over a tile. MASK_KEYS: the block may hold keys past T or
    (causal) after a query; their scores become -inf before the max and the exp2. EVEN_K / EVEN_V: the
    head dims fill their tiles, so those pointer loads need no mask.
    """
    if TMA:
        k_block = k_src.load([start_n, 0]).T
        v_block = v_src.load([start_n, 0])
    else:
        # k is read as k^T tiles [BLOCK_K, BLOCK_N], v as [BLOCK_N, BLOCK_V].
        key_ok = offs_n < T
        k_block = _load_tile(k_src + start_n * (H * K), offs_k < K, key_ok, not EVEN_K, MASK_KEYS)
        v_block = _load_tile(v_src + start_n * (H * V), key_ok, offs_v < V, MASK_KEYS, not EVEN_V)
    scores = tl.dot(q, k_block, input_precision=DOT_PRECISION)
    p, new_max, rescale, row_sum = block_softmax(scores, row_max, row_sum, offs_m, offs_n, T, qk_scale,
                                                 MASK_KEYS, CAUSAL, P_EXP2_SHIFT)
    acc = acc * rescale[:, None]
    # P is rounded to V's dtype: the input dtype, or fp16 for the column-scaled V of precision "fp16".
    if SPLIT_P:
        p_hi, p_lo = split(p, v_block.dtype)
        acc = tl.dot(p_lo, v_block, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(p_hi, v_block, acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(p.to(v_block.dtype), v_block, acc, input_precision=DOT_PRECISION)
    return acc, new_max, row_sum


@triton.jit
def _softmax_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, v_inverse_ptr, row_max_ptr, log_row_sum_ptr, o_residual_ptr,
    T, H, K, V, qk_scale,
    CAUSAL: tl.constexpr, SPLIT_P: tl.constexpr, V_SCALED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    P_EXP2_SHIFT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_V: tl.constexpr, TMA: tl.constexpr,
    SAVE_STATS: tl.constexpr, SAVE_RESIDUAL: tl.constexpr,
):
    pid_m, pid_bh, qk_base, vo_base = program_head(T, H, K, V)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)

    if TMA:
        # One [T, head dim] view per head: the head dim as the descriptor's extent zero-fills the tile
        # columns past it instead of reading the next head's.
        q_desc = tl.make_tensor_descriptor(q_ptr + qk_base, [T, K], [H * K, 1], [BLOCK_M, BLOCK_K])
        q = q_desc.load([pid_m * BLOCK_M, 0])
        k_src = tl.make_tensor_descriptor(k_ptr + qk_base, [T, K], [H * K, 1], [BLOCK_N, BLOCK_K])
        v_src = tl.make_tensor_descriptor(v_ptr + vo_base, [T, V], [H * V, 1], [BLOCK_N, BLOCK_V])
    else:
        q_ptrs = q_ptr + qk_base + offs_m[:, None] * (H * K) + offs_k[None, :]
        q = _load_tile(q_ptrs, offs_m < T, offs_k < K, True, not EVEN_K)
        # One block of keys further is a fixed pointer step (int64 via the pointers: no int32 overflow at long T).
        k_src = k_ptr + qk_base + offs_n[None, :] * (H * K) + offs_k[:, None]
        v_src = v_ptr + vo_base + offs_n[:, None] * (H * V) + offs_v[None, :]

    row_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)

    unmasked_end, end = key_range(pid_m, T, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, unmasked_end, BLOCK_N):
        acc, row_max, row_sum = _online_softmax_step(
            acc, row_max, row_sum, q, k_src, v_src, start_n,
            offs_m, start_n + offs_n, offs_k, offs_v, T, H, K, V, qk_scale,
            False, CAUSAL, SPLIT_P, DOT_PRECISION, P_EXP2_SHIFT, EVEN_K, EVEN_V, TMA,
        )
    for start_n in range(unmasked_end, end, BLOCK_N):
        acc, row_max, row_sum = _online_softmax_step(
            acc, row_max, row_sum, q, k_src, v_src, start_n,
            offs_m, start_n + offs_n, offs_k, offs_v, T, H, K, V, qk_scale,
            True, CAUSAL, SPLIT_P, DOT_PRECISION, P_EXP2_SHIFT, EVEN_K, EVEN_V, TMA,
        )

    o = acc / row_sum[:, None]
    if V_SCALED:
        o = o * tl.load(v_inverse_ptr + pid_bh * V + offs_v, mask=offs_v < V, other=1.0)[None, :]
    o_offsets = vo_base + offs_m[:, None] * (H * V) + offs_v[None, :]
    o_mask = (offs_m < T)[:, None] if EVEN_V else (offs_m < T)[:, None] & (offs_v < V)[None, :]
    o_rounded = o.to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + o_offsets, o_rounded, mask=o_mask)
    # For the backward (saved): the row's log-sum-exp in base 2, lse = m + log2(l), as its two terms (their sum
    # would round log2(l) to the ulp of m, and P = exp2(s - lse) of a dominant key would carry that error), and
    # the part of the fp32 output that rounding it to the input dtype dropped, so that D = do.o uses o to ~2^-16.
    if SAVE_STATS:
        tl.store(row_max_ptr + pid_bh * T + offs_m, row_max, mask=offs_m < T)
        tl.store(log_row_sum_ptr + pid_bh * T + offs_m, tl.log2(row_sum) - P_EXP2_SHIFT, mask=offs_m < T)
    if SAVE_RESIDUAL:
        o_residual = (o - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty)
        tl.store(o_residual_ptr + o_offsets, o_residual, mask=o_mask)


def _v_to_fp16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(v * s in fp16, 1/s in fp32 [B*H, V]), s the power-of-two column scale of _numerics.pow2_scale."""
    B, T, H, V = v.shape
    peak_bits = torch.zeros((B * H, V), dtype=torch.int32, device=v.device)
    v16 = torch.empty(v.shape, dtype=torch.float16, device=v.device)
    inverse = torch.empty((B * H, V), dtype=torch.float32, device=v.device)
    tile = dict(BLOCK_T=_v_convert_rows(V), BLOCK_V=block_size(V), num_warps=4)
    tiles = triton.cdiv(T, tile["BLOCK_T"])
    _v_peak_kernel[(triton.cdiv(tiles, V_PEAK_TILES), B * H)](v, peak_bits, T, H, V, TILES=V_PEAK_TILES, **tile)
    _v_to_fp16_kernel[(tiles, B * H)](v, peak_bits, v16, inverse, T, H, V, **tile)
    return v16, inverse


def _warp_specialized_fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, precision: str, capability: tuple[int, int] | None,
    launch_options: tuple[int | None, ...],
) -> bool:
    """Whether _softmax_sm90's kernel runs this call: on sm_90 (``capability``; None off the GPU), 16-bit
    inputs, one P @ V dot (precision "fp16" or "input", resolved), head dims it is built for, TMA-aligned
    rows (v after the "fp16" conversion), and the Triton kernel's launch options (LAUNCH_OPTION_NAMES) left at
    their defaults."""
    return (
        capability == (9, 0)
        and q.dtype in (torch.float16, torch.bfloat16)
        and precision in ("fp16", "input")
        and q.shape[-1] in _softmax_sm90.HEAD_DIMS
        and v.shape[-1] in _softmax_sm90.HEAD_DIMS
        and launch_options == DEFAULT_LAUNCH_OPTIONS
        and tma_fits(q, k, v)
    )


def _device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of the GPU holding ``t``; None on the CPU or under the interpreter."""
    if interpreter_active() or not t.is_cuda:
        return None
    return torch.cuda.get_device_capability(t.device)


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
    tma: bool = True,
    warp_specialize: bool = True,
    await_checks: Callable[[], None] = no_pending_checks,
    saved: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, None]:
    """Softmax attention forward; returns (o [B, T, H, V] in the input dtype, None). With ``saved`` (a dict, for
    chunkwise_backward) it also stores "row_max" and "log_row_sum" [B, H, T] (fp32, base 2, in units of
    scale * log2(e) * q.k: m and log2(l)) and, for 16-bit inputs, "o_residual" (o's fp32 value minus o, in the input
    dtype), on the Triton kernel."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BLOCK_K, BLOCK_V = block_size(K), block_size(V)
    launch_options = (block_m, chunk_size, num_warps, num_stages)
    block_m, chunk_size, num_warps, num_stages = _launch_config(
        q.element_size(), max(BLOCK_K, BLOCK_V), block_m, chunk_size, num_warps, num_stages
    )
    await_checks()
    if scale < 0:
        # Negating q is exact; it keeps qk_scale >= 0, which the unmasked step relies on.
        q, scale = -q, -scale
    fp32 = q.dtype == torch.float32
    if precision == "auto":
        precision = "fp16" if q.dtype == torch.bfloat16 else "split"
    v_scaled = precision == "fp16" and not fp32
    v_inverse = None
    if v_scaled:
        v, v_inverse = _v_to_fp16(v)
    use_tma = tma and tma_fits(q, k, v)
    if use_tma:
        allow_device_descriptors(q.device)
    o = torch.empty((B, T, H, V), dtype=q.dtype, device=q.device)
    row_max = log_row_sum = o_residual = None
    if saved is not None:
        row_max = saved["row_max"] = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
        log_row_sum = saved["log_row_sum"] = torch.empty_like(row_max)
        if not fp32:
            o_residual = saved["o_residual"] = torch.empty_like(o)
    if saved is None and use_tma and warp_specialize and _warp_specialized_fits(q, k, v, precision, _device_capability(q), launch_options):
        sm90 = _softmax_sm90
        sm90.softmax_fwd_sm90_kernel[(triton.cdiv(T, sm90.BLOCK_M), B * H)](
            q, k, v, o, v_inverse, T, H, scale * LOG2E,
            CAUSAL=causal, V_SCALED=v_scaled, P_EXP2_SHIFT=P_EXP2_SHIFT_16BIT,
            BLOCK_M=sm90.BLOCK_M, BLOCK_N=sm90.BLOCK_N, HEAD_K=K, HEAD_V=V, STAGES=sm90.STAGES,
            CONSUMER_WARPS=sm90.CONSUMER_WARPS, CONSUMER_REGISTERS=sm90.CONSUMER_REGISTERS,
            LOADER_REGISTERS=sm90.LOADER_REGISTERS, num_warps=sm90.CONSUMER_WARPS,
        )
        return o, None
    grid = (triton.cdiv(T, block_m), B * H)
    _softmax_fwd_kernel[grid](
        q, k, v, o, v_inverse, row_max, log_row_sum, o_residual,
        T, H, K, V, scale * LOG2E,
        CAUSAL=causal,
        # Under autograd (saved) every precision but "input" splits P: D = do.o then sees o to ~2^-16, not 2^-11.
        SPLIT_P=(precision == "split" or (saved is not None and precision != "input")) and not fp32,
        V_SCALED=v_scaled,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        P_EXP2_SHIFT=0.0 if fp32 else P_EXP2_SHIFT_16BIT,
        BLOCK_M=block_m, BLOCK_N=chunk_size, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V,
        EVEN_K=K == BLOCK_K, EVEN_V=V == BLOCK_V, TMA=use_tma,
        SAVE_STATS=row_max is not None, SAVE_RESIDUAL=o_residual is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, None


# ------------------------------------------------------------------------------------------------ backward

# Backward launch shapes by input width and the wider head-dim tile, one per kernel: (rows per program, rows per
# loop step, num_warps, num_stages). The dK/dV kernel owns a block of keys and steps over queries; the dQ kernel
# owns a block of queries and steps over keys. The dK/dV kernel is the tight one: it keeps k, v and the fp32 dk,
# dv of its keys in registers besides the [keys, step] P, dP and dS tiles. fp32's "ieee" dots run on CUDA cores
# with operands in registers: 16- and 32-row tiles. How the 16-bit shapes were chosen: reports/bench.md.
BackwardConfig = tuple[int, int, int, int]
_BACKWARD_CONFIGS: dict[tuple[int, int], dict[str, BackwardConfig]] = {
    (2, 64): {"dkdv": (64, 32, 4, 3), "dq": (64, 32, 4, 3)},
    (2, 128): {"dkdv": (64, 32, 4, 3), "dq": (64, 32, 4, 3)},
    (2, 256): {"dkdv": (32, 16, 8, 1), "dq": (32, 16, 8, 1)},
    (4, 64): {"dkdv": (32, 16, 4, 1), "dq": (32, 16, 4, 1)},
    (4, 128): {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)},
    (4, 256): {"dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)},
}
# Rows per program of the D pre-pass.
DELTA_BLOCK_ROWS = 64


def _backward_config(itemsize: int, widest: int) -> dict[str, BackwardConfig]:
    """{"dkdv": ..., "dq": ...}: (BLOCK_PROGRAM, BLOCK_STEP, num_warps, num_stages) of each backward kernel for the
    narrowest listed tile >= widest."""
    width = min(w for (size, w) in _BACKWARD_CONFIGS if size == itemsize and w >= widest)
    return _BACKWARD_CONFIGS[(itemsize, width)]


# D_i = do_i . o_i, the row term of dS = P (dP - D). o here is the forward's fp32 output: the stored o plus the
# residual its rounding dropped. From the rounded o alone (FlashAttention's D), D is off by ~u |do_i| |o_i|, and on
# a row where one key dominates, dP_ij - D_i cancels to a small difference that this error then swamps.
@triton.jit
def _delta_kernel(o_ptr, o_residual_ptr, do_ptr, delta_ptr, T, H, V,
                  HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    pid_bh = tl.program_id(1)
    batch = (pid_bh // H).to(tl.int64)
    head = pid_bh % H
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, BLOCK_V)
    offsets = batch * T * H * V + head * V + offs_m[:, None] * (H * V) + offs_v[None, :]
    mask = (offs_m < T)[:, None] & (offs_v < V)[None, :]
    o = tl.load(o_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        o += tl.load(o_residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + pid_bh * T + offs_m, tl.sum(do * o, 1), mask=offs_m < T)


@triton.jit
def _accumulate_dot(x, b, acc, FP32: tl.constexpr, SPLIT: tl.constexpr, RESCALE: tl.constexpr):
    """acc + x @ b for an fp32 tile x (P or dS) and a tile b in the input dtype. fp32 inputs: one exact fp32 dot.
    16-bit inputs: x as hi + lo in the input dtype (SPLIT: two dots, x to ~2^-16; with RESCALE, fp16's, each
    row first scaled to a peak of 2^14 so that small rows keep their bits), or x rounded once (FlashAttention's
    rounding of P and dS)."""
    if FP32:
        return tl.dot(x, b, acc, input_precision="ieee")
    elif SPLIT:
        return dot_f32_lowp(x, b, acc, "split", RESCALE)
    else:
        return tl.dot(x.to(b.dtype), b, acc)


# One step of the dK/dV kernel: the program's keys j (k, v resident) against the query rows i of one block.
#     P_ij = exp2((s_ij - m_i) - log2(l_i))    s_ij = scale log2(e) q_i.k_j    (exponent <= 0: s_ij <= m_i, l_i >= 1)
#     dv_j += sum_i P_ij do_i      dP_ij = do_i.v_j      dS_ij = P_ij (dP_ij - D_i)      dk_j += sum_i dS_ij q_i
# computed transposed ([keys, queries] tiles) so that both sums are row-major dots into the resident
# accumulators. dk_j is left without its factor scale, applied once at the end.
@triton.jit
def _dkdv_step(
    dk, dv, k, v, q_head, do_head, row_max_head, log_row_sum_head, delta_head, start_m, offs_n, offs_k, offs_v,
    T, H, K, V, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, FP32: tl.constexpr, SPLIT: tl.constexpr, RESCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
):
    """MASK: the block may hold queries past T, keys past T, or (causal) queries before keys; their P is 0."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    query_ok = offs_m < T
    q = _load_tile(q_head + offs_m[:, None] * (H * K) + offs_k[None, :], query_ok, offs_k < K, MASK, not EVEN_K)
    do = _load_tile(do_head + offs_m[:, None] * (H * V) + offs_v[None, :], query_ok, offs_v < V, MASK, not EVEN_V)
    if MASK:
        row_max = tl.load(row_max_head + offs_m, mask=query_ok, other=0.0)
        log_row_sum = tl.load(log_row_sum_head + offs_m, mask=query_ok, other=0.0)
        delta = tl.load(delta_head + offs_m, mask=query_ok, other=0.0)
    else:
        row_max = tl.load(row_max_head + offs_m)
        log_row_sum = tl.load(log_row_sum_head + offs_m)
        delta = tl.load(delta_head + offs_m)
    scores_t = tl.dot(k, tl.trans(q), input_precision="ieee" if FP32 else "tf32") * qk_scale
    if MASK:
        visible = query_ok[None, :] & (offs_n < T)[:, None]
        if CAUSAL:
            visible = visible & (offs_m[None, :] >= offs_n[:, None])
        scores_t = tl.where(visible, scores_t, -float("inf"))
    p_t = tl.exp2((scores_t - row_max[None, :]) - log_row_sum[None, :])
    dv = _accumulate_dot(p_t, do, dv, FP32, SPLIT, RESCALE)
    dp_t = tl.dot(v, tl.trans(do), input_precision="ieee" if FP32 else "tf32")
    ds_t = p_t * (dp_t - delta[None, :])
    dk = _accumulate_dot(ds_t, q, dk, FP32, SPLIT, RESCALE)
    return dk, dv


# dK, dV: one program per block of BLOCK_N keys of one (batch, head), stepping over every query block that sees
# them (causal: from the diagonal on), so that dk and dv sum in registers without atomics:
#     dv_j = sum_i P_ij do_i,    dk_j = scale sum_i dS_ij q_i.
# The query blocks that cross the diagonal (and, for a key block past T's end, all of them) take the masked step;
# the rest the unmasked one, then a partial last query block the masked one again.
@triton.jit
def _softmax_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, row_max_ptr, log_row_sum_ptr, delta_ptr, dk_ptr, dv_ptr,
    T, H, K, V, qk_scale, dk_scale,
    CAUSAL: tl.constexpr, FP32: tl.constexpr, SPLIT: tl.constexpr, RESCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    pid_bh = tl.program_id(1)
    batch = (pid_bh // H).to(tl.int64)
    head = pid_bh % H
    qk_base = batch * T * H * K + head * K
    vo_base = batch * T * H * V + head * V
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)
    key_ok = offs_n < T
    k = _load_tile(k_ptr + qk_base + offs_n[:, None] * (H * K) + offs_k[None, :], key_ok, offs_k < K, True, not EVEN_K)
    v = _load_tile(v_ptr + vo_base + offs_n[:, None] * (H * V) + offs_v[None, :], key_ok, offs_v < V, True, not EVEN_V)
    dk = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    q_head, do_head = q_ptr + qk_base, do_ptr + vo_base
    row_max_head, log_row_sum_head = row_max_ptr + pid_bh * T, log_row_sum_ptr + pid_bh * T
    delta_head = delta_ptr + pid_bh * T

    if CAUSAL:
        first_m = start_n // BLOCK_M * BLOCK_M
        masked_end = tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M  # past T when this key block is the last
    else:
        first_m = 0
        masked_end = tl.where(start_n + BLOCK_N <= T, 0, T)
    full_end = T // BLOCK_M * BLOCK_M
    for start_m in range(first_m, tl.minimum(masked_end, T), BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, q_head, do_head, row_max_head, log_row_sum_head, delta_head, start_m,
                            offs_n, offs_k, offs_v, T, H, K, V, qk_scale,
                            True, CAUSAL, FP32, SPLIT, RESCALE, BLOCK_M, EVEN_K, EVEN_V)
    for start_m in range(masked_end, full_end, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, q_head, do_head, row_max_head, log_row_sum_head, delta_head, start_m,
                            offs_n, offs_k, offs_v, T, H, K, V, qk_scale,
                            False, CAUSAL, FP32, SPLIT, RESCALE, BLOCK_M, EVEN_K, EVEN_V)
    for start_m in range(tl.maximum(masked_end, full_end), T, BLOCK_M):
        dk, dv = _dkdv_step(dk, dv, k, v, q_head, do_head, row_max_head, log_row_sum_head, delta_head, start_m,
                            offs_n, offs_k, offs_v, T, H, K, V, qk_scale,
                            True, CAUSAL, FP32, SPLIT, RESCALE, BLOCK_M, EVEN_K, EVEN_V)

    dk_ptrs = dk_ptr + qk_base + offs_n[:, None] * (H * K) + offs_k[None, :]
    dv_ptrs = dv_ptr + vo_base + offs_n[:, None] * (H * V) + offs_v[None, :]
    tl.store(dk_ptrs, (dk * dk_scale).to(dk_ptr.dtype.element_ty), mask=key_ok[:, None] & (offs_k < K)[None, :])
    tl.store(dv_ptrs, dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None] & (offs_v < V)[None, :])


# One step of the dQ kernel: the program's query rows i (q, do, m, log2 l, D resident) against one block of keys j.
#     P_ij = exp2((s_ij - m_i) - log2(l_i))    dS_ij = P_ij (do_i.v_j - D_i)    dq_i += sum_j dS_ij k_j
@triton.jit
def _dq_step(
    dq, q, do, row_max, log_row_sum, delta, k_head, v_head, start_n, offs_m, offs_k, offs_v, T, H, K, V, qk_scale,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, FP32: tl.constexpr, SPLIT: tl.constexpr, RESCALE: tl.constexpr,
    BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
):
    """MASK: the block may hold keys past T or (causal) after a query; their P is 0."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < T
    k = _load_tile(k_head + offs_n[:, None] * (H * K) + offs_k[None, :], key_ok, offs_k < K, MASK, not EVEN_K)
    v = _load_tile(v_head + offs_n[:, None] * (H * V) + offs_v[None, :], key_ok, offs_v < V, MASK, not EVEN_V)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee" if FP32 else "tf32") * qk_scale
    if MASK:
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        scores = tl.where(visible, scores, -float("inf"))
    p = tl.exp2((scores - row_max[:, None]) - log_row_sum[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision="ieee" if FP32 else "tf32")
    ds = p * (dp - delta[:, None])
    return _accumulate_dot(ds, k, dq, FP32, SPLIT, RESCALE)


# dQ: one program per block of BLOCK_M queries of one (batch, head), stepping over its keys (causal: up to the
# diagonal) as the forward does: dq_i = scale sum_j dS_ij k_j. It recomputes P and dP, two dots per tile that
# the dK/dV kernel also makes, in exchange for no atomics and no fp32 dq scratch of [B, T, H, K].
# Query rows past T load zeros with m = log2(l) = D = 0: their P is 1 on the unmasked steps, but dP = 0 = D makes
# dS 0.
@triton.jit
def _softmax_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, row_max_ptr, log_row_sum_ptr, delta_ptr, dq_ptr,
    T, H, K, V, qk_scale, dq_scale,
    CAUSAL: tl.constexpr, FP32: tl.constexpr, SPLIT: tl.constexpr, RESCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_V: tl.constexpr,
):
    pid_m, pid_bh, qk_base, vo_base = program_head(T, H, K, V)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.arange(0, BLOCK_V)
    query_ok = offs_m < T
    q = _load_tile(q_ptr + qk_base + offs_m[:, None] * (H * K) + offs_k[None, :], query_ok, offs_k < K, True,
                   not EVEN_K)
    do = _load_tile(do_ptr + vo_base + offs_m[:, None] * (H * V) + offs_v[None, :], query_ok, offs_v < V, True,
                    not EVEN_V)
    row_max = tl.load(row_max_ptr + pid_bh * T + offs_m, mask=query_ok, other=0.0)
    log_row_sum = tl.load(log_row_sum_ptr + pid_bh * T + offs_m, mask=query_ok, other=0.0)
    delta = tl.load(delta_ptr + pid_bh * T + offs_m, mask=query_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    k_head, v_head = k_ptr + qk_base, v_ptr + vo_base

    unmasked_end, end = key_range(pid_m, T, BLOCK_M, BLOCK_N, CAUSAL)
    for start_n in range(0, unmasked_end, BLOCK_N):
        dq = _dq_step(dq, q, do, row_max, log_row_sum, delta, k_head, v_head, start_n, offs_m, offs_k, offs_v,
                      T, H, K, V, qk_scale, False, CAUSAL, FP32, SPLIT, RESCALE, BLOCK_N, EVEN_K, EVEN_V)
    for start_n in range(unmasked_end, end, BLOCK_N):
        dq = _dq_step(dq, q, do, row_max, log_row_sum, delta, k_head, v_head, start_n, offs_m, offs_k, offs_v,
                      T, H, K, V, qk_scale, True, CAUSAL, FP32, SPLIT, RESCALE, BLOCK_N, EVEN_K, EVEN_V)

    dq_ptrs = dq_ptr + qk_base + offs_m[:, None] * (H * K) + offs_k[None, :]
    tl.store(dq_ptrs, (dq * dq_scale).to(dq_ptr.dtype.element_ty), mask=query_ok[:, None] & (offs_k < K)[None, :])


def chunkwise_backward(
    *,
    o: torch.Tensor,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    d_state: None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    precision: str = "auto",
    **ignored: object,
) -> dict[str, torch.Tensor]:
    """Gradients {"q", "k", "v"} (input dtype) of <do, o> for the forward call that filled ``saved``.

    The forward's launch options (block sizes, warps, stages, tma, warp_specialize) do not apply: the backward
    takes its own shapes from _BACKWARD_CONFIGS. precision "input" rounds P and dS once to the input dtype for
    their dots; every other setting carries them as hi + lo (see the module docstring)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BLOCK_K, BLOCK_V = block_size(K), block_size(V)
    configs = _backward_config(q.element_size(), max(BLOCK_K, BLOCK_V))
    fp32 = q.dtype == torch.float32
    # As in the forward: q negated for a negative scale, so that P is computed from the same scores and row statistics.
    # s = scale q.k = |scale| (-q).k: dk = |scale| dS^T (-q), dq = scale dS k.
    q_seen = -q if scale < 0 else q
    delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
    o_residual = saved.get("o_residual")
    _delta_kernel[(triton.cdiv(T, DELTA_BLOCK_ROWS), B * H)](
        o, o_residual, do, delta, T, H, V,
        HAS_RESIDUAL=o_residual is not None, BLOCK_M=DELTA_BLOCK_ROWS, BLOCK_V=BLOCK_V, num_warps=4,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    shared = dict(
        CAUSAL=causal, FP32=fp32, SPLIT=precision != "input", RESCALE=q.dtype == torch.float16,
        BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, EVEN_K=K == BLOCK_K, EVEN_V=V == BLOCK_V,
    )
    qk_scale = abs(scale) * LOG2E
    keys, step, num_warps, num_stages = configs["dkdv"]
    _softmax_bwd_dkdv_kernel[(triton.cdiv(T, keys), B * H)](
        q_seen, k, v, do, saved["row_max"], saved["log_row_sum"], delta, dk, dv, T, H, K, V, qk_scale, abs(scale),
        BLOCK_M=step, BLOCK_N=keys, num_warps=num_warps, num_stages=num_stages, **shared,
    )
    queries, step, num_warps, num_stages = configs["dq"]
    _softmax_bwd_dq_kernel[(triton.cdiv(T, queries), B * H)](
        q_seen, k, v, do, saved["row_max"], saved["log_row_sum"], delta, dq, T, H, K, V, qk_scale, scale,
        BLOCK_M=queries, BLOCK_N=step, num_warps=num_warps, num_stages=num_stages, **shared,
    )
    return {"q": dq, "k": dk, "v": dv}


BACKWARD = {"chunkwise": chunkwise_backward}
