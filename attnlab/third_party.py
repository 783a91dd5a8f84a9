"""torch's own softmax attention kernels, pinned one by one, as kernels a user can validate.

``torch.nn.functional.scaled_dot_product_attention`` (SDPA) picks a backend
per call; to judge one backend, forward and backward, it has to be pinned.
Each function here pins one and is called like SDPA: head-first tensors
``[B, H, T, D]``, ``query, key, value`` positional, ``is_causal`` and
``scale`` (None: ``D ** -0.5``) as keywords, ``o`` returned in the same
layout. All are differentiable: autograd runs the backward of the kernel the
forward ran. The registry declares each as a peer of softmax (library
"torch", SDPA's convention), so ``attnlab validate`` and the torch campaign
call them through attnlab.conventions like any third-party kernel.

- :func:`sdpa_flash`: SDPBackend.FLASH_ATTENTION. On CUDA, FlashAttention-2:
  fp16 and bf16 only (an sm80+ GPU). On the CPU torch has its own flash-style
  kernel (any float dtype), which the same pin selects: it runs here.
- :func:`sdpa_efficient`: SDPBackend.EFFICIENT_ATTENTION (memory-efficient,
  xformers' cutlass kernel): CUDA only (fp16, bf16, fp32).
- :func:`sdpa_cudnn`: SDPBackend.CUDNN_ATTENTION: CUDA only, fp16 and bf16
  (cuDNN 9, sm80+).
- :func:`sdpa_math`: SDPBackend.MATH, the reference composition of matmuls
  and softmax: anywhere, any float dtype.
- :func:`flex_attention_causal`: torch.nn.attention.flex_attention compiled
  with torch.compile, the causal mask as a block mask (create_block_mask);
  non-causal calls pass no mask. In practice CUDA: on the CPU it compiles
  through inductor's C++ backend (tens of seconds per shape) and torch has no
  CPU backward, so it refuses inputs that require grad there.

A backend that cannot run the inputs raises NotImplementedError (a
RuntimeError: Python's "not supported") naming the backend, where it runs
and, where torch gave them, torch's reasons (SDPA itself only says "No
available kernel"). attnlab's properties count such an input as declined and
draw another (cuDNN has no kernel for T = 1); a kernel that declines every
input is refused, never a crash.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "sdpa_math", "flex_attention_causal", "BACKENDS"]

# backend function name -> (SDPBackend, its name in messages, where it runs)
BACKENDS: dict[str, tuple[SDPBackend, str, str]] = {
    "sdpa_flash": (SDPBackend.FLASH_ATTENTION, "flash",
                   "CUDA with fp16/bf16 (FlashAttention-2, sm80+), or torch's CPU flash kernel"),
    "sdpa_efficient": (SDPBackend.EFFICIENT_ATTENTION, "memory-efficient", "CUDA only (fp16, bf16, fp32)"),
    "sdpa_cudnn": (SDPBackend.CUDNN_ATTENTION, "cuDNN", "CUDA only, fp16/bf16 (cuDNN 9, sm80+)"),
    "sdpa_math": (SDPBackend.MATH, "math", "anywhere, any float dtype"),
}

# What SDPA raises when the pinned backend cannot take the inputs (CUDA builds; CPU builds).
_NO_KERNEL = ("No available kernel", "No viable backend")
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)")


def _describe(query: torch.Tensor) -> str:
    return f"query {tuple(query.shape)} {str(query.dtype).removeprefix('torch.')} on {query.device}"


def _pinned(function: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
            scale: float | None) -> torch.Tensor:
    """SDPA under ``sdpa_kernel(backend)``; "no kernel" turned into NotImplementedError naming the backend and why."""
    backend, name, where = BACKENDS[function]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(query, key, value, is_causal=is_causal, scale=scale)
        except RuntimeError as error:
            if not any(s in str(error) for s in _NO_KERNEL):
                raise
            reasons = "; ".join(dict.fromkeys(_TRIGGERED.sub("", str(w.message)).strip() for w in caught))
            raise NotImplementedError(
                f"torch SDPA pinned to the {name} backend ({backend.name}) cannot run {_describe(query)}: it runs on "
                f"{where}. torch: {str(error).strip()}" + (f" Reasons torch gave: {reasons}" if reasons else "")
            ) from None
    for w in caught:  # the call ran: pass its warnings on as they came
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return o


def sdpa_flash(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
               scale: float | None = None) -> torch.Tensor:
    """SDPA pinned to SDPBackend.FLASH_ATTENTION, ``[B, H, T, D]`` in and out.

    CUDA: FlashAttention-2, fp16/bf16 only (sm80+); fp32 there is refused with a
    NotImplementedError naming the backend. CPU: torch's own flash-style CPU kernel,
    which the same pin selects (any float dtype)."""
    return _pinned("sdpa_flash", query, key, value, is_causal, scale)


def sdpa_efficient(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
                   scale: float | None = None) -> torch.Tensor:
    """SDPA pinned to SDPBackend.EFFICIENT_ATTENTION (memory-efficient), ``[B, H, T, D]`` in and out.

    CUDA only (fp16, bf16, fp32); elsewhere NotImplementedError naming the backend."""
    return _pinned("sdpa_efficient", query, key, value, is_causal, scale)


def sdpa_cudnn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
               scale: float | None = None) -> torch.Tensor:
    """SDPA pinned to SDPBackend.CUDNN_ATTENTION, ``[B, H, T, D]`` in and out.

    CUDA only, fp16/bf16 (cuDNN 9, sm80+); elsewhere NotImplementedError naming the backend."""
    return _pinned("sdpa_cudnn", query, key, value, is_causal, scale)


def sdpa_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = False,
              scale: float | None = None) -> torch.Tensor:
    """SDPA pinned to SDPBackend.MATH (matmuls and a softmax, composed), ``[B, H, T, D]`` in and out.

    Runs anywhere, in any float dtype (fp16/bf16 inputs are computed in fp32 on the CPU by torch)."""
    return _pinned("sdpa_math", query, key, value, is_causal, scale)


# ----------------------------------------------------------------------------- FlexAttention


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    """flex_attention under torch.compile, made once (dynamo keeps one compiled graph per shape class)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return q_idx >= kv_idx


@functools.cache
def _flex(T: int, device: str) -> tuple[Callable[..., torch.Tensor], object]:
    """The compiled flex_attention and the causal block mask for length ``T`` on ``device``, built once per pair."""
    from torch.nn.attention.flex_attention import create_block_mask

    return _compiled_flex(), create_block_mask(_causal, None, None, T, T, device=device)


def flex_attention_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool = True,
                          scale: float | None = None) -> torch.Tensor:
    """torch.nn.attention.flex_attention, compiled with torch.compile, ``[B, H, T, D]`` in and out.

    Causal through a block mask (create_block_mask, cached per (T, device) with the compiled function);
    ``is_causal=False`` passes no mask. Needs torch.compile (Triton on CUDA, which is where it is meant to
    run). On the CPU inductor compiles C++ (tens of seconds per new shape) and torch has no backward: inputs
    that require grad are declined there with NotImplementedError naming FlexAttention."""
    if query.device.type == "cpu" and torch.is_grad_enabled() and any(
            t.requires_grad for t in (query, key, value)):
        raise NotImplementedError(f"FlexAttention (torch.nn.attention.flex_attention) cannot run the backward of "
                           f"{_describe(query)}: torch has no FlexAttention backward on the CPU; use CUDA "
                           "(or inputs that do not require grad)")
    if is_causal and query.shape[-2] != key.shape[-2]:
        raise ValueError(f"flex_attention_causal: is_causal needs as many queries as keys "
                         f"(got {query.shape[-2]} and {key.shape[-2]})")
    compiled, mask = _flex(query.shape[-2], str(query.device)) if is_causal else (_compiled_flex(), None)
    try:
        return compiled(query, key, value, block_mask=mask, scale=scale)
    except (NotImplementedError, RuntimeError) as error:  # unsupported here, or torch.compile's backend failed
        raise RuntimeError(f"FlexAttention (compiled with torch.compile) cannot run {_describe(query)}: "
                           f"{type(error).__name__}: {str(error).strip().splitlines()[0]}") from error
