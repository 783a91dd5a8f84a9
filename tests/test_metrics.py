"""The error measures of DESIGN.md, on cases whose answers are known exactly."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab import metrics
from attnlab.metrics import (FAILED, HELD, IMPRECISE, conditioning_floor, grade, max_err, measure, nonfinite_count,
                             rel_err, rounding_floor, user_bound, user_bounds, verdict, worst_verdict)
from attnlab.registry import bounds_for


def test_rel_err_and_max_err_of_a_known_perturbation():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    o = torch.tensor([3.0, 4.5], dtype=torch.float64)
    assert rel_err(o, ref) == 0.5 / 5.0
    assert max_err(o, ref) == 0.5 / 4.0
    assert rel_err(ref, ref) == 0.0


def test_non_finite_outputs_are_counted_and_never_averaged_away():
    ref = torch.ones(4, dtype=torch.float64)
    o = torch.tensor([1.0, math.nan, math.inf, 1.0])
    assert nonfinite_count(o, ref) == 2
    assert rel_err(o, ref) == math.inf and max_err(o, ref) == math.inf
    m = measure(o, ref, torch.float16)
    assert m.excess == math.inf and m.nonfinite == 2


def test_rounding_floor_of_gaussian_outputs_matches_the_design_figures():
    ref = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert 1.5e-3 < rounding_floor(ref, torch.bfloat16) < 1.9e-3
    assert 1.9e-4 < rounding_floor(ref, torch.float16) < 2.3e-4


def test_rounding_once_has_excess_one():
    ref = torch.randn(4096, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    m = measure(ref.to(torch.bfloat16), ref, torch.bfloat16)
    assert m.excess == 1.0


def test_conditioning_floor_grows_with_rwkv_key_shift():
    """Shifted keys make the exponentials' arguments large: relative fp32 perturbations of k move the output more."""
    f = attnlab.formulation("rwkv4")
    x = f.sample(B=1, T=32, H=1, V=8)
    reference = attnlab.oracle("rwkv4", "chunkwise", chunk_size=8)
    base = conditioning_floor(reference, x)
    shifted = conditioning_floor(reference, {**x, "k": x["k"] + 200})
    assert 1e-9 < base < 1e-6
    assert shifted > 20 * base


def test_conditioning_floor_runs_its_trials_as_one_batched_call_with_the_same_value():
    """A recurrent oracle costs its token loop: the trials are stacked along B and the reference runs once (the
    base output, when given, is not recomputed); the floor is the one of running the trials one by one."""
    reference = attnlab.oracle("deltanet", "recurrent")
    x = attnlab.formulation("deltanet").sample(B=2, T=9, H=2, K=8, V=8, seed=3)
    base = reference(**x)
    batches = []

    def counting(**inputs):
        batches.append(inputs["q"].shape[0])
        return reference(**inputs)

    counting.formulation = reference.formulation
    batched = conditioning_floor(counting, x, base=base)
    assert batches == [3 * 2]
    sequential = conditioning_floor(lambda **inputs: reference(**inputs), x)  # no spec: the trials run one by one
    assert batched == sequential > 0


def test_verdicts_grade_an_excess_by_two_bounds():
    """held within the accuracy bound, imprecise up to the correctness bound, failed above it or non-finite."""
    assert [grade(e, 2.0, 8.0) for e in (1.0, 2.0, 2.5, 8.0, 8.5, math.inf, math.nan)] == \
        [HELD, HELD, IMPRECISE, IMPRECISE, FAILED, FAILED, FAILED]
    ref = torch.ones(4, dtype=torch.float64)
    assert verdict(measure(ref * (1 + 1e-3), ref, torch.float16), 2.0, 8.0) == FAILED  # excess ~ 2e-3 / 0
    assert verdict(measure(torch.tensor([1.0, math.nan, 1.0, 1.0]), ref, torch.float16), 2.0, 1e9) == FAILED
    assert worst_verdict([HELD, IMPRECISE, HELD]) == IMPRECISE and worst_verdict([]) == HELD


def test_a_user_bound_replaces_the_accuracy_bound_only_within_its_block():
    f = attnlab.formulation("gla")
    table = bounds_for(f, "float16")
    with user_bound(1.25):
        tight = user_bounds(table)
        with user_bound(100.0):  # above the correctness bound: that one is raised to it
            loose = user_bounds(table)
    assert (tight.accuracy, tight.correctness, tight.state) == (1.25, table.correctness, table.state)
    assert (loose.accuracy, loose.correctness) == (100.0, max(100.0, table.correctness))
    assert user_bounds(table) == table
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="positive number"):
            with user_bound(bad):
                pass


def test_norms_neither_underflow_nor_overflow() -> None:
    """An exact softmax gradient can be 1e-280 (a saturated row); torch's norm squares it to 0 in float64, which
    made every relative error against it infinite. The norm scales by the largest entry first."""
    tiny = torch.tensor([1e-280, -3e-281, 2e-282], dtype=torch.float64)
    assert torch.linalg.vector_norm(tiny).item() == 0.0  # what the scaling is for
    assert metrics.norm(tiny) == pytest.approx(1e-280 * math.sqrt(1 + 0.3**2 + 0.02**2), rel=1e-12)
    assert metrics.rel_err(tiny * (1 + 1e-3), tiny) == pytest.approx(1e-3, rel=1e-9)
    assert metrics.rounding_floor(tiny, torch.bfloat16) == 1.0  # bf16 flushes them to zero: all of it is lost
    huge = torch.tensor([1e200, 2e200], dtype=torch.float64)
    assert metrics.rel_err(huge * (1 + 1e-6), huge) == pytest.approx(1e-6, rel=1e-6)
    assert metrics.norm(torch.zeros(3, dtype=torch.float64)) == 0.0


def test_an_exact_value_past_the_dtypes_range_must_come_back_as_its_infinity():
    # 7e4 rounds to +inf in fp16: inf is the correctly rounded gradient, 65504 (saturation) and -inf are not.
    ref = torch.tensor([7e4, 1.0, 2.0], dtype=torch.float64)
    right = measure(torch.tensor([math.inf, 1.0, 2.0]), ref, torch.float16)
    assert right.nonfinite == 0 and right.overflowed == 1 and right.excess == 1.0
    for wrong in (65504.0, -math.inf, math.nan):
        m = measure(torch.tensor([wrong, 1.0, 2.0]), ref, torch.float16)
        assert m.nonfinite == 1 and verdict(m, 1.5, 48) == FAILED, wrong
    # The finite entries are still measured: an error there is scored against their own floor.
    off = measure(torch.tensor([math.inf, 1.0, 2.5]), ref, torch.float16)
    assert off.rel_err == pytest.approx(0.5 / math.sqrt(5.0))
    # Every entry past the range and returned as its infinity (retnet's dg over 62 undecayed fp16 steps, found by the
    # property suite's slow tier): nothing is left to measure, and that is exact, not an error of the harness.
    everything = measure(torch.tensor([math.inf, -math.inf]), torch.tensor([7e4, -9e4], dtype=torch.float64),
                         torch.float16)
    assert (everything.overflowed, everything.nonfinite, everything.max_err, everything.excess) == (2, 0, 0.0, 1.0)
    saturated = measure(torch.tensor([65504.0, -math.inf]), torch.tensor([7e4, -9e4], dtype=torch.float64),
                        torch.float16)
    assert saturated.nonfinite == 1 and verdict(saturated, 1.5, 48) == FAILED
    # In bf16 the same value is representable: no overflow, an ordinary rounding floor.
    assert measure(ref.to(torch.bfloat16), ref, torch.bfloat16).overflowed == 0
