"""retnet: S_t = exp(g) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t); g [H] is log gamma per head."""

from __future__ import annotations

from attnlab.oracles._chunks import chunkwise as run_chunks
from attnlab.oracles._chunks import gated_linear_chunk, heads_first


def recurrent(xp, *, q, k, v, g, scale, state):
    (S,) = state
    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    gamma = xp.exp(g)[None, :, None, None]
    outputs = []
    for t in range(q.shape[2]):
        S = gamma * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append(((scale * q[:, :, t, None, :]) @ S)[:, :, 0, :])
    return xp.stack(outputs, axis=1), (S,)


def _cumulative_gate(xp, g, q):
    """Chunk-local G_t = (t + 1) g per head, broadcast over K: [1, H, C, K]."""
    C, K = q.shape[2], q.shape[3]
    steps = (xp.arange(C) + 1)[:, None] + xp.zeros((K,))
    return g[None, :, None, None] * steps[None, None]


def parallel(xp, *, q, k, v, g, scale, state):
    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    o, S = gated_linear_chunk(xp, q, k, v, _cumulative_gate(xp, g, q), None, state[0], scale)
    return o.swapaxes(1, 2), (S,)


def chunkwise(xp, *, q, k, v, g, scale, state, chunk_size):
    q, k, v = heads_first(q), heads_first(k), heads_first(v)

    def step(span, carried):
        qc = q[:, :, span]
        o, S = gated_linear_chunk(xp, qc, k[:, :, span], v[:, :, span], _cumulative_gate(xp, g, qc), None, carried[0], scale)
        return o, (S,)

    o, final = run_chunks(xp, q.shape[2], chunk_size, step, tuple(state))
    return o.swapaxes(1, 2), final
