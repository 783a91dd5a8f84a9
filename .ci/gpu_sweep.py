"""Time kernel option variants at the reference shape on the GPU (bf16): which launch settings to make default.

    python .ci/gpu_sweep.py     prints one line per (formulation, options): median ms and excess against the oracle
"""

from __future__ import annotations

import torch
import triton.testing

import attnlab
from attnlab.evaluate import measure_against_oracle

VARIANTS = {
    "softmax": [{}, {"chunk_size": 64}, {"chunk_size": 64, "num_stages": 2}, {"num_stages": 2}],
    "deltanet": [{"block_v": bv, "precision": p} for p in ("split", "input") for bv in (16, 32, 64)],
    "gated_deltanet": [{"block_v": bv, "precision": p} for p in ("split", "input") for bv in (16, 32, 64)],
    "gla": [{}, {"precision": "input"}, {"precision": "tf32"}],
    "retnet": [{}, {"chunk_size": 128}, {"precision": "round"}, {"precision": "round", "chunk_size": 128}],
    "linear_attn": [{"feature_map": "identity", "normalize": False}, {"feature_map": "identity", "normalize": False, "chunk_size": 128}],
}


def main() -> None:
    for name, variants in VARIANTS.items():
        f = attnlab.formulation(name)
        x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128).items()}
        small = {n: (t[:1, :1024] if t.dim() >= 3 else t) for n, t in x.items()}
        for opts in variants:
            try:
                call_options = {k: opts[k] for k in ("feature_map", "normalize") if k in opts}
                kernel = attnlab.kernel(name, "chunkwise", **{k: v for k, v in opts.items() if k not in call_options})
                ms = triton.testing.do_bench(lambda: kernel(**x, **call_options), warmup=25, rep=100, return_mode="median")
                m, _ = measure_against_oracle(name, kernel, {**small, **call_options}, out_dtype=torch.bfloat16, conditioning=False)
                print(f"{name:15s} {str(opts):45s} {ms:7.3f} ms  excess(T=1024) {m.excess:.3f}", flush=True)
            except Exception as error:
                print(f"{name:15s} {str(opts):45s} ERROR {type(error).__name__}: {str(error)[:200]}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
