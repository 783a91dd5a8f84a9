"""gla kernels (FORMULATIONS.md 4).

    S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)

q, k, g [B, T, H, K] (g: log gates <= 0 per key channel), v [B, T, H, V];
the state S [B, H, K, V] is fp32. gla is ``general`` with a key-side gate
only, so both forms run the shared kernels of ``kernels/_gated.py`` (its
docstring states the algorithm, the numerics and the options).
"""

from __future__ import annotations

import torch

from attnlab.kernels import _gated

OPTIONS = {"chunkwise": dict(_gated.CHUNKWISE_OPTIONS), "recurrent": {}}
SPEED_OPTIONS = {"chunkwise": dict(_gated.SPEED_OPTIONS)}


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    state: tuple[torch.Tensor, ...] | None, return_state: bool, **options,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Chunkwise form; its options (chunk_size, precision, block sizes, launch settings) are OPTIONS."""
    return _gated.chunkwise(q, k, v, g, None, scale, state, return_state, **options)


def recurrent(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, scale: float,
    state: tuple[torch.Tensor, ...] | None, return_state: bool, **options,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The literal recurrence, one token at a time."""
    return _gated.recurrent(q, k, v, g, None, scale, state, return_state, **options)
