"""Calling conventions as data, and the adapters built from them.

A third-party kernel computes one of attnlab's formulations but may be called
differently: other keyword names, positional arguments, gates as decay
factors instead of logs, its own default scale, the state transposed
(``[V, K]``), a tuple ``(o, state)`` returned, RWKV-4's decay as ``log w``.
A :class:`Convention` states those differences declaratively;
:func:`adapt` turns ``(kernel, convention)`` into a callable in attnlab's own
convention (FORMULATIONS.md keyword names, returns ``o`` or ``(o, state)``),
so every oracle, property and report applies unchanged.

``FLA`` holds the conventions of flash-linear-attention 0.6.0's kernels;
:func:`detect` tries the plausible conventions on small inputs when a user
does not know them.
"""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from attnlab.registry import formulation
from attnlab.spec import Formulation

# Environment variables that change flash-linear-attention's numerics; reports record them.
FLA_NUMERICS_ENV = ("FLA_DISABLE_BACKEND_DISPATCH", "FLA_TRIL_PRECISION", "FLA_USE_FAST_OPS")


@dataclass(frozen=True)
class Convention:
    """How a kernel is called, relative to attnlab's convention (whose values are the defaults).

    - ``names``: attnlab argument -> the kernel's keyword (e.g. ``{"g": "g_gamma"}``).
    - ``positional``: attnlab arguments passed positionally, in this order.
    - ``derived``: attnlab arguments the kernel does not take because it computes
      them itself (fla's chunk_retention fixes retnet's g); validation must use
      the registry's default for them.
    - ``implied``: options the kernel does not take because it always computes
      with these values (``{"causal": True}``); another value is refused.
    - ``gates``: "log" (attnlab: ``g <= 0``) or "linear" (the decay factor ``exp(g)``).
    - ``scale``: "pass" passes attnlab's scale (resolved, never None); a number
      means the kernel takes none and always uses that one (``"rsqrt_K"``: ``K ** -0.5``).
    - ``state``: "KV" (attnlab's ``[B, H, K, V]``) or "VK" (transposed).
    - ``state_keyword``: the kernel's keyword for the initial state (None: it has none).
    - ``final_state_flag``: keyword asking for the final state (fla: output_final_state).
    - ``returns``: "attnlab" (o, or (o, state) when asked), "o" (always o) or
      "o_state" (always a tuple whose first item is o and second the state).
    - ``fixed``: keywords always passed.
    - ``feature_map_outside``: linear_attn only: the kernel applies no feature map,
      so the adapter applies phi to q and k first (in fp32, rounded back to their dtype).
    - ``rwkv_decay``: "w" (decay exp(-w)) or "log_w" (fla: decay exp(-exp(w'))).
    - ``rwkv_state``: "tuple" (a, b, p) or "stacked" ``[B, 3, 1, C]`` (fla).
    - ``state_dtype``: the dtype the kernel wants its initial state in (fla: fp32);
      None passes it as given.
    - ``carries``: which of attnlab's state parts the kernel's state holds, as
      rules ``(condition, parts)``; the condition is ``""`` (always) or
      ``"option=value"`` (e.g. fla's linear attention carries only ``S`` when
      ``normalize=False``, ``(S, z)`` when normalized); the first rule that
      applies wins, none: every part. Parts a kernel does not carry come back
      as ``None`` and are not passed in (the properties compare only the parts
      carried, and say so when a run needs one that is not).
    - ``part_unsqueeze``: part -> dimension where the kernel's tensor has an
      extra singleton dimension (fla's normalizer z is ``[B, 1, H, K]``).
    """

    name: str = "attnlab"
    names: Mapping[str, str] = field(default_factory=dict)
    positional: tuple[str, ...] = ()
    derived: tuple[str, ...] = ()
    implied: Mapping[str, Any] = field(default_factory=dict)
    gates: Literal["log", "linear"] = "log"
    scale: Any = "pass"
    state: Literal["KV", "VK"] = "KV"
    state_keyword: str | None = "initial_state"
    final_state_flag: str | None = "return_state"
    returns: Literal["attnlab", "o", "o_state"] = "attnlab"
    fixed: Mapping[str, Any] = field(default_factory=dict)
    feature_map_outside: bool = False
    rwkv_decay: Literal["w", "log_w"] = "w"
    rwkv_state: Literal["tuple", "stacked"] = "tuple"
    state_dtype: torch.dtype | None = None
    carries: tuple[tuple[str, tuple[str, ...]], ...] = ()
    part_unsqueeze: Mapping[str, int] = field(default_factory=dict)

    def carried(self, f: Formulation, options: Mapping[str, Any]) -> tuple[str, ...]:
        """The names of ``f``'s state parts this kernel's state holds under ``options``."""
        assert f.state is not None
        for condition, parts in self.carries:
            if not condition:
                return tuple(parts)
            option, _, value = condition.partition("=")
            default = next((o.default for o in f.options if o.name == option), None)
            if str(options.get(option, default)) == value:
                return tuple(parts)
        return f.state.names

    def describe(self) -> str:
        """One line saying how this convention differs from attnlab's."""
        default = Convention()
        parts = [f"{k}={getattr(self, k)!r}" for k in self.__dataclass_fields__
                 if k != "name" and getattr(self, k) != getattr(default, k)]
        return f"{self.name}: " + (", ".join(parts) if parts else "attnlab's own")


ATTNLAB = Convention()


def _is_log_gate(f: Formulation, name: str) -> bool:
    arg = f.arg(name)
    return arg.high == 0.0 and arg.low is None


def _in_fp32_at_least(fn: Callable[[torch.Tensor], torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    """``fn(t)`` evaluated in fp32 (or t's dtype when wider), rounded back to t's dtype."""
    return fn(t.to(torch.promote_types(t.dtype, torch.float32))).to(t.dtype)


def fixed_scale(convention: Convention, K: int) -> float | None:
    """The scale a kernel that takes none always applies (None when it takes attnlab's)."""
    if convention.scale == "pass":
        return None
    return K**-0.5 if convention.scale == "rsqrt_K" else float(convention.scale)


@dataclass
class Adapted:
    """A kernel wrapped to attnlab's convention: ``adapted(**attnlab_inputs)``."""

    kernel: Callable[..., Any]
    convention: Convention
    formulation: Formulation
    supports_state: bool

    def __call__(self, **inputs: Any) -> Any:
        c = self.convention
        inputs = dict(inputs)
        initial_state = inputs.pop("initial_state", None)
        want_state = inputs.pop("return_state", False)
        if (initial_state is not None or want_state) and not self.supports_state:
            raise ValueError(f"{c.name} takes no state: initial_state and return_state are not supported")
        carried = self.carried(inputs)
        named = self._arguments(inputs)
        kwargs: dict[str, Any] = dict(c.fixed)
        if self.formulation.name == "rwkv4" and c.rwkv_state == "stacked":
            initial_state = self._rwkv_stacked(initial_state, inputs["k"])
        elif initial_state is not None:
            initial_state = self._state_in(initial_state, carried)
        if initial_state is not None:
            kwargs[c.state_keyword] = initial_state
        if want_state and c.final_state_flag is not None:
            kwargs[c.final_state_flag] = True
        args = [named.pop(n) for n in c.positional]
        kwargs.update({c.names.get(n, n): value for n, value in named.items()})
        return self._result(self.kernel(*args, **kwargs), want_state, carried)

    def carried(self, inputs: Mapping[str, Any]) -> tuple[str, ...]:
        """attnlab's state parts the kernel carries for these inputs (all of them for a kernel with no state)."""
        f = self.formulation
        if f.state is None:
            return ()
        options = {o.name: inputs.get(o.name, o.default) for o in f.options}
        return self.convention.carried(f, options)

    def _arguments(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """attnlab's tensors and resolved options, translated value by value."""
        from attnlab.oracles._backend import Float64
        from attnlab.oracles.linear_attn import feature

        f, c = self.formulation, self.convention
        out = {n: t for n, t in inputs.items() if n in f.arg_names and t is not None and n not in c.derived}
        for name in list(out):
            if _is_log_gate(f, name) and c.gates == "linear":
                out[name] = _in_fp32_at_least(torch.exp, out[name])
        if f.name == "rwkv4" and c.rwkv_decay == "log_w":
            out["w"] = _in_fp32_at_least(torch.log, out["w"])
        options = {o.name: inputs.get(o.name, o.default) for o in f.options}
        if "scale" in options:
            K = inputs["q"].shape[-1]
            scale = f.default_scale({"K": K}) if options["scale"] is None else float(options["scale"])
            if c.scale == "pass":
                options["scale"] = scale
            else:
                del options["scale"]
                if not math.isclose(scale, fixed_scale(c, K), rel_tol=1e-12):
                    raise ValueError(f"{c.name} always uses scale={fixed_scale(c, K):g}; got scale={scale:g}")
        for name, value in c.implied.items():
            if options.pop(name) != value:
                raise ValueError(f"{c.name} always computes with {name}={value!r}")
        if f.name == "linear_attn" and c.feature_map_outside:
            feature_map = options.pop("feature_map")
            for name in ("q", "k"):
                t = out[name]
                backend = Float64(t.device, torch.promote_types(t.dtype, torch.float32))
                out[name] = feature(backend, backend.asarray(t), feature_map).to(t.dtype)
        return {**out, **options}

    def _state_in(self, state: Any, carried: tuple[str, ...] | None = None) -> Any:
        """attnlab's state (parts the kernel does not carry may be None) -> the kernel's, carried parts only."""
        f, c = self.formulation, self.convention
        carried = f.state.names if carried is None else carried
        dtype = c.state_dtype
        parts = []
        for name, s in zip(f.state.names, f.state.split(state)):
            if name not in carried:
                continue
            if s is None:
                raise ValueError(f"{c.name} needs the state part {name}, which is None")
            s = s if dtype is None else s.to(dtype)
            if c.state == "VK" and s.dim() == 4:
                s = s.transpose(-1, -2)
            if name in c.part_unsqueeze:
                s = s.unsqueeze(c.part_unsqueeze[name])
            parts.append(s.contiguous())
        return parts[0] if len(parts) == 1 else tuple(parts)

    def _rwkv_stacked(self, state: Any, k: torch.Tensor) -> torch.Tensor:
        """(a, b, p) -> fla's [B, 3, 1, C]; the empty state's p = -inf becomes -1e38 (fla's log zero)."""
        dtype = self.convention.state_dtype or torch.float64
        if state is None:
            B, _, C = k.shape
            zeros = torch.zeros(B, C, device=k.device, dtype=dtype)
            state = (zeros, zeros, torch.full_like(zeros, -math.inf))
        a, b, p = (s.to(dtype) for s in state)
        return torch.stack([a, b, torch.clamp(p, min=-1e38)], dim=1)[:, :, None, :].contiguous()

    def _result(self, result: Any, want_state: bool, carried: tuple[str, ...] | None = None) -> Any:
        """The kernel's result in attnlab's convention; state parts it does not carry come back as None."""
        f, c = self.formulation, self.convention
        if c.returns != "o_state":
            return result
        o, state = result[0], result[1]
        if not want_state:
            return o
        if f.name == "rwkv4" and c.rwkv_state == "stacked":
            return o, tuple(state[:, i, -1, :] for i in range(3))
        carried = f.state.names if carried is None else carried
        if state is None:
            return o, state
        given = dict(zip(carried, (state,) if isinstance(state, torch.Tensor) else tuple(state)))
        parts = []
        for name in f.state.names:
            p = given.get(name)
            if p is not None:
                if name in c.part_unsqueeze:
                    p = p.squeeze(c.part_unsqueeze[name])
                if c.state == "VK" and p.dim() == 4:
                    p = p.transpose(-1, -2)
            parts.append(p)
        return o, f.state.join(tuple(parts))


def adapt(kernel: Callable[..., Any], convention: Convention, name: str) -> Adapted:
    """``kernel`` (called in ``convention``) as a callable in attnlab's convention for formulation ``name``."""
    f = formulation(name)
    supports_state = f.state is not None and convention.state_keyword is not None and _accepts(kernel, convention.state_keyword)
    return Adapted(kernel, convention, f, supports_state)


def _accepts(kernel: Callable[..., Any], keyword: str) -> bool:
    try:
        parameters = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return True
    return keyword in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


# ----------------------------------------------------------------------------- flash-linear-attention 0.6.0

_FLA_STATE = dict(state_keyword="initial_state", final_state_flag="output_final_state", returns="o_state", state_dtype=torch.float32)
# fla 0.6.0's linear attention (fla/ops/linear_attn/{chunk,fused_recurrent}.py): the state is S alone when
# normalize=False; when normalized, the tuple (S, z) with the normalizer z (running key sum) as [B, 1, H, K].
_FLA_LINEAR_STATE = dict(carries=(("normalize=False", ("S",)),), part_unsqueeze={"z": 1})

FLA: dict[str, dict[str, Convention]] = {
    "softmax": {"parallel_attn": Convention("fla:parallel_attn", implied={"causal": True}, state_keyword=None,
                                            final_state_flag=None, returns="o")},
    "linear_attn": {
        "chunk_linear_attn": Convention("fla:chunk_linear_attn", feature_map_outside=True, **_FLA_STATE,
                                        **_FLA_LINEAR_STATE),
        "fused_recurrent_linear_attn": Convention("fla:fused_recurrent_linear_attn", feature_map_outside=True,
                                                  **_FLA_STATE, **_FLA_LINEAR_STATE),
    },
    "retnet": {
        "chunk_simple_gla": Convention("fla:chunk_simple_gla", names={"g": "g_gamma"}, **_FLA_STATE),
        "chunk_retention": Convention("fla:chunk_retention", derived=("g",), **_FLA_STATE),
    },
    "gla": {
        "chunk_gla": Convention("fla:chunk_gla", **_FLA_STATE),
        "fused_recurrent_gla": Convention("fla:fused_recurrent_gla", names={"g": "gk"}, **_FLA_STATE),
    },
    "general": {"fused_recurrent_gla": Convention("fla:fused_recurrent_gla", **_FLA_STATE)},
    "deltanet": {
        "chunk_delta_rule": Convention("fla:chunk_delta_rule", **_FLA_STATE),
        "fused_recurrent_delta_rule": Convention("fla:fused_recurrent_delta_rule", **_FLA_STATE),
    },
    "gated_deltanet": {
        "chunk_gated_delta_rule": Convention("fla:chunk_gated_delta_rule", **_FLA_STATE),
        "fused_recurrent_gated_delta_rule": Convention("fla:fused_recurrent_gated_delta_rule", **_FLA_STATE),
    },
    "kda": {
        "chunk_kda": Convention("fla:chunk_kda", **_FLA_STATE),
        "fused_recurrent_kda": Convention("fla:fused_recurrent_kda", **_FLA_STATE),
    },
    "rwkv4": {
        "fused_recurrent_rwkv4": Convention(
            "fla:fused_recurrent_rwkv4", positional=("w", "u", "k", "v"), rwkv_decay="log_w", rwkv_state="stacked",
            state_keyword="state", final_state_flag=None, returns="o_state", state_dtype=torch.float32,
        )
    },
}


def fla_convention(name: str, function: str) -> Convention:
    """The convention of fla 0.6.0's ``function`` for formulation ``name``."""
    try:
        return FLA[name][function]
    except KeyError:
        known = ", ".join(f"{n}:{fn}" for n, fns in FLA.items() for fn in fns)
        raise ValueError(f"no fla convention for {name}:{function}; known: {known}") from None


# ----------------------------------------------------------------------------- detection


def candidates(name: str) -> Iterator[Convention]:
    """The plausible output conventions of a kernel for ``name`` (state layout aside), attnlab's first."""
    f = formulation(name)
    has_gates = any(_is_log_gate(f, a.name) for a in f.args)
    has_scale = "scale" in f.option_names
    required = tuple(a.name for a in f.args if not a.optional)
    for gates, scale, returns, positional in itertools.product(
        ("log", "linear") if has_gates else ("log",),
        ("pass", "rsqrt_K", 1.0) if has_scale else ("pass",),
        ("attnlab", "o_state", "o"),
        ((), required),
    ):
        label = f"gates={gates}, scale={scale}, returns={returns}, {'positional' if positional else 'keywords'}"
        yield Convention(name=f"auto({label})", gates=gates, scale=scale, returns=returns, positional=positional,
                         final_state_flag="return_state" if returns == "attnlab" else None)


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found: the matching convention (None if none did) and every candidate's error."""

    convention: Convention | None
    errors: dict[str, float]  # candidate name -> relative error against the oracle (inf when it raised)


def _error(kernel: Callable[..., Any], convention: Convention, name: str, inputs: Mapping[str, Any]) -> float:
    from attnlab.metrics import rel_err
    from attnlab.oracle import oracle

    scale = fixed_scale(convention, inputs["q"].shape[-1]) if "q" in inputs else None
    inputs = dict(inputs) if scale is None else {**inputs, "scale": scale}
    reference = oracle(name, "chunkwise", "float64")
    try:
        adapted = adapt(kernel, convention, name)
        o = adapted(**inputs)  # with an initial state, only the output is compared: the final state comes later
        return rel_err(o, reference(**inputs)) if isinstance(o, torch.Tensor) else math.inf
    except Exception:
        return math.inf


def detect(kernel: Callable[..., Any], name: str, inputs: Mapping[str, torch.Tensor], tolerance: float) -> Detection:
    """Find the convention under which ``kernel`` computes formulation ``name``.

    First the output conventions (gates log or linear, scale passed or the
    kernel's own K**-0.5 or 1, what it returns, keywords or FORMULATIONS.md's
    positional order) on ``inputs`` without a state; then, for a kernel that
    takes an initial state (under one of STATE_KEYWORDS), its layout ([K, V]
    or [V, K]) with a random one.
    A candidate matches when its output is within ``tolerance`` (relative) of
    the float64 oracle on the same inputs.
    """
    f = formulation(name)
    errors: dict[str, float] = {}
    for convention in candidates(name):
        errors[convention.name] = _error(kernel, convention, name, inputs)
        if errors[convention.name] <= tolerance:
            break
    else:
        return Detection(None, errors)
    if f.state is None or name == "rwkv4":
        return Detection(convention, errors)
    keyword = next((k for k in STATE_KEYWORDS if _named_parameter(kernel, k)), convention.state_keyword)
    convention = replace(convention, state_keyword=keyword)
    if not adapt(kernel, convention, name).supports_state:
        return Detection(convention, errors)
    dims = {d: size for a in f.args if inputs.get(a.name) is not None for d, size in zip(a.dims, inputs[a.name].shape)}
    generator = torch.Generator().manual_seed(0)
    state = tuple(torch.randn(shape, generator=generator, dtype=torch.float64).to(inputs["q"].device)
                  for shape in f.state.shapes(dims))
    for layout in ("KV", "VK"):
        with_layout = replace(convention, name=f"{convention.name[:-1]}, state={layout})", state=layout)
        errors[with_layout.name] = _error(kernel, with_layout, name, {**inputs, "initial_state": f.state.join(state)})
        if errors[with_layout.name] <= tolerance:
            return Detection(_final_state_flag(kernel, with_layout, name, inputs, tolerance, errors), errors)
    return Detection(None, errors)


# Names a kernel may give its initial state, tried in this order among its named parameters.
STATE_KEYWORDS = ("initial_state", "h0", "state", "init_state", "hidden_state", "initial_states")


def _named_parameter(kernel: Callable[..., Any], keyword: str) -> bool:
    try:
        return keyword in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


# Keywords a kernel may use to ask for its final state, tried when it returns (o, state) but no state comes back.
FINAL_STATE_FLAGS = ("output_final_state", "return_final_state", "return_state", "output_state")


def _state_error(kernel: Callable[..., Any], convention: Convention, name: str, inputs: Mapping[str, Any]) -> float:
    """Relative error of the final state returned under ``convention`` against the float64 oracle's."""
    from attnlab.metrics import rel_err
    from attnlab.oracle import oracle

    f = formulation(name)
    try:
        _, state = adapt(kernel, convention, name)(**inputs, return_state=True)
        _, reference = oracle(name, "chunkwise", "float64")(**inputs, return_state=True)
        mine = [p.to(torch.float64) for p in f.state.split(state)]
        return rel_err(mine, [p.to(torch.float64) for p in f.state.split(reference)])
    except Exception:
        return math.inf


def _final_state_flag(kernel: Callable[..., Any], convention: Convention, name: str, inputs: Mapping[str, Any],
                      tolerance: float, errors: dict[str, float]) -> Convention:
    """``convention`` with the keyword that makes the kernel return its final state, where it needs one.

    Only for kernels that return ``(o, state)``: when the state they return
    without any flag is not the oracle's final state (fla returns ``None``
    unless ``output_final_state=True``), the flags the signature accepts are
    tried. When none gives the right state, the convention is kept as it is
    (its output matched) and the state properties will say what is wrong.
    """
    if convention.returns != "o_state" or convention.final_state_flag is not None:
        return convention
    errors[f"{convention.name[:-1]}, final state without a flag)"] = _state_error(kernel, convention, name, inputs)
    if errors[f"{convention.name[:-1]}, final state without a flag)"] <= tolerance:
        return convention
    for flag in FINAL_STATE_FLAGS:
        if not _named(kernel, flag):  # only flags the signature names: a **kwargs kernel would swallow any
            continue
        flagged = replace(convention, name=f"{convention.name[:-1]}, final_state_flag={flag})", final_state_flag=flag)
        errors[flagged.name] = _state_error(kernel, flagged, name, inputs)
        if errors[flagged.name] <= tolerance:
            return flagged
    return convention


def _parameters(kernel: Callable[..., Any]) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(kernel).parameters.values())
    except (TypeError, ValueError):
        return []


def _named(kernel: Callable[..., Any], keyword: str) -> bool:
    return any(p.name == keyword for p in _parameters(kernel))
