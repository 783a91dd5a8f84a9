"""The registry: one entry per formulation of FORMULATIONS.md, in its order.

Default sampling distributions (all float64, drawn with a torch generator):
q, k, v ~ N(0, 1); for the delta rules q and k are unit-norm per head and
beta = sigmoid(N(0, 1)); log gates = logsigmoid(N(0, 1)); retnet's
g_h = log(1 - 2^(-5-h)); rwkv4's w = exp(N(0, 0.25)) and u ~ N(0, 0.25)
(variance 0.25, standard deviation 0.5); aft's pairwise bias w ~ N(0, 1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attnlab.spec import Arg, Dims, Formulation, Option, StabilityMap, StateSpec

__all__ = ["REGISTRY", "names", "formulation"]


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


def _q(unit: bool = False) -> Arg:
    return Arg("q", QK, "queries", unit_rows(*QK) if unit else gaussian(*QK))


def _k(unit: bool = False) -> Arg:
    return Arg("k", QK, "keys", unit_rows(*QK) if unit else gaussian(*QK))


def _v() -> Arg:
    return Arg("v", VO, "values", gaussian(*VO))


def _beta() -> Arg:
    return Arg("beta", BTH, "delta-rule write strength", sigmoid_beta(*BTH), **BETA)


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
    ),
    Formulation(
        name="linear_attn",
        title="linear attention",
        definition="S_t = S_{t-1} + phi(k_t) v_t^T, z_t = z_{t-1} + phi(k_t), "
        "o_t = phi(q_t)^T S_t / phi(q_t)^T z_t (normalize) or scale phi(q_t)^T S_t",
        args=(_q(), _k(), _v()),
        options=(
            Option("scale", 1.0, "output scale when normalize=False (cancels when normalized)"),
            Option("feature_map", "elu1", "phi: elu(x)+1 or identity", kind=str, choices=("elu1", "identity")),
            Option("normalize", True, "divide by phi(q_t)^T z_t", kind=bool),
        ),
        state=StateSpec(parts=(("S", S_KV), ("z", ("B", "H", "K"))), empty=(0.0, 0.0)),
        kernel_forms=("chunkwise", "recurrent"),
    ),
    Formulation(
        name="retnet",
        title="RetNet retention",
        definition="S_t = exp(g) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(), _k(), _v(), Arg("g", ("H",), "per-head log decay, log gamma", retnet_gamma, **LOG_GATE)),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP,),
    ),
    Formulation(
        name="gla",
        title="gated linear attention",
        definition="S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(), _k(), _v(), Arg("g", QK, "per-key-channel log gate", log_sigmoid_gate(*QK), **LOG_GATE)),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP,),
    ),
    Formulation(
        name="general",
        title="general gated form (outer-product gate)",
        definition="S_t = (exp(gk_t) exp(gv_t)^T) * S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(
            _q(),
            _k(),
            _v(),
            Arg("gk", QK, "key-side log gate", log_sigmoid_gate(*QK), optional=True, **LOG_GATE),
            Arg("gv", VO, "value-side log gate", log_sigmoid_gate(*VO), optional=True, **LOG_GATE),
        ),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(StabilityMap("gate", ("gk", "gv")),),
    ),
    Formulation(
        name="aft",
        title="attention-free transformer (AFT-full)",
        definition="o_t = sum_{i<=t} exp(w_{t,i} + k_i) * v_i / sum_{i<=t} exp(w_{t,i} + k_i)",
        args=(
            Arg("w", ("T", "T"), "pairwise position bias", gaussian("T", "T")),
            Arg("k", ("B", "T", "H", "D"), "keys", gaussian("B", "T", "H", "D")),
            Arg("v", ("B", "T", "H", "D"), "values", gaussian("B", "T", "H", "D")),
        ),
        options=(Option("causal", True, "mask keys after the query", kind=bool),),
        kernel_forms=("chunkwise",),
        dims_from_sizes=_aft_dims,
        notes="no finite state; D is the sampled V",
        stability=(SHIFT_MAP,),
    ),
    Formulation(
        name="rwkv4",
        title="RWKV-4 WKV",
        definition="o_t = (sum_{i<t} e^{-(t-1-i)w + k_i} v_i + e^{u+k_t} v_t) / (sum_{i<t} e^{-(t-1-i)w + k_i} + e^{u+k_t})",
        args=(
            Arg("w", ("C",), "decay rate (decay exp(-w))", rwkv_decay, low=0.0),
            Arg("u", ("C",), "current-token bonus", gaussian("C", std=0.5)),
            Arg("k", ("B", "T", "C"), "keys", gaussian("B", "T", "C")),
            Arg("v", ("B", "T", "C"), "values", gaussian("B", "T", "C")),
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
        stability=(SHIFT_MAP,),
    ),
    Formulation(
        name="deltanet",
        title="DeltaNet",
        definition="S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(_q(unit=True), _k(unit=True), _v(), _beta()),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(DELTA_MAP,),
    ),
    Formulation(
        name="gated_deltanet",
        title="Gated DeltaNet",
        definition="S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(
            _q(unit=True),
            _k(unit=True),
            _v(),
            Arg("g", BTH, "per-head log gate", log_sigmoid_gate(*BTH), **LOG_GATE),
            _beta(),
        ),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP, DELTA_MAP),
    ),
    Formulation(
        name="kda",
        title="Kimi Delta Attention",
        definition="S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)",
        args=(
            _q(unit=True),
            _k(unit=True),
            _v(),
            Arg("g", QK, "per-key-channel log gate", log_sigmoid_gate(*QK), **LOG_GATE),
            _beta(),
        ),
        options=(_scale,),
        state=_state_S,
        kernel_forms=("chunkwise", "recurrent"),
        stability=(GATE_MAP, DELTA_MAP),
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
