"""The delta rules' chunkwise backward (attnlab.kernels._delta_chunk_backward) compiles for sm_90, without a GPU.

Its gradients are tested under the interpreter with every other backward (tests/test_kernel_gradients.py), but the
interpreter runs code the compiler rejects (a name carried through a loop at another type, an early return from a
constexpr branch): each of the four kernels is compiled for Hopper here, in both of its arithmetics (fp32 for
16-bit inputs, fp64 for fp32 inputs), ungated, with a gate per head and with one per key channel (kda), at the
smallest tiles so that it stays quick. The compiles run in a process of their own, with the interpreter off (this
suite's processes run under it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

COMPILE_ALL = textwrap.dedent("""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from attnlab.kernels import _delta_chunk_backward as backward

    KERNELS = {
        backward._local_kernel: ("k v beta g", "x w u", dict(BV=16, LEVELS=0)),
        backward._states_kernel: ("k g", "w u s0 states", dict(BV=16, HAS_INITIAL=True)),
        backward._reverse_kernel: ("q k g do", "w d_final d_states d_delta d_initial",
                                   dict(BV=16, HAS_D_FINAL=True, STORE_D_INITIAL=True)),
        backward._gradients_kernel: ("q k v beta g do dq dk dv dbeta dg", "x w u states d_states d_delta parts",
                                     dict(BV=16)),
    }
    for kernel, (input_names, scratch_names, constexprs) in KERNELS.items():
        for inputs, acc in (("bf16", tl.float32), ("fp32", tl.float64)):
            for gates in ("ungated", "head", "channel"):
                scratch = "*fp64" if acc == tl.float64 else "*fp32"
                types = {f"{n}_ptr": f"*{inputs}" for n in input_names.split()}
                types |= {f"{n}_ptr": scratch for n in scratch_names.split()}
                types |= {n: "i32" for n in ("T", "H", "K", "V")} | {"scale": "fp32"}
                signature = {n: types[n] for n in kernel.arg_names if n in types}
                options = dict(constexprs, GATED=gates != "ungated", CHANNEL=gates == "channel", C=16, BK=16, BKC=4,
                               EMULATE_BF16=False, PRECISION="tf32x3", ACC=acc)
                what = f"{kernel.__name__} {inputs} {gates}"
                try:
                    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=options)
                    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                              options=dict(num_warps=4, num_stages=1))
                    print("compiled", what, len(compiled.asm["cubin"]) > 0)
                except Exception as error:
                    print("FAILED", what, type(error).__name__, str(error).splitlines()[-1][:300])
""")


def test_every_kernel_compiles_for_hopper() -> None:
    done = subprocess.run([sys.executable, "-c", COMPILE_ALL], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 24, done.stdout + done.stderr[-3000:]
    assert all(line.startswith("compiled") and line.endswith("True") for line in lines), "\n".join(lines)
