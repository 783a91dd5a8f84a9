"""Per-launch GPU time of each kernel and its peer at the bench shape (B=8, T=4096, H=16, K=V=128, bf16).

    python3 tools/gpu/profile_launches.py [NAME,NAME...] [--options "OPT=V,...;..."] [--form recurrent]
                                          [--backward] [--no-peer] [--constants "MODULE.NAME=JSON;..."]

For each formulation: attnlab's default setting, its SPEED_OPTIONS setting, each ';'-separated set of kernel
options given (e.g. "chunk_size=8,block_c=128;num_warps=8"), and the peer, each run under torch.profiler for a
few calls after a warm-up, on the bench's inputs (the peer's ``our_options`` included); prints, per
implementation, every GPU kernel it launched with its mean time per call, so that one sees which pass of a
multi-launch kernel costs what. With --backward: attnlab's kernel forward and backward together
(``attnlab.commands.bench.forward_backward``, the bench's training step), at its defaults and at each option set,
and the peer's (how gla's backward chunk was chosen). --constants sets module constants of attnlab.kernels first,
for the whole run: tiles that are no option, such as the backward's (e.g.
"_delta_chunk_backward.SUMS_KEY_BLOCK=64;_delta_chunk_backward.SUMS_BV=32").
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import attnlab
from attnlab.commands.bench import forward_backward, peer_inputs, peer_step
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
    """"a=1,b=x;c=2" -> [{"a": 1, "b": "x"}, {"c": 2}]."""
    return [{key: (int(value) if value.lstrip("-").isdigit() else value)
             for key, value in (item.split("=") for item in group.split(","))}
            for group in filter(None, text.split(";"))]


def _set_constants(text: str) -> None:
    """"_delta_chunk_backward.SUMS_BV=32;..." -> attnlab.kernels._delta_chunk_backward.SUMS_BV = 32, ..."""
    for item in filter(None, text.split(";")):
        target, value = item.split("=", 1)
        module_name, name = target.rsplit(".", 1)
        module = importlib.import_module(f"attnlab.kernels.{module_name}")
        if not hasattr(module, name):
            raise SystemExit(f"attnlab.kernels.{module_name} has no constant {name}")
        setattr(module, name, json.loads(value))


def _print_times(label: str, times: list[tuple[str, float]]) -> None:
    print(f"{label}: total {sum(t for _, t in times):.3f} ms", flush=True)
    for kname, ms in times:
        print(f"    {ms:8.3f} ms  {kname}", flush=True)


def profile_formulation(name: str, form: str, option_sets: list[dict[str, object]], backward: bool,
                        with_peer: bool) -> None:
    f = attnlab.formulation(name)
    x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
    inputs = peer_inputs(name, x)
    if backward:
        inputs = {n: t.requires_grad_() if isinstance(t, torch.Tensor) and f.arg(n).differentiable else t
                  for n, t in inputs.items()}
    speed = speed_options(name, form)
    settings = [("defaults", {}), *([("speed", speed)] if speed and not backward else []),
                *((str(options), options) for options in option_sets)]
    for label, options in settings:
        try:
            ours = attnlab.kernel(name, form, **options)
            if backward:  # the bench's training step: the leaves' gradients reset, none accumulated
                leaves = [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]
                times = kernel_times(forward_backward(lambda: ours(**inputs), leaves))  # noqa: B023
            else:
                times = kernel_times(lambda: ours(**inputs))  # noqa: B023
        except Exception as error:  # record and go on
            print(f"{name} {form} {label}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        _print_times(f"{name} {form} {'forward + backward' if backward else 'forward'} {label} ({ours!r})", times)
    peer = f.bench_peer
    if peer and with_peer:
        try:
            _print_times(f"{name} peer {peer.label}{' forward + backward' if backward else ''}",
                         kernel_times(peer_step(name, x, backward)))
        except Exception as error:
            print(f"{name} peer: {type(error).__name__}: {str(error)[:200]}", flush=True)
    del x, inputs
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="?", default=",".join(attnlab.names()))
    parser.add_argument("--options", default="", help="';'-separated kernel option sets, each OPT=V,...")
    parser.add_argument("--form", default="chunkwise", choices=("chunkwise", "recurrent"))
    parser.add_argument("--backward", action="store_true", help="forward + backward")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--constants", default="", help="';'-separated MODULE.NAME=JSON of attnlab.kernels, set first")
    args = parser.parse_args()
    _set_constants(args.constants)
    for name in args.names.split(","):
        profile_formulation(name, args.form, _option_sets(args.options), args.backward, not args.no_peer)


if __name__ == "__main__":
    main()
