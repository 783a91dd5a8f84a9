"""The delta rules' chunkwise backward over a grid of small shapes, each gradient against float64, at each product
precision: where the bf16 backward's figures depend on the head dims (narrow tiles) rather than on the inputs.

    python3 tools/gpu/backward_grid.py deltanet,kda [--dims 1,2,4,8,16,32,64] [--lengths 1,65]
        [--precisions chosen,tf32x3] [--dtype bfloat16] [--device cuda] [--forward]

For each formulation, K = V = each dim, T = each length (B = 1, H = 1, seed 0, the registry's inputs, a drawn
initial state and final-state cotangent) and each PRECISION of the backward's products ("chosen": as
kernels/_delta_chunk_backward.products_precision chooses): the worst gradient's figure and verdict of
backward_matches_oracle (and with --forward the output's of matches_oracle). Run from tools/gpu or with it on the
path (it takes replay_failures.products). A developer's instrument
(tools/gpu/README.md); one line per case, printed as it is measured (a CUDA fault ends the process).
"""

from __future__ import annotations

import argparse
import sys

import torch

from attnlab.properties import checks
from attnlab.properties.strategies import Case
from attnlab.properties.targets import own_kernel_target
from replay_failures import products


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names")
    parser.add_argument("--dims", type=_ints, default=_ints("1,2,4,8,16,32,64"))
    parser.add_argument("--lengths", type=_ints, default=_ints("1,65"))
    parser.add_argument("--precisions", default="chosen,tf32x3")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--forward", action="store_true")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    for name in args.names.split(","):
        target = own_kernel_target(name, "chunkwise")
        for T in args.lengths:
            for dim in args.dims:
                case = Case(name=name, seed=0, B=1, T=T, H=1, K=dim, V=dim)
                if args.forward:
                    result = checks.check_matches_oracle(target, case, dtype, args.device)
                    print(f"{name} T={T} K=V={dim} forward: {result.verdict} {result.figure:.3g}", flush=True)
                for precision in args.precisions.split(","):
                    with products(precision):
                        results = [checks.check_backward_matches_oracle(target, case, dtype, args.device, g)
                                   for g in checks.gradient_names(target)]
                    worst = max(results, key=lambda r: r.figure)
                    figures = " ".join(f"{r.property.split('[')[1][:-1]} {r.figure:.3g}" for r in results)
                    print(f"{name} T={T} K=V={dim} {precision}: worst {worst.verdict} ({figures})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
