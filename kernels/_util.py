"""Small helpers shared by the kernel modules."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


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
    starts. Triton's launch path (binding and specialising the arguments, the cache lookup) took 59 us
    (retnet) and 87 us (the delta rules' prepare kernel) of host time on the H100 machine, a bound launch
    17 us (.ci/gpu_overhead.py; reports/bench.md, session 9), so on the GPU binding compiles the
    kernel, or finds it in the cache (``JITFunction.warmup``), and lays out its arguments ahead of the
    wait; calling it is then the driver's launch alone (the compiled kernel's own launcher, as in
    Triton's fused-softmax tutorial). Under the interpreter calling it is the plain launch.
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
