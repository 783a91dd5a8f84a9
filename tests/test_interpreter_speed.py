"""The test suite's faster Triton interpreter (tests/kernels/interpreter_speed.py) computes the same bits."""

from __future__ import annotations

import os

import pytest
import torch

import attnlab
from attnlab.kernel import kernel

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="only under the Triton interpreter")


def _outputs_and_gradients(name: str) -> list[torch.Tensor]:
    x = attnlab.formulation(name).sample(B=1, T=40, H=2, K=16, V=16, seed=3)
    x = {n: t.half().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
         for n, t in x.items()}
    o = kernel(name, "chunkwise")(**x)
    o.float().square().sum().backward()
    return [o.detach()] + [t.grad for t in x.values() if isinstance(t, torch.Tensor) and t.grad is not None]


@pytest.mark.parametrize("name", ["gated_deltanet", "rwkv4"])
def test_patching_the_language_once_a_launch_changes_no_bits(name, monkeypatch):
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "once_a_launch", False), "conftest.py did not install it"
    fast = _outputs_and_gradients(name)
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.__wrapped__)
    plain = _outputs_and_gradients(name)
    assert len(fast) == len(plain) > 2 and all(torch.equal(a, b) for a, b in zip(fast, plain))
