"""Each kernel over awkward shapes on the GPU, one process per kernel so a crash stays contained.

    python tools/gpu/shapes.py NAME FORM     one kernel: a line per case, printed as it completes
    python tools/gpu/shapes.py [a,b,...]     every kernel (of those formulations), six processes at a time
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SHAPES = [(1, 1, 70), (12, 44, 300), (44, 12, 2627), (100, 72, 1000), (128, 128, 300), (256, 256, 200), (64, 64, 1)]


def one(name: str, form: str) -> None:
    import torch

    import attnlab
    from attnlab.evaluate import measure_against_oracle, rounded_inputs
    from attnlab.kernel import auto_chunk_sizes, speed_options

    speed = speed_options(name, form)
    settings = {"default": {}, **({"speed": speed} if speed else {})}
    # "auto" picks by shape (kda: by B*H), and these shapes' small B*H meet only one size: walk each.
    settings.update({f"C={size}": {"chunk_size": size} for size in auto_chunk_sizes(name, form)})
    for setting, opts in settings.items():
        for dtype in (torch.bfloat16, torch.float16):
            for K, V, T in SHAPES:
                x = rounded_inputs(name, dtype, "cuda", B=2, T=T, H=3, K=K, V=V, seed=K + V + T)
                label = f"{name:15s} {form:9s} {setting:7s} {str(dtype)[6:]:9s} K={K:3d} V={V:3d} T={T:5d}"
                try:
                    m, _ = measure_against_oracle(name, attnlab.kernel(name, form, **opts), x, out_dtype=dtype)
                    torch.cuda.synchronize()
                    verdict = "ok" if m.excess <= (1.5 if dtype == torch.bfloat16 else 2.0) and m.nonfinite == 0 else "BAD"
                    print(f"{label} excess={m.excess:9.3f} nonfinite={m.nonfinite} {verdict}", flush=True)
                except Exception as error:
                    print(f"{label} ERROR {type(error).__name__}: {str(error)[:300]}", flush=True)
                    if "illegal memory access" in str(error):
                        return


def everything(names: list[str]) -> None:
    import attnlab

    jobs = [(f.name, form) for f in attnlab.REGISTRY for form in f.kernel_forms if not names or f.name in names]

    def run(job):
        result = subprocess.run([sys.executable, __file__, *job], capture_output=True, text=True, timeout=540)
        return result.stdout + (result.stderr[-400:] if result.returncode else "")

    with ThreadPoolExecutor(6) as pool:
        for text in pool.map(run, jobs):
            print(text, end="", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[2] in ("chunkwise", "recurrent"):
        one(*sys.argv[1:])
    else:
        everything(sys.argv[1].split(",") if len(sys.argv) > 1 else [])
