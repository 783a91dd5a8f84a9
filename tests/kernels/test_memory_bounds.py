"""Every load and store of the delta rules' kernels, forward and backward, lands inside the tensors of its launch
(memory_bounds.checked_addresses, under the interpreter), at head dims and lengths that leave most of each tile
masked: a mask that lets one lane past its tensor reads another allocation silently on a GPU, or faults."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import attnlab
from memory_bounds import OutOfBounds, checked_addresses  # noqa: F401 - OutOfBounds is what the first test meets

INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the address checks need the interpreter")


@triton.jit
def _copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


@INTERPRETER_ONLY
def test_a_load_past_its_tensor_is_refused():
    x, y = torch.randn(8), torch.empty(8)
    with checked_addresses():
        _copy[(1,)](x, y, 8, BLOCK=16)
        with pytest.raises(Exception, match="OutOfBounds.*_copy: a load of 1 of 9 addresses outside every tensor"):
            _copy[(1,)](x, y, 9, BLOCK=16)
    assert torch.equal(x, y)


@INTERPRETER_ONLY
@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "kda"])
@pytest.mark.parametrize("T,K,V", [(1, 1, 1), (65, 17, 3)], ids=["T1-K1-V1", "T65-K17-V3"])
def test_delta_rule_kernels_stay_inside_their_tensors(name, T, K, V):
    f = attnlab.formulation(name)
    x = {n: t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
         for n, t in f.sample(B=2, T=T, H=1, K=K, V=V, seed=0).items()}
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()
              if isinstance(t, torch.Tensor) and f.arg(n).differentiable}
    state = torch.randn(2, 1, K, V, requires_grad=True)
    with checked_addresses():
        o, final = attnlab.kernel(name, "chunkwise")(**{**x, **leaves}, initial_state=state, return_state=True)
        (o.float().sum() + final.sum()).backward()
    assert all(t.grad is not None for t in (*leaves.values(), state))
