"""What the generic properties need to know about a formulation, read off its registry entry.

Every function takes a registry entry (attnlab.spec.Formulation) or a name, and derives its answer from the
entry alone, never from the name:

- arguments by role (``Arg.role``): log gates (decay ``exp(g)``), decay rates (RWKV-4's ``w``, decay
  ``exp(-w)``), write strengths (the delta rules' ``beta``; a formulation with one is a delta rule, whose keys
  are unit vectors), queries;
- an argument whose dims hold ``T`` is indexed by time (on the axis where ``T`` is);
- the facts of FORMULATIONS.md the properties rest on: ``Formulation.shift_invariant`` (inputs to which one
  constant added everywhere changes nothing: RWKV-4's and AFT's keys), ``Formulation.bilinear_logits``
  (softmax's exponent ``scale q.k``), ``Formulation.is_convex`` and ``Formulation.reductions`` (special cases,
  declared on the general entry).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.oracle import as_formulation
from attnlab.registry import REGISTRY
from attnlab.spec import Arg, Formulation, Tensors

# exp overflows above these inputs (numerics.md 4.5); the kernels' exps run in fp32.
EXP_OVERFLOW = {torch.float16: 11.09, torch.bfloat16: 88.72, torch.float32: 88.72}

Entry = Formulation | str


def is_log_gate(arg: Arg) -> bool:
    return arg.role == "log_gate"


def is_decay_rate(arg: Arg) -> bool:
    return arg.role == "decay_rate"


def is_write_strength(arg: Arg) -> bool:
    return arg.role == "write_strength"


def log_gate_args(f: Entry) -> tuple[Arg, ...]:
    """The arguments that set a decay: log gates and decay rates."""
    return as_formulation(f).args_with_role("log_gate", "decay_rate")


def is_delta_rule(f: Entry) -> bool:
    return bool(as_formulation(f).args_with_role("write_strength"))


def has_query(f: Entry) -> bool:
    return bool(as_formulation(f).args_with_role("query"))


def shift_invariant_args(f: Entry) -> tuple[str, ...]:
    """The inputs to which one constant added everywhere leaves ``o`` unchanged (the exponent is additive)."""
    return as_formulation(f).shift_invariant


def bilinear_logits(f: Entry) -> bool:
    """Whether the exponent is ``scale q.k``, so that large logits reach exp's overflow threshold."""
    return as_formulation(f).bilinear_logits


def time_axes(arg: Arg) -> tuple[int, ...]:
    """The axes of ``arg`` indexed by time (both for AFT's pairwise ``w [T, T]``)."""
    return tuple(i for i, d in enumerate(arg.dims) if d == "T")


def exp_overflow_applies(f: Entry) -> bool:
    """Whether some input of ``f`` can push an exponential of a naive implementation past overflow."""
    f = as_formulation(f)
    return bool(f.shift_invariant) or f.bilinear_logits or bool(log_gate_args(f))


def is_convex(f: Entry, options: Mapping[str, Any]) -> bool:
    """Whether each output is a convex combination of the values at the positions it reads (``options``
    fill in the defaults): softmax, AFT, RWKV-4, and linear attention with the elu+1 map, normalized."""
    return as_formulation(f).is_convex(options)


@dataclass(frozen=True)
class Reduction:
    """``special`` is ``general`` on the inputs ``to_general`` builds: a view of the registry's
    ``Formulation.reductions`` (declared on the general entry) that names both sides.

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


def reductions() -> tuple[Reduction, ...]:
    """Every special case the registry declares, in registry order of the general formulations."""
    return tuple(r for f in REGISTRY for r in reductions_of(f))


def reductions_of(general: Entry) -> tuple[Reduction, ...]:
    f = as_formulation(general)
    return tuple(Reduction(f.name, r.special, r.to_general, r.special_options) for r in f.reductions)
