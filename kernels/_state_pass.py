"""The state pass of the delta rules' chunkwise form, shared by kda and by deltanet and gated_deltanet.

Per chunk of C positions, from the UT transform's operands (kda.py's parallel kernels, or _delta.py's prepare
kernel; FORMULATIONS.md, "The three forms"):

    Delta  = U - W S
    O      = Qg S + A_qk Delta
    S_next = exp(G_C) * S (rows) + Kd^T Delta

One program per (V block, batch * head) walks the chunks in order with the fp32 state in registers, held as up to
four blocks of STATE_CHANNEL_BLOCK key channels: a whole [K, BV] fp32 tile and its [C, K] operands do not fit the
registers and shared memory at K >= 128 (fla splits it the same way). The output is computed here, in the pass that
holds the state: a parallel output pass would need every chunk's state stored, fp32 [B, H, T/C, K, V], more traffic
than q, k, v and o together. No exp or cumsum runs here: every gate factor comes precomputed.

The operands (StateOperands) are W, U, Qg, Kd and A_qk by row, exp(G_C) and per-chunk bounds on |W|, |Qg|, |Kd| and
|A_qk| by chunk. With "fp16" dots (the bf16 inputs' default, _numerics.scaled_dot) W, Qg and Kd arrive already scaled
by their bound's power of two and rounded to fp16 (_numerics.to_scratch: the rounding their products would do anyway,
at half the bytes), and every scale comes from a bound, except S's and Delta's: one reduction each a chunk is all the
sequential path reduces.

SCALAR_GATE (the delta rules: one gate per head): a scalar gate factors out of the channel sums, so Qg and Kd are
the input q and k times per-row factors (scale exp(G_t) and exp(G_C - G_t)), which the pass applies to the rows of
Q S and of Delta: the prepare kernel writes no Qg or Kd tiles, and q and k enter the dots exactly. U is then stored
like W, in fp16, each column scaled by its own peak over the chunk (store_u): every entry keeps 2^-11 relative
precision down to 2^-27 of its column's peak, the size of W S's own rounding, which Delta = U - W S subtracts from
it. kda keeps U in fp32: next to its Qg and Kd tiles an fp16 U makes its state pass spill, which costs more than
the smaller U saves.

Options (OPTIONS, in both callers' chunkwise forms): ``precision`` (the dots: _numerics.dot_precision), ``block_v``
(V columns per program), ``num_warps``, ``num_stages`` ("auto": 2 where two stages of the operand tiles fit sm_90's
227 KB of shared memory, i.e. K <= 128 and dots other than "tf32", else 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from attnlab.kernels._numerics import dot_precision, dot_scratch, from_scratch, peak, scaled_dot_within, to_scratch
from attnlab.kernels._util import Launch, block_size

STATE_CHANNEL_BLOCK = 64  # key channels per state block S0..S3 of the state pass (K <= 4 blocks = 256)

# The state pass's options, shared by kda's chunkwise form and the delta rules' (their module docstrings).
OPTIONS = {
    "precision": ("auto", ("auto", "fp16", "tf32x3", "bf16x3", "ieee", "tf32", "bf16")),
    "block_v": (64, (16, 32, 64, 128)),
    "num_warps": (4, (1, 2, 4, 8, 16)),
    "num_stages": ("auto", ("auto", 1, 2, 3, 4)),
}


@triton.jit
def store_u(u_ptr, u_peak_ptr, u, scratch_row, peak_offset, values, value_ok, V, U_PRECISION: tl.constexpr):
    """Stores a block of U's columns for the state pass. Stored in fp16 (U_PRECISION "fp16": the
    delta rules, StateOperands.allocate), each column is scaled by its own peak |U| over the chunk,
    stored beside it: every entry keeps 2^-11 relative precision down to 2^-27 of its column's peak,
    the size of the rounding of W S, which Delta = U - W S subtracts from it."""
    if U_PRECISION == "fp16" or U_PRECISION == "fp16_emulated":
        u_peak = tl.max(tl.abs(u), axis=0)
        tl.store(u_peak_ptr + peak_offset + values, u_peak, mask=value_ok)
        u = to_scratch(u, u_peak[None, :], U_PRECISION)
    tl.store(u_ptr + scratch_row[:, None] * V + values[None, :], u, mask=value_ok[None, :])


@triton.jit
def load_u(u_ptr, u_peak_ptr, scratch_row, peak_offset, values, value_ok, V, U_PRECISION: tl.constexpr):
    """A block of U's columns as store_u stored them, in fp32."""
    u = tl.load(u_ptr + scratch_row[:, None] * V + values[None, :], mask=value_ok[None, :], other=0.0)
    if U_PRECISION == "fp16" or U_PRECISION == "fp16_emulated":
        u_peak = tl.load(u_peak_ptr + peak_offset + values, mask=value_ok, other=0.0)
        u = from_scratch(u, u_peak[None, :], U_PRECISION)
    return u


@triton.jit
def _project_block(w_ptr, qg_ptr, S, scratch_row, qg_row, row_ok, channel_start, K, ws, qs, w_bound, qg_bound,
                   BKB: tl.constexpr, PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """Adds one block of BKB key channels to ws = W S and qs = Qg S (with SCALAR_GATE, Q S: qg_ptr
    is the input q, qg_row its rows' offsets, qg_bound peak|q|)."""
    channels = channel_start + tl.arange(0, BKB)
    mask = (channels < K)[None, :]
    s_peak = peak(S)
    ws += dot_scratch(tl.load(w_ptr + scratch_row[:, None] * K + channels[None, :], mask=mask, other=0.0), w_bound,
                      S, s_peak, PRECISION)
    qg = tl.load(qg_ptr + qg_row[:, None] + channels[None, :], mask=row_ok[:, None] & mask, other=0.0)
    if SCALAR_GATE:
        qg = to_scratch(qg.to(tl.float32), qg_bound, PRECISION)
    qs += dot_scratch(qg, qg_bound, S, s_peak, PRECISION)
    return ws, qs


@triton.jit
def _advance_block(kd_ptr, gc_ptr, S, delta, kd_row, row_ok, gc_offset, channel_start, K, kd_bound, delta_peak,
                   BKB: tl.constexpr, PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr):
    """One block of BKB key channels of S_next = gC * S (rows) + Kd^T Delta (with SCALAR_GATE, K^T
    Delta: kd_ptr is the input k, kd_row its rows' offsets, kd_bound peak|k|)."""
    channels = channel_start + tl.arange(0, BKB)
    channel_ok = channels < K
    kd_t = tl.load(kd_ptr + kd_row[None, :] + channels[:, None],
                   mask=channel_ok[:, None] & row_ok[None, :], other=0.0)  # [BKB, C]
    if SCALAR_GATE:
        kd_t = to_scratch(kd_t.to(tl.float32), kd_bound, PRECISION)
    decay = tl.load(gc_ptr + gc_offset + channels, mask=channel_ok, other=0.0)
    return decay[:, None] * S + dot_scratch(kd_t, kd_bound, delta, delta_peak, PRECISION)


@triton.jit
def _state_pass_kernel(
    w_ptr, u_ptr, u_peak_ptr, qg_ptr, kd_ptr, gc_ptr, aqk_ptr, bounds_ptr, q_ptr, k_ptr, o_ptr, state_in_ptr,
    state_out_ptr, T, H, K, V, num_chunks,
    C: tl.constexpr, BKB: tl.constexpr, NKB: tl.constexpr, BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr, STORE_FINAL_STATE: tl.constexpr, PRECISION: tl.constexpr,
    U_PRECISION: tl.constexpr, SCALAR_GATE: tl.constexpr,
):
    """S [NKB * BKB, BV] fp32 in registers, held as NKB (1, 2 or 4) blocks S0..S3 of BKB key
    channels. Per chunk, from the operands' W, U, Qg, Kd, gC and Aqk:
      Delta  = U - W S
      O      = Qg S + Aqk Delta
      S_next = gC * S + Kd^T Delta      (block by block)
    The fp16 scales of W, Qg, Kd and Aqk come from the operands' bounds, those of S and Delta from one
    reduction each per chunk (a product of "fp16" otherwise reduces both of its operands).

    SCALAR_GATE (the delta rules, kernels/_delta.py: one gate per head): Qg and Kd are the input q
    and k (q_ptr, k_ptr) times per-row factors, which qg and kd then hold ([rows] fp32: scale exp(G_t)
    and exp(G_C - G_t)); the factors go on the rows of Q S and of Delta, so the prepare kernel writes
    no Qg or Kd tiles, and q and k enter the dots exactly (fp16 scaled by peak|q|, peak|k|, the
    bounds' places of |Qg| and |Kd|). A_qk is stored as to_scratch makes it (fp16 for "fp16" dots).
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
        token = (b * T + positions).to(tl.int64) * H + h
        scratch_row = (bh.to(tl.int64) * num_chunks + n) * C + rows
        gc_offset = (bh.to(tl.int64) * num_chunks + n) * K
        bounds = bounds_ptr + (bh.to(tl.int64) * num_chunks + n) * 4
        w_bound, qg_bound = tl.load(bounds), tl.load(bounds + 1)
        kd_bound, aqk_bound = tl.load(bounds + 2), tl.load(bounds + 3)

        if SCALAR_GATE:
            qk_base, qk_row, qk_ok = q_ptr, token * K, row_ok  # the inputs' rows
            kd_base = k_ptr
        else:
            qk_base, qk_row, qk_ok = qg_ptr, scratch_row * K, rows >= 0  # scratch rows, padding included
            kd_base = kd_ptr
        ws = tl.zeros((C, BV), dtype=tl.float32)
        qs = tl.zeros((C, BV), dtype=tl.float32)
        ws, qs = _project_block(w_ptr, qk_base, S0, scratch_row, qk_row, qk_ok, 0, K, ws, qs, w_bound, qg_bound,
                                BKB, PRECISION, SCALAR_GATE)
        if NKB > 1:
            ws, qs = _project_block(w_ptr, qk_base, S1, scratch_row, qk_row, qk_ok, BKB, K, ws, qs, w_bound,
                                    qg_bound, BKB, PRECISION, SCALAR_GATE)
        if NKB > 2:
            ws, qs = _project_block(w_ptr, qk_base, S2, scratch_row, qk_row, qk_ok, 2 * BKB, K, ws, qs, w_bound,
                                    qg_bound, BKB, PRECISION, SCALAR_GATE)
            ws, qs = _project_block(w_ptr, qk_base, S3, scratch_row, qk_row, qk_ok, 3 * BKB, K, ws, qs, w_bound,
                                    qg_bound, BKB, PRECISION, SCALAR_GATE)

        u = load_u(u_ptr, u_peak_ptr, scratch_row, (bh.to(tl.int64) * num_chunks + n) * V, values, value_ok, V,
                   U_PRECISION)
        delta = u - ws
        delta_peak = peak(delta)
        aqk = tl.load(aqk_ptr + scratch_row[:, None] * C + cols[None, :])
        if SCALAR_GATE:
            qs = qs * tl.load(qg_ptr + scratch_row)[:, None]
            o = qs + dot_scratch(aqk, aqk_bound, delta, delta_peak, PRECISION)
            # |exp(G_C - G_t) Delta_t| <= |Delta_t|: delta_peak still bounds it.
            delta = delta * tl.load(kd_ptr + scratch_row)[:, None]
        else:
            o = qs + scaled_dot_within(aqk, aqk_bound, delta, delta_peak, PRECISION)
        tl.store(o_ptr + token[:, None] * V + values[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & value_ok[None, :])

        S0 = _advance_block(kd_base, gc_ptr, S0, delta, qk_row, qk_ok, gc_offset, 0, K, kd_bound,
                            delta_peak, BKB, PRECISION, SCALAR_GATE)
        if NKB > 1:
            S1 = _advance_block(kd_base, gc_ptr, S1, delta, qk_row, qk_ok, gc_offset, BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION, SCALAR_GATE)
        if NKB > 2:
            S2 = _advance_block(kd_base, gc_ptr, S2, delta, qk_row, qk_ok, gc_offset, 2 * BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION, SCALAR_GATE)
            S3 = _advance_block(kd_base, gc_ptr, S3, delta, qk_row, qk_ok, gc_offset, 3 * BKB, K, kd_bound,
                                delta_peak, BKB, PRECISION, SCALAR_GATE)

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


class StateOperands(NamedTuple):
    """What the state pass reads, rows [B*H, chunks*C] (the last chunk padded, its padding rows 0):
    W, U, Qg, Kd, A_qk by row, exp(G_C) and the bounds on |W|, |Qg|, |Kd|, |A_qk| by chunk; W, Qg and
    Kd as to_scratch stores them (fp16 scaled by their bound for "fp16" dots, else fp32), the others
    fp32. kernels/_delta.py fills them for the delta rules, with per-row gate factors in place of the
    Qg and Kd tiles (``allocate``'s scalar_gate; their padding rows' factors meet q = k = 0 there),
    and with U in fp16 for "fp16" dots, scaled by its column peaks by chunk (u_peak, else None)."""

    w: torch.Tensor
    u: torch.Tensor
    u_peak: torch.Tensor | None
    qg: torch.Tensor
    kd: torch.Tensor
    gc: torch.Tensor
    aqk: torch.Tensor
    bounds: torch.Tensor

    @staticmethod
    def allocate(B: int, H: int, num_chunks: int, C: int, K: int, V: int, device: torch.device,
                 dot_precision: str, scalar_gate: bool = False) -> StateOperands:
        """Buffers for kda's operands, or with ``scalar_gate`` the delta rules' (the state pass's
        SCALAR_GATE): qg and kd then hold per-row factors [rows] (scale exp(G_t), exp(G_C - G_t)),
        bounds[:, 1:3] peak|q| and peak|k|, A_qk is stored like W, and so is U, with its column peaks
        (kda keeps U in fp32: module docstring)."""
        rows = B * H * num_chunks * C
        chunks = B * H * num_chunks
        operand = torch.float16 if dot_precision in ("fp16", "fp16_emulated") else torch.float32

        def new(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        if scalar_gate:
            u_peak = new(chunks, V) if operand == torch.float16 else None
            return StateOperands(new(rows, K, dtype=operand), new(rows, V, dtype=operand), u_peak, new(rows),
                                 new(rows), new(chunks, K), new(rows, C, dtype=operand), new(chunks, 4))
        return StateOperands(new(rows, K, dtype=operand), new(rows, V), None, new(rows, K, dtype=operand),
                             new(rows, K, dtype=operand), new(chunks, K), new(rows, C), new(chunks, 4))

    def u_precision(self, dot_precision: str) -> str:
        """How U is stored (the U_PRECISION of store_u and load_u): as W is, or in fp32."""
        return dot_precision if self.u.dtype == torch.float16 else "ieee"

    def u_peak_or_u(self) -> torch.Tensor:
        """The u_peak pointer argument: U itself where U is fp32 and has no peaks (never read then)."""
        return self.u if self.u_peak is None else self.u_peak


# The fewest key and value channels at which "auto" takes "fp16" for bf16 inputs. Narrower heads take "bf16x3":
# with K = V = 1 the chunk algebra reaches outputs exactly representable in bf16 through cancellation (o_t = sum_j
# A_qk[t, j] Delta_j with |Delta_j| far above |o_t|), and "fp16"'s Delta, rounded to 2^-11 of its peak, moved them
# by an ulp (deltanet), by 4.6 % (gated_deltanet) or to excess 1.59 (kda), where "bf16x3" is exact
# (properties/regressions.py). A sum over so few channels averages no rounding away, and heads this narrow cost
# nothing to multiply at "bf16x3". The chunkwise backward draws its line at the same width
# (_delta_chunk_backward.FP16_PRODUCTS_MIN_CHANNELS).
FP16_MIN_CHANNELS = 16


def auto_precision(dtype: torch.dtype, K: int, V: int) -> str:
    """The ``precision`` option that "auto" stands for, for inputs of ``dtype`` with K key and V value channels:
    "fp16" for bf16 inputs, but "bf16x3" on heads narrower than FP16_MIN_CHANNELS; "bf16x3" for fp16 inputs;
    "ieee" for fp32."""
    if dtype == torch.bfloat16:
        return "fp16" if min(K, V) >= FP16_MIN_CHANNELS else "bf16x3"
    return "ieee" if dtype == torch.float32 else "bf16x3"


def inverse_precision(dot_precision: str) -> str:
    """The products of the forward's UT inverse T = (I + L)^-1, for the state pass's dot precision: as the state
    pass does for "ieee", "tf32" and "tf32x3"; TF32 pairs ("tf32x3", about 2^-22) for "bf16x3" (fp16 inputs,
    whose own products are about 2^-16); otherwise bf16 hi/lo parts ("split", about 2^-16), never operands rounded
    to fp16 or bf16: T's conditioning amplifies their rounding (beta = 2 with nearly parallel keys: kda's bf16
    default at 16 times bf16's floor with an inverse at "fp16"; properties/regressions.py)."""
    if dot_precision in ("ieee", "tf32", "tf32x3"):
        return dot_precision
    return "tf32x3" if dot_precision == "bf16x3" else "split"


def wy_precision(dot_precision: str) -> str:
    """How the forward's W = T Kg and U = T V multiply T, for the state pass's dot precision: as the state pass
    does for "ieee", "tf32" and "tf32x3"; otherwise in bf16 hi/lo parts of T ("split", about 2^-16 relative;
    _numerics.split_dot_into), never T rounded to fp16 as the state pass's operands are (2^-11 of its peak): T's
    conditioning amplifies that rounding (inverse_precision)."""
    return dot_precision if dot_precision in ("ieee", "tf32", "tf32x3") else "split"


def resolve_state_pass(precision: str, num_stages: int | str, dtype: torch.dtype, K: int,
                       V: int) -> tuple[str, int]:
    """(the dot precision, the number of stages) of the state pass for the ``precision`` and
    ``num_stages`` options (checked by the caller) and inputs of ``dtype`` with K key and V value
    channels ("auto": :func:`auto_precision`)."""
    resolved = dot_precision(auto_precision(dtype, K, V) if precision == "auto" else precision)
    if num_stages == "auto":
        # Two stages of the operand tiles outgrow sm_90's 227 KB of shared memory with "tf32" dots, and at
        # K > 128 with any (the ptxas figures: reports/bench.md).
        num_stages = 2 if block_size(K) <= 128 and resolved != "tf32" else 1
    return resolved, num_stages


def value_block(block_v: int, V: int) -> int:
    """kda's V columns per program of the state pass (the delta rules keep the option's whole block)."""
    return min(block_v, block_size(V))


def bind_state_pass(operands: StateOperands, o: torch.Tensor, initial: torch.Tensor | None,
                    final: torch.Tensor | None, T: int, C: int, block_v: int, dot_precision: str,
                    num_warps: int, num_stages: int, scalar_gate_inputs: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> Launch:
    """The state pass over ``operands``, bound: writes o [B, T, H, V] and, if given, the final state (fp32).
    ``scalar_gate_inputs`` (q, k) selects the delta rules' operands (StateOperands.allocate's scalar_gate)."""
    B, _, H, V = o.shape
    K = operands.gc.shape[1]
    num_chunks = triton.cdiv(T, C)
    BK = block_size(K)
    BKB = min(BK, STATE_CHANNEL_BLOCK)
    # The delta rules' q and k tiles are converted in registers before their dots; against V blocks of 16
    # (V <= 16) the GPU build gives wrong outputs that the interpreter does not show (reports/bench.md), so
    # their V blocks are never narrower than the option (64 or 128), whatever V.
    BV = block_v if scalar_gate_inputs is not None else value_block(block_v, V)
    return Launch(
        _state_pass_kernel, (triton.cdiv(V, BV), B * H),
        operands.w, operands.u, operands.u_peak_or_u(), operands.qg, operands.kd, operands.gc, operands.aqk,
        operands.bounds, *(scalar_gate_inputs or (o, o)), o,
        initial if initial is not None else operands.gc, final if final is not None else operands.gc,
        T, H, K, V, num_chunks,
        C=C, BKB=BKB, NKB=BK // BKB, BV=BV, HAS_INITIAL_STATE=initial is not None,
        STORE_FINAL_STATE=final is not None, PRECISION=dot_precision, U_PRECISION=operands.u_precision(dot_precision),
        SCALAR_GATE=scalar_gate_inputs is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
