"""The oracles: forms agree, float64 agrees with mpmath, state resumes, special cases reduce.

Every figure here is an identity of exact arithmetic checked in float64
(relative 1e-12, about 5000 ulps of accumulated float64 rounding at these
sizes) or in mpmath (10 digits short of the working precision).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

import attnlab
from attnlab.metrics import rel_err
from attnlab.properties import traits

NAMES = attnlab.names()
STATEFUL = [f.name for f in attnlab.REGISTRY if f.state is not None]
# Outputs that are convex combinations of the values under the default options, with each causal setting.
CONVEX = [(f.name, causal) for f in attnlab.REGISTRY if f.is_convex({})
          for causal in ((True, False) if "causal" in f.option_names else (True,))]
SHIFT_INVARIANT = [f.name for f in attnlab.REGISTRY if f.shift_invariant]
WITH_OPTIONAL = [f.name for f in attnlab.REGISTRY if any(a.optional for a in f.args)]
FLOAT64_TOL = 1e-12


def sample(name, T=23, seed=0, **sizes):
    sizes = {"B": 2, "H": 2, "K": 6, "V": 5, **sizes}
    return attnlab.formulation(name).sample(T=T, seed=seed, **sizes)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("chunk_size", [1, 5, 8, 64])
def test_forms_agree_float64(name, chunk_size):
    x = sample(name)
    reference = attnlab.oracle(name, "recurrent")(**x)
    assert rel_err(attnlab.oracle(name, "parallel")(**x), reference) <= FLOAT64_TOL
    assert rel_err(attnlab.oracle(name, "chunkwise", chunk_size=chunk_size)(**x), reference) <= FLOAT64_TOL


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("form", attnlab.FORMS)
def test_final_states_agree_float64(name, form):
    x = sample(name)
    opts = {"chunk_size": 7} if form == "chunkwise" else {}
    _, reference = attnlab.oracle(name, "recurrent")(**x, return_state=True)
    _, state = attnlab.oracle(name, form, **opts)(**x, return_state=True)
    assert rel_err(_comparable_state(name, state), _comparable_state(name, reference)) <= FLOAT64_TOL


def _comparable_state(name, state):
    """A state with a log-scale part (RWKV-4's (a, b, p)) is unique only up to it: compare e^p a and e^p b."""
    spec = attnlab.formulation(name).state
    parts = spec.split(state)
    logs = [p for i, p in enumerate(parts) if spec.is_log_scale(i)]
    if not logs:
        return state
    return tuple(torch.exp(logs[0]) * p for i, p in enumerate(parts) if not spec.is_log_scale(i))


@pytest.mark.parametrize("name", NAMES)
def test_float64_agrees_with_mpmath(name):
    x = sample(name, T=12, B=1, K=4, V=3)
    for form in attnlab.FORMS:
        opts = {"chunk_size": 5} if form == "chunkwise" else {}
        exact = attnlab.oracle(name, form, "mpmath", dps=40, **opts)(**x)
        assert rel_err(attnlab.oracle(name, form, **opts)(**x), exact) <= FLOAT64_TOL


def _mp_rel_diff(a, b) -> mpmath.mpf:
    a, b = np.asarray(a, dtype=object).ravel(), np.asarray(b, dtype=object).ravel()
    return mpmath.sqrt(mpmath.fsum((a - b) ** 2)) / mpmath.sqrt(mpmath.fsum(b**2))


@pytest.mark.parametrize("name", NAMES)
def test_mpmath_forms_agree_beyond_float64(name):
    dps = 40
    x = sample(name, T=10, B=1, H=1, K=3, V=3)
    with mpmath.workdps(dps):
        reference, _ = attnlab.oracle(name, "recurrent", "mpmath", dps=dps).unrounded(**x)
        for form, opts in (("parallel", {}), ("chunkwise", {"chunk_size": 4})):
            o, _ = attnlab.oracle(name, form, "mpmath", dps=dps, **opts).unrounded(**x)
            assert _mp_rel_diff(o, reference) <= mpmath.mpf(10) ** -(dps - 10)


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("form", attnlab.FORMS)
def test_split_and_resume_equals_whole(name, form):
    x = sample(name, T=30)
    f = attnlab.formulation(name)
    run = attnlab.oracle(name, form, **({"chunk_size": 8} if form == "chunkwise" else {}))
    whole, whole_state = run(**x, return_state=True)
    cut = 13
    head = {n: _time_slice(f, n, t, 0, cut) for n, t in x.items()}
    tail = {n: _time_slice(f, n, t, cut, 30) for n, t in x.items()}
    o1, state = run(**head, return_state=True)
    o2, final = run(**tail, initial_state=state, return_state=True)
    assert rel_err(torch.cat([o1, o2], dim=1), whole) <= FLOAT64_TOL
    assert rel_err(_comparable_state(name, final), _comparable_state(name, whole_state)) <= FLOAT64_TOL


def _time_slice(f, name, t, start, stop):
    return t[:, start:stop] if "T" in f.arg(name).dims else t


# ----------------------------------------------------------------------------- special cases


def _all_forms(name, x):
    return [attnlab.oracle(name, form, **({"chunk_size": 4} if form == "chunkwise" else {}))(**x) for form in attnlab.FORMS]


def _assert_reduces(special_name, special_inputs, general_name, general_inputs):
    for o_special, o_general in zip(_all_forms(special_name, special_inputs), _all_forms(general_name, general_inputs)):
        assert rel_err(o_general, o_special) <= FLOAT64_TOL


@pytest.mark.parametrize("reduction", traits.reductions(), ids=lambda r: r.label)
def test_general_formulation_on_reducing_inputs_is_the_special_case(reduction):
    """Each special case the registry declares (Formulation.reductions), in every form, with a scale of its own."""
    special = attnlab.formulation(reduction.special)
    x = {**sample(special.name), **dict(reduction.special_options)}
    if "scale" in special.option_names:
        x["scale"] = 0.3
    _assert_reduces(special.name, x, reduction.general, reduction.to_general(x))


@pytest.mark.parametrize("name", WITH_OPTIONAL)
def test_an_optional_argument_left_out_is_zero(name):
    f = attnlab.formulation(name)
    x = sample(name)
    zeros = {**x, **{a.name: torch.zeros_like(x[a.name]) for a in f.args if a.optional}}
    without = {n: t for n, t in x.items() if not f.arg(n).optional}
    _assert_reduces(name, zeros, name, without)


# ----------------------------------------------------------------------------- convexity and shift invariance (RWKV-4, AFT)


def _running_range(v, causal=True):
    """Per position t: min and max of v over the positions it averages (i <= t)."""
    if not causal:
        return v.amin(dim=1, keepdim=True).expand_as(v), v.amax(dim=1, keepdim=True).expand_as(v)
    return torch.cummin(v, dim=1).values, torch.cummax(v, dim=1).values


@pytest.mark.parametrize("name,causal", CONVEX)
@pytest.mark.parametrize("form", attnlab.FORMS)
def test_outputs_are_convex_combinations_of_values(name, causal, form):
    x = sample(name, T=40)
    extra = {"causal": causal} if "causal" in attnlab.formulation(name).option_names else {}
    o = attnlab.oracle(name, form, **({"chunk_size": 16} if form == "chunkwise" else {}))(**x, **extra)
    low, high = _running_range(x["v"], causal)
    slack = 1e-14 * x["v"].abs().max()
    assert bool((o >= low - slack).all()) and bool((o <= high + slack).all())


@pytest.mark.parametrize("name", SHIFT_INVARIANT)
@pytest.mark.parametrize("form", attnlab.FORMS)
@pytest.mark.parametrize("shift", [-300.0, 30.0, 650.0])
def test_adding_a_constant_to_every_key_changes_nothing(name, form, shift):
    x = sample(name, T=40)
    shifted = {**x, **{n: x[n] + shift for n in attnlab.formulation(name).shift_invariant}}
    run = attnlab.oracle(name, form, **({"chunk_size": 16} if form == "chunkwise" else {}))
    assert rel_err(run(**shifted), run(**x)) <= FLOAT64_TOL


def test_naive_rwkv4_overflows_in_float64_where_the_stable_form_does_not():
    x = sample("rwkv4", T=16)
    shifted = {**x, "k": x["k"] + 720.0}  # exp(k) > 1.8e308 for k > 709.78
    naive = attnlab.oracle("rwkv4", "recurrent", stable=False)
    stable = attnlab.oracle("rwkv4", "recurrent")
    assert rel_err(naive(**x), stable(**x)) <= FLOAT64_TOL
    assert not bool(torch.isfinite(naive(**shifted)).all())
    assert rel_err(stable(**shifted), stable(**x)) <= FLOAT64_TOL


def test_naive_rwkv4_in_mpmath_never_overflows():
    x = sample("rwkv4", T=8, B=1, H=1, V=2)
    shifted = {**x, "k": x["k"] + 5000.0}
    naive = attnlab.oracle("rwkv4", "recurrent", "mpmath", stable=False)(**shifted)
    assert rel_err(naive, attnlab.oracle("rwkv4", "recurrent")(**x)) <= FLOAT64_TOL


# ----------------------------------------------------------------------------- hand-worked examples


def _scalars(**values):
    """Each keyword a list over T=2 positions, as a [1, 2, 1, 1] (or [1, 2, 1]) float64 tensor."""
    return {n: torch.tensor(v, dtype=torch.float64) for n, v in values.items()}


q1, q2, k1, k2, v1, v2 = 0.7, -1.3, 0.4, 1.1, 2.0, -0.5
b1, b2, g1, g2, s = 0.6, 1.5, -0.2, -0.9, 0.5


def _hand_worked():
    """One example per formulation: (name, inputs over T = 2, options, the expected output), a row each."""
    e = math.exp
    elu1 = lambda x: x + 1 if x > 0 else e(x)  # noqa: E731
    qkv = {"q": [q1, q2], "k": [k1, k2], "v": [v1, v2]}
    S1_delta = b1 * k1 * v1
    return [
        ("softmax", qkv, {"scale": s}, [v1, (e(s * q2 * k1) * v1 + e(s * q2 * k2) * v2) / (e(s * q2 * k1) + e(s * q2 * k2))]),
        ("linear_attn", qkv, {}, [v1, (elu1(k1) * v1 + elu1(k2) * v2) / (elu1(k1) + elu1(k2))]),
        ("retnet", {**qkv, "g": "head"}, {"scale": s}, [s * q1 * k1 * v1, s * q2 * (e(g1) * k1 * v1 + k2 * v2)]),
        ("gla", {**qkv, "g": [g1, g2]}, {"scale": s}, [s * q1 * k1 * v1, s * q2 * (e(g2) * k1 * v1 + k2 * v2)]),
        (
            "general",
            {**qkv, "gk": [g1, g2], "gv": [g2, g1]},
            {"scale": s},
            [s * q1 * k1 * v1, s * q2 * (e(g2) * e(g1) * k1 * v1 + k2 * v2)],
        ),
        (
            "aft",
            {"w": [[0.3, 0.0], [-0.8, 0.25]], "k": [k1, k2], "v": [v1, v2]},
            {},
            [v1, (e(-0.8 + k1) * v1 + e(0.25 + k2) * v2) / (e(-0.8 + k1) + e(0.25 + k2))],
        ),
        (
            "rwkv4",
            {"w": [0.7], "u": [0.3], "k": [k1, k2], "v": [v1, v2]},
            {},
            [v1, (e(k1) * v1 + e(0.3 + k2) * v2) / (e(k1) + e(0.3 + k2))],
        ),
        (
            "deltanet",
            {**qkv, "beta": [b1, b2]},
            {"scale": s},
            [s * q1 * S1_delta, s * q2 * ((1 - b2 * k2 * k2) * S1_delta + b2 * k2 * v2)],
        ),
        (
            "gated_deltanet",
            {**qkv, "g": [g1, g2], "beta": [b1, b2]},
            {"scale": s},
            [s * q1 * S1_delta, s * q2 * (e(g2) * (1 - b2 * k2 * k2) * S1_delta + b2 * k2 * v2)],
        ),
        (
            "kda",
            {**qkv, "g": [g1, g2], "beta": [b1, b2]},
            {"scale": s},
            [s * q1 * S1_delta, s * q2 * ((1 - b2 * k2 * k2) * e(g2) * S1_delta + b2 * k2 * v2)],
        ),
    ]


HAND_WORKED = _hand_worked()


def test_every_formulation_has_a_hand_worked_example():
    assert [row[0] for row in HAND_WORKED] == NAMES


@pytest.mark.parametrize("name,values,options,expected", HAND_WORKED, ids=[row[0] for row in HAND_WORKED])
def test_recurrent_form_matches_a_hand_worked_example(name, values, options, expected):
    """T = 2 and every head dimension 1: the recurrence unrolled by hand."""
    f = attnlab.formulation(name)
    x = {}
    for arg in f.args:
        if arg.name not in values:
            continue
        if values[arg.name] == "head":
            x[arg.name] = torch.tensor([g1], dtype=torch.float64)
            continue
        data = torch.tensor(values[arg.name], dtype=torch.float64)
        shape = [1 if d in "BHKVDC" else data.shape[0] for d in arg.dims] if arg.dims != ("T", "T") else [2, 2]
        x[arg.name] = data.reshape(shape)
    for precision in ("float64", "mpmath"):
        o = attnlab.oracle(name, "recurrent", precision)(**x, **options)
        assert o.flatten().tolist() == pytest.approx(expected, rel=1e-14, abs=1e-15)


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_float64_oracle_on_cuda_matches_cpu(name):
    x = sample(name, T=100)
    run = attnlab.oracle(name, "chunkwise", chunk_size=16)
    on_gpu = run(**{n: t.cuda() for n, t in x.items()})
    assert on_gpu.device.type == "cuda"
    assert rel_err(on_gpu.cpu(), run(**x)) <= FLOAT64_TOL
