"""Small helpers shared by the kernel modules."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def no_pending_checks() -> None:
    """``await_checks`` of a kernel function called directly, not through attnlab.kernel: nothing to wait for.

    attnlab.kernel passes the wait of its queued value checks (attnlab.validation.ValueScan); every
    kernel function calls ``await_checks()`` after its host-side preparation, before its first launch.
    """


def block_size(n: int, minimum: int = 16) -> int:
    """The power-of-two tile covering ``n`` (at least ``minimum``, the tl.dot minimum on GPUs)."""
    return max(minimum, triton.next_power_of_2(n))


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def zero_state(shape: tuple[int, ...], device: torch.device, fill: float = 0.0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=torch.float32, device=device)


def gpu_shape_known_bad(K: int, V: int, max_K: int = 128) -> bool:
    """Shapes at which chunkwise kernels fail on the GPU: K or V not a multiple of 16, or K > max_K.

    Measured on an H200 (triton 3.6): the fused linear_attn and retnet kernels gave wrong outputs at
    K=44, V=12 (T=2627) and, for linear_attn, K=V=256; illegal memory accesses at K=V=1. Every
    shape with K and V multiples of 16 up to 128 was right. On an H100 (2026-11-25) gla's and
    general's chunkwise kernels (kernels/_gated.py, right at K = V = 256) gave wrong outputs at
    K=44, V=12 (T=300) and general's an illegal memory access; K=1, V=44 and K=V=12 were right.
    Until the causes are found, those modules route such shapes to their recurrent kernels, which
    are right everywhere; the interpreter (CPU) keeps testing the chunkwise kernels.
    """
    import os

    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    return not interpreting and (K % 16 != 0 or V % 16 != 0 or K > max_K)
