"""attnlab's kernels as autograd nodes (attnlab.kernel; each module's ``BACKWARD``), generic over the registry.

Every form whose kernel module declares a backward is checked on the CPU under the Triton interpreter, in fp16 and
fp32, on the registry's inputs: each gradient against the float64 gradient oracle (attnlab.gradients), as an
excess over the larger of its rounding floor in the dtype it is returned in and its conditioning floor
(attnlab.metrics.measure_gradients); with a drawn initial state and a final-state cotangent, and without. The
bound is the entry's gradient accuracy bound (bf16 1.5, fp16 2), and in fp32 the forward's bound on the registry's
inputs (4, not the 48 any input is held to: these are the default inputs). Every backward is causal: with do zero
from a position on, the gradients there are exactly zero. A form without a backward refuses inputs that require
grad with a message that says so. At shapes that leave most of every tile masked (one token and one channel; a
length and head dims off every block) each form also runs with every load and store checked against its launch's
tensors (tests/kernels/memory_bounds.py). The ``gpu`` tests run the same check in bf16 and fp16 on the GPU, at
a length of several chunks and head dims of 64 (each prints its excess per gradient).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

import attnlab
from attnlab.gradients import gradient_dtypes, gradient_floor, log_scale_cotangent, oracle_gradients
from attnlab.kernel import backward_forms, kernel, kernel_options
from attnlab.metrics import measure_gradients
from attnlab.registry import bounds_for, formulation, names
from attnlab.properties.traits import time_axes
from memory_bounds import checked_addresses

INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run where there is no GPU")

SIZES = dict(B=1, T=40, H=2, K=16, V=16)
CUT = 21  # the causality test's first position with do = 0
# On the GPU: several chunks of every chunk size, head dims of the bench's tiles.
GPU_SIZES = dict(B=2, T=300, H=2, K=64, V=64)
# Shapes that leave most of every tile masked: one token and one channel; a length and head dims off every block.
NARROW_SIZES = [dict(B=2, T=1, H=1, K=1, V=1), dict(B=1, T=65, H=1, K=17, V=3)]


DIFFERENTIABLE = [(name, form) for name in names() for form in backward_forms(name)]


def gradient_bound(name: str, dtype: torch.dtype) -> float:
    bounds = bounds_for(formulation(name), str(dtype).removeprefix("torch."))
    return bounds.on_default_inputs if dtype == torch.float32 else bounds.gradient_accuracy


def _inputs(name: str, dtype: torch.dtype, seed: int, sizes: dict[str, int] = SIZES) -> dict[str, Any]:
    x = formulation(name).sample(**sizes, seed=seed)
    return {n: t.to(dtype) for n, t in x.items()}


def check_gradients(name: str, form: str, dtype: torch.dtype, stateful: bool, seed: int = 0,
                    device: str = "cpu", sizes: dict[str, int] = SIZES) -> dict[str, float]:
    """The kernel's gradients of ``<do, o>`` (+ ``<dS, final state>`` when ``stateful``) on ``device`` against the
    float64 oracle's on the CPU: dtypes, shapes, finiteness and excess. Returns the excess per gradient."""
    f = formulation(name)
    x = _inputs(name, dtype, seed, sizes)
    gen = torch.Generator().manual_seed(seed + 1)
    if stateful:  # a state the formulation can reach: the final state of another input's run
        other = {n: t.double() for n, t in _inputs(name, torch.float32, seed + 100, sizes).items()}
        earlier = attnlab.oracle(name, "chunkwise", "float64")(**other, return_state=True)[1]
        x["initial_state"] = f.state.join(tuple(p.float() for p in f.state.split(earlier)))
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()
              if isinstance(t, torch.Tensor) and n != "initial_state" and f.arg(n).differentiable}
    state_leaves = ()
    if stateful:
        state_leaves = tuple(p.detach().clone().requires_grad_() for p in f.state.split(x["initial_state"]))
    call = {**{n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in x.items()},
            **{n: t.to(device) for n, t in leaves.items()}}  # .to() is differentiable: the leaves stay on the CPU
    if stateful:
        call["initial_state"] = f.state.join(tuple(p.to(device) for p in state_leaves))
    if f.state is None:
        o = kernel(name, form)(**call).cpu()
    else:
        o, final = kernel(name, form)(**call, return_state=True)
        final = f.state.join(tuple(p.cpu() for p in f.state.split(final)))
        o = o.cpu()
    # Cotangents representable in the dtype autograd hands the backward (o's, the fp32 state's): the oracle's are exact.
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).double()
    loss = (o.double() * do).sum()
    d_reference = None
    if stateful:
        reference_final = attnlab.oracle(name, "chunkwise", "float64")(**x, return_state=True)[1]
        d_scaled = tuple(torch.randn(p.shape, generator=gen, dtype=torch.float64).float().double()
                         for i, p in enumerate(f.state.split(final)) if not f.state.is_log_scale(i))
        d_kernel = f.state.split(log_scale_cotangent(f, final, f.state.join(d_scaled)))
        loss = loss + sum((p.double() * d).sum() for p, d in zip(f.state.split(final), d_kernel))
        d_reference = log_scale_cotangent(f, reference_final, f.state.join(d_scaled))
    got = torch.autograd.grad(loss, [*leaves.values(), *state_leaves])
    grads = dict(zip(leaves, got))
    if stateful:
        grads["initial_state"] = f.state.join(tuple(got[len(leaves):]))
    reference = oracle_gradients(f, x, do, d_reference)
    dtypes = gradient_dtypes(f, x)
    if stateful:  # returned in fp32, built from intermediates in the input dtype (FORMULATIONS.md, "final state")
        dtypes["initial_state"] = dtype
    for n, g in grads.items():
        for part, leaf in zip(g if isinstance(g, tuple) else (g,), state_leaves if n == "initial_state" else (leaves[n],)):
            assert part.shape == leaf.shape and part.dtype == leaf.dtype, (n, part.shape, part.dtype)
    floors = gradient_floor(f, x, do, d_reference, base=reference)
    measured = measure_gradients(grads, reference, dtypes, floors)
    bound = gradient_bound(name, dtype)
    for n, m in measured.items():
        assert m.nonfinite == 0 and m.excess <= bound, (n, m.as_dict())
    return {n: m.excess for n, m in measured.items()}


@INTERPRETER_ONLY
@pytest.mark.parametrize("stateful", [False, True], ids=["plain", "state"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name,form", DIFFERENTIABLE, ids=[f"{n}-{f}" for n, f in DIFFERENTIABLE])
def test_every_gradient_matches_the_oracle(name, form, dtype, stateful):
    if stateful and formulation(name).state is None:
        pytest.skip(f"{name} has no state")
    check_gradients(name, form, dtype, stateful)


@INTERPRETER_ONLY
@pytest.mark.parametrize("sizes", NARROW_SIZES, ids=["T1-K1-V1", "T65-K17-V3"])
@pytest.mark.parametrize("name,form", DIFFERENTIABLE, ids=[f"{n}-{f}" for n, f in DIFFERENTIABLE])
def test_every_kernel_stays_inside_its_tensors(name, form, sizes):
    """Forward and backward, with a state where the formulation has one, every load and store lands inside the
    tensors of its launch (tests/kernels/memory_bounds.py; a lane a mask lets past its tensor reads another
    allocation silently on a GPU, or faults there), and the gradients hold their bound."""
    with checked_addresses():
        check_gradients(name, form, torch.float16, formulation(name).state is not None, sizes=sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("stateful", [False, True], ids=["plain", "state"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,form", DIFFERENTIABLE, ids=[f"{n}-{f}" for n, f in DIFFERENTIABLE])
def test_every_gradient_matches_the_oracle_gpu(name, form, dtype, stateful):
    if stateful and formulation(name).state is None:
        pytest.skip(f"{name} has no state")
    excess = check_gradients(name, form, dtype, stateful, device="cuda", sizes=GPU_SIZES)
    print(f"{name} {form} {dtype} {'state' if stateful else 'plain'}: "
          + ", ".join(f"{n} {e:.2f}" for n, e in excess.items()))


@INTERPRETER_ONLY
@pytest.mark.parametrize("name,form", DIFFERENTIABLE, ids=[f"{n}-{f}" for n, f in DIFFERENTIABLE])
def test_gradients_are_causal(name, form):
    """do zero from position 21 on (inside a chunk of 16 where the form chunks) and no final-state cotangent: every
    gradient of an input indexed by time is exactly zero at times >= 21 (the gates', beta's, aft's bias rows
    included), and not zero before."""
    f = formulation(name)
    x = {n: t.half().requires_grad_() if f.arg(n).differentiable else t
         for n, t in _inputs(name, torch.float32, 31).items()}
    chunking = kernel_options(name, form).get("chunk_size")
    o = kernel(name, form, **({"chunk_size": 16} if chunking and 16 in chunking[1] else {}))(**x)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(32)).half()
    do[:, CUT:] = 0
    timed = {n: time_axes(f.arg(n))[0] for n, t in x.items() if t.requires_grad and time_axes(f.arg(n))}
    assert timed, name
    grads = torch.autograd.grad(o, [x[n] for n in timed], do)
    for (n, axis), g in zip(timed.items(), grads):
        assert not g.narrow(axis, CUT, g.shape[axis] - CUT).any(), n
        assert g.narrow(axis, 0, CUT).any(), n


def test_every_kernel_form_trains():
    assert DIFFERENTIABLE == [(name, form) for name in names() for form in formulation(name).kernel_forms]


@INTERPRETER_ONLY
def test_a_kernel_without_a_backward_refuses_inputs_that_require_grad(monkeypatch):
    """The contract for a form whose module declares no backward (none today: one is taken out here)."""
    name, form = "kda", "chunkwise"
    monkeypatch.delitem(importlib.import_module(formulation(name).kernel_module).BACKWARD, form)
    x = _inputs(name, torch.float32, 0)
    q = next(n for n, t in x.items() if isinstance(t, torch.Tensor) and formulation(name).arg(n).differentiable)
    x[q] = x[q].requires_grad_()
    with pytest.raises(NotImplementedError, match="has no backward pass yet"):
        kernel(name, form)(**x)
    with torch.no_grad():
        assert kernel(name, form)(**x).shape[0] == SIZES["B"]
