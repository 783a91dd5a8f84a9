"""Triton kernels for RetNet retention (FORMULATIONS.md 3): ``chunkwise`` and ``recurrent``.

    S_t = exp(g) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)

with g [H] a per-head log decay (g <= 0). Conventions: q, k [B, T, H, K],
v and o [B, T, H, V], g [H], one dtype (fp16, bf16 or fp32); the state
S [B, H, K, V] is fp32 in and out; o is returned in the input dtype.

Both forward kernels run on a grid of (V blocks, B*H): a program owns one V block of
one head's state in fp32 registers and loops over time. At the reference
shape (B=8, H=16, K=V=128, 64-row chunks) the fused chunkwise pass does about
6 MFLOP of tensor-core work per 64 KiB of q, k, v, o traffic and chunk (two
V blocks of 64), so it is memory-bound; a two-pass design (per-chunk states
written out, then an output pass parallel over chunks) would add a state of
K*V*4 = 64 KiB per chunk in fp32 to write and read back, doubling the
traffic, so states stay in registers instead. B*H*2 = 256 programs fill the
H100's 132 SMs; ``block_v`` trades parallelism against recomputing Q K^T.

Decays are applied in log space with every exponent <= 0, the masks applied
before the exponential: within a chunk exp((i - j) g) for i >= j, to the
state from the queries exp((i + 1) g) as a row factor after the dot (so q
stays an exact operand), and to the values exp((C - 1 - j) g) for the state
update (C the chunk's length). A state's own decay by exp(x) (x = C g per
chunk, g per token) is keep * S + change * S (``decay_factors``): near x = 0
S + expm1(x) S, because exp(x) rounded to fp32 next to 1 (g = log(1 - 2^-20)
for RetNet's last heads) would bias S by 2^-25 per step, 5e-4 relative after
16384 steps; below x = -0.5 exp(x) S, because 1 + expm1(x) would lose a small
exp(x) (exp(-20) is below fp32's spacing at 1, and at such decays dg is made of
the decayed terms alone).

Backward (``BACKWARD``). With D_t the cotangent of S_t (dS_T that of the final
state, 0 when no loss reads it), the dual recurrence runs backward in time:

    D_t = exp(g) D_{t+1} + scale q_t do_t^T   (D_T = dS_T + scale q_T do_T^T)
    dq_t = scale S_t do_t,   dk_t = D_t v_t,   dv_t = D_t^T k_t,   dS_0 = exp(g) D_1
    dg = sum_t <D_t, exp(g) S_{t-1}> = sum over pairs (write of k_j v_j^T or S_0, read by q_i or dS_T) of
         (steps between them) * (the pair's term)

dg is the one gate gradient: g is constant in time, so it is the sum of the
per-step gate gradients. The usual arrangement, sum_t t (q_t.dq_t - k_t.dk_t)
plus state terms (a reverse cumulative sum of per-step gradients), weights
terms of both signs by their positions, up to T, where the pairs they stand for
span only about 1/|g| steps: it cancels by a factor near T |g| (2^11 at
T = 4096, g = -0.5). Here every term is weighted by the decay steps it spans,
a weight >= 0, so the sum cancels no more than its terms do.

- ``recurrent_backward``: a forward sweep recomputing S_t with its tangent
  M_t = dS_t/dg = exp(g) (M_{t-1} + S_{t-1}), giving dq_t and
  dg = sum_t scale q_t^T M_t do_t + <dS_T, M_T>; then a reverse sweep giving
  dk, dv and dS_0. Both one token per step with the state in registers, as
  the forward; the V blocks' shares of dq and dk are summed on the host.
  Nothing is saved: recomputing S costs what the forward cost.
- ``chunkwise_backward``: a reverse pass over chunks (grid V blocks x B*H)
  writes the cotangent dS_{c+1} of the state leaving each chunk; then every
  chunk at once, dq, dk and dg by K blocks of 32 (grid K blocks x chunks x
  B*H, each program looping over V blocks) and dv by V blocks (grid V blocks
  x chunks x B*H), as fla's chunk_simple_gla splits them:
      dq_i = scale exp((i+1) g) S_c do_i + sum_{j<=i} scale exp((i-j) g) (do_i.v_j) k_j
      dk_j = exp((C-1-j) g) dS_{c+1} v_j + sum_{i>=j} scale exp((i-j) g) (do_i.v_j) q_i
      dv_j = exp((C-1-j) g) dS_{c+1}^T k_j + sum_{i>=j} A_ij do_i
  with A the forward's decayed scores, and the chunk's share of dg:
      sum_ij (i-j) A_ij (do_i.v_j) + sum_i (i+1) q_i.dq_i(S_c) + sum_j (C-1-j) k_j.dk_j(dS_{c+1})
      + C exp(C g) <S_c, dS_{c+1}>.
  The forward saves the state entering each chunk, S_c, in fp32 (one store
  per chunk of the state it already holds; B*H*chunks*K*V*4 bytes, 512 MiB at
  the reference shape) rather than the backward recomputing it: a recompute
  would write the same states and read k and v again (fla's chunk_simple_gla
  recomputes them, in fp32 too). The cotangents dS_{c+1} are written in fp32
  as well: the split dots read both states' low bits.

``precision`` and the fp32-operand dots are linear_attn's (kernels/_numerics.py,
``dot_f32_lowp`` and ``dot_lowp_f32``): "split" (default) carries the fp32 score
block, state and decayed values as hi + lo parts in the input dtype (two dots
each), "tf32" and "ieee" use one fp32 dot of that input_precision.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels._numerics import INPUT_SPLIT_PRECISIONS, dot_f32_lowp, dot_lowp_f32, input_split_config
from attnlab.kernels._util import (
    Launch, block_size, default_block_v, gpu_shape_known_bad, launch_after_checks, no_pending_checks, state_block,
)

OPTIONS = {
    "chunkwise": {
        "chunk_size": (64, (16, 32, 64, 128)),
        "precision": ("split", INPUT_SPLIT_PRECISIONS),
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
        "num_stages": (2, (1, 2, 3, 4)),
    },
    "recurrent": {
        "block_v": (None, (None, 16, 32, 64, 128)),
        "num_warps": (4, (1, 2, 4, 8)),
    },
}

# Tiles of the chunkwise backward where its caller gives no block_v, chosen by ptxas' register report for sm_90
# (tools/gpu/sm90_compile.py: bf16, K = V = 128, C = 64, 4 warps), there being no timing yet. The dq, dk and dg
# kernel runs one program per K block, chunk and head, as fla's dq/dk kernel, recomputing dA = do v^T per K block;
# its accumulators (two [C, K block] fp32 tiles, dA [C, C], the states' [K block, V block] tiles) take 177
# registers at 32 x 32, 247 at 32 x 64, and spill at 64 x 32 (28 bytes) and 64 x 64 (124 bytes; none at 8 warps).
# The reverse pass over chunk states takes 158 registers at V blocks of 32 (237 at 64) and has twice the programs
# for its sequential loop. The dv kernel keeps the forward's V block (160 registers at 64).
QUERY_KEY_BLOCK = 32
BACKWARD_BLOCK_V = 32
# The dq, dk and dg kernel's loop over V blocks streams four tiles a step (v, do and two states): at least 3
# pipeline stages (measured: reports/bench.md, session 19).
QUERY_KEY_STAGES = 3


@triton.jit
def expm1(x):
    """exp(x) - 1 in fp32 for x <= 0 without cancellation near 0 (a few ulps relative everywhere).

    Taylor to x^9 for x > -0.5 (truncation below 1e-9 relative), else exp(x) - 1 (|result| > 0.39).
    """
    taylor = x * (1.0 + x * (1.0 / 2 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (
        1.0 / 720 + x * (1.0 / 5040 + x * (1.0 / 40320 + x * (1.0 / 362880)))))))))
    return tl.where(x > -0.5, taylor, tl.exp(tl.minimum(x, 0.0)) - 1.0)


@triton.jit
def decay_factors(log_decay):
    """(keep, change) for a scalar log decay <= 0 with exp(log_decay) x = keep * x + change * x, accurate at both
    ends: (1, expm1) near 0, where exp rounded next to 1 would lose the decay's low bits, and (0, exp) beyond
    -0.5, where 1 + expm1 would lose a small exp (exp(-20) = 2e-9 is below fp32's spacing at 1)."""
    near_one = log_decay > -0.5
    return tl.where(near_one, 1.0, 0.0), tl.where(near_one, expm1(log_decay), tl.exp(log_decay))


@triton.jit
def _chunkwise_kernel(
    q, k, v, g, o, initial_state, final_state, chunk_states,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, STORE_CHUNK_STATES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: V block pid_v of head (b, h), decay g = g[h]. Per chunk of C rows i, j:
    #   o_i = scale sum_{j<=i} exp((i-j) g) (q_i.k_j) v_j + scale exp((i+1) g) q_i S
    #   S   = exp(C g) S + sum_j k_j (exp((C-1-j) g) v_j)^T
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    rows = tl.arange(0, CHUNK)

    log_decay = tl.load(g + h).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    distance = tl.where(causal, rows[:, None] - rows[None, :], 0).to(tl.float32)  # i - j, 0 above the diagonal
    query_decay = scale * tl.exp((rows + 1).to(tl.float32) * log_decay)

    # Within a chunk, row i of q and k is i * H * K elements after row 0 (int32 tiles, fixed);
    # the chunk's first row is a scalar int64 offset stepped per chunk, so no 64-bit tile is carried.
    qk_tile = rows[:, None] * (H * K) + keys[None, :]
    v_tile = rows[:, None] * (H * V) + values[None, :]
    qk_chunk = (b.to(tl.int64) * T * H + h) * K  # element (b, start, h, 0) of q and k
    v_chunk = (b.to(tl.int64) * T * H + h) * V
    if HAS_INITIAL_STATE:
        S = tl.load(initial_state + S_offsets, mask=S_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for start in range(0, T, CHUNK):
        if STORE_CHUNK_STATES:  # the state entering this chunk, for the backward: [B, H, chunks, K, V] fp32
            chunk_offsets = (pid_bh.to(tl.int64) * tl.cdiv(T, CHUNK) + start // CHUNK) * K * V
            tl.store(chunk_states + chunk_offsets + keys[:, None] * V + values[None, :], S, mask=S_mask)
        row_ok = rows < T - start
        qk_mask = row_ok[:, None] & key_ok[None, :]
        v_mask = row_ok[:, None] & value_ok[None, :]
        q_c = tl.load(q + qk_chunk + qk_tile, mask=qk_mask, other=0.0)
        k_c = tl.load(k + qk_chunk + qk_tile, mask=qk_mask, other=0.0)
        v_c = tl.load(v + v_chunk + v_tile, mask=v_mask, other=0.0)

        o_c = query_decay[:, None] * dot_lowp_f32(q_c, S, tl.zeros([CHUNK, BV], dtype=tl.float32), PRECISION, RESCALE)
        scores = tl.dot(q_c, tl.trans(k_c), input_precision=INPUT_PRECISION)
        A = tl.where(causal, scale * scores * tl.exp(distance * log_decay), 0.0)
        o_c = dot_f32_lowp(A, v_c, o_c, PRECISION, RESCALE)
        tl.store(o + v_chunk + v_tile, o_c.to(o.dtype.element_ty), mask=v_mask)

        # Rows past the chunk's length have v = 0; their exponent is clamped to 0, never positive.
        length = tl.minimum(T - start, CHUNK)
        to_end = tl.exp(tl.where(rows < length, (length - 1 - rows).to(tl.float32), 0.0) * log_decay)
        keep, change = decay_factors(length.to(tl.float32) * log_decay)
        S = dot_lowp_f32(tl.trans(k_c), v_c.to(tl.float32) * to_end[:, None], keep * S + change * S, PRECISION, RESCALE)
        qk_chunk += CHUNK * H * K
        v_chunk += CHUNK * H * V

    if STORE_FINAL_STATE:
        tl.store(final_state + S_offsets, S, mask=S_mask)


@triton.jit
def _recurrent_kernel(
    q, k, v, g, o, initial_state, final_state,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
):
    # The literal recurrence, one token at a time, in fp32:
    #   S = exp(g) S + k_t v_t^T,   o_t = S^T (scale q_t)
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    keep, change = decay_factors(tl.load(g + h).to(tl.float32))
    if HAS_INITIAL_STATE:
        S = tl.load(initial_state + S_offsets, mask=S_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    q_t = q + (b.to(tl.int64) * T * H + h) * K + keys
    k_t = k + (b.to(tl.int64) * T * H + h) * K + keys
    v_t = v + (b.to(tl.int64) * T * H + h) * V + values
    o_t = o + (b.to(tl.int64) * T * H + h) * V + values
    for _ in range(0, T):
        q_now = scale * tl.load(q_t, mask=key_ok, other=0.0).to(tl.float32)
        k_now = tl.load(k_t, mask=key_ok, other=0.0).to(tl.float32)
        v_now = tl.load(v_t, mask=value_ok, other=0.0).to(tl.float32)
        S = keep * S + (change * S + k_now[:, None] * v_now[None, :])
        out = tl.sum(q_now[:, None] * S, axis=0)
        tl.store(o_t, out.to(o.dtype.element_ty), mask=value_ok)
        q_t += H * K
        k_t += H * K
        v_t += H * V
        o_t += H * V

    if STORE_FINAL_STATE:
        tl.store(final_state + S_offsets, S, mask=S_mask)


def _final_state(q: torch.Tensor, V: int, return_state: bool) -> torch.Tensor | None:
    B, _, H, K = q.shape
    return torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if return_state else None


def chunkwise(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    state: tuple[torch.Tensor] | None,
    return_state: bool,
    chunk_size: int = 64,
    precision: str = "split",
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """Chunkwise retention in one fused pass; see the module docstring for the options. Given ``saved`` (a
    backward will follow), it also keeps the state entering each chunk there, as "chunk_states"."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V):
        return recurrent(q=q, k=k, v=v, g=g, scale=scale, state=state, return_state=return_state,
                         saved=saved, await_checks=await_checks)
    BK = block_size(K)
    BV = default_block_v(V, BK, block_v)
    input_precision, fp32_precision, rescale = input_split_config(q.dtype, precision)
    o = torch.empty_like(v)
    final = _final_state(q, V, return_state)
    chunk_states = None
    if saved is not None:
        chunk_states = torch.empty(B, H, triton.cdiv(T, chunk_size), K, V, dtype=torch.float32, device=q.device)
        saved["chunk_states"] = chunk_states
    grid = (triton.cdiv(V, BV), B * H)
    launch_after_checks(await_checks, Launch(
        _chunkwise_kernel, grid,
        q, k, v, g, o, state[0] if state is not None else None, final, chunk_states,
        T, H, K, V, scale,
        CHUNK=chunk_size, BK=BK, BV=BV,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        STORE_CHUNK_STATES=saved is not None,
        INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=num_warps, num_stages=num_stages,
    ))
    return o, ((final,) if return_state else None)


def recurrent(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    state: tuple[torch.Tensor] | None,
    return_state: bool,
    block_v: int | None = None,
    num_warps: int = 4,
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """Token-by-token retention with the fp32 state in registers. Its backward recomputes the states, so
    ``saved`` stays empty."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = block_v if block_v is not None else min(block_size(V), 32)
    o = torch.empty_like(v)
    final = _final_state(q, V, return_state)
    grid = (triton.cdiv(V, BV), B * H)
    launch_after_checks(await_checks, Launch(
        _recurrent_kernel, grid,
        q, k, v, g, o, state[0] if state is not None else None, final,
        T, H, K, V, scale,
        BK=BK, BV=BV,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        num_warps=num_warps,
    ))
    return o, ((final,) if return_state else None)


# ------------------------------------------------------------------------------------------------ backward


@triton.jit
def _recurrent_tangent_sweep_kernel(
    q, k, v, g, do, initial_state, d_final_state, dq_parts, dg_parts,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr,
):
    # Forward in time, recomputing S_t and carrying its tangent M_t = dS_t/dg (M_0 = 0):
    #   M_t = exp(g) (M_{t-1} + S_{t-1}),   S_t = exp(g) S_{t-1} + k_t v_t^T
    #   dq_t = scale S_t do_t                          (this V block's share of the sum over V)
    #   dg   = sum_t scale q_t^T M_t do_t + <dS_T, M_T>
    # M_t = sum_{i<=t} (t - i) exp((t - i) g) k_i v_i^T + t exp(t g) S_0: every term carries its distance, a weight
    # >= 0, so dg is summed from its own terms and cancels no more than they do.
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    keep, change = decay_factors(tl.load(g + h).to(tl.float32))
    if HAS_INITIAL_STATE:
        S = tl.load(initial_state + S_offsets, mask=S_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)
    M = tl.zeros([BK, BV], dtype=tl.float32)
    dg = tl.zeros([BK], dtype=tl.float32)  # per key row, reduced once at the end

    qk_row = (b.to(tl.int64) * T * H + h) * K
    v_row = (b.to(tl.int64) * T * H + h) * V
    dq_row = pid_v.to(tl.int64) * tl.num_programs(1) * T * K + qk_row  # dq_parts is [V blocks, B, T, H, K]
    for _ in range(0, T):
        q_now = tl.load(q + qk_row + keys, mask=key_ok, other=0.0).to(tl.float32)
        k_now = tl.load(k + qk_row + keys, mask=key_ok, other=0.0).to(tl.float32)
        v_now = tl.load(v + v_row + values, mask=value_ok, other=0.0).to(tl.float32)
        do_now = tl.load(do + v_row + values, mask=value_ok, other=0.0).to(tl.float32)
        carried = M + S
        M = keep * carried + change * carried
        S = keep * S + (change * S + k_now[:, None] * v_now[None, :])
        tl.store(dq_parts + dq_row + keys, scale * tl.sum(S * do_now[None, :], axis=1), mask=key_ok)
        dg += scale * tl.sum(M * do_now[None, :], axis=1) * q_now
        qk_row += H * K
        v_row += H * V
        dq_row += H * K

    if HAS_FINAL_GRAD:
        dg += tl.sum(tl.load(d_final_state + S_offsets, mask=S_mask, other=0.0) * M, axis=1)
    tl.store(dg_parts + pid_bh * tl.num_programs(0) + pid_v, tl.sum(dg, axis=0))


@triton.jit
def _recurrent_reverse_sweep_kernel(
    q, k, v, g, do, d_final_state, dk_parts, dv, d_initial_state,
    T, H, K, V, scale,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, STORE_INITIAL_GRAD: tl.constexpr,
):
    # Backward in time, the dual of the recurrence: with E = dS_T (the final state's cotangent, or 0),
    #   D_t = E + scale q_t do_t^T   (the cotangent of S_t)
    #   dk_t = D_t v_t               (this V block's share of the sum over V)
    #   dv_t = D_t^T k_t
    #   E = exp(g) D_t
    # and dS_0 = E after t = 1.
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    keep, change = decay_factors(tl.load(g + h).to(tl.float32))
    if HAS_FINAL_GRAD:
        E = tl.load(d_final_state + S_offsets, mask=S_mask, other=0.0)
    else:
        E = tl.zeros([BK, BV], dtype=tl.float32)

    qk_row = (b.to(tl.int64) * T * H + h) * K + (T - 1) * H * K  # the last token first
    v_row = (b.to(tl.int64) * T * H + h) * V + (T - 1) * H * V
    dk_row = pid_v.to(tl.int64) * tl.num_programs(1) * T * K + qk_row  # dk_parts is [V blocks, B, T, H, K]
    for _ in range(0, T):
        q_now = tl.load(q + qk_row + keys, mask=key_ok, other=0.0).to(tl.float32)
        k_now = tl.load(k + qk_row + keys, mask=key_ok, other=0.0).to(tl.float32)
        v_now = tl.load(v + v_row + values, mask=value_ok, other=0.0).to(tl.float32)
        do_now = tl.load(do + v_row + values, mask=value_ok, other=0.0).to(tl.float32)
        D = E + (scale * q_now)[:, None] * do_now[None, :]
        tl.store(dk_parts + dk_row + keys, tl.sum(D * v_now[None, :], axis=1), mask=key_ok)
        tl.store(dv + v_row + values, tl.sum(D * k_now[:, None], axis=0).to(dv.dtype.element_ty), mask=value_ok)
        E = keep * D + change * D
        qk_row -= H * K
        v_row -= H * V
        dk_row -= H * K

    if STORE_INITIAL_GRAD:
        tl.store(d_initial_state + S_offsets, E, mask=S_mask)


@triton.jit
def _chunk_state_gradients_kernel(
    q, g, do, d_final_state, chunk_state_grads, d_initial_state,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_FINAL_GRAD: tl.constexpr, STORE_INITIAL_GRAD: tl.constexpr,
    PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # Over chunks, the last first; dS is the cotangent of the state leaving chunk c (dS_T for the last chunk).
    # Store it (chunk c's keys and values read it), then step to the state entering chunk c, of length C:
    #   dS = exp(C g) dS + sum_i (scale exp((i + 1) g) q_i) do_i^T
    # dS_0 is dS after chunk 0. One program: V block pid_v of head (b, h).
    pid_v, pid_bh, b, h, keys, values, key_ok, value_ok, S_offsets, S_mask = state_block(H, K, V, BK, BV)
    rows = tl.arange(0, CHUNK)
    log_decay = tl.load(g + h).to(tl.float32)
    query_decay = scale * tl.exp((rows + 1).to(tl.float32) * log_decay)

    qk_tile = rows[:, None] * (H * K) + keys[None, :]
    v_tile = rows[:, None] * (H * V) + values[None, :]
    S_tile = keys[:, None] * V + values[None, :]  # within one stored state
    if HAS_FINAL_GRAD:
        dS = tl.load(d_final_state + S_offsets, mask=S_mask, other=0.0)
    else:
        dS = tl.zeros([BK, BV], dtype=tl.float32)

    chunks = tl.cdiv(T, CHUNK)
    for back in range(0, chunks):
        chunk = chunks - 1 - back
        start = chunk * CHUNK
        tl.store(chunk_state_grads + (pid_bh.to(tl.int64) * chunks + chunk) * K * V + S_tile, dS, mask=S_mask)
        row_ok = rows < T - start
        q_c = tl.load(q + (b.to(tl.int64) * T + start) * H * K + h * K + qk_tile,
                      mask=row_ok[:, None] & key_ok[None, :], other=0.0)
        do_c = tl.load(do + (b.to(tl.int64) * T + start) * H * V + h * V + v_tile,
                       mask=row_ok[:, None] & value_ok[None, :], other=0.0)
        length = tl.minimum(T - start, CHUNK)
        keep, change = decay_factors(length.to(tl.float32) * log_decay)
        dS = dot_lowp_f32(tl.trans(q_c), do_c.to(tl.float32) * query_decay[:, None], keep * dS + change * dS,
                          PRECISION, RESCALE)

    if STORE_INITIAL_GRAD:
        tl.store(d_initial_state + S_offsets, dS, mask=S_mask)


@triton.jit
def _chunk_query_key_gradients_kernel(
    q, k, v, g, do, chunk_states, chunk_state_grads, dq, dk, dg_parts,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: K block pid_k of chunk c of head (b, h), every V block in turn. With S the state entering the
    # chunk, dS the cotangent of the state leaving it, C the chunk's length, rows i, j and dA_ij = do_i.v_j:
    #   dq_i = scale exp((i + 1) g) S do_i + sum_{j<=i} scale exp((i - j) g) dA_ij k_j
    #   dk_j = exp((C - 1 - j) g) dS v_j   + sum_{i>=j} scale exp((i - j) g) dA_ij q_i
    # and this K block's share of the chunk's dg, every term times the decay steps it spans (>= 0): i - j for the
    # pair (i, j), i + 1 for a read of S, C - 1 - j for a write into the leaving state, C for S carried through:
    #   sum_ij (i - j) scale exp((i - j) g) (q_i.k_j) dA_ij + sum_i (i + 1) q_i.dq_i(S)
    #   + sum_j (C - 1 - j) k_j.dk_j(dS) + C exp(C g) <S, dS>
    # Each sum over keys splits over K blocks, so the blocks' shares add up (on the host).
    pid_k = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    start = pid_c * CHUNK
    length = tl.minimum(T - start, CHUNK)

    rows = tl.arange(0, CHUNK)
    keys = pid_k * BK + tl.arange(0, BK)
    row_ok = rows < length
    key_ok = keys < K
    log_decay = tl.load(g + h).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    distance = tl.where(causal, rows[:, None] - rows[None, :], 0).to(tl.float32)
    decay = tl.where(causal, scale * tl.exp(distance * log_decay), 0.0)
    query_decay = scale * tl.exp((rows + 1).to(tl.float32) * log_decay)
    steps_to_end = tl.where(row_ok, length - 1 - rows, 0).to(tl.float32)
    to_end = tl.exp(steps_to_end * log_decay)

    qk_offsets = (b.to(tl.int64) * T + start) * H * K + h * K + rows[:, None] * (H * K) + keys[None, :]
    qk_mask = row_ok[:, None] & key_ok[None, :]
    q_c = tl.load(q + qk_offsets, mask=qk_mask, other=0.0)
    k_c = tl.load(k + qk_offsets, mask=qk_mask, other=0.0)

    dA = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    do_S = tl.zeros([CHUNK, BK], dtype=tl.float32)   # do_i S^T, summed over V blocks
    v_dS = tl.zeros([CHUNK, BK], dtype=tl.float32)   # v_j dS^T, summed over V blocks
    S_dS = tl.zeros([BK], dtype=tl.float32)          # <S, dS> per key row
    v_base = (b.to(tl.int64) * T + start) * H * V + h * V
    S_base = (pid_bh.to(tl.int64) * tl.cdiv(T, CHUNK) + pid_c) * K * V
    for v_start in range(0, V, BV):
        values = v_start + tl.arange(0, BV)
        value_ok = values < V
        v_offsets = v_base + rows[:, None] * (H * V) + values[None, :]
        v_mask = row_ok[:, None] & value_ok[None, :]
        S_offsets = S_base + keys[:, None] * V + values[None, :]
        S_mask = key_ok[:, None] & value_ok[None, :]
        v_c = tl.load(v + v_offsets, mask=v_mask, other=0.0)
        do_c = tl.load(do + v_offsets, mask=v_mask, other=0.0)
        S = tl.load(chunk_states + S_offsets, mask=S_mask, other=0.0)
        dS = tl.load(chunk_state_grads + S_offsets, mask=S_mask, other=0.0)
        dA = tl.dot(do_c, tl.trans(v_c), dA, input_precision=INPUT_PRECISION)
        do_S = dot_lowp_f32(do_c, tl.trans(S), do_S, PRECISION, RESCALE)
        v_dS = dot_lowp_f32(v_c, tl.trans(dS), v_dS, PRECISION, RESCALE)
        S_dS += tl.sum(S * dS, axis=1)

    dq_from_state = query_decay[:, None] * do_S
    dk_from_state = to_end[:, None] * v_dS
    d_scores = decay * dA
    tl.store(dq + qk_offsets, dot_f32_lowp(d_scores, k_c, dq_from_state, PRECISION, RESCALE).to(dq.dtype.element_ty),
             mask=qk_mask)
    tl.store(dk + qk_offsets,
             dot_f32_lowp(tl.trans(d_scores), q_c, dk_from_state, PRECISION, RESCALE).to(dk.dtype.element_ty),
             mask=qk_mask)

    scores = tl.dot(q_c, tl.trans(k_c), input_precision=INPUT_PRECISION)  # this K block's share of q_i.k_j
    dg = tl.sum(distance * d_scores * scores)
    dg += tl.sum((rows + 1).to(tl.float32) * tl.sum(q_c.to(tl.float32) * dq_from_state, axis=1))
    dg += tl.sum(steps_to_end * tl.sum(k_c.to(tl.float32) * dk_from_state, axis=1))
    dg += length.to(tl.float32) * tl.exp(length.to(tl.float32) * log_decay) * tl.sum(S_dS, axis=0)
    tl.store(dg_parts + (pid_bh.to(tl.int64) * tl.num_programs(1) + pid_c) * tl.num_programs(0) + pid_k, dg)


@triton.jit
def _chunk_value_gradients_kernel(
    q, k, g, do, chunk_state_grads, dv,
    T, H, K, V, scale,
    CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr,
):
    # One program: V block pid_v of chunk c of head (b, h). With dS the cotangent of the state leaving the chunk,
    # C its length and A the forward's decayed scores, A_ij = scale exp((i - j) g) q_i.k_j for i >= j:
    #   dv_j = exp((C - 1 - j) g) dS^T k_j + sum_{i>=j} A_ij do_i
    pid_v = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    start = pid_c * CHUNK
    length = tl.minimum(T - start, CHUNK)

    rows = tl.arange(0, CHUNK)
    keys = tl.arange(0, BK)
    values = pid_v * BV + tl.arange(0, BV)
    row_ok = rows < length
    key_ok = keys < K
    value_ok = values < V
    log_decay = tl.load(g + h).to(tl.float32)
    causal = rows[:, None] >= rows[None, :]
    distance = tl.where(causal, rows[:, None] - rows[None, :], 0).to(tl.float32)
    to_end = tl.exp(tl.where(row_ok, length - 1 - rows, 0).to(tl.float32) * log_decay)

    qk_offsets = (b.to(tl.int64) * T + start) * H * K + h * K + rows[:, None] * (H * K) + keys[None, :]
    qk_mask = row_ok[:, None] & key_ok[None, :]
    q_c = tl.load(q + qk_offsets, mask=qk_mask, other=0.0)
    k_c = tl.load(k + qk_offsets, mask=qk_mask, other=0.0)
    v_offsets = (b.to(tl.int64) * T + start) * H * V + h * V + rows[:, None] * (H * V) + values[None, :]
    v_mask = row_ok[:, None] & value_ok[None, :]
    do_c = tl.load(do + v_offsets, mask=v_mask, other=0.0)
    S_offsets = (pid_bh.to(tl.int64) * tl.cdiv(T, CHUNK) + pid_c) * K * V + keys[:, None] * V + values[None, :]
    dS = tl.load(chunk_state_grads + S_offsets, mask=key_ok[:, None] & value_ok[None, :], other=0.0)

    scores = tl.dot(q_c, tl.trans(k_c), input_precision=INPUT_PRECISION)
    A = tl.where(causal, scale * scores * tl.exp(distance * log_decay), 0.0)
    dv_c = to_end[:, None] * dot_lowp_f32(k_c, dS, tl.zeros([CHUNK, BV], dtype=tl.float32), PRECISION, RESCALE)
    dv_c = dot_f32_lowp(tl.trans(A), do_c, dv_c, PRECISION, RESCALE)
    tl.store(dv + v_offsets, dv_c.to(dv.dtype.element_ty), mask=v_mask)


def _gradients(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, dq: torch.Tensor,
               dk: torch.Tensor, dv: torch.Tensor, dg_parts: torch.Tensor,
               d_initial: torch.Tensor | None) -> dict[str, torch.Tensor | tuple[torch.Tensor]]:
    """The backward's dict: gradients in their inputs' dtypes (dg summed over batch and parts in fp32)."""
    B, H = dg_parts.shape[:2]
    grads: dict[str, torch.Tensor | tuple[torch.Tensor]] = {
        "q": dq.to(q.dtype), "k": dk.to(k.dtype), "v": dv,
        "g": dg_parts.reshape(B, H, -1).double().sum(dim=(0, 2)).to(g.dtype),
    }
    if d_initial is not None:
        grads["initial_state"] = (d_initial,)
    return grads


def chunkwise_backward(
    *,
    o: torch.Tensor,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    d_state: tuple[torch.Tensor] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    state: tuple[torch.Tensor] | None,
    return_state: bool,
    chunk_size: int = 64,
    precision: str = "split",
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    **ignored: object,
) -> dict[str, torch.Tensor | tuple[torch.Tensor]]:
    """Gradients of chunkwise retention: a reverse pass over chunks for the leaving states' cotangents, then
    every chunk's dq, dk, dv and share of dg at once (see the module docstring)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if gpu_shape_known_bad(K, V):  # the forward ran the recurrent kernel
        return recurrent_backward(o=o, saved=saved, do=do, d_state=d_state, q=q, k=k, v=v, g=g, scale=scale,
                                  state=state, return_state=return_state)
    BK = block_size(K)
    BV = default_block_v(V, BK, block_v)
    backward_block_v = block_v if block_v is not None else min(block_size(V), BACKWARD_BLOCK_V)
    input_precision, fp32_precision, rescale = input_split_config(q.dtype, precision)
    chunks = triton.cdiv(T, chunk_size)
    chunk_state_grads = torch.empty(B, H, chunks, K, V, dtype=torch.float32, device=q.device)
    d_initial = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if state is not None else None
    _chunk_state_gradients_kernel[(triton.cdiv(V, backward_block_v), B * H)](
        q, g, do, d_state[0] if d_state is not None else None, chunk_state_grads, d_initial,
        T, H, K, V, scale,
        CHUNK=chunk_size, BK=BK, BV=backward_block_v,
        HAS_FINAL_GRAD=d_state is not None, STORE_INITIAL_GRAD=state is not None,
        PRECISION=fp32_precision, RESCALE=rescale,
        num_warps=num_warps, num_stages=num_stages,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    key_block = min(BK, QUERY_KEY_BLOCK)
    key_blocks = triton.cdiv(K, key_block)
    dg_parts = torch.empty(B, H, chunks, key_blocks, dtype=torch.float32, device=q.device)
    dots = dict(INPUT_PRECISION=input_precision, PRECISION=fp32_precision, RESCALE=rescale,
                num_warps=num_warps, num_stages=num_stages)
    _chunk_query_key_gradients_kernel[(key_blocks, chunks, B * H)](
        q, k, v, g, do, saved["chunk_states"], chunk_state_grads, dq, dk, dg_parts,
        T, H, K, V, scale,
        CHUNK=chunk_size, BK=key_block, BV=backward_block_v,
        **{**dots, "num_stages": max(num_stages, QUERY_KEY_STAGES)},
    )
    _chunk_value_gradients_kernel[(triton.cdiv(V, BV), chunks, B * H)](
        q, k, g, do, chunk_state_grads, dv,
        T, H, K, V, scale,
        CHUNK=chunk_size, BK=BK, BV=BV, **dots,
    )
    return _gradients(q, k, v, g, dq, dk, dv, dg_parts, d_initial)


def recurrent_backward(
    *,
    o: torch.Tensor,
    saved: dict[str, torch.Tensor],
    do: torch.Tensor,
    d_state: tuple[torch.Tensor] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float,
    state: tuple[torch.Tensor] | None,
    return_state: bool,
    block_v: int | None = None,
    num_warps: int = 4,
    **ignored: object,
) -> dict[str, torch.Tensor | tuple[torch.Tensor]]:
    """Gradients of the token-by-token recurrence: a forward sweep (dq, dg) and a reverse one (dk, dv, dS_0)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK = block_size(K)
    BV = block_v if block_v is not None else min(block_size(V), 32)
    v_blocks = triton.cdiv(V, BV)
    grid = (v_blocks, B * H)
    d_final = d_state[0] if d_state is not None else None
    dq_parts = torch.empty(v_blocks, B, T, H, K, dtype=torch.float32, device=q.device)
    dg_parts = torch.empty(B, H, v_blocks, dtype=torch.float32, device=q.device)
    _recurrent_tangent_sweep_kernel[grid](
        q, k, v, g, do, state[0] if state is not None else None, d_final, dq_parts, dg_parts,
        T, H, K, V, scale,
        BK=BK, BV=BV, HAS_INITIAL_STATE=state is not None, HAS_FINAL_GRAD=d_state is not None,
        num_warps=num_warps,
    )
    dk_parts = torch.empty(v_blocks, B, T, H, K, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(v)
    d_initial = torch.empty(B, H, K, V, dtype=torch.float32, device=q.device) if state is not None else None
    _recurrent_reverse_sweep_kernel[grid](
        q, k, v, g, do, d_final, dk_parts, dv, d_initial,
        T, H, K, V, scale,
        BK=BK, BV=BV, HAS_FINAL_GRAD=d_state is not None, STORE_INITIAL_GRAD=state is not None,
        num_warps=num_warps,
    )
    return _gradients(q, k, v, g, dq_parts.sum(dim=0), dk_parts.sum(dim=0), dv, dg_parts, d_initial)


BACKWARD = {"chunkwise": chunkwise_backward, "recurrent": recurrent_backward}
