"""Token selection: greedy, temperature, top-k and top-p (nucleus) filtering.

`sample` returns the chosen token and its log-probability under the distribution it was drawn
from: log_softmax of the temperature-scaled logits restricted to the allowed set (top-k, then
top-p over the renormalised top-k distribution). Greedy (temperature 0) returns the argmax and its
log-softmax at temperature 1 (no filtering).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def validate(temperature: float, top_p: float, top_k: int) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")


def filter_logits(logits, temperature, *, top_k: int = 0, use_top_p: bool = False, top_p=1.0):
    """logits [B, V] float32 -> temperature-scaled logits with -inf outside the allowed set.

    top_k > 0 keeps exactly the k largest (ties broken towards the lower token id, like
    jax.lax.top_k); top-p then keeps the smallest prefix of the sorted distribution whose mass
    reaches top_p (always at least one token).
    """
    b, v = logits.shape
    x = logits.astype(jnp.float32) / temperature
    rows = jnp.arange(b)[:, None]
    if top_k and top_k < v:
        _, keep_ids = jax.lax.top_k(x, top_k)
        keep = jnp.zeros((b, v), bool).at[rows, keep_ids].set(True)
        x = jnp.where(keep, x, -jnp.inf)
    if use_top_p:
        order = jnp.argsort(-x, axis=-1, stable=True)
        probs = jax.nn.softmax(jnp.take_along_axis(x, order, axis=-1), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs               # mass strictly before each token
        keep_sorted = (before < top_p) & (probs > 0)
        keep_sorted = keep_sorted.at[:, 0].set(True)
        keep = jnp.zeros((b, v), bool).at[rows, order].set(keep_sorted)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def sample(key, logits, *, greedy: bool, temperature=1.0, top_k: int = 0, use_top_p: bool = False, top_p=1.0):
    """logits [B, V] -> (tokens int32 [B], logprobs float32 [B])."""
    logits = logits.astype(jnp.float32)
    if greedy:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        lp = jax.nn.log_softmax(logits, axis=-1)
    else:
        x = filter_logits(logits, temperature, top_k=top_k, use_top_p=use_top_p, top_p=top_p)
        tok = jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
        lp = jax.nn.log_softmax(x, axis=-1)
    return tok, jnp.take_along_axis(lp, tok[:, None], axis=-1)[:, 0]
