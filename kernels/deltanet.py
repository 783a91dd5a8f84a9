"""DeltaNet kernels (FORMULATIONS.md 8).

    S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t)

q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] in [0, 2]; state S [B, H, K, V]
in fp32. The Triton code (chunkwise UT transform, recurrent loop, the
recurrent form's backward) and the meaning of the options are in
kernels/_delta.py, shared with gated_deltanet; the chunkwise form's backward
is kernels/_delta_chunk_backward.py. Both forms are differentiable (BACKWARD):
gradients of q, k, v, beta and the initial state.
"""

from __future__ import annotations

import torch

from attnlab.kernels import _delta, _delta_chunk_backward

OPTIONS = {"chunkwise": _delta.options(chunkwise=True), "recurrent": _delta.options(chunkwise=False)}


def chunkwise(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float,
              state: tuple[torch.Tensor] | None, return_state: bool, **options) -> tuple[torch.Tensor, tuple | None]:
    return _delta.chunkwise(q=q, k=k, v=v, beta=beta, g=None, scale=scale, state=state,
                            return_state=return_state, **options)


def recurrent(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float,
              state: tuple[torch.Tensor] | None, return_state: bool, **options) -> tuple[torch.Tensor, tuple | None]:
    return _delta.recurrent(q=q, k=k, v=v, beta=beta, g=None, scale=scale, state=state,
                            return_state=return_state, **options)


def recurrent_backward(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float,
                       state: tuple[torch.Tensor] | None, **rest) -> dict:
    return _delta.recurrent_backward(q=q, k=k, v=v, beta=beta, g=None, scale=scale, state=state, **rest)


def chunkwise_backward(*, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, scale: float,
                       state: tuple[torch.Tensor] | None, **rest) -> dict:
    return _delta_chunk_backward.chunkwise_backward(q=q, k=k, v=v, beta=beta, g=None, scale=scale, state=state, **rest)


BACKWARD = {"chunkwise": chunkwise_backward, "recurrent": recurrent_backward}
