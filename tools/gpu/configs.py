"""Time a kernel's option settings against its peer at the bench shape, per launch, to choose defaults.

    python3 tools/gpu/configs.py NAME '{"chunk_size": 32}' '{"num_warps": 8}' ...

Each argument is a JSON dict of attnlab.kernel options (the first row is always the defaults); a "constants" entry
({"constants": {"A_ROWS_CHANNEL_SLICE": 32}}, or "_delta.PREPARE_CHANNEL_SLICE" for another module of attnlab.kernels)
sets module constants of the formulation's kernel module around each call of that setting instead (block sizes
that are not options). Every setting
is compiled and its bf16 excess against the float64 oracle at T=1024 measured first, so that a faster setting
that loses accuracy shows; then, holding an exclusive lock (/tmp/attnlab-gpu-timing.lock), each setting and the
peer are timed: the whole call with triton.testing.do_bench (median) and each launch's GPU time under
torch.profiler (tools/gpu/profile_launches.py). Several formulations can run as parallel processes (PROCESSES=N in the
environment of each): they compile at once, wait for each other, then take turns at the GPU for the timing.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import time
from pathlib import Path

import importlib
from contextlib import contextmanager

import torch
import triton.testing
from profile_launches import kernel_times

import attnlab
from attnlab.commands.bench import peer_call
from attnlab.metrics import measure

LOCK = "/tmp/attnlab-gpu-timing.lock"
READY = Path("/tmp/attnlab-ready")


def mark_ready(name: str) -> None:
    READY.mkdir(exist_ok=True)
    (READY / name).touch()


def wait_for_the_others(name: str) -> None:
    """With PROCESSES=N in the environment, wait (up to 6 minutes) until N processes have compiled, so that no
    compilation's GPU calls overlap a timing."""
    expected = int(os.environ.get("PROCESSES", "1"))
    mark_ready(name)
    deadline = time.time() + 360
    while len(list(READY.iterdir())) < expected and time.time() < deadline:
        time.sleep(1)


def _owner(module, name: str):
    """(module, attribute) of a constant: NAME in the formulation's module, or MODULE.NAME in attnlab.kernels."""
    if "." in name:
        module_name, name = name.rsplit(".", 1)
        module = importlib.import_module(f"attnlab.kernels.{module_name}")
    if not hasattr(module, name):
        raise AttributeError(f"{module.__name__} has no constant {name}")
    return module, name


@contextmanager
def module_constants(module, constants: dict):
    """Module constants set for the duration of a call (restored after)."""
    owners = {name: _owner(module, name) for name in constants}
    saved = {name: getattr(*owners[name]) for name in constants}
    for name, value in constants.items():
        setattr(*owners[name], value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(*owners[name], value)


def with_constants(kernel, module, constants: dict):
    if not constants:
        return kernel

    def call(**inputs):
        with module_constants(module, constants):
            return kernel(**inputs)

    return call


def main() -> None:
    name, settings = sys.argv[1], [{}] + [json.loads(a) for a in sys.argv[2:]]
    f = attnlab.formulation(name)
    x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
    small = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=1, T=1024, H=4, K=128, V=128, seed=1).items()}
    peer = f.bench_peer
    extra = dict(peer.our_options) if peer else {}
    ref = attnlab.oracle(name, "chunkwise", "float64")(**small, **extra)
    module = importlib.import_module(f.kernel_module)
    ready = []
    for opts in settings:
        try:
            options = {n: v for n, v in opts.items() if n != "constants"}
            kernel = with_constants(attnlab.kernel(name, "chunkwise", **options), module, opts.get("constants", {}))
            kernel(**x, **extra)
            excess = measure(kernel(**small, **extra), ref, torch.bfloat16).excess
            ready.append((opts, kernel, excess))
        except Exception as error:  # record and go on
            print(f"{name} {json.dumps(opts)}: {type(error).__name__}: {str(error)[:150]}", flush=True)
    if peer:
        peer_call(name, x)()
    wait_for_the_others(name)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        peer_ms = triton.testing.do_bench(peer_call(name, x), warmup=25, rep=100, return_mode="median") if peer else float("nan")
        print(f"{name}: peer {peer.label if peer else None} {peer_ms:.3f} ms", flush=True)
        for opts, kernel, excess in ready:
            call = lambda: kernel(**x, **extra)  # noqa: E731, B023
            ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
            launches = ", ".join(f"{kname.split('(')[0][:28]} {t:.3f}" for kname, t in kernel_times(call) if t > 0.01)
            print(f"{name} {json.dumps(opts):44s} {ms:7.3f} ms  ratio {ms / peer_ms:5.2f}  "
                  f"excess(T=1024) {excess:6.3f}  | {launches}", flush=True)
        fcntl.flock(lock, fcntl.LOCK_UN)


if __name__ == "__main__":
    try:
        main()
    finally:  # a process that failed must not keep the others waiting
        mark_ready(sys.argv[1])
