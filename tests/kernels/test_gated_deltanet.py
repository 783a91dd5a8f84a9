"""gated_deltanet kernels (kernels/gated_deltanet.py, kernels/_delta.py) beyond the generic test:
g = 0 reproduces the deltanet kernels exactly, log gates of -20 per step stay finite and accurate,
beta at 2, T=1 from a state, non-power-of-two head dims, every chunk size.
CPU (Triton interpreter), fp16 and fp32."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.kernel import kernel
from attnlab.kernels import _delta
from attnlab.kernels._numerics import dot_precision as resolve_dot_precision
from attnlab.kernels._state_pass import StateOperands
from kernel_checks import check_gradients, check_stateful_kernel, with_state
from attnlab.metrics import rel_err, rounding_floor

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run where there is no GPU")

NAME = "gated_deltanet"
# The targets of the generic test (tests/test_kernels.py): excess over max(rounding, conditioning) floor.
FORMS = ("chunkwise", "recurrent")


def _sample(T: int, K: int = 16, V: int = 16, B: int = 1, H: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    return attnlab.formulation(NAME).sample(B=B, T=T, H=H, K=K, V=V, seed=seed)


def _check(x: dict, dtype: torch.dtype, form: str, **opts) -> None:
    """Run the kernel on x rounded to dtype; assert finite output, the excess bound and the final state."""
    check_stateful_kernel(NAME, form, x, dtype, **opts)


@pytest.mark.parametrize("form", FORMS)
def test_zero_gate_is_deltanet(form):
    """g = 0 runs the gated code path with every decay exactly 1: bit-identical to the deltanet kernel."""
    x = {n: t.half() for n, t in _sample(T=37, H=2).items()}
    x["g"] = torch.zeros_like(x["g"])
    opts = {"chunk_size": 16} if form == "chunkwise" else {}
    o, state = kernel(NAME, form, **opts)(**x, return_state=True)
    ungated = {n: t for n, t in x.items() if n != "g"}
    o_delta, state_delta = kernel("deltanet", form, **opts)(**ungated, return_state=True)
    assert torch.equal(o, o_delta) and torch.equal(state, state_delta)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gates_of_minus_20_stay_finite_and_exact(form, dtype):
    """A third of the steps (and every fourth) decay by exp(-20), beta = 2 on some: three chunks of 16."""
    x = _sample(T=40)
    generator = torch.Generator().manual_seed(1)
    strong = torch.rand(x["g"].shape, generator=generator, dtype=torch.float64) < 0.3
    strong[:, ::4] = True
    x["g"] = torch.where(strong, torch.full_like(x["g"], -20.0), x["g"])
    x["beta"] = torch.where(torch.rand(x["beta"].shape, generator=generator, dtype=torch.float64) < 0.2, 2.0, x["beta"])
    _check(x, dtype, form, **({"chunk_size": 16} if form == "chunkwise" else {}))


def test_every_gate_minus_20_in_a_long_chunk():
    """G reaches -1280 inside one 64-chunk: every exponent stays <= 0, the output stays finite and exact."""
    x = _sample(T=64)
    x["g"] = torch.full_like(x["g"], -20.0)
    _check(x, torch.float16, "chunkwise", chunk_size=64)


@pytest.mark.parametrize("form", FORMS)
def test_head_dims_not_powers_of_two(form):
    """K = 20 (one padded 32-wide tile) and V = 100 (two 64-column programs, the second partial)."""
    _check(_sample(T=19, K=20, V=100), torch.float16, form)


@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunk_sizes(chunk_size):
    """1, 2 and 4 diagonal blocks merged in the UT inverse; a partial last chunk."""
    _check(_sample(T=40), torch.float16, "chunkwise", chunk_size=chunk_size)


def test_fp16_state_pass_with_gates_of_minus_20():
    """Strong gates shrink rows of W and Qg by up to exp(-20 C) against their chunk's bound: rows
    below 2^-27 of it go subnormal or to 0 in fp16, but their products with S are then that much
    below the chunk's other terms, so the output stays finite and near bf16 rounding."""
    x = _sample(T=48, K=32, V=32)
    x["g"] = torch.where(torch.arange(48)[None, :, None] % 3 == 0, -20.0, x["g"])
    x = {n: t.half() for n, t in x.items()}
    ref = attnlab.oracle(NAME, "chunkwise", "float64")(**x)
    o = kernel(NAME, "chunkwise", chunk_size=16, precision="fp16")(**x)
    assert torch.isfinite(o).all() and rel_err(o, ref) <= 0.5 * rounding_floor(ref, torch.bfloat16)


def test_forms_agree_in_fp32():
    """The chunkwise and recurrent kernels compute one function: they agree to fp32 accuracy."""
    x = {n: t.float() for n, t in _sample(T=45, K=16, V=24, H=2).items()}
    o_chunk, s_chunk = kernel(NAME, "chunkwise", chunk_size=16)(**x, return_state=True)
    o_rec, s_rec = kernel(NAME, "recurrent")(**x, return_state=True)
    assert rel_err(o_chunk, o_rec) <= 1e-6 and rel_err(s_chunk, s_rec) <= 1e-6


def _prepared(x: dict[str, torch.Tensor], scale: float, precision: str, C: int = 16):
    """The state pass's operands as the delta rules' prepare kernel writes them for inputs x."""
    B, T, H, K = x["k"].shape
    dot_precision = resolve_dot_precision(precision)
    operands = StateOperands.allocate(B, H, -(-T // C), C, K, x["v"].shape[-1], torch.device("cpu"),
                                      dot_precision, scalar_gate=True)
    _delta._bind_prepare(x["q"], x["k"], x["v"], x["beta"], x["g"], scale, operands, C, dot_precision)()
    return operands


@pytest.mark.parametrize("scale", [0.3, -2.0])
def test_prepare_bounds_and_row_factors(scale):
    """kda's state pass takes its fp16 scales from the prepare kernel's per-chunk bounds, and in its
    SCALAR_GATE mode reads q and k themselves: the bounds must hold (|W| <= bounds[0], peak|q| and
    peak|k| exactly, |A_qk| <= bounds[3]), for a negative scale too; the row factors are scale
    exp(G_t) and exp(G_C - G_t) of the chunk-local gates (G_C: the last real step's); "fp16" stores W
    and A_qk scaled by their bound's power of two, below 2^14 and not wildly below it, and U scaled by
    its column peaks, each entry to fp16 rounding. Two heads, three chunks of 16, the last one partial,
    strong gates on a third of the steps."""
    x = {n: t.float() for n, t in _sample(T=45, K=64, V=16, H=2, seed=3).items()}
    x["g"] = torch.where(torch.arange(45)[None, :, None] % 3 == 0, -20.0, x["g"])
    exact = _prepared(x, scale, "ieee")
    rounded = _prepared(x, scale, "fp16")
    chunks = exact.bounds.shape[0]
    B, T, H, K = x["k"].shape

    def by_chunk(t: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B*H*chunks, 16 * ...], zero-padded
        t = torch.nn.functional.pad(t.movedim(2, 1), (0, 0) * (t.dim() - 3) + (0, 3))
        return t.reshape(chunks, -1)

    def chunk_peaks(rows: torch.Tensor) -> torch.Tensor:
        return rows.float().abs().reshape(chunks, -1).amax(dim=1)

    assert torch.equal(exact.bounds[:, 1], by_chunk(x["q"]).abs().amax(dim=1))
    assert torch.equal(exact.bounds[:, 2], by_chunk(x["k"]).abs().amax(dim=1))
    assert torch.all(chunk_peaks(exact.w) <= exact.bounds[:, 0]) and torch.all(chunk_peaks(exact.aqk) <= exact.bounds[:, 3])
    G = by_chunk(x["g"].double()).cumsum(dim=1)  # past the sequence end g = 0: the last row holds G_C
    real = by_chunk(torch.ones_like(x["g"])) > 0  # (the factors of padding rows meet q = k = 0 there)
    tiny = 2.0**-126  # fp32's smallest normal: factors below it are subnormal or 0 in fp32
    # exp of an fp32 exponent errs by |exponent| 2^-24 relative (|G| <= 16 * 21 here): 2e-5; a step too many
    # or too few in a sum would be off by at least e^0.02 (the weakest gate here, about -0.03).
    rtol = 2e-5
    assert by_chunk(x["g"]).abs().max() <= 21 and by_chunk(x["g"]).abs()[real].min() > 0.02
    q_factor, k_factor = exact.qg.reshape(chunks, -1).double(), exact.kd.reshape(chunks, -1).double()
    assert torch.allclose(q_factor[real], (scale * G.exp())[real], rtol=rtol, atol=tiny)
    assert torch.allclose(k_factor[real], (G[:, -1:] - G).exp()[real], rtol=rtol, atol=tiny)
    assert k_factor.max() <= 1.0
    for name, column in (("w", 0), ("aqk", 3)):
        stored = getattr(rounded, name)
        assert stored.dtype == torch.float16, name
        peaks = stored.float().abs().reshape(chunks, -1).amax(dim=1)
        assert torch.all(peaks < 2.0**14) and torch.all(peaks >= 2.0**4), name
    # U: fp32 under "ieee"; fp16 under "fp16", each (chunk, column) scaled by its own peak |U|, stored beside it.
    assert exact.u.dtype == torch.float32 and exact.u_peak is None
    u = exact.u.reshape(chunks, 16, -1)
    column_peaks = u.abs().amax(dim=1)
    assert rounded.u.dtype == torch.float16 and rounded.u_peak.shape == column_peaks.shape
    # "fp16" makes U from split products of a split inverse (about 2^-16 relative each, 0.8 * 2^-16 of the
    # peak measured here) where "ieee" is exact: 2^-14 allows four such errors, then fp16's rounding (2^-11).
    assert torch.allclose(rounded.u_peak, column_peaks, rtol=2.0**-14, atol=0.0)
    up = torch.exp2(13.0 - torch.floor(torch.log2(rounded.u_peak)))[:, None, :]
    stored = rounded.u.float().reshape(chunks, 16, -1)
    assert torch.all(stored.abs().amax(dim=1) >= 2.0**13) and torch.all(stored.abs() <= 2.0**14)
    assert torch.all((stored / up - u).abs() <= 2.0**-11 * u.abs() + 2.0**-14 * column_peaks[:, None, :])


# --------------------------------------------------------------------------- the recurrent backward


def _with_state(x: dict, seed: int = 20) -> dict:
    return with_state(NAME, x, seed)


def _strong_gates(x: dict, seed: int) -> dict:
    """A third of the steps (and every fourth) decay by exp(-20), beta = 2 on a fifth."""
    generator = torch.Generator().manual_seed(seed)
    strong = torch.rand(x["g"].shape, generator=generator, dtype=torch.float64) < 0.3
    strong[:, ::4] = True
    g = torch.where(strong, torch.full_like(x["g"], -20.0), x["g"])
    beta = torch.where(torch.rand(x["beta"].shape, generator=generator, dtype=torch.float64) < 0.2, 2.0, x["beta"])
    return {**x, "g": g, "beta": beta}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gradients_across_segments(dtype):
    """T = 70: two replay segments of 64, the second partial; an initial state, both cotangents, two heads."""
    check_gradients(NAME, "recurrent", _with_state(_sample(T=70, H=2, seed=21)), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gradients_with_gates_of_minus_20(dtype):
    """Every exponent is a log gate (<= 0); dg is each step's own sum, so steps decayed by exp(-20) keep
    an accurate dg where a reverse cumulative sum would leave it a rounding residue."""
    check_gradients(NAME, "recurrent", _with_state(_strong_gates(_sample(T=40, seed=25), seed=26)), dtype)


def test_gradients_at_one_position():
    check_gradients(NAME, "recurrent", _with_state(_sample(T=1, seed=22)), torch.float32)


@pytest.mark.parametrize("block_v", [None, 16])
def test_gradients_of_odd_head_dims(block_v):
    """K = 20, V = 24: masked tiles on both sides; with block_v = 16 two V blocks, the second partial, whose
    parts of dq, dk, dbeta and dg are added after."""
    check_gradients(NAME, "recurrent", _with_state(_sample(T=21, K=20, V=24, seed=23)), torch.float16,
                    block_v=block_v)


def test_gradients_of_the_final_state_alone():
    """do = 0: every gradient comes from the final state's cotangent (dq is exactly 0)."""
    check_gradients(NAME, "recurrent", _with_state(_sample(T=37, seed=27)), torch.float16, with_do=False)


def test_gradients_of_the_output_alone():
    """No loss reads the final state (its cotangent is None)."""
    check_gradients(NAME, "recurrent", _sample(T=37, seed=28), torch.float16, with_d_state=False)


def test_zero_gate_gradients_are_deltanet():
    """g = 0: the gated dual multiplies by exp(0) = 1, so every gradient but dg is deltanet's, bit for bit."""
    x = {n: t.half() for n, t in _with_state(_sample(T=37, H=2, seed=29)).items()}
    x["g"] = torch.zeros_like(x["g"])
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(30)).half()
    d_state = torch.randn(x["initial_state"].shape, generator=torch.Generator().manual_seed(31))

    def gradients(name: str, inputs: dict) -> dict:
        leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
        o, final = kernel(name, "recurrent")(**leaves, return_state=True)
        return dict(zip(leaves, torch.autograd.grad((o, final), list(leaves.values()), (do, d_state))))

    gated = gradients(NAME, x)
    ungated = gradients("deltanet", {n: t for n, t in x.items() if n != "g"})
    for name, g in ungated.items():
        assert torch.equal(gated[name], g), name
