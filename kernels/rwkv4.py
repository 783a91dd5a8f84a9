"""RWKV-4 WKV kernels (FORMULATIONS.md 7): ``recurrent`` and ``chunkwise`` (Triton).

    o_t = (sum_{i<t} e^{-(t-1-i) w + k_i} v_i + e^{u + k_t} v_t)
        / (sum_{i<t} e^{-(t-1-i) w + k_i} + e^{u + k_t})

Conventions (FORMULATIONS.md, registry entry ``rwkv4``):

- ``w [C]`` (>= 0, decay ``exp(-w)``), ``u [C]``, ``k, v [B, T, C]``: no
  heads, channels are independent. All four are in the input dtype (fp16,
  bf16 or fp32) and are upcast to fp32 on load; every computation is fp32 and
  ``o`` is rounded once to the input dtype.
- The state is ``(a, b, p)``, each ``[B, C]`` fp32: numerator ``e^p a`` and
  denominator ``e^p b`` of every key before the next token, ``p`` their
  shared log-scale. The final ``p`` is the canonical one of the oracle
  (oracles/rwkv4.py): the largest decayed key logit, so that the largest
  weight folded into ``a`` and ``b`` is exactly 1. The initial state is read
  by the first token without decay. ``state=None`` is the empty state, built
  in the kernel as ``a = b = 0, p = -inf``: ``-inf`` is exact (every
  ``exp(p - top)`` is 0) and never meets another infinity, because each
  ``top`` below is a maximum that includes a finite key logit.
- Numerics: the running maximum of seed 002 / the RWKV paper. Every
  exponential is taken of ``logit - top`` with ``top`` the maximum of the
  logits it normalizes, so every exponent is <= 0 and nothing overflows,
  whatever the size of ``k`` (keys near 200 are fine in fp32 and fp16).
  Masked entries are set to ``-inf`` before the exponential. Inside the
  kernels ``p`` is held as ``anchor - steps * w``: the logit it was last set
  to (a key, or the initial ``p``) and the tokens decayed since, so each use
  of ``p`` is one product and one subtraction from exact instead of the sum
  of one rounding per token (or per chunk) that ``p = p - w`` accumulates.

Kernels (one program per (batch, block of BLOCK_C channels); the programs
walk the time axis in order):

- ``recurrent``: one token per step, the oracle's stable loop.
- ``chunkwise``: CHUNK tokens per step. Inside a chunk every query takes the
  log-sum-exp over the chunk's keys (decay ``-(t-1-i) w``, bonus ``u`` on the
  diagonal) plus the carried state as one extra term (logit ``p - t w``);
  the state then advances over the whole chunk at once. This is the oracle's
  ``_chunk``: every weight inside a chunk is one exponential of one logit,
  with no recurrence on rounded values; the price is CHUNK exponentials per
  token instead of two, for T / CHUNK serial steps instead of T.

Backward (``BACKWARD``: both forms share one algorithm). Write ``A_t, B_t``
for the scale-free state after token t (``e^p a, e^p b``), ``D_t`` for the
denominator of ``o_t`` and ``P_t = log D_t``. By the chain rule through
``A_t = e^{-w} A_{t-1} + e^{k_t} v_t`` (and B), the adjoint of the state
obeys a recurrence that runs backwards in time,

    gA_{t-1} = e^{-w} gA_t + do_t / D_t,    gB_{t-1} = e^{-w} gB_t - do_t o_t / D_t,
    hA_{t-1} = e^{-w} (hA_t + gA_t)          (hB likewise),

``gA_T`` being the final-state cotangent ``e^{-p_T} da_T`` (and h, the
adjoint weighted by each reader's lag, starting at 0), and every gradient is
a local expression in it:

    dv_t = e^{k_t} gA_t + do_t lam_t,       lam_t = e^{u + k_t} / D_t,
    dk_t = e^{k_t} (v_t gA_t + gB_t) + do_t lam_t (v_t - o_t),
    du   = sum_t do_t lam_t (v_t - o_t),
    dw   = -sum_t e^{k_t} (v_t hA_t + hB_t) - e^{p_0} (a_0 hA_0 + b_0 hB_0),
    (da_0, db_0, dp_0) = e^{p_0} (gA_0, gB_0, a_0 gA_0 + b_0 gB_0)

(index 0 here: the initial state, before the first token), plus the final
``p``'s own part: ``p_T`` is one logit, a key ``k_j - (T-1-j) w`` or the
initial ``p_0 - T w``, and ``dp_T - a_T da_T - b_T db_T`` (what p's
cotangent leaves after rescaling a and b) goes to that key or to ``p_0``,
``-(T-1-j)`` (or ``-T``) times it to ``w``.

The kernel sweeps the tokens once in reverse, one program per (batch, block
of channels), like the forward's recurrent form: every term above is
per-channel (no matrix product for tensor cores, as in fla's own RWKV-4),
and the chunkwise form's parallel tiles would cost CHUNK exponentials per
token where the sweep costs four. The adjoint is held at its own running
log-scale ``r`` (the forward's running maximum, mirrored: ``r`` tracks
``max(-P_t - lag w)``), so ``e^{k_t + r}``, ``lam_t`` and the rescaling
factors all have exponents ``<= 0``; keys near 200 stay finite.

Saved by the forward (``saved``) rather than recomputed: ``P_t`` (fp32,
``[B, T, C]``), because the reverse sweep needs each token's denominator and
the forward state cannot be run backwards (undoing a decay divides by
``e^{-w}`` and subtracts, which cancels); re-running the forward to
checkpoint states would cost a second serial sweep. In fp16 and bf16 also
``o``'s rounding residual ``o - round(o)`` in the input dtype: ``o`` enters
every ``(v - o)``, and the rounded ``o`` alone measured 1.6x the floor on
``dk`` in fp16 (1.0 with the residual). Plus, when the final state is
returned, which logit the final ``p`` is. 6 bytes per element in bf16
(fla's RWKV-4 saves three bf16 states per token, 6 as well), 4 in fp32.

Accuracy (CPU, Triton interpreter, tests/test_kernel_gradients.py's inputs,
T = 40): fp16 excess 1.0 on every gradient; fp32 1.1-3.2. The adjoint's
rescalings round once per token, so fp32 error grows with T on slow decays
(T = 600, w ~ 1e-3: dw up to 12-27, dk, dv 5-9; a float64 adjoint, in a torch
model of the sweep, brings dw to 4.6); fp16 stays at 1.0 there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from attnlab.kernels._util import Launch, block_size, launch_after_checks, no_pending_checks

__all__ = ["recurrent", "chunkwise", "recurrent_backward", "chunkwise_backward", "BACKWARD", "OPTIONS"]

_POWERS_OF_TWO = (16, 32, 64, 128, 256)

# name -> (default, allowed values); attnlab.kernel checks them before a launch.
# Both kernels run B * cdiv(C, block_c) programs, each walking the time axis.
OPTIONS = {
    "recurrent": {
        # 64 channels on one warp: 2 per thread, so 4-byte (fp16/bf16) loads
        # that the pipeliner can turn into asynchronous copies
        "block_c": (64, _POWERS_OF_TWO),
        "num_warps": (1, (1, 2, 4, 8)),
        # depth of the time loop's software pipeline (tl.range num_stages): one
        # token's compute is short, so the loop is bound by load latency unless
        # the next tokens' loads are already in flight
        "num_stages": (4, (1, 2, 3, 4, 6, 8)),
    },
    "chunkwise": {
        # tokens per chunk: each token costs chunk_size exponentials (a chunk x
        # chunk x block_c tile), the serial steps are T / chunk_size; the tile
        # lives in registers. One warp a program keeps a chunk's maxima and
        # sums inside the warp (no shared memory, no barrier), and 16 channels
        # a program give B * C / 16 programs to hide the serial steps' latency
        # (the settings measured: reports/bench.md, session 19)
        "chunk_size": (8, (8, 16, 32, 64)),
        "block_c": (16, _POWERS_OF_TWO),
        "num_warps": (1, (1, 2, 4, 8)),
        "num_stages": (3, (1, 2, 3, 4)),
    },
}


@triton.jit
def _load_state(a_ptr, b_ptr, p_ptr, offs, mask, HAS_STATE: tl.constexpr, BLOCK_C: tl.constexpr):
    """The state (a, b, p) of one block of channels; the empty state a = b = 0, p = -inf without one."""
    if HAS_STATE:
        a = tl.load(a_ptr + offs, mask=mask, other=0.0)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=float("-inf"))
    else:
        a = tl.zeros([BLOCK_C], dtype=tl.float32)
        b = tl.zeros([BLOCK_C], dtype=tl.float32)
        p = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
    return a, b, p


# Recurrent form, one token per step (oracles/rwkv4.py, _recurrent_stable):
#   read:  top = max(p, u + k_t)
#          o_t = (e^{p-top} a + e^{u+k_t-top} v_t) / (e^{p-top} b + e^{u+k_t-top})
#   write: top = max(p - w, k_t)
#          a = e^{p-w-top} a + e^{k_t-top} v_t,  b = e^{p-w-top} b + e^{k_t-top},  p = top
# p is kept as anchor - steps * w (the logit it was last set to, and the tokens
# since): p = p - w repeated in fp32 rounds once per token, and on slow decays
# (w ~ 0.01, where p is rarely reset) that drift piles up to many times the
# floor; anchored, every p is one product and one subtraction away from exact.
@triton.jit
def _rwkv4_recurrent_kernel(
    w_ptr, u_ptr, k_ptr, v_ptr, o_ptr,
    a_in_ptr, b_in_ptr, p_in_ptr, a_out_ptr, b_out_ptr, p_out_ptr, log_den_ptr, residual_ptr, steps_out_ptr,
    T, C,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    SAVE_FOR_BACKWARD: tl.constexpr, SAVE_RESIDUAL: tl.constexpr,
    BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    batch, channel_block = tl.program_id(0), tl.program_id(1)
    channels = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels < C
    w = tl.load(w_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    state_offs = batch * C + channels
    a, b, anchor = _load_state(a_in_ptr, b_in_ptr, p_in_ptr, state_offs, channel_ok, HAS_INITIAL_STATE, BLOCK_C)
    steps = tl.zeros([BLOCK_C], dtype=tl.int32)

    sequence = batch.to(tl.int64) * T * C  # [B, T, C] may pass 2^31 elements
    k_ptrs = k_ptr + sequence + channels  # pointers advance by one token (C) per step
    v_ptrs = v_ptr + sequence + channels
    o_ptrs = o_ptr + sequence + channels
    log_den_ptrs = log_den_ptr + sequence + channels
    residual_ptrs = residual_ptr + sequence + channels
    for _ in tl.range(0, T, num_stages=NUM_STAGES):
        k_t = tl.load(k_ptrs, mask=channel_ok, other=0.0).to(tl.float32)
        v_t = tl.load(v_ptrs, mask=channel_ok, other=0.0).to(tl.float32)

        p = anchor - steps.to(tl.float32) * w
        bonus = u + k_t
        top = tl.maximum(p, bonus)
        e_state = tl.exp(p - top)
        e_token = tl.exp(bonus - top)
        denominator = e_state * b + e_token
        o_t = (e_state * a + e_token * v_t) / denominator
        o_rounded = o_t.to(o_ptr.dtype.element_ty)
        tl.store(o_ptrs, o_rounded, mask=channel_ok)
        if SAVE_FOR_BACKWARD:
            tl.store(log_den_ptrs, top + tl.log(denominator), mask=channel_ok)
            log_den_ptrs += C
        if SAVE_RESIDUAL:
            tl.store(residual_ptrs, (o_t - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=channel_ok)
            residual_ptrs += C

        decayed = anchor - (steps + 1).to(tl.float32) * w
        top = tl.maximum(decayed, k_t)
        e_state = tl.exp(decayed - top)
        e_token = tl.exp(k_t - top)
        a = e_state * a + e_token * v_t
        b = e_state * b + e_token
        restart = k_t >= decayed  # p = top = k_t: re-anchor there
        anchor = tl.where(restart, k_t, anchor)
        steps = tl.where(restart, 0, steps + 1)
        k_ptrs += C
        v_ptrs += C
        o_ptrs += C

    if STORE_FINAL_STATE:
        tl.store(a_out_ptr + state_offs, a, mask=channel_ok)
        tl.store(b_out_ptr + state_offs, b, mask=channel_ok)
        tl.store(p_out_ptr + state_offs, anchor - steps.to(tl.float32) * w, mask=channel_ok)
        if SAVE_FOR_BACKWARD:  # which logit the final p is: the backward routes p's cotangent to it
            tl.store(steps_out_ptr + state_offs, steps, mask=channel_ok)


# Chunkwise form, CHUNK tokens per step (oracles/rwkv4.py, _chunk). For query t
# and key i of a chunk (0-based), per channel:
#   logit[t, i] = k_i - (t-1-i) w  (i < t),   u + k_t  (i = t),   -inf  (i > t)
#   state logit  s_t = p - t w      (the carried state, read without decay at t = 0)
#   top_t = max(max_i logit[t, i], s_t)
#   o_t = (sum_i e^{logit-top} v_i + e^{s_t-top} a) / (sum_i e^{logit-top} + e^{s_t-top} b)
# and over the n valid keys of the chunk the state advances to
#   key logit  g_i = k_i - (n-1-i) w,   p' = max(max_i g_i, p - n w)
#   a' = sum_i e^{g_i-p'} v_i + e^{p-n w-p'} a,   b' = sum_i e^{g_i-p'} + e^{p-n w-p'} b
# As in the recurrent kernel, p is kept as anchor - steps * w (anchor: the key
# or initial p it was last set to), so that no rounding accumulates across chunks.
@triton.jit
def _rwkv4_chunkwise_kernel(
    w_ptr, u_ptr, k_ptr, v_ptr, o_ptr,
    a_in_ptr, b_in_ptr, p_in_ptr, a_out_ptr, b_out_ptr, p_out_ptr, log_den_ptr, residual_ptr, steps_out_ptr,
    T, C,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr,
    SAVE_FOR_BACKWARD: tl.constexpr, SAVE_RESIDUAL: tl.constexpr,
    CHUNK: tl.constexpr, BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    batch, channel_block = tl.program_id(0), tl.program_id(1)
    channels = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels < C
    w = tl.load(w_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    state_offs = batch * C + channels
    a, b, anchor = _load_state(a_in_ptr, b_in_ptr, p_in_ptr, state_offs, channel_ok, HAS_INITIAL_STATE, BLOCK_C)
    steps = tl.zeros([BLOCK_C], dtype=tl.int32)

    position = tl.arange(0, CHUNK)  # t for queries, i for keys
    lag = (position[:, None] - 1 - position[None, :]).to(tl.float32)  # [t, i]
    is_past = position[None, :] < position[:, None]
    is_self = position[None, :] == position[:, None]
    past_decay = lag[:, :, None] * w[None, None, :]  # [t, i, c]: (t-1-i) w, the same in every chunk

    sequence = batch.to(tl.int64) * T * C  # [B, T, C] may pass 2^31 elements
    tile_offs = sequence + position[:, None] * C + channels[None, :]
    k_ptrs = k_ptr + tile_offs  # pointers advance by one chunk (CHUNK * C) per step
    v_ptrs = v_ptr + tile_offs
    o_ptrs = o_ptr + tile_offs
    log_den_ptrs = log_den_ptr + tile_offs
    residual_ptrs = residual_ptr + tile_offs
    for start in tl.range(0, T, CHUNK, num_stages=NUM_STAGES):
        row_ok = start + position < T
        tile_ok = row_ok[:, None] & channel_ok[None, :]
        k = tl.load(k_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptrs, mask=tile_ok, other=0.0).to(tl.float32)

        # Output: log-sum-exp over the chunk's keys and the carried state.
        logit = tl.where(is_past[:, :, None], k[None, :, :] - past_decay, u[None, None, :] + k[None, :, :])
        logit = tl.where((is_past | is_self)[:, :, None], logit, float("-inf"))
        state_logit = anchor[None, :] - (steps[None, :] + position[:, None]).to(tl.float32) * w[None, :]
        top = tl.maximum(tl.max(logit, axis=1), state_logit)
        weight = tl.exp(logit - top[:, None, :])
        e_state = tl.exp(state_logit - top)
        numerator = tl.sum(weight * v[None, :, :], axis=1) + e_state * a[None, :]
        denominator = tl.sum(weight, axis=1) + e_state * b[None, :]
        o_tile = numerator / denominator
        o_rounded = o_tile.to(o_ptr.dtype.element_ty)
        tl.store(o_ptrs, o_rounded, mask=tile_ok)
        if SAVE_FOR_BACKWARD:
            tl.store(log_den_ptrs, top + tl.log(denominator), mask=tile_ok)
            log_den_ptrs += CHUNK * C
        if SAVE_RESIDUAL:
            tl.store(residual_ptrs, (o_tile - o_rounded.to(tl.float32)).to(o_ptr.dtype.element_ty), mask=tile_ok)
            residual_ptrs += CHUNK * C

        # State: decay everything to the chunk's last valid token, renormalize to the largest logit.
        n = tl.minimum(T - start, CHUNK)
        key_steps = n - 1 - position  # tokens from key i to the chunk's end
        key_logit = k - key_steps[:, None].to(tl.float32) * w[None, :]
        key_logit = tl.where(row_ok[:, None], key_logit, float("-inf"))
        decayed = anchor - (steps + n).to(tl.float32) * w
        best_key = tl.argmax(key_logit, axis=0)  # [c]: the key with the largest logit
        best_logit = tl.max(key_logit, axis=0)
        top = tl.maximum(best_logit, decayed)
        e_keys = tl.exp(key_logit - top[None, :])
        e_state = tl.exp(decayed - top)
        a = tl.sum(e_keys * v, axis=0) + e_state * a
        b = tl.sum(e_keys, axis=0) + e_state * b
        restart = best_logit >= decayed  # p = top = that key's logit: re-anchor on it
        is_best = position[:, None] == best_key[None, :]
        anchor = tl.where(restart, tl.sum(tl.where(is_best, k, 0.0), axis=0), anchor)
        steps = tl.where(restart, n - 1 - best_key, steps + n)
        k_ptrs += CHUNK * C
        v_ptrs += CHUNK * C
        o_ptrs += CHUNK * C

    if STORE_FINAL_STATE:
        tl.store(a_out_ptr + state_offs, a, mask=channel_ok)
        tl.store(b_out_ptr + state_offs, b, mask=channel_ok)
        tl.store(p_out_ptr + state_offs, anchor - steps.to(tl.float32) * w, mask=channel_ok)
        if SAVE_FOR_BACKWARD:  # which logit the final p is: the backward routes p's cotangent to it
            tl.store(steps_out_ptr + state_offs, steps, mask=channel_ok)


@triton.jit
def _kahan_add(total, compensation, term):
    """total + term with the rounding error of earlier additions carried in compensation."""
    corrected = term - compensation
    new_total = total + corrected
    return new_total, (new_total - total) - corrected


# Backward, one reverse sweep over the tokens (module docstring, "Backward"). Per channel, with
# P_t = log D_t the forward's saved log-denominator, o_t in fp32 (o plus its saved residual) and the
# adjoint (gA, gB; hA, hB the same weighted by each reader's lag) held at the log-scale r:
#   key t:    e = e^{k_t + r};  dv_t = e gA,  dk_t = e (v_t gA + gB),  dw -= e (v_t hA + hB)
#   query t:  lam = e^{u + k_t - P_t};  dv_t += do_t lam,  dk_t += do_t lam (v_t - o_t),  du += the same
#   step:     r' = max(r - w, -P_t),  f = e^{r - w - r'},  g = e^{-P_t - r'}
#             hA = f (hA + gA),  hB = f (hB + gB),  gA = f gA + g do_t,  gB = f gB - g do_t o_t
# k_t + r <= 0 and u + k_t - P_t <= 0 (D_t holds both terms); one of f, g is 1 and the other the
# exponential of -|gap| with gap = (r + P_t) - w, formed from the nearby r and -P_t first so that it is
# rounded once at its own small size. r is kept as anchor - steps * w (as p in the forward), and dw, du,
# sums of many signed terms, are compensated (Kahan) sums (without: fp32 excess up to 3.7 on dw, 2.6 on du;
# with: 2.3 and 1.6, in a torch model of this sweep).
@triton.jit
def _rwkv4_backward_kernel(
    w_ptr, u_ptr, k_ptr, v_ptr, o_ptr, residual_ptr, do_ptr, log_den_ptr,
    dk_ptr, dv_ptr, dw_ptr, du_ptr,
    a_in_ptr, b_in_ptr, p_in_ptr, da_in_ptr, db_in_ptr, dp_in_ptr,
    da_out_ptr, db_out_ptr, p_out_ptr, dp_anchor_ptr, steps_out_ptr,
    T, C,
    HAS_RESIDUAL: tl.constexpr, HAS_INITIAL_STATE: tl.constexpr, HAS_FINAL_COTANGENT: tl.constexpr,
    BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    batch, channel_block = tl.program_id(0), tl.program_id(1)
    channels = channel_block * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_ok = channels < C
    w = tl.load(w_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + channels, mask=channel_ok, other=0.0).to(tl.float32)
    state_offs = batch * C + channels

    # The adjoint of the state after the last token: e^{-p_T} (da_T, db_T) on the scale-free (A, B).
    if HAS_FINAL_COTANGENT:
        anchor = -tl.load(p_out_ptr + state_offs, mask=channel_ok, other=0.0)
        grad_a = tl.load(da_out_ptr + state_offs, mask=channel_ok, other=0.0)
        grad_b = tl.load(db_out_ptr + state_offs, mask=channel_ok, other=0.0)
        # p_T is one logit, decayed final_steps times: key T-1-final_steps, or the initial p when final_steps = T.
        final_steps = tl.load(steps_out_ptr + state_offs, mask=channel_ok, other=0)
        dp_anchor = tl.load(dp_anchor_ptr + state_offs, mask=channel_ok, other=0.0)
    else:
        anchor = tl.full([BLOCK_C], float("-inf"), dtype=tl.float32)
        grad_a = tl.zeros([BLOCK_C], dtype=tl.float32)
        grad_b = tl.zeros([BLOCK_C], dtype=tl.float32)
        final_steps = tl.full([BLOCK_C], -1, dtype=tl.int32)
        dp_anchor = tl.zeros([BLOCK_C], dtype=tl.float32)
    steps = tl.zeros([BLOCK_C], dtype=tl.int32)
    lag_a = tl.zeros([BLOCK_C], dtype=tl.float32)
    lag_b = tl.zeros([BLOCK_C], dtype=tl.float32)
    # The initial state's log-scale gradient a gA + b gB (and its lag-weighted twin for dw), carried term by
    # term: formed at the end from the rounded gA and gB it cancels catastrophically whenever the outputs sit
    # near the state's own average a / b.
    a, b, p = _load_state(a_in_ptr, b_in_ptr, p_in_ptr, state_offs, channel_ok, HAS_INITIAL_STATE, BLOCK_C)
    grad_p = a * grad_a + b * grad_b
    lag_p = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw = tl.where(final_steps >= 0, -final_steps.to(tl.float32) * dp_anchor, 0.0)
    du = tl.zeros([BLOCK_C], dtype=tl.float32)
    dw_error = tl.zeros([BLOCK_C], dtype=tl.float32)
    du_error = tl.zeros([BLOCK_C], dtype=tl.float32)

    last = (batch.to(tl.int64) * T + T - 1) * C + channels  # int64: [B, T, C] may pass 2^31 elements
    # the pointers step back one token (C) per step
    k_ptrs, v_ptrs, o_ptrs, do_ptrs = k_ptr + last, v_ptr + last, o_ptr + last, do_ptr + last
    residual_ptrs, log_den_ptrs, dk_ptrs, dv_ptrs = residual_ptr + last, log_den_ptr + last, dk_ptr + last, dv_ptr + last
    for back in tl.range(0, T, num_stages=NUM_STAGES):
        k_t = tl.load(k_ptrs, mask=channel_ok, other=0.0).to(tl.float32)
        v_t = tl.load(v_ptrs, mask=channel_ok, other=0.0).to(tl.float32)
        o_t = tl.load(o_ptrs, mask=channel_ok, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            o_t += tl.load(residual_ptrs, mask=channel_ok, other=0.0).to(tl.float32)
        do_t = tl.load(do_ptrs, mask=channel_ok, other=0.0).to(tl.float32)
        log_den = tl.load(log_den_ptrs, mask=channel_ok, other=0.0)

        # Key t, through the state it joins (A_t = e^{-w} A_{t-1} + e^{k_t} v_t).
        e_key = tl.exp(k_t + (anchor - steps.to(tl.float32) * w))
        dv_t = e_key * grad_a
        dk_t = e_key * (v_t * grad_a + grad_b) + tl.where(back == final_steps, dp_anchor, 0.0)
        dw, dw_error = _kahan_add(dw, dw_error, -e_key * (v_t * lag_a + lag_b))
        # Query t, through its own bonus term.
        weighted = do_t * tl.exp(u + k_t - log_den)
        dv_t += weighted
        dk_t += weighted * (v_t - o_t)
        du, du_error = _kahan_add(du, du_error, weighted * (v_t - o_t))
        tl.store(dk_ptrs, dk_t.to(dk_ptr.dtype.element_ty), mask=channel_ok)
        tl.store(dv_ptrs, dv_t.to(dv_ptr.dtype.element_ty), mask=channel_ok)

        # Move the adjoint before token t: decay it once, add query t's read of the state.
        gap = (anchor + log_den) - (steps + 1).to(tl.float32) * w  # (r - w) - (-P_t)
        keep = gap > 0  # the decayed adjoint stays the larger: keep its anchor
        e_old = tl.exp(tl.minimum(gap, 0.0))
        e_query = tl.exp(-tl.maximum(gap, 0.0)) * do_t
        lag_a = e_old * (lag_a + grad_a)
        lag_b = e_old * (lag_b + grad_b)
        grad_a = e_old * grad_a + e_query
        grad_b = e_old * grad_b - e_query * o_t
        if HAS_INITIAL_STATE:
            lag_p = e_old * (lag_p + grad_p)
            grad_p = e_old * grad_p + e_query * (a - b * o_t)
        anchor = tl.where(keep, anchor, -log_den)
        steps = tl.where(keep, steps + 1, 0)
        k_ptrs -= C
        v_ptrs -= C
        o_ptrs -= C
        residual_ptrs -= C
        do_ptrs -= C
        log_den_ptrs -= C
        dk_ptrs -= C
        dv_ptrs -= C

    # The adjoint now belongs to the initial state (A, B) = e^p (a, b), which token 0 read without decay.
    if HAS_INITIAL_STATE:
        e_initial = tl.exp(p + (anchor - steps.to(tl.float32) * w))  # 0 for the empty state p = -inf
        da = e_initial * grad_a
        db = e_initial * grad_b
        dp = e_initial * grad_p + tl.where(final_steps == T, dp_anchor, 0.0)
        dw, dw_error = _kahan_add(dw, dw_error, -e_initial * lag_p)
        tl.store(da_in_ptr + state_offs, da, mask=channel_ok)
        tl.store(db_in_ptr + state_offs, db, mask=channel_ok)
        tl.store(dp_in_ptr + state_offs, dp, mask=channel_ok)
    tl.store(dw_ptr + state_offs, dw, mask=channel_ok)
    tl.store(du_ptr + state_offs, du, mask=channel_ok)


def _launch(
    kernel: triton.JITFunction,
    w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    state: tuple[torch.Tensor, ...] | None, return_state: bool, saved: dict[str, torch.Tensor] | None,
    block_c: int, num_warps: int, await_checks: Callable[[], None], **meta: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    B, T, C = k.shape
    o = torch.empty_like(v)
    final = tuple(torch.empty((B, C), dtype=torch.float32, device=k.device) for _ in range(3)) if return_state else None
    # Unused pointer slots get a valid tensor; the constexpr flags compile their accesses out.
    a_in, b_in, p_in = state if state is not None else (o, o, o)
    a_out, b_out, p_out = final if final is not None else (o, o, o)
    log_den, residual, steps_out = o, o, o
    save_residual = saved is not None and o.dtype != torch.float32  # an fp32 o is its own fp32 value
    if saved is not None:
        log_den = saved["log_denominator"] = torch.empty((B, T, C), dtype=torch.float32, device=k.device)
        if final is not None:
            steps_out = saved["final_steps"] = torch.empty((B, C), dtype=torch.int32, device=k.device)
            saved["final_state"] = final
    if save_residual:
        residual = saved["output_residual"] = torch.empty_like(o)
    block_c = min(block_c, block_size(C))
    grid = (B, triton.cdiv(C, block_c))
    launch_after_checks(await_checks, Launch(
        kernel, grid,
        w, u, k, v, o, a_in, b_in, p_in, a_out, b_out, p_out, log_den, residual, steps_out, T, C,
        HAS_INITIAL_STATE=state is not None, STORE_FINAL_STATE=return_state,
        SAVE_FOR_BACKWARD=saved is not None, SAVE_RESIDUAL=save_residual,
        BLOCK_C=block_c, num_warps=num_warps, **meta,
    ))
    return o, final


def recurrent(
    *, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    state: tuple[torch.Tensor, ...] | None = None, return_state: bool = False,
    block_c: int = OPTIONS["recurrent"]["block_c"][0],
    num_warps: int = OPTIONS["recurrent"]["num_warps"][0],
    num_stages: int = OPTIONS["recurrent"]["num_stages"][0],
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """RWKV-4 WKV one token at a time (the running-maximum loop); returns (o, (a, b, p) or None).

    With ``saved`` (a dict), also stores what the backward needs in it (module docstring, "Backward").
    """
    return _launch(
        _rwkv4_recurrent_kernel, w, u, k, v, state, return_state, saved, block_c, num_warps, await_checks,
        NUM_STAGES=num_stages,
    )


def chunkwise(
    *, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    state: tuple[torch.Tensor, ...] | None = None, return_state: bool = False,
    chunk_size: int = OPTIONS["chunkwise"]["chunk_size"][0],
    block_c: int = OPTIONS["chunkwise"]["block_c"][0],
    num_warps: int = OPTIONS["chunkwise"]["num_warps"][0],
    num_stages: int = OPTIONS["chunkwise"]["num_stages"][0],
    saved: dict[str, torch.Tensor] | None = None,
    await_checks: Callable[[], None] = no_pending_checks,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """RWKV-4 WKV by chunks of ``chunk_size`` tokens (log-sum-exp inside, state between).

    Returns (o, (a, b, p) or None). With ``saved`` (a dict), also stores what the backward needs in it.
    """
    if chunk_size not in OPTIONS["chunkwise"]["chunk_size"][1]:
        raise ValueError(f"chunk_size must be one of {OPTIONS['chunkwise']['chunk_size'][1]}; got {chunk_size!r}")
    return _launch(
        _rwkv4_chunkwise_kernel, w, u, k, v, state, return_state, saved, block_c, num_warps, await_checks,
        CHUNK=chunk_size, NUM_STAGES=num_stages,
    )


def _backward(
    *, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    saved: dict[str, torch.Tensor], d_state: tuple[torch.Tensor, ...] | None,
    state: tuple[torch.Tensor, ...] | None, block_c: int, num_warps: int, num_stages: int,
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    B, T, C = k.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    # One row per batch for w and u (each program writes its own), summed over the batch below in fp32.
    dw_rows, du_rows = (torch.empty((B, C), dtype=torch.float32, device=k.device) for _ in range(2))
    a_in, b_in, p_in = state if state is not None else (dw_rows,) * 3
    d_initial = tuple(torch.empty_like(part) for part in state) if state is not None else (dw_rows,) * 3
    da_out = db_out = p_out = dp_anchor = steps_out = dw_rows
    if d_state is not None:
        a_out, b_out, p_out = saved["final_state"]
        da_out, db_out, dp_out = d_state
        # The final (a, b) = e^{-p} (A, B): p's own cotangent, less what rescaling (A, B) takes, goes to p's logit.
        dp_anchor = dp_out - a_out * da_out - b_out * db_out
        steps_out = saved["final_steps"]
    block_c = min(block_c, block_size(C))
    residual = saved.get("output_residual", o)
    _rwkv4_backward_kernel[(B, triton.cdiv(C, block_c))](
        w, u, k, v, o, residual, do, saved["log_denominator"],
        dk, dv, dw_rows, du_rows,
        a_in, b_in, p_in, *d_initial,
        da_out, db_out, p_out, dp_anchor, steps_out,
        T, C,
        HAS_RESIDUAL="output_residual" in saved, HAS_INITIAL_STATE=state is not None,
        HAS_FINAL_COTANGENT=d_state is not None, BLOCK_C=block_c, NUM_STAGES=num_stages, num_warps=num_warps,
    )
    grads: dict[str, torch.Tensor | tuple[torch.Tensor, ...]] = {
        "w": dw_rows.sum(0).to(w.dtype), "u": du_rows.sum(0).to(u.dtype), "k": dk, "v": dv,
    }
    if state is not None:
        grads["initial_state"] = d_initial
    return grads


def recurrent_backward(
    *, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    saved: dict[str, torch.Tensor], d_state: tuple[torch.Tensor, ...] | None,
    state: tuple[torch.Tensor, ...] | None = None,
    block_c: int = OPTIONS["recurrent"]["block_c"][0],
    num_warps: int = OPTIONS["recurrent"]["num_warps"][0],
    num_stages: int = OPTIONS["recurrent"]["num_stages"][0],
    **ignored: object,
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Gradients of the recurrent form: the reverse sweep with the forward's tiling options."""
    return _backward(w=w, u=u, k=k, v=v, o=o, do=do, saved=saved, d_state=d_state, state=state,
                     block_c=block_c, num_warps=num_warps, num_stages=num_stages)


def chunkwise_backward(
    *, w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, do: torch.Tensor,
    saved: dict[str, torch.Tensor], d_state: tuple[torch.Tensor, ...] | None,
    state: tuple[torch.Tensor, ...] | None = None, **ignored: object,
) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...]]:
    """Gradients of the chunkwise form: the same reverse sweep (module docstring, "Backward"), with the
    recurrent form's tiling, since the sweep is one token per step whatever the forward's chunk size."""
    return _backward(w=w, u=u, k=k, v=v, o=o, do=do, saved=saved, d_state=d_state, state=state,
                     block_c=OPTIONS["recurrent"]["block_c"][0], num_warps=OPTIONS["recurrent"]["num_warps"][0],
                     num_stages=OPTIONS["recurrent"]["num_stages"][0])


BACKWARD = {"chunkwise": chunkwise_backward, "recurrent": recurrent_backward}
