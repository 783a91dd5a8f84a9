"""Conventions as data: adapters reproduce attnlab's convention, and detection finds unusual ones."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.conventions import ATTNLAB, Convention, adapt, detect, fla_convention
from attnlab.metrics import rel_err

TOL = 1e-12


def _oracle(name):
    return attnlab.oracle(name, "recurrent")


def fla_style_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """gla in flash-linear-attention's convention: keywords, (o, final_state or None)."""
    o, state = _oracle("gla")(q=q, k=k, v=v, g=g, scale=scale, initial_state=initial_state, return_state=True)
    return o, (state if output_final_state else None)


def fla_style_rwkv4(w, u, k, v, state):
    """rwkv4 in fla's convention: positional, decay exp(-exp(w)), state [B, 3, 1, C]."""
    a, b, p = state[:, 0, 0], state[:, 1, 0], state[:, 2, 0]
    o, (a, b, p) = _oracle("rwkv4")(w=torch.exp(w), u=u, k=k, v=v, initial_state=(a, b, p), return_state=True)
    return o, torch.stack([a, b, p], dim=1)[:, :, None]


def unusual_kda(q, k, v, decay, beta, initial_state=None):
    """kda called positionally, gates as decay factors, scale always 1, state [V, K], returns (o, state)."""
    state = None if initial_state is None else initial_state.transpose(-1, -2)
    o, final = _oracle("kda")(q=q, k=k, v=v, g=torch.log(decay), beta=beta, scale=1.0, initial_state=state, return_state=True)
    return o, final.transpose(-1, -2)


def sample(name, T=12):
    return attnlab.formulation(name).sample(B=1, T=T, H=2, K=4, V=3, seed=3)


def test_attnlab_convention_is_the_identity():
    x = sample("gla")
    adapted = adapt(_oracle("gla"), ATTNLAB, "gla")
    assert torch.equal(adapted(**x), _oracle("gla")(**x))


def test_fla_convention_adapter_matches_the_oracle_with_state():
    x = sample("gla")
    adapted = adapt(fla_style_gla, fla_convention("gla", "chunk_gla"), "gla")
    o, state = adapted(**x, return_state=True)
    ref, ref_state = _oracle("gla")(**x, return_state=True)
    assert rel_err(o, ref) <= TOL and rel_err(state, ref_state) <= TOL
    o2 = adapted(**x, initial_state=ref_state)  # fla takes its state in fp32
    assert rel_err(o2, _oracle("gla")(**x, initial_state=ref_state.float())) <= TOL


def test_fla_rwkv4_convention_translates_decay_and_stacked_state():
    x = sample("rwkv4")
    seen = {}

    def recording(w, u, k, v, state):
        seen.update(w=w.dtype, u=u.dtype, state=(state.dtype, tuple(state.shape), state[:, 2].max().item()))
        return fla_style_rwkv4(w, u, k, v, state)

    adapted = adapt(recording, fla_convention("rwkv4", "fused_recurrent_rwkv4"), "rwkv4")
    o, (a, b, p) = adapted(**x, return_state=True)
    # fla takes log w and u in fp32 (arg_dtypes), and the empty state stacked [B, 3, 1, C] with p = -1e38.
    log_zero = torch.tensor(-1e38, dtype=torch.float32).item()
    assert seen == {"w": torch.float32, "u": torch.float32, "state": (torch.float32, (1, 3, 1, 6), log_zero)}
    used = {**x, "w": torch.exp(torch.log(x["w"]).float()).double(), "u": x["u"].float().double()}  # what fla saw
    ref, (ra, rb, rp) = _oracle("rwkv4")(**used, return_state=True)
    assert rel_err(o, ref) <= TOL
    assert rel_err(torch.exp(p) * a, torch.exp(rp) * ra) <= TOL and rel_err(torch.exp(p) * b, torch.exp(rp) * rb) <= TOL


def test_fixed_scale_and_implied_options_are_enforced():
    x = sample("kda")
    convention = Convention("unusual", positional=("q", "k", "v", "g", "beta"), gates="linear", scale=1.0, returns="o_state")
    adapted = adapt(unusual_kda, convention, "kda")
    assert rel_err(adapted(**x, scale=1.0), _oracle("kda")(**x, scale=1.0)) <= TOL
    with pytest.raises(ValueError, match=r"unusual always uses scale=1; got scale=0.5"):
        adapted(**x)  # the registry default, K ** -0.5 = 0.5
    soft = sample("softmax")
    parallel = adapt(lambda q, k, v, scale=None: _oracle("softmax")(q=q, k=k, v=v, scale=scale), fla_convention("softmax", "parallel_attn"), "softmax")
    assert rel_err(parallel(**soft), _oracle("softmax")(**soft)) <= TOL
    with pytest.raises(ValueError, match=r"always computes with causal=True"):
        parallel(**soft, causal=False)


def test_detect_finds_the_convention_of_an_unusual_kernel():
    x = sample("kda")
    found = detect(unusual_kda, "kda", x, tolerance=1e-10)
    assert found.convention is not None
    c = found.convention
    assert (c.gates, c.scale, c.returns, c.positional, c.state) == ("linear", 1.0, "o_state", ("q", "k", "v", "g", "beta"), "VK")
    assert math.isinf(found.errors["auto(gates=log, scale=pass, returns=attnlab, keywords)"])


def test_detect_says_plainly_when_nothing_matches():
    def wrong(q, k, v, g, beta, **_):
        return torch.zeros_like(v)

    found = detect(wrong, "kda", sample("kda"), tolerance=1e-3)
    assert found.convention is None and len(found.errors) == 36
    assert all(e >= 1e-3 for e in found.errors.values())


def test_bind_does_every_conversion_up_front_and_its_call_is_the_kernel_call():
    """retnet's fla chunk_simple_gla: g renamed g_gamma and passed in fp32 (arg_dtypes), the scale resolved."""
    f = attnlab.formulation("retnet")
    x = {n: t.half() for n, t in sample("retnet").items()}
    calls = []

    def chunk_simple_gla(q, k, v, g_gamma, scale=None, initial_state=None, output_final_state=False):
        calls.append((q, k, v, g_gamma, scale))
        o = _oracle("retnet")(q=q, k=k, v=v, g=g_gamma, scale=scale)
        return o.half(), None

    bound = adapt(chunk_simple_gla, f.peer("fla", "chunk_simple_gla").convention, f).bind(**x)
    assert bound.args == () and set(bound.kwargs) == {"q", "k", "v", "g_gamma", "scale"}
    assert bound.kwargs["g_gamma"].dtype == torch.float32 and bound.kwargs["q"] is x["q"]
    assert bound.kwargs["scale"] == 4**-0.5 and not calls
    o = bound.result(bound())
    assert len(calls) == 1 and o.dtype == torch.float16
    assert rel_err(o, _oracle("retnet")(**x)) <= 1e-3


def _sdpa_peer():
    return attnlab.formulation("softmax").peer("torch", "scaled_dot_product_attention")


def test_head_first_layout_transposes_every_time_and_head_tensor_and_the_output():
    seen = {}

    def head_first(q, k, v, scale=None, is_causal=False):
        seen.update(shape=tuple(q.shape), is_causal=is_causal)
        o = _oracle("softmax")(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), scale=scale,
                               causal=is_causal)
        return o.transpose(1, 2)

    x = sample("softmax")
    adapted = adapt(head_first, _sdpa_peer().convention, "softmax")
    assert rel_err(adapted(**x), _oracle("softmax")(**x)) <= TOL
    assert seen == {"shape": (1, 2, 12, 4), "is_causal": True}  # [B, H, T, K]; causal renamed is_causal


def test_the_sdpa_peer_through_its_declared_convention_is_softmax():
    from attnlab.conventions import peer_adapter

    x = sample("softmax")
    assert rel_err(peer_adapter(_sdpa_peer(), "softmax")(**x), _oracle("softmax")(**x)) <= TOL


def test_fla_conventions_are_the_registry_peers():
    from attnlab.conventions import FLA

    for f in attnlab.REGISTRY:
        fla = {p.attribute: p.convention for p in f.peers if p.library == "fla"}
        assert FLA.get(f.name, {}) == fla
        for function, convention in fla.items():
            assert fla_convention(f, function) is convention
