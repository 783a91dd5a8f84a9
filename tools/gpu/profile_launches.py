"""Per-launch GPU time of each kernel and its peer at the bench shape (B=8, T=4096, H=16, K=V=128, bf16).

    python3 tools/gpu/profile_launches.py [NAME,NAME...] [--backward [OPTION=VALUE,...;...]]

For each formulation: attnlab's default setting, its SPEED_OPTIONS setting and the peer, each run under
torch.profiler for a few calls after a warm-up; prints, per implementation, every GPU kernel it launched
with its mean time per call, so that one sees which pass of a multi-launch kernel costs what.
With --backward: attnlab's kernel alone, forward and backward together (``o.backward(do)``, as the bench's
backward pass), at its defaults and at each ';'-separated set of kernel options given (e.g.
"num_warps=8;num_stages=3,num_warps=8"), so that launch options can be compared per kernel.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import attnlab
from attnlab.commands.bench import peer_call, peer_inputs
from attnlab.kernel import speed_options

CALLS = 5


def kernel_times(call) -> list[tuple[str, float]]:
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:90]] += event.device_time / 1e3 / CALLS
    return sorted(totals.items(), key=lambda item: -item[1])


def _option_sets(text: str) -> list[dict[str, object]]:
    sets = [{}]
    for group in filter(None, text.split(";")):
        sets.append({key: (value if not value.lstrip("-").isdigit() else int(value))
                     for key, value in (item.split("=") for item in group.split(","))})
    return sets


def profile_backward(names: list[str], option_sets: list[dict[str, object]]) -> None:
    for name in names:
        f = attnlab.formulation(name)
        x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
        x = {n: t.requires_grad_() if f.arg(n).differentiable else t for n, t in x.items()}
        for options in option_sets:
            try:
                ours = attnlab.kernel(name, "chunkwise", **options)
                do = torch.randn_like(ours(**x))
                times = kernel_times(lambda: ours(**x).backward(do))  # noqa: B023
            except Exception as error:  # record and go on
                print(f"{name} {options}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            print(f"{name} forward + backward {options or 'defaults'}: total {sum(t for _, t in times):.3f} ms", flush=True)
            for kname, ms in times:
                print(f"    {ms:8.3f} ms  {kname}", flush=True)
        del x
        torch.cuda.empty_cache()


def main() -> None:
    args = sys.argv[1:]
    if "--backward" in args:
        at = args.index("--backward")
        option_text = args[at + 1] if at + 1 < len(args) else ""
        names = args[0].split(",") if at > 0 else attnlab.names()
        profile_backward(names, _option_sets(option_text))
        return
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else attnlab.names()
    for name in names:
        f = attnlab.formulation(name)
        x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
        peer = attnlab.formulation(name).bench_peer
        inputs = peer_inputs(name, x)
        speed = speed_options(name, "chunkwise")
        runs = [("attnlab default", attnlab.kernel(name, "chunkwise")), ("attnlab speed", attnlab.kernel(name, "chunkwise", **speed) if speed else None)]
        for label, ours in runs:
            if ours is None:
                continue
            try:
                times = kernel_times(lambda: ours(**inputs))  # noqa: B023
            except Exception as error:  # record and go on
                print(f"{name} {label}: {type(error).__name__}: {str(error)[:200]}")
                continue
            print(f"{name} {label} ({ours!r}): total {sum(t for _, t in times):.3f} ms")
            for kname, ms in times:
                print(f"    {ms:8.3f} ms  {kname}")
        if peer:
            try:
                times = kernel_times(peer_call(name, x))
                print(f"{name} peer {peer.label}: total {sum(t for _, t in times):.3f} ms")
                for kname, ms in times:
                    print(f"    {ms:8.3f} ms  {kname}")
            except Exception as error:
                print(f"{name} peer: {type(error).__name__}: {str(error)[:200]}")
        del x, inputs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
