"""Times softmax's backward kernels over launch shapes at the bench shape, beside SDPA's flash backend (GPU only).

    python3 tools/gpu/softmax_backward.py [--T 4096] [--head 128] [--out DIR]

For each precision ("input", "split") and each candidate shape of one kernel (the other kept at the registry's
choice), the time of kernels.softmax.chunkwise_backward alone on saved forward statistics; then the forward with
and without saving, and SDPA flash's forward and forward + backward. The table goes to stdout and, as JSON lines,
to DIR/softmax-backward.jsonl. Shapes are (rows per program, rows per step, num_warps, num_stages).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import triton.testing

import attnlab
from attnlab.commands.bench import forward_backward
from attnlab.third_party import sdpa_flash
from attnlab.kernels import softmax

CANDIDATES = [(128, 32, 4, 3), (128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3), (64, 64, 4, 3),
              (64, 32, 8, 2), (64, 16, 4, 3), (128, 16, 8, 3)]


def bench(call) -> float:
    try:
        call()
        return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
    except Exception as error:  # a shape that does not compile (shared memory, registers) is recorded as such
        print(f"  failed: {str(error).splitlines()[0][:160]}", flush=True)
        return math.nan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--head", type=int, default=128)
    parser.add_argument("--out", default="out")
    args = parser.parse_args()
    B, H, D = 8, 16, args.head
    x = attnlab.formulation("softmax").sample(B=B, T=args.T, H=H, K=D, V=D, seed=0)
    q, k, v = (x[n].to("cuda", torch.bfloat16) for n in ("q", "k", "v"))
    scale, causal = D**-0.5, True  # the bench's call: causal, 1/sqrt(head dim)
    do = torch.randn_like(v)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []

    def record(**row) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    default = softmax._backward_config(2, D)
    for precision in ("input", "split"):
        saved: dict[str, torch.Tensor] = {}
        o, _ = softmax.chunkwise(q=q, k=k, v=v, scale=scale, causal=causal, precision=precision, saved=saved)
        record(what="forward saving", precision=precision,
               ms=bench(lambda: softmax.chunkwise(q=q, k=k, v=v, scale=scale, causal=causal, precision=precision,
                                                 saved={})))
        for kernel in ("dkdv", "dq"):
            for shape in CANDIDATES:
                softmax._BACKWARD_CONFIGS[(2, D)] = {**default, kernel: shape}
                ms = bench(lambda: softmax.chunkwise_backward(o=o, saved=saved, do=do, d_state=None, q=q, k=k, v=v,
                                                              scale=scale, causal=causal, precision=precision))
                record(what="backward", precision=precision, kernel=kernel, shape=shape, ms=ms)
        softmax._BACKWARD_CONFIGS[(2, D)] = default
    record(what="forward", precision="fp16",
           ms=bench(lambda: softmax.chunkwise(q=q, k=k, v=v, scale=scale, causal=causal)))
    qh, kh, vh = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    record(what="sdpa flash forward", ms=bench(lambda: sdpa_flash(qh, kh, vh, is_causal=causal, scale=scale)))
    record(what="sdpa flash forward + backward",
           ms=bench(forward_backward(lambda: sdpa_flash(qh, kh, vh, is_causal=causal, scale=scale), [qh, kh, vh])))
    (out / "softmax-backward.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
