"""``attnlab bench``: each kernel timed side by side with its peer, in one run.

Peers: flash-linear-attention's kernel of the same formulation where it has
one, torch's scaled_dot_product_attention for softmax. Times are medians of
``triton.testing.do_bench`` after a warm-up call (compilation stays out of
the numbers); the ratio ours / peer is the figure to read, since absolute
times depend on the GPU. The memory floor is the time to read every input
and write the output once at the measured device-to-device bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.registry import REGISTRY, formulation

Inputs = dict[str, torch.Tensor]


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, tuple) else result


@dataclass(frozen=True)
class Peer:
    """A third-party implementation of a formulation, called on attnlab's inputs."""

    label: str
    make: Callable[[Inputs], Callable[[], Any]]
    our_options: dict[str, Any] | None = None  # options attnlab must use to compute the same function
    to_output: Callable[[Any], torch.Tensor] = _first  # the peer's result -> o in attnlab's layout

    def output(self, x: Inputs) -> torch.Tensor:
        return self.to_output(self.make(x)())


def _sdpa(x: Inputs) -> Callable[[], Any]:
    q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _fla(op: str, build: Callable[[Inputs], dict[str, Any]]) -> Callable[[Inputs], Callable[[], Any]]:
    def make(x: Inputs) -> Callable[[], Any]:
        import fla.ops

        fn = getattr(fla.ops, op)
        kwargs = build(x)
        return lambda: fn(**kwargs)

    return make


def _qkv(x: Inputs) -> dict[str, Any]:
    return {"q": x["q"], "k": x["k"], "v": x["v"]}


def _rwkv4_fla(x: Inputs) -> dict[str, Any]:
    B, _, C = x["k"].shape
    # fla takes log(w) (decay exp(-exp(w_fla))) and a state [B, 3, 1, C].
    state = torch.zeros(B, 3, 1, C, device=x["k"].device, dtype=torch.float32)
    state[:, 2] = -1e38
    return {"w": torch.log(x["w"].float()), "u": x["u"].float(), "k": x["k"], "v": x["v"], "state": state}


PEERS: dict[str, Peer] = {
    "softmax": Peer("torch SDPA causal", _sdpa, to_output=lambda o: o.transpose(1, 2)),
    "linear_attn": Peer("fla chunk_linear_attn", _fla("chunk_linear_attn", lambda x: {**_qkv(x), "normalize": False, "scale": 1.0}),
                        {"feature_map": "identity", "normalize": False}),
    "retnet": Peer("fla chunk_simple_gla(g_gamma)", _fla("chunk_simple_gla", lambda x: {**_qkv(x), "g_gamma": x["g"].float()})),
    "gla": Peer("fla chunk_gla", _fla("chunk_gla", lambda x: {**_qkv(x), "g": x["g"]})),
    "general": Peer("fla fused_recurrent_gla(gk, gv)", _fla("fused_recurrent_gla", lambda x: {**_qkv(x), "gk": x["gk"], "gv": x["gv"]})),
    "rwkv4": Peer("fla fused_recurrent_rwkv4", _fla("fused_recurrent_rwkv4", _rwkv4_fla)),
    "deltanet": Peer("fla chunk_delta_rule", _fla("chunk_delta_rule", lambda x: {**_qkv(x), "beta": x["beta"]})),
    "gated_deltanet": Peer("fla chunk_gated_delta_rule", _fla("chunk_gated_delta_rule", lambda x: {**_qkv(x), "g": x["g"], "beta": x["beta"]})),
    "kda": Peer("fla chunk_kda", _fla("chunk_kda", lambda x: {**_qkv(x), "g": x["g"], "beta": x["beta"]})),
}


def _bytes_moved(x: Inputs, out: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in x.values()) + out.numel() * out.element_size()


def measured_bandwidth(device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written."""
    import triton.testing

    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def run(names: list[str], *, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, form: str = "chunkwise",
        progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Time each formulation's kernel and its peer at one shape; one result row per formulation."""
    import triton.testing

    from attnlab.kernel import kernel

    bandwidth = measured_bandwidth()
    rows = []
    for name in names:
        f = formulation(name)
        peer = PEERS.get(name)
        x = {n: t.to(device="cuda", dtype=dtype) for n, t in f.sample(B=B, T=T, H=H, K=K, V=V, seed=0).items()}
        options = dict(peer.our_options or {}) if peer else {}
        ours = kernel(name, form if form in f.kernel_forms else f.kernel_forms[0])
        call = lambda: ours(**x, **options)  # noqa: E731
        out = call()
        row: dict[str, Any] = {"formulation": name, "kernel": repr(ours), "options": options,
                               "floor_ms": 1e3 * _bytes_moved(x, out) / bandwidth}
        row["ours_ms"] = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
        row["peer"] = peer.label if peer else None
        row["peer_ms"] = math.nan
        if peer is not None:
            try:
                peer_call = peer.make(x)
                peer_call()
                row["peer_ms"] = triton.testing.do_bench(peer_call, warmup=25, rep=100, return_mode="median")
            except Exception as error:  # the peer's failure is recorded, not fatal
                row["peer_error"] = f"{type(error).__name__}: {error}"[:300]
        row["ratio"] = row["ours_ms"] / row["peer_ms"] if row["peer_ms"] == row["peer_ms"] else math.nan
        progress(f"{name:15s} ours {row['ours_ms']:8.3f} ms  peer {row['peer_ms']:8.3f} ms  ratio {row['ratio']:.2f}")
        rows.append(row)
        del x, out
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, str]) -> str:
    lines = ["# attnlab kernel benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| formulation | ours (ms) | peer | peer (ms) | ours / peer | memory floor (ms) | ours / floor |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        peer_ms = f"{r['peer_ms']:.3f}" if r["peer_ms"] == r["peer_ms"] else r.get("peer_error", "n/a")
        ratio = f"{r['ratio']:.2f}" if r["ratio"] == r["ratio"] else "n/a"
        lines.append(f"| {r['formulation']} | {r['ours_ms']:.3f} | {r['peer'] or 'none'} | {peer_ms} | {ratio} | "
                     f"{r['floor_ms']:.3f} | {r['ours_ms'] / r['floor_ms']:.1f} |")
    return "\n".join(lines) + "\n"


ALL = [f.name for f in REGISTRY]
