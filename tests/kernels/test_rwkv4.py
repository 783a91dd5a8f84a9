"""RWKV-4 kernel behaviour beyond the generic oracle test (tests/test_kernels.py).

Runs under the Triton interpreter in fp16 and fp32 (bf16 needs a GPU). Every
bound is either an exact identity or a multiple of the floor
``max(floor_round, floor_cond)`` (attnlab.metrics), with the multiples of
tests/test_kernels.py: excess <= 2 in fp16, <= 4 in fp32.

- Large keys (+60 in fp16, +200 in fp32): finite, within the bound of the
  float64 oracle, and every output inside [min v, max v] of the values it
  averages (the output is a convex combination).
- Shift invariance: adding a constant to every key (exactly, on a grid where
  k + c is representable) moves the output by no more than two bounds.
- T = 1 gives o = v and the state (v, 1, k) exactly.
- initial_state with p = -inf is the empty state (bit-identical outputs);
  with finite p it matches the oracle.
- Decays from none (w = 0) to strong (w = 50 per step), a non-power-of-two
  channel count split over several programs, every chunk_size, bad options.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st, target

import attnlab
from attnlab.kernel import kernel
from attnlab.kernels import rwkv4 as rwkv4_kernels
from attnlab.gradients import gradient_dtypes, gradient_floor, log_scale_cotangent, oracle_gradients
from attnlab.metrics import conditioning_floor, measure, measure_gradients, rel_err, unit_roundoff
from attnlab.registry import bounds_for
from kernel_checks import EXCESS_BOUND, STATE_BOUND

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter tests run where there is no GPU")

FORMS = ("recurrent", "chunkwise")
DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
REFERENCE = attnlab.oracle("rwkv4", "chunkwise", "float64")


def _inputs(
    dtype: torch.dtype, T: int, C: int = 24, B: int = 1, seed: int = 0, shift: float = 0.0, w_scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """The registry's rwkv4 inputs ([B, T, C], C = H * V with H = 1), keys shifted, decays scaled, in ``dtype``."""
    x = attnlab.formulation("rwkv4").sample(B=B, T=T, H=1, K=16, V=C, seed=seed)
    x["k"] = x["k"] + shift
    x["w"] = x["w"] * w_scale
    return {n: t.to(dtype) for n, t in x.items()}


def _check_against_oracle(form: str, x: dict, dtype: torch.dtype, state=None, **opts):
    """Run the kernel and the float64 oracle on the same inputs; assert finite and within the bound."""
    o, final = kernel("rwkv4", form, **opts)(**x, initial_state=state, return_state=True)
    ref, ref_final = REFERENCE(**x, initial_state=state, return_state=True)
    m = measure(o, ref, dtype, conditioning_floor(REFERENCE, {**x, "initial_state": state}))
    assert o.dtype == dtype and o.shape == ref.shape
    assert m.nonfinite == 0, m.as_dict()
    assert m.excess <= EXCESS_BOUND[dtype], f"{form} {dtype} {opts}: {m.as_dict()}"
    assert all(part.dtype == torch.float32 for part in final)
    assert rel_err(final, ref_final) <= STATE_BOUND[dtype]
    return o, final, m


def _assert_convex(o: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> None:
    """o_t lies in [min_{i<=t} v_i, max_{i<=t} v_i] (no initial state).

    In fp16 exactly: the fp32 result overshoots by a few fp32 ulps at most,
    and rounding to fp16 brings it back onto the fp16 value max v (or min v).
    In fp32 up to 8 unit roundoffs of max|v|: the output's own rounding plus
    the few roundings of the numerator, denominator and division.
    """
    v64, o64 = v.double(), o.double()
    low, high = torch.cummin(v64, dim=1).values, torch.cummax(v64, dim=1).values
    slack = 0.0 if dtype == torch.float16 else 8 * unit_roundoff(torch.float32) * v64.abs().max().item()
    assert bool((o64 >= low - slack).all()) and bool((o64 <= high + slack).all())


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,shift", [(torch.float16, 60.0), (torch.float32, 200.0)], ids=["fp16+60", "fp32+200"])
def test_large_keys_finite_within_bound_and_convex(form, dtype, shift):
    x = _inputs(dtype, T=45, B=2, shift=shift)
    o, _, _ = _check_against_oracle(form, x, dtype)
    _assert_convex(o, x["v"], dtype)


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=5, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    T=st.integers(1, 40),
    shift=st.sampled_from([-60.0, 0.0, 60.0]),
    log_w_scale=st.floats(-5.0, 4.0),
)
def test_convex_and_within_bound_fp16(form, seed, T, shift, log_w_scale):
    x = _inputs(torch.float16, T=T, C=16, seed=seed, shift=shift, w_scale=math.exp(log_w_scale))
    o, _, m = _check_against_oracle(form, x, torch.float16)
    target(m.excess, label="excess")
    _assert_convex(o, x["v"], torch.float16)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,shift", [(torch.float16, 60.0), (torch.float32, 200.0)], ids=["fp16+60", "fp32+200"])
def test_shift_invariance(form, dtype, shift):
    """o(k + c) = o(k) exactly; the kernel's two outputs differ by at most the two error bounds."""
    x = _inputs(dtype, T=40)
    # Keys on a 1/32 grid inside (-4, 4): k and k + c are both exact in fp16 and fp32.
    x["k"] = (x["k"].double() * 32).round().clamp(-112, 112).div(32).to(dtype)
    shifted = {**x, "k": x["k"] + shift}
    assert torch.equal(shifted["k"].double() - shift, x["k"].double())
    run = kernel("rwkv4", form)
    o, o_shifted = run(**x), run(**shifted)
    ref = REFERENCE(**x)
    floors = [measure(ref, ref, dtype, conditioning_floor(REFERENCE, inputs)).floor for inputs in (x, shifted)]
    difference = (o.double() - o_shifted.double()).norm() / ref.norm()
    assert difference <= EXCESS_BOUND[dtype] * sum(floors)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_single_token_returns_v_and_its_state(form, dtype):
    x = _inputs(dtype, T=1, B=2, shift=30.0)
    o, (a, b, p) = kernel("rwkv4", form)(**x, return_state=True)
    assert torch.equal(o, x["v"])
    assert torch.equal(a, x["v"][:, 0].float())
    assert torch.equal(b, torch.ones_like(b))
    assert torch.equal(p, x["k"][:, 0].float())


@pytest.mark.parametrize("form", FORMS)
def test_state_with_p_minus_inf_is_the_empty_state(form):
    x = _inputs(torch.float32, T=21, B=2)
    B, C = x["k"].shape[0], x["k"].shape[2]
    generator = torch.Generator().manual_seed(3)
    junk = (torch.randn(B, C, generator=generator), torch.rand(B, C, generator=generator) + 0.5)
    empty = (*junk, torch.full((B, C), -math.inf))
    run = kernel("rwkv4", form)
    o_none, state_none = run(**x, return_state=True)
    o_empty, state_empty = run(**x, initial_state=empty, return_state=True)
    assert torch.equal(o_none, o_empty)
    assert all(torch.equal(s, t) for s, t in zip(state_none, state_empty))
    _check_against_oracle(form, x, torch.float32, state=empty)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "dtype,p_offset",
    [(torch.float16, 0.0), (torch.float16, 60.0), (torch.float32, 8.0)],
    ids=["fp16-p~k", "fp16-p>>k", "fp32-p>k"],
)
def test_state_with_finite_p(form, dtype, p_offset):
    """A state (a, b, p) with a / b an average of values and p near, above or far above the keys."""
    x = _inputs(dtype, T=30, B=2, shift=20.0)
    B, C = x["k"].shape[0], x["k"].shape[2]
    generator = torch.Generator().manual_seed(5)
    b = torch.rand(B, C, generator=generator) + 1.0
    a = b * torch.randn(B, C, generator=generator)
    p = 20.0 + p_offset + torch.randn(B, C, generator=generator)
    _check_against_oracle(form, x, dtype, state=(a, b, p))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("w_value", [0.0, 1e-3, 50.0, 1e4], ids=["no-decay", "slow", "strong", "huge"])
def test_decay_extremes(form, w_value):
    x = _inputs(torch.float16, T=24)
    x["w"] = torch.full_like(x["w"], w_value)
    _check_against_oracle(form, x, torch.float16)


@pytest.mark.parametrize("form", FORMS)
def test_channels_not_a_power_of_two_over_several_programs(form):
    x = _inputs(torch.float16, T=19, C=100, B=2, shift=10.0)
    _check_against_oracle(form, x, torch.float16, block_c=32)


@pytest.mark.parametrize(
    "chunk_size,dtype",
    [(8, torch.float16), (16, torch.float16), (32, torch.float16), (64, torch.float16),
     (8, torch.float32), (64, torch.float32)],
)
def test_chunk_sizes(chunk_size, dtype):
    # T = 37: full chunks and a partial one for 8 and 16, one partial chunk for 64.
    x = _inputs(dtype, T=37, shift=5.0)
    _check_against_oracle("chunkwise", x, dtype, chunk_size=chunk_size, block_c=16)


@pytest.mark.parametrize(
    "form,opts",
    [
        ("chunkwise", {"chunk_size": 12}),
        ("chunkwise", {"chunk_size": 128}),
        ("chunkwise", {"block_c": 24}),
        ("recurrent", {"block_c": 8}),
        ("recurrent", {"num_stages": 5}),
        ("recurrent", {"num_warps": 3}),
    ],
)
def test_bad_options_raise_value_error(form, opts):
    name, value = next(iter(opts.items()))
    with pytest.raises(ValueError, match=name):
        kernel("rwkv4", form, **opts)


def test_bad_chunk_size_called_directly_raises_value_error():
    x = _inputs(torch.float32, T=4)
    with pytest.raises(ValueError, match="chunk_size"):
        rwkv4_kernels.chunkwise(**x, chunk_size=12)


def test_recurrent_option_is_unknown_to_chunkwise_and_vice_versa():
    with pytest.raises(TypeError, match="chunk_size"):
        kernel("rwkv4", "recurrent", chunk_size=16)


# --- Backward (kernels/rwkv4.py, BACKWARD): every gradient against float64 autograd through the oracle ---

# Beyond the registry's default inputs (large keys, extreme decays) fp32 is held to this multiple of the floor
# rather than the default-inputs bound 4 (the registry's fp32 gradient bound for any input is 48).
FP32_GRADIENT_BOUND = 8.0


def _check_gradients(form: str, x: dict, dtype: torch.dtype, state: tuple | None = None, *, with_do: bool = True,
                     d_state: str | None = "scale-free", fp32_bound: float = EXCESS_BOUND[torch.float32],
                     **opts) -> dict[str, float]:
    """Gradients of <do, o> + <dS, final state> by the kernel's backward against the oracle's, on x in dtype
    (state in fp32): dtypes, shapes, finite, each excess within the gradient bound (fp16 2; fp32 ``fp32_bound``,
    the default-inputs bound 4 unless given). A gradient whose exact value is zero must be exactly zero.

    ``d_state``: None (no dS), "scale-free" (dS on e^p a and e^p b, as the generic test draws it: it grows as
    e^p, so only for moderate keys) or "parts" (dS drawn on (a, b, p) themselves: the kernel's p is the
    oracle's canonical one, so this is one function, and p's cotangent reaches the key p was set from)."""
    f = attnlab.formulation("rwkv4")
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("w", "u", "k", "v")}
    state_leaves = tuple(p.detach().clone().requires_grad_() for p in state) if state is not None else ()
    o, final = kernel("rwkv4", form, **opts)(**leaves, initial_state=state_leaves or None, return_state=True)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).double() * with_do
    loss = (o.double() * do).sum()
    d_reference = None
    if d_state == "scale-free":
        d_scaled = tuple(torch.randn(final[0].shape, generator=gen, dtype=torch.float64).float().double()
                         for _ in range(2))
        d_kernel = log_scale_cotangent(f, final, d_scaled)
        reference_final = REFERENCE(**x, initial_state=state, return_state=True)[1]
        d_reference = log_scale_cotangent(f, reference_final, d_scaled)
    elif d_state == "parts":
        d_kernel = d_reference = tuple(torch.randn(p.shape, generator=gen, dtype=torch.float64).float().double()
                                       for p in final)
    if d_state is not None:
        loss = loss + sum((p.double() * d).sum() for p, d in zip(final, d_kernel))
    got = torch.autograd.grad(loss, [*leaves.values(), *state_leaves])
    grads = dict(zip(leaves, got))
    for n, grad in grads.items():
        assert grad.shape == leaves[n].shape and grad.dtype == dtype, (n, grad.shape, grad.dtype)
    if state is not None:
        grads["initial_state"] = tuple(got[len(leaves):])
        assert all(g.dtype == torch.float32 and g.shape == p.shape for g, p in zip(grads["initial_state"], state))
    for n, grad in grads.items():
        assert all(bool(torch.isfinite(g).all()) for g in (grad if isinstance(grad, tuple) else (grad,))), n
    inputs = {**x, **({"initial_state": state} if state is not None else {})}
    reference = oracle_gradients(f, inputs, do, d_reference)
    flat = {n: torch.cat([r.flatten() for r in (v if isinstance(v, tuple) else (v,))]) for n, v in reference.items()}
    exact_zeros = [n for n, r in flat.items() if not bool(r.any())]
    for n in exact_zeros:
        assert not any(bool(g.any()) for g in (grads[n] if isinstance(grads[n], tuple) else (grads[n],))), n
    reference = {n: r for n, r in reference.items() if n not in exact_zeros}
    dtypes = {**gradient_dtypes(f, inputs), "initial_state": dtype}  # the state's built from input-dtype terms
    floors = gradient_floor(f, inputs, do, d_reference, base=reference)
    measured = measure_gradients({n: grads[n] for n in reference}, reference, dtypes, floors)
    bound = fp32_bound if dtype == torch.float32 else bounds_for(f, str(dtype).removeprefix("torch.")).gradient_accuracy
    for n, m in measured.items():
        assert m.nonfinite == 0 and m.excess <= bound, (form, n, m.as_dict())
    return {n: m.excess for n, m in measured.items()}


def _reachable_state(x: dict, seed: int = 11) -> tuple[torch.Tensor, ...]:
    """A state the formulation reaches: the float64 oracle's final state on other inputs of x's shape, in fp32."""
    B, T, C = x["k"].shape
    other = {n: t.double() for n, t in _inputs(torch.float32, T=T, C=C, B=B, seed=seed).items()}
    return tuple(p.float() for p in REFERENCE(**other, return_state=True)[1])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gradients_at_T_1(form, dtype):
    x = _inputs(dtype, T=1, B=2)
    _check_gradients(form, x, dtype, state=_reachable_state(x))
    _check_gradients(form, x, dtype, d_state=None)


@pytest.mark.parametrize("form,opts", [("recurrent", {}), ("chunkwise", {"chunk_size": 16})])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gradients_over_a_partial_chunk(form, opts, dtype):
    x = _inputs(dtype, T=37, B=2, seed=3)
    _check_gradients(form, x, dtype, state=_reachable_state(x), **opts)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_channels_not_a_power_of_two_over_several_programs(form):
    x = _inputs(torch.float16, T=19, C=100, B=2, shift=10.0)
    _check_gradients(form, x, torch.float16, state=_reachable_state(x), d_state="parts", block_c=32)


@pytest.mark.parametrize(
    "chunk_size,dtype",
    [(8, torch.float16), (16, torch.float32), (32, torch.float16), (64, torch.float32)],
)
def test_gradients_every_chunk_size(chunk_size, dtype):
    x = _inputs(dtype, T=37, seed=4)
    _check_gradients("chunkwise", x, dtype, state=_reachable_state(x), chunk_size=chunk_size)


@pytest.mark.parametrize("opts", [{"block_c": 16, "num_warps": 2}, {"num_stages": 1}, {"block_c": 256, "num_warps": 8}])
def test_gradients_recurrent_tiling_options(opts):
    x = _inputs(torch.float16, T=21, seed=5)
    _check_gradients("recurrent", x, torch.float16, **opts)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,shift", [(torch.float16, 60.0), (torch.float32, 200.0)], ids=["fp16+60", "fp32+200"])
def test_gradients_large_keys_stay_finite_and_accurate(form, dtype, shift):
    """exp(k) overflows fp32 at k = 88.7: every exponential of the backward is of a logit less a maximum."""
    x = _inputs(dtype, T=45, B=2, shift=shift)
    _check_gradients(form, x, dtype, d_state="parts", fp32_bound=FP32_GRADIENT_BOUND)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "w_value,dtype",
    [(0.0, torch.float32), (1e-3, torch.float16), (20.0, torch.float16), (20.0, torch.float32), (1e4, torch.float16)],
    ids=["no-decay-fp32", "slow-fp16", "strong-20-fp16", "strong-20-fp32", "huge-fp16"],
)
def test_gradients_decay_extremes(form, w_value, dtype):
    """w = 20 (log decay -20 per step) and 1e4: the weights of older keys underflow to 0, nothing overflows."""
    x = _inputs(dtype, T=30)
    x["w"] = torch.full_like(x["w"], w_value)
    _check_gradients(form, x, dtype, state=_reachable_state(x), fp32_bound=FP32_GRADIENT_BOUND)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("with_do,d_state", [(False, "scale-free"), (False, "parts"), (True, None)],
                         ids=["d_state-only", "d_parts-only", "do-only"])
def test_gradients_one_cotangent_at_a_time(form, with_do, d_state):
    x = _inputs(torch.float32, T=33, B=2, seed=6)
    _check_gradients(form, x, torch.float32, state=_reachable_state(x), with_do=with_do, d_state=d_state)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "dtype,p_offset", [(torch.float16, 60.0), (torch.float32, 8.0)], ids=["fp16-p>>k", "fp32-p>k"],
)
def test_gradients_state_with_p_above_the_keys(form, dtype, p_offset):
    """The final p may stay the initial one decayed: its cotangent then goes to the initial p.

    In fp32 the outputs then sit next to the state's own average a / b, and dw's initial-state term, a sum of
    do_t (a - b o_t) lag_t, inherits o_t's own fp32 rounding where the exact (a - b o_t) is far smaller:
    measured excess 12-14 on dw, held to the registry's fp32 gradient bound for any input."""
    x = _inputs(dtype, T=30, B=2, shift=20.0)
    x["w"] = x["w"] * 0.05  # slow decays: the initial p stays the largest logit to the end in most channels
    generator = torch.Generator().manual_seed(5)
    b = torch.rand(2, 24, generator=generator) + 1.0
    a = b * torch.randn(2, 24, generator=generator)
    p = 20.0 + p_offset + torch.randn(2, 24, generator=generator)
    any_input = bounds_for(attnlab.formulation("rwkv4"), "float32").gradient_accuracy
    _check_gradients(form, x, dtype, state=(a, b, p), d_state="parts", fp32_bound=any_input)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_empty_initial_state_p_minus_inf(form):
    """p = -inf: the initial state weighs nothing, so its gradients are exactly zero (no 0 * inf)."""
    x = _inputs(torch.float32, T=21, B=2)
    state = (torch.randn(2, 24), torch.rand(2, 24) + 0.5, torch.full((2, 24), -math.inf))
    leaves = tuple(p.clone().requires_grad_() for p in state)
    o, final = kernel("rwkv4", form)(**x, initial_state=leaves, return_state=True)
    grads = torch.autograd.grad((o * torch.randn_like(o)).sum() + final[0].sum() + final[2].sum(), leaves)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("form", FORMS)
def test_gradient_identities_key_shift_and_causality(form):
    """sum_t dk_t = 0 per channel (a constant added to every key changes nothing); with do zero from position c
    on, every gradient at positions >= c is exactly zero."""
    x = _inputs(torch.float32, T=40, B=2, seed=8)
    k, v = x["k"].clone().requires_grad_(), x["v"].clone().requires_grad_()
    o = kernel("rwkv4", form)(**{**x, "k": k, "v": v})
    do = torch.randn_like(o)
    do[:, 25:] = 0
    dk, dv = torch.autograd.grad((o * do).sum(), [k, v])
    assert not bool(dk[:, 25:].any()) and not bool(dv[:, 25:].any())
    assert dk.sum(1).abs().max() <= 16 * unit_roundoff(torch.float32) * dk.abs().sum(1).max()


@pytest.mark.parametrize("form", FORMS)
def test_saving_for_the_backward_leaves_the_forward_bit_identical(form):
    """The forward called with ``saved`` (as attnlab.kernel does when gradients are needed) writes the same o and
    final state, and saves log D_t: finite with keys near 40, and at least u + k_t (D_t holds that term)."""
    x = _inputs(torch.float16, T=37, B=2, seed=9, shift=40.0)
    run = getattr(rwkv4_kernels, form)
    o, final = run(**x, return_state=True)
    saved: dict = {}
    o_saving, final_saving = run(**x, return_state=True, saved=saved)
    assert torch.equal(o, o_saving) and all(torch.equal(s, t) for s, t in zip(final, final_saving))
    assert set(saved) == {"log_denominator", "output_residual", "final_steps", "final_state"}
    log_den = saved["log_denominator"]
    assert bool(torch.isfinite(log_den).all())
    assert bool((log_den >= (x["u"].float() + x["k"].float()) - 1e-5 * log_den.abs()).all())
