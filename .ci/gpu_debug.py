"""Localize the linear_attn/retnet chunkwise failure at (K=44, V=12, T=2627) seen on the GPU."""

import torch

import attnlab
from attnlab.evaluate import rounded_inputs
from attnlab.metrics import rel_err


def run(name, opts, B=1, H=1, K=44, V=12, T=2627, dtype=torch.bfloat16, call=None):
    x = rounded_inputs(name, dtype, "cuda", B=B, T=T, H=H, K=K, V=V, seed=K + V + T)
    x.update(call or {})
    ref = attnlab.oracle(name, "chunkwise")(**x)
    try:
        o = attnlab.kernel(name, "chunkwise", **opts)(**x).double()
        torch.cuda.synchronize()
    except Exception as error:
        print(f"{name} {opts} B={B} H={H} K={K} V={V} T={T}: ERROR {str(error)[:120]}", flush=True)
        return
    err = (o - ref).abs().amax(dim=(0, 2, 3)) / ref.abs().amax()
    bad = (err > 0.05).nonzero().flatten()
    where = f"first bad row {bad[0].item()} (chunk {bad[0].item() // 64}), {len(bad)} bad rows" if len(bad) else "no bad rows"
    nan_rows = (~torch.isfinite(o)).any(dim=(0, 2, 3)).nonzero().flatten()
    print(f"{name} {opts} B={B} H={H} K={K} V={V} T={T}: rel_err {rel_err(o, ref):.2e}; {where}; "
          f"nan rows {nan_rows[:5].tolist()}{'...' if len(nan_rows) > 5 else ''}", flush=True)


for T in (2627, 2624, 2628, 2563, 1027, 195, 67):
    run("retnet", {}, T=T)
for K, V in ((40, 12), (48, 12), (64, 12), (44, 8), (44, 16), (44, 32), (48, 16)):
    run("retnet", {}, K=K, V=V)
for opts in ({"precision": "ieee"}, {"precision": "tf32"}, {"precision": "round"}, {"num_stages": 1}, {"chunk_size": 32}, {"block_v": 64}):
    run("retnet", opts)
run("retnet", {}, dtype=torch.float16)
run("linear_attn", {}, call={"feature_map": "identity", "normalize": False})
run("linear_attn", {})
