"""What the generic properties need to know about a formulation, derived from the registry.

Most of it is read off the registry entry (attnlab.registry):

- an argument with ``high == 0`` and no ``low`` is a log gate (decay ``exp(g)``);
- an argument with ``low == 0`` and no ``high`` is a decay rate (RWKV-4's ``w``,
  decay ``exp(-w)``);
- an argument bounded to ``[0, 2]`` is a delta-rule write strength (``beta``);
  a formulation with one is a delta rule, whose keys are unit vectors;
- an argument whose dims hold ``T`` is indexed by time (on the axis where ``T`` is).

Three facts of FORMULATIONS.md are not in the registry yet and are listed
here, in one table each (a registry proposal: ``Formulation.exp_inputs``,
``Formulation.convex`` and ``Formulation.reductions``; see the report of
issue 4):

- ``ADDITIVE_LOGITS``: inputs that enter an exponential additively, so that
  one constant added to all of them changes nothing (RWKV-4 and AFT keys);
- ``BILINEAR_LOGITS``: formulations whose exponent is ``scale q.k`` (softmax);
- ``is_convex``: outputs that are convex combinations of the values.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.registry import formulation
from attnlab.spec import Arg, Formulation

# exp overflows above these inputs (numerics.md 4.5); the kernels' exps run in fp32.
EXP_OVERFLOW = {torch.float16: 11.09, torch.bfloat16: 88.72, torch.float32: 88.72}

ADDITIVE_LOGITS: dict[str, tuple[str, ...]] = {"rwkv4": ("k",), "aft": ("k",)}
BILINEAR_LOGITS: frozenset[str] = frozenset({"softmax"})


def is_log_gate(arg: Arg) -> bool:
    return arg.high == 0.0 and arg.low is None


def is_decay_rate(arg: Arg) -> bool:
    return arg.low == 0.0 and arg.high is None


def is_write_strength(arg: Arg) -> bool:
    return arg.low == 0.0 and arg.high == 2.0


def log_gate_args(f: Formulation) -> tuple[Arg, ...]:
    return tuple(a for a in f.args if is_log_gate(a) or is_decay_rate(a))


def is_delta_rule(f: Formulation) -> bool:
    return any(is_write_strength(a) for a in f.args)


def has_query(f: Formulation) -> bool:
    return "q" in f.arg_names


def time_axes(arg: Arg) -> tuple[int, ...]:
    """The axes of ``arg`` indexed by time (both for AFT's pairwise ``w [T, T]``)."""
    return tuple(i for i, d in enumerate(arg.dims) if d == "T")


def exp_overflow_applies(name: str) -> bool:
    """Whether some input of ``name`` can push an exponential of a naive implementation past overflow."""
    f = formulation(name)
    return name in ADDITIVE_LOGITS or name in BILINEAR_LOGITS or bool(log_gate_args(f))


def is_convex(name: str, options: Mapping[str, Any]) -> bool:
    """Whether each output is a convex combination of the values at the positions it reads.

    True for softmax, AFT, RWKV-4, and linear attention with the positive
    elu+1 feature map, normalized.
    """
    if name in ("softmax", "aft", "rwkv4"):
        return True
    if name == "linear_attn":
        f = formulation(name)
        feature_map = options.get("feature_map", f.option("feature_map").default)
        normalize = options.get("normalize", f.option("normalize").default)
        return feature_map == "elu1" and bool(normalize)
    return False


Tensors = dict[str, Any]


def _query_key_value(x: Tensors) -> Tensors:
    return {n: x[n] for n in ("q", "k", "v", "scale") if n in x}


def _gla_as_general(x: Tensors) -> Tensors:
    return {**_query_key_value(x), "gk": x["g"]}


def _retnet_as_general(x: Tensors) -> Tensors:
    gk = x["g"][None, None, :, None].expand_as(x["q"]).contiguous()
    return {**_query_key_value(x), "gk": gk, "gv": torch.zeros_like(x["v"])}


def _linear_as_general(x: Tensors) -> Tensors:
    # linear_attn's default scale is 1.0, general's K ** -0.5: pass it explicitly.
    scale = x.get("scale", formulation("linear_attn").option("scale").default)
    return {"q": x["q"], "k": x["k"], "v": x["v"], "scale": scale}


def _deltanet_as_gated(x: Tensors) -> Tensors:
    return {**x, "g": torch.zeros_like(x["beta"])}


def _deltanet_as_kda(x: Tensors) -> Tensors:
    return {**x, "g": torch.zeros_like(x["q"])}


def _gated_deltanet_as_kda(x: Tensors) -> Tensors:
    return {**x, "g": x["g"][..., None].expand_as(x["q"]).contiguous()}


@dataclass(frozen=True)
class Reduction:
    """``special`` is ``general`` on the inputs ``to_general`` builds (FORMULATIONS.md, test_oracles.py).

    ``to_general`` maps the special case's call (tensors and options, any
    dtype) to the general formulation's; ``special_options`` are the options
    the special case must be drawn with.
    """

    general: str
    special: str
    to_general: Callable[[Tensors], Tensors]
    special_options: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.general}->{self.special}"


REDUCTIONS: tuple[Reduction, ...] = (
    Reduction("general", "gla", _gla_as_general),
    Reduction("general", "retnet", _retnet_as_general),
    Reduction("general", "linear_attn", _linear_as_general, (("feature_map", "identity"), ("normalize", False))),
    Reduction("gated_deltanet", "deltanet", _deltanet_as_gated),
    Reduction("kda", "deltanet", _deltanet_as_kda),
    Reduction("kda", "gated_deltanet", _gated_deltanet_as_kda),
)


def reductions_of(general: str) -> tuple[Reduction, ...]:
    return tuple(r for r in REDUCTIONS if r.general == general)
