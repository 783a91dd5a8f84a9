"""Repository-wide pytest set-up: the Triton interpreter on machines without a GPU.

The ``gpu`` marker and the hypothesis profiles (``attnlab-ci``, ``-dev``,
``-gpu``, ``-thorough``) come from attnlab's pytest plugin
(attnlab/pytest_plugin.py, entry point ``pytest11``).
"""

import os
import sys
from pathlib import Path

# The interpreter's many small numpy matmuls run 1000x slower with OpenBLAS threads on a loaded 2-core machine.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must happen before any @triton.jit decorator runs.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/kernels/kernel_checks.py holds the bounds every kernel test asserts; tests/test_kernels.py imports them too.
sys.path.insert(0, str(Path(__file__).parent / "tests" / "kernels"))

if os.environ.get("TRITON_INTERPRET") == "1":
    # A third of an interpreted kernel's time went to re-patching triton.language on every helper's call
    # (tests/kernels/interpreter_speed.py; tests/test_interpreter_speed.py holds it to the same bits).
    from interpreter_speed import patch_the_language_once_a_launch  # noqa: E402

    patch_the_language_once_a_launch()
