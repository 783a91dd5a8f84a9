"""Time a kernel's option settings against its peer at the bench shape, to choose defaults.

    python3 .ci/gpu_configs.py NAME '{"chunk_size": 128}' '{"num_warps": 8}' ...

Each argument is a JSON dict of attnlab.kernel options (the first row is always the defaults); each setting is
timed with triton.testing.do_bench (median) after a warm-up call, beside the peer of attnlab.bench in the same run,
and its bf16 excess against the float64 oracle at T=1024 is printed too, so a faster setting that loses accuracy shows.
"""

from __future__ import annotations

import json
import sys

import torch
import triton.testing

import attnlab
from attnlab.bench import PEERS
from attnlab.metrics import measure


def main() -> None:
    name, settings = sys.argv[1], [{}] + [json.loads(a) for a in sys.argv[2:]]
    f = attnlab.formulation(name)
    x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
    small = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=1, T=1024, H=4, K=128, V=128, seed=1).items()}
    peer = PEERS.get(name)
    extra = peer.our_options or {} if peer else {}
    ref = attnlab.oracle(name, "chunkwise", "float64")(**small, **extra)
    peer_ms = triton.testing.do_bench(peer.make(x), warmup=25, rep=100, return_mode="median") if peer else float("nan")
    print(f"{name}: peer {peer.label if peer else None} {peer_ms:.3f} ms")
    for opts in settings:
        try:
            kernel = attnlab.kernel(name, "chunkwise", **opts)
            kernel(**x, **extra)
            ms = triton.testing.do_bench(lambda: kernel(**x, **extra), warmup=25, rep=100, return_mode="median")  # noqa: B023
            excess = measure(kernel(**small, **extra), ref, torch.bfloat16).excess
            print(f"  {json.dumps(opts) or '{}':60s} {ms:8.3f} ms  ratio {ms / peer_ms:5.2f}  excess(T=1024) {excess:6.3f}", flush=True)
        except Exception as error:  # record and go on
            print(f"  {json.dumps(opts):60s} {type(error).__name__}: {str(error)[:150]}", flush=True)


if __name__ == "__main__":
    main()
