"""fp32 operands of tensor-core dots, and expm1; shared by kernels/linear_attn.py and kernels/retnet.py.

Each dot helper returns acc + x @ y in fp32. PRECISION says how an fp32
operand x enters the tensor cores:

- "split": x = hi + lo in the input dtype (hi = round(x), lo = round(x - hi)),
  two dots against an exact input-dtype operand; x is carried to ~2^-16
  relative (bf16) or ~2^-22 (fp16), so no intermediate is rounded to the
  input dtype.
- "round": hi only, one dot: x rounded once to the input dtype, as
  flash-linear-attention does (the fast setting, about one input-dtype
  rounding of every intermediate).
- "tf32" / "ieee": one fp32 dot of that input_precision.

With RESCALE (fp16 inputs, "split" or "round") x is first scaled per row
(left operand) or per column (right operand) to a peak of 16384 (fp16's
maximum is 65504) and the product scaled back: that commutes with the dot and
keeps the parts finite when a state grows past fp16's range. An all-zero row
or column keeps a peak of 1e-30 (never a division by zero) and contributes 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PRECISIONS = ("split", "round", "tf32", "ieee")


@triton.jit
def split(x, DTYPE: tl.constexpr):
    """fp32 x = hi + lo (to ~2^-16 relative for bf16), hi and lo in DTYPE."""
    hi = x.to(DTYPE)
    return hi, (x - hi.to(tl.float32)).to(DTYPE)


@triton.jit
def _parts_dot_left(x, b, acc, PRECISION: tl.constexpr):
    """acc + x @ b from the hi (and, for "split", lo) parts of fp32 x."""
    hi, lo = split(x, b.dtype)
    if PRECISION == "split":
        return tl.dot(lo, b, tl.dot(hi, b, acc))
    else:
        return tl.dot(hi, b, acc)


@triton.jit
def _parts_dot_right(a, x, acc, PRECISION: tl.constexpr):
    """acc + a @ x from the hi (and, for "split", lo) parts of fp32 x."""
    hi, lo = split(x, a.dtype)
    if PRECISION == "split":
        return tl.dot(a, lo, tl.dot(a, hi, acc))
    else:
        return tl.dot(a, hi, acc)


@triton.jit
def dot_f32_lowp(x, b, acc, PRECISION: tl.constexpr, RESCALE: tl.constexpr):
    """acc + x @ b for fp32 x [M, N] and b [N, P] in the input dtype."""
    if PRECISION == "tf32" or PRECISION == "ieee":
        return tl.dot(x, b.to(tl.float32), acc, input_precision=PRECISION)
    elif RESCALE:
        peak = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
        product = _parts_dot_left(x * (16384.0 / peak)[:, None], b, tl.zeros_like(acc), PRECISION)
        return acc + product * (peak * (1.0 / 16384.0))[:, None]
    else:
        return _parts_dot_left(x, b, acc, PRECISION)


@triton.jit
def dot_lowp_f32(a, x, acc, PRECISION: tl.constexpr, RESCALE: tl.constexpr):
    """acc + a @ x for a [M, N] in the input dtype and fp32 x [N, P]."""
    if PRECISION == "tf32" or PRECISION == "ieee":
        return tl.dot(a.to(tl.float32), x, acc, input_precision=PRECISION)
    elif RESCALE:
        peak = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30)
        product = _parts_dot_right(a, x * (16384.0 / peak)[None, :], tl.zeros_like(acc), PRECISION)
        return acc + product * (peak * (1.0 / 16384.0))[None, :]
    else:
        return _parts_dot_right(a, x, acc, PRECISION)


@triton.jit
def dot_f32_f32(x, y, acc, DTYPE: tl.constexpr, PRECISION: tl.constexpr, RESCALE: tl.constexpr):
    """acc + x @ y for fp32 x [M, N], y [N, P]: "split" is x_hi y_hi + x_hi y_lo + x_lo y_hi in DTYPE."""
    if PRECISION == "tf32" or PRECISION == "ieee":
        return tl.dot(x, y, acc, input_precision=PRECISION)
    elif RESCALE:
        x_peak = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
        y_peak = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-30)
        x_hi, x_lo = split(x * (16384.0 / x_peak)[:, None], DTYPE)
        y_hi, y_lo = split(y * (16384.0 / y_peak)[None, :], DTYPE)
        product = tl.dot(x_hi, y_hi)
        if PRECISION == "split":
            product = tl.dot(x_lo, y_hi, tl.dot(x_hi, y_lo, product))
        return acc + product * (x_peak * (1.0 / 16384.0))[:, None] * (y_peak * (1.0 / 16384.0))[None, :]
    else:
        x_hi, x_lo = split(x, DTYPE)
        y_hi, y_lo = split(y, DTYPE)
        acc = tl.dot(x_hi, y_hi, acc)
        if PRECISION == "split":
            acc = tl.dot(x_lo, y_hi, tl.dot(x_hi, y_lo, acc))
        return acc


@triton.jit
def expm1(x):
    """exp(x) - 1 in fp32 for x <= 0 without cancellation near 0 (a few ulps relative everywhere).

    Taylor to x^9 for x > -0.5 (truncation below 1e-9 relative), else exp(x) - 1 (|result| > 0.39).
    """
    taylor = x * (1.0 + x * (1.0 / 2 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (
        1.0 / 720 + x * (1.0 / 5040 + x * (1.0 / 40320 + x * (1.0 / 362880)))))))))
    return tl.where(x > -0.5, taylor, tl.exp(tl.minimum(x, 0.0)) - 1.0)


def dot_config(dtype: torch.dtype, precision: str) -> tuple[str | None, str, bool]:
    """(INPUT_PRECISION, PRECISION, RESCALE) constexprs of a kernel for inputs of ``dtype``.

    INPUT_PRECISION is that of dots whose operands are inputs (None: the dtype's default; fp32
    inputs use "ieee" unless "tf32" is asked for, and then every dot is an fp32 dot).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))}; got {precision!r}")
    if dtype == torch.float32:
        fp32_precision = "tf32" if precision == "tf32" else "ieee"
        return fp32_precision, fp32_precision, False
    return None, precision, precision in ("split", "round") and dtype == torch.float16


def tile(n: int, cap: int) -> int:
    """A power-of-two tile covering ``n`` up to ``cap``, at least 32.

    32 rather than tl.dot's minimum 16, as a hedge: the first-round kernels gave wrong results on
    the GPU at V=12 (16-wide state tiles, 32-byte rows of the bf16 operands), for a cause not
    pinned down; the extra padding costs nothing measurable at such small head dimensions.
    """
    return min(max(32, triton.next_power_of_2(n)), max(cap, 32))
