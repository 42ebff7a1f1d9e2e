"""Token selection: greedy, temperature, top-k and top-p (nucleus) filtering.

`sample` returns the chosen token and its log-probability under the distribution it was drawn
from: log_softmax of the temperature-scaled logits restricted to the allowed set (top-k, then
top-p over the renormalised top-k distribution). Greedy (temperature 0) returns the argmax and its
log-softmax at temperature 1 (no filtering).

Per-row variants for batches of requests with their own parameters (continuous batching, sampled
speculation): `filter_rows`, `probs_rows` (the distribution sampled from; one-hot for greedy rows) and
`sample_rows` (one PRNG key per row), with temperature / top_k / top_p as [B] arrays.

`batch_row_keys`: per-row keys that draw, row by row, what one key draws over a whole batch (`sample`'s
key folded over [B, V]): the paged runtime samples `infer.generate`'s batches (and so RL's rollouts) with
them, one row at a time, exactly as a batch draw.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import define_prng_impl, threefry2x32_p

from glm5_jax.fields import require


def validate(temperature: float, top_p: float, top_k: int) -> None:
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    require("top_k", top_k, ValueError, integer=True, min=0, note="(0 = off)")


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


# ----------------------------------------------------------------------------- per-row parameters
def filter_rows(logits, temperature, top_k, top_p):
    """Per-row `filter_logits`: logits [B, V], temperature / top_k / top_p [B] (arrays, so one compiled
    program serves any mix of requests) -> temperature-scaled float32 logits, -inf outside each row's
    allowed set: its top_k largest (0 = all; ties towards the lower id), then the smallest prefix of the
    sorted, renormalised distribution whose mass reaches its top_p (at least one token). Row b equals
    ``filter_logits`` with row b's scalars (tested). Rows with temperature 0 are scaled by 1 (greedy rows
    use the raw argmax; see `probs_rows`)."""
    b, v = logits.shape
    temperature, top_k, top_p = (jnp.broadcast_to(jnp.asarray(a), (b,)) for a in (temperature, top_k, top_p))
    x = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)[:, None]
    order = jnp.argsort(-x, axis=-1, stable=True)
    xs = jnp.take_along_axis(x, order, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    keep = jnp.arange(v)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(keep, xs, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & ((top_p[:, None] >= 1.0) | ((before < top_p[:, None]) & (probs > 0)))
    keep = keep.at[:, 0].set(True)
    mask = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], order].set(keep)
    return jnp.where(mask, x, -jnp.inf)


def probs_rows(logits, temperature, top_k, top_p):
    """The distribution each row samples from, [B, V] float32: softmax of `filter_rows`, or one-hot at the
    argmax for a row with temperature 0 (greedy as the temperature -> 0 limit). Returns (probs,
    log-probs of the same distribution, -inf outside its support)."""
    lf = logits.astype(jnp.float32)
    greedy = (jnp.broadcast_to(jnp.asarray(temperature), lf.shape[:1]) <= 0)[:, None]
    lp = jax.nn.log_softmax(filter_rows(lf, temperature, top_k, top_p), axis=-1)
    onehot = jax.nn.one_hot(jnp.argmax(lf, axis=-1), lf.shape[-1], dtype=bool)
    lp = jnp.where(greedy, jnp.where(onehot, 0.0, -jnp.inf), lp)
    return jnp.exp(lp), lp


def sample_rows(keys, logits, temperature, top_k, top_p):
    """Per-row sampling: keys [B] (one PRNG key per row: a request's output does not depend on its
    batch-mates), logits [B, V], temperature / top_k / top_p [B] -> (tokens int32 [B], log-probs [B] under
    the distribution drawn from, model log-softmax [B, V] at temperature 1). Temperature 0 rows: the argmax,
    with its temperature-1 log-softmax (as `sample` with greedy=True)."""
    lf = logits.astype(jnp.float32)
    model_lp = jax.nn.log_softmax(lf, axis=-1)
    x = filter_rows(lf, temperature, top_k, top_p)
    drawn = jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
    greedy = jnp.broadcast_to(jnp.asarray(temperature), lf.shape[:1]) <= 0
    tok = jnp.where(greedy, jnp.argmax(lf, axis=-1).astype(jnp.int32), drawn)
    lp_samp = jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), tok[:, None], axis=-1)[:, 0]
    lp_model = jnp.take_along_axis(model_lp, tok[:, None], axis=-1)[:, 0]
    return tok, jnp.where(greedy, lp_model, lp_samp), model_lp


# ----------------------------------------------------------------------------- a batch draw, row by row
def _offset_bits(key, bit_width, shape):
    """Random bits of the threefry key (key[0], key[1]) at flat indices key[2:] (hi, lo words) + 0 .. n - 1:
    jax's partitionable threefry (``jax_threefry_partitionable``, the default) gives element j of any draw
    of `shape` the bits of flat index j, so these are elements offset .. offset + n - 1 of a larger draw."""
    n = int(np.prod(shape, dtype=np.int64))
    lo = jax.lax.iota(jnp.uint32, n).reshape(shape) + key[3]
    hi = key[2] + (lo < key[3]).astype(jnp.uint32)          # the carry into the high word
    b1, b2 = threefry2x32_p.bind(key[0], key[1], hi, lo)
    if bit_width == 64:
        return (b1.astype(jnp.uint64) << 32) | b2.astype(jnp.uint64)
    bits = b1 ^ b2
    return bits if bit_width == 32 else bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width])


def _no_derivation(*_):
    raise NotImplementedError("batch_row_keys' keys only draw (no split, fold_in or seed)")


OFFSET_THREEFRY = define_prng_impl(key_shape=(4,), seed=_no_derivation, split=_no_derivation,
                                   random_bits=_offset_bits, fold_in=_no_derivation, name="offset_threefry",
                                   tag="offset_threefry")


def batch_row_keys(keys, rows, width: int):
    """keys [R, 2] (raw threefry keys), rows [R] int -> typed keys [R] such that a draw of shape [width] with
    key r (``jax.random.categorical(k[r], x_r)``, vmapped as `sample_rows` draws) is row rows[r] of the same
    draw over [*, width] with keys[r] (``jax.random.categorical(keys[r], x)[rows[r]]``, `sample`'s batch draw);
    rows[r] < 0: row 0, which is the draw of keys[r] over [width] itself (the row's own key). Exact under
    jax's partitionable threefry (tested), for rows[r] * width < 2 ** 32."""
    keys = jnp.asarray(keys, jnp.uint32)
    off = jnp.maximum(jnp.asarray(rows), 0).astype(jnp.uint32) * jnp.uint32(width)
    data = jnp.stack([keys[:, 0], keys[:, 1], jnp.zeros_like(off), off], axis=-1)
    return jax.random.wrap_key_data(data, impl=OFFSET_THREEFRY)
