"""The broken backward specimens (properties/specimens.py, issue 22): each has the right forward and a gradient
wrong in exactly the input its defect names, by a real margin; the naive RWKV-4 backward is right below the exp
threshold and non-finite past it while its forward stays finite."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.gradients import oracle_gradients
from attnlab.properties import specimens
from attnlab.properties.targets import function_target

BACKWARD = [s for s in specimens.SPECIMENS if s.broken_pass == specimens.BACKWARD]
# The one gradient each targeted specimen gets wrong (the naive RWKV-4 backward is tested on its own below).
WRONG = {"gla_dg_one_step_short": "g", "deltanet_dk_without_erase": "k", "retnet_dq_without_scale": "q",
         "softmax_dv_sees_earlier_do": "v"}
DTYPES = (torch.float32, torch.float16)


def _inputs(name: str, dtype: torch.dtype, seed: int = 1, key_shift: float = 0.0) -> dict[str, torch.Tensor]:
    x = attnlab.formulation(name).sample(B=1, T=5, H=2, K=4, V=3, seed=seed)
    if key_shift:
        x["k"] = x["k"] + key_shift
    return {n: t.to(dtype).requires_grad_() for n, t in x.items()}


def _cotangent(o: torch.Tensor, seed: int = 2) -> torch.Tensor:
    return torch.randn(o.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(o.dtype)


def _gradients(function, x: dict[str, torch.Tensor], do: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    o = function(**x)
    tensors = {n: t for n, t in x.items() if isinstance(t, torch.Tensor)}
    return o, dict(zip(tensors, torch.autograd.grad(o, list(tensors.values()), do)))


def _within_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> bool:
    """|got - exact| <= u |exact| elementwise (u the unit roundoff of got's dtype), plus the smallest subnormal."""
    info = torch.finfo(got.dtype)
    slack = info.eps / 2 * exact.abs() + info.smallest_normal * info.eps
    return bool(((got.double() - exact).abs() <= slack).all())


def _relative(got: torch.Tensor, exact: torch.Tensor) -> float:
    return float((got.detach().double() - exact).norm() / exact.norm())


def test_backward_specimens_are_registered_as_such() -> None:
    assert {s.name for s in BACKWARD} == {*WRONG, "rwkv4_naive_exp_backward"}
    assert all(s.expected_property.startswith("backward_") for s in BACKWARD)
    assert all(s.broken_pass == specimens.FORWARD for s in specimens.SPECIMENS if s not in BACKWARD)
    for s in BACKWARD:  # plain keyword kernels: no state, no chunk size
        target = function_target(s.function, s.formulation, s.name)
        assert not target.accepts_state and target.chunk_sizes == ()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("specimen", BACKWARD, ids=lambda s: s.name)
def test_forward_is_the_oracle_rounded_once(specimen: specimens.Specimen, dtype: torch.dtype) -> None:
    x = _inputs(specimen.formulation, dtype)
    o = specimen.function(**x)
    assert o.dtype == dtype and o.requires_grad
    assert _within_one_rounding(o, attnlab.oracle(specimen.formulation, "chunkwise")(**x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(WRONG))
def test_gradient_is_wrong_in_the_intended_input_only(name: str, dtype: torch.dtype) -> None:
    specimen = next(s for s in BACKWARD if s.name == name)
    x = _inputs(specimen.formulation, dtype)
    o, grads = _gradients(specimen.function, x, do := _cotangent(specimen.function(**x)))
    exact = oracle_gradients(specimen.formulation, x, do)
    assert set(grads) == set(exact)
    for n, g in grads.items():
        assert g.dtype == x[n].dtype and bool(torch.isfinite(g).all())
        if n == WRONG[name]:
            assert _relative(g, exact[n]) > 0.3, f"{name}: d{n} is not measurably wrong"
        else:
            assert _within_one_rounding(g, exact[n]), f"{name}: d{n} should be the oracle's, rounded once"


def test_dq_without_scale_is_off_by_exactly_the_scale() -> None:
    x = _inputs("retnet", torch.float32)
    x_scaled = {**x, "scale": 0.25}
    for inputs, scale in ((x, 4**-0.5), (x_scaled, 0.25)):  # the default scale K ** -0.5, and a given one
        o = specimens.retnet_dq_without_scale(**inputs)
        _, grads = _gradients(specimens.retnet_dq_without_scale, inputs, do := _cotangent(o))
        assert _relative(grads["q"] * scale, oracle_gradients("retnet", inputs, do)["q"]) < 1e-6


def test_dv_sees_earlier_do_breaks_backward_causality() -> None:
    """do zero from position c on: the right dv is zero there, the specimen's dv_c is not."""
    x = _inputs("softmax", torch.float32)
    o = specimens.softmax_dv_sees_earlier_do(**x)
    do = _cotangent(o)
    do[:, 3:] = 0
    dv = torch.autograd.grad(o, x["v"], do)[0]
    assert bool((oracle_gradients("softmax", x, do)["v"][:, 3:] == 0).all())
    assert bool((dv[:, 3] != 0).any()) and bool((dv[:, 4:] == 0).all())


@pytest.mark.parametrize("dtype, past", [(torch.float32, 100.0), (torch.float16, 20.0)], ids=str)
def test_rwkv4_naive_exp_backward_overflows_past_the_threshold_only(dtype: torch.dtype, past: float) -> None:
    specimen = next(s for s in BACKWARD if s.name == "rwkv4_naive_exp_backward")
    if dtype == torch.float32:  # below the threshold, fp32 arithmetic: every gradient close to the oracle's
        x = _inputs("rwkv4", dtype)
        _, grads = _gradients(specimen.function, x, do := _cotangent(specimen.function(**x)))
        exact = oracle_gradients("rwkv4", x, do)
        assert all(_relative(grads[n], exact[n]) < 1e-4 for n in grads)
    x = _inputs("rwkv4", dtype, key_shift=past)  # keys past the exp threshold of dtype
    o, grads = _gradients(specimen.function, x, _cotangent(specimen.function(**x)))
    assert _within_one_rounding(o, attnlab.oracle("rwkv4", "chunkwise")(**x))
    assert all(bool(torch.isfinite(t).all()) for t in oracle_gradients("rwkv4", x, _cotangent(o)).values())
    assert not bool(torch.isfinite(grads["k"]).all())
