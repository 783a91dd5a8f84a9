"""What every kernel test asserts, in one place: the bounds and the check against the float64 oracle.

Bounds are multiples of the floor (attnlab.metrics): the issue's targets, excess <= 2 in fp16 and <= 1.5
in bf16, and 4 in fp32; the final state is kept in fp32 but built from low-precision intermediates, so it
is bounded by the input dtype's unit roundoff (fp32: 1e-5).
"""

from __future__ import annotations

from typing import Any

import torch

import attnlab
from attnlab.kernel import kernel
from attnlab.metrics import Measurement, conditioning_floor, measure, rel_err

EXCESS_BOUND = {torch.float16: 2.0, torch.bfloat16: 1.5, torch.float32: 4.0}
# Any precision choice, speed settings included (fla's own roundings measured 1.4 to 2.9), stays within this;
# a wrong answer (a bad tile, a lost chunk) lands far above it.
ANY_PRECISION_EXCESS_BOUND = 4.0
STATE_BOUND = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 1e-5}


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
    EXCESS_BOUND, and an fp32 final state within STATE_BOUND. Returns (o, final_state, measurement).
    """
    x = {n: (t if t is None or n == "initial_state" else t.to(dtype)) for n, t in x.items()}
    x.update(call or {})
    reference = attnlab.oracle(name, "chunkwise", "float64")
    o, state = kernel(name, form, **opts)(**x, return_state=True)
    ref, ref_state = reference(**x, return_state=True)
    assert o.dtype == dtype and o.shape == ref.shape
    assert all(part.dtype == torch.float32 for part in attnlab.formulation(name).state.split(state))
    m = measure(o, ref, dtype, conditioning_floor(reference, {n: t for n, t in x.items() if t is not None}))
    assert m.nonfinite == 0, m.as_dict()
    assert m.excess <= EXCESS_BOUND[dtype], m.as_dict()
    assert rel_err(state, ref_state) <= STATE_BOUND[dtype]
    return o, state, m
