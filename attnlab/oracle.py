"""``attnlab.oracle(name, form, precision, **opts)``: the high-precision references.

The returned callable takes the formulation's inputs as keyword arguments
(FORMULATIONS.md names), validates them, evaluates the oracle module's form
in float64 (torch, on the inputs' device) or mpmath (``dps`` digits, rounded
once), and returns ``o`` as a float64 tensor ``[B, T, H, V]`` (``[B, T, C]``
for rwkv4), or ``(o, final_state)`` with ``return_state=True``.

Inputs of any floating dtype are upcast exactly, so an oracle fed a kernel's
fp16 or bf16 inputs measures the kernel's error, not the inputs' rounding.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch

from attnlab.registry import REGISTRY, formulation
from attnlab.spec import FORMS, Formulation, Option
from attnlab.validation import check_positive_int, validate

PRECISIONS = ("float64", "mpmath")
# The same code evaluated in a lower torch dtype: not references, but the
# naive same-precision baselines that reports set kernels against.
BASELINE_PRECISIONS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def as_formulation(f: Formulation | str) -> Formulation:
    """The registry entry ``f`` names, or ``f`` itself when it is one: the spine passes entries, users names."""
    return f if isinstance(f, Formulation) else formulation(f)


def _check_form_option(option: Option, value: Any) -> Any:
    """A form-only option's value (``Formulation.form_options``), checked against its kind and choices."""
    if option.kind is bool and not isinstance(value, bool):
        raise ValueError(f"{option.name} must be True or False; got {value!r}")
    if option.choices is not None and value not in option.choices:
        raise ValueError(f"{option.name} must be one of {', '.join(map(repr, option.choices))}; got {value!r}")
    if option.kind is not bool and option.choices is None and not isinstance(value, option.kind):
        raise ValueError(f"{option.name} must be a {option.kind.__name__}; got {value!r}")
    return value


def _form_options_text() -> str:
    """Which formulation's form each form-only option belongs to ("stable for rwkv4's recurrent form, ")."""
    return "".join(f"{option.name} for {f.name}'s {form} form, "
                   for f in REGISTRY for form, options in f.form_options.items() for option in options)


class Oracle:
    """A configured oracle; call it with the formulation's inputs."""

    def __init__(self, name: str | Formulation, form: str, precision: str, **opts: Any) -> None:
        self.formulation = as_formulation(name)
        name = self.formulation.name
        if form not in self.formulation.forms:
            raise ValueError(f"form must be one of {', '.join(self.formulation.forms)}; got {form!r}")
        if precision not in PRECISIONS and precision not in BASELINE_PRECISIONS:
            known = ", ".join([*PRECISIONS, *BASELINE_PRECISIONS])
            raise ValueError(f"precision must be one of {known}; got {precision!r}")
        self.form, self.precision = form, precision
        self.dps = 50
        if "dps" in opts:
            if precision != "mpmath":
                raise ValueError("dps applies to precision='mpmath' only")
            self.dps = check_positive_int("dps", opts.pop("dps"))
        self.form_opts: dict[str, Any] = {}
        if form == "chunkwise":
            self.form_opts["chunk_size"] = check_positive_int("chunk_size", opts.pop("chunk_size", 64))
        for option in self.formulation.form_options.get(form, ()):
            self.form_opts[option.name] = _check_form_option(option, opts.pop(option.name, option.default))
        if opts:
            raise TypeError(
                f"oracle({name!r}, form={form!r}) got unexpected option(s) {', '.join(sorted(opts))}; "
                f"chunk_size is for the chunkwise form, {_form_options_text()}dps for mpmath"
            )
        module = importlib.import_module(self.formulation.oracle_module)
        self._fn: Callable[..., tuple[Any, Any]] = getattr(module, form)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.form_opts.items())
        dps = f", dps={self.dps}" if self.precision == "mpmath" else ""
        return f"attnlab.oracle({self.formulation.name!r}, form={self.form!r}, precision={self.precision!r}{dps}{opts})"

    def _prepare(self, inputs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        """The validated call, the backend, and the form's keyword arguments in the backend's numbers."""
        from attnlab.oracles._backend import Float64, MPMath

        f = self.formulation
        call = validate(f, inputs)
        if self.precision == "mpmath":
            backend: Float64 | MPMath = MPMath(self.dps, call.device)
        else:
            backend = Float64(call.device, BASELINE_PRECISIONS.get(self.precision, torch.float64))
        # Conversions are exact (asarray upcasts; every float64 is an mpf), whatever precision is in force.
        arrays = {n: (None if t is None else backend.asarray(t)) for n, t in call.tensors.items()}
        options = dict(call.options)
        if "scale" in options:
            options["scale"] = backend.scalar(options["scale"])
        kwargs: dict[str, Any] = {**arrays, **options, **self.form_opts}
        if f.state is not None:
            state = call.initial_state or f.state.split(f.state.zeros(call.dims, call.device))
            kwargs["state"] = tuple(backend.asarray(s) for s in state)
        return call, backend, kwargs

    def _evaluate(self, inputs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
        from attnlab.oracles._backend import MPMath

        call, backend, kwargs = self._prepare(inputs)
        # The torch forms are differentiable by autograd (the gradient oracle, attnlab.gradients) when an
        # input requires grad; otherwise they run under no_grad, which spares autograd's dispatch (~10%).
        tensors = [*call.tensors.values(), *(call.initial_state or ())]
        needs_grad = any(t is not None and t.requires_grad for t in tensors)
        context = backend if isinstance(backend, MPMath) else contextlib.nullcontext() if needs_grad else torch.no_grad()
        with context:
            o, final = self._fn(backend, **kwargs)
        return call, backend, o, final

    def arguments(self, **inputs: Any) -> tuple[Any, dict[str, Any]]:
        """``(backend, arguments)``: the backend ``xp`` and the keyword arguments the oracle module's form takes.

        The inputs are validated and converted exactly into the backend's numbers (mpmath: numpy arrays of
        mpf), the options resolved, the state (given, or the empty one) a tuple of parts under ``state``.
        With :meth:`evaluate` this evaluates the form on moved arguments (attnlab.gradients' mpmath
        directional derivative moves them along a direction by an mpf step).
        """
        _, backend, kwargs = self._prepare(inputs)
        return backend, kwargs

    def evaluate(self, backend: Any, arguments: dict[str, Any]) -> tuple[Any, tuple[Any, ...] | None]:
        """``(o, final_state_parts)`` of the form on ``arguments`` (see :meth:`arguments`), unrounded.

        For mpmath it computes at the precision in force when called, not at ``dps``: the caller's
        ``mpmath.workdps`` (or mpmath.diff's raised precision) rules.
        """
        return self._fn(backend, **arguments)

    def __call__(self, **inputs: Any) -> torch.Tensor | tuple[torch.Tensor, Any]:
        call, backend, o, final = self._evaluate(inputs)
        o = backend.to_tensor(o)
        if call.return_state:
            return o, self.formulation.state.join(tuple(backend.to_tensor(s) for s in final))
        return o

    def unrounded(self, **inputs: Any) -> tuple[Any, tuple[Any, ...] | None]:
        """``(o, final_state_parts)`` in the backend's own numbers, before the one rounding.

        For precision='mpmath' these are numpy arrays of mpf at ``dps`` digits,
        for comparing two mpmath evaluations beyond float64 (as SciPy's
        ``mp_assert_allclose`` does).
        """
        _, _, o, final = self._evaluate(inputs)
        return o, final


def oracle(name: str | Formulation, form: str = "recurrent", precision: str = "float64", **opts: Any) -> Oracle:
    """The oracle of formulation ``name`` (a name or a registry entry) in ``form`` at ``precision``
    ("float64" or "mpmath").

    precision="float32", "float16" or "bfloat16" runs the same code in that
    torch dtype (inputs rounded to it, output in it): a naive baseline for
    reports, not a reference.

    Options: ``chunk_size`` (chunkwise, default 64; the last chunk may be
    partial), ``dps`` (mpmath, default 50), and the formulation's form-only
    options (``Formulation.form_options``: rwkv4's recurrent ``stable``,
    default True; False is the naive exp(k) accumulation that overflows).
    """
    return Oracle(name, form, precision, **opts)


__all__ = ["oracle", "Oracle", "as_formulation", "PRECISIONS", "FORMS"]
