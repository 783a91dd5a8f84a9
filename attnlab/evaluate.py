"""Measure an implementation against the float64 oracle on the registry's inputs.

The GPU shape checks (tools/gpu/shapes.py) measure each kernel this way, and the reports share its steps:
draw the registry's default inputs, round them to the implementation's
dtype, evaluate the float64 chunkwise oracle on exactly those rounded inputs
(on the same device), and return the :class:`attnlab.metrics.Measurement`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from attnlab.metrics import Measurement, conditioning_floor, measure
from attnlab.oracle import as_formulation, oracle
from attnlab.spec import Formulation

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}") from None


def rounded_inputs(
    name: str | Formulation, dtype: torch.dtype, device: str | torch.device, *, B: int, T: int, H: int, K: int, V: int, seed: int = 0,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The registry's default inputs of ``name`` (a name or a registry entry), optionally transformed in
    float64, rounded to ``dtype`` on ``device``."""
    x = as_formulation(name).sample(B=B, T=T, H=H, K=K, V=V, seed=seed)
    if transform is not None:
        x = transform(x)
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


def measure_against_oracle(
    name: str | Formulation,
    implementation: Callable[..., torch.Tensor],
    inputs: Mapping[str, Any],
    *,
    out_dtype: torch.dtype,
    conditioning: bool = True,
    chunk_size: int = 64,
) -> tuple[Measurement, torch.Tensor]:
    """Run ``implementation(**inputs)`` and measure it against the float64 chunkwise oracle on the same inputs."""
    reference = oracle(name, "chunkwise", "float64", chunk_size=chunk_size)
    ref = reference(**inputs)
    o = implementation(**inputs)
    floor_cond = conditioning_floor(reference, inputs, base=ref) if conditioning else 0.0
    return measure(o, ref, out_dtype, floor_cond), ref
