"""linear_attn kernels (kernels/linear_attn.py) beyond the generic test: the identity map unnormalized
and normalized, T=1, non-power-of-two head dimensions over several V blocks (z written once), an fp16
state above fp16's range, every precision mode, feature precision and chunk size, bad options.
The backward (tests/test_kernel_gradients.py checks the registry's inputs) on the same cases, on do alone
and on the final state's cotangent alone (its causality: tests/test_kernel_gradients.py). CPU (Triton
interpreter), fp16 and fp32."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.kernel import kernel
from attnlab.kernels import linear_attn as linear_attn_kernels
from kernel_checks import ANY_PRECISION_EXCESS_BOUND, EXCESS_BOUND, STATE_BOUND, check_stateful_kernel
from attnlab.gradients import gradient_dtypes, gradient_floor, oracle_gradients
from attnlab.metrics import measure, measure_gradients, rel_err
from attnlab.registry import bounds_for

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


# ------------------------------------------------------------------------------------------------ backward


def _state(H: int, K: int, V: int, seed: int, size: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """An initial state (S, z) with z > 0, as a run of elu1 keys leaves it."""
    generator = torch.Generator().manual_seed(seed)
    return (size * torch.randn(1, H, K, V, dtype=torch.float64, generator=generator),
            size * (torch.rand(1, H, K, dtype=torch.float64, generator=generator) + 1.0))


def _small_chunks(form: str) -> dict[str, int]:
    """Chunks of 16 for the chunkwise kernel: short sequences still cross chunks."""
    return {"chunk_size": 16} if form == "chunkwise" else {}


def _gradients(x: dict, dtype: torch.dtype, form: str, call: dict | None = None, cotangents: str = "both",
               seed: int = 1, bound: float | None = None, **opts) -> dict[str, float]:
    """The kernel's gradients of <do, o> + <d_state, final state> on x rounded to dtype against the float64 oracle's:
    dtypes, shapes, finite, excess within ``bound``, by default the gradient bound (fp16 2) or the fp32 bound
    on default inputs (4).
    ``cotangents``: "both", "do" (no loss reads the final state) or "state" (do = 0). Returns the excess per
    gradient."""
    f = attnlab.formulation("linear_attn")
    x = {n: (t if n == "initial_state" else t.to(dtype)) for n, t in x.items()}
    if "initial_state" in x:
        x["initial_state"] = tuple(p.float() for p in x["initial_state"])
    x.update(call or {})
    leaves = {n: x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")}
    state = tuple(p.detach().clone().requires_grad_() for p in x.get("initial_state", ()))
    o, final = kernel("linear_attn", form, **opts)(**{**x, **leaves, **({"initial_state": state} if state else {})},
                                                   return_state=True)
    generator = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64).to(dtype).double()
    if cotangents == "state":
        do = torch.zeros_like(do)
    d_final = None
    loss = (o.double() * do).sum()
    if cotangents != "do":
        d_final = tuple(torch.randn(p.shape, generator=generator, dtype=torch.float64).float().double() for p in final)
        loss = loss + sum((p.double() * d).sum() for p, d in zip(final, d_final))
    got = torch.autograd.grad(loss, [*leaves.values(), *state])
    grads = dict(zip(leaves, got))
    for name, g in grads.items():
        assert g.dtype == dtype and g.shape == leaves[name].shape, (name, g.dtype, g.shape)
    if state:
        grads["initial_state"] = tuple(got[3:])
        assert all(g.dtype == torch.float32 and g.shape == p.shape for g, p in zip(grads["initial_state"], state))
    reference_inputs = {n: (tuple(p.double() for p in t) if n == "initial_state" else t) for n, t in x.items()}
    reference = oracle_gradients(f, reference_inputs, do, d_final)
    dtypes = gradient_dtypes(f, reference_inputs)
    dtypes.update({n: dtype for n in dtypes})  # q, k, v in dtype; the state's gradient built from dtype inputs
    floors = gradient_floor(f, reference_inputs, do, d_final, base=reference)
    bounds = bounds_for(f, str(dtype).removeprefix("torch."))
    if bound is None:
        bound = bounds.on_default_inputs if dtype == torch.float32 else bounds.gradient_accuracy
    measured = measure_gradients(grads, reference, dtypes, floors)
    for name, m in measured.items():
        assert m.nonfinite == 0 and m.excess <= bound, (name, m.as_dict())
    return {n: m.excess for n, m in measured.items()}


@pytest.mark.parametrize("form", FORMS)
def test_backward_single_step_from_a_state(form):
    x = {**_sample(T=1), "initial_state": _state(2, 16, 16, seed=2)}
    _gradients(x, torch.float16, form)
    _gradients(x, torch.float32, form)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("chunk_size", [16, 32, 64, 128])
def test_backward_chunk_sizes_and_partial_chunks(chunk_size, dtype):
    """T=45: a partial last chunk at every size (one partial chunk at 64 and 128); the state crosses chunks.
    fp32 without a final-state cotangent: dv within a chunk is a long sum (blocked_dot_f32)."""
    x = {**_sample(T=45), "initial_state": _state(2, 16, 16, seed=4)}
    _gradients(x, dtype, "chunkwise", cotangents="both" if dtype == torch.float16 else "do", chunk_size=chunk_size)


@pytest.mark.parametrize("form", FORMS)
def test_backward_head_dims_not_powers_of_two(form):
    """K=20, V=24 pad to 32: phi(0) = 1 must not leak from the padding into dq, dk or z's cotangent."""
    x = {**_sample(T=23, K=20, V=24), "initial_state": _state(2, 20, 24, seed=5)}
    _gradients(x, torch.float16, form, **_small_chunks(form))


@pytest.mark.parametrize("form", FORMS)
def test_backward_several_v_blocks(form):
    """V=100 in blocks of 16 (chunkwise) or 32 (recurrent): dq, dk sum over blocks, z's terms counted once."""
    x = {**_sample(T=19, K=20, V=100, H=1), "initial_state": _state(1, 20, 100, seed=6)}
    _gradients(x, torch.float16, form, block_v=16 if form == "chunkwise" else 32)


@pytest.mark.parametrize("precision, feature_precision",
                         [("split", "round"), ("tf32", "round"), ("ieee", "round"), ("split", "split")])
def test_backward_precision_modes(precision, feature_precision):
    """feature_precision="round" differentiates the function of the rounded features (dq measured 2.2 here): a
    speed setting, held to the bound of any precision choice."""
    bound = ANY_PRECISION_EXCESS_BOUND if feature_precision == "round" else None
    _gradients(_sample(T=40), torch.float16, "chunkwise", precision=precision, feature_precision=feature_precision,
               chunk_size=16, bound=bound)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("call", [
    {"feature_map": "identity", "normalize": False, "scale": 0.25},
    {"feature_map": "elu1", "normalize": False, "scale": 0.5},
], ids=["identity", "elu1"])
def test_backward_unnormalized(form, dtype, call):
    x = {**_sample(T=40), "initial_state": _state(2, 16, 16, seed=7)}
    _gradients(x, dtype, form, call, **_small_chunks(form))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_backward_takes_its_own_chunks_where_untied(dtype):
    """Unnormalized on the input tiles the backward recomputes the states at chunks of its own, whatever the
    forward's: here 128 rows after a forward at 16, over two full chunks and a partial one."""
    assert linear_attn_kernels._backward_chunk(16, 300, 16, normalize=False, fp32_features=False) == 128
    x = {**_sample(T=300), "initial_state": _state(2, 16, 16, seed=9)}
    _gradients(x, dtype, "chunkwise", {"feature_map": "identity", "normalize": False, "scale": 0.25}, chunk_size=16)


@pytest.mark.parametrize("form", FORMS)
def test_backward_identity_map_normalized(form):
    x = _sample(T=30)
    x["q"], x["k"] = x["q"] + 1.0, x["k"] + 1.0  # a positive-leaning denominator, as in the forward's test
    _gradients(x, torch.float32, form, {"feature_map": "identity"})


@pytest.mark.parametrize("stateful", [False, True], ids=["plain", "state"])
@pytest.mark.parametrize("cotangents", ["do", "state"])
@pytest.mark.parametrize("form", FORMS)
def test_backward_one_cotangent(form, cotangents, stateful):
    """do alone (no loss reads the final state) and the final state's cotangent alone (do = 0)."""
    x = {**_sample(T=37), **({"initial_state": _state(2, 16, 16, seed=8)} if stateful else {})}
    _gradients(x, torch.float16, form, cotangents=cotangents, **_small_chunks(form))


@pytest.mark.parametrize("form", FORMS)
def test_backward_fp16_state_beyond_fp16_range(form):
    """S, z ~ 1e6 (den far above fp16's 65504, as at long T): den, z and their cotangents stay fp32; the split
    dots rescale; nothing overflows."""
    x = {**_sample(T=20), "initial_state": _state(2, 16, 16, seed=3, size=1e6)}
    _gradients(x, torch.float16, form, **_small_chunks(form))


@pytest.mark.parametrize("form", FORMS)
def test_saving_for_the_backward_leaves_the_forward_unchanged(form):
    x = {n: t.to(torch.float16) for n, t in _sample(T=45).items()}
    run = kernel("linear_attn", form)
    plain, plain_state = run(**x, return_state=True)
    tracked, tracked_state = run(**{n: t.requires_grad_() for n, t in x.items()}, return_state=True)
    assert torch.equal(plain, tracked.detach())
    assert all(torch.equal(a, b.detach()) for a, b in zip(plain_state, tracked_state))
