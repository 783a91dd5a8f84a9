"""linear_attn: S_t = S_{t-1} + phi(k_t) v_t^T, z_t = z_{t-1} + phi(k_t),
o_t = phi(q_t)^T S_t / phi(q_t)^T z_t (normalize=True) or scale phi(q_t)^T S_t.

The state is the pair (S [B, H, K, V], z [B, H, K]). phi is elu(x)+1
("elu1") or the identity.
"""

from __future__ import annotations

from typing import Any

from attnlab.oracles._chunks import chunkwise as run_chunks
from attnlab.oracles._chunks import gated_linear_chunk, heads_first


def feature(xp: Any, x: Any, feature_map: str) -> Any:
    """phi(x): elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise; or x itself."""
    if feature_map == "identity":
        return x
    return xp.where(x > 0, x + 1, xp.exp(xp.where(x > 0, 0.0, x)))


def _read(numerator: Any, denominator: Any, scale: Any, normalize: bool) -> Any:
    return numerator / denominator if normalize else scale * numerator


def recurrent(xp, *, q, k, v, scale, feature_map, normalize, state):
    S, z = state
    fq, fk, v = (heads_first(feature(xp, q, feature_map)), heads_first(feature(xp, k, feature_map)), heads_first(v))
    outputs = []
    for t in range(q.shape[1]):
        S = S + fk[:, :, t, :, None] * v[:, :, t, None, :]
        z = z + fk[:, :, t, :]
        numerator = (fq[:, :, t, None, :] @ S)[:, :, 0, :]
        denominator = xp.sum(fq[:, :, t, :] * z, axis=-1, keepdims=True)
        outputs.append(_read(numerator, denominator, scale, normalize))
    return xp.stack(outputs, axis=1), (S, z)


def _chunk(xp, fq, fk, v, S, z, scale, normalize):
    """The numerator and the normalizer in one pass: the value gets a column of ones, the state gets z."""
    ones = xp.zeros(v.shape[:-1] + (1,)) + 1
    o_aug, S_aug = gated_linear_chunk(xp, fq, fk, xp.concat([v, ones], axis=-1), None, None, xp.concat([S, z[..., None]], axis=-1), 1)
    o = _read(o_aug[..., :-1], o_aug[..., -1:], scale, normalize)
    return o, S_aug[..., :-1], S_aug[..., -1]


def parallel(xp, *, q, k, v, scale, feature_map, normalize, state):
    S, z = state
    fq, fk = heads_first(feature(xp, q, feature_map)), heads_first(feature(xp, k, feature_map))
    o, S, z = _chunk(xp, fq, fk, heads_first(v), S, z, scale, normalize)
    return o.swapaxes(1, 2), (S, z)


def chunkwise(xp, *, q, k, v, scale, feature_map, normalize, state, chunk_size):
    fq, fk, v = heads_first(feature(xp, q, feature_map)), heads_first(feature(xp, k, feature_map)), heads_first(v)

    def step(span, carried):
        o, S, z = _chunk(xp, fq[:, :, span], fk[:, :, span], v[:, :, span], *carried, scale, normalize)
        return o, (S, z)

    o, final = run_chunks(xp, q.shape[1], chunk_size, step, tuple(state))
    return o.swapaxes(1, 2), final
