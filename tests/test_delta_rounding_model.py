"""tools/delta_rounding_model.py, the float64 model of the delta rules' chunk dual with chosen intermediates rounded:
unrounded it is the gradient oracle's answer (to float64's rounding); rounded as attnlab's "fp16" path stores them
it stays at bf16's floor and rounded as fla stores them (bf16) it does not, as the GPU measured both; its command
line prints one row per variant and refuses a length off the chunk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from attnlab.gradients import oracle_gradients
from attnlab.metrics import rel_err

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import delta_rounding_model as model  # noqa: E402


@pytest.mark.parametrize("name", model.NAMES)
def test_the_unrounded_model_gives_the_oracles_gradients(name):
    x, do = model.inputs(name, T=128, K=16, seed=2)
    reference = oracle_gradients(name, x, do)
    grads = model.chunk_dual_gradients(x, do, {})
    assert set(grads) == set(reference)
    for gradient, exact in reference.items():
        assert rel_err(grads[gradient], exact) < 1e-12, gradient


def test_attnlabs_storage_holds_bf16s_floor_and_flas_does_not():
    x, do = model.inputs("deltanet", T=256, K=64, seed=0)
    variants = {n: model.VARIANTS[n] for n in ("attnlab's fp16 path (S, dS, Delta, dDelta, sums)",
                                               "everything in bf16 (fla's storage)")}
    ours, fla = model.excess_table("deltanet", x, do, variants).values()
    assert max(ours.values()) < 1.1, ours
    assert min(fla[g] for g in ("q", "k", "beta")) > 1.8, fla


def test_the_command_prints_every_variant_and_refuses_a_partial_chunk(capsys):
    model.main(["gated_deltanet", "64", "16", "--seed", "3"])
    rows = capsys.readouterr().out.splitlines()
    assert [row[:50].rstrip() for row in rows] == list(model.VARIANTS)
    assert all(row.split()[-10::2] == ["q", "k", "v", "g", "beta"] for row in rows), rows
    with pytest.raises(SystemExit):
        model.main(["deltanet", "100", "16"])
    assert "T must be a multiple of the chunk (64); got 100" in capsys.readouterr().err


def test_fp16_against_the_peak_keeps_eleven_bits_of_each_value_of_each_matrix():
    # Two matrices (chunks) with peaks 2^44 apart, each scaled by its own: against the first's peak the second's
    # values would be flushed to zero.
    x = torch.tensor([[[3.0e4, 1.0 + 2.0**-12, -(2.0**-10), 0.0]],
                      [[2.0**-30 * (1.0 + 2.0**-12), 2.0**-29, 0.0, 0.0]]], dtype=torch.float64)
    stored = model.fp16_against_peak(x)
    assert torch.all((stored - x).abs() <= 2.0**-11 * x.abs())
    assert stored[0, 0, 0] == x[0, 0, 0] and stored[1, 0, 1] == x[1, 0, 1]
    assert stored[1, 0, 0] == 2.0**-30  # 1 + 2^-12 rounds to 1 in fp16's 11 bits
