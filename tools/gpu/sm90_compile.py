"""Compile Triton kernels for sm_90 on a machine without a GPU and report ptxas's registers and spills.

    from sm90_compile import compile_kernel   (tools/gpu on sys.path; in a fresh process: it sets TRITON_INTERPRET=0)
    compile_kernel(kernel_fn, {"q": "*bf16", "T": "i32", ...}, {"BT": 64, ...}, num_warps=4, num_stages=2)

returns ("Used N registers, S bytes spill stores, L bytes spill loads", wgmma count, tt.dot count, shared bytes);
``dump`` writes the ttgir and ptx beside a path for reading.
"""
import os
import re
import subprocess
import tempfile

os.environ["TRITON_INTERPRET"] = "0"
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")


def _attrs(fn, signature):
    """What the JIT infers at the reference shape: 16-aligned pointers, T, H, K, V and C (RWKV-4's channels) divisible by 16."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
            if t.startswith("*") or n in ("T", "H", "K", "V", "C")}

def compile_kernel(fn, signature, constexprs, num_warps, num_stages):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=_attrs(fn, signature))
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(cc.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    info = " ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores|\d+ bytes spill loads", out.stderr))
    ttgir = cc.asm["ttgir"]
    return info, ttgir.count("warp_group_dot"), ttgir.count("tt.dot "), cc.metadata.shared

def dump(fn, signature, constexprs, num_warps, num_stages, path):
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=_attrs(fn, signature))
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    for key in ("ttgir", "ptx"):
        open(f"{path}.{key}", "w").write(cc.asm[key])
