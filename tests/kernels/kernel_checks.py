"""What every kernel test asserts, in one place: the bounds and the checks against the float64 oracle (the
outputs; the gradients: ``check_gradients``).

The bounds are the registry's (attnlab.registry.BOUNDS, through ``bounds_for``; its ``why`` says how each
was measured), as multiples of the floor (attnlab.metrics): a kernel test on the registry's default inputs
asserts the accuracy bound on those inputs (``Bounds.on_default_inputs``: fp32 4, tighter than the 48 any input
is held to), the verdict "held". ``EXCESS_BOUND`` and ``STATE_BOUND`` are those columns by torch dtype, for the
tests that name no formulation; :func:`check_stateful_kernel` reads the formulation's own entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

import attnlab
from attnlab.evaluate import DTYPES
from attnlab.kernel import kernel
from attnlab.gradients import gradient_dtypes, gradient_floor, oracle_gradients
from attnlab.metrics import Measurement, conditioning_floor, measure, measure_gradients, rel_err
from attnlab.registry import BOUNDS, bounds_for

EXCESS_BOUND = {DTYPES[name]: b.on_default_inputs for name, b in BOUNDS.items()}
STATE_BOUND = {DTYPES[name]: b.state for name, b in BOUNDS.items()}
# Any precision choice of fp16 and bf16 kernels, speed settings included, stays within this: fla's own roundings
# measured 1.4 to 2.9 (DESIGN.md); attnlab's speed settings are held to it on the GPU (tests/test_kernels.py). It
# sits between the accuracy and the correctness bound (a speed setting may be "imprecise", never "failed"), well
# below the latter, so that a setting growing less accurate shows long before it would be graded failed.
ANY_PRECISION_EXCESS_BOUND = 4.0
assert all(EXCESS_BOUND[d] < ANY_PRECISION_EXCESS_BOUND < BOUNDS[name].correctness
           for name, d in DTYPES.items() if d != torch.float32), "ANY_PRECISION_EXCESS_BOUND: between the bounds"


def as_on_the_gpu_in_bf16(x: dict[str, Any]) -> dict[str, Any]:
    """bf16 inputs as the GPU's bf16 default of the delta rules and kda (precision "fp16") computes them,
    runnable here: fp32 carriers of the bf16 values for precision="fp16" (its operands enter exactly either
    way), so that the fp32 output is rounded to bf16 once, as the GPU's kernel writes it (tools/bf16_on_cpu.py)."""
    return {n: t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t for n, t in x.items()}


def check_stateful_kernel(
    name: str, form: str, x: dict[str, Any], dtype: torch.dtype, call: dict[str, Any] | None = None, **opts: Any
) -> tuple[torch.Tensor, Any, Measurement]:
    """Run ``attnlab.kernel(name, form, **opts)`` on ``x`` rounded to ``dtype`` and check it against the oracle.

    ``initial_state`` and absent (None) tensors are passed as given; ``call`` holds non-tensor options
    (feature_map, normalize...). Asserts the output dtype and shape, no non-finite entries, excess within
    the formulation's accuracy bound, and an fp32 final state within its state bound
    (attnlab.registry.bounds_for). Returns (o, final_state, measurement).
    """
    x = {n: (t if t is None or n == "initial_state" else t.to(dtype)) for n, t in x.items()}
    x.update(call or {})
    reference = attnlab.oracle(name, "chunkwise", "float64")
    o, state = kernel(name, form, **opts)(**x, return_state=True)
    ref, ref_state = reference(**x, return_state=True)
    assert o.dtype == dtype and o.shape == ref.shape
    assert all(part.dtype == torch.float32 for part in attnlab.formulation(name).state.split(state))
    bounds = bounds_for(attnlab.formulation(name), str(dtype).removeprefix("torch."))
    m = measure(o, ref, dtype, conditioning_floor(reference, {n: t for n, t in x.items() if t is not None}))
    assert m.nonfinite == 0, m.as_dict()
    assert m.excess <= bounds.on_default_inputs, m.as_dict()
    assert rel_err(state, ref_state) <= bounds.state
    return o, state, m


def with_state(name: str, x: dict, seed: int = 20) -> dict:
    """x with an initial state name's recurrence can reach: the final state of another draw (T = 16)."""
    B, _, H, K = x["q"].shape
    other = attnlab.formulation(name).sample(B=B, T=16, H=H, K=K, V=x["v"].shape[-1], seed=seed)
    return {**x, "initial_state": attnlab.oracle(name, "chunkwise", "float64")(**other, return_state=True)[1].float()}


def check_gradients(name: str, form: str, x: dict, dtype: torch.dtype, *, with_do: bool = True,
                    with_d_state: bool = True, **opts) -> dict[str, float]:
    """The kernel's gradients of ``<do, o> + <dS, final state>`` on x rounded to dtype (x's initial_state,
    if any, in fp32) against the float64 oracle's: dtypes, shapes, finiteness and the excess bound of
    tests/test_kernel_gradients.py (fp16 2, fp32 4). ``with_do=False`` puts do = 0 (only the final
    state's cotangent), ``with_d_state=False`` leaves the final state out of the loss. Returns the excess
    per gradient."""
    f = attnlab.formulation(name)
    x = {n: (t if t is None or n == "initial_state" else t.to(dtype)) for n, t in x.items()}
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items() if t is not None and n != "initial_state"}
    state = x.get("initial_state")
    state_leaf = state.detach().clone().float().requires_grad_() if state is not None else None
    call = {**x, **leaves, **({"initial_state": state_leaf} if state is not None else {})}
    o, final = kernel(name, form, **opts)(**call, return_state=True)
    gen = torch.Generator().manual_seed(11)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(dtype).double() * with_do
    d_state = torch.randn(final.shape, generator=gen, dtype=torch.float64).float().double() if with_d_state else None
    loss = (o.double() * do).sum() + ((final.double() * d_state).sum() if with_d_state else 0.0)
    got = torch.autograd.grad(loss, [*leaves.values(), *([state_leaf] if state is not None else [])])
    grads = dict(zip(leaves, got))
    for n, g in grads.items():
        assert g.dtype == dtype and g.shape == leaves[n].shape, n
    if state is not None:
        grads["initial_state"] = got[-1]
        assert got[-1].dtype == torch.float32
    reference = oracle_gradients(f, x, do, d_state)
    dtypes = gradient_dtypes(f, x)
    if state is not None:
        dtypes["initial_state"] = dtype
    measured = measure_gradients(grads, reference, dtypes, gradient_floor(f, x, do, d_state, base=reference))
    for n, m in measured.items():
        assert m.nonfinite == 0 and m.excess <= EXCESS_BOUND[dtype], (n, m.as_dict())
    return {n: m.excess for n, m in measured.items()}


def sweep(values: Sequence[Any], ids: Sequence[str] | None = None) -> list[Any]:
    """A parametrize axis whose first value runs in every test run and whose others carry the ``slow`` marker:
    they run in ``make test-all``, not in ``make test`` (CI: a 2-core machine under the interpreter, 15 minutes)."""
    ids = list(ids) if ids is not None else [None] * len(values)
    return [pytest.param(*(v if isinstance(v, tuple) else (v,)), id=i, marks=() if n == 0 else (pytest.mark.slow,))
            for n, (v, i) in enumerate(zip(values, ids))]
