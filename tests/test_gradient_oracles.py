"""The gradient oracle (attnlab.gradients) and the gradient error measure (attnlab.metrics).

Every formulation of the registry, every form (and form-only option, such as RWKV-4's naive loop): float64
autograd through the oracle gives the same gradients in each form (relative 1e-12, as the forward forms agree),
passes torch's finite-difference gradcheck, and agrees with an mpmath directional derivative of the exact
function (relative 1e-10); measured at these sizes: forms within 1.3e-15, mpmath within 6e-16. The measure: a
gradient rounded once has excess <= 1, one 1% off shows it. Validation raises the same errors on inputs that
require grad.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.gradients import (differentiable_names, directional_derivative_mpmath, gradient_dtypes, gradient_floor,
                               inner, log_scale_cotangent, oracle_gradients)
from attnlab.metrics import UNIT_ROUNDOFF, gradient_conditioning_floor, measure_gradients, rel_err
from attnlab.oracles._backend import Float64
from attnlab.validation import validate

ENTRIES = list(attnlab.REGISTRY)
IDS = [f.name for f in ENTRIES]
FORMS_TOL = 1e-12
MPMATH_TOL = 1e-10
SIZES = {"B": 2, "T": 7, "H": 2, "K": 3, "V": 2}
CHUNK = 3  # chunks of 3, 3 and 1 at T = 7: a boundary crossed and a partial chunk


def _cast(value, dtype):
    """A tensor or a tuple of them (a multi-part state) in ``dtype``; anything else as it is."""
    if isinstance(value, tuple):
        return tuple(_cast(p, dtype) for p in value)
    return value.to(dtype) if isinstance(value, torch.Tensor) else value


def _tuple(value):
    return value if isinstance(value, tuple) else (value,)


def _requiring_grad(value):
    if isinstance(value, tuple):
        return tuple(_requiring_grad(p) for p in value)
    return value.clone().requires_grad_() if isinstance(value, torch.Tensor) and value.dtype.is_floating_point else value


def _random_like(value, generator):
    if isinstance(value, tuple):
        return tuple(_random_like(part, generator) for part in value)
    return torch.randn(value.shape, generator=generator, dtype=torch.float64)


def _outputs(f, x, form="recurrent", **opts):
    """(o, final state or None) of the float64 oracle."""
    if f.state is None:
        return attnlab.oracle(f, form, **opts)(**x), None
    return attnlab.oracle(f, form, **opts)(**x, return_state=True)


def case(f, seed=0, **sizes):
    """Inputs (with a reachable, random initial state where there is a state), a random ``do`` and random
    cotangents of the final state's scale-free parts (see log_scale_cotangent)."""
    sizes = {**SIZES, **sizes}
    x = f.sample(seed=seed, **sizes)
    generator = torch.Generator().manual_seed(seed)
    if f.state is not None:
        # The final state of another sequence: inside every part's range, RWKV-4's log scale p finite.
        _, x["initial_state"] = _outputs(f, f.sample(seed=seed + 100, **sizes))
    o, final = _outputs(f, x)
    do = _random_like(o, generator)
    d_scaled = None
    if final is not None:
        parts = f.state.split(final)
        d_scaled = f.state.join(tuple(_random_like(p, generator) for i, p in enumerate(parts) if not f.state.is_log_scale(i)))
    return x, do, d_scaled


def variants(f):
    """Every (form, oracle options) of ``f``: the three forms and each value of their form-only options."""
    for form in attnlab.FORMS:
        choices = [{"chunk_size": CHUNK} if form == "chunkwise" else {}]
        for option in f.form_options.get(form, ()):
            values = option.choices or ((True, False) if option.kind is bool else (option.default,))
            choices = [{**c, option.name: value} for c in choices for value in values]
        for opts in choices:
            yield form, opts


def gradients_of(f, x, do, d_scaled, form="recurrent", **opts):
    """oracle_gradients, the final-state cotangent taken on the scale-free parts (the same function whatever
    representation of a log-scale state the form returns)."""
    d_final = None
    if d_scaled is not None:
        _, final = _outputs(f, x, form, **opts)
        d_final = log_scale_cotangent(f, final, d_scaled)
    chunk_size = opts.pop("chunk_size", 64)
    return oracle_gradients(f, x, do, d_final, form=form, chunk_size=chunk_size, **opts)


def _moved_inward(f, x, margin=1e-3):
    """Ranged arguments kept ``margin`` inside their range, so finite differences stay valid inputs."""
    out = dict(x)
    for arg in f.args:
        if x.get(arg.name) is not None and (arg.low is not None or arg.high is not None):
            low = None if arg.low is None else arg.low + margin
            high = None if arg.high is None else arg.high - margin
            out[arg.name] = x[arg.name].clamp(min=low, max=high)
    return out


# ----------------------------------------------------------------------------- the oracle's gradients


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_every_differentiable_input_gets_a_float64_gradient(f):
    x, do, d_scaled = case(f)
    grads = gradients_of(f, x, do, d_scaled)
    expected = [a.name for a in f.args if a.differentiable] + (["initial_state"] if f.state is not None else [])
    assert list(grads) == differentiable_names(f, x) == expected
    for name, g in grads.items():
        for part, given in zip(_tuple(g), _tuple(x[name])):
            assert part.dtype == torch.float64 and part.shape == given.shape
            assert bool(torch.isfinite(part).all()) and bool(part.ne(0).any())


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_forms_agree_on_every_gradient(f):
    x, do, d_scaled = case(f, seed=1)
    reference = gradients_of(f, x, do, d_scaled)
    for form, opts in variants(f):
        grads = gradients_of(f, x, do, d_scaled, form, **opts)
        for name, g in grads.items():
            assert rel_err(g, reference[name]) <= FORMS_TOL, (form, opts, name)


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_gradients_taken_a_few_heads_at_a_time_are_the_whole_ones(f):
    """Three heads, one or two per autograd call: head-indexed gradients side by side, shared ones (aft's position
    bias) summed, the initial state's and the final-state cotangent split by head too. A formulation without a
    head dimension in its output (RWKV-4's channels) is differentiated whole."""
    x, do, d_scaled = case(f, seed=2, H=3)
    d_final = None
    if d_scaled is not None:
        d_final = log_scale_cotangent(f, _outputs(f, x, "chunkwise", chunk_size=CHUNK)[1], d_scaled)
    whole = oracle_gradients(f, x, do, d_final, chunk_size=CHUNK)
    shared = {a.name for a in f.args if "H" not in a.dims}
    for heads in (1, 2):
        split = oracle_gradients(f, x, do, d_final, chunk_size=CHUNK, heads_per_call=heads)
        assert list(split) == list(whole)
        for name, g in split.items():
            if name in shared:  # the groups' sums, in another order: at most 2 roundings per group added (1.4 u seen)
                assert rel_err(g, whole[name]) <= 2 * 3 * UNIT_ROUNDOFF[torch.float64], (heads, name)
            else:  # each head's own arithmetic, unchanged
                assert all(torch.equal(a, b) for a, b in zip(_tuple(g), _tuple(whole[name]))), (heads, name)


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_the_forward_pass_is_the_same_with_and_without_grad(f):
    x, _, _ = case(f, seed=2)
    for form, opts in variants(f):
        plain = _outputs(f, x, form, **opts)
        tracked = {n: _requiring_grad(v) for n, v in x.items()}
        o, final = _outputs(f, tracked, form, **opts)
        assert o.requires_grad and torch.equal(o, plain[0])
        if final is not None:
            assert all(torch.equal(part, same) for part, same in zip(_tuple(final), _tuple(plain[1])))


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_gradcheck(f):
    """torch's finite differences against autograd, every form, on a tiny case (o and every final-state part)."""
    x, _, _ = case(f, seed=3, B=1, T=3, H=1, K=2, V=2)
    x = _moved_inward(f, x)
    names = differentiable_names(f, x)
    leaves = [p.clone().requires_grad_() for n in names for p in _tuple(x[n])]
    for form, opts in variants(f):
        opts = {**opts, "chunk_size": 2} if form == "chunkwise" else opts

        def function(*tensors):
            call, rest = dict(x), list(tensors)
            for n in names:
                count = len(_tuple(x[n]))
                parts, rest = rest[:count], rest[count:]
                call[n] = tuple(parts) if isinstance(x[n], tuple) else parts[0]
            o, final = _outputs(f, call, form, **opts)
            return (o, *(() if final is None else _tuple(final)))

        assert torch.autograd.gradcheck(function, leaves, eps=1e-6, atol=1e-7, rtol=1e-5), (form, opts)


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_mpmath_directional_derivative_certifies_every_form(f):
    """<grad, u> of each float64 form against mpmath's derivative of the exact loss along u (every input and
    the initial state moved at once; the final-state cotangent on the recurrent form's own parts)."""
    x, do, _ = case(f, seed=4, B=1, T=4, H=1, K=2, V=2)
    _, final = _outputs(f, x)
    d_final = None if final is None else _random_like(final, torch.Generator().manual_seed(5))
    generator = torch.Generator().manual_seed(6)
    direction = {n: _random_like(x[n], generator) for n in differentiable_names(f, x)}
    exact = directional_derivative_mpmath(f, x, do, direction, d_final, dps=40)
    for form in attnlab.FORMS:
        grads = oracle_gradients(f, x, do, d_final, form=form, chunk_size=CHUNK)
        assert abs(inner(grads, direction) - exact) <= MPMATH_TOL * abs(exact), form


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_low_precision_inputs_and_cotangents_are_upcast_exactly(f):
    x, do, d_scaled = case(f, seed=7)
    half = {n: _cast(v, torch.float16) for n, v in x.items()}
    exact = {n: _cast(v, torch.float64) for n, v in half.items()}
    d_final = None if d_scaled is None else log_scale_cotangent(f, _outputs(f, exact)[1], d_scaled)
    a = oracle_gradients(f, half, do.half(), _cast(d_final, torch.float16))
    b = oracle_gradients(f, exact, do.half().double(), _cast(_cast(d_final, torch.float16), torch.float64))
    for name in a:
        assert all(torch.equal(p, q) and p.dtype == torch.float64 for p, q in zip(_tuple(a[name]), _tuple(b[name])))


def test_bad_cotangents_are_refused():
    f = next(e for e in ENTRIES if e.state is not None)
    x, do, _ = case(f)
    with pytest.raises(ValueError, match="do must be a tensor of o's shape"):
        oracle_gradients(f, x, do[:, :-1])
    with pytest.raises(ValueError, match="d_final_state must match"):
        oracle_gradients(f, x, do, torch.zeros(1))
    stateless = next(e for e in ENTRIES if e.state is None)
    y, dy, _ = case(stateless)
    with pytest.raises(ValueError, match="has no state"):
        oracle_gradients(stateless, y, dy, torch.zeros(1))
    with pytest.raises(ValueError, match="not among the differentiable inputs"):
        directional_derivative_mpmath(stateless, y, dy, {"initial_state": torch.zeros(1)})


# ----------------------------------------------------------------------------- the measure


def _kernel_like(f, dtype, seed=8):
    """Inputs rounded to ``dtype`` (what a kernel is given) and the float64 gradients of exactly those."""
    x, do, d_scaled = case(f, seed=seed, B=1, T=16, H=2, K=8, V=8)
    x = {n: _cast(v, torch.float32 if n == "initial_state" else dtype) for n, v in x.items()}  # a kernel's state: fp32
    do = do.to(dtype)
    d_final = None if d_scaled is None else log_scale_cotangent(f, _outputs(f, x)[1], d_scaled)
    reference = oracle_gradients(f, x, do, d_final)
    return x, do, d_final, reference


def _rounded(grads, dtypes, factor=None, seed=0):
    """Each gradient times ``factor`` (a tensor function of the gradient), rounded to its dtype."""
    out = {}
    for name, g in grads.items():
        parts = tuple((p if factor is None else p * factor(p, seed)).to(dtypes[name]) for p in _tuple(g))
        out[name] = parts if isinstance(g, tuple) else parts[0]
    return out


def _one_percent_off(p, seed):
    signs = torch.randint(0, 2, p.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1
    return 1 + 0.01 * signs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_exact_gradient_has_excess_at_most_one_and_one_percent_off_shows(f, dtype):
    x, do, d_final, reference = _kernel_like(f, dtype)
    dtypes = gradient_dtypes(f, x)
    assert all(dtypes[n] == (torch.float32 if n == "initial_state" else dtype) for n in reference)
    floors = gradient_floor(f, x, do, d_final, base=reference)
    assert all(0 < floors[n] < 1e-5 for n in reference), floors
    exact = measure_gradients(_rounded(reference, dtypes), reference, dtypes, floors)
    assert all(m.excess <= 1.0 and m.nonfinite == 0 for m in exact.values()), {n: m.excess for n, m in exact.items()}
    off = measure_gradients(_rounded(reference, dtypes, _one_percent_off), reference, dtypes, floors)
    # 1% over a rounding floor of about 2e-4 (fp16) or 1.6e-3 (bf16): excess ~50 and ~6 (measured at least 36 and
    # 3.5, the lowest where a gradient has two entries: retnet's g). No floor exceeds u, so the least possible is
    # (0.01 - u) / u: 19.5 in fp16, 1.6 in bf16.
    least = 20.0 if dtype == torch.float16 else 2.5
    assert all(m.excess > least for m in off.values()), {n: m.excess for n, m in off.items()}


def test_non_finite_gradient_entries_are_counted_on_their_own():
    f = next(e for e in ENTRIES if e.state is not None)
    x, do, d_final, reference = _kernel_like(f, torch.float16)
    dtypes = gradient_dtypes(f, x)
    grads = _rounded(reference, dtypes)
    name = differentiable_names(f, x)[0]
    grads[name] = grads[name].clone()
    grads[name].view(-1)[0] = math.nan
    measured = measure_gradients(grads, reference, dtypes)
    assert measured[name].nonfinite == 1 and measured[name].excess == math.inf
    assert all(m.nonfinite == 0 and m.excess <= 1.0 for n, m in measured.items() if n != name)
    with pytest.raises(ValueError, match="no gradient given for"):
        measure_gradients({}, reference, dtypes)


def test_conditioning_floor_perturbs_cotangents_and_clamps_inputs_into_their_range():
    """A gradient that is 2 do moves with do at fp32 roundoff; a ranged input at its bound stays inside."""
    f, ranged = next((e, a) for e in ENTRIES for a in e.args if a.high not in (None, 0.0))  # a bound x(1+r) moves
    x = {ranged.name: torch.full((64,), ranged.high, dtype=torch.float64)}
    do = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    seen = []

    def gradients(inputs, cotangents):
        seen.append(inputs[ranged.name].max().item())
        return {"v": 2 * cotangents["do"], ranged.name: inputs[ranged.name] + 1}

    floor = gradient_conditioning_floor(gradients, x, {"do": do}, args={a.name: a for a in f.args})
    u = 2.0**-24
    assert u / 3 < floor["v"] < u and floor[ranged.name] < u
    assert max(seen) <= ranged.high


# ----------------------------------------------------------------------------- validation under autograd


def _bad_values(f):
    """(what, changes): the first input in integers and with a dimension short; NaN in every tensor, each ranged
    one past its range; NaN in the state."""
    x, _, _ = case(f, seed=9)
    first = f.args[0].name
    yield f"{first} integer", {first: x[first].long()}
    yield f"{first} short", {first: x[first][..., :-1]}
    for arg in f.args:
        if x.get(arg.name) is None:
            continue
        yield f"{arg.name} NaN", {arg.name: torch.full_like(x[arg.name], math.nan)}
        if arg.high is not None:
            yield f"{arg.name} > high", {arg.name: torch.full_like(x[arg.name], arg.high + 0.5)}
        if arg.low is not None:
            yield f"{arg.name} < low", {arg.name: torch.full_like(x[arg.name], arg.low - 0.5)}
    if f.state is not None:
        parts = f.state.split(x["initial_state"])
        bad = tuple(torch.full_like(p, math.nan) if i == 0 else p for i, p in enumerate(parts))
        yield "initial_state NaN", {"initial_state": f.state.join(bad)}


def _error(call):
    try:
        call()
    except (TypeError, ValueError) as error:
        return type(error), str(error)
    return None


@pytest.mark.parametrize("f", ENTRIES, ids=IDS)
def test_validation_raises_the_same_errors_on_inputs_that_require_grad(f):
    x, do, _ = case(f, seed=9)
    kernel_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    for what, changes in _bad_values(f):
        bad = {**x, **changes}
        tracked = {n: _requiring_grad(v) for n, v in bad.items()}
        plain_error = _error(lambda: attnlab.oracle(f, "chunkwise")(**bad))
        assert plain_error is not None and plain_error[0] is ValueError, what
        assert _error(lambda: attnlab.oracle(f, "chunkwise")(**tracked)) == plain_error, what
        assert _error(lambda: oracle_gradients(f, tracked, do)) == plain_error, what
        as_kernel = {n: _requiring_grad(v.float() if isinstance(v, torch.Tensor) else v) for n, v in bad.items()}
        plain = _error(lambda: validate(f, {n: v.float() if isinstance(v, torch.Tensor) else v for n, v in bad.items()},
                                        dtypes=kernel_dtypes, scan="ranges"))
        assert _error(lambda: validate(f, as_kernel, dtypes=kernel_dtypes, scan="ranges")) == plain, what


def test_aft_chunkwise_oracle_keeps_no_key_block_for_autograd(monkeypatch):
    """aft's chunkwise oracle runs each key block's step through xp.recompute: autograd keeps the running sums
    ([B, H, T, D] each) and the inputs, never a step's [B, H, T, chunk, D] logits (T^2 D per head in all: 137 GB in
    float64 at T = 16384, D = 64), and the gradients are those of the same arithmetic kept whole, bit for bit."""
    f = attnlab.formulation("aft")
    B, T, H, D, chunk = 1, 48, 2, 8, 16
    x = f.sample(B=B, T=T, H=H, K=D, V=D, seed=3)
    do = torch.randn(B, T, H, D, dtype=torch.float64)

    def gradients_and_largest_saved():
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            grads = oracle_gradients(f, x, do, chunk_size=chunk)
        return grads, max(sizes)

    recomputed, largest = gradients_and_largest_saved()
    assert largest <= max(T * T, B * H * T * D)
    monkeypatch.setattr(Float64, "recompute", lambda self, step, *arrays: step(*arrays))
    kept, largest_kept = gradients_and_largest_saved()
    assert largest_kept >= B * H * T * chunk * D  # what recompute saves
    for name in recomputed:
        assert torch.equal(recomputed[name], kept[name]), name
