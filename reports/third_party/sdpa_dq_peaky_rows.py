"""Standalone reproducer (torch only, a CUDA GPU): SDPA's dq in bf16 on short causal sequences with a large scale.

attnlab's torch campaign found sdpa_efficient's dq off by 80% (rel_err 0.80, 482x the bf16 rounding floor) on
Case(name='softmax', seed=309, B=1, T=3, H=1, K=64, V=64, scale=1.81, causal, cut=2): do zero from position 2,
the gradient at positions 0 and 1 against the float64 gradient of the two-position prefix.

This script asks whether that is a defect of the memory-efficient backward or the accuracy any backward has that
forms D = rowsum(dO * O) from the bf16 output: for a row whose softmax is nearly one-hot (p = 1 - e), dq is
O(e) while an error u |dO| |O| in D moves it by O(u), a relative error of about u / e. For each seed it prints,
per backend, the relative error of dq at the positions before the cut against float64 autograd, the same for the
full run (do nonzero everywhere), and a float64 emulation of the FlashAttention-2 backward whose only rounding is
O in bf16 (the error that algorithm cannot avoid). Run: python reports/third_party/sdpa_dq_peaky_rows.py
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

BACKENDS = {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def dq_of(q, k, v, do, scale, backend=None):
    q = q.detach().requires_grad_()
    if backend is None:
        o = scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        with sdpa_kernel(backend):
            o = scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    (dq,) = torch.autograd.grad(o, q, do)
    return dq


def fa2_emulation(q, k, v, do, scale):
    """float64 FlashAttention-2 backward for dq, D taken from the output rounded to bf16."""
    q, k, v, do = (x.double() for x in (q, k, v, do))
    T = q.shape[-2]
    logits = (q @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = logits.softmax(-1)
    o = (p @ v).to(torch.bfloat16).double()
    dp = do @ v.transpose(-1, -2)
    D = (do * o).sum(-1, keepdim=True)
    return (p * (dp - D)) @ k * scale


def main() -> None:
    T, D, scale, cut = 3, 64, 1.81, 2
    print(f"T={T}, D={D}, scale={scale}, causal, bf16; dq rel_err at positions < {cut} (do zero from {cut}) | full run")
    for seed in range(8):
        g = torch.Generator(device="cuda").manual_seed(seed)
        q, k, v, do = (torch.randn(1, 1, T, D, device="cuda", generator=g).bfloat16() for _ in range(4))
        cut_do = do.clone()
        cut_do[..., cut:, :] = 0
        ref_cut = dq_of(q.double(), k.double(), v.double(), cut_do.double(), scale)[..., :cut, :]
        ref_full = dq_of(q.double(), k.double(), v.double(), do.double(), scale)
        floor = relative(ref_cut.bfloat16(), ref_cut)
        row = [f"seed {seed}: floor {floor:.1e}"]
        for name, backend in BACKENDS.items():
            try:
                mine_cut = dq_of(q, k, v, cut_do, scale, backend)[..., :cut, :]
                mine_full = dq_of(q, k, v, do, scale, backend)
                row.append(f"{name} {relative(mine_cut, ref_cut):.2e} | {relative(mine_full, ref_full):.2e}")
            except RuntimeError as error:
                row.append(f"{name} refused ({str(error).splitlines()[0][:40]})")
        emulated = fa2_emulation(q, k, v, cut_do, scale)[..., :cut, :]
        row.append(f"FA2 emulation (O in bf16) {relative(emulated, ref_cut):.2e}")
        print("; ".join(row))


if __name__ == "__main__":
    main()
