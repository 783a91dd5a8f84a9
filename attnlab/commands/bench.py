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
    """A peer from fla.ops; ``op`` is a function of fla.ops, or ``submodule.function`` for one it doesn't export."""

    def make(x: Inputs) -> Callable[[], Any]:
        import importlib

        module, _, function = f"fla.ops.{op}".rpartition(".")
        fn = getattr(importlib.import_module(module), function)
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
    "rwkv4": Peer("fla fused_recurrent_rwkv4", _fla("rwkv4.fused_recurrent_rwkv4", _rwkv4_fla)),
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


def _timed(call: Callable[[], Any]) -> tuple[float, Any, str | None]:
    """(median ms, the output, None) or (nan, None, the error) when the call fails."""
    import triton.testing

    try:
        out = call()
        return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"), out, None
    except Exception as error:  # one implementation's failure is recorded, the run goes on
        return math.nan, None, f"{type(error).__name__}: {error}"[:300]


def run(names: list[str], *, B: int, T: int, H: int, K: int, V: int, dtype: torch.dtype, form: str = "chunkwise",
        progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Time each formulation's kernel (its default and, if its module offers one, its SPEED_OPTIONS
    setting) and its peer at one shape; one result row per kernel setting."""
    from attnlab.kernel import kernel, speed_options

    bandwidth = measured_bandwidth()
    rows = []
    for name in names:
        f = formulation(name)
        peer = PEERS.get(name)
        x = {n: t.to(device="cuda", dtype=dtype) for n, t in f.sample(B=B, T=T, H=H, K=K, V=V, seed=0).items()}
        inputs = {**x, **(peer.our_options or {})} if peer else x
        peer_ms, _, peer_error = _timed(peer.make(x)) if peer else (math.nan, None, None)
        chosen = form if form in f.kernel_forms else f.kernel_forms[0]
        speed = speed_options(name, chosen)
        for setting, opts in (("default", {}), ("speed", speed)):
            if setting == "speed" and not opts:
                continue
            ours = kernel(name, chosen, **opts)
            ours_ms, out, error = _timed(lambda: ours(**inputs))  # noqa: B023
            row: dict[str, Any] = {
                "formulation": name, "setting": setting, "kernel": repr(ours), "ours_ms": ours_ms,
                "floor_ms": 1e3 * _bytes_moved(x, out) / bandwidth if out is not None else math.nan,
                "peer": peer.label if peer else None, "peer_ms": peer_ms, "ratio": ours_ms / peer_ms,
            }
            if error:
                row["error"] = error
            if peer_error:
                row["peer_error"] = peer_error
            progress(f"{name:15s} {setting:8s} ours {ours_ms:8.3f} ms  peer {peer_ms:8.3f} ms  ratio {row['ratio']:.2f}")
            rows.append(row)
        del x, inputs
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict[str, Any]], header: dict[str, str]) -> str:
    lines = ["# attnlab kernel benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in header.items()]
    lines += ["", "| formulation | kernel | ours (ms) | peer | peer (ms) | ours / peer | memory floor (ms) | ours / floor |",
              "|---|---|---:|---|---:|---:|---:|---:|"]
    def cell(value: float, digits: int, otherwise: str = "n/a") -> str:
        return f"{value:.{digits}f}" if value == value else otherwise

    for r in rows:
        ours = cell(r["ours_ms"], 3, r.get("error", "n/a"))
        lines.append(f"| {r['formulation']} | `{r['kernel']}` | {ours} | {r['peer'] or 'none'} | {cell(r['peer_ms'], 3, r.get('peer_error', 'n/a'))} | "
                     f"{cell(r['ratio'], 2)} | {cell(r['floor_ms'], 3)} | {cell(r['ours_ms'] / r['floor_ms'], 1)} |")
    return "\n".join(lines) + "\n"


ALL = [f.name for f in REGISTRY]
