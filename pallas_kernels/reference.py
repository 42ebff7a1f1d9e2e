"""Pure-jnp references for the DSA kernels: the XLA path the model uses on CPU.

Both functions work chunk by chunk over queries, so neither writes a [T, S] array (or a full
gathered [T, K, D] tensor) to memory: peak extra memory is [B, chunk, S] for the indexer and
[B, chunk, K, Hk, D] for the attention.

Conventions shared with the Pallas kernels in `pallas_kernels.dsa`:
  * causal alignment is bottom-right: query t of T sees key s of S iff s <= t + (S - T)
    (prefill S == T; a chunk of queries at the end of a longer key sequence otherwise);
  * optional `segment_ids` ([B, T], needs S == T): a key is visible only inside its document;
  * top-k ties break towards the lower key index (the order of `jax.lax.top_k`);
  * slots past the number of visible keys hold -1; attention rows with no valid index return 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


def _pick_chunk(t: int, target: int) -> int:
    """Largest divisor of t that is <= target (chunks must tile T exactly for lax.map)."""
    c = max(1, min(t, target))
    while t % c:
        c -= 1
    return c


def visible_mask(t0, tc: int, s: int, t_total: int, causal: bool, seg_q=None, seg_k=None):
    """Bool [B or 1, tc, s]: key s visible from query t0 + i (bottom-right causal alignment)."""
    q_pos = t0 + jnp.arange(tc)[:, None] + (s - t_total)
    k_pos = jnp.arange(s)[None, :]
    mask = (k_pos <= q_pos) if causal else jnp.ones((tc, s), bool)
    mask = mask[None]
    if seg_q is not None:
        mask = mask & (seg_q[:, :, None] == seg_k[:, None, :])
    return mask


def index_scores(q_idx, k_idx, weights):
    """I[b, t, s] = sum_j weights[b, t, j] * relu(q_idx[b, t, j] . k_idx[b, s]), in float32.

    Callers fold the softmax scale (Di^-0.5, applied before the ReLU) into q_idx, and the
    head-weight scale (Hi^-0.5) into `weights`.
    """
    dots = jnp.einsum("bthd,bsd->bths", q_idx.astype(jnp.float32), k_idx.astype(jnp.float32))
    return jnp.einsum("bth,bths->bts", weights.astype(jnp.float32), jax.nn.relu(dots))


def indexer_topk(q_idx, k_idx, weights, topk: int, *, causal: bool = True, segment_ids=None,
                 chunk: int = 256):
    """Exact top-k keys per query by the lightning-indexer score.

    q_idx [B, T, Hi, Di], k_idx [B, S, Di], weights [B, T, Hi] -> int32 [B, T, topk].
    """
    b, t, _, _ = q_idx.shape
    s = k_idx.shape[1]
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    if segment_ids is not None and s != t:
        raise ValueError(f"segment_ids needs S == T, got S={s}, T={t}")
    tc = _pick_chunk(t, chunk)
    k_eff = min(topk, s)

    def one_chunk(i):
        t0 = i * tc
        q = jax.lax.dynamic_slice_in_dim(q_idx, t0, tc, axis=1)
        w = jax.lax.dynamic_slice_in_dim(weights, t0, tc, axis=1)
        seg_q = None if segment_ids is None else jax.lax.dynamic_slice_in_dim(segment_ids, t0, tc, 1)
        scores = index_scores(q, k_idx, w)
        mask = visible_mask(t0, tc, s, t, causal, seg_q, segment_ids)
        scores = jnp.where(mask, scores, NEG_INF)
        vals, idx = jax.lax.top_k(scores, k_eff)
        return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)

    out = jax.lax.map(one_chunk, jnp.arange(t // tc))  # [n, B, tc, k]
    out = jnp.moveaxis(out, 0, 1).reshape(b, t, k_eff)
    if k_eff < topk:
        out = jnp.pad(out, ((0, 0), (0, 0), (0, topk - k_eff)), constant_values=-1)
    return out


def sparse_attention(q, k, v, indices, *, scale: float, chunk: int = 128):
    """Attention of each query over its selected keys only.

    q [B, T, H, Dq], k [B, S, Hk, Dq], v [B, S, Hk, Dv] with Hk in {1, H}, indices int32 [B, T, K]
    (-1 = no key) -> [B, T, H, Dv] in q's dtype. Softmax in float32; a row without a valid index
    returns zeros.
    """
    b, t, h, _ = q.shape
    hk = k.shape[2]
    if hk not in (1, h):
        raise ValueError(f"k has {hk} heads; sparse_attention allows 1 or H={h}")
    tc = _pick_chunk(t, chunk)

    def gather(x, idx):  # x [B, S, Hk, D], idx [B, tc, K] -> [B, tc, K, Hk, D]
        return jax.vmap(lambda xb, ib: xb[ib])(x, idx)

    def one_chunk(i):
        t0 = i * tc
        qc = jax.lax.dynamic_slice_in_dim(q, t0, tc, axis=1)
        idx = jax.lax.dynamic_slice_in_dim(indices, t0, tc, axis=1)
        valid = idx >= 0
        safe = jnp.where(valid, idx, 0)
        kc, vc = gather(k, safe), gather(v, safe)
        if hk == 1:
            logits = jnp.einsum("bthd,btkd->bthk", qc, kc[:, :, :, 0])
        else:
            logits = jnp.einsum("bthd,btkhd->bthk", qc, kc)
        logits = logits.astype(jnp.float32) * scale
        logits = jnp.where(valid[:, :, None, :], logits, NEG_INF)
        m = jnp.max(logits, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(logits - m)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom == 0, 1.0, denom)
        p = p.astype(v.dtype)
        if hk == 1:
            return jnp.einsum("bthk,btkd->bthd", p, vc[:, :, :, 0])
        return jnp.einsum("bthk,btkhd->bthd", p, vc)

    # checkpoint: the backward re-gathers K/V per chunk instead of saving the gathered
    # [T, K, Hk, D] tensors of every chunk (identical results, O(T) residual memory)
    out = jax.lax.map(jax.checkpoint(one_chunk), jnp.arange(t // tc))  # [n, B, tc, H, Dv]
    return jnp.moveaxis(out, 0, 1).reshape(b, t, h, v.shape[-1]).astype(q.dtype)
