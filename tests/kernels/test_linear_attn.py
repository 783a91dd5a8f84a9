"""linear_attn kernels (kernels/linear_attn.py) beyond the generic test: the identity map unnormalized
and normalized, T=1, non-power-of-two head dimensions over several V blocks (z written once), an fp16
state above fp16's range, every precision mode, feature precision and chunk size, bad options.
The backward (tests/test_kernel_gradients.py checks the registry's inputs) on the same cases, on do alone
and on the final state's cotangent alone (its causality: tests/test_kernel_gradients.py). CPU (Triton
interpreter), fp16 and fp32; bf16's fp16 features (feature_precision "fp16", bf16's "auto") on the CPU as the
GPU computes them (fp32 carriers of bf16 inputs, the output rounded to bf16 once) and on the GPU (``gpu``)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.kernel import kernel
from attnlab.kernels import linear_attn as linear_attn_kernels
from kernel_checks import ANY_PRECISION_EXCESS_BOUND, EXCESS_BOUND, STATE_BOUND, check_stateful_kernel
from attnlab.gradients import gradient_dtypes, gradient_floor, oracle_gradients
from attnlab.metrics import conditioning_floor, measure, measure_gradients, rel_err
from attnlab.properties.regressions import REGRESSIONS
from attnlab.properties.strategies import Case
from attnlab.registry import bounds_for


@pytest.fixture(autouse=True)
def _interpreter_tests_off_the_gpu(request):
    """The interpreter tests run where there is no GPU; the ``gpu`` tests where there is one (the plugin skips
    them elsewhere)."""
    if torch.cuda.is_available() and request.node.get_closest_marker("gpu") is None:
        pytest.skip("interpreter tests run where there is no GPU")

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


@pytest.mark.parametrize("precision, feature_precision", [
    ("split", "round"), ("tf32", "round"), ("ieee", "round"), ("split", "split"), ("split", "fp16"), ("tf32", "fp16"),
    ("split", "auto"),
])
def test_precision_modes(precision, feature_precision):
    """Under the interpreter fp32 dots are exact, so every mode must reach the bound here."""
    _check(_sample(T=40), torch.float16, "chunkwise", precision=precision, feature_precision=feature_precision,
           chunk_size=16)


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
        ("chunkwise", {"feature_precision": "bf16"}, "feature_precision must be one of"),
        ("chunkwise", {"chunk_size": 48}, "chunk_size must be one of"),
        ("recurrent", {"block_v": 24}, "block_v must be one of"),
    ],
)
def test_bad_options_raise(form, opts, message):
    with pytest.raises(ValueError, match=message):
        kernel("linear_attn", form, **opts)


def test_gpu_v_tiles_are_at_least_64(monkeypatch):
    """On the GPU (the interpreter off) the chunkwise V tile is at least 64 whatever V, and a smaller block_v is
    refused with a message that says why; the interpreter keeps every tile."""
    assert linear_attn_kernels._chunkwise_block_v(V=32, BK=64, block_v=16) == 16
    monkeypatch.setattr(linear_attn_kernels, "interpreter_active", lambda: False)
    assert linear_attn_kernels._chunkwise_block_v(V=32, BK=64, block_v=None) == 64
    assert linear_attn_kernels._chunkwise_block_v(V=300, BK=64, block_v=128) == 128
    x = {n: t.to(torch.float16) for n, t in _sample(T=20, K=16, V=48).items()}
    with pytest.raises(ValueError, match="block_v of at least 64 on the GPU"):  # as a user calls it, before any launch
        kernel("linear_attn", "chunkwise", block_v=32)(**x)


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
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64).to(dtype).double().to(o.device)
    if cotangents == "state":
        do = torch.zeros_like(do)
    d_final = None
    loss = (o.double() * do).sum()
    if cotangents != "do":
        d_final = tuple(torch.randn(p.shape, generator=generator, dtype=torch.float64).float().double().to(p.device)
                        for p in final)
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
                         [("split", "round"), ("tf32", "round"), ("ieee", "round"), ("split", "split"), ("split", "fp16")])
def test_backward_precision_modes(precision, feature_precision):
    """feature_precision="round" differentiates the function of the rounded features (dq measured 2.2 here): a
    speed setting, held to the bound of any precision choice; so is "fp16" on fp16 inputs (the same rounding,
    scaled; bf16's default, one rounding 8x below bf16's: the bf16 tests below)."""
    bound = ANY_PRECISION_EXCESS_BOUND if feature_precision in ("round", "fp16") else None
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


# ------------------------------------------------------------------------------------------------ bf16: fp16 features
#
# bf16's default ("auto" = "fp16"): elu1's features rounded once to fp16 (scaled per row by a power of two), the
# state entering phi(Q) S as fp16 hi + lo (module docstring). One fp16 rounding of a feature is 1/8 of bf16's, so
# even where few keys and features leave it unaveraged (T = 1, K = 7: properties/regressions.py, where fp16
# features cost fp16 outputs excess 2.84) it stays a small fraction of the bf16 output's floor.


def _regression_cases() -> list:
    return [c for cases in REGRESSIONS.values() for c in cases if c.name == "linear_attn"]


def _bf16_cases() -> list[tuple[str, dict, dict]]:
    """(id, inputs float64, call options): the regressions (T = 1, K = 7) both ways, few keys and features,
    several chunks, features above fp16's range (1e6) and below its subnormals (e^-40)."""
    cases = []
    for i, case in enumerate(_regression_cases()):
        for normalize in (False, True):
            cases.append((f"regression{i}-{'normalized' if normalize else 'plain'}", case.inputs(),
                          {**case.option_values, "normalize": normalize}))
    cases.append(("T3-K4", _sample(T=3, K=4, V=8, seed=1), {"normalize": False, "scale": 1.5}))
    # The worst of 240 draws at T <= 3, K <= 8 (bf16 on the CPU as here): 1.0086.
    worst = Case(name="linear_attn", seed=112, B=1, T=2, H=2, K=1, V=8, key_coherence=0.5, spread=4.0, scale=1.5)
    cases.append(("T2-K1", worst.inputs(), {**worst.option_values, "normalize": False}))
    cases.append(("T64-K16", _sample(T=64, K=16, V=32, H=4), {}))
    huge = _sample(T=40, K=16, V=16, seed=3)
    huge["q"], huge["k"] = 1e6 * huge["q"].abs(), 1e6 * huge["k"].abs()
    cases.append(("features-1e6", huge, {"normalize": False, "scale": 1e-12}))
    tiny = _sample(T=40, K=16, V=16, seed=4)
    tiny["q"], tiny["k"] = tiny["q"] - 40.0, tiny["k"] - 40.0
    cases.append(("features-e-40", tiny, {}))
    return cases


BF16_CASES = _bf16_cases()


def _bf16_excess(x: dict, call: dict, device: str, carry_fp32: bool, **opts) -> float:
    """Excess of the chunkwise kernel on x rounded to bf16 against the float64 oracle, over bf16's floor:
    on bf16 tensors, or (carry_fp32) on their fp32 carriers with the output rounded to bf16 once."""
    xb = {n: t.to(device=device, dtype=torch.bfloat16) for n, t in x.items()}
    inputs = {n: t.float() for n, t in xb.items()} if carry_fp32 else xb
    o = kernel("linear_attn", "chunkwise", **opts)(**inputs, **call).to(torch.bfloat16)
    reference = attnlab.oracle("linear_attn", "chunkwise", "float64")
    x64 = {**{n: t.double() for n, t in xb.items()}, **call}
    m = measure(o, reference(**x64), torch.bfloat16, conditioning_floor(reference, x64))
    assert m.nonfinite == 0, m.as_dict()
    return m.excess


@pytest.mark.parametrize("case", BF16_CASES, ids=[c[0] for c in BF16_CASES])
def test_fp16_features_as_on_the_gpu_in_bf16(case):
    """fp32 carriers of bf16 inputs with feature_precision="fp16" make the GPU's bf16 default's feature roundings
    (its dots are exact here, a little finer than the GPU's hi + lo); the output rounded to bf16 once."""
    _, x, call = case
    assert _bf16_excess(x, call, "cpu", carry_fp32=True, chunk_size=16, feature_precision="fp16") <= \
        EXCESS_BOUND[torch.bfloat16]


def test_fp16_features_keep_their_bits_below_fp16_subnormals():
    """fp16 inputs shifted to -14: features near e^-14 (8e-7, fp16-subnormal) lose most of their bits rounded to
    fp16 as they are ("round": excess 22); scaled per row by a power of two ("fp16") they keep all 11 (1.07)."""
    x = _sample(T=40)
    x["q"], x["k"] = x["q"] - 14.0, x["k"] - 14.0
    scaled = _check(x, torch.float16, "chunkwise", feature_precision="fp16", chunk_size=16)
    x16 = {n: t.to(torch.float16) for n, t in x.items()}
    reference = attnlab.oracle("linear_attn", "chunkwise", "float64")(**x16)
    rounded = measure(kernel("linear_attn", "chunkwise", feature_precision="round", chunk_size=16)(**x16), reference,
                      torch.float16).excess
    assert scaled <= EXCESS_BOUND[torch.float16] < ANY_PRECISION_EXCESS_BOUND < rounded


def test_feature_precision_auto_by_dtype():
    """"auto": fp16 features for bf16, split (hi + lo) for fp16, exact fp32 features for fp32; "fp16" on fp32
    inputs only when named; the identity map has no features to round."""
    mode = linear_attn_kernels._feature_mode
    assert mode(torch.bfloat16, "elu1", "auto") == "fp16"
    assert mode(torch.float16, "elu1", "auto") == "fp32"
    assert mode(torch.float32, "elu1", "auto") == "input"
    assert mode(torch.float32, "elu1", "split") == "input"
    assert mode(torch.float32, "elu1", "fp16") == "fp16"
    assert mode(torch.bfloat16, "elu1", "split") == "fp32"
    assert mode(torch.bfloat16, "elu1", "round") == "input"
    assert mode(torch.bfloat16, "identity", "fp16") == "input"


@pytest.mark.gpu
@pytest.mark.parametrize("case", BF16_CASES, ids=[c[0] for c in BF16_CASES])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_fp16_features_bf16_gpu(case, chunk_size):
    """bf16's default (fp16 features) against the float64 oracle, within bf16's accuracy bound, and "auto" is
    "fp16" for bf16."""
    _, x, call = case
    assert _bf16_excess(x, call, "cuda", carry_fp32=False, chunk_size=chunk_size, feature_precision="fp16") <= \
        EXCESS_BOUND[torch.bfloat16]
    xb = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in x.items()}
    run = lambda fp: kernel("linear_attn", "chunkwise", chunk_size=chunk_size, feature_precision=fp)(**xb, **call)
    assert torch.equal(run("auto"), run("fp16"))


@pytest.mark.gpu
@pytest.mark.parametrize("feature_precision", ["fp16", "split"])
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "plain"])
def test_bf16_wide_heads_gpu(feature_precision, normalize):
    """The bench's head size (K = V = 128: two V blocks of 64, 8 chunks of 64, from a state), each feature
    precision of bf16 within its accuracy bound."""
    x = {n: t.cuda() for n, t in _sample(T=500, K=128, V=128, H=2, seed=12).items()}
    state = tuple(p.cuda().float() for p in _state(2, 128, 128, seed=13))
    _, _, m = check_stateful_kernel("linear_attn", "chunkwise", {**x, "initial_state": state}, torch.bfloat16,
                                    {"normalize": normalize}, feature_precision=feature_precision)
    assert m.excess <= EXCESS_BOUND[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "plain"])
@pytest.mark.parametrize("T, K", [(1, 7), (45, 16), (300, 64)])
def test_backward_fp16_features_bf16_gpu(T, K, normalize):
    """bf16 gradients of the fp16 features (the backward differentiates the rounded features' function on their
    fp32 carriers, the forward's very states) within bf16's gradient bound."""
    x = {n: t.cuda() for n, t in _sample(T=T, K=K, V=32).items()}
    x["initial_state"] = tuple(p.cuda() for p in _state(2, K, 32, seed=14))
    _gradients(x, torch.bfloat16, "chunkwise", {"normalize": normalize}, feature_precision="fp16")
