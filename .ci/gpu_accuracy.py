"""Accuracy of every attnlab kernel and its peer against the float64 oracle, on the GPU.

Writes one JSON row per (formulation, variant, dtype, T, implementation) to
the path given, and prints the worst excess per (formulation, implementation, dtype).
Variants: the registry's default inputs; log gates uniform in [-20, 0] per step
(gated formulations); keys shifted by +-60 (rwkv4, aft).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict

import torch

import attnlab
from attnlab.bench import PEERS
from attnlab.evaluate import measure_against_oracle, rounded_inputs

LENGTHS = [64, 256, 1024, 4096, 16384]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SIZES = dict(B=1, H=2, K=64, V=64)
GATES = {"retnet": (), "gla": ("g",), "general": ("gk", "gv"), "gated_deltanet": ("g",), "kda": ("g",)}


def variants(name):
    yield "default", None
    if GATES.get(name):
        def strong(x, names=GATES[name]):
            gen = torch.Generator().manual_seed(7)
            return {**x, **{n: -20.0 * torch.rand(x[n].shape, generator=gen, dtype=torch.float64) for n in names}}
        yield "gates-20", strong
    if name in ("rwkv4", "aft"):
        yield "keys+60", lambda x: {**x, "k": x["k"] + 60}
        yield "keys-60", lambda x: {**x, "k": x["k"] - 60}


def main(path: str) -> None:
    rows = []
    for f in attnlab.REGISTRY:
        peer = PEERS.get(f.name)
        options = dict(peer.our_options or {}) if peer else {}
        for variant, transform in variants(f.name):
            for dtype_name, dtype in DTYPES.items():
                for T in LENGTHS:
                    x = rounded_inputs(f.name, dtype, "cuda", T=T, transform=transform, **SIZES)
                    x.update(options)
                    impls = {f"attnlab:{form}": attnlab.kernel(f.name, form) for form in f.kernel_forms}
                    if peer is not None:
                        impls[peer.label] = peer.output
                    for label, impl in impls.items():
                        started = time.time()
                        row = dict(formulation=f.name, variant=variant, dtype=dtype_name, T=T, impl=label, options=options)
                        try:
                            m, _ = measure_against_oracle(f.name, lambda **kw: impl(**kw), x, out_dtype=dtype)
                            row.update(m.as_dict())
                        except Exception as error:
                            row["error"] = f"{type(error).__name__}: {error}"[:400]
                        row["seconds"] = round(time.time() - started, 2)
                        rows.append(row)
                        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "options"}), flush=True)
                    torch.cuda.empty_cache()
    with open(path, "w") as out:
        json.dump(rows, out, indent=1)
    worst = defaultdict(float)
    for r in rows:
        key = (r["formulation"], r["impl"], r["dtype"])
        worst[key] = max(worst[key], r.get("excess", math.inf))
    print("\nworst excess over lengths and variants:")
    for (name, impl, dtype), value in sorted(worst.items()):
        print(f"  {name:15s} {impl:32s} {dtype:9s} {value:8.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
