"""The declarative pieces a registry entry is made of (PyTorch's OpInfo is the model).

A :class:`Formulation` lists its tensor arguments (:class:`Arg`: symbolic
shape, valid range, default sampling distribution), its scalar options
(:class:`Option`), its state (:class:`StateSpec`) and where its oracle and
kernel modules live. Everything generic (validation, sampling, the oracle and
kernel front ends, tests, reports, the CLI) is driven by these entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

FORMS = ("recurrent", "parallel", "chunkwise")

Dims = Mapping[str, int]
Sampler = Callable[[Dims, torch.Generator], torch.Tensor]


@dataclass(frozen=True)
class Arg:
    """A tensor argument of a formulation.

    ``dims`` is its symbolic shape (``("B", "T", "H", "K")``); ``low`` and
    ``high`` bound every element inclusively; ``optional`` arguments may be
    ``None`` (``general``'s gates).
    """

    name: str
    dims: tuple[str, ...]
    doc: str
    sample: Sampler
    low: float | None = None
    high: float | None = None
    optional: bool = False
    allow_neg_inf: bool = False

    @property
    def range_text(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in [{self.low:g}, {self.high:g}]"
        if self.low is not None:
            return f">= {self.low:g}"
        if self.high is not None:
            return f"<= {self.high:g}"
        return "finite"


@dataclass(frozen=True)
class Option:
    """A non-tensor keyword argument (``scale``, ``causal``, ``feature_map``...)."""

    name: str
    default: Any
    doc: str
    kind: type = float
    choices: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class StateSpec:
    """The recurrent state: one or more named tensors.

    A single part is passed and returned as a tensor, several as a tuple in
    this order. ``empty`` is each part's value in the zero (initial) state;
    ``log_scale`` parts may hold ``-inf`` (RWKV-4's ``p``, log of zero).
    """

    parts: tuple[tuple[str, tuple[str, ...]], ...]
    empty: tuple[float, ...]
    log_scale: tuple[bool, ...] = ()

    def is_log_scale(self, index: int) -> bool:
        return bool(self.log_scale) and self.log_scale[index]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)

    def shapes(self, dims: Dims) -> list[tuple[int, ...]]:
        return [tuple(dims[d] for d in part_dims) for _, part_dims in self.parts]

    def zeros(self, dims: Dims, device: torch.device | str = "cpu") -> torch.Tensor | tuple[torch.Tensor, ...]:
        parts = tuple(
            torch.full(shape, value, dtype=torch.float64, device=device)
            for shape, value in zip(self.shapes(dims), self.empty)
        )
        return parts[0] if len(parts) == 1 else parts

    def split(self, state: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (state,) if isinstance(state, torch.Tensor) else tuple(state)

    def join(self, parts: tuple[Any, ...]) -> Any:
        return parts[0] if len(parts) == 1 else tuple(parts)


MAP_FAMILIES = ("gate", "delta", "shift")


@dataclass(frozen=True)
class StabilityMap:
    """A stability map a formulation takes part in (``attnlab map``, attnlab/stability.py).

    ``family`` names the two swept parameters and the theoretical boundary:
    ``"gate"`` (log-gate strength x T; the cumulative log decay of one chunk
    reaching the exp threshold), ``"delta"`` (key norm x beta; the line
    ``beta |k|^2 = 2``), ``"shift"`` (a constant added to the keys x dtype;
    the exp thresholds 11.09 fp16, 88.72 bf16 and fp32). ``args`` are the
    arguments the swept parameter acts on: the log gates; the keys then the
    write strength; the keys.
    """

    family: str
    args: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.family not in MAP_FAMILIES:
            raise ValueError(f"family must be one of {', '.join(MAP_FAMILIES)}; got {self.family!r}")


def _default_dims(B: int, T: int, H: int, K: int, V: int) -> dict[str, int]:
    return {"B": B, "T": T, "H": H, "K": K, "V": V}


@dataclass(frozen=True)
class Formulation:
    """One registry entry: everything generic code needs to know about a formulation."""

    name: str
    title: str
    definition: str
    args: tuple[Arg, ...]
    options: tuple[Option, ...] = ()
    state: StateSpec | None = None
    forms: tuple[str, ...] = FORMS
    kernel_forms: tuple[str, ...] = ("chunkwise",)
    notes: str = ""
    # Options of the recurrent oracle that select the textbook algorithm, for the
    # reports' naive baselines (rwkv4: the exp(k) accumulation, stable=False).
    naive_options: tuple[tuple[str, Any], ...] = ()
    stability: tuple[StabilityMap, ...] = ()
    dims_from_sizes: Callable[[int, int, int, int, int], dict[str, int]] = field(default=_default_dims)

    # --- lookups --------------------------------------------------------
    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def arg(self, name: str) -> Arg:
        for a in self.args:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no argument {name!r}")

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(f"{self.name} has no option {name!r}")

    @property
    def oracle_module(self) -> str:
        return f"attnlab.oracles.{self.name}"

    @property
    def kernel_module(self) -> str:
        return f"attnlab.kernels.{self.name}"

    # --- sampling ---------------------------------------------------------
    def sample(
        self, B: int = 1, T: int = 64, H: int = 2, K: int = 16, V: int = 16, seed: int = 0
    ) -> dict[str, torch.Tensor]:
        """Draw the registry's default inputs: a dict of argument name -> float64 CPU tensor.

        Each argument is drawn from its own generator (seeded from ``seed`` and
        the argument's position), so changing one distribution leaves the others'
        draws unchanged. Options (scale, causal...) are left at their defaults.
        """
        dims = self.dims_from_sizes(B, T, H, K, V)
        out: dict[str, torch.Tensor] = {}
        for position, arg in enumerate(self.args):
            generator = torch.Generator().manual_seed(seed * 1009 + position)
            out[arg.name] = arg.sample(dims, generator).to(torch.float64)
        return out

    def default_scale(self, dims: Dims) -> float:
        """The ``scale`` used when the caller passes ``None`` (FORMULATIONS.md)."""
        option = self.option("scale")
        return float(option.default) if option.default is not None else math.pow(dims["K"], -0.5)
