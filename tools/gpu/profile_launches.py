"""Per-launch GPU time of each kernel and its peer at the bench shape (B=8, T=4096, H=16, K=V=128, bf16).

    python3 tools/gpu/profile_launches.py [NAME,NAME...] [--options "OPT=V,...;..."] [--form recurrent]
                                          [--backward] [--no-peer] [--constants "MODULE.NAME=JSON;..."]
                                          [--against FILE]...

For each formulation: attnlab's default setting, its SPEED_OPTIONS setting, each ';'-separated set of kernel
options given (e.g. "chunk_size=8,block_c=128;num_warps=8"), and the peer, each run under torch.profiler for a
few calls after a warm-up, on the bench's inputs (the peer's ``our_options`` included); prints, per
implementation, every GPU kernel it launched with its mean time per call, so that one sees which pass of a
multi-launch kernel costs what. With --backward: attnlab's kernel forward and backward together
(``attnlab.commands.bench.forward_backward``, the bench's training step), at its defaults and at each option set,
and the peer's (how gla's backward chunk was chosen). --constants sets module constants of attnlab.kernels first,
for the whole run: tiles that are no option, such as the backward's (e.g.
"_delta_chunk_backward.SUMS_KEY_BLOCK=64;_delta_chunk_backward.SUMS_BV=32").

--against FILE: another version of one kernel module (e.g. alt/_delta_chunk_backward.py, as another commit has it),
for a comparison within one call: after this run, the same run again in a fresh process with FILE over the
module of its name in attnlab.kernels (put back afterwards), then each launch's time in the two runs side by side,
and each setting's total. Given again, each FILE has its run and its comparison with this tree's, in turn (two
commits' versions and this tree's timed on one machine); every FILE is checked before the first run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

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


Times = dict[str, list[tuple[str, float]]]  # per setting's label, each launch's mean time (ms)


def profile_formulation(name: str, form: str, option_sets: list[dict[str, object]], backward: bool,
                        with_peer: bool) -> Times:
    f = attnlab.formulation(name)
    x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
    inputs = peer_inputs(name, x)
    if backward:
        inputs = {n: t.requires_grad_() if isinstance(t, torch.Tensor) and f.arg(n).differentiable else t
                  for n, t in inputs.items()}
    speed = speed_options(name, form)
    results: Times = {}
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
        results[f"{name} {form} {label}"] = times
    peer = f.bench_peer
    if peer and with_peer:
        try:
            times = kernel_times(peer_step(name, x, backward))
            _print_times(f"{name} peer {peer.label}{' forward + backward' if backward else ''}", times)
            results[f"{name} peer {peer.label}"] = times
        except Exception as error:
            print(f"{name} peer: {type(error).__name__}: {str(error)[:200]}", flush=True)
    del x, inputs
    torch.cuda.empty_cache()
    return results


def replaced_module(alternative: Path) -> Path:
    """The module of attnlab.kernels that ``alternative`` stands in for (of its name); checked before any run."""
    module = Path(importlib.import_module("attnlab.kernels").__file__).parent / alternative.name
    if not alternative.is_file():
        raise SystemExit(f"--against {alternative}: no such file")
    if not module.is_file():
        raise SystemExit(f"--against {alternative}: attnlab.kernels has no module {alternative.name}")
    return module


def profile_against(alternative: Path, argv: list[str]) -> Times:
    """The run of ``argv`` (this script's arguments, --against left out) in a fresh process, with ``alternative``
    over the module of its name in attnlab.kernels, which is put back afterwards; its times."""
    module = replaced_module(alternative)
    with tempfile.TemporaryDirectory() as scratch:
        kept, results = Path(scratch) / alternative.name, Path(scratch) / "times.json"
        # copyfile, not copy2: a new mtime each time, so that no bytecode cached for the other version is taken.
        shutil.copyfile(module, kept)
        try:
            shutil.copyfile(alternative, module)
            print(f"\n--- again, with {alternative} over {module} ---", flush=True)
            subprocess.run([sys.executable, __file__, *argv, "--json", str(results)], check=True)
        finally:
            shutil.copyfile(kept, module)
        return {label: [tuple(launch) for launch in times] for label, times in json.loads(results.read_text()).items()}


def _without_against(argv: list[str]) -> list[str]:
    """The arguments less every --against and its file ("--against FILE" or "--against=FILE")."""
    kept, skip = [], False
    for argument in argv:
        if skip or argument.startswith("--against="):
            skip = False
        elif argument == "--against":
            skip = True
        else:
            kept.append(argument)
    return kept


def print_comparison(ours: Times, other: Times, other_name: str) -> None:
    """Each setting's launches in both runs (ms) and their ratio, the slowest first, then the setting's total."""
    print(f"\n--- each launch (ms): this tree, with {other_name}, and their ratio ---", flush=True)
    for label in (label for label in ours if label in other):
        here, there = dict(ours[label]), dict(other[label])
        print(label, flush=True)
        for kname in sorted(here.keys() | there.keys(), key=lambda k: -max(here.get(k, 0.0), there.get(k, 0.0))):
            a, b = here.get(kname, 0.0), there.get(kname, 0.0)
            print(f"    {a:8.3f} {b:8.3f} {a / b if b else float('nan'):6.3f}  {kname}", flush=True)
        a, b = sum(here.values()), sum(there.values())
        print(f"    {a:8.3f} {b:8.3f} {a / b:6.3f}  total", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="?", default=",".join(attnlab.names()))
    parser.add_argument("--options", default="", help="';'-separated kernel option sets, each OPT=V,...")
    parser.add_argument("--form", default="chunkwise", choices=("chunkwise", "recurrent"))
    parser.add_argument("--backward", action="store_true", help="forward + backward")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--constants", default="", help="';'-separated MODULE.NAME=JSON of attnlab.kernels, set first")
    parser.add_argument("--against", type=Path, action="append", default=[],
                        help="another version of a module of attnlab.kernels, run after (repeatable)")
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)  # where --against's second run leaves its times
    args = parser.parse_args()
    for alternative in args.against:
        replaced_module(alternative)
    _set_constants(args.constants)
    results: Times = {}
    for name in args.names.split(","):
        results |= profile_formulation(name, args.form, _option_sets(args.options), args.backward, not args.no_peer)
    if args.json:
        args.json.write_text(json.dumps(results))
    for alternative in args.against:
        other = profile_against(alternative, _without_against(sys.argv[1:]))
        print_comparison(results, other, str(alternative))


if __name__ == "__main__":
    main()
