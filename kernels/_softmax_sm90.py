"""softmax's forward on Hopper (sm_90): a warp-specialized Gluon kernel, FlashAttention-3 style.

    o_t = sum_{i<=t} exp(scale q_t.k_i) v_i / sum_{i<=t} exp(scale q_t.k_i)   (all i when causal=False)

The same online softmax, in the same arithmetic, as softmax.py's Triton kernel (_online_softmax's step:
base-2 scores, P shifted by 2^P_EXP2_SHIFT; P @ V in V's dtype with fp32 accumulation, V optionally
column-scaled fp16): with V in fp16 the two kernels agree bit for bit. What differs is the schedule. One
program owns 128 queries of one (batch, head) and runs three partitions:

- a loader warp streams K and V blocks of BLOCK_N keys through STAGES shared-memory slots with TMA, each slot
  guarded by a "ready" barrier (the copy landed) and an "empty" barrier (both consumers are done with it);
- two consumer warpgroups of 64 queries each. Being separate partitions they synchronise only through the
  barriers, never with each other, so one's softmax (CUDA cores, MUFU) runs while the other's dots hold the
  tensor cores. Inside a warpgroup, block j's scores Q K_j^T and the previous block's P_{j-1} V_{j-1} are
  issued together and the softmax of block j starts as soon as its scores land, while P_{j-1} V_{j-1} is
  still running; the accumulator is rescaled by exp2(m_{j-1} - m_j) once it has.

Why two consumer partitions: Gluon puts a barrier of the whole partition before every mbarrier wait and
arrive, so one partition of 8 warps would move both warpgroups in lockstep, and it runs no faster than the
Triton kernel; as two partitions they overlap (the timings: reports/bench.md, "Design history moved from the
kernel docstrings").
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from attnlab.kernels._online_softmax import block_softmax, key_range, program_head

BLOCK_M = 128  # queries per program: two consumer warpgroups of 64
BLOCK_N = 128  # keys per block
STAGES = 3  # K/V slots in shared memory (3 x 64 KB + Q's 32 KB at head dims 128)
HEAD_DIMS = (64, 128)  # head dims K and V this kernel is built and tested for
CONSUMER_WARPS = 4  # one warpgroup per consumer partition
CONSUMER_REGISTERS = 240
LOADER_REGISTERS = 24


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, ready, empty, q_row, n_blocks,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Q once, then K_j and V_j into slot j % STAGES once both consumers have released it."""
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_ready, q_smem)
    for block in range(n_blocks):
        slot = block % STAGES
        # Parity 1 of a fresh barrier counts as complete: each slot's first use does not wait.
        mbarrier.wait(empty.index(slot), ((block // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [block * BLOCK_N, 0], ready.index(slot), k_smem.index(slot))
        tma.async_copy_global_to_shared(v_desc, [block * BLOCK_N, 0], ready.index(slot), v_smem.index(slot))


@gluon.jit
def _consumer_partition(q_smem, k_smem, v_smem, q_ready, ready, empty, o_ptr, v_inverse_ptr, vo_base,
                        first_query, pid_bh, T, H, qk_scale, unmasked_end, n_blocks,
                        CAUSAL: gl.constexpr, V_SCALED: gl.constexpr, P_EXP2_SHIFT: gl.constexpr,
                        ROWS: gl.constexpr, ROW0: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_V: gl.constexpr,
                        STAGES: gl.constexpr):
    """Rows [ROW0, ROW0 + ROWS) of the program's queries: the online softmax over the key blocks, then o."""
    WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, HEAD_V, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    v_dtype: gl.constexpr = v_smem.dtype

    q_rows = q_smem.slice(ROW0, ROWS)
    offs_m = first_query + ROW0 + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
    row_max = gl.full([ROWS], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    row_sum = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_V], gl.float32, o_layout)
    no_scores = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)

    # Block 0: its scores, its P. Every query sees key 0, so row_max is finite from here on.
    mbarrier.wait(q_ready, 0)
    mbarrier.wait(ready.index(0), 0)
    scores = warpgroup_mma(q_rows, k_smem.index(0).permute((1, 0)), no_scores, use_acc=False)
    if unmasked_end > 0:
        p, row_max, rescale, row_sum = block_softmax(scores, row_max, row_sum, offs_m, offs_n, T, qk_scale,
                                                      False, CAUSAL, P_EXP2_SHIFT)
    else:
        p, row_max, rescale, row_sum = block_softmax(scores, row_max, row_sum, offs_m, offs_n, T, qk_scale,
                                                      True, CAUSAL, P_EXP2_SHIFT)
    p_operand = gl.convert_layout(p.to(v_dtype), p_layout)

    for block in range(1, n_blocks):
        slot = block % STAGES
        previous = (block - 1) % STAGES
        mbarrier.wait(ready.index(slot), (block // STAGES) & 1)
        scores = warpgroup_mma(q_rows, k_smem.index(slot).permute((1, 0)), no_scores, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_operand, v_smem.index(previous), acc, is_async=True)
        # The scores were issued first: waiting for all but the newest dot leaves P_{j-1} V_{j-1} running.
        scores = warpgroup_mma_wait(num_outstanding=1, deps=[scores])
        start_n = block * BLOCK_N
        if start_n < unmasked_end:
            p, row_max, rescale, row_sum = block_softmax(scores, row_max, row_sum, offs_m, start_n + offs_n, T,
                                                          qk_scale, False, CAUSAL, P_EXP2_SHIFT)
        else:
            p, row_max, rescale, row_sum = block_softmax(scores, row_max, row_sum, offs_m, start_n + offs_n, T,
                                                          qk_scale, True, CAUSAL, P_EXP2_SHIFT)
        acc, p_operand = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_operand])
        mbarrier.arrive(empty.index(previous), count=1)
        acc = acc * gl.convert_layout(rescale, o_rows)[:, None]
        p_operand = gl.convert_layout(p.to(v_dtype), p_layout)

    acc = warpgroup_mma(p_operand, v_smem.index((n_blocks - 1) % STAGES), acc, is_async=True)
    acc, p_operand = warpgroup_mma_wait(num_outstanding=0, deps=[acc, p_operand])

    o = acc / gl.convert_layout(row_sum, o_rows)[:, None]
    offs_v = gl.arange(0, HEAD_V, gl.SliceLayout(0, o_layout))
    if V_SCALED:
        o = o * gl.load(v_inverse_ptr + pid_bh * HEAD_V + offs_v)[None, :]
    o_offs_m = first_query + ROW0 + gl.arange(0, ROWS, o_rows)
    o_ptrs = o_ptr + vo_base + o_offs_m[:, None] * (H * HEAD_V) + offs_v[None, :]
    gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=(o_offs_m < T)[:, None])


@gluon.jit
def softmax_fwd_sm90_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, v_inverse_ptr, T, H, qk_scale,
    CAUSAL: gl.constexpr, V_SCALED: gl.constexpr, P_EXP2_SHIFT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_K: gl.constexpr, HEAD_V: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_WARPS: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
    LOADER_REGISTERS: gl.constexpr,
):
    pid_m, pid_bh, qk_base, vo_base = program_head(T, H, HEAD_K, HEAD_V)

    # One [T, head dim] TMA view per head: rows past T read as zeros.
    qk_dtype: gl.constexpr = q_ptr.dtype.element_ty
    v_dtype: gl.constexpr = v_ptr.dtype.element_ty
    q_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_K], qk_dtype)
    k_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_K], qk_dtype)
    v_tile: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_V], v_dtype)
    q_desc = tma.make_tensor_descriptor(q_ptr + qk_base, [T, HEAD_K], [H * HEAD_K, 1], [BLOCK_M, HEAD_K], q_tile)
    k_desc = tma.make_tensor_descriptor(k_ptr + qk_base, [T, HEAD_K], [H * HEAD_K, 1], [BLOCK_N, HEAD_K], k_tile)
    v_desc = tma.make_tensor_descriptor(v_ptr + vo_base, [T, HEAD_V], [H * HEAD_V, 1], [BLOCK_N, HEAD_V], v_tile)

    q_smem = gl.allocate_shared_memory(qk_dtype, [BLOCK_M, HEAD_K], q_tile)
    k_smem = gl.allocate_shared_memory(qk_dtype, [STAGES, BLOCK_N, HEAD_K], k_tile)
    v_smem = gl.allocate_shared_memory(v_dtype, [STAGES, BLOCK_N, HEAD_V], v_tile)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=2)  # one arrival per consumer
    fence_async_shared()

    unmasked_end, end = key_range(pid_m, T, BLOCK_M, BLOCK_N, CAUSAL)
    n_blocks = gl.cdiv(end, BLOCK_N)

    ROWS: gl.constexpr = BLOCK_M // 2
    first_query = pid_m * BLOCK_M
    gl.warp_specialize(
        [
            (_consumer_partition, (q_smem, k_smem, v_smem, q_ready, ready, empty, o_ptr, v_inverse_ptr, vo_base,
                                   first_query, pid_bh, T, H, qk_scale, unmasked_end, n_blocks, CAUSAL, V_SCALED,
                                   P_EXP2_SHIFT, ROWS, 0, BLOCK_N, HEAD_V, STAGES)),
            (_consumer_partition, (q_smem, k_smem, v_smem, q_ready, ready, empty, o_ptr, v_inverse_ptr, vo_base,
                                   first_query, pid_bh, T, H, qk_scale, unmasked_end, n_blocks, CAUSAL, V_SCALED,
                                   P_EXP2_SHIFT, ROWS, ROWS, BLOCK_N, HEAD_V, STAGES)),
            (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, ready, empty, first_query,
                               n_blocks, BLOCK_N, STAGES)),
        ],
        [CONSUMER_WARPS, 1],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )
