"""linear_attn kernels (kernels/linear_attn.py) beyond the generic test: the identity map unnormalized
and normalized, T=1, non-power-of-two head dimensions over several V blocks (z written once), an fp16
state above fp16's range, every precision mode, feature precision and chunk size, bad options.
CPU (Triton interpreter), fp16 and fp32."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.kernel import kernel
from kernel_checks import EXCESS_BOUND, STATE_BOUND, check_stateful_kernel
from attnlab.metrics import measure, rel_err

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run where there is no GPU")

# The targets of the generic test (tests/test_kernels.py): excess over max(rounding, conditioning) floor.
FORMS = ("chunkwise", "recurrent")


def _sample(T: int, K: int = 16, V: int = 16, H: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    return attnlab.formulation("linear_attn").sample(B=1, T=T, H=H, K=K, V=V, seed=seed)


def _check(x: dict, dtype: torch.dtype, form: str, call: dict | None = None, **opts) -> float:
    """Run the kernel on x rounded to dtype; assert finite output, excess and final state (S, z) within the bounds."""
    return check_stateful_kernel("linear_attn", form, x, dtype, call, **opts)[2].excess


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_identity_map_unnormalized(form, dtype):
    _check(_sample(T=40), dtype, form, {"feature_map": "identity", "normalize": False, "scale": 0.25})


@pytest.mark.parametrize("form", FORMS)
def test_elu1_unnormalized(form):
    _check(_sample(T=40), torch.float16, form, {"normalize": False, "scale": 0.5})


@pytest.mark.parametrize("form", FORMS)
def test_identity_map_normalized_stays_finite(form):
    """phi(q)^T z can be small with the identity map; the error is judged against the conditioning floor."""
    x = _sample(T=30)
    x["q"], x["k"] = x["q"] + 1.0, x["k"] + 1.0  # a positive-leaning denominator, as the oracle keeps finite
    _check(x, torch.float32, form, {"feature_map": "identity"})


@pytest.mark.parametrize("form", FORMS)
def test_single_step_from_a_state(form):
    x = _sample(T=1)
    generator = torch.Generator().manual_seed(2)
    x["initial_state"] = (
        torch.randn(1, 2, 16, 16, dtype=torch.float64, generator=generator),
        torch.rand(1, 2, 16, dtype=torch.float64, generator=generator) + 1.0,
    )
    _check(x, torch.float16, form)
    _check(x, torch.float32, form)


@pytest.mark.parametrize("form", FORMS)
def test_head_dims_not_powers_of_two_over_several_v_blocks(form):
    """K=20 pads to 32 (phi(0)=1 must not leak into the padding); V=100 spans several V blocks, z is written once."""
    _check(_sample(T=19, K=20, V=100, H=1), torch.float16, form)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_chunk_sizes(chunk_size):
    _check(_sample(T=45), torch.float16, "chunkwise", chunk_size=chunk_size)


@pytest.mark.parametrize("precision, feature_precision", [("split", "round"), ("tf32", "round"), ("ieee", "round"), ("split", "split")])
def test_precision_modes(precision, feature_precision):
    """Under the interpreter fp32 dots are exact, so every mode must reach the bound here."""
    _check(_sample(T=40), torch.float16, "chunkwise", precision=precision, feature_precision=feature_precision, chunk_size=16)


def test_split_features_beat_rounded_features_at_small_k():
    """feature_precision="split" removes the u/sqrt(K) cost of rounding phi to fp16 (largest at small K)."""
    x = _sample(T=64, K=16, V=32, H=4)
    rounded = _check(x, torch.float16, "chunkwise", feature_precision="round")
    split = _check(x, torch.float16, "chunkwise", feature_precision="split")
    assert split <= 1.01 < rounded


@pytest.mark.parametrize("form", FORMS)
def test_fp16_state_beyond_fp16_range(form):
    """S ~ 1e6 and z ~ 1e6 (fp16 tops out at 65504): the split dots rescale, nothing overflows."""
    x = _sample(T=20)
    generator = torch.Generator().manual_seed(3)
    x["initial_state"] = (
        1e6 * torch.randn(1, 2, 16, 16, dtype=torch.float64, generator=generator),
        1e6 * (torch.rand(1, 2, 16, dtype=torch.float64, generator=generator) + 1.0),
    )
    _check(x, torch.float16, form)


def test_resume_mid_chunk_fp16():
    """Split at t=23 (inside the second chunk of 16) and pass the fp32 state (S, z) on."""
    x = {n: t.to(torch.float16) for n, t in _sample(T=50).items()}
    run = kernel("linear_attn", "chunkwise", chunk_size=16)
    whole, whole_state = run(**x, return_state=True)
    o1, s1 = run(**{n: t[:, :23] for n, t in x.items()}, return_state=True)
    o2, s2 = run(**{n: t[:, 23:] for n, t in x.items()}, initial_state=s1, return_state=True)
    ref = attnlab.oracle("linear_attn", "chunkwise", "float64")(**x)
    m = measure(torch.cat([o1, o2], dim=1), ref, torch.float16)
    assert m.excess <= EXCESS_BOUND[torch.float16], m.as_dict()
    assert rel_err(s2, whole_state) <= STATE_BOUND[torch.float16]


@pytest.mark.parametrize(
    "form, opts, message",
    [
        ("chunkwise", {"precision": "bf16"}, "precision must be one of"),
        ("chunkwise", {"feature_precision": "fp32"}, "feature_precision must be one of"),
        ("chunkwise", {"chunk_size": 48}, "chunk_size must be one of"),
        ("recurrent", {"block_v": 24}, "block_v must be one of"),
    ],
)
def test_bad_options_raise(form, opts, message):
    with pytest.raises(ValueError, match=message):
        kernel("linear_attn", form, **opts)
