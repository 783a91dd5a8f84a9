"""Every gradient's excess against T for attnlab's kernel forms alone, bf16 on the GPU (issues 24 and 25: "flat in T").

    python3 tools/gpu/gradient_flatness.py NAME[,NAME...] [--lengths 64,1024,4096,16384] [--forms chunkwise]
                                          [--heads 4]

Each point is `attnlab report --passes backward`'s own measurement (attnlab.commands.report.measure_backward_point:
the registry's inputs at B=1, K=V=64, float64 autograd through the chunkwise oracle on the GPU, one head at a
time), without the naive fp32 and bf16 recurrences the report also differentiates: at T = 16384 their autograd
through a Python loop of T steps takes minutes, the kernels' seconds. Prints one line per (formulation, form, T):
each gradient's excess and non-finite count, and the point's seconds.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

import attnlab
from attnlab.commands.report import Implementation, Sizes, measure_backward_point


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names")
    parser.add_argument("--lengths", default="64,1024,4096,16384")
    parser.add_argument("--forms", default=None, help="comma-separated kernel forms (default: every form)")
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()
    sizes = Sizes(B=1, H=args.heads, K=64, V=64)
    for name in args.names.split(","):
        f = attnlab.formulation(name)
        impls = [Implementation(f"attnlab:{form}", partial(attnlab.kernel, name, form)) for form in f.kernel_forms
                 if args.forms is None or form in args.forms.split(",")]
        for T in (int(t) for t in args.lengths.split(",")):
            start = time.time()
            rows = measure_backward_point(f, "bfloat16", T, sizes, impls, {}, seed=0, device="cuda")
            for impl in impls:
                mine = [r for r in rows if r["impl"] == impl.name]
                errors = "; ".join(r["error"] for r in mine if r.get("error"))
                excess = ", ".join(f"{r['gradient']} {r['excess']:.2f}" + (f" ({r['nonfinite']} non-finite)"
                                                                           if r.get("nonfinite") else "")
                                   for r in mine if r.get("gradient") and r.get("excess") is not None)
                print(f"{name} {impl.name} T={T}: {excess or errors} [{time.time() - start:.0f} s]", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
