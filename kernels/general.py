"""general kernels (FORMULATIONS.md 5).

    S_t = (exp(gk_t) exp(gv_t)^T) * S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)

q, k, gk [B, T, H, K], v, gv [B, T, H, V]; gk and gv are log gates <= 0 and
either may be None (no decay on that side); the state S [B, H, K, V] is
fp32. Both forms run the shared kernels of ``kernels/_gated.py`` (its
docstring states the algorithm, the numerics and the options).
"""

from __future__ import annotations

import torch

from attnlab.kernels import _gated

OPTIONS = {"chunkwise": dict(_gated.CHUNKWISE_OPTIONS), "recurrent": {}}
SPEED_OPTIONS = {"chunkwise": dict(_gated.SPEED_OPTIONS)}


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor, ...] | None, return_state: bool, **options,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Chunkwise form; its options (chunk_size, precision, block sizes, launch settings) are OPTIONS."""
    return _gated.chunkwise(q, k, v, gk, gv, scale, state, return_state, **options)


def recurrent(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor, ...] | None, return_state: bool, **options,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The literal recurrence, one token at a time."""
    return _gated.recurrent(q, k, v, gk, gv, scale, state, return_state, **options)
