"""The DSA lightning indexer, its exact token top-k, and the indexer training losses.

Score I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s] * Di^-0.5) with w = weights_proj(x) * Hi^-0.5,
q_I = wq_b(q_latent), k_I = LayerNorm(wk(x)); interleaved RoPE on the first qk_rope dims of both.
The Di^-0.5 scale is folded into q_I (exact: ReLU(c z) = c ReLU(z) for c > 0).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.attention.core import row_major, visible_slots
from glm5_jax.utils import NEG_INF
from glm5_jax.layers.common import Dense, LayerNorm, dtype_of
from glm5_jax.layers.rope import apply_rope
from pallas_kernels import dsa_xla as ref


class Indexer(nn.Module):
    cfg: "ModelConfig"  # noqa: F821
    cached: bool = False      # over a cache (decode / prefill): wq_b's output in row-major layout (core.row_major)

    @nn.compact
    def __call__(self, x, q_latent, cos, sin):
        """x [B, T, D] (attention input), q_latent [B, T, q_lora] ->
        (q_idx [B, T, Hi, Di] pre-scaled, k_idx [B, T, Di], weights [B, T, Hi] float32)."""
        c = self.cfg
        b, t, _ = x.shape
        hi, di, r = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim
        kw = dict(stddev=c.initializer_range, dtype=dtype_of(c.dtype), param_dtype=dtype_of(c.param_dtype))
        q = Dense(hi * di, ("q_lora", "index_heads"), name="wq_b", **kw)(q_latent)
        q = (row_major(q, ("activation_batch", "activation_seq", None)) if self.cached else q).reshape(b, t, hi, di)
        k = LayerNorm(1e-6, dtype_of(c.param_dtype), name="k_norm")(Dense(di, ("embed", "index_dim"), name="wk", **kw)(x))
        q = jnp.concatenate([apply_rope(q[..., :r], cos, sin), q[..., r:]], axis=-1)
        k = jnp.concatenate([apply_rope(k[..., :r], cos, sin), k[..., r:]], axis=-1)
        # weights_proj stays float32 (the reference keeps it in fp32).
        w = Dense(hi, ("embed", "index_heads_w"), name="weights_proj", stddev=c.initializer_range,
                  dtype=jnp.float32, param_dtype=jnp.float32)(x.astype(jnp.float32))
        return q * (di ** -0.5), k, w * (hi ** -0.5)


def select_topk_cached(q_idx, k_cache, weights, topk: int, positions, page: int = 0):
    """DSA's selection over an indexer-key cache k_cache [B, S, Di] for queries at positions [B, T] (slots
    0..p visible) -> int32 [B, T, min(topk, S)] slots, -1 where fewer keys are visible.

    page=0 (ModelConfig.dsa_decode_pages, the default): the exact top-k, ties to the lower slot, as in
    training. page=P > 0: page-level selection: the slots are scored in pages of P (slot s in page s // P;
    a page's score is its best visible slot's), the best min(topk, S) // P pages are kept, and their visible
    slots are the selection, page by page in score order (a page's invisible slots and unfilled pages -1).
    The attention then reads whole pages of P contiguous rows (a DMA-friendly gather at long context, where
    token gathers were the cost in sglang-jax's DSA decode), at the price of recall against the exact top-k
    (docs/inference.md, "Cache layout and DSA decode": measured by tools.dsa_page_recall)."""
    s = k_cache.shape[1]
    visible = visible_slots(positions, s)
    scores = jnp.where(visible, ref.index_scores(q_idx, k_cache, weights), NEG_INF)
    if not page or s <= topk:     # S <= topk: every visible slot is selected, pages or not
        vals, idx = jax.lax.top_k(scores, min(topk, s))
        return jnp.where(vals == NEG_INF, -1, idx).astype(jnp.int32)
    if topk % page:
        raise ValueError(f"page-level selection needs the page size ({page}) to divide index_topk ({topk})")
    n_pages = -(-s // page)
    padded = jnp.pad(scores, ((0, 0), (0, 0), (0, n_pages * page - s)), constant_values=NEG_INF)
    page_scores = jnp.max(padded.reshape(*scores.shape[:2], n_pages, page), axis=-1)
    vals, pages = jax.lax.top_k(page_scores, topk // page)                      # S > topk: enough pages
    slots = pages[..., None] * page + jnp.arange(page)                          # [B, T, topk // P, P]
    ok = (vals[..., None] > NEG_INF) & (slots <= positions[..., None, None]) & (slots < s)
    return jnp.where(ok, slots, -1).reshape(*scores.shape[:2], topk).astype(jnp.int32)


def _kl(p, log_q, valid):
    """sum_s p (log p - log q) over valid entries; p already normalised."""
    terms = jnp.where(valid & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0)
    return jnp.sum(terms, axis=-1)


def indexer_kl_dense(q, k, scale, q_idx, k_idx, weights, *, topk: int, segment_ids=None, chunk: int = 256,
                     q_offset=None, kv_segment_ids=None):
    """Dense warm-up loss: KL(p_t || softmax(I_t)) over all visible keys, mean over queries, where
    p_t is the main attention distribution summed over heads and L1-normalised (a fixed target).
    Also returns the indexer's recall of the true top-k keys of p_t.

    q [B, T, H, Dq], k [B, S, H, Dq] (main attention, expanded), q_idx/k_idx/weights as kernels.indexer_topk
    (q_offset / kv_segment_ids likewise: queries at global positions q_offset.. of the S keys).
    """
    b, t = q.shape[:2]
    s = k.shape[1]
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    tc = ref.pick_chunk(t, chunk)
    kk = min(topk, s)

    def one_chunk(i):
        t0 = i * tc
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, t0, tc, axis=1)
        seg_q = None if segment_ids is None else sl(segment_ids)
        mask = ref.visible_mask(t0, tc, s, t, True, seg_q, kv_seg, q_offset=q_offset)
        logits = jnp.einsum("bthd,bshd->bhts", sl(q), k).astype(jnp.float32) * scale
        probs = jax.nn.softmax(jnp.where(mask[:, None], logits, NEG_INF), axis=-1)
        p = jnp.sum(probs, axis=1)
        p = jax.lax.stop_gradient(p / jnp.sum(p, axis=-1, keepdims=True))
        scores = jnp.where(mask, ref.index_scores(sl(q_idx), k_idx, sl(weights)), NEG_INF)
        log_q = jax.nn.log_softmax(scores, axis=-1)
        kl = _kl(p, log_q, mask)
        # recall: fraction of the true top-k (by p) that the indexer's top-k also holds
        _, true_top = jax.lax.top_k(jnp.where(mask, p, -1.0), kk)
        _, idx_top = jax.lax.top_k(jax.lax.stop_gradient(scores), kk)
        n_vis = jnp.minimum(jnp.sum(mask, axis=-1), kk)                       # [B, tc]
        slot_ok = jnp.arange(kk) < n_vis[..., None]
        hit = jnp.any(true_top[..., :, None] == jnp.where(slot_ok, idx_top, -2)[..., None, :], axis=-1)
        recall = jnp.sum(hit & slot_ok, axis=-1) / n_vis
        return kl, recall

    kl, recall = jax.lax.map(one_chunk, jnp.arange(t // tc))
    return jnp.mean(kl), jnp.mean(recall)


def indexer_kl_sparse(q, k, scale, q_idx, k_idx, weights, indices, *, chunk: int = 256):
    """Sparse-stage loss: the same KL restricted to each query's selected keys `indices` [B, T, K].

    q [B, T, H, Dq], k [B, S, Hk, Dq] with Hk = H (expanded heads) or Hk = 1 (MLA's MQA form, as
    DSA's sparse attention runs it: one gathered row per selected key serves every head)."""
    b, t, h = q.shape[:3]
    hk = k.shape[2]
    if hk not in (1, h):
        raise ValueError(f"k has {hk} heads; indexer_kl_sparse allows 1 or H={h}")
    tc = ref.pick_chunk(t, chunk)
    gather = jax.vmap(lambda xb, ib: xb[ib])
    if hk == 1:
        k = k[:, :, 0]

    def one_chunk(i):
        t0 = i * tc
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, t0, tc, axis=1)
        idx = sl(indices)
        valid = idx >= 0
        safe = jnp.where(valid, idx, 0)
        kc = gather(k, safe)                                            # [B, tc, K, (H,) D]
        spec = "bthd,btkd->bhtk" if hk == 1 else "bthd,btkhd->bhtk"
        logits = jnp.einsum(spec, sl(q), kc).astype(jnp.float32) * scale
        probs = jax.nn.softmax(jnp.where(valid[:, None], logits, NEG_INF), axis=-1)
        p = jnp.sum(probs, axis=1)
        p = jax.lax.stop_gradient(p / jnp.sum(p, axis=-1, keepdims=True))
        ki = gather(k_idx, safe)                                                # [B, tc, K, Di]
        dots = jax.nn.relu(jnp.einsum("bthd,btkd->bthk", sl(q_idx).astype(jnp.float32), ki.astype(jnp.float32)))
        scores = jnp.einsum("bth,bthk->btk", sl(weights), dots)
        log_q = jax.nn.log_softmax(jnp.where(valid, scores, NEG_INF), axis=-1)
        return _kl(p, log_q, valid)

    return jnp.mean(jax.lax.map(one_chunk, jnp.arange(t // tc)))


def _head_mean_probs(q, k, scale, mask):
    """The main attention's dense softmax averaged over heads, [B, tc, S] float32 (rows sum to 1 over the
    visible keys, 0 elsewhere). q [B, tc, H, D], k [B, S, Hk, D] with Hk in {1, H} (the MQA form's one
    shared row per key, or expanded heads); mask [B or 1, tc, S]."""
    h, hk = q.shape[2], k.shape[2]
    if hk not in (1, h):
        raise ValueError(f"k has {hk} heads; allowed 1 (MQA form) or H={h}")
    logits = (jnp.einsum("bthd,bsd->bhts", q, k[:, :, 0]) if hk == 1
              else jnp.einsum("bthd,bshd->bhts", q, k)).astype(jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], logits, NEG_INF), axis=-1)
    return jnp.where(mask, jnp.mean(probs, axis=1), 0.0)


def _top_visible(p, mask, kk: int):
    """Exact top-kk keys of p [B, tc, S] among the visible ones (ties to the lower key), -1 past the visible
    count -> (indices int32 [B, tc, kk], n_valid [B, tc])."""
    _, idx = jax.lax.top_k(jnp.where(mask, p, -1.0), kk)
    n_vis = jnp.minimum(jnp.sum(mask, axis=-1), kk)
    return jnp.where(jnp.arange(kk) < n_vis[..., None], idx, -1).astype(jnp.int32), n_vis


def _query_chunks(q, k, segment_ids, chunk, q_offset, kv_segment_ids, one):
    """Run one(t0, tc, q chunk, mask) over query chunks of T and concatenate along T."""
    b, t = q.shape[:2]
    s = k.shape[1]
    kv_seg = segment_ids if kv_segment_ids is None else kv_segment_ids
    tc = ref.pick_chunk(t, chunk)

    def body(i):
        t0 = i * tc
        sl = lambda a: jax.lax.dynamic_slice_in_dim(a, t0, tc, axis=1)
        seg_q = None if segment_ids is None else sl(segment_ids)
        mask = ref.visible_mask(t0, tc, s, t, True, seg_q, kv_seg, q_offset=q_offset)
        mask = jnp.broadcast_to(mask, (b, tc, s))
        return one(sl(q), mask, i, tc)

    outs = jax.lax.map(body, jnp.arange(t // tc))
    return jax.tree.map(lambda x: jnp.moveaxis(x, 0, 1).reshape(b, t, *x.shape[3:]), outs)


def oracle_topk(q, k, scale, topk: int, *, segment_ids=None, chunk: int = 256, q_offset=None, kv_segment_ids=None):
    """The oracle selection (ModelConfig.dsa_topk_source="oracle"): per query, the exact top-k keys of the
    main attention's own dense softmax averaged over heads -- one key set shared by every head, as DSA's
    MQA form shares the indexer's -- which is the k-set holding the most head-averaged attention mass any
    k keys can hold. Causal, inside each packed document; ties to the lower key (lax.top_k).

    q [B, T, H, D], k [B, S, Hk, D] (Hk = 1: MLA's MQA form; Hk = H: expanded), the attention's own scale;
    q_offset / kv_segment_ids as kernels.indexer_topk -> int32 [B, T, topk], -1 where fewer keys are
    visible (the indexer top-k's layout: the same sparse-attention kernels consume it). No gradient."""
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    s = k.shape[1]
    kk = min(topk, s)

    def one(qc, mask, i, tc):
        return _top_visible(_head_mean_probs(qc, k, scale, mask), mask, kk)[0]

    out = _query_chunks(q, k, segment_ids, chunk, q_offset, kv_segment_ids, one)
    if kk < topk:
        out = jnp.pad(out, ((0, 0), (0, 0), (0, topk - kk)), constant_values=-1)
    return out


def selection_stats(q, k, scale, indices, *, segment_ids=None, chunk: int = 256, q_offset=None,
                    kv_segment_ids=None):
    """How much of the dense attention a selection keeps, per query: (selected_mass, oracle_mass, recall),
    each float32 [B, T]. selected_mass: the head-averaged dense softmax mass on the keys `indices`
    [B, T, K] (-1 = none; distinct keys); oracle_mass: the same on the oracle's K keys (`oracle_topk`,
    the most any K keys shared by the heads can hold); recall: the fraction of the oracle's keys the
    selection holds (over min(K, visible keys)). q / k / scale as `oracle_topk`."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    s, kk = k.shape[1], indices.shape[-1]
    ke = min(kk, s)

    def one(qc, mask, i, tc):
        p = _head_mean_probs(qc, k, scale, mask)
        idx = jax.lax.dynamic_slice_in_dim(indices, i * tc, tc, axis=1)
        valid = idx >= 0
        sel = jnp.sum(jnp.where(valid, jnp.take_along_axis(p, jnp.where(valid, idx, 0), axis=-1), 0.0), axis=-1)
        top, n = _top_visible(p, mask, ke)
        orc = jnp.sum(jnp.where(top >= 0, jnp.take_along_axis(p, jnp.maximum(top, 0), axis=-1), 0.0), axis=-1)
        hit = jnp.any((top[..., :, None] == jnp.where(valid, idx, -2)[..., None, :]) & (top >= 0)[..., None], axis=-1)
        return sel, orc, jnp.sum(hit, axis=-1) / jnp.maximum(n, 1)

    return _query_chunks(q, k, segment_ids, chunk, q_offset, kv_segment_ids, one)
