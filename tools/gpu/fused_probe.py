"""Bisect the fused linear_attn/retnet chunkwise kernels' wrong GPU results at odd shapes.

    python3 tools/gpu/fused_probe.py

Bypasses kernels._util.gpu_shape_known_bad (which routes these shapes to the recurrent kernels) and prints,
per (formulation, K, V, T, options), the excess over the rounding floor of the bf16 chunkwise kernel against the
float64 oracle: the shapes and the options (software pipelining off, other precisions) that make it go wrong.
"""

from __future__ import annotations

import torch

import attnlab
import attnlab.kernels.linear_attn as linear_attn
import attnlab.kernels.retnet as retnet
from attnlab.metrics import measure

linear_attn.gpu_shape_known_bad = retnet.gpu_shape_known_bad = lambda K, V: False

SHAPES = [(44, 12, 64), (44, 12, 2627), (48, 16, 2627), (44, 16, 2627), (48, 12, 2627), (64, 64, 2627), (44, 12, 128),
          (1, 1, 64), (256, 256, 64), (256, 256, 1000)]
VARIANTS = [{}, {"num_stages": 1}, {"precision": "ieee"}, {"num_warps": 8}]

for name in ("linear_attn", "retnet"):
    for K, V, T in SHAPES:
        x = {n: t.cuda().to(torch.bfloat16) for n, t in attnlab.formulation(name).sample(B=1, T=T, H=2, K=K, V=V, seed=0).items()}
        ref = attnlab.oracle(name, "chunkwise", "float64")(**x)
        cells = []
        for opts in VARIANTS:
            try:
                o = attnlab.kernel(name, "chunkwise", **opts)(**x)
                cells.append(f"{measure(o, ref, torch.bfloat16).excess:9.3g}")
            except Exception as error:  # record and go on
                cells.append(f"{type(error).__name__:>9s}")
        print(f"{name:12s} K={K:3d} V={V:3d} T={T:5d}  " + "  ".join(f"{str(v) or 'default'}:{c}" for v, c in zip(VARIANTS, cells)), flush=True)
