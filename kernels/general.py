"""general kernels (FORMULATIONS.md 5).

    S_t = (exp(gk_t) exp(gv_t)^T) * S_{t-1} + k_t v_t^T,   o_t = S_t^T (scale q_t)

q, k, gk [B, T, H, K], v, gv [B, T, H, V]; gk and gv are log gates <= 0 and
either may be None (no decay on that side); the state S [B, H, K, V] is
fp32. Both forms run the shared kernels of ``kernels/_gated.py`` (its
docstring states the algorithm, the numerics and the options).

Both forms are differentiable (``BACKWARD``): every input's gradient, the
gates' included, and the initial state's; the backward's math, what the
forward saves (the recurrent form: a state checkpoint every 64 steps; the
chunkwise form: nothing) and what it recomputes are in ``kernels/_gated.py``'s
docstring, "Backward".
"""

from __future__ import annotations

import torch

from attnlab.kernels import _gated

OPTIONS = {"chunkwise": dict(_gated.CHUNKWISE_OPTIONS), "recurrent": {}}
SPEED_OPTIONS = {"chunkwise": dict(_gated.SPEED_OPTIONS)}


def chunkwise(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor, ...] | None, return_state: bool,
    saved: dict[str, torch.Tensor] | None = None, **options,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """Chunkwise form; its options (chunk_size, precision, block sizes, launch settings) are OPTIONS."""
    return _gated.chunkwise(q, k, v, gk, gv, scale, state, return_state, saved=saved, **options)


def recurrent(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor, ...] | None, return_state: bool,
    saved: dict[str, torch.Tensor] | None = None, **options,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The literal recurrence, one token at a time."""
    return _gated.recurrent(q, k, v, gk, gv, scale, state, return_state, saved=saved, **options)


def _returned(r: dict, state: tuple[torch.Tensor, ...] | None) -> dict:
    """The shared backward's gradients under this formulation's names."""
    grads = {n: r[n] for n in ("q", "k", "v", "gk", "gv") if r[n] is not None}
    if state is not None:
        grads["initial_state"] = r["initial_state"]
    return grads


def chunkwise_backward(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor, ...] | None, do: torch.Tensor,
    d_state: tuple[torch.Tensor, ...] | None, saved: dict[str, torch.Tensor], **keywords,
) -> dict:
    """Gradients of the chunkwise form (kernels/_gated.py, "Backward") under the forward's options; o is not
    needed."""
    r = _gated.chunkwise_backward(q, k, v, gk, gv, scale, state, do, d_state, saved=saved,
                                  **_gated.chunkwise_options(keywords))
    return _returned(r, state)


def recurrent_backward(
    *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor | None, gv: torch.Tensor | None,
    scale: float, state: tuple[torch.Tensor, ...] | None, do: torch.Tensor,
    d_state: tuple[torch.Tensor, ...] | None, saved: dict[str, torch.Tensor], **ignored,
) -> dict:
    """Gradients of the recurrent form (kernels/_gated.py, "Backward"): saved holds the forward's
    checkpoints; o is not needed."""
    return _returned(_gated.recurrent_backward(q, k, v, gk, gv, scale, state, do, d_state, saved), state)


BACKWARD = {"chunkwise": chunkwise_backward, "recurrent": recurrent_backward}
