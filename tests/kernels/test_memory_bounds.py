"""The interpreter's address checks (memory_bounds.checked_addresses) refuse a load past its tensor; every kernel is
run under them in tests/test_kernel_gradients.py."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from memory_bounds import checked_addresses

INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the address checks need the interpreter")


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


@triton.jit
def _copy_in_the_first_program(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    first = (offsets < n) & (tl.program_id(0) == 0)  # an integer mask under the interpreter, not a boolean one
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=first), mask=first)


@INTERPRETER_ONLY
def test_an_integer_mask_is_a_mask_not_indices():
    x, y = torch.randn(1), torch.empty(1)
    with checked_addresses():  # taken as indices, its 0s and 1s would pick lanes 0 and 1: one past the tensor
        _copy_in_the_first_program[(2,)](x, y, 1, BLOCK=16)
    assert torch.equal(x, y)


@INTERPRETER_ONLY
def test_a_load_past_its_tensor_is_refused():
    x, y = torch.randn(8), torch.empty(8)
    with checked_addresses():
        _copy[(1,)](x, y, 8, BLOCK=16)
        refused = ("OutOfBounds.*_copy: a load of 1 of 9 addresses outside every tensor of its launch, "
                   "the first 4 bytes past the end of .x_ptr. .32 bytes.")
        with pytest.raises(Exception, match=refused):
            _copy[(1,)](x, y, 9, BLOCK=16)
    assert torch.equal(x, y)
