"""retnet kernels (kernels/retnet.py) beyond the generic test: strong decays (g = -20 per step),
no decay, T=1, non-power-of-two head dimensions over several V blocks, an fp16 state above fp16's
range, every precision mode and chunk size, the expm1 helper, bad options. The backward likewise
(against float64 autograd through the oracle, tests/test_kernel_gradients.py's measure), with
either cotangent alone, and the chunk states the forward saves for it. CPU (Triton interpreter),
fp16 and fp32."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import attnlab
from attnlab.kernel import kernel
from kernel_checks import EXCESS_BOUND, STATE_BOUND, check_stateful_kernel
from attnlab.gradients import gradient_dtypes, gradient_floor, oracle_gradients
from attnlab.kernels.retnet import chunkwise, expm1
from attnlab.metrics import measure, measure_gradients, rel_err
from attnlab.registry import bounds_for

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run where there is no GPU")

# The targets of the generic test (tests/test_kernels.py): excess over max(rounding, conditioning) floor.
FORMS = ("chunkwise", "recurrent")


def _sample(T: int, K: int = 16, V: int = 16, H: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    return attnlab.formulation("retnet").sample(B=1, T=T, H=H, K=K, V=V, seed=seed)


def _check(x: dict, dtype: torch.dtype, form: str, **opts) -> float:
    """Run the kernel on x rounded to dtype; assert finite output, excess and final state within the bounds."""
    return check_stateful_kernel("retnet", form, x, dtype, **opts)[2].excess


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_decay_of_minus_20_stays_finite_and_exact(form, dtype):
    """exp(-20) per step: every exponent underflows to 0 past a few steps, never overflows."""
    x = _sample(T=40)
    x["g"] = torch.tensor([-20.0, -0.5], dtype=torch.float64)
    _check(x, dtype, form, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("form", FORMS)
def test_no_decay(form):
    x = _sample(T=24)
    x["g"] = torch.zeros(2, dtype=torch.float64)
    _check(x, torch.float16, form, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("form", FORMS)
def test_head_dims_not_powers_of_two_over_several_v_blocks(form):
    """K=20 pads to a 32 tile; V=100 spans two V blocks of 64 (chunkwise) or four of 32 (recurrent)."""
    _check(_sample(T=19, K=20, V=100, H=1), torch.float16, form)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_sizes(chunk_size):
    _check(_sample(T=45), torch.float16, "chunkwise", chunk_size=chunk_size)


@pytest.mark.parametrize("precision", ["split", "tf32", "ieee"])
def test_precision_modes(precision):
    """Under the interpreter fp32 dots are exact, so every mode must reach the floor here."""
    _check(_sample(T=40), torch.float16, "chunkwise", precision=precision, chunk_size=16)


@pytest.mark.parametrize("form", FORMS)
def test_fp16_state_beyond_fp16_range(form):
    """A state of ~1e6 (fp16 tops out at 65504) read by small queries: the split dots rescale, nothing overflows."""
    x = _sample(T=20)
    x["q"] = x["q"] * 1e-2
    x["initial_state"] = 1e6 * torch.randn(1, 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    _check(x, torch.float16, form)


def test_resume_mid_chunk_fp16():
    """Split at t=23 (inside the second chunk of 16) and pass the fp32 state on."""
    x = {n: t.to(torch.float16) for n, t in _sample(T=50).items()}
    run = kernel("retnet", "chunkwise", chunk_size=16)
    whole, whole_state = run(**x, return_state=True)
    first = {n: (t[:, :23] if t.dim() == 4 else t) for n, t in x.items()}
    second = {n: (t[:, 23:] if t.dim() == 4 else t) for n, t in x.items()}
    o1, s1 = run(**first, return_state=True)
    o2, s2 = run(**second, initial_state=s1, return_state=True)
    ref = attnlab.oracle("retnet", "chunkwise", "float64")(**x)
    m = measure(torch.cat([o1, o2], dim=1), ref, torch.float16)
    assert m.excess <= EXCESS_BOUND[torch.float16], m.as_dict()
    assert rel_err(s2, whole_state) <= STATE_BOUND[torch.float16]


@triton.jit
def _expm1_kernel(x, out, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out + offsets, expm1(tl.load(x + offsets)))


def test_expm1_is_accurate_near_zero():
    """exp(g) - 1 for g from -50 to -1e-9: within 4 fp32 ulps of the exact value (no cancellation near 0)."""
    g = -torch.logspace(-9, math.log10(50), 256, dtype=torch.float64)
    out = torch.empty(256, dtype=torch.float32)
    _expm1_kernel[(1,)](g.float(), out, N=256)
    exact = torch.expm1(g.float().double())
    assert ((out.double() - exact).abs() / exact.abs()).max().item() <= 4 * 2.0**-24


@pytest.mark.parametrize(
    "opts, message",
    [
        ({"precision": "bf16"}, "precision must be one of"),
        ({"chunk_size": 48}, "chunk_size must be one of"),
        ({"block_v": 8}, "block_v must be one of"),
        ({"num_warps": 3}, "num_warps must be one of"),
    ],
)
def test_bad_options_raise(opts, message):
    with pytest.raises(ValueError, match=message):
        kernel("retnet", "chunkwise", **opts)


def test_recurrent_rejects_chunk_options():
    with pytest.raises(TypeError, match="chunk_size"):
        kernel("retnet", "recurrent", chunk_size=16)


# ------------------------------------------------------------------------------------------------ backward


# fp32 gradients of inputs off the registry's defaults (g = -20, g = 0): dg sums T * K * V products in fp32 to a few
# units of roundoff, against a floor that can sit far below one (at g = (-20, -0.5) dg is two numbers and its floor
# 2.8e-8, under half fp32's u: dg's excess measured 2.8 chunkwise, 4.9 recurrent, whose tangent state sums over
# every step where the chunkwise form sums over a chunk; fp32 arithmetic with the recurrent's steps in torch lands at
# the same few u). The registry's fp32 gradient bound for any input is 48; this holds them tighter.
FP32_GRADIENT_BOUND = 8.0


def _check_gradients(x: dict, dtype: torch.dtype, form: str, *, with_do: bool = True, with_d_state: bool = True,
                     default_inputs: bool = True, **opts) -> dict[str, float]:
    """Gradients of <do, o> (+ <dS, final state>) by the kernel's backward against float64 autograd through the
    oracle, on x rounded to dtype (its initial state, if any, in fp32): dtypes, shapes, finite, and each
    gradient's excess within the gradient bound (fp16 2; fp32 the default-inputs bound, 4, else
    FP32_GRADIENT_BOUND). A cotangent left out is zero (do) or absent (dS); a gradient whose exact value is then
    zero must be exactly zero."""
    x = {n: (t.float() if n == "initial_state" else t.to(dtype)) for n, t in x.items()}
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v", "g")}
    if "initial_state" in x:
        leaves["initial_state"] = x["initial_state"].detach().clone().requires_grad_()
    o, final = kernel("retnet", form, **opts)(**{**x, **leaves}, return_state=True)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).double()
    if not with_do:
        do = torch.zeros_like(do)
    d_state = torch.randn(final.shape, generator=gen, dtype=torch.float64).float().double() if with_d_state else None
    loss = (o.double() * do).sum() + ((final.double() * d_state).sum() if with_d_state else 0.0)
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    for n, grad in grads.items():
        assert grad.shape == leaves[n].shape and grad.dtype == leaves[n].dtype, (n, grad.shape, grad.dtype)
        assert bool(torch.isfinite(grad).all()), n
    reference = oracle_gradients("retnet", x, do, d_state)
    exact_zeros = [n for n, r in reference.items() if not bool(r.any())]
    for n in exact_zeros:
        assert not bool(grads[n].any()), n
    reference = {n: r for n, r in reference.items() if n not in exact_zeros}
    dtypes = {**gradient_dtypes("retnet", x), "initial_state": dtype}  # the state's built from input-dtype terms
    floors = gradient_floor("retnet", x, do, d_state, base=reference)
    measured = measure_gradients({n: grads[n] for n in reference}, reference, dtypes, floors)
    bounds = bounds_for(attnlab.formulation("retnet"), str(dtype).removeprefix("torch."))
    bound = bounds.gradient_accuracy if dtype != torch.float32 else bounds.on_default_inputs if default_inputs \
        else FP32_GRADIENT_BOUND
    for n, m in measured.items():
        assert m.nonfinite == 0 and m.excess <= bound, (n, m.as_dict())
    return {n: m.excess for n, m in measured.items()}


def _with_state(x: dict, seed: int = 11) -> dict:
    """x with an initial state the formulation reaches: the final state of another input of x's shape."""
    _, T, H, K = x["q"].shape
    other = _sample(T=T, K=K, V=x["v"].shape[-1], H=H, seed=seed)
    return {**x, "initial_state": attnlab.oracle("retnet", "chunkwise", "float64")(**other, return_state=True)[1]}


CHUNK_16 = {"chunkwise": {"chunk_size": 16}, "recurrent": {}}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gradients_at_T_1(form, dtype):
    _check_gradients(_with_state(_sample(T=1)), dtype, form)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_over_partial_chunks(form):
    """T = 45: two full chunks of 16 and a partial one of 13, with a state in and out."""
    _check_gradients(_with_state(_sample(T=45)), torch.float16, form, **CHUNK_16[form])


@pytest.mark.parametrize("form", FORMS)
def test_gradients_with_head_dims_not_powers_of_two_over_several_v_blocks(form):
    """K=20 pads to a 32 tile; V=24 spans two V blocks of 16, so dq and dk sum blocks' shares."""
    x = _with_state(_sample(T=21, K=20, V=24))
    _check_gradients(x, torch.float16, form, block_v=16, **CHUNK_16[form])


@pytest.mark.parametrize("form", FORMS)
def test_gradients_with_large_odd_head_dims(form):
    """The one large case: K=72, V=100 (four V blocks of 32), T not a multiple of the chunk."""
    x = _with_state(_sample(T=19, K=72, V=100, H=1))
    _check_gradients(x, torch.float16, form, block_v=32, **CHUNK_16[form])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gradients_under_a_decay_of_minus_20_stay_finite_and_exact(form, dtype):
    """exp(-20) per step: every decayed term underflows within a few steps, no exponent is positive."""
    x = _with_state(_sample(T=40))
    x["g"] = torch.tensor([-20.0, -0.5], dtype=torch.float64)
    _check_gradients(x, dtype, form, default_inputs=False, **CHUNK_16[form])


@pytest.mark.parametrize("form", FORMS)
def test_gradients_without_decay(form):
    """g = 0: dg's weights (the steps each term spans) grow to T, and the state never shrinks."""
    x = _with_state(_sample(T=70))
    x["g"] = torch.zeros(2, dtype=torch.float64)
    _check_gradients(x, torch.float32, form, default_inputs=False, **CHUNK_16[form])


@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_gradients_at_every_chunk_size(chunk_size):
    _check_gradients(_with_state(_sample(T=45)), torch.float16, "chunkwise", chunk_size=chunk_size)


@pytest.mark.parametrize("precision", ["split", "tf32", "ieee"])
def test_gradients_at_every_precision(precision):
    _check_gradients(_with_state(_sample(T=40)), torch.float16, "chunkwise", precision=precision, chunk_size=16)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_from_the_final_state_alone(form):
    """do = 0: dq is exactly zero; dk, dv, dg and dS_0 come from the final state's cotangent alone."""
    _check_gradients(_with_state(_sample(T=37)), torch.float16, form, with_do=False, **CHUNK_16[form])


@pytest.mark.parametrize("form", FORMS)
def test_gradients_from_the_output_alone(form):
    """No loss reads the final state: the backward gets d_state = None."""
    _check_gradients(_with_state(_sample(T=37)), torch.float16, form, with_d_state=False, **CHUNK_16[form])


def test_chunkwise_saves_the_state_entering_each_chunk():
    """With a saved dict, the forward keeps the state entering each chunk (the final state of the tokens before
    it) and its output is unchanged; without one it keeps nothing."""
    x = {n: (t.float() if n == "initial_state" else t.to(torch.float16)) for n, t in _with_state(_sample(T=45)).items()}
    call = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], scale=16 ** -0.5, state=(x["initial_state"],),
                return_state=True, chunk_size=16)
    saved: dict[str, torch.Tensor] = {}
    o, _ = chunkwise(**call, saved=saved)
    assert torch.equal(o, chunkwise(**call)[0])
    states = saved["chunk_states"]
    assert states.shape == (1, 2, 3, 16, 16) and states.dtype == torch.float32
    assert torch.equal(states[:, :, 0], x["initial_state"])
    for c in (1, 2):
        prefix = {n: (t[:, :16 * c] if n in "qkv" else t) for n, t in x.items()}
        expected = attnlab.oracle("retnet", "chunkwise", "float64")(**prefix, return_state=True)[1]
        assert rel_err(states[:, :, c], expected) <= STATE_BOUND[torch.float16]


@pytest.mark.parametrize("form", FORMS)
def test_gradient_of_a_decay_of_minus_20_on_every_head(form):
    """dg ~ 2e-7 from terms decayed by exp(-20) alone: carried as exp(g) x, not x + expm1(g) x (whose factor rounds
    to 0 in fp32), it keeps its accuracy in fp32."""
    x = _with_state(_sample(T=40))
    x["g"] = torch.full((2,), -20.0, dtype=torch.float64)
    _check_gradients(x, torch.float32, form, default_inputs=False, **CHUNK_16[form])
