"""Where the delta rules' chunkwise backward needs its precision: a float64 model of the chunk dual with chosen
intermediates rounded.

    python3 tools/delta_rounding_model.py NAME T K [--seed N] [--adversarial BETA_LOW COHERENCE]

NAME is deltanet or gated_deltanet (a gate per head), T a multiple of the chunk (64), K = V the head dims. The model
is kernels/_delta_chunk_backward.py's module docstring written in float64 torch, one chunk at a time, from a zero
initial state: the forward's chunk algebra (X = (I + L)^-1, W, U, then S and Delta chunk by chunk) and its dual
(dDelta and dS' backwards, the sums over V, dT, dL, and dq, dk, dv, dbeta and a gate per head's dg). Each
intermediate named in a variant (VARIANTS) is rounded where a kernel would store it:

- X, W, U: the inverse and the WY factors;
- S, dS: the state entering a chunk and the cotangent of the state leaving it, as stored (Delta and dDelta are
  formed from them, the sums read them; the recursions carry them unrounded);
- Delta, dDelta: stored, and multiplied as stored by the recursions too;
- sums: the [C, K] sums over V, dQg, -dW and dKd; cc: the [C, C] ones, dA and dDelta V^T.

Roundings: "bf16" (fla's storage), "fp16" against the peak of each chunk's matrix of one head (attnlab's "fp16" path:
2^-11 of each value down to 2^-25 of the peak) or against a bound 2^20 times it (what a scale from a cheap bound
would leave), "bf16 parts" (hi + lo, about 2^-16). Products are exact (float64), so a variant measures what its
storage costs, not what the arithmetic that forms a tile costs (the inverse's merges at bf16 parts are another
question: tools/bf16_on_cpu.py runs the kernel's own). Each gradient comes back rounded to bf16 and is measured
against the float64 oracle's (attnlab.gradients.oracle_gradients) as the gradient tests measure it: its excess over
bf16's rounding floor. The inputs are the registry's (``sample``) in bf16, or with --adversarial the property suite's
kind of hard chunk (properties/strategies.py's Case: beta drawn from [BETA_LOW, 2], keys of that coherence).
reports/bench.md (session 39) has what it found.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping

import torch

import attnlab
from attnlab.gradients import oracle_gradients
from attnlab.metrics import measure_gradients
from attnlab.properties.strategies import Case

CHUNK = 64
NAMES = ("deltanet", "gated_deltanet")


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def fp16_against_peak(x: torch.Tensor, slack: float = 1.0) -> torch.Tensor:
    """Each matrix of x (its last two dims: one chunk's of one head) in fp16 after scaling its peak, times ``slack``,
    to [2^13, 2^14), as _numerics.to_scratch stores a tile against its bound (the kernels' tiles are such a matrix
    or a block of one; their bound is the peak, slack 1)."""
    peak = x.abs().amax((-2, -1), keepdim=True) * slack
    step = torch.exp2(torch.floor(torch.log2(torch.where(peak > 0, peak, 1.0))) - 13)
    return (x / step).to(torch.float16).double() * step


def fp16_against_loose_bound(x: torch.Tensor) -> torch.Tensor:
    """fp16 against a bound 2^20 times each matrix's peak: what a scale taken from a cheap bound instead of the peak
    (no max-reduction) would leave; the peak lands in [2^-7, 2^-6), fp16's normal range ends 2^-8 below it."""
    return fp16_against_peak(x, 2.0**20)


def bf16_parts(x: torch.Tensor) -> torch.Tensor:
    hi = bf16(x)
    return hi + bf16(x - hi)


Rounding = Callable[[torch.Tensor], torch.Tensor]
FP16_PATH = dict.fromkeys(("S", "dS", "Delta", "dDelta", "sums"), fp16_against_peak)
EVERYTHING = ("X", "W", "U", "S", "dS", "Delta", "dDelta", "sums", "cc")
VARIANTS: dict[str, dict[str, Rounding]] = {
    "exact": {},
    "attnlab's fp16 path (S, dS, Delta, dDelta, sums)": FP16_PATH,
    "the fp16 path against bounds 2^20 over the peaks": FP16_PATH | dict.fromkeys(("S", "dS", "Delta", "dDelta"),
                                                                             fp16_against_loose_bound),
    "S, dS in bf16": dict(S=bf16, dS=bf16),
    "Delta, dDelta in bf16": dict(Delta=bf16, dDelta=bf16),
    "[C, K] sums in bf16": dict(sums=bf16),
    "[C, C] sums in bf16": dict(cc=bf16),
    "[C, C] sums in fp16": dict(cc=fp16_against_peak),
    "X in bf16": dict(X=bf16),
    "X in fp16": dict(X=fp16_against_peak),
    "X in bf16 parts": dict(X=bf16_parts),
    "W, U in bf16": dict(W=bf16, U=bf16),
    "W, U in fp16": dict(W=fp16_against_peak, U=fp16_against_peak),
    "S, dS in bf16, the rest of the fp16 path": FP16_PATH | dict(S=bf16, dS=bf16),
    "everything in fp16": dict.fromkeys(EVERYTHING, fp16_against_peak),
    "everything in fp16 but X in bf16 parts": dict.fromkeys(EVERYTHING, fp16_against_peak) | dict(X=bf16_parts),
    "everything in bf16 (fla's storage)": dict.fromkeys(EVERYTHING, bf16),
}


def chunk_dual_gradients(x: Mapping[str, torch.Tensor], do: torch.Tensor,
                         rounded: Mapping[str, Rounding]) -> dict[str, torch.Tensor]:
    """dq, dk, dv, dbeta (and dg where ``x`` has g) of <do, o> for the delta rule's inputs ``x`` ([B, T, H, *], g
    per head or absent), the chunk dual in float64 with each intermediate named in ``rounded`` passed through its
    rounding."""
    def r(name: str, t: torch.Tensor) -> torch.Tensor:
        return rounded[name](t) if name in rounded else t

    q, k, v, dO = (t.double().transpose(1, 2) for t in (x["q"], x["k"], x["v"], do))  # [B, H, T, *]
    beta = x["beta"].double().transpose(1, 2)
    g = x["g"].double().transpose(1, 2) if "g" in x else torch.zeros_like(beta)
    T, K = q.shape[-2:]
    if T % CHUNK:
        raise ValueError(f"T must be a multiple of the chunk ({CHUNK}); got {T}")
    scale = K ** -0.5
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.float64).tril()
    strict = causal.tril(-1)
    eye = torch.eye(CHUNK, dtype=torch.float64)
    chunks = []
    for start in range(0, T, CHUNK):
        rows = slice(start, start + CHUNK)
        c = dict(rows=rows, q=q[..., rows, :], k=k[..., rows, :], v=v[..., rows, :], beta=beta[..., rows])
        G = g[..., rows].cumsum(-1)
        c["gamma"] = torch.exp((G[..., :, None] - G[..., None, :]).clamp(max=0)) * causal
        c["kk"] = c["k"] @ c["k"].mT * c["gamma"]
        c["X"] = r("X", torch.linalg.inv(eye + strict * c["beta"][..., :, None] * c["kk"]))
        c["T"] = c["X"] * c["beta"][..., None, :]
        c["from_start"], c["to_end"] = torch.exp(G)[..., None], torch.exp(G[..., -1:] - G)[..., None]
        c["Kg"], c["Qg"], c["Kd"] = c["k"] * c["from_start"], scale * c["q"] * c["from_start"], c["k"] * c["to_end"]
        c["W"], c["U"] = r("W", c["T"] @ c["Kg"]), r("U", c["T"] @ c["v"])
        c["A"] = scale * (c["q"] @ c["k"].mT) * c["gamma"]
        c["decay"] = torch.exp(G[..., -1])[..., None, None]
        chunks.append(c)
    S = torch.zeros(*q.shape[:2], K, v.shape[-1], dtype=torch.float64)
    for c in chunks:
        c["S"] = r("S", S)
        c["Delta"] = r("Delta", c["U"] - c["W"] @ c["S"])
        S = c["decay"] * S + c["Kd"].mT @ c["Delta"]
    grads = {n: torch.zeros_like(t) for n, t in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g))}
    dS = torch.zeros_like(S)
    for c in reversed(chunks):
        dOc, dS_stored = dO[..., c["rows"], :], r("dS", dS)
        d_delta = r("dDelta", c["A"].mT @ dOc + c["Kd"] @ dS_stored)
        dS = c["decay"] * dS + c["Qg"].mT @ dOc - c["W"].mT @ d_delta
        dQg = r("sums", dOc @ c["S"].mT)
        dW = r("sums", -d_delta @ c["S"].mT)
        dKd = r("sums", c["Delta"] @ dS_stored.mT)
        dA = r("cc", causal * (dOc @ c["Delta"].mT))
        dT = r("cc", d_delta @ c["v"].mT) + dW @ c["Kg"].mT
        X = c["X"]
        dL = -strict * (X.mT @ (dT * c["beta"][..., None, :]) @ X.mT)
        dE = c["beta"][..., :, None] * dL * c["gamma"]
        dP = scale * dA * c["gamma"]
        dKg = c["T"].mT @ dW
        rows = c["rows"]
        grads["beta"][..., rows] = (dT * X).sum(-2) + (dL * c["kk"]).sum(-1)
        grads["v"][..., rows, :] = c["T"].mT @ d_delta
        grads["k"][..., rows, :] = ((dE + dE.mT) @ c["k"] + dP.mT @ c["q"] + c["from_start"] * dKg
                                    + c["to_end"] * dKd)
        grads["q"][..., rows, :] = dP @ c["k"] + scale * c["from_start"] * dQg
        # dG: the pairwise decays' (row sums minus column sums of dL * L and dA * A), the row factors' (Qg, Kg, and
        # Kd, whose sum also goes to G_C) and the state decay's; dg is its reverse cumulative sum over the chunk.
        pairs = dL * c["beta"][..., :, None] * c["kk"] + dA * c["A"]
        to_end_terms = (dKd * c["Kd"]).sum(-1)
        dG = (pairs.sum(-1) - pairs.sum(-2) + (dQg * c["Qg"]).sum(-1) + (dKg * c["Kg"]).sum(-1)
              - to_end_terms)
        dG[..., -1] += to_end_terms.sum(-1) + c["decay"][..., 0, 0] * (c["S"] * dS_stored).sum((-2, -1))
        grads["g"][..., rows] = dG.flip(-1).cumsum(-1).flip(-1)
    return {n: t.transpose(1, 2) for n, t in grads.items() if n in x}


def inputs(name: str, T: int, K: int, seed: int,
           adversarial: tuple[float, float] | None = None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the inputs in bf16's values as float64, do likewise): the registry's sample, or the property suite's hard
    chunks (beta from [adversarial[0], 2], keys of coherence adversarial[1])."""
    if name not in NAMES:
        raise ValueError(f"the model covers {', '.join(NAMES)}; got {name!r}")
    if adversarial is None:
        drawn = attnlab.formulation(name).sample(B=1, T=T, H=2, K=K, V=K, seed=seed)
    else:
        case = Case(name=name, seed=seed, B=1, T=T, H=2, K=K, V=K, beta_low=adversarial[0], beta_high=2.0,
                    key_coherence=adversarial[1])
        drawn = case.call(torch.bfloat16, "cpu")
    x = {n: t.to(torch.bfloat16).double() for n, t in drawn.items() if isinstance(t, torch.Tensor)}
    o = attnlab.oracle(name, "chunkwise", "float64")(**x)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return x, bf16(do)


def excess_table(name: str, x: Mapping[str, torch.Tensor], do: torch.Tensor,
                 variants: Mapping[str, Mapping[str, Rounding]] = VARIANTS) -> dict[str, dict[str, float]]:
    """{variant: {gradient: excess over bf16's floor}}, each gradient returned in bf16."""
    reference = oracle_gradients(name, x, do)
    table = {}
    for label, rounded in variants.items():
        grads = chunk_dual_gradients(x, do, rounded)
        measured = measure_gradients({n: grads[n].to(torch.bfloat16) for n in reference}, reference,
                                     dict.fromkeys(reference, torch.bfloat16))
        table[label] = {n: m.excess for n, m in measured.items()}
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=NAMES)
    parser.add_argument("T", type=int)
    parser.add_argument("K", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--adversarial", type=float, nargs=2, metavar=("BETA_LOW", "COHERENCE"))
    args = parser.parse_args(argv)
    if args.T % CHUNK:
        parser.error(f"T must be a multiple of the chunk ({CHUNK}); got {args.T}")
    x, do = inputs(args.name, args.T, args.K, args.seed, args.adversarial)
    for label, excess in excess_table(args.name, x, do).items():
        print(f"{label:50s}", "  ".join(f"{n} {value:5.2f}" for n, value in excess.items()), flush=True)


if __name__ == "__main__":
    main()
