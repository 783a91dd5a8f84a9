"""Where a kernel call's time goes besides its kernels, at the bench shape (B=8, T=4096, H=16, K=V=128, bf16).

    python3 tools/gpu/overhead.py [NAME,NAME...]

For each formulation, do_bench medians in ms of:

    call      attnlab.kernel(name)(**x) as users call it: validation, the queued value checks, the kernel
              module's preparation, the one sync (just before the first launch), the launches
    eager     the same with the sync inside validation, before the module's preparation (the order before
              session 5): the GPU idles while the host allocates and builds the launch arguments
    no-sync   the value checks' reductions queued but never waited for
    kernels   no value checks at all: the kernels and the host's launch cost, never waiting
    reduce    the value checks' reductions alone (torch.aminmax of each ranged input)
    peer      the peer of attnlab bench

call - kernels is what checking the values costs a call; call - no-sync the cost of the sync itself.
Then, for back-to-back calls, the host's medians in microseconds: blocked in the sync, from the sync to
the first launch, and inside that launch (a bound attnlab.kernels._util.Launch: the driver's launch
alone), which together the GPU idles through.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch
import triton

import attnlab
from attnlab.commands.bench import peer_call, peer_inputs
from attnlab.kernels._util import Launch
from attnlab.validation import ValueScan


@contextlib.contextmanager
def patched(**methods):
    saved = {name: getattr(ValueScan, name) for name in methods}
    for name, method in methods.items():
        setattr(ValueScan, name, method)
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(ValueScan, name, method)


def host_timeline(call, calls: int = 50) -> tuple[float, float, float]:
    """Median microseconds blocked in ValueScan.wait, from its return to the next launch, inside that launch."""
    marks: list[tuple[str, float]] = []
    wait, run = ValueScan.wait, Launch.__call__

    def timed_wait(self):
        marks.append(("wait", time.perf_counter()))
        wait(self)
        marks.append(("waited", time.perf_counter()))

    def timed_run(self):
        marks.append(("launch", time.perf_counter()))
        run(self)
        marks.append(("launched", time.perf_counter()))

    Launch.__call__ = timed_run
    with patched(wait=timed_wait):
        try:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        finally:
            Launch.__call__ = run
    blocked, to_launch, launching = [], [], []
    for i, (mark, t) in enumerate(marks):
        if mark == "waited" and i + 2 < len(marks) and marks[i + 1][0] == "launch":
            blocked.append(t - marks[i - 1][1])
            to_launch.append(marks[i + 1][1] - t)
            launching.append(marks[i + 2][1] - marks[i + 1][1])
    return tuple(1e6 * statistics.median(x) if x else float("nan") for x in (blocked, to_launch, launching))


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else attnlab.names()
    init, wait = ValueScan.__init__, ValueScan.wait

    def eager_init(self, checks):
        init(self, checks)
        wait(self)

    def no_wait(self):
        self.done = True

    def unchecked_init(self, checks):
        init(self, [])

    variants = {
        "call": {},
        "eager": {"__init__": eager_init},
        "no-sync": {"wait": no_wait},
        "kernels": {"__init__": unchecked_init},
    }
    print(f"{'':16s} " + " ".join(f"{v:>8s}" for v in [*variants, "reduce", "peer"]), flush=True)
    for name in names:
        f = attnlab.formulation(name)
        x = {n: t.to(device="cuda", dtype=torch.bfloat16) for n, t in f.sample(B=8, T=4096, H=16, K=128, V=128, seed=0).items()}
        peer = attnlab.formulation(name).bench_peer
        inputs = peer_inputs(name, x)
        ours = attnlab.kernel(name, "chunkwise")
        times = []
        for methods in variants.values():
            with patched(**methods):
                ours(**inputs)
                times.append(triton.testing.do_bench(lambda: ours(**inputs), warmup=25, rep=200, return_mode="median"))  # noqa: B023
        ranged = [x[a.name] for a in f.args if (a.low is not None or a.high is not None) and a.name in x]
        times.append(triton.testing.do_bench(lambda: [torch.aminmax(t) for t in ranged], warmup=25, rep=200, return_mode="median")  # noqa: B023
                     if ranged else float("nan"))
        times.append(triton.testing.do_bench(peer_call(name, x), warmup=25, rep=200, return_mode="median") if peer else float("nan"))
        blocked, to_launch, launching = host_timeline(lambda: ours(**inputs))  # noqa: B023
        print(f"{name:16s} " + " ".join(f"{t:8.3f}" for t in times)
              + f"   host us: sync {blocked:.0f}, to launch {to_launch:.0f}, launch {launching:.0f}", flush=True)


if __name__ == "__main__":
    main()
