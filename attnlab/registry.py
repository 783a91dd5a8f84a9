"""The registry: one entry per formulation of FORMULATIONS.md, in its order.

Default sampling distributions (all float64, drawn with a torch generator):
q, k, v ~ N(0, 1); for the delta rules q and k are unit-norm per head and
beta = sigmoid(N(0, 1)); log gates = logsigmoid(N(0, 1)); retnet's
g_h = log(1 - 2^(-5-h)); rwkv4's w = exp(N(0, 0.25)) and u ~ N(0, 0.25)
(variance 0.25, standard deviation 0.5); aft's pairwise bias w ~ N(0, 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from attnlab.spec import (Arg, Bounds, Convention, Dims, Formulation, Option, Peer, Reduction, StabilityMap, StateSpec,
                          Tensors)

__all__ = ["REGISTRY", "BOUNDS", "names", "formulation", "bounds_for"]


def _shape(dims: Dims, symbols: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(dims[s] for s in symbols)


def gaussian(*symbols: str, std: float = 1.0):
    def draw(dims: Dims, gen: torch.Generator) -> torch.Tensor:
        return std * torch.randn(_shape(dims, symbols), generator=gen, dtype=torch.float64)

    return draw


def unit_rows(*symbols: str):
    """Gaussian vectors normalized to unit 2-norm along the last axis."""

    def draw(dims: Dims, gen: torch.Generator) -> torch.Tensor:
        x = torch.randn(_shape(dims, symbols), generator=gen, dtype=torch.float64)
        return x / x.norm(dim=-1, keepdim=True)

    return draw


def log_sigmoid_gate(*symbols: str):
    def draw(dims: Dims, gen: torch.Generator) -> torch.Tensor:
        return F.logsigmoid(torch.randn(_shape(dims, symbols), generator=gen, dtype=torch.float64))

    return draw


def sigmoid_beta(*symbols: str):
    def draw(dims: Dims, gen: torch.Generator) -> torch.Tensor:
        return torch.sigmoid(torch.randn(_shape(dims, symbols), generator=gen, dtype=torch.float64))

    return draw


def retnet_gamma(dims: Dims, gen: torch.Generator) -> torch.Tensor:
    heads = torch.arange(dims["H"], dtype=torch.float64)
    return torch.log1p(-torch.pow(2.0, -5.0 - heads))


def rwkv_decay(dims: Dims, gen: torch.Generator) -> torch.Tensor:
    return torch.exp(0.5 * torch.randn(dims["C"], generator=gen, dtype=torch.float64))


QK = ("B", "T", "H", "K")
VO = ("B", "T", "H", "V")
BTH = ("B", "T", "H")
S_KV = ("B", "H", "K", "V")

_scale = Option("scale", None, "query scale; None means K ** -0.5")
_state_S = StateSpec(parts=(("S", S_KV),), empty=(0.0,))

LOG_GATE = dict(low=None, high=0.0)
BETA = dict(low=0.0, high=2.0)

GATE_MAP = StabilityMap("gate", ("g",))
DELTA_MAP = StabilityMap("delta", ("k", "beta"))
SHIFT_MAP = StabilityMap("shift", ("k",))

# Every verdict's bounds, by output dtype (a registry entry's ``bounds`` may override one): the one table that
# properties/checks.py, the kernel tests (tests/kernels/kernel_checks.py), attnlab validate, selftest, report and map
# read, through bounds_for. Excess = rel_err / max(floor_round, floor_cond) (attnlab.metrics): held <= accuracy <
# imprecise <= correctness < failed. fp16 and bf16 accuracy are the project's targets; the fp32 accuracy bound and
# every correctness bound are measured (each entry's ``why``; docs/FORMULATIONS.md, "Bounds"). The correctness
# bound sits near the geometric middle between the largest excess of correct reduced-precision kernels and the
# smallest excess by which the selftest caught a defect (attnlab selftest prints both per dtype).
GRADIENTS_WHY = ("gradients: the forward's bounds until measured otherwise (issue 22's starting point: bf16 1.5, fp16 2, "
                 "fp32 48 accuracy; correctness as the forward's). Each gradient's excess is over the larger of its "
                 "rounding floor (the float64 gradient rounded once to the dtype it is returned in) and its "
                 "conditioning floor (inputs and cotangents perturbed at fp32 roundoff), which keeps the cancelling "
                 "sums of gate and beta gradients honest. Measured on an H100 in bf16: fla 0.6.0 chunk_delta_rule dq "
                 "2.9, dk 3.7, dv 2.5, dbeta 3.0 (imprecise), chunk_gla 1.05-1.14; SDPA flash dq 1.5, memory-efficient "
                 "1.8-1.9, cuDNN 1.5, math 1.0 (DESIGN.md, 'Gradients')")

BOUNDS: dict[str, Bounds] = {
    "float16": Bounds(accuracy=2.0, correctness=16.0, state=2.0**-10,
                      why="accuracy: one fp16 rounding of the output plus fp16 operands of the tensor-core products "
                          "(the project's target). correctness 16: correct reduced-precision kernels stay within 4 "
                          "(kernel_checks.ANY_PRECISION_EXCESS_BOUND; fla 0.6.0 measured 1.4 to 2.9, the same ratios "
                          "as in bf16); the selftest's defects first measured 114 and more (kda_gate_after_update, "
                          "matches_oracle; CPU, `attnlab selftest --only specimens --dtypes float16`): 4x above the "
                          "one, 7x below the other (their geometric middle is 21). " + GRADIENTS_WHY,
                      gradient_accuracy=2.0, gradient_correctness=16.0),
    "bfloat16": Bounds(accuracy=1.5, correctness=8.0, state=2.0**-7,
                       why="accuracy: one bf16 rounding of the output; fp16 intermediates where the range allows (the "
                           "project's target). correctness 8: correct reduced-precision kernels stay within 4 (fla "
                           "0.6.0's forward measured up to 2.9, deltanet on an H100; attnlab's speed settings are held "
                           "to 4); the selftest's defects measured 15 and more (kda_gate_after_update, matches_oracle; "
                           "the specimens run on the CPU: `attnlab selftest --only specimens --dtypes bfloat16`): 2x "
                           "above the one, 1.9x below the other (their geometric middle is 7.7). The naive RWKV-4 "
                           "exp(k) loop accumulating in bf16 measures 4.7 on matches_oracle (imprecise) and is failed "
                           "by overflow. " + GRADIENTS_WHY,
                       gradient_accuracy=1.5, gradient_correctness=8.0),
    "float32": Bounds(accuracy=48.0, correctness=32768.0, state=1e-5, default_inputs=4.0,
                      why="accuracy 48: both floors are one fp32 rounding, while fp32 algorithms accumulate T steps "
                          "and K-term products. Measured on the CPU (Triton interpreter, T <= 64, K, V <= 16): "
                          "attnlab's fp32 kernels, chunkwise and recurrent, every formulation, on the registry's "
                          "inputs <= 3.2, on the property suite's adversarial strategies <= 22.2 (gated_deltanet "
                          "chunkwise with no decay, beta = 2, keys of coherence 0.999, T = 64; deltanet chunkwise "
                          "20.0, kda 12.4, general recurrent on retnet's inputs 15.1, every other kernel <= 5.7); "
                          "the fp32 oracle forms (attnlab.oracle(name, form, 'float32')) <= 10.6 on the registry's "
                          "inputs (gla's parallel form) and <= 35.8 on the adversarial ones (gated_deltanet's "
                          "parallel form, gates to -16). 48 is 2.2x "
                          "the largest kernel figure. correctness 32768: correct reduced-precision kernels on fp32 "
                          "inputs reach 6.5e3 (the delta rules' precision='fp16', registry inputs; tf32 dots, "
                          "2^13 u_fp32, would be about 2.5e4, to be measured on a GPU); the selftest's defects measured "
                          "8.3e4 and more (softmax_default_scale_one, overflow; `attnlab selftest --only specimens "
                          "--dtypes float32`): 5x above the one, 2.5x below the other (their geometric middle is "
                          "2.3e4). " + GRADIENTS_WHY,
                      gradient_accuracy=48.0, gradient_correctness=32768.0),
}


def bounds_for(f: Formulation, dtype: str) -> Bounds:
    """The bounds ``f``'s outputs in ``dtype`` (a dtype name: "bfloat16") are judged by."""
    return f.bounds.get(dtype, BOUNDS[dtype])


def _q(unit: bool = False) -> Arg:
    return Arg("q", QK, "queries", unit_rows(*QK) if unit else gaussian(*QK), role="query")


def _k(unit: bool = False) -> Arg:
    return Arg("k", QK, "keys", unit_rows(*QK) if unit else gaussian(*QK), role="key")


def _v() -> Arg:
    return Arg("v", VO, "values", gaussian(*VO), role="value")


def _beta() -> Arg:
    return Arg("beta", BTH, "delta-rule write strength", sigmoid_beta(*BTH), role="write_strength", **BETA)


def _log_gate(dims: tuple[str, ...], doc: str, **kw) -> Arg:
    return Arg("g", dims, doc, log_sigmoid_gate(*dims), role="log_gate", **LOG_GATE, **kw)


# --- special cases (Formulation.reductions): the special case's call -> the general formulation's call


def _query_key_value(x: Tensors) -> Tensors:
    return {n: x[n] for n in ("q", "k", "v", "scale") if n in x}


def _gla_as_general(x: Tensors) -> Tensors:
    return {**_query_key_value(x), "gk": x["g"]}


def _retnet_as_general(x: Tensors) -> Tensors:
    gk = x["g"][None, None, :, None].expand_as(x["q"]).contiguous()
    return {**_query_key_value(x), "gk": gk, "gv": torch.zeros_like(x["v"])}


def _linear_as_general(x: Tensors) -> Tensors:
    # linear_attn's default scale is 1.0, general's K ** -0.5: pass it explicitly.
    return {"q": x["q"], "k": x["k"], "v": x["v"], "scale": x.get("scale", LINEAR_ATTN_SCALE)}


def _with_zero_gate_like(reference: str) -> Callable[[Tensors], Tensors]:
    return lambda x: {**x, "g": torch.zeros_like(x[reference])}


def _gated_deltanet_as_kda(x: Tensors) -> Tensors:
    return {**x, "g": x["g"][..., None].expand_as(x["q"]).contiguous()}


LINEAR_ATTN_SCALE = 1.0

# --- third-party peers: flash-linear-attention 0.6.0 (fla.ops) and torch


def _fla(function: str, label: str = "", bench: bool = False, our_options: tuple[tuple[str, Any], ...] = (),
         module: str = "fla.ops", **convention: Any) -> Peer:
    """fla 0.6.0's ``function``: it returns (o, final state), the state in fp32, asked for with output_final_state."""
    calling = dict(state_keyword="initial_state", final_state_flag="output_final_state", returns="o_state",
                   state_dtype=torch.float32)
    calling.update(convention)
    return Peer("fla", f"{module}:{function}", Convention(f"fla:{function}", **calling),
                label=label or f"fla {function}", our_options=our_options, bench=bench)


# fla 0.6.0's linear attention (fla/ops/linear_attn/{chunk,fused_recurrent}.py): the state is S alone when
# normalize=False; when normalized, the tuple (S, z) with the normalizer z (running key sum) as [B, 1, H, K].
_FLA_LINEAR_STATE = dict(feature_map_outside=True, carries=(("normalize=False", ("S",)),), part_unsqueeze={"z": 1})

# torch SDPA's calling convention: head-first [B, H, T, D], q, k, v positional, causal as is_causal, returns o.
# Shared by SDPA itself and by attnlab.third_party's pinned backends and FlexAttention, which are called alike.
SDPA_CONVENTION = Convention("torch:sdpa", layout="BHTD", positional=("q", "k", "v"), names={"causal": "is_causal"},
                             state_keyword=None, final_state_flag=None, returns="o")

SDPA = Peer("torch", "torch.nn.functional:scaled_dot_product_attention", SDPA_CONVENTION, label="torch SDPA")


def _torch(function: str, label: str, bench: bool = False) -> Peer:
    """attnlab.third_party's ``function``: one of torch's softmax kernels pinned, called like SDPA."""
    return Peer("torch", f"attnlab.third_party:{function}", SDPA_CONVENTION, label=label, bench=bench)


# SDPA with each backend pinned, and FlexAttention (compiled, causal block mask): validated forward and backward.
# The bench's peer is the flash backend (FlashAttention-2), the same algorithm as attnlab's kernel: unpinned SDPA
# picks whichever backend torch prefers on the machine.
TORCH_PINNED = (
    _torch("sdpa_flash", "torch SDPA (flash)", bench=True),
    _torch("sdpa_efficient", "torch SDPA (memory-efficient)"),
    _torch("sdpa_cudnn", "torch SDPA (cuDNN)"),
    _torch("sdpa_math", "torch SDPA (math)"),
    _torch("flex_attention_causal", "torch FlexAttention (compiled, causal block mask)"),
)


def _aft_dims(B: int, T: int, H: int, K: int, V: int) -> dict[str, int]:
    return {"B": B, "T": T, "H": H, "D": V}


def _rwkv_dims(B: int, T: int, H: int, K: int, V: int) -> dict[str, int]:
    return {"B": B, "T": T, "C": H * V}


REGISTRY: tuple[Formulation, ...] = (
    Formulation(
        name="softmax",
        title="softmax attention",
        definition="o_t = sum_{i<=t} exp(scale q_t.k_i) v_i / sum_{i<=t} exp(scale q_t.k_i)",
        args=(_q(), _k(), _v()),
        options=(_scale, Option("causal", True, "mask keys after the query", kind=bool)),
        kernel_forms=("chunkwise",),
        notes="no finite state; recurrent form is the KV-cache loop; chunkwise is the online softmax",
        convex_when=(),
        bilinear_logits=True,
        peers=(
            SDPA,
            *TORCH_PINNED,
            _fla("parallel_attn", implied={"causal": True}, state_keyword=None, final_state_flag=None, returns="o",
                 state_dtype=None),
        ),
    ),
    Formulation(
        name="linear_attn",
        title="linear attention",
        definition="S_t = S_{t-1} + phi(k_t) v_t^T, z_t = z_{t-1} + phi(k_t), "
        "o_t = phi(q_t)^T S_t / phi(q_t)^T z_t (normalize) or scale phi(q_t)^T S_t",
        args=(_q(), _k(), _v()),
        options=(
            Option("scale", LINEAR_ATTN_SCALE, "output scale when normalize=False (cancels when normalized)"),
            Option("feature_map", "elu1", "phi: elu(x)+1 or identity", kind=str, choices=("elu1", "identity")),
            Option("normalize", True, "divide by phi(q_t)^T z_t", kind=bool),
        ),
        state=StateSpec(parts=(("S", S_KV), ("z", ("B", "H", "K"))), empty=(0.0, 0.0),
                        words=("the key-value sum S", "the normalizer z")),
        kernel_forms=("chunkwise", "recurrent"),
        convex_when=(("feature_map", "elu1"), ("normalize", True)),
        linear_in_query_when=(("feature_map", "identity"), ("normalize", False)),
        peers=(
            _fla("chunk_linear_attn", bench=True, our_options=(("feature_map", "identity"), ("normalize", False)),
                 **_FLA_LINEAR_STATE),
            _fla("fused_recurrent_linear_attn", **_FLA_LINEAR_STATE),
        ),
    ),
    Formulation(
        name="retnet",
        linear_in_query_when=(),
        title="RetNet retention",
        definition="S_t = exp(g) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(), _k(), _v(), Arg("g", ("H",), "per-head log decay, log gamma", retnet_gamma, role="log_gate",
                                   **LOG_GATE)),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP,),
        peers=(
            _fla("chunk_simple_gla", label="fla chunk_simple_gla(g_gamma)", bench=True, names={"g": "g_gamma"},
                 arg_dtypes={"g": torch.float32}),
            _fla("chunk_retention", derived=("g",)),
        ),
    ),
    Formulation(
        name="gla",
        linear_in_query_when=(),
        title="gated linear attention",
        definition="S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(), _k(), _v(), _log_gate(QK, "per-key-channel log gate")),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP,),
        peers=(_fla("chunk_gla", bench=True), _fla("fused_recurrent_gla", names={"g": "gk"})),
    ),
    Formulation(
        name="general",
        linear_in_query_when=(),
        title="general gated form (outer-product gate)",
        definition="S_t = (exp(gk_t) exp(gv_t)^T) * S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(
            _q(),
            _k(),
            _v(),
            Arg("gk", QK, "key-side log gate", log_sigmoid_gate(*QK), role="log_gate", optional=True, **LOG_GATE),
            Arg("gv", VO, "value-side log gate", log_sigmoid_gate(*VO), role="log_gate", optional=True, **LOG_GATE),
        ),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(StabilityMap("gate", ("gk", "gv")),),
        reductions=(
            Reduction("gla", _gla_as_general),
            Reduction("retnet", _retnet_as_general),
            Reduction("linear_attn", _linear_as_general, (("feature_map", "identity"), ("normalize", False))),
        ),
        peers=(_fla("fused_recurrent_gla", label="fla fused_recurrent_gla(gk, gv)", bench=True),),
    ),
    Formulation(
        name="aft",
        title="attention-free transformer (AFT-full)",
        definition="o_t = sum_{i<=t} exp(w_{t,i} + k_i) * v_i / sum_{i<=t} exp(w_{t,i} + k_i)",
        args=(
            Arg("w", ("T", "T"), "pairwise position bias", gaussian("T", "T"), role="bias"),
            Arg("k", ("B", "T", "H", "D"), "keys", gaussian("B", "T", "H", "D"), role="key"),
            Arg("v", ("B", "T", "H", "D"), "values", gaussian("B", "T", "H", "D"), role="value"),
        ),
        options=(Option("causal", True, "mask keys after the query", kind=bool),),
        kernel_forms=("chunkwise",),
        dims_from_sizes=_aft_dims,
        notes="no finite state; D is the sampled V",
        stability=(SHIFT_MAP,),
        convex_when=(),
        shift_invariant=("k",),
    ),
    Formulation(
        name="rwkv4",
        title="RWKV-4 WKV",
        definition="o_t = (sum_{i<t} e^{-(t-1-i)w + k_i} v_i + e^{u+k_t} v_t) / (sum_{i<t} e^{-(t-1-i)w + k_i} + e^{u+k_t})",
        args=(
            Arg("w", ("C",), "decay rate (decay exp(-w))", rwkv_decay, role="decay_rate", low=0.0),
            Arg("u", ("C",), "current-token bonus", gaussian("C", std=0.5), role="bias"),
            Arg("k", ("B", "T", "C"), "keys", gaussian("B", "T", "C"), role="key"),
            Arg("v", ("B", "T", "C"), "values", gaussian("B", "T", "C"), role="value"),
        ),
        state=StateSpec(
            parts=(("a", ("B", "C")), ("b", ("B", "C")), ("p", ("B", "C"))),
            empty=(0.0, 0.0, -math.inf),
            log_scale=(False, False, True),
        ),
        kernel_forms=("chunkwise", "recurrent"),
        dims_from_sizes=_rwkv_dims,
        notes="state (a, b, p): numerator e^p a, denominator e^p b; C is the sampled H * V",
        naive_options=(("stable", False),),
        form_options={"recurrent": (Option("stable", True, "the running-maximum loop; False: the naive exp(k) "
                                                            "accumulation, which overflows", kind=bool),)},
        stability=(SHIFT_MAP,),
        convex_when=(),
        shift_invariant=("k",),
        peers=(
            _fla("fused_recurrent_rwkv4", module="fla.ops.rwkv4", bench=True, positional=("w", "u", "k", "v"),
                 decay_rate_as_log=True, stacked_state=True, arg_dtypes={"w": torch.float32, "u": torch.float32},
                 state_keyword="state", final_state_flag=None),
        ),
    ),
    Formulation(
        name="deltanet",
        linear_in_query_when=(),
        title="DeltaNet",
        definition="S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(unit=True), _k(unit=True), _v(), _beta()),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(DELTA_MAP,),
        peers=(_fla("chunk_delta_rule", bench=True), _fla("fused_recurrent_delta_rule")),
    ),
    Formulation(
        name="gated_deltanet",
        linear_in_query_when=(),
        title="Gated DeltaNet",
        definition="S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(unit=True), _k(unit=True), _v(), _log_gate(BTH, "per-head log gate"), _beta()),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP, DELTA_MAP),
        reductions=(Reduction("deltanet", _with_zero_gate_like("beta")),),
        peers=(_fla("chunk_gated_delta_rule", bench=True), _fla("fused_recurrent_gated_delta_rule")),
    ),
    Formulation(
        name="kda",
        linear_in_query_when=(),
        title="Kimi Delta Attention",
        definition="S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(unit=True), _k(unit=True), _v(), _log_gate(QK, "per-key-channel log gate"), _beta()),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP, DELTA_MAP),
        reductions=(
            Reduction("deltanet", _with_zero_gate_like("q")),
            Reduction("gated_deltanet", _gated_deltanet_as_kda),
        ),
        peers=(_fla("chunk_kda", bench=True), _fla("fused_recurrent_kda")),
    ),
)

_BY_NAME = {f.name: f for f in REGISTRY}


def names() -> list[str]:
    """The ten formulation names, in FORMULATIONS.md's order."""
    return [f.name for f in REGISTRY]


def formulation(name: str) -> Formulation:
    """The registry entry of ``name``; a ValueError lists the known names otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown formulation {name!r}; expected one of {', '.join(names())}") from None
