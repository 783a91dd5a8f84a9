"""general kernels (kernels/general.py, kernels/_gated.py) beyond the generic test: each gate
present or absent, strong value gates, T=1, V=100 (two value blocks, the second partial), and
gla as the key-gate-only special case; and the backward's gradients against the float64 oracle's in
the same cases. CPU (Triton interpreter), fp16 and fp32."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.kernel import kernel
from kernel_checks import check_gradients, check_stateful_kernel, with_state

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run where there is no GPU")

FORMS = ("chunkwise", "recurrent")


def _sample(T: int, K: int = 16, V: int = 16, B: int = 1, H: int = 1, seed: int = 0,
            gates: str = "gk gv") -> dict[str, torch.Tensor]:
    x = attnlab.formulation("general").sample(B=B, T=T, H=H, K=K, V=V, seed=seed)
    for gate in ("gk", "gv"):
        if gate not in gates.split():
            x[gate] = None
    return x


def _check(x: dict, dtype: torch.dtype, form: str, **opts) -> torch.Tensor:
    """Run the kernel on x rounded to dtype; assert finite output, the excess bound and the final state."""
    return check_stateful_kernel("general", form, x, dtype, **opts)[0]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("gates", ["gk", "gv", ""], ids=["only-gk", "only-gv", "no-gate"])
def test_each_gate_may_be_absent(gates, form):
    """Both gates run in tests/test_kernels.py; here each alone and neither (three chunks of 16)."""
    _check(_sample(T=36, gates=gates), torch.float16, form, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gates_of_minus_20_stay_finite_and_exact(form, dtype):
    """exp(-20) per step on half the value channels and on random steps of both gates."""
    x = _sample(T=34, seed=1)
    gen = torch.Generator().manual_seed(5)
    for name in ("gk", "gv"):
        strong = torch.rand(x[name].shape, generator=gen, dtype=torch.float64) < 0.3
        if name == "gv":
            strong[..., 1::2] = True
        x[name] = torch.where(strong, torch.full_like(x[name], -20.0), x[name])
    _check(x, dtype, form, **({"chunk_size": 16} if form == "chunkwise" else {}))


def test_fp16_operands_with_strong_gates():
    """"fp16" (the default for bf16 inputs) on fp16 inputs, both gates with exp(-20) steps, chunks of 16."""
    x = _sample(T=34, K=32, V=48, seed=3)
    gen = torch.Generator().manual_seed(6)
    for name in ("gk", "gv"):
        strong = torch.rand(x[name].shape, generator=gen, dtype=torch.float64) < 0.3
        x[name] = torch.where(strong, torch.full_like(x[name], -20.0), x[name])
    _check(x, torch.float16, "chunkwise", precision="fp16", chunk_size=16)


@pytest.mark.parametrize("form", FORMS)
def test_value_dim_100(form):
    """V = 100 with a value gate: two V blocks of 64, the second partial."""
    _check(_sample(T=9, V=100), torch.float16, form)


def test_gla_is_general_with_only_a_key_gate():
    """Both run the same kernels: identical bits."""
    x = {n: t.half() for n, t in _sample(T=20, gates="gk").items() if t is not None}
    o_general, s_general = kernel("general", "chunkwise")(**x, return_state=True)
    o_gla, s_gla = kernel("gla", "chunkwise")(q=x["q"], k=x["k"], v=x["v"], g=x["gk"], return_state=True)
    assert torch.equal(o_general, o_gla) and torch.equal(s_general, s_gla)


# --- backward (kernels/_gated.py, "Backward") ---------------------------------------------------------------


def _with_state(x: dict, seed: int = 40) -> dict:
    return with_state("general", x, seed)


def _strong(x: dict, seed: int) -> dict:
    """exp(-20) per step at random steps of both gates and on every other value channel."""
    gen = torch.Generator().manual_seed(seed)
    for name in ("gk", "gv"):
        strong = torch.rand(x[name].shape, generator=gen, dtype=torch.float64) < 0.3
        if name == "gv":
            strong[..., 1::2] = True
        x[name] = torch.where(strong, torch.full_like(x[name], -20.0), x[name])
    return x


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("gates", ["gk", "gv", ""], ids=["only-gk", "only-gv", "no-gate"])
def test_gradients_with_each_gate_absent(gates, form):
    """Three chunks of 16, the last partial; no gradient is returned for an absent gate."""
    check_gradients("general", form, _with_state(_sample(T=36, seed=41, gates=gates)), torch.float16,
                    **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gradients_across_chunks_with_strong_gates(form, dtype):
    """T = 50 (four chunks of 16, the last partial), both gates with exp(-20) steps, an initial state and
    both cotangents: dgk and dgv summed directly, every exponent <= 0."""
    x = _with_state(_strong(_sample(T=50, seed=42), seed=43))
    check_gradients("general", form, x, dtype, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("form", FORMS)
def test_gradients_at_one_position(form):
    check_gradients("general", form, _with_state(_sample(T=1, seed=44)), torch.float32)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_of_odd_head_dims(form):
    """K = 20, V = 24 with both gates: masked tiles on both sides of the state."""
    check_gradients("general", form, _with_state(_sample(T=21, K=20, V=24, seed=45)), torch.float16)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_of_the_final_state_alone(form):
    """do = 0: every gradient, the gates' included, comes from the final state's cotangent."""
    check_gradients("general", form, _with_state(_sample(T=37, seed=46)), torch.float16, with_do=False,
                    **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("precision", ["fp16", "input"])
def test_gradients_with_fp16_and_input_operands(precision):
    """The two modes that round fp32 operands hardest, both gates with exp(-20) steps."""
    check_gradients("general", "chunkwise", _with_state(_strong(_sample(T=34, seed=47), seed=48)), torch.float16,
                    precision=precision, chunk_size=16)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "auto"), (torch.float16, "split")], ids=["fp32", "fp16"])
def test_gradients_read_the_forwards_scores_at_twice_the_backwards_chunk(dtype, precision):
    """Forward chunks of 64, backward chunks of 32 (_gated.BACKWARD_CHUNK): the dv kernel reads each chunk's
    scores, diagonal included (the value gate's levels), from a diagonal block of the forward's tiles; both
    gates with exp(-20) steps, the last chunk partial."""
    check_gradients("general", "chunkwise", _with_state(_strong(_sample(T=77, seed=49), seed=50)), dtype,
                    chunk_size=64, precision=precision)
