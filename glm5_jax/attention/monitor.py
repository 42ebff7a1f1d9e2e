"""Cheap attention-logit monitor: max |q.k| * scale over allowed pairs (QK-clip style checks, logging).

Used by the attention modules (`monitor_logits=True` sows it per layer); it lives beside them, not
with the optimizers.
"""
from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from glm5_jax.utils import pad_to


def max_attention_logit(q: jax.Array, k: jax.Array, scale: float, *, causal: bool = False,
                        q_segment_ids: Optional[jax.Array] = None,
                        kv_segment_ids: Optional[jax.Array] = None,
                        q_positions: Optional[jax.Array] = None,
                        kv_positions: Optional[jax.Array] = None,
                        per_head: bool = False, q_chunk: int = 256,
                        kv_chunk: int = 1024) -> jax.Array:
    """max over (batch, query, key[, head]) of |q . k| * scale, over allowed pairs only.

    q: [B, T, H, D]; k: [B, S, Hk, D] with H % Hk == 0 (GQA: query head h uses kv head
    h // (H // Hk)). Segment ids [B, T] / [B, S]: pairs in different segments are ignored.
    causal: key position <= query position; positions default to q = arange(T) + (S - T),
    k = arange(S) (queries are the last T positions). Returns float32 scalar, or [H] when
    per_head. Work is chunked (q_chunk x kv_chunk logits per step) and under stop_gradient.
    Masked/padded pairs count as 0, so the result is 0 when nothing is allowed.
    """
    q = jax.lax.stop_gradient(q)
    k = jax.lax.stop_gradient(k)
    b, t, h, d = q.shape
    s, hk = k.shape[1], k.shape[2]
    if h % hk:
        raise ValueError(f"query heads {h} not a multiple of key heads {hk}")
    g = h // hk
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(t) + (s - t), (b, t))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    if q_segment_ids is None:
        q_segment_ids = jnp.zeros((b, t), jnp.int32)
    if kv_segment_ids is None:
        kv_segment_ids = jnp.zeros((b, s), jnp.int32)

    qc, kc = min(q_chunk, t), min(kv_chunk, s)
    nq, nk = -(-t // qc), -(-s // kc)
    # padded keys get segment -1 and padded queries segment -2 so they never match anything
    qp = pad_to(q, 1, nq * qc).reshape(b, nq, qc, hk, g, d).astype(jnp.float32)
    kp = pad_to(k, 1, nk * kc).reshape(b, nk, kc, hk, d).astype(jnp.float32)
    qseg = pad_to(q_segment_ids, 1, nq * qc, -2).reshape(b, nq, qc)
    kseg = pad_to(kv_segment_ids, 1, nk * kc, -1).reshape(b, nk, kc)
    qpos = pad_to(q_positions, 1, nq * qc).reshape(b, nq, qc)
    kpos = pad_to(kv_positions, 1, nk * kc).reshape(b, nk, kc)

    def q_body(_, qi):
        qb, qs, qps = qp[:, qi], qseg[:, qi], qpos[:, qi]          # [b,qc,hk,g,d]

        def k_body(acc, ki):
            kb, ks, kps = kp[:, ki], kseg[:, ki], kpos[:, ki]      # [b,kc,hk,d]
            logits = jnp.abs(jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb))
            ok = qs[:, :, None] == ks[:, None, :]                  # [b,qc,kc]
            if causal:
                ok = ok & (kps[:, None, :] <= qps[:, :, None])
            logits = jnp.where(ok[:, None, None], logits, 0.0)
            return jnp.maximum(acc, logits.max(axis=(0, 3, 4))), None   # [hk,g]

        acc, _ = jax.lax.scan(k_body, jnp.zeros((hk, g), jnp.float32), jnp.arange(nk))
        return None, acc

    _, per_chunk = jax.lax.scan(q_body, None, jnp.arange(nq))      # [nq,hk,g]
    heads = per_chunk.max(axis=0).reshape(h) * scale
    return heads if per_head else heads.max()
