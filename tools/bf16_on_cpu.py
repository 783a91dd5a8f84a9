"""The delta rules' and kda's bf16 default run on the CPU with the GPU's roundings, for the property suite.

bf16 kernels do not run under the Triton interpreter (it computes on bf16 bit patterns as integers). Their
default for bf16 inputs, precision "fp16", takes every operand's value exactly whatever its carrier: given fp32
copies of the bf16 inputs and precision="fp16", these kernels make the roundings the GPU makes on the bf16
inputs (fp16-scaled dot operands, bf16 hi/lo splits, fp32 sums; not bit for bit, the order of the sums
differs), and their fp32 output rounded once to bf16 stands for the GPU's bf16 output. Point the property suite
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
the bf16 inputs carried in fp16 (exact inside fp16's range), so that the backward accumulates in fp32 as on bf16
inputs, and its products chosen as for bf16 inputs of the same shape (products_precision: "fp16_emulated"
where the GPU takes "fp16", for every dtype in the process from the first call on). They take an initial state
and return the final one, as the kernels do: the suite then draws both (a stand-in without them, before session
26, missed the failures a drawn state brings out on the GPU, which it now reproduces to three digits). The
forward then runs its fp16 inputs' path, not the bf16 one: a closer stand-in for the backward than for the
forward. The gradients come back in fp16, the carriers' dtype, where the GPU's are bf16: a
gradient entry below fp16's normal range (6.1e-5) keeps fewer bits here than there, so a failure on such entries
is the stand-in's (gated_deltanet's dg of 1.2e-7 at T = 2, beta near 0, read 18 % off: reports/bench.md, session 25).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import attnlab
from attnlab.kernels import _delta_chunk_backward

_CHOSEN = _delta_chunk_backward.products_precision


def _as_for_bf16(dtype: torch.dtype, K: int, V: int, positions: int) -> str:
    """The backward's products as chosen for bf16 inputs of this shape, whatever the carriers' dtype."""
    return _CHOSEN(torch.bfloat16, K, V, positions)


def _output_in_bf16(out: Any) -> Any:
    """The kernel's output (o, or o and the state) with o rounded once to bf16, as the GPU's kernel writes it."""
    if isinstance(out, tuple):
        return (out[0].to(torch.bfloat16), *out[1:])
    return out.to(torch.bfloat16)


def _bf16_default_as_on_the_gpu(name: str) -> Callable[..., Any]:
    def call(**inputs: Any) -> Any:
        carried = {n: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t
                   for n, t in inputs.items()}
        out = attnlab.kernel(name, "chunkwise", precision="fp16")(**carried)
        return _output_in_bf16(out)

    call.__name__ = name
    return call


def _bf16_backward_as_on_the_gpu(name: str) -> Callable[..., Any]:
    def call(initial_state: Any = None, return_state: bool = False, **inputs: Any) -> Any:
        carried = {n: t.half() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t
                   for n, t in inputs.items()}
        _delta_chunk_backward.products_precision = _as_for_bf16
        out = attnlab.kernel(name, "chunkwise")(**carried, initial_state=initial_state, return_state=return_state)
        return _output_in_bf16(out)

    call.__name__ = f"{name}_backward"
    return call


deltanet = _bf16_default_as_on_the_gpu("deltanet")
gated_deltanet = _bf16_default_as_on_the_gpu("gated_deltanet")
kda = _bf16_default_as_on_the_gpu("kda")
deltanet_backward = _bf16_backward_as_on_the_gpu("deltanet")
gated_deltanet_backward = _bf16_backward_as_on_the_gpu("gated_deltanet")
kda_backward = _bf16_backward_as_on_the_gpu("kda")
