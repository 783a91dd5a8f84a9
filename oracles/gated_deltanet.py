"""gated_deltanet: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t).

g [B, T, H] is one log gate per head and token.
"""

from __future__ import annotations

from attnlab.oracles._chunks import chunkwise as run_chunks
from attnlab.oracles._chunks import delta_chunk, heads_first


def recurrent(xp, *, q, k, v, g, beta, scale, state):
    (S,) = state
    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    g, beta = g.swapaxes(1, 2), beta.swapaxes(1, 2)
    outputs = []
    for t in range(q.shape[2]):
        k_t, v_t, b_t = k[:, :, t, :, None], v[:, :, t, None, :], beta[:, :, t, None, None]
        S = xp.exp(g[:, :, t, None, None]) * (S - b_t * k_t * (k_t.mT @ S)) + b_t * k_t * v_t
        outputs.append(((scale * q[:, :, t, None, :]) @ S)[:, :, 0, :])
    return xp.stack(outputs, axis=1), (S,)


def _cumulative(xp, g, span, K):
    """Chunk-local cumulative head gate, broadcast over the K channels: [B, H, C, K]."""
    return xp.cumsum(g[:, :, span], axis=2)[..., None] + xp.zeros((K,))


def parallel(xp, *, q, k, v, g, beta, scale, state):
    q, k, v, g, beta = heads_first(q), heads_first(k), heads_first(v), g.swapaxes(1, 2), beta.swapaxes(1, 2)
    G = _cumulative(xp, g, slice(0, q.shape[2]), q.shape[3])
    o, S = delta_chunk(xp, q, k, v, beta, G, state[0], scale)
    return o.swapaxes(1, 2), (S,)


def chunkwise(xp, *, q, k, v, g, beta, scale, state, chunk_size):
    q, k, v, g, beta = heads_first(q), heads_first(k), heads_first(v), g.swapaxes(1, 2), beta.swapaxes(1, 2)

    def step(span, carried):
        G = _cumulative(xp, g, span, q.shape[3])
        o, S = delta_chunk(xp, q[:, :, span], k[:, :, span], v[:, :, span], beta[:, :, span], G, carried[0], scale)
        return o, (S,)

    o, final = run_chunks(xp, q.shape[2], chunk_size, step, tuple(state))
    return o.swapaxes(1, 2), final
