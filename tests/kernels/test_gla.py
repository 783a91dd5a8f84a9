"""gla kernels (kernels/gla.py, kernels/_gated.py) beyond the generic test: strong gates, T=1,
head dimensions above one tile and not powers of two, an fp16 state above fp16's range,
every precision mode and chunk size, bad options; and the backward's gradients against the float64
oracle's in the same cases. CPU (Triton interpreter), fp16 and fp32."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.kernel import kernel
from kernel_checks import check_gradients, check_stateful_kernel, with_state

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run where there is no GPU")

# The targets of the generic test (tests/test_kernels.py): excess over max(rounding, conditioning) floor.
FORMS = ("chunkwise", "recurrent")


def _sample(T: int, K: int = 16, V: int = 16, B: int = 1, H: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    return attnlab.formulation("gla").sample(B=B, T=T, H=H, K=K, V=V, seed=seed)


def _check(x: dict, dtype: torch.dtype, form: str, **opts) -> float:
    """Run the kernel on x rounded to dtype; assert finite output, the excess bound and the final state.

    Returns the excess."""
    return check_stateful_kernel("gla", form, x, dtype, **opts)[2].excess


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gates_of_minus_20_stay_finite_and_exact(form, dtype):
    """Half the key channels decay by exp(-20) every step, the rest at random steps (three chunks of 16)."""
    x = _sample(T=40)
    g = x["g"]
    strong = torch.rand(g.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) < 0.3
    strong[..., ::2] = True
    x["g"] = torch.where(strong, torch.full_like(g, -20.0), g)
    _check(x, dtype, form, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("form", FORMS)
def test_head_dims_over_one_tile_and_not_powers_of_two(form):
    """K = V = 100: four K blocks of 32 and two V blocks of 64, the last of each partial."""
    _check(_sample(T=9, K=100, V=100), torch.float16, form)


@pytest.mark.parametrize("form", FORMS)
def test_fp16_state_above_fp16_range(form):
    """No decay and k = v = 60: the state reaches 40 * 3600 = 144000 > 65504, the outputs stay in range."""
    x = _sample(T=40)
    x["g"] = torch.zeros_like(x["g"])
    x["k"] = torch.full_like(x["k"], 60.0)
    x["v"] = 60.0 + x["v"]
    x["q"] = 0.01 * x["q"]
    _check(x, torch.float16, form, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("precision", ["auto", "fp16", "split", "tf32x3", "tf32", "ieee", "input"])
def test_precision_modes(precision):
    """Every mode meets the fp16 target here; "split" (the default for fp16 inputs) sits at the rounding floor.

    The interpreter computes tf32/tf32x3/ieee dots exactly in fp32; only the GPU shows their error.
    """
    excess = _check(_sample(T=16, seed=3), torch.float16, "chunkwise", precision=precision)
    if precision == "split":
        assert excess <= 1.05


def test_fp16_operands_on_strong_gates_and_a_large_state():
    """"fp16" (the default for bf16 inputs, which the interpreter cannot run) on fp16 inputs: its
    power-of-two scaling with exp(-20) gates and with a state above fp16's range, two chunks of 32."""
    x = _sample(T=40, K=48, V=32, seed=6)
    strong = torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64) < 0.3
    x["g"] = torch.where(strong, torch.full_like(x["g"], -20.0), x["g"])
    _check(x, torch.float16, "chunkwise", precision="fp16", chunk_size=32)
    x["g"] = torch.zeros_like(x["g"])
    x["k"] = torch.full_like(x["k"], 60.0)
    x["v"] = 60.0 + x["v"]
    x["q"] = 0.01 * x["q"]
    _check(x, torch.float16, "chunkwise", precision="fp16", chunk_size=32)


@pytest.mark.parametrize("precision", ["fp16", "split"])
def test_sub_chunks_of_full_chunks(precision):
    """Chunks of 64 (the default): the scores kernel's sub-chunk levels and its batched diagonal
    blocks, three chunks with the last partial, strong gates, h and A stored in scaled fp16 with "fp16"."""
    x = _sample(T=150, K=48, V=32, seed=8)
    strong = torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) < 0.2
    x["g"] = torch.where(strong, torch.full_like(x["g"], -20.0), x["g"])
    _check(x, torch.float16, "chunkwise", precision=precision, chunk_size=64)


def test_chunk_size_32_agrees_with_the_oracle():
    """Chunks of 16 run in the tests above, 64 in tests/test_kernels.py."""
    _check(_sample(T=45, seed=4), torch.float32, "chunkwise", chunk_size=32)


@pytest.mark.parametrize(
    "opts, message",
    [({"precision": "fp8"}, "precision"), ({"chunk_size": 48}, "chunk_size"), ({"num_warps": 3}, "num_warps")],
)
def test_bad_options_are_refused_before_launch(opts, message):
    with pytest.raises(ValueError, match=message):
        kernel("gla", "chunkwise", **opts)


def test_recurrent_takes_no_options():
    with pytest.raises(TypeError, match="chunk_size"):
        kernel("gla", "recurrent", chunk_size=16)


# --- backward (kernels/_gated.py, "Backward") ---------------------------------------------------------------


def _with_state(x: dict, seed: int = 20) -> dict:
    return with_state("gla", x, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gradients_across_chunks_and_segments(form, dtype):
    """T = 70: five chunks of 16, the last partial (chunkwise); two replay segments of the recurrent backward,
    the second partial; an initial state and both cotangents."""
    x = _with_state(_sample(T=70, seed=21))
    check_gradients("gla", form, x, dtype, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("form", FORMS)
def test_gradients_at_one_position(form):
    check_gradients("gla", form, _with_state(_sample(T=1, seed=22)), torch.float32)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_of_odd_head_dims(form):
    """K = 20, V = 24: masked tiles on both sides; a partial chunk of 32."""
    check_gradients("gla", form, _with_state(_sample(T=21, K=20, V=24, seed=23)), torch.float16)


@pytest.mark.parametrize("form", FORMS)
def test_gradients_of_head_dims_over_one_tile(form):
    """K = 40, V = 48 in blocks of 16 (chunkwise; the recurrent backward's V tiles are 32): the loops over
    K and V blocks, partial last blocks, and the per-V-block parts of dq, dk and dg."""
    opts = {"chunk_size": 16, "block_k": 16, "block_v": 16} if form == "chunkwise" else {}
    check_gradients("gla", form, _sample(T=12, K=40, V=48, seed=24), torch.float16, **opts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
def test_gradients_with_gates_of_minus_20(form, dtype):
    """exp(-20) per step on half the key channels and at random steps: every decay exponent stays <= 0,
    the gate's gradient is summed directly (no difference of cumulative sums)."""
    x = _sample(T=40, seed=25)
    strong = torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(26), dtype=torch.float64) < 0.3
    strong[..., ::2] = True
    x["g"] = torch.where(strong, torch.full_like(x["g"], -20.0), x["g"])
    check_gradients("gla", form, _with_state(x), dtype, **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("form", FORMS)
def test_gradients_of_the_final_state_alone(form):
    """do = 0: every gradient comes from the final state's cotangent (dq is exactly 0)."""
    check_gradients("gla", form, _with_state(_sample(T=37, seed=27)), torch.float16, with_do=False,
                    **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("form", FORMS)
def test_gradients_of_the_output_alone(form):
    """No loss reads the final state (its cotangent is None)."""
    check_gradients("gla", form, _sample(T=37, seed=28), torch.float16, with_d_state=False,
                    **({"chunk_size": 16} if form == "chunkwise" else {}))


@pytest.mark.parametrize("precision", ["auto", "fp16", "split", "tf32x3", "tf32", "ieee", "input"])
def test_gradients_in_every_precision_mode(precision):
    """Three chunks of 16, the last partial. "fp16" runs its power-of-two scaled fp16 dots in the backward's
    own kernels; the interpreter computes tf32/tf32x3/ieee dots exactly in fp32."""
    check_gradients("gla", "chunkwise", _with_state(_sample(T=33, seed=29)), torch.float16,
                    precision=precision, chunk_size=16)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "auto"), (torch.float16, "fp16")], ids=["fp32", "fp16"])
@pytest.mark.parametrize("chunk_size", [32, 64])
def test_gradients_in_chunks_of_32_and_64(chunk_size, dtype, precision):
    """Two forward chunks, the second partial. The backward takes chunks of at most 32 rows
    (_gated.BACKWARD_CHUNK) and reads the forward's scores: at 64 each backward chunk's pairs are a diagonal
    block of a forward tile ("fp16": scaled fp16 tiles, one inverse scale each)."""
    check_gradients("gla", "chunkwise", _with_state(_sample(T=chunk_size + 13, seed=30)), dtype,
                    chunk_size=chunk_size, precision=precision)


def test_fp16_state_cotangents_over_several_tiles():
    """"fp16" (bf16's default) keeps the backward's dh as fp16 tiles, one inverse scale per (chunk, K block,
    V block): K = 40, V = 48 in blocks of 16 (3 x 3 tiles, the last ones partial), gates of -20 on some key
    channels (tiles whose peaks differ by e^-20 and more), three chunks of 16, the last partial."""
    x = _sample(T=40, K=40, V=48, seed=31)
    x["g"][..., :8] = -20.0
    check_gradients("gla", "chunkwise", _with_state(x), torch.float16, precision="fp16", chunk_size=16,
                    block_k=16, block_v=16)
