"""Softmax kernel behaviour beyond the generic oracle test (tests/test_kernels.py).

Runs under the Triton interpreter in fp16 and fp32 (bf16 needs a GPU). Bounds
are multiples of the floor ``max(floor_round, floor_cond)`` (attnlab.metrics)
with tests/test_kernels.py's multiples (excess <= 2 in fp16, <= 4 in fp32),
or exact identities.

- causal=False, separate q/k and v head dims, non-powers of two (K=40, V=100).
- T = 1 returns v exactly (one key: P = 2^15 exactly, l = 2^15).
- precision="split" (P as hi + lo) brings fp16 to within 1.05 of the floor;
  "auto" is "split" for fp16 inputs.
- precision="fp16" (the bf16 default; P and V in fp16 for the P @ V dot, V
  by a power-of-two column scale): in fp16 it runs the scale path, which
  must keep the excess bound for V up to 2^12 times larger, commute exactly
  with power-of-two scalings of V, and give zero for all-zero columns; the
  scale itself, built from exponent bits, brings every column peak into
  [2^13, 2^14) and is a power of two with an exact inverse (1 for
  non-finite peaks). The pre-pass that applies it, run on bf16 too (its
  loads and conversions are exact under the interpreter), must represent v
  exactly as v16 * inverse over several row blocks (the last one partial)
  and a masked head dim, with inf, NaN and all-zero columns.
- tma=True (tensor descriptors) gives the same bits as pointer loads.
- Query blocks smaller than key blocks (the causal unmasked range must end on
  a key-block boundary), several chunk sizes, negative and zero scale,
  near-one-hot rows (scores spanning ~80 nats).
- Bad options give a clear ValueError / TypeError before any launch.
- The default launch configs are allowed option values, chunk_size is capped
  by them, and the 16-bit ones keep q plus the K/V stages under sm_90's
  227 KB of shared memory.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings, strategies as st

import attnlab
from attnlab.kernel import kernel
from attnlab.gradients import gradient_dtypes, gradient_floor, oracle_gradients
from attnlab.metrics import UNIT_ROUNDOFF, conditioning_floor, measure, measure_gradients
from attnlab.registry import bounds_for
from attnlab.kernels import softmax as softmax_kernels
from attnlab.kernels._numerics import pow2_scale
from attnlab.kernels.softmax import (
    OPTIONS, _launch_config, _v_convert_rows, _v_to_fp16,
)
from attnlab.kernels._util import tma_fits
from kernel_checks import ANY_PRECISION_EXCESS_BOUND, EXCESS_BOUND

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run where there is no GPU")

DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
REFERENCE = attnlab.oracle("softmax", "chunkwise", "float64")


def _inputs(dtype, T, K, V, H=2, B=1, seed=0, q_std=1.0):
    x = attnlab.formulation("softmax").sample(B=B, T=T, H=H, K=K, V=V, seed=seed)
    x["q"] = x["q"] * q_std
    return {n: t.to(dtype) for n, t in x.items()}


def _excess(x, dtype, causal=True, scale=None, **opts):
    o = kernel("softmax", **opts)(**x, causal=causal, scale=scale)
    assert o.dtype == dtype and o.shape == x["v"].shape
    ref = REFERENCE(**x, causal=causal, scale=scale)
    m = measure(o, ref, dtype, conditioning_floor(REFERENCE, {**x, "causal": causal, "scale": scale}))
    assert m.nonfinite == 0, m.as_dict()
    return m.excess


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_matches_oracle_with_separate_odd_head_dims(dtype, causal):
    x = _inputs(dtype, T=70, K=40, V=100)
    assert _excess(x, dtype, causal) <= EXCESS_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_single_token_returns_v_exactly(dtype, causal):
    x = _inputs(dtype, T=1, K=16, V=24, B=2)
    o = kernel("softmax")(**x, causal=causal)
    assert torch.equal(o, x["v"])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_split_precision_reaches_the_rounding_floor_in_fp16(causal):
    x = _inputs(torch.float16, T=80, K=32, V=32)
    assert _excess(x, torch.float16, causal, precision="split") <= 1.05


def test_auto_precision_is_split_in_fp16():
    x = _inputs(torch.float16, T=50, K=24, V=24)
    assert torch.equal(kernel("softmax")(**x, causal=True), kernel("softmax", precision="split")(**x, causal=True))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("v_exponent", [2, 7, 12])
def test_fp16_precision_scales_v_exactly(causal, v_exponent):
    x = _inputs(torch.float16, T=70, K=40, V=100)
    scaled = {**x, "v": (x["v"].double() * 2.0**v_exponent).half()}
    assert torch.equal(scaled["v"].double(), x["v"].double() * 2.0**v_exponent)
    assert _excess(scaled, torch.float16, causal, precision="fp16") <= EXCESS_BOUND[torch.float16]
    o = kernel("softmax", precision="fp16")(**scaled, causal=causal).double()
    o_unscaled = kernel("softmax", precision="fp16")(**x, causal=causal).double()
    # Equal wherever the unscaled output is no fp16 subnormal (those hold fewer bits).
    normal = o_unscaled.abs() >= 2.0**-14
    assert normal.float().mean() > 0.9
    assert torch.equal(o[normal], o_unscaled[normal] * 2.0**v_exponent)


def test_fp16_precision_zero_value_columns():
    x = _inputs(torch.float16, T=33, K=16, V=32)
    x["v"][..., 5] = 0.0
    o = kernel("softmax", precision="fp16")(**x, causal=True)
    assert torch.equal(o[..., 5], torch.zeros_like(o[..., 5]))
    assert _excess(x, torch.float16, precision="fp16") <= EXCESS_BOUND[torch.float16]


@triton.jit
def _column_scales_kernel(peak_ptr, scale_ptr, inverse_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    peak = tl.load(peak_ptr + offs, mask=offs < N, other=0.0)
    scale, inverse = pow2_scale(peak, 13)
    tl.store(scale_ptr + offs, scale, mask=offs < N)
    tl.store(inverse_ptr + offs, inverse, mask=offs < N)


def test_v_column_scale():
    exponents = torch.arange(-149, 128, dtype=torch.float64)
    peaks = torch.cat([torch.tensor([0.0, 65504.0, 3.0e38, 1.0 - 2.0**-24]), 2.0**exponents, 1.75 * 2.0**exponents[:-1]])
    peaks = peaks.to(torch.float32)
    scale, inverse = torch.empty_like(peaks), torch.empty_like(peaks)
    _column_scales_kernel[(1,)](peaks, scale, inverse, peaks.numel(), BLOCK=triton.next_power_of_2(peaks.numel()))
    mantissa, _ = torch.frexp(scale)
    assert torch.all(mantissa == 0.5)  # powers of two
    assert torch.all(scale * inverse == 1.0)
    # The largest finite peak (< 2^128) gets 2^-114; zero and tiny peaks the clamp, 2^126.
    assert scale.min() == 2.0**-114 and scale.max() == 2.0**126
    scaled = peaks.double() * scale.double()
    unclamped = peaks >= 2.0**-113  # 2^(13 - floor(log2 peak)) <= 2^126
    assert torch.all((scaled[unclamped] >= 2.0**13) & (scaled[unclamped] < 2.0**14))
    assert torch.all(scaled < 2.0**14)
    nonfinite = torch.tensor([float("inf"), float("nan")])
    _column_scales_kernel[(1,)](nonfinite, scale[:2], inverse[:2], 2, BLOCK=2)
    assert torch.all(scale[:2] == 1.0) and torch.all(inverse[:2] == 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("peak_tiles", [1, 2, 4])
def test_v_to_fp16_is_exact(dtype, peak_tiles, monkeypatch):
    """Three row tiles (the last partial): one peak program each, two programs (the second partial), or one."""
    monkeypatch.setattr(softmax_kernels, "V_PEAK_TILES", peak_tiles)
    B, H, V = 2, 3, 40
    T = 2 * _v_convert_rows(V) + 5
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    # Columns of Gaussians times 2^-16 .. 2^12: peaks far apart, some below fp16's normal range.
    v = v * 2.0 ** torch.randint(-16, 13, (B, 1, H, V), generator=gen)
    v[0, :, 0, 1] = torch.randn(T, generator=gen, dtype=torch.float64)
    v[0, 7, 0, 1] = 2.0**15  # the peak in the first row block, converted last
    v[1, :, 2, 3] = 0.0
    # Non-finite columns keep scale 1: their finite entries must be exact in fp16 unscaled.
    v[0, :, 1, 5] = v[1, :, 0, V - 1] = torch.randn(T, generator=gen, dtype=torch.float64)
    v = v.to(dtype)
    v[0, -1, 1, 5] = float("inf")  # in the partial last row block
    v[1, 100, 0, V - 1] = float("nan")  # in the last column (V = 40 masked in a 64-wide tile)
    v16, inverse = _v_to_fp16(v)
    assert v16.dtype == torch.float16 and v16.shape == v.shape
    inverse = inverse.reshape(B, H, V)[:, None]
    assert torch.equal((v16.double() * inverse.double()).nan_to_num(), v.double().nan_to_num())
    assert torch.equal(v16.isnan(), v.isnan())
    peaks = v16.abs().amax(dim=1)
    finite = torch.isfinite(v.double().abs().amax(dim=1)) & (v.abs().amax(dim=1) > 0)
    assert torch.all((peaks[finite] >= 2.0**13) & (peaks[finite] < 2.0**14))
    assert inverse[1, 0, 2, 3] == 2.0**-126 and inverse[0, 0, 1, 5] == 1.0 and inverse[1, 0, 0, V - 1] == 1.0


@pytest.mark.parametrize(
    "dtype,precision",
    [(torch.float16, "fp16"), (torch.float16, "input"), (torch.float16, "split"), (torch.float32, "auto")],
    ids=["fp16-fp16", "fp16-input", "fp16-split", "fp32"],
)
def test_tma_matches_pointer_loads(dtype, precision):
    # K = 24 and V = 40 (16-bit) fit TMA's 16-byte alignment without filling their tiles.
    x = _inputs(dtype, T=150, K=24, V=40)
    assert tma_fits(x["q"], x["k"], x["v"])
    for causal in (True, False):
        pointers = kernel("softmax", precision=precision, tma=False)(**x, causal=causal)
        tma = kernel("softmax", precision=precision, tma=True)(**x, causal=causal)
        if dtype == torch.float32:
            # The interpreter computes fp32 dots and sums with numpy, whose summation order may follow the
            # operands' memory layout, and its descriptor tiles are laid out unlike pointer tiles: with
            # numpy 2.3.5 the two came out up to 2.3 ulps apart (bit-equal in earlier CI runs); a wrong or unfilled
            # tile would be off by O(1).
            assert (tma - pointers).abs().max() <= 16 * torch.finfo(dtype).eps * pointers.abs().max()
        else:
            assert torch.equal(tma, pointers)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("block_m,chunk_size", [(16, 64), (32, 128), (64, 16), (128, 32)])
def test_block_shapes(block_m, chunk_size, causal):
    x = _inputs(torch.float16, T=75, K=16, V=16, H=1)
    assert _excess(x, torch.float16, causal, block_m=block_m, chunk_size=chunk_size) <= EXCESS_BOUND[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("scale", [-0.4, 0.0, 3.0], ids=["negative", "zero", "peaked"])
def test_scales(dtype, scale):
    # scale 3 with |q|, |k| ~ 4 puts scores ~ +-50 apart: near one-hot rows.
    x = _inputs(dtype, T=40, K=16, V=16)
    assert _excess(x, dtype, causal=True, scale=scale) <= EXCESS_BOUND[dtype]


@settings(max_examples=6, deadline=None)
@given(
    T=st.integers(1, 90),
    K=st.integers(1, 70),
    V=st.integers(1, 70),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    q_std=st.sampled_from([0.5, 1.0, 4.0]),
)
def test_random_shapes_fp16(T, K, V, causal, seed, q_std):
    x = _inputs(torch.float16, T=T, K=K, V=V, H=1, seed=seed, q_std=q_std)
    assert _excess(x, torch.float16, causal) <= EXCESS_BOUND[torch.float16]


@pytest.mark.parametrize(
    "opts,error",
    [
        ({"chunk_size": 48}, ValueError),
        ({"block_m": 256}, ValueError),
        ({"precision": "fp8"}, ValueError),
        ({"num_warps": 3}, ValueError),
        ({"tma": 1.5}, ValueError),
        ({"warp_specialize": "yes"}, ValueError),
        ({"block_n": 64}, TypeError),
    ],
)
def test_bad_options(opts, error):
    with pytest.raises(error):
        kernel("softmax", **opts)


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("widest", [16, 64, 128, 256])
def test_default_launch_configs(itemsize, widest):
    block_m, block_n, num_warps, num_stages = _launch_config(itemsize, widest, None, 128, None, None)
    allowed = {name: choices for name, (_, choices) in OPTIONS["chunkwise"].items()}
    assert block_m in allowed["block_m"] and block_n in allowed["chunk_size"]
    assert num_warps in allowed["num_warps"] and num_stages in allowed["num_stages"]
    if itemsize == 2:
        assert itemsize * widest * (block_m + 2 * num_stages * block_n) <= 232448
    assert _launch_config(itemsize, widest, 16, 16, 2, 1) == (16, 16, 2, 1)


# ------------------------------------------------------------------------------------------------ backward
# The Triton backward (softmax.BACKWARD["chunkwise"]) against float64 autograd through the oracle
# (attnlab.gradients), each gradient as an excess over max(its rounding floor in the returned dtype, its
# conditioning floor): fp16 within the registry's gradient bound (2), fp32 within the default-input bound (4),
# "input" (P and dS rounded once, FlashAttention's rounding) within ANY_PRECISION_EXCESS_BOUND.

GRADIENT_BOUND = {torch.float16: bounds_for(attnlab.formulation("softmax"), "float16").gradient_accuracy,
                  torch.float32: EXCESS_BOUND[torch.float32]}
# Backward block shapes (rows per program, rows per step, warps, stages) that make T <= 70 span several
# programs and several steps, with the masked (diagonal, tail) and unmasked steps all taken.
SMALL_BACKWARD_CONFIGS = [(16, 16, 4, 1), (32, 16, 4, 1), (16, 32, 2, 1)]


def _gradients(x, causal=True, scale=None, do=None, **opts):
    """(kernel gradients {q, k, v}, do in float64) of <do, o>, do drawn from the seed unless given."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}
    o = kernel("softmax", **opts)(**leaves, causal=causal, scale=scale)
    if do is None:
        do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        do = do.to(o.dtype).double()
    got = torch.autograd.grad(o, list(leaves.values()), do.to(o.dtype))
    for g, leaf in zip(got, leaves.values()):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
    return dict(zip(leaves, got)), do


def _gradient_excess(x, causal=True, scale=None, **opts):
    """The excess of each gradient; asserts all are finite."""
    grads, do = _gradients(x, causal, scale, **opts)
    call = {**x, "causal": causal, "scale": scale}
    reference = oracle_gradients("softmax", call, do)
    floors = gradient_floor("softmax", call, do, base=reference)
    measured = measure_gradients(grads, reference, gradient_dtypes("softmax", call), floors)
    assert all(m.nonfinite == 0 for m in measured.values()), {n: m.as_dict() for n, m in measured.items()}
    return {n: m.excess for n, m in measured.items()}


def _small_backward_blocks(monkeypatch, config, dq_config=None):
    """Both backward kernels on ``config`` (the dQ kernel on ``dq_config`` when given)."""
    configs = {key: {"dkdv": config, "dq": dq_config or config} for key in softmax_kernels._BACKWARD_CONFIGS}
    monkeypatch.setattr(softmax_kernels, "_BACKWARD_CONFIGS", configs)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_gradients_match_the_oracle_with_odd_head_dims(dtype, causal):
    x = _inputs(dtype, T=37, K=20, V=24)
    assert max(_gradient_excess(x, causal).values()) <= GRADIENT_BOUND[dtype]


def test_gradients_with_wide_odd_head_dims():
    x = _inputs(torch.float16, T=70, K=40, V=100, H=1)
    assert max(_gradient_excess(x, causal=False).values()) <= GRADIENT_BOUND[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("config", SMALL_BACKWARD_CONFIGS, ids=lambda c: f"{c[0]}x{c[1]}")
def test_gradients_over_several_blocks(dtype, causal, config, monkeypatch):
    """T = 70: partial last blocks of every size, key blocks that end past T, diagonal blocks of both shapes."""
    _small_backward_blocks(monkeypatch, config)
    x = _inputs(dtype, T=70, K=16, V=16, H=1)
    assert max(_gradient_excess(x, causal).values()) <= GRADIENT_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_single_token_gradients(dtype, causal):
    """One key: o = v, so dv = do exactly, and dq, dk are 0 up to dP - D, two fp32 sums of do.v in different
    orders (a few ulps of |do| |v|; exactly 0 is not promised)."""
    x = _inputs(dtype, T=1, K=16, V=24, B=2)
    grads, do = _gradients(x, causal)
    assert torch.equal(grads["v"].double(), do)
    size = do.abs().sum(-1, keepdim=True) * x["v"].double().abs().amax() * x["k"].double().abs().amax()
    assert torch.all(grads["q"].double().abs() <= 8 * torch.finfo(torch.float32).eps * size)
    assert torch.all(grads["k"].double().abs() <= 8 * torch.finfo(torch.float32).eps * size)


@pytest.mark.parametrize("precision", ["auto", "split", "fp16", "input"])
def test_gradients_at_every_precision(precision):
    """Under autograd every precision but "input" splits P in the forward (its fp32 o feeds D) and carries P and
    dS as hi + lo in the backward: the floor in fp16; "input" rounds each once."""
    x = _inputs(torch.float16, T=50, K=16, V=16)
    bound = ANY_PRECISION_EXCESS_BOUND if precision == "input" else 1.1
    assert max(_gradient_excess(x, precision=precision).values()) <= bound


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("scale", [-0.4, 0.0, 3.0], ids=["negative", "zero", "peaked"])
def test_gradient_scales(dtype, scale):
    x = _inputs(dtype, T=40, K=16, V=16)
    assert max(_gradient_excess(x, scale=scale).values()) <= GRADIENT_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_gradients_on_rows_one_key_dominates(dtype, causal):
    """Scores spanning ~100 nats: P is one-hot to fp16 precision on most rows, dP_ij - D_i cancels, and a D taken
    from the fp16-rounded o would be off by the output rounding (FlashAttention's dq error, 6x the floor here).
    D from the forward's fp32 o keeps every fp16 gradient at the floor. In fp32, P from m and log2(l) kept apart
    (exact for the dominant key) holds the default-input bound, where exp2(s - lse) gave dv 5."""
    x = _inputs(dtype, T=64, K=16, V=16, q_std=8.0)
    bound = 1.1 if dtype == torch.float16 else EXCESS_BOUND[torch.float32]
    assert max(_gradient_excess(x, causal, scale=1.0).values()) <= bound


def test_zero_cotangent_gives_zero_gradients():
    x = _inputs(torch.float16, T=45, K=16, V=16)
    grads, _ = _gradients(x, do=torch.zeros(1, 45, 2, 16, dtype=torch.float64))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_causality(dtype, monkeypatch):
    """do = 0 from position c on: q's gradient there, and k's and v's (keys seen only by later queries), are 0."""
    _small_backward_blocks(monkeypatch, SMALL_BACKWARD_CONFIGS[0])
    x = _inputs(dtype, T=60, K=16, V=16)
    do = torch.randn(1, 60, 2, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    do[:, 27:] = 0
    grads, _ = _gradients(x, do=do.to(dtype).double())
    for g in grads.values():
        assert torch.equal(g[:, 27:], torch.zeros_like(g[:, 27:]))
        assert g[:, :27].abs().amax() > 0


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_forward_saves_lse_and_the_output_residual(dtype):
    """saved["row_max"] + saved["log_row_sum"] is log2 sum_i exp(scale q.k_i) per row ([B, H, T], fp32), the
    first the row's largest scaled score; o + saved["o_residual"] (16-bit inputs) is o before its rounding, closer
    to the exact o than o is."""
    x = _inputs(dtype, T=50, K=16, V=24)
    saved = {}
    o, _ = softmax_kernels.chunkwise(**x, scale=16**-0.5, causal=True, saved=saved)
    q, k = x["q"].double(), x["k"].double()
    scores = torch.einsum("bthk,bshk->bhts", q, k) * 16**-0.5
    scores = scores.masked_fill(torch.ones(50, 50, dtype=torch.bool).triu(1), -float("inf"))
    lse = torch.logsumexp(scores, -1) / math.log(2)
    row_max, log_row_sum = saved["row_max"].double(), saved["log_row_sum"].double()
    assert saved["row_max"].dtype == saved["log_row_sum"].dtype == torch.float32
    assert row_max.shape == log_row_sum.shape == (1, 2, 50)
    # A few fp32 roundings at the rows' magnitude: measured 1.6 u (the max) and 3.5 u (their sum) of max |lse|.
    allowance = 8 * UNIT_ROUNDOFF[torch.float32] * lse.abs().max()
    assert (row_max - scores.amax(-1) / math.log(2)).abs().max() <= allowance
    assert torch.all(log_row_sum >= 0)
    assert (row_max + log_row_sum - lse).abs().max() <= allowance
    if dtype == torch.float32:
        assert "o_residual" not in saved
        return
    exact = REFERENCE(**x, causal=True)
    unrounded = o.double() + saved["o_residual"].double()
    assert (unrounded - exact).norm() < 0.05 * (o.double() - exact).norm()


@settings(max_examples=4, deadline=None)
@given(
    T=st.integers(1, 70),
    K=st.integers(1, 40),
    V=st.integers(1, 40),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    q_std=st.sampled_from([0.5, 1.0, 4.0]),
    config=st.sampled_from(SMALL_BACKWARD_CONFIGS),
    dq_config=st.sampled_from(SMALL_BACKWARD_CONFIGS),
)
def test_random_shape_gradients_fp16(T, K, V, causal, seed, q_std, config, dq_config):
    """The two kernels' shapes are drawn apart: each kernel's masks must hold whatever the other's blocks are."""
    x = _inputs(torch.float16, T=T, K=K, V=V, H=1, seed=seed, q_std=q_std)
    with pytest.MonkeyPatch.context() as patch:
        _small_backward_blocks(patch, config, dq_config)
        assert max(_gradient_excess(x, causal).values()) <= GRADIENT_BOUND[torch.float16]


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("widest", [16, 64, 128, 256])
def test_backward_launch_configs(itemsize, widest):
    """Every head-dim tile up to 256 has a backward shape: power-of-two blocks of at least 16 rows (tl.dot's
    minimum), the step no larger than the program's block."""
    configs = softmax_kernels._backward_config(itemsize, widest)
    assert set(configs) == {"dkdv", "dq"}
    for block_program, block_step, num_warps, num_stages in configs.values():
        for block in (block_program, block_step):
            assert block >= 16 and block & (block - 1) == 0
        assert block_step <= block_program and num_warps in (1, 2, 4, 8, 16) and num_stages >= 1
