"""``attnlab selftest``: every specimen caught by its expected property, no correct kernel flagged.

The first test is the selftest itself (what CI runs); the others show that
its verdict can fail: a specimen that is in fact correct escapes, and a
broken kernel posing as a correct one is flagged, both with exit code 1.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from attnlab.commands import selftest
from attnlab.properties import specimens
from attnlab.properties.targets import function_target


# Every specimen in both dtypes; of attnlab's kernels, gla (gates, both forms, a backward) and, in the slow tier,
# rwkv4 (a log-scale state) and fp32 too. properties/test_kernel_properties.py holds every kernel to the same suite,
# so the rest would run it twice; under the interpreter a kernel's suite takes tens of seconds a dtype.
@pytest.mark.parametrize("kernels, kernel_dtypes", [
    pytest.param(["gla"], [torch.float16], id="gla-fp16"),
    pytest.param(["gla", "rwkv4"], [torch.float16, torch.float32], id="gla-rwkv4-fp16-fp32", marks=pytest.mark.slow),
])
def test_selftest_catches_every_specimen_and_flags_no_correct_kernel(kernels, kernel_dtypes) -> None:
    jobs = os.cpu_count() or 1
    rows = (selftest.run_selftest(include="specimens", jobs=jobs, progress=False)
            + selftest.run_selftest(include="kernels", names=kernels, dtypes=kernel_dtypes, jobs=jobs, progress=False))
    table = selftest.table(rows)
    print(table)
    kinds = {row.job.kind for row in rows}
    assert kinds == {"specimen", "kernel"}
    assert {row.job.name for row in rows if row.job.kind == "specimen"} == {
        s.name for s in specimens.SPECIMENS if s.broken_pass in selftest.suite_passes()}
    assert {row.job.dtype for row in rows if row.job.kind == "kernel"} == set(kernel_dtypes)
    failures = [f"{row.label} {row.job.dtype}: " + "; ".join(f.message.splitlines()[0] for f in row.caught_by + row.errors)
                for row in rows if not row.passed]
    assert not failures, table + "\n\n" + "\n".join(failures)
    assert "float16 gradients: smallest defect" in table  # the backward specimens' excess, below the forward's lines


def _command(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    selftest.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["selftest", "--jobs", "1", "--no-progress", "--dtypes", "float32", *argv])
    return args.func(args)


def test_a_specimen_that_is_not_broken_escapes(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def correct_softmax(*, q, k, v, scale=None, causal=True):
        return specimens.softmax_default_scale_one(q=q, k=k, v=v, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                                                   causal=causal)

    not_broken = specimens.Specimen("softmax_correct", "softmax", correct_softmax, "none", "matches_oracle")
    monkeypatch.setattr(specimens, "SPECIMENS", (not_broken,))
    assert _command("--only", "specimens", "--examples", "3") == 1
    out = capsys.readouterr().out
    assert "softmax_correct" in out and "ESCAPED" in out


def test_a_broken_kernel_among_the_correct_ones_is_flagged(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    def broken_kernel(job: selftest.Job):
        return function_target(specimens.gla_decay_off_by_one, "gla", "attnlab:gla/broken"), None

    monkeypatch.setattr(selftest, "_target", broken_kernel)
    monkeypatch.setattr(selftest, "_jobs", lambda dtypes, include, names: [selftest.Job("kernel", "gla/broken", torch.float32)])
    assert _command("--examples", "2") == 1
    out = capsys.readouterr().out
    assert "FLAGGED" in out and "property matches_oracle FAILED for attnlab:gla/broken" in out


def test_imprecise_is_neither_a_catch_nor_a_pass(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """Graded verdicts: a correct kernel made imprecise (a user bound of half a rounding: excess 1 > 0.5) is
    flagged, and a specimen whose expected property finds it only imprecise has escaped (a defect must read as
    failed)."""
    from attnlab.metrics import user_bound
    from attnlab.properties.targets import rounded_oracle_target

    def ideal(job: selftest.Job):
        target = rounded_oracle_target("retnet")
        if job.kind == "kernel":
            return function_target(target.function, "retnet", "attnlab:retnet/ideal"), None
        specimen = specimens.Specimen("retnet_ideal", "retnet", target.function, "none", "matches_oracle")
        return function_target(target.function, "retnet", "specimen:retnet_ideal"), specimen

    monkeypatch.setattr(selftest, "_target", ideal)
    monkeypatch.setattr(selftest, "_jobs", lambda dtypes, include, names: [
        selftest.Job("specimen", "retnet_ideal", torch.float16), selftest.Job("kernel", "retnet/ideal", torch.float16)])
    with user_bound(0.5):
        assert _command("--examples", "2") == 1
    out = capsys.readouterr().out
    assert "ESCAPED" in out and "FLAGGED" in out and "matches_oracle IMPRECISE" in out
    assert "property matches_oracle IMPRECISE for attnlab:retnet/ideal" in out


def test_a_backward_specimen_whose_gradient_is_right_escapes(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    """A backward specimen is caught only by its expected gradient property failing: the ideal kernel (the float64
    oracle rounded once, differentiable by autograd) registered as one escapes, its forward and backward held."""
    from attnlab.properties.targets import rounded_oracle_target

    ideal = specimens.Specimen("retnet_gradient_right", "retnet", rounded_oracle_target("retnet").function, "none",
                               "backward_matches_oracle[dq]", specimens.BACKWARD)
    monkeypatch.setattr(specimens, "SPECIMENS", (ideal,))
    assert _command("--only", "specimens", "--examples", "2") == 1
    out = capsys.readouterr().out
    assert "retnet_gradient_right" in out and "backward" in out and "ESCAPED" in out
    row = selftest.run_job(selftest.Job("specimen", "retnet_gradient_right", torch.float32), 2, "cpu")
    held = {f.property for f in row.findings if f.status == "held"}
    assert {"matches_oracle", "backward_matches_oracle[dq]", "backward_causality[dv]"} <= held
