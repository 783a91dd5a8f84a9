"""Where kernels run in this process: compiled on a CUDA GPU, or under the Triton interpreter on the CPU.

The lowest layer of the package (it imports neither the registry nor any kernel): importing it sets
``TRITON_INTERPRET=1`` when no CUDA device is present, which must happen before the first ``@triton.jit``
decorator runs, so every module that may import Triton imports this one first.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreter_active() -> bool:
    """Whether Triton kernels run under the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
