"""kda: S_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t).

g [B, T, H, K] is a log gate per key channel (it scales the rows of S).
"""

from __future__ import annotations

from attnlab.oracles._chunks import chunkwise as run_chunks
from attnlab.oracles._chunks import delta_chunk, heads_first


def recurrent(xp, *, q, k, v, g, beta, scale, state):
    (S,) = state
    q, k, v, g = heads_first(q), heads_first(k), heads_first(v), heads_first(g)
    beta = beta.swapaxes(1, 2)
    outputs = []
    for t in range(q.shape[2]):
        k_t, v_t, b_t = k[:, :, t, :, None], v[:, :, t, None, :], beta[:, :, t, None, None]
        S = xp.exp(g[:, :, t, :, None]) * S
        S = S - b_t * k_t * (k_t.mT @ S) + b_t * k_t * v_t
        outputs.append(((scale * q[:, :, t, None, :]) @ S)[:, :, 0, :])
    return xp.stack(outputs, axis=1), (S,)


def parallel(xp, *, q, k, v, g, beta, scale, state):
    q, k, v, g = heads_first(q), heads_first(k), heads_first(v), heads_first(g)
    o, S = delta_chunk(xp, q, k, v, beta.swapaxes(1, 2), xp.cumsum(g, axis=2), state[0], scale)
    return o.swapaxes(1, 2), (S,)


def chunkwise(xp, *, q, k, v, g, beta, scale, state, chunk_size):
    q, k, v, g, beta = heads_first(q), heads_first(k), heads_first(v), heads_first(g), beta.swapaxes(1, 2)

    def step(span, carried):
        G = xp.cumsum(g[:, :, span], axis=2)
        o, S = delta_chunk(xp, q[:, :, span], k[:, :, span], v[:, :, span], beta[:, :, span], G, carried[0], scale)
        return o, (S,)

    o, final = run_chunks(xp, q.shape[2], chunk_size, step, tuple(state))
    return o.swapaxes(1, 2), final
