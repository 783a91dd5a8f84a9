"""The delta rules' and kda's bf16 default run on the CPU with the GPU's roundings, for the property suite.

bf16 kernels do not run under the Triton interpreter (it computes on bf16 bit patterns as integers). Their
default for bf16 inputs, precision "fp16" (on heads of at least 16 key and value channels; narrower ones take
"bf16x3", which the interpreter computes as exact fp32), takes every operand's value exactly whatever its carrier:
given fp32 copies of the bf16 inputs and the precision "auto" picks for bf16, these kernels make the roundings the
GPU makes on the bf16 inputs (fp16-scaled dot operands, bf16 hi/lo splits, fp32 sums; not bit for bit, the order
of the sums differs), and their fp32 output rounded once to bf16 stands for the GPU's bf16 output. Point the property suite
at them by path (slow: the interpreter runs every example; kda takes longest):

    .venv/bin/python -m pytest --pyargs attnlab.properties -q -p no:cacheprovider \\
        --attnlab-profile ci --attnlab-device cpu --attnlab-dtype bfloat16 -k matches_oracle \\
        --attnlab-formulation deltanet --attnlab-kernel tools/bf16_on_cpu.py:deltanet

A developer's instrument, not a target for users: it stands for attnlab's own GPU kernels in one setting
(precision "fp16" on bf16 inputs) and only approximately (the order of the sums differs), so a verdict on it
is a lead to confirm on the GPU, never a verdict on a kernel.

Session 10 reproduced this way the counterexample on which the H100's bf16 run failed (deltanet, K = 1,
beta = 1: properties/regressions.py).

The ``*_backward`` functions stand for the bf16 backward (kernels/_delta_chunk_backward.py) in the same spirit, for
the backward properties (``-k backward_matches_oracle --attnlab-kernel tools/bf16_on_cpu.py:deltanet_backward``):
the bf16 inputs carried in fp16 (exact from 2^-17 to fp16's largest; below, fp16's subnormals hold fewer than
bf16's 8 bits), so that the backward accumulates in fp32 as on bf16 inputs, and its products chosen as for bf16
inputs of the same shape (products_precision: "fp16_emulated" where the GPU takes "fp16"; wy_precision:
"split_emulated" where it takes "split"; for every dtype in the process from the first call on). An input its
carriers cannot hold exactly (entries below 2^-17 with more bits than fp16's subnormals keep, or above fp16's
largest) it declines (NotImplementedError: the suite draws another): it would run on other inputs than the
oracle's. kda's beta drawn from 5e-7 to 9e-6, carried 0.4 % off at the median and 5 %
at most, failed backward_causality[dg] at 15 times bf16's floor, and beta near 1e-38, carried as 0,
backward_query_identity (session 36). They take an initial state and return the final one, as the kernels do: the
suite then draws both (a stand-in without them, before session 26, missed the failures a drawn state brings out on
the GPU, which it now reproduces to three digits). The forward then runs its fp16 inputs' path, not the bf16 one:
a closer stand-in for the backward than for the forward. The backward gets ``do`` with bf16's values in fp32 and
writes the gradients in fp32, each then rounded once to bf16, as the GPU writes them (_CarriedInFp16). Before
session 28 they came back in the fp16 carriers: an entry below fp16's normal range (6.1e-5) kept only fp16's
subnormal spacing, and the suite failed the stand-in where the GPU's kernel is right (gated_deltanet's dv of 3e-5
and 2e-7 at beta near 0: 8.1 times bf16's floor).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import attnlab
from attnlab.kernel import node_gradients
from attnlab.kernels import _delta_chunk_backward
from attnlab.kernels._state_pass import auto_precision

_CHOSEN = _delta_chunk_backward.products_precision
_WY = _delta_chunk_backward.wy_precision


def _as_for_bf16(dtype: torch.dtype, K: int, V: int, positions: int) -> str:
    """The backward's products as chosen for bf16 inputs of this shape, whatever the carriers' dtype."""
    return _CHOSEN(torch.bfloat16, K, V, positions)


def _wy_as_for_bf16(dtype: torch.dtype, K: int, V: int) -> str:
    """The backward's W = T Kg and U = T V (bf16 hi/lo parts of T on wide heads) as chosen for bf16 inputs."""
    return _WY(torch.bfloat16, K, V)


def _output_in_bf16(out: Any) -> Any:
    """The kernel's output (o, or o and the state) with o rounded once to bf16, as the GPU's kernel writes it."""
    if isinstance(out, tuple):
        return (out[0].to(torch.bfloat16), *out[1:])
    return out.to(torch.bfloat16)


def _bf16_default_as_on_the_gpu(name: str) -> Callable[..., Any]:
    def call(**inputs: Any) -> Any:
        carried = {n: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t
                   for n, t in inputs.items()}
        precision = auto_precision(torch.bfloat16, carried["k"].shape[-1], carried["v"].shape[-1])
        out = attnlab.kernel(name, "chunkwise", precision=precision)(**carried)
        return _output_in_bf16(out)

    call.__name__ = name
    return call


class _CarriedInFp16(torch.autograd.Function):
    """attnlab's kernel on fp16 carriers of bf16 inputs, its gradients as the GPU's bf16 kernel writes them.

    The forward runs ``run`` on fp16 copies (exact from 2^-17 up) with autograd on, and keeps the kernel's
    node; o comes back rounded to bf16. The backward calls that node's module backward itself
    (attnlab.kernel.node_gradients) with ``do`` in fp32, holding bf16's values exactly (autograd would hand the
    kernel an fp16 ``do``), and gradients in fp32 (grad_dtype), each rounded once to its input's dtype here: the
    one rounding the GPU makes where it writes them, with bf16's range (fp16 carriers would keep a gradient below
    6.1e-5 only to fp16's subnormal spacing)."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., Any], names: tuple[str, ...], *tensors: torch.Tensor) -> Any:
        with torch.enable_grad():
            out = run(**{n: (t.detach().half() if t.dtype == torch.bfloat16 else t.detach()).requires_grad_()
                         for n, t in zip(names, tensors)})
        o, *final = out if isinstance(out, tuple) else (out,)
        ctx.node, ctx.names, ctx.dtypes = o.grad_fn, names, [t.dtype for t in tensors]
        return (o.detach().to(torch.bfloat16), *(f.detach() for f in final))

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor, *d_final: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        grads = node_gradients(ctx.node, do.float(), d_final, grad_dtype=torch.float32)
        if "initial_state" in grads:  # the delta rules' state is one part; the caller passed it as a tensor
            grads["initial_state"] = grads["initial_state"][0]
        return (None, None, *(grads[n].to(dtype) for n, dtype in zip(ctx.names, ctx.dtypes)))


def _bf16_backward_as_on_the_gpu(name: str) -> Callable[..., Any]:
    def call(initial_state: Any = None, return_state: bool = False, **inputs: Any) -> Any:
        for n, t in inputs.items():
            if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 and not torch.equal(t.half().to(t.dtype), t):
                raise NotImplementedError(f"{n} has entries fp16 carriers cannot hold exactly (below 2^-17 or above "
                                          "65504)")
        _delta_chunk_backward.products_precision = _as_for_bf16
        _delta_chunk_backward.wy_precision = _wy_as_for_bf16
        kernel = attnlab.kernel(name, "chunkwise")
        inputs["initial_state"] = initial_state
        tensors = {n: t for n, t in inputs.items() if isinstance(t, torch.Tensor)}
        rest = {n: value for n, value in inputs.items() if n not in tensors}
        out = _CarriedInFp16.apply(lambda **carried: kernel(**carried, **rest, return_state=return_state),
                                   tuple(tensors), *tensors.values())
        return out if return_state else out[0]

    call.__name__ = f"{name}_backward"
    return call


deltanet = _bf16_default_as_on_the_gpu("deltanet")
gated_deltanet = _bf16_default_as_on_the_gpu("gated_deltanet")
kda = _bf16_default_as_on_the_gpu("kda")
deltanet_backward = _bf16_backward_as_on_the_gpu("deltanet")
gated_deltanet_backward = _bf16_backward_as_on_the_gpu("gated_deltanet")
kda_backward = _bf16_backward_as_on_the_gpu("kda")
