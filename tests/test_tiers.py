"""The test command's two tiers (``make test``, CI, without the ``slow`` marker; ``make test-all``, everything), as
pytest collects them: the quick tier still holds every forward property and two backward checks to every one of
attnlab's kernels in fp16, and leaves the per-kernel tests' fp32 cases to the slow tier."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from attnlab.properties.session import QUICK_BACKWARD_CHECKS

ROOT = Path(__file__).resolve().parent.parent


def _collected(*options: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "--attnlab-profile", "ci", *options, "properties/test_kernel_properties.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::test_kernel_property[" in line]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the tiers are the interpreter's (no GPU)")
def test_the_quick_tier_keeps_every_kernel_in_fp16_and_the_first_gradient_of_two_backward_checks():
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
        elif check in QUICK_BACKWARD_CHECKS:
            assert kept[check, target, dtype] == gradients[:1], (check, target, kept[check, target, dtype])
        elif check.startswith("backward_"):
            assert (check, target, dtype) not in kept, (check, target)
        else:
            assert kept[check, target, dtype] == [None], (check, target)
