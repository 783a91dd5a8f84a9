"""The delta rules' chunkwise backward (attnlab.kernels._delta_chunk_backward) compiles for sm_90, without a GPU.

Its gradients are tested under the interpreter with every other backward (tests/test_kernel_gradients.py), but the
interpreter runs code the compiler rejects (a name carried through a loop at another type, an early return from a
constexpr branch) and knows no register or shared-memory limit. So each of the seven kernels is compiled for
Hopper here, in both of its arithmetics (fp32 for 16-bit inputs, fp64 for fp32 inputs), ungated, with a gate per
head and with one per key channel (kda; the two anchored kernels only there; the sums kernel, which reads no gate,
once), at the smallest tiles (quick); and the sums and gradients kernels, the largest, at the tiles the launcher
takes (``tiles``) for the widest head dims (K = V = 256) in their widest arithmetic (fp64, for fp32 inputs), within
sm_90's 227 KB of shared memory a block (the bench's K = V = 128 in bf16 takes 16 KB and 64 KB). The compiles run
in a process of their own, with the interpreter off (this suite's processes run under it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attnlab
from attnlab.gradients import gradient_dtypes, gradient_floor, oracle_gradients
from attnlab.kernel import kernel
from attnlab.kernels import _delta_chunk_backward as backward
from attnlab.metrics import measure_gradients

SHARED_MEMORY_PER_BLOCK = 232448  # sm_90's opt-in maximum (227 KB)

COMPILE = textwrap.dedent("""
    import sys
    import torch
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from attnlab.kernels import _delta_chunk_backward as backward

    KERNELS = {
        "local": (backward._local_kernel, "q k v beta g", "x w u a kk factors decays peaks", dict(LEVELS=0)),
        "states": (backward._states_kernel, "k g", "factors decays w u s0 states delta peaks",
                   dict(HAS_INITIAL=True)),
        "reverse": (backward._reverse_kernel, "q k g do",
                    "factors decays w a d_final d_states d_delta d_initial peaks",
                    dict(HAS_D_FINAL=True, STORE_D_INITIAL=True)),
        "sums": (backward._sums_kernel, "v beta do dv",
                 "x states d_states delta d_delta key_sums dw value_sums pairing peaks", {}),
        "gradients": (backward._gradients_kernel, "q k beta g dq dk dbeta dg",
                      "factors decays x a kk key_sums dw value_sums pairing parts d_kk d_a", {}),
        "channel_grams": (backward._channel_grams_kernel, "q k g", "a kk", {}),
        "channel_cotangents": (backward._channel_cotangents_kernel, "q k g dq dk dg", "parts d_kk d_a", {}),
    }
    CHANNEL_ONLY = ("channel_grams", "channel_cotangents")
    GATELESS = ("sums",)  # no gate argument: one compile per arithmetic

    DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
    # The sequential passes' outputs, stored in fp16 on the "fp16" path (bf16 inputs); the bounds always fp32.
    STORED = ("states", "d_states", "delta", "d_delta")
    WARPS = dict.fromkeys(KERNELS, backward.NUM_WARPS) | {"sums": backward.SUMS_NUM_WARPS,
                                                          "gradients": backward.GRADIENTS_NUM_WARPS}
    WARPS |= dict.fromkeys(CHANNEL_ONLY, backward.CHANNEL_NUM_WARPS)

    def compile_one(name, inputs, gates, C, BK, BV, STATE_BV):
        kernel, input_names, scratch_names, constexprs = KERNELS[name]
        acc = tl.float64 if inputs == "fp32" else tl.float32
        types = {f"{n}_ptr": f"*{inputs}" for n in input_names.split()}
        precision = backward.products_precision(DTYPES[inputs])
        types |= {f"{n}_ptr": "*fp64" if inputs == "fp32" else "*fp32" for n in scratch_names.split()}
        types |= {f"{n}_ptr": "*fp16" for n in STORED if precision == "fp16"} | {"peaks_ptr": "*fp32"}
        types |= {n: "i32" for n in ("T", "H", "K", "V")} | {"scale_hi": "fp32", "scale_lo": "fp32"}
        signature = {n: types[n] for n in kernel.arg_names if n in types}
        options = dict(constexprs, GATED=gates != "ungated", CHANNEL=gates == "channel", C=C, BK=BK, BV=BV,
                       STATE_BV=STATE_BV,
                       BKC=min(BK, backward.CHANNEL_SLICE), NATIVE_GATES=inputs != "fp32", ACC=acc,
                       PRECISION="tf32x3" if name in ("local", "channel_grams")
                       else precision)
        options = {n: value for n, value in options.items() if n in kernel.arg_names}
        what = f"{name} {inputs} {gates} C={C} BK={BK} BV={BV}"
        try:
            source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=options)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=WARPS[name], num_stages=1))
            print("compiled", what, "shared", compiled.metadata.shared, flush=True)
        except Exception as error:
            print("FAILED", what, type(error).__name__, str(error).strip().splitlines()[-1][:300], flush=True)

    if sys.argv[1] == "smallest":
        for name in KERNELS:
            for inputs in ("bf16", "fp32"):
                for gates in ("channel",) if name in CHANNEL_ONLY + GATELESS else ("ungated", "head", "channel"):
                    compile_one(name, inputs, gates, 16, 16, 16, 16)
    else:
        inputs, K = sys.argv[2], int(sys.argv[3])
        C, _, BV, key_block, sums_BV, gradients_key_block = backward.tiles(K, K)
        compile_one("sums", inputs, "channel", C, key_block, sums_BV, BV)
        compile_one("gradients", inputs, "channel", C, gradients_key_block, sums_BV, BV)
""")


def compiled(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", COMPILE, *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout.splitlines()


def test_every_kernel_compiles_for_hopper_in_every_arithmetic_and_gate_mode() -> None:
    lines = compiled("smallest")
    assert len(lines) == 30 and all(line.startswith("compiled") for line in lines), "\n".join(lines)


def test_the_sums_and_gradients_kernels_fit_hopper_at_the_launchers_tiles() -> None:
    for inputs, K in (("fp32", "256"),):
        lines = compiled("launch", inputs, K)
        assert len(lines) == 2, lines
        for line in lines:
            assert line.startswith("compiled"), line
            assert int(line.split()[-1]) <= SHARED_MEMORY_PER_BLOCK, line


# The "fp16" path (the bf16 inputs' default) under the interpreter: its emulation forced on fp16 inputs, whose
# floor (2^-11) is the size of its operands' rounding. With S, dS', Delta and dDelta stored as to_scratch makes them
# (11 bits against their stored bounds) every gradient measured 1.4 to 2.3 times fp16's floor (kda's g 4.6); stored
# with 8 bits instead (bf16's: the to_scratch of a coarser rule) they measured 16 to 35.
FP16_PATH_BOUND = 6.0


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet", "kda"])
def test_the_fp16_path_stores_its_operands_at_fp16s_precision(name, monkeypatch):
    monkeypatch.setattr(backward, "products_precision", lambda dtype: "fp16_emulated")
    f = attnlab.formulation(name)
    x = {n: t.half() if isinstance(t, torch.Tensor) else t
         for n, t in f.sample(B=1, T=80, H=2, K=32, V=32, seed=3).items()}  # two chunks of 64
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()
              if isinstance(t, torch.Tensor) and f.arg(n).differentiable}
    o = kernel(name, "chunkwise")(**{**x, **leaves})
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).half().double()
    grads = dict(zip(leaves, torch.autograd.grad((o.double() * do).sum(), list(leaves.values()))))
    reference = oracle_gradients(f, x, do, None)
    measured = measure_gradients(grads, reference, gradient_dtypes(f, x), gradient_floor(f, x, do, None,
                                                                                          base=reference))
    for n, m in measured.items():
        assert m.nonfinite == 0 and m.excess <= FP16_PATH_BOUND, (n, m.as_dict())
