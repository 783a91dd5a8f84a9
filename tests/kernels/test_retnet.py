"""retnet kernels (kernels/retnet.py) beyond the generic test: strong decays (g = -20 per step),
no decay, T=1, non-power-of-two head dimensions over several V blocks, an fp16 state above fp16's
range, every precision mode and chunk size, the expm1 helper, bad options. CPU (Triton
interpreter), fp16 and fp32."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

import attnlab
from attnlab.kernel import kernel
from kernel_checks import EXCESS_BOUND, STATE_BOUND, check_stateful_kernel
from attnlab.kernels.retnet import expm1
from attnlab.metrics import measure, rel_err

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
