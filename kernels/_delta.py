"""Triton kernels shared by DeltaNet and Gated DeltaNet (FORMULATIONS.md, 8 and 9).

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

(DeltaNet is g = 0, compiled without the gate code.) Layout: q, k [B, T, H, K],
v and o [B, T, H, V], beta and g [B, T, H], the state S [B, H, K, V] in fp32.

Chunkwise form: seed 000's UT transform in the [K, V] layout, exactly as
oracles/_chunks.py's ``delta_chunk`` writes it. Within a chunk of C positions,
with chunk-local cumulative log gates G_t = sum_{s<=t} g_s (G = 0 ungated),
Gamma_tj = exp(G_t - G_j) for t >= j, and M the causal mask:

    L     = tril(Diag(beta) (K K^T * Gamma), -1)
    T     = (I + L)^-1 Diag(beta)                       (forward substitution in fp32)
    Delta = T (V - exp(G) * (K S))                      (= U - W S with U = T V, W = T (K * exp(G)))
    O     = scale exp(G) * (Q S) + (scale Q K^T * Gamma * M) Delta
    S'    = exp(G_C) S + K^T (exp(G_C - G) * Delta)

Every exponent is <= 0: pairwise differences are masked to -inf above the
diagonal before the exponential, and the others clamped to <= 0. G is kept
as an fp32 pair (a compensated scan), so that G_t - G_j is accurate to its
own size even when |G| reaches C * 20 inside a chunk.

Two launches. ``_chunk_prepare_kernel`` (one program per chunk and head, all
in parallel) builds the two state-independent C x C matrices of each chunk,
T and the gated causal score block scale Q K^T * Gamma * M, in fp32, into
[B*H, NT, C, C] buffers. ``_chunk_scan_kernel`` (one program per head and
block of V columns) walks the chunks in order with S in fp32 registers and
writes O; it reads q, k, v, g and those two blocks, so besides them only the
output goes through memory, and no intermediate is rounded to 16 bits.

Dot precision. Products of two input tiles (Q K^T, K K^T) are exact in fp32
on tensor cores for fp16/bf16 inputs. Every other dot has an fp32 operand
(S, T, Delta, the gated score block); the ``precision`` option chooses how:

- "split": each fp32 operand x is split into bf16 parts hi + lo (x = hi + lo
  + O(2^-17 |x|)) and the dot is hi*hi + hi*lo + lo*hi on bf16 tensor cores
  (a bf16 input operand needs no lo part: two dots). Relative error ~2^-16,
  far below the bf16/fp16 output rounding.
- "tf32x3", "tf32", "ieee": passed to ``tl.dot`` as ``input_precision``
  (~2^-22, 2^-11 and exact fp32).
- "auto" (default): "tf32x3" for fp16/bf16 inputs, "ieee" for fp32 inputs
  (whose accuracy target is fp32 rounding). Not "split": its 2^-16 is far
  below the output rounding only while the UT inverse is well conditioned;
  with beta = 2 and nearly parallel keys (condition numbers in the thousands,
  numerics notes 4.3) the property suite measured fp16 excess 2.5 with
  "split" against 1.004 with exact fp32 dots.

Under the Triton interpreter bf16 arithmetic is broken, so "split" rounds to
bf16 by integer RTNE on the fp32 bit pattern and multiplies the parts as fp32
(exact, like the tensor cores' bf16 products); the other precisions are all
exact fp32 there.

Recurrent form: one program per (head, block of V columns), the literal
recurrence token by token on the fp32 state (the read k^T S spans the whole
K column, so only V is split).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from attnlab.kernel import interpreter_active

from ._util import block_size

PRECISIONS = ("auto", "split", "tf32x3", "tf32", "ieee")
CHUNK_SIZES = (16, 32, 64)
BLOCK_VS = (None, 16, 32, 64, 128)
NUM_WARPS = (1, 2, 4, 8)
NUM_STAGES = (1, 2, 3)
# Diagonal blocks of T are inverted by substitution at this size, then merged by dots.
SUB = tl.constexpr(16)


def options(chunkwise: bool) -> dict[str, tuple]:
    """The kernel options of one form, as kernels/__init__.py's OPTIONS entry."""
    common = {"block_v": (None, BLOCK_VS), "num_warps": (4, NUM_WARPS)}
    if not chunkwise:
        return common
    # num_stages 1: the scan's shared memory then fits two programs per H100 SM (sm_90 ptxas, K=V=128).
    return {"chunk_size": (64, CHUNK_SIZES), "precision": ("auto", PRECISIONS), "num_stages": (1, NUM_STAGES), **common}


# --------------------------------------------------------------------------- dots


@triton.jit
def _round_to_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32: integer RTNE on the bit pattern."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_parts(x, EMULATE_BF16: tl.constexpr):
    """x (fp32) = hi + lo + O(2^-17 |x|) with hi, lo bf16 values (fp32 carriers when emulating)."""
    if EMULATE_BF16:
        hi = _round_to_bf16(x)
        lo = _round_to_bf16(x - hi)
    else:
        hi = x.to(tl.bfloat16)
        lo = (x - hi.to(tl.float32)).to(tl.bfloat16)
    return hi, lo


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """a @ b with fp32 accumulation; a and b are input tiles (fp16/bf16/fp32) or fp32 tiles.

    Two 16-bit tiles of one dtype go straight to the tensor cores (exact
    products). Otherwise PRECISION decides: "split" multiplies bf16 hi/lo parts
    (a bf16 operand is its own hi part), anything else is tl.dot's input_precision.
    """
    if tl.constexpr(a.dtype == b.dtype) and tl.constexpr(a.dtype != tl.float32):
        out = tl.dot(a, b)
    elif PRECISION == "split":
        if tl.constexpr(a.dtype == tl.bfloat16):
            b_hi, b_lo = _bf16_parts(b.to(tl.float32), EMULATE_BF16)
            out = tl.dot(a, b_hi) + tl.dot(a, b_lo)
        elif tl.constexpr(b.dtype == tl.bfloat16):
            a_hi, a_lo = _bf16_parts(a.to(tl.float32), EMULATE_BF16)
            out = tl.dot(a_hi, b) + tl.dot(a_lo, b)
        else:
            a_hi, a_lo = _bf16_parts(a.to(tl.float32), EMULATE_BF16)
            b_hi, b_lo = _bf16_parts(b.to(tl.float32), EMULATE_BF16)
            out = tl.dot(a_hi, b_hi) + (tl.dot(a_hi, b_lo) + tl.dot(a_lo, b_hi))
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
    return out


# --------------------------------------------------------------------------- gates


@triton.jit
def _two_sum(a_hi, a_lo, b_hi, b_lo):
    """(a_hi + a_lo) + (b_hi + b_lo) as an unevaluated fp32 pair (Knuth's TwoSum on the leading parts)."""
    total = a_hi + b_hi
    b_virtual = total - a_hi
    error = (a_hi - (total - b_virtual)) + (b_hi - b_virtual)
    return total, (a_lo + b_lo) + error


@triton.jit
def _chunk_cumulative_gate(g_ptr, token, valid):
    """G_t = sum_{s<=t} g_s over the chunk as a pair G_hi + G_lo carrying about 48 bits.

    A plain fp32 cumsum errs by ~u |G_t| in every G_t, and the pairwise
    differences G_t - G_j (|G| up to C * 20 on strong gates) would inherit that
    absolutely; the pair keeps each difference to ~u |G_t - G_j|. Rows past the
    sequence end load g = 0, so the last row holds G_C.
    """
    g = tl.load(g_ptr + token, mask=valid, other=0.0).to(tl.float32)
    return tl.associative_scan((g, tl.zeros_like(g)), 0, _two_sum)


@triton.jit
def _gate_difference(G_hi, G_lo, other_hi, other_lo):
    """G - other from two (hi, lo) pairs, clamped to <= 0 (the exact value is, since g <= 0)."""
    return tl.minimum((G_hi - other_hi) + (G_lo - other_lo), 0.0)


# --------------------------------------------------------------------------- UT transform


@triton.jit
def _unit_lower_inverse(L, BC: tl.constexpr, LEVELS: tl.constexpr, PRECISION: tl.constexpr,
                        EMULATE_BF16: tl.constexpr):
    """(I + L)^-1 for strictly lower-triangular L [BC, BC], in fp32.

    The SUB x SUB diagonal blocks are inverted by column-oriented forward
    substitution (all blocks at once: step r eliminates column r of every
    block), then merged pairwise LEVELS times: for a block [[A, 0], [B, D]]
    whose halves are already inverted, X <- X - X B X fills in -D^-1 B A^-1.
    """
    rows = tl.arange(0, BC)[:, None]
    cols = tl.arange(0, BC)[None, :]
    same_block = (rows // SUB) == (cols // SUB)
    L_diag = tl.where(same_block, L, 0.0)
    X = tl.where(rows == cols, 1.0, 0.0)
    for r in range(SUB):
        # l[i] = L[i, j] and x[m] = X[j, m], with j the r-th column (row) of the block of i (m).
        l = tl.sum(tl.where(cols % SUB == r, L_diag, 0.0), axis=1)
        x = tl.sum(tl.where(rows % SUB == r, X, 0.0), axis=0)
        X = X - tl.where(same_block, l[:, None] * x[None, :], 0.0)
    for level in tl.static_range(LEVELS):
        half = SUB << level
        lower_left = ((rows // (2 * half)) == (cols // (2 * half))) & ((rows // half) % 2 == 1) & ((cols // half) % 2 == 0)
        X = X - _mm(_mm(X, tl.where(lower_left, L, 0.0), PRECISION, EMULATE_BF16), X, PRECISION, EMULATE_BF16)
    return X


@triton.jit
def _chunk_prepare_kernel(
    q_ptr, k_ptr, beta_ptr, g_ptr, ut_ptr, scores_ptr,
    T, H, K, scale,
    GATED: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, LEVELS: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """The state-independent matrices of one chunk of one head, both [BC, BC] fp32:

      T      = (I + L)^-1 Diag(beta),  L = tril(Diag(beta) (K K^T * Gamma), -1)
      scores = scale Q K^T * Gamma * M

    Grid (NT, B*H). Rows past the sequence end load q = k = beta = g = 0, so
    their rows and columns of both are 0.
    """
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    pos = chunk * BC + tl.arange(0, BC)
    valid = pos < T
    token = (b * T + pos).to(tl.int64) * H + h
    kcol = tl.arange(0, BK)
    qk_mask = valid[:, None] & (kcol[None, :] < K)
    q = tl.load(q_ptr + token[:, None] * K + kcol[None, :], mask=qk_mask, other=0.0)
    k = tl.load(k_ptr + token[:, None] * K + kcol[None, :], mask=qk_mask, other=0.0)
    beta = tl.load(beta_ptr + token, mask=valid, other=0.0).to(tl.float32)

    rows = tl.arange(0, BC)[:, None]
    cols = tl.arange(0, BC)[None, :]
    L = beta[:, None] * _mm(k, tl.trans(k), PRECISION, EMULATE_BF16)
    scores = scale * _mm(q, tl.trans(k), PRECISION, EMULATE_BF16)
    if GATED:
        G_hi, G_lo = _chunk_cumulative_gate(g_ptr, token, valid)
        pairwise = _gate_difference(G_hi[:, None], G_lo[:, None], G_hi[None, :], G_lo[None, :])
        gamma = tl.exp(tl.where(rows >= cols, pairwise, float("-inf")))
        L = L * gamma
        scores = scores * gamma
    L = tl.where(rows > cols, L, 0.0)
    scores = tl.where(rows >= cols, scores, 0.0)

    ut = _unit_lower_inverse(L, BC, LEVELS, PRECISION, EMULATE_BF16) * beta[None, :]
    block = (bh.to(tl.int64) * tl.num_programs(0) + chunk) * (BC * BC) + rows * BC + cols
    tl.store(ut_ptr + block, ut)
    tl.store(scores_ptr + block, scores)


# --------------------------------------------------------------------------- chunk scan


@triton.jit
def _chunk_scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, ut_ptr, scores_ptr, s0_ptr, o_ptr, s_out_ptr,
    T, H, K, V, scale,
    GATED: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
    BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    """The chunks of one head in order, for V columns [BV * pid0, BV * (pid0 + 1)).

    Per chunk, with S the fp32 state before it and T, scores from _chunk_prepare_kernel:
      Delta = T (V - exp(G) * (K S))
      O     = scale exp(G) * (Q S) + scores Delta
      S    <- exp(G_C) S + K^T (exp(G_C - G) * Delta)
    Grid (cdiv(V, BV), B*H).
    """
    vblock = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kcol = tl.arange(0, BK)
    vcol = vblock * BV + tl.arange(0, BV)
    k_in, v_in = kcol < K, vcol < V
    state_offsets = bh.to(tl.int64) * K * V + kcol[:, None] * V + vcol[None, :]
    state_mask = k_in[:, None] & v_in[None, :]
    if HAS_INITIAL:
        S = tl.load(s0_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    square = tl.arange(0, BC)[:, None] * BC + tl.arange(0, BC)[None, :]
    n_chunks = tl.cdiv(T, BC)
    for chunk in range(0, n_chunks):
        pos = chunk * BC + tl.arange(0, BC)
        valid = pos < T
        token = (b * T + pos).to(tl.int64) * H + h
        qk_mask = valid[:, None] & k_in[None, :]
        ov_mask = valid[:, None] & v_in[None, :]
        block = (bh.to(tl.int64) * n_chunks + chunk) * (BC * BC) + square
        k = tl.load(k_ptr + token[:, None] * K + kcol[None, :], mask=qk_mask, other=0.0)
        v = tl.load(v_ptr + token[:, None] * V + vcol[None, :], mask=ov_mask, other=0.0).to(tl.float32)
        if GATED:
            G_hi, G_lo = _chunk_cumulative_gate(g_ptr, token, valid)
            decay_in = tl.exp(tl.minimum(G_hi + G_lo, 0.0))  # exp(G_t)
            last = tl.arange(0, BC) == BC - 1
            G_end_hi, G_end_lo = tl.sum(tl.where(last, G_hi, 0.0), axis=0), tl.sum(tl.where(last, G_lo, 0.0), axis=0)
            decay_out = tl.exp(_gate_difference(G_end_hi, G_end_lo, G_hi, G_lo))  # exp(G_C - G_t)
            v = v - decay_in[:, None] * _mm(k, S, PRECISION, EMULATE_BF16)
        else:
            v = v - _mm(k, S, PRECISION, EMULATE_BF16)
        delta = _mm(tl.load(ut_ptr + block), v, PRECISION, EMULATE_BF16)

        q = tl.load(q_ptr + token[:, None] * K + kcol[None, :], mask=qk_mask, other=0.0)
        o = scale * _mm(q, S, PRECISION, EMULATE_BF16)
        if GATED:
            o = o * decay_in[:, None]
        o += _mm(tl.load(scores_ptr + block), delta, PRECISION, EMULATE_BF16)
        tl.store(o_ptr + token[:, None] * V + vcol[None, :], o.to(o_ptr.dtype.element_ty), mask=ov_mask)

        if GATED:
            S = S * tl.exp(tl.minimum(G_end_hi + G_end_lo, 0.0)) + _mm(tl.trans(k), delta * decay_out[:, None],
                                                                       PRECISION, EMULATE_BF16)
        else:
            S = S + _mm(tl.trans(k), delta, PRECISION, EMULATE_BF16)

    if STORE_FINAL:
        tl.store(s_out_ptr + state_offsets, S, mask=state_mask)


# --------------------------------------------------------------------------- recurrent


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, g_ptr, s0_ptr, o_ptr, s_out_ptr,
    T, H, K, V, scale,
    GATED: tl.constexpr, HAS_INITIAL: tl.constexpr, STORE_FINAL: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """Token by token: S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T (scale q).

    (The first two lines are exp(g) (I - beta k k^T) S + beta k v^T.) Grid (cdiv(V, BV), B*H).
    """
    vblock = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    kcol = tl.arange(0, BK)
    vcol = vblock * BV + tl.arange(0, BV)
    k_in, v_in = kcol < K, vcol < V
    state_offsets = bh.to(tl.int64) * K * V + kcol[:, None] * V + vcol[None, :]
    state_mask = k_in[:, None] & v_in[None, :]
    if HAS_INITIAL:
        S = tl.load(s0_ptr + state_offsets, mask=state_mask, other=0.0)
    else:
        S = tl.zeros([BK, BV], dtype=tl.float32)

    for t in range(0, T):
        token = (b * T + t).to(tl.int64) * H + h
        q = tl.load(q_ptr + token * K + kcol, mask=k_in, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + token * K + kcol, mask=k_in, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + token * V + vcol, mask=v_in, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + token).to(tl.float32)
        if GATED:
            S = S * tl.exp(tl.load(g_ptr + token).to(tl.float32))
        error = v - tl.sum(k[:, None] * S, axis=0)
        S = S + (beta * k)[:, None] * error[None, :]
        o = tl.sum((scale * q)[:, None] * S, axis=0)
        tl.store(o_ptr + token * V + vcol, o.to(o_ptr.dtype.element_ty), mask=v_in)

    if STORE_FINAL:
        tl.store(s_out_ptr + state_offsets, S, mask=state_mask)


# --------------------------------------------------------------------------- launchers


def _block_v(V: int, K: int, block_v: int | None) -> int:
    """V columns per program: the option, else 64 (32 when K > 128, to bound the fp32 state tile)."""
    if block_v is not None:
        return min(block_v, block_size(V))
    return min(block_size(V), 64 if block_size(K) <= 128 else 32)


def _resolve_precision(precision: str, dtype: torch.dtype) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}")
    if precision == "auto":
        return "ieee" if dtype == torch.float32 else "tf32x3"
    return precision


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _outputs(q: torch.Tensor, v: torch.Tensor, return_state: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    B, _, H, K = q.shape
    o = torch.empty_like(v)
    final = torch.empty((B, H, K, v.shape[-1]), dtype=torch.float32, device=v.device) if return_state else None
    return o, final


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor] | None, return_state: bool,
    chunk_size: int = 64, precision: str = "auto", block_v: int | None = None, num_warps: int = 4,
    num_stages: int = 1,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The chunkwise UT-transform kernels; g None is DeltaNet. Returns (o, (S,) or None)."""
    _check_choice("chunk_size", chunk_size, CHUNK_SIZES)
    _check_choice("num_stages", num_stages, NUM_STAGES)
    _check_choice("block_v", block_v, BLOCK_VS)
    _check_choice("num_warps", num_warps, NUM_WARPS)
    dot_precision = _resolve_precision(precision, q.dtype)
    emulate_bf16 = dot_precision == "split" and interpreter_active()
    B, T, H, K = q.shape
    V = v.shape[-1]
    BC, BK, BV = chunk_size, block_size(K), _block_v(V, K, block_v)
    n_chunks = triton.cdiv(T, BC)
    gated = g is not None
    o, final = _outputs(q, v, return_state)
    ut = torch.empty((B * H, n_chunks, BC, BC), dtype=torch.float32, device=q.device)
    scores = torch.empty_like(ut)
    g_arg = g if gated else beta  # an unused pointer when ungated
    _chunk_prepare_kernel[(n_chunks, B * H)](
        q, k, beta, g_arg, ut, scores, T, H, K, float(scale),
        GATED=gated, BC=BC, BK=BK, LEVELS=int(math.log2(BC // SUB.value)),
        PRECISION=dot_precision, EMULATE_BF16=emulate_bf16, num_warps=num_warps,
    )
    initial = state[0] if state is not None else None
    _chunk_scan_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, g_arg, ut, scores, ut if initial is None else initial, o, ut if final is None else final,
        T, H, K, V, float(scale),
        GATED=gated, HAS_INITIAL=initial is not None, STORE_FINAL=final is not None,
        BC=BC, BK=BK, BV=BV, PRECISION=dot_precision, EMULATE_BF16=emulate_bf16,
        num_warps=num_warps, num_stages=num_stages,
    )
    return o, ((final,) if return_state else None)


def recurrent(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor] | None, return_state: bool,
    block_v: int | None = None, num_warps: int = 4,
) -> tuple[torch.Tensor, tuple[torch.Tensor] | None]:
    """The token-by-token kernel; g None is DeltaNet. Returns (o, (S,) or None)."""
    _check_choice("block_v", block_v, BLOCK_VS)
    _check_choice("num_warps", num_warps, NUM_WARPS)
    B, T, H, K = q.shape
    V = v.shape[-1]
    BK, BV = block_size(K), _block_v(V, K, block_v)
    o, final = _outputs(q, v, return_state)
    initial = state[0] if state is not None else None
    gated = g is not None
    _recurrent_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, v, beta, g if gated else beta, initial if initial is not None else o, o,
        final if final is not None else o,
        T, H, K, V, float(scale),
        GATED=gated, HAS_INITIAL=initial is not None, STORE_FINAL=final is not None,
        BK=BK, BV=BV, num_warps=num_warps,
    )
    return o, ((final,) if return_state else None)
