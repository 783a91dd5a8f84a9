"""Repository-wide pytest set-up: the Triton interpreter on machines without a GPU,
the ``gpu`` marker, and hypothesis profiles (``ci``, ``dev``, ``gpu``, ``thorough``)."""

import os

import torch

if not torch.cuda.is_available():
    # Must happen before any @triton.jit decorator runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_slow_ok = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", derandomize=True, deadline=None, database=None, max_examples=25,
                          print_blob=True, suppress_health_check=_slow_ok)
settings.register_profile("dev", deadline=None, max_examples=50, suppress_health_check=_slow_ok)
settings.register_profile("gpu", deadline=None, max_examples=200, suppress_health_check=_slow_ok)
settings.register_profile("thorough", deadline=None, max_examples=2000, suppress_health_check=_slow_ok)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
