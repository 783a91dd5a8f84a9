"""Input checking shared by every oracle and kernel front end.

Everything is checked before any work starts: argument names, tensor type,
dtype, device, symbolic shapes (``[B, T, H, K]`` ...), finiteness, value ranges
(log gates <= 0, RWKV-4's w >= 0, beta in [0, 2]), options, and the initial
state. Unknown or missing arguments raise TypeError (as Python does for a bad
call); bad values raise ValueError naming the argument and what was expected.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from attnlab.spec import CONTRACT, Dims, Formulation

STATE_KEYWORDS = ("initial_state", "return_state")


@dataclass
class Call:
    """A validated call: the tensors, resolved options, sizes and state."""

    formulation: Formulation
    tensors: dict[str, torch.Tensor | None]
    options: dict[str, Any]
    dims: dict[str, int]
    device: torch.device
    dtype: torch.dtype
    initial_state: tuple[torch.Tensor, ...] | None = None
    return_state: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # The value checks; already waited for unless validate(defer_values=True) was asked.
    values: ValueScan | None = None


def _fmt_dims(symbols: Iterable[str]) -> str:
    return "[" + ", ".join(symbols) + "]"


def _bind_shape(name: str, shape: tuple[int, ...], symbols: tuple[str, ...], dims: dict[str, int], origin: dict[str, str]) -> None:
    if len(shape) != len(symbols):
        raise ValueError(f"{name} must have shape {_fmt_dims(symbols)} ({len(symbols)} dims); got shape {tuple(shape)}")
    for size, symbol in zip(shape, symbols):
        if size < 1:
            raise ValueError(f"{name} has an empty dimension {symbol}: shape {tuple(shape)}")
        if symbol in dims and dims[symbol] != size:
            raise ValueError(
                f"{name} has {symbol}={size} (shape {tuple(shape)}, expected {_fmt_dims(symbols)}), "
                f"but {origin[symbol]} gives {symbol}={dims[symbol]}"
            )
        dims.setdefault(symbol, size)
        origin.setdefault(symbol, name)


@dataclass(frozen=True)
class _ValueCheck:
    """A tensor whose values are checked: finite (or -inf where allowed), within [low, high]."""

    name: str
    tensor: torch.Tensor
    low: float | None = None
    high: float | None = None
    allow_neg_inf: bool = False
    formulation: str = ""


def contract_reference(name: str) -> str:
    """Where a user reads what an input of formulation ``name`` must be: appended to every validation error."""
    return f"(see {CONTRACT}, section {name})"


class ValueScan:
    """The value checks of one call: queued on the tensors' device at construction, read by ``wait()``.

    ``torch.aminmax`` gives each tensor's two ends in one pass (a NaN propagates to both, an infinity
    shows at its end), written straight into one buffer per dtype, so a call pays one reduction per
    checked tensor and one device-to-host transfer per dtype, not an elementwise pass, a reduction and
    a sync per tensor and condition (nor the stacking and conversion kernels that once gathered the
    ends: on the H100, five tiny kernels for gated_deltanet's two checks). On a GPU the transfer is
    asynchronous: ``wait()`` is the only synchronisation, and a kernel calls it after its host-side
    preparation (allocations, its launches bound), just before its first launch, so that the GPU is
    not left idle while the host does that work. Nothing but copies (a contiguous copy, the initial
    state to fp32) touches the inputs before ``wait()`` returns, so a bad value still raises before
    any kernel computes on it.
    """

    def __init__(self, checks: list[_ValueCheck]) -> None:
        # Values are read from detached tensors: aminmax(out=...) refuses a tensor that requires grad, and a
        # check is no part of the function being differentiated.
        self._checks = [replace(c, tensor=c.tensor.detach()) if c.tensor.requires_grad else c
                        for c in checks if c.tensor.numel()]
        self._ends: list[tuple[list[int], torch.Tensor]] = []  # (indices into _checks, their [n, 2] ends)
        self._ready: torch.cuda.Event | None = None
        for dtype in dict.fromkeys(c.tensor.dtype for c in self._checks):
            indices = [i for i, c in enumerate(self._checks) if c.tensor.dtype == dtype]
            ends = torch.empty((len(indices), 2), dtype=dtype, device=self._checks[indices[0]].tensor.device)
            for row, i in enumerate(indices):
                torch.aminmax(self._checks[i].tensor, out=(ends[row, 0], ends[row, 1]))
            self._ends.append((indices, ends.to("cpu", non_blocking=True) if ends.is_cuda else ends))
            if ends.is_cuda:
                self._ready = torch.cuda.Event()
                self._ready.record(torch.cuda.current_stream(ends.device))
        self.done = not self._checks

    def wait(self) -> None:
        """Raise ValueError if a checked tensor holds a bad value; a no-op after the first call."""
        if self.done:
            return
        self.done = True
        if self._ready is not None:
            self._ready.synchronize()
        for indices, ends in self._ends:
            for i, (lowest, highest) in zip(indices, ends.tolist()):
                _raise_if_out_of_range(self._checks[i], lowest, highest)


def _raise_if_out_of_range(c: _ValueCheck, lowest: float, highest: float) -> None:
    if math.isnan(lowest) or math.isnan(highest) or highest == math.inf or (lowest == -math.inf and not c.allow_neg_inf):
        allowed = torch.isfinite(c.tensor)
        if c.allow_neg_inf:
            allowed |= c.tensor == -math.inf
        bad = c.tensor[~allowed].flatten()[0].item()
        raise ValueError(f"{c.name} must be finite; it holds {bad} {contract_reference(c.formulation)}")
    if c.low is not None and lowest < c.low:
        raise ValueError(f"{c.name} must be >= {c.low:g}; its minimum is {lowest:.6g} {contract_reference(c.formulation)}")
    if c.high is not None and highest > c.high:
        what = "a log gate (decay exp(g) <= 1)" if c.high == 0.0 and c.low is None else f"<= {c.high:g}"
        raise ValueError(f"{c.name} must be {what}; its maximum is {highest:.6g} {contract_reference(c.formulation)}")


def _check_option(f: Formulation, name: str, value: Any, dims: Dims) -> Any:
    option = f.option(name)
    if name == "scale":
        if value is None:
            return f.default_scale(dims)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise ValueError(f"scale must be a finite real number or None; got {value!r}")
        return float(value)
    if option.kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False; got {value!r}")
        return value
    if option.choices is not None and value not in option.choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, option.choices))}; got {value!r}")
    return value


def _citing_the_contract(check: Callable[..., Call]) -> Callable[..., Call]:
    """``check`` whose TypeErrors and ValueErrors end with the section of the contract to read."""

    @functools.wraps(check)
    def checked(f: Formulation, inputs: Mapping[str, Any], **options: Any) -> Call:
        try:
            return check(f, inputs, **options)
        except (TypeError, ValueError) as error:
            if CONTRACT in str(error):
                raise
            raise type(error)(f"{error} {contract_reference(f.name)}") from None

    return checked


@_citing_the_contract
def validate(
    f: Formulation,
    inputs: Mapping[str, Any],
    *,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device_type: str | None = None,
    extra_keywords: tuple[str, ...] = (),
    scan: str = "all",
    defer_values: bool = False,
) -> Call:
    """Check a call of formulation ``f`` and resolve its defaults.

    ``dtypes`` restricts the tensor dtypes (kernels: fp16, bf16, fp32), and
    ``device_type`` the device ("cuda"); by default any floating dtype on any
    single device is accepted. Keywords in ``extra_keywords`` are passed
    through untouched in ``Call.extra``.

    ``scan`` says which tensors' values are read: "all" (every input must be
    finite and within its range; the oracles), or "ranges" (only the inputs
    with a range, such as log gates, beta, RWKV's w, and the initial state;
    the kernels, for which a full scan of q, k and v would cost a large part of
    the kernel's own time, and whose non-finite q, k, v show up as non-finite
    outputs rather than silently wrong ones).

    ``defer_values``: return with the value checks queued but not yet read;
    the caller must call ``call.values.wait()`` before it launches anything
    on the inputs (see ValueScan).

    Every error ends with the section of the contract (docs/FORMULATIONS.md) to read.
    """
    if scan not in ("all", "ranges"):
        raise ValueError(f"scan must be 'all' or 'ranges'; got {scan!r}")
    allowed = set(f.arg_names) | set(f.option_names) | set(extra_keywords)
    if f.state is not None:
        allowed |= set(STATE_KEYWORDS)
    unknown = sorted(set(inputs) - allowed)
    if unknown:
        raise TypeError(f"{f.name} got unexpected argument(s) {', '.join(unknown)}; it takes {', '.join(sorted(allowed))}")
    missing = [a.name for a in f.args if not a.optional and inputs.get(a.name) is None]
    if missing:
        raise TypeError(f"{f.name} is missing required tensor argument(s): {', '.join(missing)}")

    dims: dict[str, int] = {}
    origin: dict[str, str] = {}
    tensors: dict[str, torch.Tensor | None] = {}
    value_checks: list[_ValueCheck] = []
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    first = ""
    for arg in f.args:
        t = inputs.get(arg.name)
        if t is None:
            tensors[arg.name] = None
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{arg.name} must be a torch.Tensor of shape {_fmt_dims(arg.dims)}; got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{arg.name} must be a floating-point tensor; got dtype {t.dtype}")
        if dtypes is not None and t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise ValueError(f"{arg.name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {names}")
        if device_type is not None and t.device.type != device_type:
            raise ValueError(f"{arg.name} is on {t.device}; this implementation needs {device_type} tensors")
        if device is None:
            device, dtype, first = t.device, t.dtype, arg.name
        elif t.device != device:
            raise ValueError(f"{arg.name} is on {t.device} but {first} is on {device}; all tensors must share one device")
        elif dtypes is not None and t.dtype != dtype:
            raise ValueError(f"{arg.name} has dtype {t.dtype} but {first} has {dtype}; all tensors must share one dtype")
        _bind_shape(arg.name, tuple(t.shape), arg.dims, dims, origin)
        if scan == "all" or arg.low is not None or arg.high is not None:
            value_checks.append(_ValueCheck(arg.name, t, arg.low, arg.high, arg.allow_neg_inf, f.name))
        tensors[arg.name] = t
    assert device is not None and dtype is not None

    options = {o.name: _check_option(f, o.name, inputs.get(o.name, o.default), dims) for o in f.options}

    initial_state = None
    if f.state is not None and inputs.get("initial_state") is not None:
        initial_state = _check_state(f, inputs["initial_state"], dims, device)
        value_checks += [_ValueCheck(label, part, allow_neg_inf=log_scale, formulation=f.name) for label, part, log_scale in _state_parts(f, initial_state)]
    return_state = inputs.get("return_state", False)
    if not isinstance(return_state, bool):
        raise ValueError(f"return_state must be True or False; got {return_state!r}")

    values = ValueScan(value_checks)
    if not defer_values:
        values.wait()
    extra = {k: inputs[k] for k in extra_keywords if k in inputs}
    return Call(f, tensors, options, dims, device, dtype, initial_state, return_state, extra, values)


def _check_state(f: Formulation, state: Any, dims: Dims, device: torch.device) -> tuple[torch.Tensor, ...]:
    spec = f.state
    assert spec is not None
    expected = ", ".join(f"{n} {_fmt_dims(d)}" for n, d in spec.parts)
    parts = (state,) if isinstance(state, torch.Tensor) else tuple(state) if isinstance(state, (tuple, list)) else None
    if parts is None or len(parts) != len(spec.parts):
        raise ValueError(f"initial_state must be {'a tensor' if len(spec.parts) == 1 else 'a tuple'} ({expected}); got {type(state).__name__}")
    checked = []
    for part, (name, symbols), shape in zip(parts, spec.parts, spec.shapes(dims)):
        label = f"initial_state {name}" if len(spec.parts) > 1 else "initial_state"
        if not isinstance(part, torch.Tensor) or not part.dtype.is_floating_point:
            raise ValueError(f"{label} must be a floating-point torch.Tensor of shape {_fmt_dims(symbols)}")
        if tuple(part.shape) != shape:
            raise ValueError(f"{label} must have shape {_fmt_dims(symbols)} = {shape}; got {tuple(part.shape)}")
        if part.device != device:
            raise ValueError(f"{label} is on {part.device} but the inputs are on {device}")
        checked.append(part)
    return tuple(checked)


def _state_parts(f: Formulation, parts: tuple[torch.Tensor, ...]) -> list[tuple[str, torch.Tensor, bool]]:
    """(label, part, whether it is a log-scale part that may hold -inf) for each initial-state part."""
    spec = f.state
    assert spec is not None
    multi = len(spec.parts) > 1
    return [(f"initial_state {name}" if multi else "initial_state", part, spec.is_log_scale(index))
            for index, (part, (name, _)) in enumerate(zip(parts, spec.parts))]


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)
