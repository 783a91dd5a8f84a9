"""Calling conventions as data, and the adapters built from them.

A third-party kernel computes one of attnlab's formulations but may be called
differently: other keyword names, positional arguments, gates as decay
factors instead of logs, its own default scale, head-first tensors
(``[B, H, T, D]``), the state transposed (``[V, K]``) or stacked, a tuple
``(o, state)`` returned, a decay rate passed as its log, some arguments in
another dtype. A :class:`Convention` (attnlab.spec; every registry entry's
``Peer`` holds one) states those differences declaratively; :func:`adapt`
turns ``(kernel, convention, formulation)`` into a callable in attnlab's own
convention (FORMULATIONS.md keyword names, returns ``o`` or ``(o, state)``),
so every oracle, property and report applies unchanged. The adapter acts on
argument roles (``Arg.role``) and the state's declaration, never on a
formulation's name.

``FLA`` holds the conventions of flash-linear-attention 0.6.0's kernels, read
from the registry's peers of library "fla"; :func:`detect` tries the
plausible conventions on small inputs when a user does not know them.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from attnlab.oracle import as_formulation
from attnlab.registry import REGISTRY
from attnlab.spec import Convention, Formulation, Peer

__all__ = ["Convention", "ATTNLAB", "Adapted", "BoundCall", "adapt", "peer_adapter", "load_function", "fixed_scale",
           "FLA", "FLA_NUMERICS_ENV", "fla_convention", "candidates", "Detection", "detect", "ConventionError",
           "CONVENTION_CHOICES", "DETECT_SIZES", "DETECT_TOLERANCE", "choose_fla_convention", "peer_convention",
           "detect_convention", "describe_detection", "detection_caveat", "choose_convention"]

# Environment variables that change flash-linear-attention's numerics; reports record them.
FLA_NUMERICS_ENV = ("FLA_DISABLE_BACKEND_DISPATCH", "FLA_TRIL_PRECISION", "FLA_USE_FAST_OPS")

ATTNLAB = Convention()
# The stacked state's stand-in for a log-scale part's log of zero (-inf): fla's RWKV-4 takes -1e38.
STACKED_LOG_ZERO = -1e38


def _converted(t: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor] | None, dtype: torch.dtype | None) -> torch.Tensor:
    """``fn(t)`` evaluated in fp32 at least (or the wider of t's and ``dtype``), returned in ``dtype``
    (default: t's own); with no ``fn``, ``t`` cast to ``dtype``. Where that changes nothing (an identity
    feature map), ``t`` itself, so that the kernel reads the caller's tensor as it would unadapted."""
    dtype = dtype or t.dtype
    if fn is None:
        return t.to(dtype)
    working = torch.promote_types(torch.promote_types(t.dtype, torch.float32), dtype)
    out = fn(t.to(working)).to(dtype)
    return t if dtype == t.dtype and torch.equal(out, t) else out


def fixed_scale(convention: Convention, K: int) -> float | None:
    """The scale a kernel that takes none always applies (None when it takes attnlab's)."""
    if convention.scale == "pass":
        return None
    return K**-0.5 if convention.scale == "rsqrt_K" else float(convention.scale)


def _feature_map(f: Formulation, feature_map: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """phi of ``f``'s ``feature_map`` option, as its oracle module computes it (its ``feature(xp, x, name)``)."""
    from attnlab.oracles._backend import Float64

    feature = getattr(importlib.import_module(f.oracle_module), "feature", None)
    if feature is None:
        raise ValueError(f"{f.oracle_module} has no feature(xp, x, feature_map): a convention with "
                         "feature_map_outside needs one")
    return lambda t: feature(Float64(t.device, t.dtype), t, feature_map)


def _heads_first(dims: tuple[str, ...]) -> tuple[int, int] | None:
    """The axes swapped between [..., T, H, ...] and [..., H, T, ...], or None when dims lack T or H."""
    return (dims.index("T"), dims.index("H")) if "T" in dims and "H" in dims else None


def _state_dims(f: Formulation, inputs: Mapping[str, Any]) -> dict[str, int]:
    """The sizes of the symbolic dims, read off the tensors given."""
    return {d: size for a in f.args if isinstance(inputs.get(a.name), torch.Tensor)
            for d, size in zip(a.dims, inputs[a.name].shape)}


@dataclass(frozen=True)
class BoundCall:
    """One call of a kernel with every conversion already done: ``bound()`` is exactly
    ``kernel(*args, **kwargs)`` (what a benchmark times), and ``bound.result(raw)`` turns what it returned
    into attnlab's convention."""

    kernel: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    adapted: Adapted
    want_state: bool
    carried: tuple[str, ...]

    def __call__(self) -> Any:
        return self.kernel(*self.args, **self.kwargs)

    def result(self, raw: Any) -> Any:
        return self.adapted._result(raw, self.want_state, self.carried)


@dataclass
class Adapted:
    """A kernel wrapped to attnlab's convention: ``adapted(**attnlab_inputs)``."""

    kernel: Callable[..., Any]
    convention: Convention
    formulation: Formulation
    supports_state: bool

    def __call__(self, **inputs: Any) -> Any:
        bound = self.bind(**inputs)
        return bound.result(bound())

    def bind(self, **inputs: Any) -> BoundCall:
        """The kernel's call on attnlab's ``inputs``, every conversion done now (see :class:`BoundCall`)."""
        c = self.convention
        inputs = dict(inputs)
        initial_state = inputs.pop("initial_state", None)
        want_state = bool(inputs.pop("return_state", False))
        if (initial_state is not None or want_state) and not self.supports_state:
            raise ValueError(f"{c.name} takes no state: initial_state and return_state are not supported")
        carried = self.carried(inputs)
        named = self._arguments(inputs)
        kwargs: dict[str, Any] = dict(c.fixed)
        if c.stacked_state and self.supports_state:
            initial_state = self._stacked(initial_state, inputs)
        elif initial_state is not None:
            initial_state = self._state_in(initial_state, carried)
        if initial_state is not None:
            kwargs[c.state_keyword] = initial_state
        if want_state and c.final_state_flag is not None:
            kwargs[c.final_state_flag] = True
        args = tuple(named.pop(n) for n in c.positional)
        kwargs.update({c.names.get(n, n): value for n, value in named.items()})
        return BoundCall(self.kernel, args, kwargs, self, want_state, carried)

    def carried(self, inputs: Mapping[str, Any]) -> tuple[str, ...]:
        """attnlab's state parts the kernel carries for these inputs (all of them for a kernel with no state)."""
        f = self.formulation
        if f.state is None:
            return ()
        options = {o.name: inputs.get(o.name, o.default) for o in f.options}
        return self.convention.carried(f, options)

    def _arguments(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """attnlab's tensors and resolved options, translated value by value (by the arguments' roles)."""
        f, c = self.formulation, self.convention
        out = {n: t for n, t in inputs.items() if n in f.arg_names and t is not None and n not in c.derived}
        options = {o.name: inputs.get(o.name, o.default) for o in f.options}
        conversions: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
        if c.gates == "linear":
            conversions.update({a.name: torch.exp for a in f.args_with_role("log_gate")})
        if c.decay_rate_as_log:
            conversions.update({a.name: torch.log for a in f.args_with_role("decay_rate")})
        if c.feature_map_outside:
            phi = _feature_map(f, options.pop("feature_map"))
            conversions.update({a.name: phi for a in f.args_with_role("query", "key")})
        for name in list(out):
            if name in conversions or name in c.arg_dtypes:
                out[name] = _converted(out[name], conversions.get(name), c.arg_dtypes.get(name))
        if "scale" in options:
            K = inputs[f.args_with_role("query")[0].name].shape[-1]
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
        if c.layout == "BHTD":
            for name in list(out):
                axes = _heads_first(f.arg(name).dims)
                out[name] = out[name] if axes is None else out[name].transpose(*axes)
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

    def _stacked(self, state: Any, inputs: Mapping[str, Any]) -> torch.Tensor:
        """attnlab's state parts (each [B, C]; the empty state when None) stacked as [B, parts, 1, C], always
        passed; a log-scale part's -inf (log of zero) becomes STACKED_LOG_ZERO."""
        spec = self.formulation.state
        dtype = self.convention.state_dtype or torch.float64
        if state is None:
            device = next(t.device for t in inputs.values() if isinstance(t, torch.Tensor))
            state = spec.zeros(_state_dims(self.formulation, inputs), device)
        parts = [s.to(dtype) for s in spec.split(state)]
        parts = [torch.clamp(s, min=STACKED_LOG_ZERO) if spec.is_log_scale(i) else s for i, s in enumerate(parts)]
        return torch.stack(parts, dim=1)[:, :, None].contiguous()

    def _output(self, o: Any) -> Any:
        """The kernel's ``o`` in attnlab's layout (its dims are the values')."""
        if self.convention.layout != "BHTD" or not isinstance(o, torch.Tensor):
            return o
        axes = _heads_first(self.formulation.args_with_role("value")[0].dims)
        return o if axes is None else o.transpose(*axes)

    def _result(self, result: Any, want_state: bool, carried: tuple[str, ...] | None = None) -> Any:
        """The kernel's result in attnlab's convention; state parts it does not carry come back as None."""
        f, c = self.formulation, self.convention
        if c.returns == "o":
            return self._output(result)
        if c.returns == "attnlab":
            return (self._output(result[0]), result[1]) if want_state else self._output(result)
        o, state = self._output(result[0]), result[1]
        if not want_state:
            return o
        if c.stacked_state:
            return o, f.state.join(tuple(state[:, i, -1] for i in range(len(f.state.parts))))
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


def adapt(kernel: Callable[..., Any], convention: Convention, name: str | Formulation) -> Adapted:
    """``kernel`` (called in ``convention``) as a callable in attnlab's convention for formulation ``name``
    (a name or a registry entry)."""
    f = as_formulation(name)
    supports_state = f.state is not None and convention.state_keyword is not None and _accepts(kernel, convention.state_keyword)
    return Adapted(kernel, convention, f, supports_state)


def _accepts(kernel: Callable[..., Any], keyword: str) -> bool:
    try:
        parameters = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return True
    return keyword in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def load_function(function: str) -> Callable[..., Any]:
    """The callable named ``module:attribute`` (a peer's ``function``), imported now."""
    module, _, attribute = function.rpartition(":")
    return getattr(importlib.import_module(module), attribute)


def peer_adapter(peer: Peer, f: Formulation | str) -> Adapted:
    """The registry peer ``peer`` of ``f``, imported and adapted to attnlab's convention."""
    return adapt(load_function(peer.function), peer.convention, f)


# ----------------------------------------------------------------------------- flash-linear-attention 0.6.0

# formulation name -> fla function -> its convention, read from the registry's peers of library "fla".
FLA: dict[str, dict[str, Convention]] = {
    f.name: {p.attribute: p.convention for p in f.peers if p.library == "fla"}
    for f in REGISTRY if any(p.library == "fla" for p in f.peers)
}


def fla_convention(name: str | Formulation, function: str) -> Convention:
    """The convention of fla 0.6.0's ``function`` for formulation ``name`` (a name or a registry entry)."""
    try:
        return FLA[as_formulation(name).name][function]
    except KeyError:
        known = ", ".join(f"{n}:{fn}" for n, fns in FLA.items() for fn in fns)
        raise ValueError(f"no fla convention for {as_formulation(name).name}:{function}; known: {known}") from None


# ----------------------------------------------------------------------------- detection


def candidates(name: str | Formulation) -> Iterator[Convention]:
    """The plausible output conventions of a kernel for ``name`` (state layout aside), attnlab's first."""
    f = as_formulation(name)
    has_gates = bool(f.args_with_role("log_gate"))
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
    raised: dict[str, str] = field(default_factory=dict)  # candidate name -> what it raised (when it did)


def _error(kernel: Callable[..., Any], convention: Convention, f: Formulation, inputs: Mapping[str, Any],
           raised: dict[str, str] | None = None) -> float:
    from attnlab.metrics import rel_err
    from attnlab.oracle import oracle

    query = next((a.name for a in f.args_with_role("query") if a.name in inputs), None)
    scale = fixed_scale(convention, inputs[query].shape[-1]) if query is not None else None
    inputs = dict(inputs) if scale is None else {**inputs, "scale": scale}
    reference = oracle(f, "chunkwise", "float64")
    try:
        adapted = adapt(kernel, convention, f)
        o = adapted(**inputs)  # with an initial state, only the output is compared: the final state comes later
        if not isinstance(o, torch.Tensor):
            if raised is not None:
                raised[convention.name] = f"returned {type(o).__name__}, not a tensor"
            return math.inf
        return rel_err(o, reference(**inputs))
    except Exception as error:  # noqa: BLE001 - a candidate that does not fit the kernel: recorded, not raised
        if raised is not None:
            raised[convention.name] = f"{type(error).__name__}: {error}"
        return math.inf


def detect(kernel: Callable[..., Any], name: str | Formulation, inputs: Mapping[str, torch.Tensor],
           tolerance: float) -> Detection:
    """Find the convention under which ``kernel`` computes formulation ``name`` (a name or a registry entry).

    First the output conventions (gates log or linear, scale passed or the
    kernel's own K**-0.5 or 1, what it returns, keywords or FORMULATIONS.md's
    positional order) on ``inputs`` without a state; then, for a kernel that
    takes an initial state (under one of STATE_KEYWORDS) and whose state holds
    a [K, V] matrix, its layout ([K, V] or [V, K]) with a random one.
    A candidate matches when its output is within ``tolerance`` (relative) of
    the float64 oracle on the same inputs.
    """
    f = as_formulation(name)
    errors: dict[str, float] = {}
    raised: dict[str, str] = {}
    for convention in candidates(f):
        errors[convention.name] = _error(kernel, convention, f, inputs, raised)
        if errors[convention.name] <= tolerance:
            break
    else:
        return Detection(None, errors, raised)
    if f.state is None or not any({"K", "V"} <= set(dims) for _, dims in f.state.parts):
        return Detection(convention, errors, raised)  # no [K, V] matrix in the state: no layout to find
    keyword = next((k for k in STATE_KEYWORDS if _named_parameter(kernel, k)), convention.state_keyword)
    convention = replace(convention, state_keyword=keyword)
    if not adapt(kernel, convention, f).supports_state:
        return Detection(convention, errors, raised)
    dims = _state_dims(f, inputs)
    device = next(t.device for t in inputs.values() if isinstance(t, torch.Tensor))
    generator = torch.Generator().manual_seed(0)
    state = tuple(torch.randn(shape, generator=generator, dtype=torch.float64).to(device)
                  for shape in f.state.shapes(dims))
    for layout in ("KV", "VK"):
        with_layout = replace(convention, name=f"{convention.name[:-1]}, state={layout})", state=layout)
        errors[with_layout.name] = _error(kernel, with_layout, f, {**inputs, "initial_state": f.state.join(state)},
                                          raised)
        if errors[with_layout.name] <= tolerance:
            return Detection(_final_state_flag(kernel, with_layout, f, inputs, tolerance, errors), errors, raised)
    return Detection(None, errors, raised)


# Names a kernel may give its initial state, tried in this order among its named parameters.
STATE_KEYWORDS = ("initial_state", "h0", "state", "init_state", "hidden_state", "initial_states")


def _named_parameter(kernel: Callable[..., Any], keyword: str) -> bool:
    try:
        return keyword in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


# Keywords a kernel may use to ask for its final state, tried when it returns (o, state) but no state comes back.
FINAL_STATE_FLAGS = ("output_final_state", "return_final_state", "return_state", "output_state")


def _state_error(kernel: Callable[..., Any], convention: Convention, f: Formulation, inputs: Mapping[str, Any]) -> float:
    """Relative error of the final state returned under ``convention`` against the float64 oracle's."""
    from attnlab.metrics import rel_err
    from attnlab.oracle import oracle

    try:
        _, state = adapt(kernel, convention, f)(**inputs, return_state=True)
        _, reference = oracle(f, "chunkwise", "float64")(**inputs, return_state=True)
        mine = [p.to(torch.float64) for p in f.state.split(state)]
        return rel_err(mine, [p.to(torch.float64) for p in f.state.split(reference)])
    except Exception:
        return math.inf


def _final_state_flag(kernel: Callable[..., Any], convention: Convention, f: Formulation, inputs: Mapping[str, Any],
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
    errors[f"{convention.name[:-1]}, final state without a flag)"] = _state_error(kernel, convention, f, inputs)
    if errors[f"{convention.name[:-1]}, final state without a flag)"] <= tolerance:
        return convention
    for flag in FINAL_STATE_FLAGS:
        if not _named(kernel, flag):  # only flags the signature names: a **kwargs kernel would swallow any
            continue
        flagged = replace(convention, name=f"{convention.name[:-1]}, final_state_flag={flag})", final_state_flag=flag)
        errors[flagged.name] = _state_error(kernel, flagged, f, inputs)
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


# ----------------------------------------------------------------------------- choosing a kernel's convention
# Shared by ``attnlab validate --convention`` and the pytest plugin's ``--attnlab-convention``.


class ConventionError(ValueError):
    """A convention that cannot be chosen as asked (unknown fla kernel, not a registry peer, ambiguous): a usage
    error of the command or the plugin that asked."""


CONVENTION_CHOICES = ("attnlab", "fla", "peer", "auto")
# ``auto``: the inputs candidates are tried on (K != V, so a transposed state cannot pass), and the relative error
# against the oracle under which a candidate matches (a wrong convention is off by O(1)).
DETECT_SIZES = dict(B=1, T=20, H=2, K=8, V=6)
DETECT_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-3}


def _parameter_names(kernel: Callable[..., Any]) -> set[str] | None:
    """The keywords ``kernel`` accepts; None when it takes any (``**kwargs``) or has no signature."""
    try:
        parameters = inspect.signature(kernel).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def _same_convention(a: Convention, b: Convention) -> bool:
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(Convention) if f.name != "name")


def choose_fla_convention(name: str, kernel: Callable[..., Any], function: str, fla_op: str | None) -> Convention:
    """The fla 0.6.0 convention a kernel follows: ``fla_op``'s (``--fla-op``), else that of the fla function of the
    same name, else the one whose keywords the kernel's signature takes (the one passing the most arguments)."""
    table = FLA.get(name)
    if not table:
        known = ", ".join(f"{n} ({', '.join(t)})" for n, t in FLA.items())
        raise ConventionError(f"fla 0.6.0 has no kernel of {name}; --convention fla knows: {known}")
    if fla_op is not None:
        if fla_op not in table:
            raise ConventionError(f"--fla-op {fla_op!r}: fla's kernels of {name} are {', '.join(table)}")
        return table[fla_op]
    if function in table:
        return table[function]
    f = as_formulation(name)
    accepted = _parameter_names(kernel)

    def passed(c: Convention) -> list[str]:
        return [c.names.get(a.name, a.name) for a in f.args
                if a.name not in c.derived and a.name not in c.positional and not a.optional]

    fitting = [c for c in table.values() if accepted is None or all(k in accepted for k in passed(c))]
    if fitting:
        most = max(len(passed(c)) for c in fitting)
        fitting = [c for c in fitting if len(passed(c)) == most]
    if fitting and all(_same_convention(fitting[0], c) for c in fitting):
        return fitting[0]
    raise ConventionError(f"cannot tell which of fla's {name} kernels {function} is called like; "
                          f"pass --fla-op with one of {', '.join(table)}")


def peer_convention(name: str, kernel_spec: str) -> Convention:
    """``peer``: the calling convention the registry declares for ``kernel_spec`` (``MODULE:FUNCTION``) among
    ``name``'s peers (``Formulation.peers``: torch's SDPA backends and FlexAttention, fla's kernels)."""
    f = as_formulation(name)
    for peer in f.peers:
        if peer.function == kernel_spec:
            return peer.convention
    known = ", ".join(p.function for p in f.peers) or "none"
    raise ConventionError(f"--convention peer: {kernel_spec} is not a peer of {f.name} in the registry; "
                          f"its peers: {known}")


def detect_convention(kernel: Callable[..., Any], name: str | Formulation, dtype: torch.dtype,
                      device: str) -> Detection:
    """``auto``: :func:`detect` on small inputs (:data:`DETECT_SIZES`) of ``dtype`` on ``device``."""
    x = as_formulation(name).sample(**DETECT_SIZES, seed=0)
    inputs = {n: t.to(device=device, dtype=dtype) for n, t in x.items()}
    return detect(kernel, name, inputs, DETECT_TOLERANCE[dtype])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _candidate_label(name: str) -> str:
    """``auto(gates=log, scale=pass, ...)`` -> ``gates=log, scale=pass, ...``."""
    return name.removeprefix("auto(").removesuffix(")")


def describe_detection(found: Detection, dtype: torch.dtype, flag: str = "--convention") -> str:
    """Plain words: which convention matched; or that none did, what was tried, and the closest candidate with its
    error (or, when every candidate raised, what the first one raised), so that a user can tell a kernel called in a
    convention attnlab does not try from a kernel that computes something else."""
    tolerance = DETECT_TOLERANCE[dtype]
    tried = len(found.errors)
    if found.convention is not None:
        return (f"{flag} auto: found {found.convention.describe().split(': ', 1)[1]} "
                f"({tried} candidates tried on {DETECT_SIZES}, {_dtype_name(dtype)}; matched the oracle within "
                f"{tolerance:g} relative)")
    ranked = sorted(((label, error) for label, error in found.errors.items() if math.isfinite(error)),
                    key=lambda item: item[1])
    if ranked:
        closest = "closest: " + "; then ".join(f"{_candidate_label(label)}: rel_err {error:.3g}"
                                               for label, error in ranked[:3]) + ". "
        verdict = (f"The closest ran and was off by {ranked[0][1]:.3g} (a wrong convention is typically off by O(1); "
                   f"a kernel in the right convention with a small defect comes closer than that, yet above "
                   f"{tolerance:g}). ")
    else:
        first = next(iter(found.raised.items()), None)
        closest = ("Every candidate raised or returned no tensor"
                   + (f"; the first ({_candidate_label(first[0])}) raised {first[1]}" if first else "") + ". ")
        verdict = ""
    return (f"{flag} auto: NO convention matched: none of the {tried} candidates tried (gates log or linear, scale "
            f"passed, K**-0.5 or 1, returns o, (o, state) or attnlab's, keywords or FORMULATIONS.md's positional "
            f"order, state [K,V] or [V,K]) gave the oracle's output within {tolerance:g} relative on "
            f"{DETECT_SIZES} in {_dtype_name(dtype)}; " + closest + verdict
            + "Either the kernel computes something else (a bug, or another formulation), or it is called in a "
              "convention attnlab does not try: describe it with attnlab.conventions.Convention.")


def detection_caveat(flag: str = "--convention") -> str:
    """What a failed property means when the convention was detected (``auto``) rather than given."""
    return (f"the convention was detected on T={DETECT_SIZES['T']}, K={DETECT_SIZES['K']}, V={DETECT_SIZES['V']} "
            f"probe inputs; a failure may also mean the detection was wrong: pass {flag} explicitly to rule it out")


def choose_convention(which: str, kernel: Callable[..., Any], name: str | Formulation, spec: str, *,
                      fla_op: str | None = None, dtype: torch.dtype = torch.float32,
                      device: str = "cpu") -> tuple[Convention | None, Detection | None]:
    """The convention ``which`` (one of :data:`CONVENTION_CHOICES`) means for ``kernel`` (named ``spec``,
    ``MODULE:FUNCTION``) computing ``name``: ``(convention, detection)``, the detection only under ``auto`` (its
    convention None when no candidate matched). A ConventionError says why one cannot be chosen."""
    f = as_formulation(name)
    if which == "attnlab":
        return ATTNLAB, None
    if which == "fla":
        return choose_fla_convention(f.name, kernel, spec.rpartition(":")[2].split(".")[-1], fla_op), None
    if which == "peer":
        return peer_convention(f.name, spec), None
    if which == "auto":
        found = detect_convention(kernel, f, dtype, device)
        return found.convention, found
    raise ConventionError(f"convention must be one of {', '.join(CONVENTION_CHOICES)}; got {which!r}")
