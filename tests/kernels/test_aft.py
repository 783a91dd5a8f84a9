"""AFT kernel behaviour beyond the generic oracle test (tests/test_kernels.py).

Runs under the Triton interpreter in fp16 and fp32 (bf16 needs a GPU). Bounds
are multiples of the floor ``max(floor_round, floor_cond)`` (attnlab.metrics)
with tests/test_kernels.py's multiples (excess <= 2 in fp16, <= 4 in fp32),
or exact identities.

- causal=False, a non-power-of-two D (100) split over several channel blocks.
- Keys shifted by +-60 (fp16) and +-200 (fp32): finite, within the bound,
  every output inside [min v, max v] of the values it averages.
- Shift invariance: keys on a 1/8 grid plus a constant (so k + c is exact)
  give bit-identical outputs (the kernel only ever sees k - max k).
- T = 1 returns v exactly, in both precisions.
- The exact passes: bias and keys whose maxima sit at different keys
  (w = [0, -100], k = [-100, 0]) make the factorized block sums underflow to
  0/0, and, causal, put a key of a row's own tile far above its reference
  (k_0 for the first tile); the kernel marks those entries and the fallback
  recomputes them exactly. Entries where only the own tile's fp16 operands
  fail, causal with 16-bit inputs, are summed again by the redo pass (fp32 own
  operands): an own key far above the running maximum of the keys before its
  tile (past 2^32, the fallback), an own E * v operand past fp16's range in the
  own tile's E * v units (a headroom of its own, 2^4, below E's 2^8), and own
  E * v operands below fp16's normal range (the block before set a large
  scale) where they would matter. With a pass left out exactly the rows it
  would take come out NaN. Forcing the fallback on ordinary inputs matches the
  oracle too.
- Causality, bitwise: replacing k, v and w at positions after t leaves
  outputs 0..t bit-identical (T not a multiple of the blocks, own tiles of 16,
  32, 64 and 128 rows over several query and key blocks, with and without
  entries that take the fallback); so does a huge or non-finite k or v later
  in a row's own tile (its row of the own-tile operands serves the rows after
  it).
- The anchored forward (fp16 "single" here; bf16's default on the GPU): the
  registry's inputs, keys shifted by +-60 too, take it alone (the running
  forward's pass over its listed tiles left out, no row NaN, within the
  bound); a key past KEY_WINDOW, an E * v past fp16's range, a huge first
  value (the others' E * v too coarse) mark their row and every later one, a
  bias row spread past BIAS_WINDOW marks itself, and the running forward takes
  exactly those rows (without causality a failed key marks every row); its
  causality, bitwise, with the running forward taking the perturbed run's rows
  from a failed key on. The tests of the running forward's own machinery (its
  own tile, its redo pass) that use "single" pin anchored=False.
- precision "single" and "split", block shapes, bad options (causal: a key
  block longer than the query tile, refused before any launch).
- The forward's kernels compile for sm_90 (in a process of their own, without
  the interpreter) at the launcher's default tiles, in every arithmetic, within
  sm_90's shared memory (bf16: the anchored forward's kernels as well).

Backward (chunkwise_backward), every gradient (dw, dk, dv) against float64 autograd through the oracle, as an
excess over max(rounding floor in the returned dtype, conditioning floor) (attnlab.metrics.measure_gradients),
held to the same bounds: T = 1, T not a multiple of the blocks, odd D over several channel blocks, keys
shifted past the exp thresholds and wide bias/keys (the exact per-key fallback), every precision and block
shape, do alone, and zero do (every gradient exactly 0). Backward causality: do zero from position c on leaves
dk, dv at positions >= c and dw's rows >= c exactly zero. Its two paths: ordinary inputs (keys shifted by 60
included) take the factorized kernels alone (the per-tile kernels stubbed out, the flag they read 0, the gradients
within the bound); wide bias and keys, mismatched maxima, a key or a head 30 nats above the rest raise the flag and
come out right through the per-tile kernels; the backward's kernels compile for sm_90 at the default tiles within
its shared memory (fp16's "split" first: the most operand tiles).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import assume, example, given, settings, strategies as st

import attnlab
from attnlab.kernel import kernel
from attnlab.kernels import aft as aft_kernels
from attnlab.kernels._util import tma_fits
from attnlab.gradients import gradient_dtypes, gradient_floor, oracle_gradients
from attnlab.metrics import conditioning_floor, measure, measure_gradients, unit_roundoff
from kernel_checks import EXCESS_BOUND, sweep

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run where there is no GPU")

DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
REFERENCE = attnlab.oracle("aft", "chunkwise", "float64")
# fp16 inputs with "single" operands (not fp16's default): each operand is rounded once, as coarsely as fp16's own
# output, so the excess is about 1.6 and, over few outputs, up to 2.7 (measured at T = 20, D = 1, both forwards).
SINGLE_FP16_BOUND = 3.0


def _inputs(dtype, T, D, H=2, B=1, seed=0, key_shift=0.0, spread=1.0):
    x = attnlab.formulation("aft").sample(B=B, T=T, H=H, K=D, V=D, seed=seed)
    x["w"] = x["w"] * spread
    x["k"] = x["k"] * spread + key_shift
    return {n: t.to(dtype) for n, t in x.items()}


def _measure(o, x, dtype, causal):
    ref = REFERENCE(**x, causal=causal)
    m = measure(o, ref, dtype, conditioning_floor(REFERENCE, {**x, "causal": causal}))
    assert m.nonfinite == 0, m.as_dict()
    return m


def _excess(x, dtype, causal=True, **opts):
    o = kernel("aft", **opts)(**x, causal=causal)
    assert o.dtype == dtype and o.shape == x["v"].shape
    return _measure(o, x, dtype, causal).excess


def _assert_convex(o, v, causal, dtype):
    """Each o[b, t, h, d] lies in [min, max] of v[b, i, h, d] over the keys it averages (up to a few roundings)."""
    v64, o64 = v.to(torch.float64), o.to(torch.float64)
    if causal:
        low, high = torch.cummin(v64, dim=1).values, torch.cummax(v64, dim=1).values
    else:
        low, high = v64.amin(dim=1, keepdim=True), v64.amax(dim=1, keepdim=True)
    slack = 4 * unit_roundoff(dtype) * v64.abs().max()
    assert bool((o64 >= low - slack).all()) and bool((o64 <= high + slack).all())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_matches_oracle_odd_channel_count_over_several_blocks(dtype, causal):
    x = _inputs(dtype, T=40, D=100, H=1)
    assert _excess(x, dtype, causal, block_q=32, chunk_size=16, block_d=32) <= EXCESS_BOUND[dtype]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize(
    "dtype,shift",
    [(torch.float16, 60.0), (torch.float16, -60.0), (torch.float32, 200.0), (torch.float32, -200.0)],
    ids=["fp16+60", "fp16-60", "fp32+200", "fp32-200"],
)
def test_shifted_keys_stay_finite_accurate_and_convex(dtype, shift, causal):
    x = _inputs(dtype, T=48, D=16, key_shift=shift)
    o = kernel("aft")(**x, causal=causal)
    assert _measure(o, x, dtype, causal).excess <= EXCESS_BOUND[dtype]
    _assert_convex(o, x["v"], causal, dtype)


@pytest.mark.parametrize("dtype,shift", [(torch.float16, 32.0), (torch.float32, 128.0)], ids=["fp16", "fp32"])
@pytest.mark.parametrize("precision", ["single", "split"])
def test_key_shift_invariance_is_exact(dtype, shift, precision):
    x = _inputs(dtype, T=40, D=16)
    x["k"] = (x["k"].to(torch.float64) * 8).round().clamp(-32, 32).div(8).to(dtype)  # |k| <= 4 on a 1/8 grid
    shifted = {**x, "k": x["k"] + shift}
    assert torch.equal(shifted["k"].to(torch.float64) - shift, x["k"].to(torch.float64))  # k + c is exact
    for causal in (True, False):
        run = kernel("aft", precision=precision)
        assert torch.equal(run(**shifted, causal=causal), run(**x, causal=causal))


@pytest.mark.parametrize("dtype", sweep(list(DTYPES.values()), DTYPES.keys()))
@pytest.mark.parametrize("precision", sweep(["single", "split"], ["single", "split"]))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_single_token_returns_v_exactly(dtype, precision, causal):
    x = _inputs(dtype, T=1, D=20, B=2)
    assert torch.equal(kernel("aft", precision=precision)(**x, causal=causal), x["v"])


def _mismatched_maxima(dtype):
    """T = 2: every row's largest bias is at key 0, every channel's largest key at key 1; both logits are -100."""
    x = _inputs(dtype, T=2, D=16, H=1)
    x["w"] = torch.tensor([[0.0, -100.0], [0.0, -100.0]], dtype=dtype)
    x["k"][:, 0] = -100.0
    x["k"][:, 1] = 0.0
    return x


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_mismatched_maxima_take_the_exact_fallback(dtype):
    x = _mismatched_maxima(dtype)
    o = kernel("aft")(**x, causal=False)
    assert _measure(o, x, dtype, causal=False).excess <= EXCESS_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_mismatched_maxima_in_a_rows_own_tile_take_the_exact_fallback(dtype):
    # Causal, both keys lie in row 1's own tile, whose keys are relative to k_0 = -100: k_1 passes it by 100, far
    # beyond the own tile's headroom (2^8, 2^32 with fp32 operands).
    x = _mismatched_maxima(dtype)
    o = kernel("aft")(**x, causal=True)
    assert _measure(o, x, dtype, causal=True).excess <= EXCESS_BOUND[dtype]


def test_without_the_fallback_mismatched_maxima_give_nan(monkeypatch):
    """The factorized sums alone underflow to 0 / 0 here: the fallback is what the previous test exercised."""
    monkeypatch.setitem(aft_kernels.DEN_FLOOR, True, 0.0)
    o = kernel("aft")(**_mismatched_maxima(torch.float16), causal=False)
    assert bool(torch.isnan(o).all())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_forced_fallback_matches_oracle(dtype, causal, monkeypatch):
    monkeypatch.setitem(aft_kernels.DEN_FLOOR, dtype != torch.float32, float("inf"))
    x = _inputs(dtype, T=20, D=16, H=1)
    assert _excess(x, dtype, causal) <= EXCESS_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_wide_bias_and_keys(dtype):
    # w, k ~ N(0, 8^2): some (t, d) have their best bias and best key far apart, some tiles fall back.
    x = _inputs(dtype, T=40, D=16, H=1, spread=8.0)
    assert _excess(x, dtype, causal=True, block_q=16, chunk_size=16) <= EXCESS_BOUND[dtype]


@pytest.mark.parametrize("dtype", sweep(list(DTYPES.values()), DTYPES.keys()))
@pytest.mark.parametrize(
    "block_q,chunk_size,spread,T,precision",
    # The anchored forward ("single"), spread 2: the second draw, whose keys replace those after each cut, has key 80
    # past KEY_WINDOW, so that the running forward takes the perturbed run's rows from 80 on (in every run: the
    # property suite's causality check meets fp16's default, the running forward, alone). The running forward
    # ("split", fp16's default): own tiles of 64 (the default), 16, 32 and 128 rows, each over several tiles and
    # several key blocks before the later ones; spread 30: some entries take the fallback.
    sweep([(None, 64, 2.0, 150, "single"), (None, 64, 1.0, 150, "auto"), (16, 16, 1.0, 75, "auto"),
           (32, 16, 30.0, 75, "auto"), (128, 32, 1.0, 300, "auto")],
          ["anchored-T150", "default-T150", "q16-k16", "q32-k16-wide", "q128-k32-T300"]),
)
def test_causal_outputs_ignore_the_future_bitwise(dtype, block_q, chunk_size, spread, T, precision):
    x = _inputs(dtype, T=T, D=16, H=1, spread=spread)
    other = _inputs(dtype, T=T, D=16, H=1, seed=1, spread=spread)
    run = kernel("aft", block_q=block_q, chunk_size=chunk_size, precision=precision)
    before = run(**x, causal=True)
    positions = torch.arange(T)
    for t in (t for t in (16, 40, 64, 73, 130, 147, 200, 290) if t < T - 1):
        future = positions > t
        perturbed = {
            "w": torch.where(future[:, None] | future[None, :], other["w"], x["w"]),
            "k": torch.where(future[None, :, None, None], other["k"], x["k"]),
            "v": torch.where(future[None, :, None, None], other["v"], x["v"]),
        }
        after = run(**perturbed, causal=True)
        assert torch.equal(before[:, : t + 1], after[:, : t + 1]), t
        assert not torch.equal(before, after)  # the perturbation reached the kernel


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("precision", ["single", "split"])
def test_precisions_fp16(precision, causal):
    x = _inputs(torch.float16, T=64, D=32)
    bound = 1.05 if precision == "split" else EXCESS_BOUND[torch.float16]
    assert _excess(x, torch.float16, causal, precision=precision) <= bound


@pytest.mark.parametrize("causal", sweep([True, False], ["causal", "noncausal"]))
@pytest.mark.parametrize("dtype,precision", sweep([(torch.float16, "single"), (torch.float16, "split"),
                                                   (torch.float32, "auto")], ["fp16-single", "fp16-split", "fp32"]))
def test_tma_matches_pointer_loads(dtype, precision, causal, monkeypatch):
    # T = 56 and D = 20 fit TMA's 16-byte rows (T % 8, 2 D % 8) without filling the last query tile, key block or
    # channel block: the descriptors' zero fill stands in for the pointer loads' masks.
    x = _inputs(dtype, T=56, D=20)
    taken = []
    monkeypatch.setattr(aft_kernels, "tma_fits", lambda *t: taken.append(tma_fits(*t)) or taken[-1])
    opts = dict(precision=precision, block_q=32, chunk_size=16, block_d=16)
    tma = kernel("aft", tma=True, **opts)(**x, causal=causal)
    assert taken == [True]
    pointers = kernel("aft", tma=False, **opts)(**x, causal=causal)
    assert torch.equal(tma, pointers)
    # Rows of A that TMA cannot take (T = 57): the pointer loads, at the same answer.
    y = _inputs(dtype, T=57, D=20)
    assert torch.equal(kernel("aft", tma=True, **opts)(**y, causal=causal),
                       kernel("aft", tma=False, **opts)(**y, causal=causal))
    assert taken == [True, False]


@settings(max_examples=5, deadline=None)
@given(
    T=st.integers(1, 80),
    D=st.integers(1, 40),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    block_q=st.sampled_from([16, 32, 64]),
    chunk_size=st.sampled_from([16, 32, 64]),
)
def test_random_shapes_fp16(T, D, causal, seed, block_q, chunk_size):
    assume(not causal or chunk_size <= block_q)  # causal: the key blocks end where a query tile starts
    x = _inputs(torch.float16, T=T, D=D, H=1, seed=seed)
    assert _excess(x, torch.float16, causal, block_q=block_q, chunk_size=chunk_size) <= EXCESS_BOUND[torch.float16]


@pytest.mark.parametrize(
    "opts,error",
    [
        ({"chunk_size": 24}, ValueError),
        ({"block_d": 512}, ValueError),
        ({"precision": "bf16"}, ValueError),
        ({"num_stages": 0}, ValueError),
        ({"block_k": 64}, TypeError),
        ({"chunk_size": 64, "block_q": 32}, ValueError),  # causal: key blocks longer than the query tile
        ({"chunk_size": 128}, ValueError),  # ... than the default one (64 queries)
    ],
)
def test_bad_options(opts, error):
    with pytest.raises(error):
        kernel("aft", **opts)(**_inputs(torch.float16, T=8, D=16), causal=True)


def test_causal_key_blocks_longer_than_the_query_tile_are_refused_before_any_launch(monkeypatch):
    """Causal, the main loop's key blocks must end where the tile's own keys start (chunk_size divides block_q):
    the host says so, naming both options, before it launches anything. Without causality any pair runs."""
    launched = []
    monkeypatch.setattr(aft_kernels, "launch_after_checks", lambda *args: launched.append(args))
    x = _inputs(torch.float16, T=40, D=16)
    run = kernel("aft", block_q=16, chunk_size=32)
    with pytest.raises(ValueError, match=r"chunk_size=32, block_q=16"):
        run(**x, causal=True)
    assert launched == []
    monkeypatch.undo()
    assert _excess(x, torch.float16, causal=False, block_q=16, chunk_size=32) <= EXCESS_BOUND[torch.float16]

# ------------------------------------------------------------------------------------------------ anchored forward


def _anchored_alone(monkeypatch):
    """Launch the forward without the running forward's pass over the anchored forward's listed tiles, so that the
    rows the anchored forward marks stay NaN."""
    monkeypatch.setattr(aft_kernels, "_aft_listed_kernel",
                        _NoLaunch(aft_kernels._aft_listed_kernel, lambda options: not options["REDO_OWN"]))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("key_shift", [0.0, 60.0, -60.0])
def test_the_anchored_forward_takes_ordinary_inputs_alone(causal, key_shift, monkeypatch):
    """The registry's inputs (keys shifted by +-60 too: the anchors move with them) pass every check of the anchored
    forward: with the running forward's pass left out no row is NaN, and the answer is within the bound. T = 150
    and D = 20: two query tiles of 128, the second partial, and a partial key block."""
    x = _inputs(torch.float16, T=150, D=20, key_shift=key_shift)
    _anchored_alone(monkeypatch)
    o = kernel("aft", precision="single")(**x, causal=causal)
    assert not bool(torch.isnan(o).any())
    assert _measure(o, x, torch.float16, causal).excess <= EXCESS_BOUND[torch.float16]


def _key_past_the_window(x):
    x["k"][:, 21] += 12.0  # past KEY_WINDOW above k_0 in every channel


def _value_overflows(x):
    x["v"][:, 21] = 60000.0  # E * v past fp16's range


def _first_value_huge(x):
    x["v"][:, 0] *= 1e4  # the value scale comes from key 0: the other keys' E * v would lose bits below 2^-14


def _bias_spread(x):
    x["w"][21, :5] = -25.0  # row 21's visible bias spreads past BIAS_WINDOW


# Each input, and the rows the anchored forward leaves to the running forward (causal).
FAILED_CHECKS = {"key_past_the_window": (_key_past_the_window, slice(21, None)), "value_overflows": (_value_overflows, slice(21, None)),
                 "first_value_huge": (_first_value_huge, slice(1, None)), "bias_spread": (_bias_spread, slice(21, 22))}


@pytest.mark.parametrize("failed", sweep(list(FAILED_CHECKS), list(FAILED_CHECKS)))
def test_the_anchored_forward_leaves_rows_past_a_failed_check_to_the_running_forward(failed, monkeypatch):
    """A key that fails a check marks its row and every later one (they meet it), a bias row that fails marks
    itself; the running forward takes exactly those rows, and the whole answer is within the bound. Without its
    pass the marked rows, and only they, are NaN."""
    make, rows = FAILED_CHECKS[failed]
    x = _inputs(torch.float16, T=40, D=16)
    make(x)
    assert _excess(x, torch.float16, causal=True, precision="single") <= EXCESS_BOUND[torch.float16]
    _anchored_alone(monkeypatch)
    o = kernel("aft", precision="single")(**x, causal=True)
    marked = torch.zeros(40, dtype=torch.bool)
    marked[rows] = True
    assert torch.equal(torch.isnan(o).any(-1).any(-1).any(0), marked)


@settings(max_examples=5, deadline=None)
@given(
    T=st.integers(1, 200),
    D=st.integers(1, 40),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    block_q=st.sampled_from([16, 32, 64, 128]),
    block_d=st.sampled_from([16, 32, 64]),
    raised=st.none() | st.floats(0.0, 1.0),
)
# The listing at both ends: one running tile of 128 rows per anchored tile, two channel blocks of 16 in its 32
# channels (D = 20); eight running tiles of 16 rows, one channel block.
@example(T=150, D=20, causal=True, seed=1, block_q=128, block_d=16, raised=0.5)
@example(T=200, D=40, causal=False, seed=2, block_q=16, block_d=64, raised=0.3)
def test_random_shapes_anchored_fp16(T, D, causal, seed, block_q, block_d, raised):
    """Shapes, the running forward's tiles (block_q, block_d: where the marked rows' tiles are listed) and, with
    ``raised``, a key past KEY_WINDOW at that fraction of the sequence (the rows from it on marked)."""
    x = _inputs(torch.float16, T=T, D=D, H=2, seed=seed)
    if raised is not None:
        x["k"][:, int(raised * (T - 1))] += 12.0
    opts = dict(precision="single", block_q=block_q, chunk_size=min(64, block_q), block_d=block_d)
    assert _excess(x, torch.float16, causal, **opts) <= SINGLE_FP16_BOUND


def test_without_causality_a_failed_key_marks_every_row(monkeypatch):
    x = _inputs(torch.float16, T=40, D=16)
    _key_past_the_window(x)
    assert _excess(x, torch.float16, causal=False, precision="single") <= EXCESS_BOUND[torch.float16]
    _anchored_alone(monkeypatch)
    assert bool(torch.isnan(kernel("aft", precision="single")(**x, causal=False)).all())



# ------------------------------------------------------------------------------------------------ backward


def _gradients(x, causal=True, do=None, seed=0, **opts):
    """The kernel's (dw, dk, dv) of <do, o> and the float64 oracle's, with do drawn in o's dtype unless given."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("w", "k", "v")}
    o = kernel("aft", **opts)(**leaves, causal=causal)
    if do is None:
        gen = torch.Generator().manual_seed(seed + 1)
        do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    got = torch.autograd.grad(o, list(leaves.values()), do)
    for g, leaf in zip(got, leaves.values()):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
    return dict(zip(leaves, got)), do.double()


def _gradient_excess(x, dtype, causal=True, seed=0, **opts):
    grads, do = _gradients(x, causal, seed=seed, **opts)
    f = attnlab.formulation("aft")
    call = {**x, "causal": causal}
    reference = oracle_gradients(f, call, do)
    floors = gradient_floor(f, call, do, None, base=reference)
    measured = measure_gradients(grads, reference, gradient_dtypes(f, call), floors)
    for name, m in measured.items():
        assert m.nonfinite == 0, (name, m.as_dict())
    return {name: m.excess for name, m in measured.items()}


def _assert_gradients_within(x, dtype, causal=True, bound=None, **opts):
    excess = _gradient_excess(x, dtype, causal, **opts)
    assert max(excess.values()) <= (bound or EXCESS_BOUND[dtype]), excess


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_backward_single_token(dtype, causal):
    x = _inputs(dtype, T=1, D=20, B=2)
    grads, do = _gradients(x, causal)
    # o = v: dv = do, and the weights' gradients vanish (one key, its weight 1 whatever w and k are).
    assert torch.equal(grads["v"], do.to(dtype))
    assert not grads["k"].any() and not grads["w"].any()


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_backward_partial_blocks(dtype, causal):
    # T = 45: a partial last block of queries and of keys, several of each, and diagonal tiles.
    x = _inputs(dtype, T=45, D=16)
    _assert_gradients_within(x, dtype, causal, block_q=32, chunk_size=16)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_odd_channels_over_several_blocks(dtype):
    x = _inputs(dtype, T=24, D=40, H=1)  # D = 40 over channel blocks of 16: the last one masked
    _assert_gradients_within(x, dtype, causal=True, block_q=16, chunk_size=16, block_d=16)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_non_power_of_two_dims(dtype):
    x = _inputs(dtype, T=37, D=20, H=1, B=2)
    _assert_gradients_within(x, dtype, causal=True, block_q=32, chunk_size=16)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize(
    "dtype,shift",
    [(torch.float16, 60.0), (torch.float16, -60.0), (torch.float32, 200.0)],
    ids=["fp16+60", "fp16-60", "fp32+200"],
)
def test_backward_shifted_keys(dtype, shift, causal):
    x = _inputs(dtype, T=40, D=16, H=1, key_shift=shift)
    _assert_gradients_within(x, dtype, causal)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_wide_bias_and_keys_take_the_exact_path(dtype):
    # w, k ~ N(0, 8^2): tiles whose factor exp(m_t + m_d - lse) passes 1 / DEN_FLOOR are summed per key.
    # One key dominates each weight, so v - o is small: o's rounding to fp16 would show (3.4) without the saved
    # residual. Off the registry's inputs fp32 is held to the gradient accuracy bound (48; measured 4.6 for dv).
    x = _inputs(dtype, T=40, D=16, H=1, spread=8.0)
    _assert_gradients_within(x, dtype, causal=True, bound=48.0 if dtype == torch.float32 else None,
                             block_q=16, chunk_size=16)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_mismatched_maxima(dtype):
    # The factorized terms underflow: only the exact path gets them. |lse| is 100 here: without lse's saved
    # rounding residual fp32 measured 29 (its rounding alone moves every weight by 50 u).
    x = _mismatched_maxima(dtype)
    _assert_gradients_within(x, dtype, causal=False)


class _PerTileLaunches:
    """Stands in for one of the per-tile backward kernels: records the flag each launch reads (1: that kernel
    computes every gradient), and launches the kernel itself unless ``stub`` (then no gradient is computed again)."""

    def __init__(self, kernel, stub: bool):
        self.kernel, self.stub, self.flags = kernel, stub, []

    def __getitem__(self, grid):
        def launch(flag, *args, **kwargs):
            self.flags.append(int(flag.item()))
            if not self.stub:
                self.kernel[grid](flag, *args, **kwargs)
        return launch


def _per_tile_launches(monkeypatch, stub: bool) -> list[_PerTileLaunches]:
    launches = []
    for name in ("_aft_bwd_dkdv_kernel", "_aft_bwd_dw_kernel"):
        launches.append(_PerTileLaunches(getattr(aft_kernels, name), stub))
        monkeypatch.setattr(aft_kernels, name, launches[-1])
    return launches


@pytest.mark.parametrize("causal, precision, key_shift", sweep(
    [(True, "split", 0.0), (False, "split", 0.0), (True, "single", 0.0), (True, "split", 60.0),
     (False, "single", -60.0)],
    ["causal", "noncausal", "causal-single", "causal-keys+60", "noncausal-single-keys-60"]))
def test_backward_ordinary_inputs_take_the_factorized_kernels_alone(causal, precision, key_shift, monkeypatch):
    # Nothing flagged: the per-tile kernels compute nothing (here they are stubbed out), and the factorized kernels'
    # gradients alone meet the bound (keys shifted by 60 too: their exponentials never form alone).
    launches = _per_tile_launches(monkeypatch, stub=True)
    x = _inputs(torch.float16, T=70, D=24, H=2, key_shift=key_shift)
    _assert_gradients_within(x, torch.float16, causal, bound=SINGLE_FP16_BOUND if precision == "single" else None,
                             precision=precision, block_q=32, chunk_size=16)
    assert [launch.flags for launch in launches] == [[0], [0]]


def _key_raised(x):
    x["k"][:, 25] += 30  # rows before it and after it, in one query tile, 30 nats apart: its channels' spread
    return x


def _head_raised(x):
    x["k"][:, :, 1] += 30  # one head's keys 30 nats above the other's: the spread of a key's row over the heads
    return x


@pytest.mark.parametrize("inputs", sweep([
    lambda: _key_raised(_inputs(torch.float16, T=40, D=16)),
    lambda: _head_raised(_inputs(torch.float16, T=40, D=16)),
    lambda: _mismatched_maxima(torch.float16),
    lambda: _inputs(torch.float16, T=40, D=16, H=1, spread=8.0),
], ["a-key-raised", "a-head-raised", "mismatched-maxima", "wide-bias-and-keys"]))
def test_backward_inputs_past_the_factorized_limits_take_the_per_tile_kernels(inputs, monkeypatch):
    launches = _per_tile_launches(monkeypatch, stub=False)
    _assert_gradients_within(inputs(), torch.float16, causal=True, block_q=16, chunk_size=16)
    assert [launch.flags for launch in launches] == [[1], [1]]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_backward_forced_exact_path_matches_oracle(dtype, causal, monkeypatch):
    # Every call flagged (no spread is under -inf), and every tile of the per-tile kernels summed per key.
    monkeypatch.setattr(aft_kernels, "SPREAD_LIMIT", -float("inf"))
    monkeypatch.setitem(aft_kernels.LOG_FACTOR_LIMIT, dtype != torch.float32, -float("inf"))
    x = _inputs(dtype, T=20, D=16, H=1)
    _assert_gradients_within(x, dtype, causal)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("precision", ["single", "split"])
def test_backward_precisions_fp16(precision, causal):
    x = _inputs(torch.float16, T=48, D=32)
    # "single" (bf16's setting: one fp16 rounding per operand) measured 2.2-2.4 on fp16 inputs, as the forward
    # would without the split; "auto" takes "split" for fp16.
    _assert_gradients_within(x, torch.float16, causal, bound=SINGLE_FP16_BOUND if precision == "single" else None,
                             precision=precision)


# Causal key blocks longer than the query tile (16, 64) only run without causality: the forward refuses them.
@pytest.mark.parametrize("block_q,chunk_size,causal", [(16, 64, False), (64, 16, True), (128, 128, True)])
def test_backward_block_shapes_fp16(block_q, chunk_size, causal):
    x = _inputs(torch.float16, T=70, D=16, H=1)
    _assert_gradients_within(x, torch.float16, causal=causal, block_q=block_q, chunk_size=chunk_size)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_zero_do_gives_exact_zeros(dtype):
    x = _inputs(dtype, T=33, D=16, H=1)
    grads, _ = _gradients(x, do=torch.zeros_like(x["v"]), block_q=16, chunk_size=16)
    assert all(not g.any() for g in grads.values())


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_backward_causality(dtype):
    T, c = 50, 21
    x = _inputs(dtype, T=T, D=16, H=1)
    gen = torch.Generator().manual_seed(3)
    do = torch.randn(x["v"].shape, generator=gen).to(dtype)
    do[:, c:] = 0
    grads, _ = _gradients(x, do=do, block_q=16, chunk_size=16)
    assert not grads["k"][:, c:].any() and not grads["v"][:, c:].any() and not grads["w"][c:].any()
    assert not grads["w"].triu(1).any()  # no key after its query gets a gradient


def test_backward_key_gradients_sum_to_zero():
    # Adding a constant to every key of a channel leaves o unchanged: sum_t dk_t = 0 per (b, h, d).
    x = _inputs(torch.float32, T=30, D=16)
    grads, _ = _gradients(x, block_q=16, chunk_size=16)
    dk = grads["k"].double()
    # fp32 rounding of the sum and of each dk_t, relative to sum_t |dk_t| (measured 2.1 u): 16 u, as rwkv4's test.
    assert dk.sum(1).abs().max() <= 16 * unit_roundoff(torch.float32) * dk.abs().sum(1).max()


def test_forward_without_saved_is_unchanged():
    x = _inputs(torch.float16, T=40, D=16)
    saved = {}
    o, _ = aft_kernels.chunkwise(**x, causal=True, saved=saved)
    assert torch.equal(o, aft_kernels.chunkwise(**x, causal=True)[0])
    assert saved["lse"].dtype == torch.float32 and saved["lse"].shape == x["v"].shape


@pytest.mark.slow
@settings(max_examples=3, deadline=None)
@given(
    T=st.integers(1, 50),
    D=st.integers(1, 40),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
    block_q=st.sampled_from([16, 32, 64]),
    chunk_size=st.sampled_from([16, 32, 64]),
)
def test_backward_random_shapes_fp16(T, D, causal, seed, block_q, chunk_size):
    assume(not causal or chunk_size <= block_q)  # the forward: causal key blocks end where a query tile starts
    x = _inputs(torch.float16, T=T, D=D, H=1, seed=seed)
    _assert_gradients_within(x, torch.float16, causal, seed=seed, block_q=block_q, chunk_size=chunk_size)


# ------------------------------------------------------------------------------------------------ sm_90 compile

SHARED_MEMORY_PER_BLOCK = 232448  # sm_90's opt-in maximum (227 KB)

COMPILE = textwrap.dedent("""
    import sys

    import triton
    from triton.backends.compiler import GPUTarget
    from attnlab.kernels import aft

    OPTIONS = {name: default for name, (default, _) in aft.OPTIONS["chunkwise"].items()}
    FP32 = ("anchor", "own_bias_max", "move", "block_ref", "block_peak", "block_unscale", "running_unscale", "lse",
            "lse_residual", "col_log", "row_log", "key_log", "key_max")

    def compile_one(kernel, inputs, constexprs, num_warps, num_stages, what):
        operands = "fp32" if inputs == "fp32" else "fp16"
        types = {"walk_ptr": "*i32", "redo_ptr": "*i32", "flag_ptr": "*i32", "gate_ptr": "*i32", "list_ptr": "*i32",
                 "first_bad_ptr": "*i32", "bias_spread_ptr": "*fp32", "a_ptr": "*fp16", "eev_ptr": "*fp16", "T": "i32", "H": "i32", "D": "i32",
                 "n_blocks": "i32", "n_bh": "i32", "n_heads": "i32", "width": "i32", "B": "i32", "den_floor": "fp32",
                 "spread_limit": "fp32", "log_factor_limit": "fp32"}
        types |= {f"{n}_ptr": "*fp32" for n in FP32}
        types |= {f"{n}_ptr": f"*{inputs}" for n in ("w", "k", "v", "o", "o_residual", "do", "dk", "dv", "dw")}
        types |= {f"{n}_{part}_ptr": f"*{operands}" for n in ("a", "eev", "cols", "g", "go", "ev", "e")
                  for part in ("hi", "lo")}
        signature = {n: types[n] for n in kernel.arg_names if n in types}
        constexprs = {n: value for n, value in constexprs.items() if n in kernel.arg_names}
        # What the JIT infers at the bench shape: 16-byte aligned pointers, T, H, D and n_blocks multiples of 16.
        attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
                 if (t.startswith("*") and n != "flag_ptr") or n in ("T", "H", "D", "n_blocks", "width")}
        try:
            source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=num_warps, num_stages=num_stages))
            print("compiled", what, "shared", compiled.metadata.shared, flush=True)
        except Exception as error:
            print("FAILED", what, type(error).__name__, str(error).strip().splitlines()[-1][:300], flush=True)

    # The launcher's choices at the bench's head size (D = 128) with the default options, in the arithmetic of the
    # inputs and causality given as the script's arguments.
    inputs, causal = sys.argv[1], sys.argv[2] == "causal"
    half = inputs != "fp32"
    constexprs = dict(
        CAUSAL=causal, SPLIT=inputs == "fp16", HALF_OPERANDS=half, DOT_PRECISION="tf32" if half else "ieee",
        OPERAND_SCALE=aft.OPERAND_MAX.value if half else 1.0, E_HEADROOM_LOG2=aft.OWN_HEADROOM_LOG2[half],
        EV_HEADROOM_LOG2=aft.OWN_EV_HEADROOM_LOG2[half], TMA=OPTIONS["tma"],
        STORE_LSE=True, STORE_LSE_RESIDUAL=not half, STORE_O_RESIDUAL=half,
        BLOCK_Q=aft.FORWARD_BLOCK_Q, BLOCK_K=OPTIONS["chunk_size"], BLOCK_D=OPTIONS["block_d"],
        BLOCK_KEYS=aft.BIAS_BLOCK_KEYS)
    what = f"{inputs} {'causal' if causal else 'noncausal'}"
    if sys.argv[3] == "backward":
        split = constexprs["SPLIT"]
        if half:
            rows = dict(constexprs, ROWS=aft.OPERAND_ROWS, BLOCK_D=128)
            compile_one(aft._visible_bias_kernel, inputs, constexprs, 4, 3, f"visible bias {what}")
            compile_one(aft._key_rows_kernel, inputs, rows, aft.FACTORIZED_NUM_WARPS, 3, f"key rows {what}")
            compile_one(aft._query_rows_kernel, inputs, rows, aft.FACTORIZED_NUM_WARPS, 3, f"query rows {what}")
            compile_one(aft._query_columns_kernel, inputs, dict(constexprs, BLOCK_Q=aft.BACKWARD_BLOCK_Q, BLOCK_D=128),
                        aft.FACTORIZED_NUM_WARPS, 3, f"query columns {what}")
            compile_one(aft._factorized_dkdv_kernel, inputs, dict(constexprs, BLOCK_Q=aft.BACKWARD_BLOCK_Q),
                        aft.FACTORIZED_NUM_WARPS, OPTIONS["num_stages"], f"factorized dk dv {what}")
            compile_one(aft._factorized_dw_kernel, inputs,
                        dict(constexprs, BLOCK_Q=aft.DW_BLOCK, BLOCK_K=aft.DW_BLOCK,
                             BLOCK_COLUMNS=aft.DW_BLOCK_COLUMNS[split]),
                        aft.DW_NUM_WARPS, OPTIONS["num_stages"], f"factorized dw {what}")
        per_tile = dict(constexprs, BLOCK_Q=aft.BACKWARD_BLOCK_Q, EXACT_DIAGONAL=causal and not half)
        compile_one(aft._aft_bwd_dkdv_kernel, inputs, per_tile, aft.BACKWARD_NUM_WARPS, OPTIONS["num_stages"],
                    f"per-tile dk dv {what}")
        compile_one(aft._aft_bwd_dw_kernel, inputs, dict(per_tile, BLOCK_D=32), aft.BACKWARD_NUM_WARPS,
                    OPTIONS["num_stages"], f"per-tile dw {what}")
        sys.exit()
    compile_one(aft._bias_factors_kernel, inputs, constexprs, 4, 3, f"bias factors {what}")
    compile_one(aft._key_block_stats_kernel, inputs, dict(constexprs, BLOCK_D=aft.KEY_FACTORS_BLOCK_D), 4, 3,
                f"key block statistics {what}")
    for scan_blocks in (aft.PREFIX_SCAN_BLOCKS, 1):  # 1: a sequence of one key block
        compile_one(aft._key_prefix_kernel, inputs,
                    dict(constexprs, BLOCK_D=aft.PREFIX_BLOCK_D, SCAN_BLOCKS=scan_blocks), 4, 3,
                    f"key prefix {what} scan {scan_blocks}")
    compile_one(aft._key_factors_kernel, inputs, dict(constexprs, BLOCK_D=aft.KEY_FACTORS_BLOCK_D), 4, 3,
                f"key factors {what}")
    compile_one(aft._aft_fwd_kernel, inputs, constexprs, aft.FORWARD_NUM_WARPS, OPTIONS["num_stages"],
                f"forward {what}")
    if half and causal:
        compile_one(aft._aft_listed_kernel, inputs,
                    dict(constexprs, E_HEADROOM_LOG2=aft.OWN_HEADROOM_LOG2[False],
                         EV_HEADROOM_LOG2=aft.OWN_EV_HEADROOM_LOG2[False], REDO_OWN=True),
                    aft.FORWARD_NUM_WARPS, OPTIONS["num_stages"], f"redo pass {what}")
    if half and not constexprs["SPLIT"]:
        compile_one(aft._aft_listed_kernel, inputs, dict(constexprs, REDO_OWN=False), aft.FORWARD_NUM_WARPS,
                    OPTIONS["num_stages"], f"listed tiles {what}")
        compile_one(aft._visible_bias_kernel, inputs, dict(constexprs, SPLIT=False), 4, 3, f"visible bias {what}")
        compile_one(aft._anchored_keys_kernel, inputs, dict(BLOCK_K=aft.ANCHORED_BLOCK_K, FULL_D=128), 4, 3,
                    f"anchored keys {what}")
        compile_one(aft._aft_anchored_fwd_kernel, inputs,
                    dict(constexprs, BLOCK_Q=aft.ANCHORED_BLOCK_Q, BLOCK_K=aft.ANCHORED_BLOCK_K,
                         BLOCK_D=aft.ANCHORED_BLOCK_D, FULL_D=128, LISTED_BLOCK_Q=aft.FORWARD_BLOCK_Q,
                         LISTED_BLOCK_D=OPTIONS["block_d"]),
                    aft.ANCHORED_NUM_WARPS, aft.ANCHORED_NUM_STAGES, f"anchored forward {what}")
    compile_one(aft._aft_fallback_kernel, inputs, constexprs, aft.FORWARD_NUM_WARPS, 3, f"fallback {what}")
""")


# bf16 causal, the training path, in every run; the other arithmetics in the slow tier (each compile takes seconds).
@pytest.mark.parametrize("inputs, causal", sweep([("bf16", "causal"), ("bf16", "noncausal"), ("fp16", "causal"),
                                                  ("fp32", "causal")], ["bf16-causal", "bf16-noncausal",
                                                                        "fp16-causal", "fp32-causal"]))
def test_the_forward_compiles_for_hopper_at_the_default_tiles(inputs, causal):
    lines = _compiled_for_hopper(inputs, causal, "forward")
    # The running forward's six kernels, the key prefix at two scan widths; the redo pass too where the own tile has
    # 16-bit operands (causal, 16-bit inputs); bf16 ("single" operands) also the anchored forward's three and the
    # running forward's pass over the tiles it lists.
    expected = 7 + (inputs != "fp32" and causal == "causal") + 4 * (inputs == "bf16")
    assert len(lines) == expected and all(line.startswith("compiled") for line in lines), "\n".join(lines)
    assert all(int(line.split()[-1]) <= SHARED_MEMORY_PER_BLOCK for line in lines), "\n".join(lines)


# fp16 first (in every run): "split" holds twice the operand tiles, the most shared memory.
@pytest.mark.parametrize("inputs", sweep(["fp16", "bf16", "fp32"]))
def test_the_backward_compiles_for_hopper_at_the_default_tiles(inputs):
    lines = _compiled_for_hopper(inputs, "causal", "backward")
    # The factorized kernels (six, 16-bit inputs only) and the per-tile ones (two).
    assert len(lines) == (8 if inputs != "fp32" else 2), "\n".join(lines)
    assert all(line.startswith("compiled") for line in lines), "\n".join(lines)
    assert all(int(line.split()[-1]) <= SHARED_MEMORY_PER_BLOCK for line in lines), "\n".join(lines)


def _compiled_for_hopper(inputs: str, causal: str, passes: str) -> list[str]:
    """COMPILE's lines for one arithmetic, causality and pass (forward or backward), in a process of its own."""
    done = subprocess.run([sys.executable, "-c", COMPILE, inputs, causal, passes], capture_output=True, text=True,
                          timeout=900, env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout.splitlines()


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_a_key_of_huge_e_v_and_no_weight_leaves_the_others_their_precision(causal):
    """Key 0 has |E v| far above every other key's but a bias of -30 for every row: no row gives it weight, yet a
    scale of E v taken from the running peak over all keys so far would push the later keys' operands into fp16's
    subnormals (session 19's review of this kernel: excess 6.5 against the bound 2). Each block's operands must be
    scaled for their own peak. Causal, rows 64..127 take their own tile's E v in the units of the running peak
    at block 0, which key 0 set: those operands fall below fp16's normal range, and the rows, which weigh them
    most, take the redo pass."""
    sample = attnlab.formulation("aft").sample(B=1, T=256, H=1, K=16, V=16, seed=5)
    x = {n: t.to(torch.float16) for n, t in sample.items()}
    x["k"][:, 0], x["v"][:, 0], x["w"][:, 0] = 11.5, 60000.0, -30.0
    assert _excess(x, torch.float16, causal=causal) <= EXCESS_BOUND[torch.float16]


@pytest.mark.parametrize("later", ["v_inf", "k_nan", "k_inf"])
def test_the_exact_fallback_is_causal_past_non_finite_keys(later):
    """Row 1 takes the exact fallback (its bias and keys peak at different keys: w = [0, -100], k = [-100, 0]); a
    non-finite v or k at key 2 must leave rows 0 and 1 bitwise as they were (the review's repro, session 19)."""
    x = _inputs(torch.float32, T=3, D=4, H=1)
    x["w"][1, :2] = torch.tensor([0.0, -100.0])
    x["k"][:, 0], x["k"][:, 1] = -100.0, 0.0
    before = kernel("aft")(**x, causal=True)
    name, value = {"v_inf": ("v", float("inf")), "k_nan": ("k", float("nan")), "k_inf": ("k", float("inf"))}[later]
    x[name] = x[name].clone()
    x[name][:, 2] = value
    after = kernel("aft")(**x, causal=True)
    assert torch.equal(before[:, :2], after[:, :2])


# Key 21 in a row's own tile: the first of 64 rows (the default tiles; its keys are relative to k_0) or the second of
# 16 (rows 16..31; relative to the largest of keys 0..15).
OWN_TILES = {"first-tile-of-64": ({}, 64), "second-tile-of-16": ({"block_q": 16, "chunk_size": 16}, 32)}


@pytest.mark.parametrize("tiles", OWN_TILES)
@pytest.mark.parametrize("dtype,rise,taken_by", [(torch.float16, 12.0, "redo"), (torch.float16, 30.0, "fallback"),
                                                 (torch.float32, 40.0, "fallback")],
                         ids=["fp16-past-fp16s-headroom", "fp16-past-fp32s-headroom", "fp32"])
def test_an_own_key_far_above_the_running_maximum_takes_an_exact_pass(dtype, rise, taken_by, tiles, monkeypatch):
    """Key 21 passes the largest key before its own tile (k_0 for the first) by more than the own tile's headroom:
    the rows of its tile from 21 on come out of a later pass, and match the oracle. With fp16 operands (2^8 = 5.5
    nats) the redo pass takes them, its own operands in fp32 (2^32 = 22 nats); past that too, or with fp32 inputs
    (no redo pass), the exact fallback. Without the passes that take them exactly those rows come out NaN."""
    opts, tile_end = OWN_TILES[tiles]
    x = _inputs(dtype, T=40, D=16, H=1)
    x["k"][:, 21] = x["k"][:, :16].amax(1) + rise
    assert _excess(x, dtype, causal=True, **opts) <= EXCESS_BOUND[dtype]
    _leave_out(monkeypatch, "fallback")
    if taken_by == "redo":
        assert _excess(x, dtype, causal=True, **opts) <= EXCESS_BOUND[dtype]
        _leave_out(monkeypatch, "redo")
    o = kernel("aft", **opts)(**x, causal=True)
    assert bool(torch.isnan(o[:, 21:tile_end]).all()) and not bool(torch.isnan(o[:, :21]).any())
    assert not bool(torch.isnan(o[:, tile_end:]).any())


def _leave_out(monkeypatch, step):
    """Launch the forward without one of its exact passes, so that the entries it would take stay NaN: "fallback"
    (_aft_fallback_kernel) or "redo" (_aft_listed_kernel's launch with REDO_OWN; its other launch, the running
    forward's pass over the anchored forward's listed tiles, still runs)."""
    name, left_out = {"fallback": ("_aft_fallback_kernel", lambda options: True),
                      "redo": ("_aft_listed_kernel", lambda options: options["REDO_OWN"])}[step]
    monkeypatch.setattr(aft_kernels, name, _NoLaunch(getattr(aft_kernels, name), left_out))


class _NoLaunch:
    """Stands in for an exact pass's kernel: the launches ``left_out`` picks (by their keyword arguments) launch
    nothing, so the entries they would take stay NaN; the others launch ``kernel``."""

    def __init__(self, kernel, left_out):
        self.kernel, self.left_out = kernel, left_out

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None if self.left_out(kwargs) else self.kernel[grid](*args, **kwargs)


@pytest.mark.parametrize("tiles", sweep(list(OWN_TILES), list(OWN_TILES)))
@pytest.mark.parametrize("dtype", sweep(list(DTYPES.values()), DTYPES.keys()))
@pytest.mark.parametrize("later", ["k_huge", "k_inf", "k_nan", "v_huge", "v_inf", "v_nan"])
def test_the_own_tile_is_causal_past_huge_or_non_finite_keys(dtype, later, tiles):
    """Key 21's row of its own tile's operands serves the tile's rows from 21 on, its 0 in A_own hides it from the
    tile's earlier rows. A huge or non-finite k or v there must leave rows 0..20 bitwise as they were (0 * inf
    would be NaN in the product)."""
    opts, _ = OWN_TILES[tiles]
    x = _inputs(dtype, T=40, D=16, H=1)
    before = kernel("aft", **opts)(**x, causal=True)
    name, value = {"k_huge": ("k", 60000.0), "k_inf": ("k", float("inf")), "k_nan": ("k", float("nan")),
                   "v_huge": ("v", 60000.0), "v_inf": ("v", float("inf")), "v_nan": ("v", float("nan"))}[later]
    x[name] = x[name].clone()
    x[name][:, 21] = value
    after = kernel("aft", **opts)(**x, causal=True)
    assert torch.equal(before[:, :21], after[:, :21])


@pytest.mark.parametrize("tiles,T", [({}, 100), ({"block_q": 16, "chunk_size": 16}, 48)],
                         ids=["second-tile-of-64", "second-tile-of-16"])
@pytest.mark.parametrize("precision", ["single", "split"])
def test_own_tile_operands_below_fp16s_normal_range_take_the_redo_pass(precision, tiles, T):
    """Key 1 has |E v| 60000 and no weight (bias -30), every other v is about 1e-3: block 0's E v scale is set by key
    1, and the rows of the second tile take their own tile's E v in it, 2^-4 lower still, where those operands are
    fp16 subnormals (about 2^-20). den is fine, so only the subnormal flag catches them (the redo pass then sums
    them with fp32 own operands): with "single" (bf16's setting) those rows measured excess 5.6 (tiles of 64) and
    10.3 (of 16) without it; "split" keeps them to 2^-36 by lo."""
    sample = attnlab.formulation("aft").sample(B=1, T=T, H=1, K=16, V=16, seed=5)
    x = {n: t.to(torch.float16) for n, t in sample.items()}
    x["v"] = x["v"] * 1e-3
    x["k"][:, 1], x["v"][:, 1], x["w"][:, 1] = 3.0, 60000.0, -30.0
    assert _excess(x, torch.float16, causal=True, precision=precision, anchored=False, **tiles) <= \
        EXCESS_BOUND[torch.float16]


@pytest.mark.parametrize("precision", ["single", "split"])
def test_an_own_e_v_past_fp16s_range_in_its_own_units_takes_the_redo_pass(precision, monkeypatch):
    """The own tile's E * v operands have a headroom of their own, 2^4 (OWN_EV_HEADROOM_LOG2), below E's 2^8: key 80
    (the second tile of 64 rows) passes the largest key before its tile by 2^4.5 in E (inside E's headroom), with
    a v that makes its E * v operand 2^16 in the units of block 0 (2^12 with E's headroom): past fp16's range, so
    rows 80..99 take the redo pass (fp32 own operands) and match the oracle, the fallback left out. Without the
    redo pass either, exactly those rows come out NaN; with E's headroom for E * v too (the module constant, read
    at each call: tools/gpu/configs.py sweeps it) none of the second tile's do."""
    x = _inputs(torch.float16, T=100, D=16, H=1)
    k, v = x["k"].double(), x["v"].double()
    block_max = k[:, :64].amax(1)  # C(0), the reference of the second tile's keys
    peak = ((k[:, :64] - block_max[:, None]).exp() * v[:, :64]).abs().amax(1)
    scale = 2.0 ** (14 - peak.log2().floor())  # S(0): block 0's peak of |E v| to [2^14, 2^15)
    e = 2.0**4.5
    x["k"][:, 80] = (block_max + math.log(e)).to(torch.float16)
    x["v"][:, 80] = (2.0**20 / (e * scale)).to(torch.float16)
    _leave_out(monkeypatch, "fallback")
    assert _excess(x, torch.float16, causal=True, precision=precision, anchored=False) <= EXCESS_BOUND[torch.float16]
    _leave_out(monkeypatch, "redo")
    o = kernel("aft", precision=precision, anchored=False)(**x, causal=True)
    assert bool(torch.isnan(o[:, 80:]).all()) and not bool(torch.isnan(o[:, :80]).any())
    monkeypatch.setitem(aft_kernels.OWN_EV_HEADROOM_LOG2, True, aft_kernels.OWN_HEADROOM_LOG2[True])
    o = kernel("aft", precision=precision, anchored=False)(**x, causal=True)
    assert not bool(torch.isnan(o[:, 64:]).any())
