"""``attnlab.kernel(name, form, **opts)``: the Triton kernels, behind input validation.

A kernel takes the formulation's inputs (fp16, bf16 or fp32, all one dtype,
on one CUDA device), accumulates in fp32 and returns ``o`` in the input
dtype, or ``(o, final_state)`` with ``return_state=True`` (the state in
fp32). On a machine without a GPU the kernels run on CPU tensors under the
Triton interpreter: attnlab.runtime sets ``TRITON_INTERPRET=1`` before any kernel
is imported when no CUDA device is present. The interpreter cannot compute
in bf16 (DESIGN.md), so bf16 there is refused with a clear error.

Head dimensions (K, V, aft's D) may be anything from 1 to 256; kernels mask
non-powers of two. Everything is checked before a launch: names, dtypes,
devices, shapes, options, the values of every input with a range (log
gates, beta, RWKV's w) and of the initial state. The values of q, k and v
are not scanned (a scan would cost a large share of the kernel's own time);
a non-finite one shows up as a non-finite output.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from attnlab.registry import formulation
from attnlab.runtime import interpreter_active
from attnlab.validation import check_positive_int, validate

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
HEAD_DIMS = ("K", "V", "D")


def _module_table(name: str, table: str, form: str) -> dict[str, Any]:
    """Entry ``form`` of the dict ``table`` in formulation ``name``'s kernel module ({} where it has none)."""
    module = importlib.import_module(formulation(name).kernel_module)
    return dict(getattr(module, table, {}).get(form, {}))


def backward_forms(name: str) -> tuple[str, ...]:
    """The forms in which formulation ``name``'s kernel is an autograd function (its module's ``BACKWARD``)."""
    f = formulation(name)
    backward = getattr(importlib.import_module(f.kernel_module), "BACKWARD", {})
    return tuple(form for form in f.kernel_forms if form in backward)


def kernel_options(name: str, form: str) -> dict[str, tuple[Any, tuple[Any, ...] | None]]:
    """The tunables of formulation ``name``'s kernel in ``form``: option -> (default, its choices or None)."""
    return _module_table(name, "OPTIONS", form)


def speed_options(name: str, form: str) -> dict[str, Any]:
    """The fastest setting of ``name``'s kernel in ``form`` where its module offers one (its SPEED_OPTIONS,
    which trade accuracy for speed: bench and the GPU scripts time it beside the default), else {}."""
    return _module_table(name, "SPEED_OPTIONS", form)


def auto_chunk_sizes(name: str, form: str) -> tuple[int, ...]:
    """The chunk sizes ``name``'s kernel in ``form`` may pick by shape where its chunk_size defaults to "auto"
    (the GPU tests and tools/gpu/shapes.py walk each, since small test shapes meet only one); () otherwise."""
    default, choices = kernel_options(name, form).get("chunk_size", (None, ()))
    return tuple(c for c in choices or () if c != "auto") if default == "auto" else ()


class Kernel:
    """A configured kernel; call it with the formulation's inputs."""

    def __init__(self, name: str, form: str = "chunkwise", **opts: Any) -> None:
        self.formulation = formulation(name)
        if form not in self.formulation.kernel_forms:
            raise ValueError(
                f"{name} has kernels for form(s) {', '.join(self.formulation.kernel_forms)}; got {form!r}"
            )
        self.form = form
        module = importlib.import_module(self.formulation.kernel_module)
        self._fn = getattr(module, form)
        self._backward = getattr(module, "BACKWARD", {}).get(form)
        allowed = kernel_options(name, form)
        unknown = sorted(set(opts) - set(allowed))
        if unknown:
            raise TypeError(f"kernel({name!r}, {form!r}) got unexpected option(s) {', '.join(unknown)}; it takes {', '.join(sorted(allowed)) or 'none'}")
        self.opts = {**{k: v for k, (v, _) in allowed.items()}, **opts}
        for key, (_, choices) in allowed.items():
            if choices is not None and self.opts[key] not in choices:
                raise ValueError(f"{key} must be one of {', '.join(map(repr, choices))}; got {self.opts[key]!r}")
        if self.opts.get("chunk_size") not in (None, "auto"):  # "auto": the kernel picks one by shape
            check_positive_int("chunk_size", self.opts["chunk_size"])

    @property
    def differentiable(self) -> bool:
        """Whether calling it on inputs that require grad gives gradients (else it refuses them)."""
        return self._backward is not None

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.opts.items())
        return f"attnlab.kernel({self.formulation.name!r}, {self.form!r}{opts})"

    def __call__(self, **inputs: Any) -> torch.Tensor | tuple[torch.Tensor, Any]:
        f = self.formulation
        interpreting = interpreter_active()
        call = validate(
            f, inputs, dtypes=KERNEL_DTYPES, device_type=None if interpreting else "cuda", scan="ranges", defer_values=True
        )
        if interpreting and call.device.type != "cpu":
            raise ValueError(f"TRITON_INTERPRET=1 runs kernels on CPU tensors; the inputs are on {call.device}")
        if interpreting and call.dtype == torch.bfloat16:
            raise ValueError(
                "bfloat16 kernels need a GPU: the Triton interpreter (TRITON_INTERPRET=1) computes on bf16 bit "
                "patterns as integers; use float16 or float32 on the CPU"
            )
        for symbol in HEAD_DIMS:
            if call.dims.get(symbol, 0) > MAX_HEAD_DIM:
                raise ValueError(f"head dimension {symbol}={call.dims[symbol]} is larger than the kernels' limit {MAX_HEAD_DIM}")
        state = None
        if call.initial_state is not None:
            state = tuple(s.to(torch.float32).contiguous() for s in call.initial_state)
        tensors = {n: (None if t is None else t.contiguous()) for n, t in call.tensors.items()}
        kwargs = {**tensors, **call.options, **self.opts}
        if f.state is not None:
            kwargs.update(state=state, return_state=call.return_state)
        assert call.values is not None
        differentiable = {n: t for n, t in tensors.items() if t is not None and f.arg(n).differentiable}
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*differentiable.values(), *(state or ()))):
            if self._backward is None:
                raise NotImplementedError(
                    f"{self!r} has no backward pass yet: call it on inputs that do not require grad, or under "
                    "torch.no_grad()")
            o, final = _differentiable_call(self, kwargs, differentiable, state, call.values.wait)
        else:
            # The module binds its launches (kernels/_util.Launch), then waits for the value checks just before the first.
            o, final = self._fn(**kwargs, await_checks=call.values.wait)
        if not call.values.done:
            raise AssertionError(f"{self!r} launched without waiting for the value checks of its inputs")
        if call.return_state:
            return o, f.state.join(final)
        return o


class _KernelFunction(torch.autograd.Function):
    """One kernel call as an autograd node: the module's forward, then its backward (its ``BACKWARD[form]``).

    The inputs are the differentiable tensors (in ``names`` order), then the initial state's fp32 parts; the
    outputs are ``o``, then the final state's parts when the call returns it. The forward fills ``saved``, a dict
    of what its backward needs beyond the inputs and ``o`` (softmax's log-sum-exp, say); the backward gets the
    inputs, ``o``, ``saved``, ``do`` and the final state's cotangent (None where no loss reads the final state).
    """

    @staticmethod
    def forward(ctx: Any, kernel: Kernel, kwargs: dict[str, Any], names: tuple[str, ...], wait: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(names, tensors))
        state = tuple(tensors[len(names):]) or None
        saved: dict[str, torch.Tensor] = {}
        call = {**kwargs, **inputs, **({"state": state} if "state" in kwargs else {})}
        o, final = kernel._fn(**call, saved=saved, await_checks=wait)
        ctx.kernel, ctx.kwargs, ctx.names, ctx.saved = kernel, kwargs, names, saved
        ctx.has_state = state is not None
        final_parts = tuple(final) if final is not None else ()
        ctx.final_shapes = tuple(p.shape for p in final_parts)
        ctx.save_for_backward(*tensors, o)
        return (o, *final_parts)

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, *d_final: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        grads = node_gradients(ctx, do, d_final)
        state_grads = tuple(grads["initial_state"]) if ctx.has_state else ()
        return (None, None, None, None, *(grads[n] for n in ctx.names), *state_grads)


def node_gradients(node: Any, do: torch.Tensor | None, d_final: tuple[torch.Tensor | None, ...],
                   **backward_options: Any) -> dict[str, Any]:
    """The kernel module's backward at one differentiable call's autograd node (``o.grad_fn``): the gradients by
    input name ("initial_state": the state's parts), from ``do`` and the final state's parts' cotangents as autograd
    hands them over (None: zero). What :class:`_KernelFunction`'s backward returns; ``backward_options`` go to the
    module's backward, for a tool that wants its gradients otherwise (tools/bf16_on_cpu.py: in fp32, from an fp32
    ``do``)."""
    *tensors, o = node.saved_tensors
    inputs = dict(zip(node.names, tensors))
    state = tuple(tensors[len(node.names):]) or None
    d_state = None
    if any(d is not None for d in d_final):
        d_state = tuple(torch.zeros(shape, dtype=torch.float32, device=o.device) if d is None
                        else d.to(torch.float32).contiguous()
                        for d, shape in zip(d_final, node.final_shapes))
    if do is None:
        do = torch.zeros_like(o)
    call = {**node.kwargs, **inputs, **({"state": state} if "state" in node.kwargs else {})}
    return node.kernel._backward(**call, o=o, saved=node.saved, do=do.contiguous(), d_state=d_state,
                                 **backward_options)


def _differentiable_call(kernel: Kernel, kwargs: dict[str, Any], differentiable: dict[str, torch.Tensor],
                         state: tuple[torch.Tensor, ...] | None, wait: Any) -> tuple[torch.Tensor, Any]:
    """The forward through :class:`_KernelFunction`: ``(o, final state parts or None)``, both tracked by autograd."""
    names = tuple(differentiable)
    rest = {n: v for n, v in kwargs.items() if n not in differentiable and n != "state"}
    if "state" in kwargs:
        rest["state"] = None  # replaced by the node's own state inputs
    outputs = _KernelFunction.apply(kernel, rest, names, wait, *differentiable.values(), *(state or ()))
    o, *final = outputs
    return o, (tuple(final) if final else None)


def kernel(name: str, form: str = "chunkwise", **opts: Any) -> Kernel:
    """The Triton kernel of formulation ``name`` in ``form`` ("chunkwise" or "recurrent").

    ``opts`` are the kernel's own tunables (its module's ``OPTIONS``), such as
    ``chunk_size``; each is validated before any launch.
    """
    return Kernel(name, form, **opts)
