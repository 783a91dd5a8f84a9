"""Under the Triton interpreter, every load and store a kernel makes checked against the memory its launch was given.

On a GPU an address past a tensor's allocation is an illegal memory access, reported asynchronously and fatal to
the process's CUDA context (every later call in it fails); a small overrun that lands inside the caching
allocator's segment is not reported at all. The interpreter, which runs the kernel on the CPU through numpy, reads
and writes any host address it is given. :func:`checked_addresses` makes it refuse: while it is active, each
launch records the storages of its tensor arguments, and each load or store raises :class:`OutOfBounds` when an
address its mask lets through (with the element's size) is not inside one of them. It catches the overrun where
the GPU would read past the end silently, and names the kernel and the nearest argument. Pointer loads and stores
only: block pointers and tensor descriptors (TMA) take other paths of the interpreter, unchecked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np


class OutOfBounds(AssertionError):
    """A kernel loaded or stored outside every tensor its launch was given."""


@contextlib.contextmanager
def checked_addresses() -> Iterator[None]:
    """Check every masked-in address of every interpreted launch inside the block (module docstring)."""
    from triton.runtime import interpreter

    launch: dict[str, object] = {}  # the launch in progress: its kernel and sorted (start, end, argument) spans
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    original_args, original_load, original_store = (
        executor._init_args_hst, builder.create_masked_load, builder.create_masked_store)

    def record_args(self, args_dev, kwargs):
        args_hst, kwargs_hst = original_args(self, args_dev, kwargs)
        named = {**dict(zip(self.arg_names, args_hst)), **kwargs_hst}
        spans = sorted({(s.data_ptr(), s.data_ptr() + s.nbytes(), n)
                        for n, t in named.items() if hasattr(t, "untyped_storage") for s in (t.untyped_storage(),)})
        launch.update(kernel=getattr(self.fn, "__name__", "kernel"), spans=spans)
        return args_hst, kwargs_hst

    def check(ptrs, mask, what: str) -> None:
        kernel, spans = launch["kernel"], launch["spans"]
        wanted = np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)  # an int mask (bool & int) too
        addresses = ptrs.data[wanted].astype(np.uint64)
        if addresses.size == 0 or not spans:
            return
        starts = np.array([s for s, _, _ in spans], dtype=np.uint64)
        ends = np.array([e for _, e, _ in spans], dtype=np.uint64)
        size = np.uint64(ptrs.get_element_ty().primitive_bitwidth // 8)
        at = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
        inside = (at >= 0) & (addresses + size <= ends[np.maximum(at, 0)])
        if not inside.all():
            bad = int(addresses[~inside][0])
            start, end, name = min(spans, key=lambda span: min(abs(bad - span[0]), abs(bad - span[1])))
            where = (f"{start - bad} bytes before" if bad < start else f"{bad - end + int(size)} bytes past the end of")
            raise OutOfBounds(f"{kernel}: a {what} of {int((~inside).sum())} of {addresses.size} addresses outside "
                              f"every tensor of its launch, the first {where} `{name}` ({end - start} bytes)")

    def load(self, ptrs, mask, other, *rest):
        check(ptrs, mask, "load")
        return original_load(self, ptrs, mask, other, *rest)

    def store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return original_store(self, ptrs, value, mask, *rest)

    executor._init_args_hst, builder.create_masked_load, builder.create_masked_store = record_args, load, store
    try:
        yield
    finally:
        executor._init_args_hst, builder.create_masked_load, builder.create_masked_store = (
            original_args, original_load, original_store)
