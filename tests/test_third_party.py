"""torch's softmax kernels pinned (attnlab.third_party) and their registry peers.

On the CPU: SDPA's math backend (and torch's CPU flash kernel, which pinning FLASH_ATTENTION selects on CPU
tensors), called through the registry's peer and its convention, matches the float64 oracle forward and
backward in float32 at tiny sizes (measured: forward ~1e-7, gradients ~2e-7 relative); the CUDA-only backends
decline CPU tensors with NotImplementedError naming the backend; FlexAttention refuses the backward on the CPU (torch
has none there) before compiling. Its CPU forward compiles through inductor's C++ backend in about 45 s a shape
on this 2-core CPU, so it is tested only under the ``slow`` marker.
"""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab import third_party
from attnlab.conventions import peer_adapter
from attnlab.gradients import oracle_gradients
from attnlab.metrics import rel_err
from attnlab.registry import SDPA, SDPA_CONVENTION

SOFTMAX = attnlab.formulation("softmax")
FUNCTIONS = ("sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention_causal")
ON_CPU = {"sdpa_math": 3, "sdpa_flash": 4}  # the pins that run on CPU tensors -> V (flash needs K == V)
CUDA_ONLY = {"sdpa_efficient": "memory-efficient", "sdpa_cudnn": "cuDNN"}
TOL = 1e-5  # float32 against float64: one fp32 rounding is 6e-8; T = 7 steps and D = 4 products stay far below


def peer(function: str):
    return SOFTMAX.peer("torch", function)


def inputs(dtype: torch.dtype = torch.float32, causal: bool = True, seed: int = 0, V: int = 3) -> dict:
    """Tiny float32 inputs; K != V by default (the math backend takes it, flash needs K == V)."""
    x = SOFTMAX.sample(B=2, T=7, H=2, K=4, V=V, seed=seed)
    return {**{n: t.to(dtype) for n, t in x.items()}, "causal": causal}


def test_registry_lists_each_torch_kernel_once() -> None:
    torch_peers = [p for p in SOFTMAX.peers if p.library == "torch"]
    attributes = [p.attribute for p in torch_peers]
    for function in FUNCTIONS:
        assert attributes.count(function) == 1, function
        p = peer(function)
        assert p.function == f"attnlab.third_party:{function}" and p.library == "torch" and p.label
        assert p.convention is SDPA_CONVENTION and p.bench == (function == "sdpa_flash")
        assert callable(getattr(third_party, function))
    # The bench times attnlab against FlashAttention-2 itself, not whichever backend unpinned SDPA picks.
    assert SOFTMAX.bench_peer is peer("sdpa_flash") and SDPA.convention is SDPA_CONVENTION
    assert len({p.label for p in torch_peers}) == len(torch_peers)


@pytest.mark.parametrize("function", sorted(ON_CPU))
@pytest.mark.parametrize("causal", (True, False))
def test_forward_through_the_peer_matches_the_oracle(function: str, causal: bool) -> None:
    x = inputs(causal=causal, V=ON_CPU[function])
    o = peer_adapter(peer(function), SOFTMAX)(**x)
    reference = attnlab.oracle("softmax", "chunkwise", "float64")(**{**x, **{n: x[n].double() for n in "qkv"}})
    assert o.shape == x["v"].shape and o.dtype == torch.float32
    assert rel_err(o.double(), reference) < TOL


@pytest.mark.parametrize("function", sorted(ON_CPU))
@pytest.mark.parametrize("causal", (True, False))
def test_gradients_through_the_peer_match_the_oracle(function: str, causal: bool) -> None:
    x = inputs(causal=causal, seed=1, V=ON_CPU[function])
    leaves = {n: x[n].clone().requires_grad_() for n in "qkv"}
    o = peer_adapter(peer(function), SOFTMAX)(**{**x, **leaves})
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    grads = torch.autograd.grad(o, [leaves[n] for n in "qkv"], do.to(o.dtype))
    reference = oracle_gradients("softmax", x, do)
    assert set(reference) == set("qkv")
    for n, g in zip("qkv", grads):
        assert g.dtype == torch.float32 and g.shape == x[n].shape
        assert rel_err(g.double(), reference[n]) < TOL, n


def test_scale_is_passed_through() -> None:
    x = {**inputs(), "scale": 0.3}
    o = peer_adapter(peer("sdpa_math"), SOFTMAX)(**x)
    reference = attnlab.oracle("softmax", "chunkwise", "float64")(**{**x, **{n: x[n].double() for n in "qkv"}})
    assert rel_err(o.double(), reference) < TOL


@pytest.mark.parametrize("function", sorted(CUDA_ONLY))
def test_cuda_only_backends_refuse_cpu_tensors_clearly(function: str) -> None:
    x = inputs()
    with pytest.raises(NotImplementedError, match=rf"pinned to the {CUDA_ONLY[function]} backend .*on cpu.*CUDA only"):
        peer_adapter(peer(function), SOFTMAX)(**x)


def test_flash_refuses_what_it_cannot_take_naming_torch_s_reason() -> None:
    x = inputs(V=3)  # K = 4, V = 3: no flash kernel takes different head dims
    with pytest.raises(NotImplementedError, match=r"pinned to the flash backend .*same last dimension") as error:
        peer_adapter(peer("sdpa_flash"), SOFTMAX)(**x)
    assert "Triggered internally" not in str(error.value)


def test_flex_attention_refuses_the_backward_on_cpu_before_compiling() -> None:
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    with pytest.raises(NotImplementedError, match="FlexAttention .*no FlexAttention backward on the CPU"):
        third_party.flex_attention_causal(q, k, v)
    assert third_party._flex.cache_info().currsize == 0  # refused before any block mask or compile


@pytest.mark.slow
def test_flex_attention_forward_on_cpu_matches_the_oracle() -> None:
    x = inputs()
    with torch.no_grad():
        o = peer_adapter(peer("flex_attention_causal"), SOFTMAX)(**x)
    reference = attnlab.oracle("softmax", "chunkwise", "float64")(**{**x, **{n: x[n].double() for n in "qkv"}})
    assert rel_err(o.double(), reference) < TOL
