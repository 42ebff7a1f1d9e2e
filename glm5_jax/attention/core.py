"""Dense causal attention, chunked over queries (never a [T, S] array for long T), with GQA and
document (segment) masking. The dense baseline next to DSA's sparse attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from glm5_jax.utils import NEG_INF
from pallas_kernels.reference import pick_chunk, visible_mask


def causal_attention(q, k, v, *, scale: float, segment_ids=None, chunk: int = 256):
    """q [B, T, H, D], k [B, S, Hk, D], v [B, S, Hk, Dv] (H % Hk == 0) -> [B, T, H, Dv].

    Causal alignment is bottom-right (query t sees key s iff s <= t + S - T); `segment_ids` [B, T]
    (S == T) keeps attention inside each packed document. Softmax in float32.
    """
    b, t, h, _ = q.shape
    s, hk = k.shape[1], k.shape[2]
    if h % hk:
        raise ValueError(f"query heads {h} must be a multiple of key heads {hk}")
    g = h // hk
    tc = pick_chunk(t, chunk)

    def one_chunk(i):
        t0 = i * tc
        qc = jax.lax.dynamic_slice_in_dim(q, t0, tc, axis=1).reshape(b, tc, hk, g, -1)
        seg_q = None if segment_ids is None else jax.lax.dynamic_slice_in_dim(segment_ids, t0, tc, 1)
        logits = jnp.einsum("btkgd,bskd->bkgts", qc, k).astype(jnp.float32) * scale
        mask = visible_mask(t0, tc, s, t, True, seg_q, segment_ids)     # [B|1, tc, S]
        logits = jnp.where(mask[:, None, None], logits, NEG_INF)
        p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, tc, h, -1)

    if tc == t:
        return one_chunk(0)
    out = jax.lax.map(one_chunk, jnp.arange(t // tc))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, v.shape[-1])


# ----------------------------------------------------------------------------- attention over a cache
def write_cache(buf, wpos, new):
    """buf [B, S, ...] with new [B, T, ...] written at slots wpos [B, T]; wpos < 0 or >= S is dropped."""
    s = buf.shape[1]
    wpos = jnp.where(wpos < 0, s, wpos)
    rows = jnp.arange(buf.shape[0])[:, None]
    return buf.at[rows, wpos].set(new.astype(buf.dtype), mode="drop")


def visible_slots(positions, size: int):
    """[B, T, S] bool: cache slot s is visible from a query at position p iff s <= p (slot == position)."""
    return jnp.arange(size)[None, None, :] <= positions[..., None]


def masked_softmax(logits, mask):
    """Softmax over the last axis where mask; a row with no visible entry gives zeros, never NaN."""
    logits = jnp.where(mask, logits, NEG_INF)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    d = jnp.sum(p, axis=-1, keepdims=True)
    return p / jnp.where(d == 0, 1.0, d)


def cached_attention(q, k, v, positions, *, scale: float):
    """q [B, T, H, D] over a K/V cache k [B, S, Hk, D], v [B, S, Hk, Dv] -> [B, T, H, Dv]; the query
    at position p sees the slots 0..p."""
    b, t, h, d = q.shape
    hk = k.shape[2]
    logits = jnp.einsum("btkgd,bskd->btkgs", q.reshape(b, t, hk, h // hk, d), k).astype(jnp.float32)
    probs = masked_softmax(logits * scale, visible_slots(positions, k.shape[1])[:, :, None, None, :])
    return jnp.einsum("btkgs,bskd->btkgd", probs.astype(v.dtype), v).reshape(b, t, h, v.shape[-1])
