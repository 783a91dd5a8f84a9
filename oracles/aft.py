"""aft: o_t = sum_{i<=t} exp(w_{t,i} + k_i) * v_i / sum_{i<=t} exp(w_{t,i} + k_i), elementwise over D.

w [T, T] is the pairwise position bias; k, v [B, T, H, D]; causal=False sums
over every i. No finite state: the recurrent form is seed 002's per-token
loop, the parallel form the whole [T, T, D] log-sum-exp, the chunkwise form
the online reduction over key blocks (each block's step through
``xp.recompute``: its [T, block, D] logits are not kept for autograd, which
would hold T^2 D of them per head). Every exponent is shifted by its
running maximum, which changes nothing in exact arithmetic.
"""

from __future__ import annotations

import math

from attnlab.oracles._chunks import chunk_spans, heads_first


def recurrent(xp, *, w, k, v, causal):
    k, v = heads_first(k), heads_first(v)
    T = k.shape[2]
    outputs = []
    for t in range(T):
        seen = slice(0, t + 1 if causal else T)
        logits = w[t, seen][:, None] + k[:, :, seen]
        weights = xp.exp(logits - xp.amax(logits, axis=2, keepdims=True))
        outputs.append(xp.sum(weights * v[:, :, seen], axis=2) / xp.sum(weights, axis=2))
    return xp.stack(outputs, axis=1), None


def _logits(xp, w_block, k_block, causal_mask):
    """[B, H, Tq, Tk, D] logits w_{t,i} + k_i, -inf where a key is masked."""
    logits = w_block[:, :, None] + k_block[:, :, None, :, :]
    if causal_mask is None:
        return logits
    return xp.where(causal_mask[:, :, None], logits, -math.inf)


def parallel(xp, *, w, k, v, causal):
    k, v = heads_first(k), heads_first(v)
    T = k.shape[2]
    logits = _logits(xp, w, k, xp.tril_mask(T) if causal else None)
    weights = xp.exp(logits - xp.amax(logits, axis=3, keepdims=True))
    o = xp.sum(weights * v[:, :, None], axis=3) / xp.sum(weights, axis=3)
    return o.swapaxes(1, 2), None


def chunkwise(xp, *, w, k, v, causal, chunk_size):
    k, v = heads_first(k), heads_first(v)
    B, H, T, D = k.shape
    running_max = xp.full((B, H, T, D), -math.inf)
    running_sum = xp.zeros((B, H, T, D))
    acc = xp.zeros((B, H, T, D))
    mask = xp.tril_mask(T)

    def absorb(running_max, running_sum, acc, w_block, k_block, v_block, mask_block):
        """The online reduction's step over one key block ([B, H, T, block, D] logits: recomputed in the backward)."""
        logits = _logits(xp, w_block, k_block, mask_block)
        new_max = xp.maximum(running_max, xp.amax(logits, axis=3))
        # Every query sees key 0 in the first block, so new_max is finite from there on.
        rescale = xp.exp(running_max - new_max)
        weights = xp.exp(logits - new_max[:, :, :, None])
        return (new_max, rescale * running_sum + xp.sum(weights, axis=3),
                rescale * acc + xp.sum(weights * v_block[:, :, None], axis=3))

    for span in chunk_spans(T, chunk_size):
        running_max, running_sum, acc = xp.recompute(
            absorb, running_max, running_sum, acc, w[:, span], k[:, :, span], v[:, :, span],
            mask[:, span] if causal else None)
    return (acc / running_sum).swapaxes(1, 2), None
