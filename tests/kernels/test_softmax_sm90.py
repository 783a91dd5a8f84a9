"""softmax's warp-specialized Hopper kernel (attnlab.kernels._softmax_sm90) and when it runs.

- The rule (``_warp_specialized_fits``): sm_90 only, 16-bit inputs, precision "fp16" or "input", head dims
  64 or 128, TMA-aligned rows, the Triton kernel's launch options at their defaults. Checked anywhere.
- On an sm_90 GPU: with V in fp16 (precision "fp16") it gives the same bits as the Triton kernel, which
  computes the same roundings in the same order; with precision "input" (bf16 P @ V) the two differ by no
  more than one output rounding (normwise); its excess stays within kernel_checks' bounds (EXCESS_BOUND, and
  ANY_PRECISION_EXCESS_BOUND for the speed setting "input") with no non-finite entries.
  Shapes: partial last blocks, T = 1, non-causal, K != V, several heads and batches.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import ANY_PRECISION_EXCESS_BOUND, EXCESS_BOUND

import attnlab
from attnlab.kernel import kernel
from attnlab.kernels.softmax import DEFAULT_LAUNCH_OPTIONS, _device_capability, _warp_specialized_fits
from attnlab.metrics import conditioning_floor, measure, rel_err, unit_roundoff


def _inputs(dtype, B, T, H, K, V, device="cpu", seed=0):
    x = attnlab.formulation("softmax").sample(B=B, T=T, H=H, K=K, V=V, seed=seed)
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


@pytest.mark.parametrize(
    "change,fits",
    [
        ({}, True),
        ({"K": 64, "V": 64, "precision": "input", "dtype": torch.float16}, True),
        ({"capability": (8, 0)}, False),
        ({"capability": (10, 0)}, False),
        ({"capability": None}, False),
        ({"dtype": torch.float32}, False),
        ({"precision": "split"}, False),
        ({"K": 96}, False),
        ({"V": 32}, False),
        ({"launch": (64, 128, None, None)}, False),
        ({"launch": (None, 64, None, None)}, False),
        ({"launch": (None, 128, 8, None)}, False),
        ({"launch": (None, 128, None, 3)}, False),
        ({"misaligned": True}, False),
    ],
)
def test_the_warp_specialized_kernel_runs_where_it_was_built_for(change, fits):
    case = {"dtype": torch.bfloat16, "K": 128, "V": 128, "precision": "fp16", "capability": (9, 0),
            "launch": DEFAULT_LAUNCH_OPTIONS, "misaligned": False, **change}
    x = _inputs(case["dtype"], B=1, T=8, H=2, K=case["K"], V=case["V"])
    if case["misaligned"]:
        # One element in: every head's row starts 2 bytes off the 16-byte boundary TMA needs.
        x["q"] = torch.empty(x["q"].numel() + 1, dtype=x["q"].dtype)[1:].view(x["q"].shape).copy_(x["q"])
    assert _warp_specialized_fits(x["q"], x["k"], x["v"], case["precision"], case["capability"], case["launch"]) is fits


def test_no_capability_off_the_gpu():
    assert _device_capability(torch.zeros(1)) is None


SHAPES = [  # B, T, H, K, V, causal
    (2, 1000, 3, 128, 128, True),
    (1, 777, 2, 64, 64, False),
    (2, 300, 2, 64, 128, True),
    (1, 129, 2, 128, 64, True),
    (1, 1, 2, 128, 128, True),
    (1, 4096, 1, 128, 128, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-T{t}-H{h}-K{k}-V{v}-{'causal' if c else 'full'}"
                                               for b, t, h, k, v, c in SHAPES])
def test_warp_specialized_kernel_matches_the_triton_kernel_gpu(shape, dtype):
    B, T, H, K, V, causal = shape
    x = _inputs(dtype, B, T, H, K, V, device="cuda", seed=T)
    if _device_capability(x["q"]) != (9, 0):
        pytest.skip("the warp-specialized kernel is built for sm_90")
    assert _warp_specialized_fits(x["q"], x["k"], x["v"], "fp16", (9, 0), DEFAULT_LAUNCH_OPTIONS)
    reference = attnlab.oracle("softmax", "chunkwise", "float64")
    ref = reference(**x, causal=causal)
    floor_cond = conditioning_floor(reference, {**x, "causal": causal})
    for precision in ("fp16", "input"):
        ours = kernel("softmax", precision=precision)(**x, causal=causal)
        triton_kernel = kernel("softmax", precision=precision, warp_specialize=False)(**x, causal=causal)
        if precision == "fp16":
            assert torch.equal(ours, triton_kernel), f"{precision}: {rel_err(ours, triton_kernel):.3e}"
        else:
            assert rel_err(ours, triton_kernel) <= unit_roundoff(dtype)
        m = measure(ours, ref, dtype, floor_cond)
        bound = EXCESS_BOUND[dtype] if precision == "fp16" else ANY_PRECISION_EXCESS_BOUND
        assert m.nonfinite == 0 and m.excess <= bound, f"{precision}: {m.as_dict()}"
