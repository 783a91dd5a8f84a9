"""Small helpers shared by the kernel modules."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def block_size(n: int, minimum: int = 16) -> int:
    """The power-of-two tile covering ``n`` (at least ``minimum``, the tl.dot minimum on GPUs)."""
    return max(minimum, triton.next_power_of_2(n))


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def zero_state(shape: tuple[int, ...], device: torch.device, fill: float = 0.0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=torch.float32, device=device)
