"""Time a chunkwise kernel at each of its chunk sizes against its peer, over shapes from many programs to few.

    python3 tools/gpu/chunk_sizes.py [NAME]        (default kda; bf16, K = V = 128 unless a shape says otherwise)

For each shape (B, T, H, K = V): the whole call at every fixed chunk size the kernel offers and the peer's call,
with triton.testing.do_bench (median). Used in session 11 to choose kda's chunk_size "auto" (kernels/kda.py,
auto_chunk_size): small chunks win while the sequential state pass has programs enough to fill the SMs,
large ones once it runs on a few.
"""

from __future__ import annotations

import sys

import torch
import triton.testing

import attnlab
from attnlab.commands.bench import peer_call
from attnlab.kernel import kernel_options

SHAPES = [(8, 4096, 16, 128), (4, 4096, 16, 128), (8, 4096, 16, 64), (2, 4096, 16, 128), (2, 8192, 8, 128),
          (1, 8192, 16, 128), (1, 16384, 4, 128)]


def main(name: str = "kda") -> None:
    f = attnlab.formulation(name)
    sizes = [c for c in kernel_options(name, "chunkwise")["chunk_size"][1] if c != "auto"]
    for B, T, H, K in SHAPES:
        x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=B, T=T, H=H, K=K, V=K, seed=0).items()}
        times = []
        for size in sizes:
            kernel = attnlab.kernel(name, "chunkwise", chunk_size=size)
            times.append(triton.testing.do_bench(lambda: kernel(**x), rep=100))
        peer = triton.testing.do_bench(peer_call(name, x), rep=100)
        mine = " ".join(f"C{size} {ms:.3f}" for size, ms in zip(sizes, times))
        print(f"B={B} T={T} H={H} K=V={K}: {mine} {attnlab.formulation(name).bench_peer.label} {peer:.3f}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
