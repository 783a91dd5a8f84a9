"""softmax: o_t = sum_{i<=t} exp(scale q_t.k_i) v_i / sum_{i<=t} exp(scale q_t.k_i) (all i when causal=False).

There is no finite state: the recurrent form is the KV-cache loop (one query
at a time over the keys so far), the parallel form the masked T x T
log-sum-exp, the chunkwise form the online softmax over key blocks.
"""

from __future__ import annotations

import math

from attnlab.oracles._chunks import chunk_spans, heads_first


def recurrent(xp, *, q, k, v, scale, causal):
    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    T = q.shape[2]
    outputs = []
    for t in range(T):
        seen = slice(0, t + 1 if causal else T)
        scores = (scale * q[:, :, t, None, :]) @ k[:, :, seen].mT
        weights = xp.exp(scores - xp.amax(scores, axis=-1, keepdims=True))
        outputs.append((weights @ v[:, :, seen])[:, :, 0, :] / xp.sum(weights, axis=-1))
    return xp.stack(outputs, axis=1), None


def parallel(xp, *, q, k, v, scale, causal):
    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    T = q.shape[2]
    scores = (scale * q) @ k.mT
    if causal:
        scores = xp.where(xp.tril_mask(T), scores, -math.inf)
    weights = xp.exp(scores - xp.amax(scores, axis=-1, keepdims=True))
    o = (weights @ v) / xp.sum(weights, axis=-1, keepdims=True)
    return o.swapaxes(1, 2), None


def chunkwise(xp, *, q, k, v, scale, causal, chunk_size):
    q, k, v = heads_first(q), heads_first(k), heads_first(v)
    B, H, T, _ = q.shape
    running_max = xp.full((B, H, T, 1), -math.inf)
    running_sum = xp.zeros((B, H, T, 1))
    acc = xp.zeros((B, H, T, v.shape[-1]))
    for span in chunk_spans(T, chunk_size):
        scores = (scale * q) @ k[:, :, span].mT
        if causal:
            scores = xp.where(xp.tril_mask(T, T, diagonal=0)[:, span], scores, -math.inf)
        new_max = xp.maximum(running_max, xp.amax(scores, axis=-1, keepdims=True))
        # Every query sees key 0 in the first block, so new_max is finite from there on.
        rescale = xp.exp(running_max - new_max)
        weights = xp.exp(scores - new_max)
        running_sum = rescale * running_sum + xp.sum(weights, axis=-1, keepdims=True)
        acc = rescale * acc + weights @ v[:, :, span]
        running_max = new_max
    return (acc / running_sum).swapaxes(1, 2), None
