"""Every kernel whose state is one [B, H, K, V] matrix, started from a given state: T = 1 with two batches
and two heads, each with its own state, both forms, fp16 and fp32. Driven by the registry; CPU (Triton
interpreter). linear_attn (S and a positive normalizer z) and rwkv4 (a log-scale part) have their own tests."""

from __future__ import annotations

import pytest
import torch

import attnlab
from kernel_checks import check_stateful_kernel

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests run where there is no GPU")

MATRIX_STATE = [(f.name, form) for f in attnlab.REGISTRY if f.state is not None and len(f.state.parts) == 1
                for form in f.kernel_forms]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name,form", MATRIX_STATE)
def test_single_step_from_a_state(name, form, dtype):
    x = attnlab.formulation(name).sample(B=2, T=1, H=2, K=16, V=16, seed=0)
    x["initial_state"] = torch.randn(2, 2, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    check_stateful_kernel(name, form, x, dtype)
