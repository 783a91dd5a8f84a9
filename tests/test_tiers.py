"""The test command's two tiers (``make test``, CI, without the ``slow`` marker; ``make test-all``, everything), as
pytest collects them: the quick tier still holds every property check to every one of attnlab's kernels."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _collected(*options: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--attnlab-profile", "ci", *options, "properties/test_kernel_properties.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::test_kernel_property[" in line]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiers are the interpreter's (no GPU)")
def test_the_quick_tier_keeps_one_gradient_of_every_backward_check_on_every_kernel_in_fp16():
    everything, quick = _collected(), _collected("-m", "not slow")
    assert 0 < len(quick) < len(everything)
    pattern = re.compile(r"\[(\w+)(?:\[(\w+)\])?-(attnlab:[\w/]+)-(\w+)\]$")
    kept, every = defaultdict(list), defaultdict(list)
    for ids, table in ((everything, every), (quick, kept)):
        for line in ids:
            check, gradient, target, dtype = pattern.search(line).groups()
            table[check, target, dtype].append(gradient)
    for (check, target, dtype), gradients in every.items():
        if dtype == "float32":
            assert (check, target, dtype) not in kept, (check, target)
        elif check.startswith("backward_"):
            assert kept[check, target, dtype] == gradients[:1], (check, target, kept[check, target, dtype])
        else:
            assert kept[check, target, dtype] == [None], (check, target)
