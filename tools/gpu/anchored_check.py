"""aft's anchored forward on the registry's inputs (kernels/aft.py, "Anchored forward"), on the GPU:

- how many rows it marks for the running forward at the bench shape (B=8, T=4096, H=16, D=128) and at B=1,
  T=16384, H=2, in bf16 and fp16 ("single"), causal and not (the running forward's pass over the listed tiles is
  left out, so that marked rows stay NaN and are counted);
- its excess against the float64 oracle beside the running forward's (anchored=False), at B=1, T=4096, H=4.

    python3 tools/gpu/anchored_check.py
"""

from __future__ import annotations

import torch

import attnlab
from attnlab.kernels import aft
from attnlab.metrics import measure

DTYPES = (torch.bfloat16, torch.float16)


class _WithoutListedPass:
    """Stands in for aft._aft_listed_kernel: its launch over the anchored forward's listed tiles does nothing (the
    redo pass, REDO_OWN, still runs)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs) if kwargs["REDO_OWN"] else None


def inputs(dtype, B, T, H, seed):
    sample = attnlab.formulation("aft").sample(B=B, T=T, H=H, K=128, V=128, seed=seed)
    return {n: t.to(device="cuda", dtype=dtype) for n, t in sample.items()}


def marked_rows() -> None:
    listed = aft._aft_listed_kernel
    aft._aft_listed_kernel = _WithoutListedPass(listed)
    try:
        for dtype in DTYPES:
            for causal in (True, False):
                for B, T, H, seed in ((8, 4096, 16, 0), (1, 16384, 2, 3)):
                    o, _ = aft.chunkwise(**inputs(dtype, B, T, H, seed), causal=causal, precision="single")
                    rows = int(torch.isnan(o.float()).any(-1).any(-1).any(0).sum())
                    print(f"{dtype} causal={causal} B={B} T={T} H={H}: {rows} marked rows", flush=True)
    finally:
        aft._aft_listed_kernel = listed


def excess() -> None:
    for dtype in DTYPES:
        for causal in (True, False):
            x = inputs(dtype, 1, 4096, 4, 1)
            ref = attnlab.oracle("aft", "chunkwise", "float64")(**x, causal=causal)
            for anchored in (True, False):
                o = attnlab.kernel("aft", "chunkwise", anchored=anchored, precision="single")(**x, causal=causal)
                print(f"{dtype} causal={causal} {'anchored' if anchored else 'running'}: excess "
                      f"{measure(o, ref, dtype).excess:.4f}", flush=True)


if __name__ == "__main__":
    marked_rows()
    excess()
