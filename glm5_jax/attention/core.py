"""Dense causal attention, chunked over queries (never a [T, S] array for long T), with GQA and
document (segment) masking. The dense baseline next to DSA's sparse attention."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.reference import _pick_chunk, visible_mask


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
    tc = _pick_chunk(t, chunk)

    def one_chunk(i):
        t0 = i * tc
        qc = jax.lax.dynamic_slice_in_dim(q, t0, tc, axis=1).reshape(b, tc, hk, g, -1)
        seg_q = None if segment_ids is None else jax.lax.dynamic_slice_in_dim(segment_ids, t0, tc, 1)
        logits = jnp.einsum("btkgd,bskd->bkgts", qc, k).astype(jnp.float32) * scale
        mask = visible_mask(t0, tc, s, t, True, seg_q, segment_ids)     # [B|1, tc, S]
        logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.einsum("bkgts,bskd->btkgd", p, v).reshape(b, tc, h, -1)

    if tc == t:
        return one_chunk(0)
    out = jax.lax.map(one_chunk, jnp.arange(t // tc))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, v.shape[-1])
