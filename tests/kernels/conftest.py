"""The per-kernel tests' slow tier: their cases in fp32 (a dtype parameter torch.float32) carry pytest's ``slow``
marker, so ``make test`` (CI) runs them in fp16, where the kernels meet real rounding, and ``make test-all`` in both.
tests/test_kernels.py and tests/test_kernel_gradients.py hold every kernel's output and gradients to the oracle in
fp32 in both tiers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (callspec is not None and Path(item.path).resolve().parent == HERE
                and any(value is torch.float32 for value in callspec.params.values())):
            item.add_marker(pytest.mark.slow)
