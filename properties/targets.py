"""What the kernel properties run on: a :class:`Target` wraps one implementation of one formulation.

The attnlab convention (DESIGN.md, the plugin's ``--attnlab-kernel``): an
implementation is called with the formulation's inputs as keyword arguments
(FORMULATIONS.md names, options such as ``scale`` only when the caller sets
them) and returns ``o``. If its signature names ``initial_state`` and
``return_state``, then ``return_state=True`` makes it return
``(o, final_state)`` and the state properties run; if it names
``chunk_size``, the chunk-size property runs.

Three kinds of target share this one interface: attnlab's own Triton kernels
(through ``attnlab.kernel``), a third party's function (``module:function``)
and the deliberately broken specimens (attnlab.properties.specimens).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any

import torch

# Importing attnlab.kernel sets TRITON_INTERPRET (no GPU) before any kernel module is imported.
from attnlab.kernel import Kernel, backward_forms, interpreter_active
from attnlab.kernel import kernel as attnlab_kernel
from attnlab.conventions import ATTNLAB, Convention, Detection, adapt, choose_convention, describe_detection  # noqa: I001
from attnlab.oracle import as_formulation
from attnlab.registry import REGISTRY
from attnlab.spec import Formulation

__all__ = ["Target", "own_kernel_target", "own_kernel_targets", "function_target", "convention_target", "resolve",
           "resolve_in_convention", "Resolved", "smoke_check", "rounded_oracle_target"]

# Chunk sizes tried by the chunk-size property, when the target takes any.
PREFERRED_CHUNK_SIZES = (16, 32, 64)


@dataclass(frozen=True)
class Target:
    """One implementation under test.

    ``formulation`` is the formulation's name (``entry`` its registry entry);
    ``function(**inputs)`` follows the attnlab convention; ``chunk_sizes``
    are the values it accepts as ``chunk_size=`` (empty when it takes none);
    ``dtypes`` are the dtypes it can run here (attnlab's kernels cannot run
    bf16 under the CPU interpreter).
    """

    label: str
    formulation: str
    function: Callable[..., Any]
    accepts_state: bool
    chunk_sizes: tuple[int, ...] = ()
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32)
    # Whether calling it on inputs that require grad gives an output that requires grad; None: probe it once.
    declared_differentiable: bool | None = None

    @cached_property
    def differentiable(self) -> bool:
        """Whether the backward properties apply: the declared answer, else :func:`probe_differentiable` (once)."""
        if self.declared_differentiable is not None:
            return self.declared_differentiable
        return probe_differentiable(self)

    def __call__(self, chunk_size: int | None = None, **inputs: Any) -> Any:
        if chunk_size is not None:
            inputs["chunk_size"] = chunk_size
        return self.function(**inputs)

    def __repr__(self) -> str:
        return f"Target({self.label})"

    @property
    def entry(self) -> Formulation:
        return as_formulation(self.formulation)


# The inputs the differentiability probe calls a target on: tiny first, then head dims a tiled kernel accepts.
PROBE_SIZES = (dict(B=1, T=3, H=1, K=4, V=4), dict(B=1, T=16, H=1, K=16, V=16), dict(B=1, T=64, H=2, K=64, V=64))
# What the probe last found for a target's label when no probe input ran: the error, for a usage message.
PROBE_NOTES: dict[str, str] = {}


def probe_differentiable(target: Target) -> bool:
    """Call ``target`` on small inputs that require grad (float32, bfloat16, float16; on the GPU when there is one,
    else the CPU; tiny shapes first); differentiable when the output of the first call that runs requires grad. A
    target that raises on every probe is not (:data:`PROBE_NOTES` keeps its last error)."""
    f = target.entry
    devices = ("cuda", "cpu") if torch.cuda.is_available() else ("cpu",)
    last = ""
    for sizes in PROBE_SIZES:
        x = f.sample(**sizes, seed=0)
        for device in devices:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                inputs = {n: t.to(device=device, dtype=dtype).requires_grad_(f.arg(n).differentiable)
                          for n, t in x.items()}
                try:
                    with torch.enable_grad():
                        out = target(**inputs)
                except Exception as error:  # noqa: BLE001 - a target that cannot run here is probed further
                    last = f"{type(error).__name__}: {error}"
                    continue
                o = out[0] if isinstance(out, (tuple, list)) else out
                PROBE_NOTES.pop(target.label, None)
                return isinstance(o, torch.Tensor) and o.requires_grad
    PROBE_NOTES[target.label] = f"it raised on every probe input ({last})"
    return False


def own_kernel_target(name: str | Formulation, form: str) -> Target:
    """attnlab's Triton kernel of ``name`` (a name or a registry entry) in ``form``, validated by ``attnlab.kernel``."""
    f = as_formulation(name)
    name = f.name
    module = importlib.import_module(f.kernel_module)
    choices = getattr(module, "OPTIONS", {}).get(form, {}).get("chunk_size", (None, ()))[1] or ()
    chunk_sizes = tuple(c for c in PREFERRED_CHUNK_SIZES if c in choices)

    @cache
    def configured(chunk_size: int | None) -> Kernel:
        return attnlab_kernel(name, form, **({} if chunk_size is None else {"chunk_size": chunk_size}))

    def run(chunk_size: int | None = None, **inputs: Any) -> Any:
        return configured(chunk_size)(**inputs)

    dtypes = (torch.float16, torch.float32) if interpreter_active() else (torch.bfloat16, torch.float16, torch.float32)
    # Differentiable where its module declares a backward for the form: declared, not probed.
    return Target(f"attnlab:{name}/{form}", name, run, f.state is not None, chunk_sizes, dtypes,
                  form in backward_forms(name))


def own_kernel_targets(names: list[str] | None = None) -> list[Target]:
    """Every attnlab kernel that exists (module importable, form present), in registry order."""
    targets = []
    for f in REGISTRY:
        if names is not None and f.name not in names:
            continue
        if importlib.util.find_spec(f.kernel_module) is None:
            continue
        module = importlib.import_module(f.kernel_module)
        targets += [own_kernel_target(f, form) for form in f.kernel_forms if hasattr(module, form)]
    return targets


def function_target(function: Callable[..., Any], name: str | Formulation, label: str) -> Target:
    """A function following the attnlab convention, for formulation ``name`` (a name or a registry entry)."""
    f = as_formulation(name)
    parameters = inspect.signature(function).parameters
    accepts_state = "initial_state" in parameters and "return_state" in parameters
    chunk_sizes = PREFERRED_CHUNK_SIZES if "chunk_size" in parameters else ()
    return Target(label, f.name, function, accepts_state and f.state is not None, chunk_sizes)


def load_callable(spec: str, flag: str) -> Callable[..., Any]:
    """The callable named ``MODULE:FUNCTION``; MODULE is a dotted module (importable from here or the
    current directory) or a path to a ``.py`` file; FUNCTION may be an attribute path (``Class.method``).
    ``flag`` names the option in the ValueError that says what is wrong (``--kernel``, ``--attnlab-kernel``)."""
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{flag} must be MODULE:FUNCTION (e.g. mypkg.ops:my_gla or path/to/file.py:my_gla); got {spec!r}")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"{flag} {spec}: no such file {module_name!r}")
        sys.path.insert(0, str(path.resolve().parent))  # so that the file's own imports of its neighbours work
        loader_spec = importlib.util.spec_from_file_location(path.stem, path)
        if loader_spec is None or loader_spec.loader is None:
            raise ValueError(f"{flag} {spec}: cannot load {module_name!r} as a Python module")
        module: Any = importlib.util.module_from_spec(loader_spec)
        sys.modules[path.stem] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as error:  # noqa: BLE001 - the user's module: say what broke
            raise ValueError(f"{flag} {spec}: importing {module_name} failed: {type(error).__name__}: {error}") from error
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"{flag} {spec}: cannot import module {module_name!r}: {error}") from error
        except Exception as error:  # noqa: BLE001
            raise ValueError(f"{flag} {spec}: importing {module_name} failed: {type(error).__name__}: {error}") from error
    obj: Any = module
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{flag} {spec}: module {module_name!r} has no attribute {attribute!r}") from None
    if not callable(obj):
        raise ValueError(f"{flag} {spec}: {attribute!r} is not callable")
    return obj


def resolve(spec: str, name: str | Formulation) -> Target:
    """The target named ``MODULE:FUNCTION`` (load_callable), checked against formulation ``name``."""
    return function_target(load_callable(spec, "--attnlab-kernel"), name, spec)


def _returns_state(kernel: Callable[..., Any], convention: Convention) -> bool:
    if convention.returns == "o_state":
        return True
    if convention.returns == "attnlab" and convention.final_state_flag is not None:
        try:
            parameters = inspect.signature(kernel).parameters.values()
        except (TypeError, ValueError):
            return True
        return (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
                or convention.final_state_flag in {p.name for p in parameters})
    return False


def convention_target(kernel: Callable[..., Any], name: str | Formulation, label: str, convention: Convention) -> Target:
    """The Target for ``kernel``, called in ``convention``.

    attnlab's own convention needs no adapter (and keeps ``chunk_size``, so
    the chunk-size property runs when the kernel takes one); any other goes
    through attnlab.conventions.adapt, and the state properties run when the
    adapted kernel both takes an initial state and returns its final one.
    """
    if convention == ATTNLAB:
        return function_target(kernel, name, label)
    f = as_formulation(name)
    adapted = adapt(kernel, convention, f)
    accepts_state = f.state is not None and adapted.supports_state and _returns_state(kernel, convention)
    return Target(label, f.name, adapted, accepts_state, ())


@dataclass(frozen=True)
class Resolved:
    """A kernel resolved in a convention: the target, the convention (None when ``auto`` found none), the
    detection (under ``auto``) and its plain-words description."""

    target: Target | None
    convention: Convention | None
    detection: Detection | None = None
    detection_text: str = ""


def resolve_in_convention(spec: str, name: str | Formulation, convention: str = "attnlab", *,
                          fla_op: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
                          flag: str = "--attnlab-kernel", convention_flag: str = "--attnlab-convention") -> Resolved:
    """The kernel ``spec`` (``MODULE:FUNCTION``) as a Target for ``name``, called in ``convention`` (attnlab,
    fla, peer or auto: attnlab.conventions.choose_convention; auto detects it on small ``dtype`` inputs on
    ``device``). A ValueError says what is wrong with the spec or the convention; ``auto`` finding none gives
    a Resolved without a target, whose ``detection_text`` says what was tried and what came closest."""
    f = as_formulation(name)
    kernel = load_callable(spec, flag)
    chosen, found = choose_convention(convention, kernel, f, spec, fla_op=fla_op, dtype=dtype, device=device)
    text = describe_detection(found, dtype, convention_flag) if found is not None else ""
    if chosen is None:
        return Resolved(None, None, found, text)
    return Resolved(convention_target(kernel, f, spec, chosen), chosen, found, text)


def smoke_check(target: Target, inputs: dict[str, Any], convention: Convention,
                hint: str = "check --convention / --fla-op, or try --convention auto") -> None:
    """One call of ``target`` on small ``inputs``: a TypeError, or an output that is not a tensor of the
    oracle's shape, means the kernel is not called the way ``convention`` says (a ValueError saying so); anything
    else the kernel raises is left to the properties to report."""
    try:
        out = target(**inputs)
    except TypeError as error:
        raise ValueError(f"{target.label} cannot be called in convention {convention.name}: TypeError: {error}; "
                         f"{hint}") from error
    except Exception:  # noqa: BLE001 - anything else is the kernel's to answer for, in the properties
        return
    from attnlab.oracle import oracle

    if isinstance(out, torch.Tensor):
        try:
            expected = oracle(target.entry, "recurrent")(**{n: t.double() if isinstance(t, torch.Tensor) else t
                                                           for n, t in inputs.items()})
        except Exception:  # noqa: BLE001 - the oracle refusing these inputs is not the kernel's convention
            return
        expected = expected[0] if isinstance(expected, tuple) else expected
        if tuple(out.shape) == tuple(expected.shape):
            return
        what = f"an output of shape {tuple(out.shape)} where the oracle's is {tuple(expected.shape)}"
    else:
        what = (f"a {type(out).__name__} of {len(out)} items" if isinstance(out, (tuple, list))
                else f"a {type(out).__name__}")
    returns = "o alone (and (o, state) only with return_state=True)" if convention == ATTNLAB else "o"
    raise ValueError(f"{target.label} does not follow convention {convention.name}: called without return_state "
                     f"it returned {what}, where the convention returns {returns}; {hint}")


def rounded_oracle_target(name: str | Formulation) -> Target:
    """The ideal kernel: the float64 recurrent oracle, rounded once to the input dtype (excess exactly 1).

    A control for the checks: every property must hold on it.
    """
    from attnlab.oracle import oracle

    f = as_formulation(name)
    reference = oracle(f, "recurrent")

    def ideal(**inputs: Any) -> Any:
        dtype = next(t.dtype for t in inputs.values() if isinstance(t, torch.Tensor))
        result = reference(**inputs)
        if isinstance(result, tuple):
            return result[0].to(dtype), result[1]
        return result.to(dtype)

    return Target(f"oracle:{f.name}/recurrent rounded", f.name, ideal, f.state is not None, declared_differentiable=True)
