"""gla: S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t); g [B, T, H, K] log gates."""

from __future__ import annotations

from attnlab.oracles._chunks import chunkwise as run_chunks
from attnlab.oracles._chunks import gated_linear_chunk, heads_first


def recurrent(xp, *, q, k, v, g, scale, state):
    (S,) = state
    q, k, v, g = heads_first(q), heads_first(k), heads_first(v), heads_first(g)
    outputs = []
    for t in range(q.shape[2]):
        S = xp.exp(g[:, :, t, :, None]) * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append(((scale * q[:, :, t, None, :]) @ S)[:, :, 0, :])
    return xp.stack(outputs, axis=1), (S,)


def parallel(xp, *, q, k, v, g, scale, state):
    q, k, v, g = heads_first(q), heads_first(k), heads_first(v), heads_first(g)
    o, S = gated_linear_chunk(xp, q, k, v, xp.cumsum(g, axis=2), None, state[0], scale)
    return o.swapaxes(1, 2), (S,)


def chunkwise(xp, *, q, k, v, g, scale, state, chunk_size):
    q, k, v, g = heads_first(q), heads_first(k), heads_first(v), heads_first(g)

    def step(span, carried):
        G = xp.cumsum(g[:, :, span], axis=2)
        o, S = gated_linear_chunk(xp, q[:, :, span], k[:, :, span], v[:, :, span], G, None, carried[0], scale)
        return o, (S,)

    o, final = run_chunks(xp, q.shape[2], chunk_size, step, tuple(state))
    return o.swapaxes(1, 2), final
