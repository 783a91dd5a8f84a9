"""Standalone reproducer (torch and fla-core 0.6.0 only): fla's fused_recurrent_rwkv4 backward loses its gradients
when the keys are large.

attnlab's fla campaign found dw off by 31% (272x the bf16 rounding floor) and du by 4.8% on
Case(name='rwkv4', seed=41378721, T=1023, key_shift=130.4): keys shifted by a constant, which leaves RWKV-4's
output unchanged (it is a ratio of sums of e^k) and which its forward handles with a running maximum. The likely
cause: the backward reads the per-token states the forward saved, and fla saves them as ``k.new_empty(...)``, in
the input dtype (fla/ops/rwkv4/fused_recurrent.py), so the running maximum eps, a log-scale as large as the keys,
is rounded to the 16-bit grid (spacing at 130: bf16 1.0, fp16 0.0625), and every e^(eps - tau) the backward forms
from it is off by up to e^(spacing / 2). The error grows with the shift as that spacing does.

Measured on the CPU (fp16, Triton interpreter, T=64, C=16), rel_err / floor at key shifts 0, 30, 130:
dw 3.4, 29, 207; du 1.2, 4.1, 43; dk 1.8, 16, 109; dv 1.4, 13, 76.

For each key shift it prints the relative error of every gradient against float64 autograd through the literal
recurrence, and the rounding floor (the float64 gradient rounded once to the dtype). On a GPU it runs bf16; without
one, fp16 under the Triton interpreter (slow: small sizes). Run: python reports/third_party/fla_rwkv4_backward_shifted_keys.py
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from fla.ops.rwkv4 import fused_recurrent_rwkv4  # noqa: E402 - after TRITON_INTERPRET

DEVICE, DTYPE = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float16)
B, T, C = (1, 1023, 64) if DEVICE == "cuda" else (1, 64, 16)


def reference(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """RWKV-4's WKV in float64, literally (w in fla's convention: the decay per step is exp(-exp(w))); the keys
    stay below 709, so e^k is finite in float64."""
    decay = torch.exp(-torch.exp(w))
    a = torch.zeros(k.shape[0], k.shape[2], dtype=torch.float64)
    b = torch.zeros_like(a)
    out = []
    for t in range(k.shape[1]):
        e_now = torch.exp(u + k[:, t])
        out.append((a + e_now * v[:, t]) / (b + e_now))
        a = decay * a + torch.exp(k[:, t]) * v[:, t]
        b = decay * b + torch.exp(k[:, t])
    return torch.stack(out, dim=1)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(C, generator=gen, dtype=torch.float64) - 1.0
    u = 0.5 * torch.randn(C, generator=gen, dtype=torch.float64)
    k0 = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    do = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    print(f"fla fused_recurrent_rwkv4 backward, {DTYPE} on {DEVICE}, B={B} T={T} C={C}")
    print("key shift | gradient | rel_err | floor (exact rounded once) | rel_err / floor")
    for shift in (0.0, 30.0, 130.0):
        inputs = [x.to(DTYPE).double() for x in (w, u, k0 + shift, v)]  # exactly the dtype's values
        exact = [x.clone().requires_grad_() for x in inputs]
        exact_grads = torch.autograd.grad(reference(*exact), exact, do.to(DTYPE).double())
        leaves = [x.to(device=DEVICE, dtype=DTYPE).requires_grad_() for x in inputs]
        state = torch.zeros(B, 3, 1, C, device=DEVICE, dtype=DTYPE)
        state[:, 2] = -1e38  # the empty state: no key yet (eps = -inf in effect)
        o, _ = fused_recurrent_rwkv4(*leaves, state)
        grads = torch.autograd.grad(o, leaves, do.to(device=DEVICE, dtype=DTYPE))
        for name, got, want in zip(("dw", "du", "dk", "dv"), grads, exact_grads):
            err, floor = relative(got.cpu(), want), relative(want.to(DTYPE), want)
            print(f"{shift:9.0f} | {name:8s} | {err:.3e} | {floor:.3e} | {err / floor:8.1f}")


if __name__ == "__main__":
    main()
