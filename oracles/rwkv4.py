"""rwkv4: o_t = (sum_{i<t} e^{-(t-1-i)w + k_i} v_i + e^{u+k_t} v_t) / (sum_{i<t} e^{-(t-1-i)w + k_i} + e^{u+k_t}).

w, u [C]; k, v [B, T, C]. The state is (a, b, p), each [B, C]: numerator
e^p a and denominator e^p b of everything before the next token, with p
their shared log-scale (p = -inf is the empty state). The initial state is
not decayed before the first token reads it.
"""

from __future__ import annotations

import math

from attnlab.oracles._chunks import chunk_spans


def recurrent(xp, *, w, u, k, v, state, stable=True):
    return (_recurrent_stable if stable else _recurrent_naive)(xp, w, u, k, v, state)


def _recurrent_stable(xp, w, u, k, v, state):
    """Seed 002's loop with a running maximum: every exponent is <= 0."""
    a, b, p = state
    outputs = []
    for t in range(k.shape[1]):
        k_t, v_t = k[:, t], v[:, t]
        top = xp.maximum(p, u + k_t)
        e_state, e_token = xp.exp(p - top), xp.exp(u + k_t - top)
        outputs.append((e_state * a + e_token * v_t) / (e_state * b + e_token))
        top = xp.maximum(p - w, k_t)
        e_state, e_token = xp.exp(p - w - top), xp.exp(k_t - top)
        a, b, p = e_state * a + e_token * v_t, e_state * b + e_token, top
    return xp.stack(outputs, axis=1), (a, b, p)


def _recurrent_naive(xp, w, u, k, v, state):
    """exp(k) accumulated directly: overflows once k passes the format's exp threshold."""
    a, b, p = state
    a, b = xp.exp(p) * a, xp.exp(p) * b
    decay = xp.exp(-w)
    outputs = []
    for t in range(k.shape[1]):
        k_t, v_t = k[:, t], v[:, t]
        bonus = xp.exp(u + k_t)
        outputs.append((a + bonus * v_t) / (b + bonus))
        a, b = decay * a + xp.exp(k_t) * v_t, decay * b + xp.exp(k_t)
    return xp.stack(outputs, axis=1), (a, b, xp.zeros(a.shape))


def _chunk(xp, w, u, k, v, state):
    """A block of tokens at once, log-sum-exp over the block's keys and the carried state.

    Query t (0-based in the block) weighs key i < t by -(t-1-i) w + k_i, itself
    by u + k_t, and the carried state by p - t w.
    """
    a, b, p = state
    c = k.shape[1]
    pos = xp.arange(c)
    lag = pos[:, None] - 1 - pos[None, :]  # [t, i]
    logits = -lag[None, :, :, None] * w + k[:, None, :, :]  # [B, t, i, C]
    eye = xp.tril_mask(c, diagonal=0) & ~xp.tril_mask(c, diagonal=-1)
    logits = xp.where(eye[None, :, :, None], u + k[:, None, :, :], logits)
    logits = xp.where(xp.tril_mask(c)[None, :, :, None], logits, -math.inf)
    state_logit = p[:, None, :] - pos[None, :, None] * w  # [B, t, C]
    top = xp.maximum(xp.amax(logits, axis=2), state_logit)
    weights, e_state = xp.exp(logits - top[:, :, None]), xp.exp(state_logit - top)
    o = (xp.sum(weights * v[:, None], axis=2) + e_state * a[:, None]) / (xp.sum(weights, axis=2) + e_state * b[:, None])

    key_logit = -(c - 1 - pos)[None, :, None] * w + k  # weight of key i after the whole block
    p_end = xp.maximum(xp.amax(key_logit, axis=1), p - c * w)
    e_keys, e_state = xp.exp(key_logit - p_end[:, None]), xp.exp(p - c * w - p_end)
    a_end = xp.sum(e_keys * v, axis=1) + e_state * a
    b_end = xp.sum(e_keys, axis=1) + e_state * b
    return o, (a_end, b_end, p_end)


def parallel(xp, *, w, u, k, v, state):
    return _chunk(xp, w, u, k, v, tuple(state))


def chunkwise(xp, *, w, u, k, v, state, chunk_size):
    outputs = []
    state = tuple(state)
    for span in chunk_spans(k.shape[1], chunk_size):
        o, state = _chunk(xp, w, u, k[:, span], v[:, span], state)
        outputs.append(o)
    return xp.concat(outputs, axis=1), state
