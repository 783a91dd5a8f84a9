"""Hypothesis strategies: inputs described by a seed, shapes and distribution parameters.

Hypothesis draws a :class:`Case` (a few numbers); the tensors are built from
it with torch generators (DESIGN.md: hypothesis' ``arrays()`` gives
near-constant tensors at these sizes). A Case is its own reproduction recipe:
its ``repr`` is a Python expression, ``Case(...).inputs()`` rebuilds the exact
float64 inputs and ``Case(...).call(dtype, device)`` the rounded kernel call.

Starting from the registry's default sample (``Formulation.sample``), a Case
can move every input to where arithmetic breaks (attnlab.properties.traits
says which inputs are which):

- T = 1, T next to and between chunk multiples, long T (``Sizes``);
  non-power-of-two K and V;
- log gates per step uniform in ``[gate_low, 0]``, from exactly zero to -20
  (RWKV-4's decay rate ``w`` likewise, as ``-log`` decay);
- beta uniform in ``[beta_low, beta_high]``, near 0, 1 and 2;
- delta-rule keys of norm ``key_norm`` (unit or not, with beta * |k|^2 <= 2
  so the state still contracts) and nearly parallel keys
  (``key_coherence`` near 1: an ill-conditioned UT inverse);
- large logits: ``logit_max`` rescales softmax's queries so that the
  largest ``|scale q.k|`` is exactly that, ``spread`` widens q and k or the
  additive keys;
- RWKV-4 and AFT keys shifted by ``key_shift``, past the exp overflow
  thresholds of the dtype (11.09 fp16, 88.72 bf16 and fp32) or below
  underflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from hypothesis import strategies as st

from attnlab.oracle import as_formulation
from attnlab.properties import traits
from attnlab.spec import Formulation

__all__ = ["Case", "Sizes", "CPU_SIZES", "CPU_THOROUGH_SIZES", "GPU_SIZES", "GPU_LONG_SIZES", "cases"]


@dataclass(frozen=True)
class Sizes:
    """Bounds on the shapes a strategy draws (inclusive)."""

    max_T: int
    max_dim: int
    max_B: int = 1
    max_H: int = 2
    min_T: int = 1


# The Triton interpreter runs one program after another: keep CPU sizes small.
CPU_SIZES = Sizes(max_T=72, max_dim=24)
CPU_THOROUGH_SIZES = Sizes(max_T=300, max_dim=64, max_B=2)
GPU_SIZES = Sizes(max_T=1024, max_dim=128, max_B=2, max_H=4)
GPU_LONG_SIZES = Sizes(max_T=4096, max_dim=128, max_B=1, max_H=2, min_T=1024)


@dataclass(frozen=True)
class Case:
    """One input of formulation ``name``: shapes, a seed and distribution parameters.

    Parameters left at their defaults keep the registry's default
    distribution. ``cut`` (1 <= cut < T) splits time for the causality and
    split-and-resume properties: the head is positions ``[0, cut)``.
    """

    name: str
    seed: int = 0
    B: int = 1
    T: int = 16
    H: int = 1
    K: int = 16
    V: int = 16
    gate_low: float | None = None
    beta_low: float | None = None
    beta_high: float | None = None
    key_norm: float = 1.0
    key_coherence: float = 0.0
    spread: float = 1.0
    logit_max: float | None = None
    key_shift: float = 0.0
    scale: float | None = None
    options: tuple[tuple[str, Any], ...] = ()
    absent: tuple[str, ...] = ()
    cut: int | None = None

    def __repr__(self) -> str:
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if f.name in ("name", "seed", "B", "T", "H", "K", "V") or getattr(self, f.name) != f.default]
        return f"Case({', '.join(shown)})"

    @property
    def entry(self) -> Formulation:
        """The registry entry of ``name``."""
        return as_formulation(self.name)

    def with_(self, **changes: Any) -> Case:
        return replace(self, **changes)

    @property
    def option_values(self) -> dict[str, Any]:
        """The options passed explicitly (``scale`` only when set)."""
        values = dict(self.options)
        if self.scale is not None:
            values["scale"] = self.scale
        return values

    def inputs(self) -> dict[str, torch.Tensor]:
        """The tensors, float64 on the CPU (optional arguments in ``absent`` left out)."""
        f = self.entry
        x = f.sample(B=self.B, T=self.T, H=self.H, K=self.K, V=self.V, seed=self.seed)
        for position, arg in enumerate(f.args):
            gen = torch.Generator().manual_seed(self.seed * 7919 + 101 + position)
            t = x[arg.name]
            if traits.is_log_gate(arg) or traits.is_decay_rate(arg):
                t = self._log_decay(t, gen) if self.gate_low is not None else t
                if traits.is_decay_rate(arg) and self.gate_low is not None:
                    t = -t
            elif traits.is_write_strength(arg) and self.beta_low is not None:
                high = self.beta_high if self.beta_high is not None else self.beta_low
                t = self.beta_low + (high - self.beta_low) * torch.rand(t.shape, generator=gen, dtype=torch.float64)
                t = t.clamp(self.beta_low, high)
            elif arg.name in f.shift_invariant:
                t = t * self.spread + self.key_shift
            x[arg.name] = t
        if traits.has_query(f):
            self._shape_queries_and_keys(x, f)
        for name in self.absent:
            del x[name]
        return x

    def _log_decay(self, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if self.gate_low == 0.0:
            return torch.zeros_like(like)
        return self.gate_low * torch.rand(like.shape, generator=gen, dtype=torch.float64)

    def _shape_queries_and_keys(self, x: dict[str, torch.Tensor], f: Formulation) -> None:
        gen = torch.Generator().manual_seed(self.seed * 7919 + 97)
        query, key = f.args_with_role("query")[0].name, f.args_with_role("key")[0].name
        q, k = x[query], x[key]
        if self.key_coherence > 0:
            base = torch.randn((k.shape[0], 1, *k.shape[2:]), generator=gen, dtype=torch.float64)
            base = base / base.norm(dim=-1, keepdim=True) * k.norm(dim=-1, keepdim=True)
            c = self.key_coherence
            k = c * base + math.sqrt(1 - c * c) * k
        if traits.is_delta_rule(f):
            k = k / k.norm(dim=-1, keepdim=True) * self.key_norm
        else:
            q, k = q * self.spread, k * self.spread
        if self.logit_max is not None and f.bilinear_logits:
            scale = self.scale if self.scale is not None else f.default_scale({"K": self.K})
            logits = scale * torch.einsum("bthk,bshk->bhts", q, k)
            if dict(self.options).get("causal", True):
                logits = logits.tril()
            q = q * (self.logit_max / logits.abs().max().clamp_min(1e-300))
        x[query], x[key] = q, k

    def call(self, dtype: torch.dtype, device: str | torch.device = "cpu") -> dict[str, Any]:
        """The keyword arguments of one kernel call: the inputs rounded to ``dtype`` on ``device``, and the options."""
        return {**round_to(self.inputs(), dtype, device), **self.option_values}


def round_to(x: dict[str, Any], dtype: torch.dtype, device: str | torch.device) -> dict[str, Any]:
    return {n: (t.to(device=device, dtype=dtype) if isinstance(t, torch.Tensor) else t) for n, t in x.items()}


def _lengths(sizes: Sizes) -> st.SearchStrategy[int]:
    """T = 1, T on either side of the chunk multiples, and anything in between."""
    edges = sorted({t for m in (16, 32, 64, 128, 1024, 2048, 4096) for t in (m - 1, m, m + 1)} | {1, 2, 3})
    edges = [t for t in edges if sizes.min_T <= t <= sizes.max_T]
    return st.one_of(st.sampled_from(edges), st.integers(sizes.min_T, sizes.max_T))


def _head_dims(sizes: Sizes) -> st.SearchStrategy[int]:
    awkward = [d for d in (1, 3, 5, 7, 12, 16, 17, 24, 31, 32, 48, 64, 96, 100, 128) if d <= sizes.max_dim]
    return st.one_of(st.sampled_from(awkward), st.integers(1, sizes.max_dim))


_GATE_LOWS = st.one_of(st.none(), st.just(0.0), st.sampled_from([-1e-3, -0.05, -1.0, -5.0, -20.0]), st.floats(-20.0, 0.0))
_BETA_RANGES = st.one_of(
    st.none(),
    st.sampled_from([(0.0, 1e-3), (0.999, 1.0), (1.0, 1.0), (1.99, 2.0), (2.0, 2.0), (0.0, 2.0)]),
    st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 2.0)).map(sorted).map(tuple),
)


@st.composite
def cases(
    draw: st.DrawFn,
    name: str | Formulation,
    dtype: torch.dtype,
    sizes: Sizes = CPU_SIZES,
    *,
    overflow: bool = False,
    with_cut: bool = False,
    causal: bool = False,
    convex: bool = False,
    shifted: bool = False,
    options: tuple[tuple[str, Any], ...] = (),
) -> Case:
    """Cases of formulation ``name`` (a name or a registry entry) for a kernel running in ``dtype``.

    ``overflow`` pushes every exponential a naive implementation would take
    past the dtype's overflow (or underflow) threshold; ``with_cut`` draws a
    cut (and T >= 2); ``causal`` forces ``causal=True``; ``convex`` keeps the
    options under which outputs are convex combinations of the values;
    ``shifted`` draws a non-zero key shift (RWKV-4, AFT); ``options`` are
    forced as given.
    """
    f = as_formulation(name)
    name = f.name
    threshold = traits.EXP_OVERFLOW[dtype]
    forced = dict(options)
    T = draw(_lengths(sizes).filter(lambda t: t >= 2) if with_cut else _lengths(sizes))
    case = Case(
        name=name, seed=draw(st.integers(0, 2**31 - 1)), T=T,
        B=draw(st.integers(1, sizes.max_B)), H=draw(st.integers(1, sizes.max_H)),
        K=draw(_head_dims(sizes)), V=draw(_head_dims(sizes)),
    )
    changes: dict[str, Any] = {}
    if traits.log_gate_args(f):
        changes["gate_low"] = draw(st.floats(-20.0, -threshold / 8) if overflow else _GATE_LOWS)
    if traits.is_delta_rule(f):
        beta = draw(_BETA_RANGES)
        key_norm = draw(st.one_of(st.just(1.0), st.floats(0.25, 1.4)))
        if beta is not None:
            high = min(beta[1], 2.0 / key_norm**2)
            changes.update(beta_low=min(beta[0], high), beta_high=high)
        changes["key_norm"] = key_norm
    if traits.has_query(f):
        changes["key_coherence"] = draw(st.one_of(st.just(0.0), st.sampled_from([0.99, 0.999, 0.99999]), st.floats(0.0, 0.9999)))
        if not traits.is_delta_rule(f):
            changes["spread"] = draw(st.sampled_from([1.0, 0.25, 2.0, 4.0]))
    if f.bilinear_logits:
        low, high = (threshold + 0.5, 3 * threshold) if overflow else (1.0, 3 * threshold)
        changes["logit_max"] = draw(st.floats(low, high) if overflow else st.one_of(st.none(), st.floats(low, high)))
    if f.shift_invariant:
        changes["spread"] = draw(st.one_of(st.just(1.0), st.floats(0.1, 10.0)))
        past = st.floats(threshold + 0.5, threshold + 60.0)
        if overflow:
            changes["key_shift"] = draw(st.one_of(past, past.map(lambda s: -s - 16.0)))
        elif shifted:
            changes["key_shift"] = draw(st.one_of(past, st.floats(-120.0, 120.0).filter(lambda s: abs(s) >= 1.0)))
        else:
            changes["key_shift"] = draw(st.one_of(st.just(0.0), past, st.floats(-40.0, 40.0)))
    for option in f.options:
        if option.name in forced:
            continue
        if option.name == "scale":
            changes["scale"] = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
        elif option.name == "causal" and causal:
            forced["causal"] = True
        elif option.kind is bool:
            forced[option.name] = draw(st.booleans())
        elif option.choices is not None:
            forced[option.name] = draw(st.sampled_from(option.choices))
    if convex and not f.is_convex(forced):
        forced.update(f.convex_when or ())
    optional = [a.name for a in f.args if a.optional]
    if optional:
        changes["absent"] = tuple(n for n in optional if draw(st.booleans()))
    if with_cut:
        # Cutting before the last token puts both sides of the cut in the last (partial) chunk.
        changes["cut"] = draw(st.one_of(st.just(T - 1), st.integers(1, T - 1)))
    return case.with_(options=tuple(sorted(forced.items())), **changes)

