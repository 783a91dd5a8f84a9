"""Small helpers shared by the kernel modules."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from attnlab.runtime import interpreter_active


def no_pending_checks() -> None:
    """``await_checks`` of a kernel function called directly, not through attnlab.kernel: nothing to wait for.

    attnlab.kernel passes the wait of its queued value checks (attnlab.validation.ValueScan); every
    kernel function waits before its first launch. Those of formulations with checked inputs bind their
    launches first (``Launch``) and run them with ``launch_after_checks``; softmax, which has none to
    wait for, calls ``await_checks()`` itself.
    """


class Launch:
    """``kernel[grid](*args, **kwargs)``, bound now and run by calling it.

    The value checks' wait is a call's one sync, and the GPU idles from its end until the next kernel
    starts. Triton's launch path (binding and specialising the arguments, the cache lookup) costs
    several times a bound launch in host time (tools/gpu/overhead.py; reports/bench.md), so on the GPU
    binding compiles the kernel, or finds it in the cache (``JITFunction.warmup``), and lays out its
    arguments ahead of the wait; calling it is then the driver's launch alone (the compiled kernel's
    own launcher, as in Triton's fused-softmax tutorial). Under the interpreter calling it is the
    plain launch.
    """

    def __init__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
        if isinstance(kernel, JITFunction):
            compiled = kernel.warmup(*args, grid=grid, **kwargs)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled  # asynchronous compile mode
            runner = compiled[tuple(grid) + (1,) * (3 - len(grid))]
            values = launch_arguments(kernel, args, kwargs)
            self._run: Callable[[], None] = lambda: runner(*values)
        else:
            self._run = lambda: kernel[grid](*args, **kwargs)

    def __call__(self) -> None:
        self._run()


def launch_arguments(kernel: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What ``JITFunction.run`` hands the compiled kernel's launcher: every parameter's value in the kernel's
    order, constexprs included and defaults filled in, the launch options (num_warps, num_stages, ...) left out."""
    bound = kernel.signature.bind(*args, **{name: value for name, value in kwargs.items()
                                            if name in kernel.signature.parameters})
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def launch_after_checks(await_checks: Callable[[], None], *launches: Launch) -> None:
    """Wait for the call's value checks (raising on a bad value before anything runs), then launch, in order."""
    await_checks()
    for launch in launches:
        launch()


def _descriptor_scratch(size: int, alignment: int, stream: int | None, *, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device=device)


def allow_device_descriptors(device: torch.device) -> None:
    """Give the kernels that build tensor descriptors on the device (tl.make_tensor_descriptor: TMA on sm_90) the
    global scratch they need (triton.set_allocator; process-wide)."""
    triton.set_allocator(functools.partial(_descriptor_scratch, device=device))


def tma_fits(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned base addresses and row strides: each row of the tensors (their last dim,
    contiguous) starts on a 16-byte boundary."""
    return all(t.data_ptr() % 16 == 0 and t.shape[-1] * t.element_size() % 16 == 0 for t in tensors)


def block_size(n: int, minimum: int = 16) -> int:
    """The power-of-two tile covering ``n`` (at least ``minimum``, the tl.dot minimum on GPUs)."""
    return max(minimum, triton.next_power_of_2(n))


def default_block_v(V: int, BK: int, block_v: int | None) -> int:
    """The V tile: the caller's, else at most 64 (32 when K > 128, to bound the fp32 state's registers)."""
    if block_v is not None:
        return block_v
    return min(block_size(V), 64 if BK <= 128 else 32)


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def zero_state(shape: tuple[int, ...], device: torch.device, fill: float = 0.0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=torch.float32, device=device)


def gpu_shape_known_bad(K: int, V: int, max_K: int = 128) -> bool:
    """Shapes at which chunkwise kernels fail on the GPU: K or V not a multiple of 16, or K > max_K.

    The fused linear_attn and retnet kernels (max_K 128) and gla's and general's chunkwise kernels
    (kernels/_gated.py, max_K 256) give wrong outputs or illegal memory accesses at such shapes on
    the GPU (triton 3.6; the shapes measured: reports/bench.md). Until the causes are found, those
    modules route such shapes to their recurrent kernels, which are right everywhere; the
    interpreter (CPU) keeps testing the chunkwise kernels.
    """
    return not interpreter_active() and (K % 16 != 0 or V % 16 != 0 or K > max_K)


@triton.jit
def state_block(H, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """The program of a kernel over (V block, batch * head), grid (cdiv(V, BV), B * H), and its [BK, BV] block
    of a state S [B, H, K, V]: (pid_v, pid_bh, batch, head, key lanes, value lanes, their masks, the block's
    offsets in S and its mask)."""
    pid_v = tl.program_id(0)
    pid_bh = tl.program_id(1)
    keys = tl.arange(0, BK)
    values = pid_v * BV + tl.arange(0, BV)
    key_ok = keys < K
    value_ok = values < V
    S_offsets = pid_bh.to(tl.int64) * K * V + keys[:, None] * V + values[None, :]
    S_mask = key_ok[:, None] & value_ok[None, :]
    return pid_v, pid_bh, pid_bh // H, pid_bh % H, keys, values, key_ok, value_ok, S_offsets, S_mask
