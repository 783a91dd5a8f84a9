"""general: S_t = (exp(gk_t) exp(gv_t)^T) * S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

gk [B, T, H, K] and gv [B, T, H, V] are log gates; either may be None (no
gate on that side). linear_attn (unnormalized, identity map), retnet and gla
are special cases.
"""

from __future__ import annotations

from attnlab.oracles._chunks import chunkwise as run_chunks
from attnlab.oracles._chunks import gated_linear_chunk, heads_first


def recurrent(xp, *, q, k, v, gk, gv, scale, state):
    (S,) = state
    q, k, v, gk, gv = (heads_first(x) for x in (q, k, v, gk, gv))
    outputs = []
    for t in range(q.shape[2]):
        if gk is not None:
            S = xp.exp(gk[:, :, t, :, None]) * S
        if gv is not None:
            S = xp.exp(gv[:, :, t, None, :]) * S
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append(((scale * q[:, :, t, None, :]) @ S)[:, :, 0, :])
    return xp.stack(outputs, axis=1), (S,)


def _cumulative(xp, g, span):
    return None if g is None else xp.cumsum(g[:, :, span], axis=2)


def parallel(xp, *, q, k, v, gk, gv, scale, state):
    q, k, v, gk, gv = (heads_first(x) for x in (q, k, v, gk, gv))
    whole = slice(0, q.shape[2])
    o, S = gated_linear_chunk(xp, q, k, v, _cumulative(xp, gk, whole), _cumulative(xp, gv, whole), state[0], scale)
    return o.swapaxes(1, 2), (S,)


def chunkwise(xp, *, q, k, v, gk, gv, scale, state, chunk_size):
    q, k, v, gk, gv = (heads_first(x) for x in (q, k, v, gk, gv))

    def step(span, carried):
        Gk, Gv = _cumulative(xp, gk, span), _cumulative(xp, gv, span)
        o, S = gated_linear_chunk(xp, q[:, :, span], k[:, :, span], v[:, :, span], Gk, Gv, carried[0], scale)
        return o, (S,)

    o, final = run_chunks(xp, q.shape[2], chunk_size, step, tuple(state))
    return o.swapaxes(1, 2), final
