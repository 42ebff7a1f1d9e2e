"""Multi-head latent attention (MLA), and DSA = MLA over the keys the lightning indexer selects.

q = q_b(RMSNorm(q_a(x))) -> per head [nope ; rope]; [latent ; k_rope] = kv_a(x);
[k_nope ; v] = kv_b(RMSNorm(latent)) per head; the rope key is shared by all heads.

Two forms of the same attention (docs/model.md "MLA forms"):
  * expanded: k_nope / v per head from kv_b, H heads of (dn + dr) / dv -- plain MLA and DSA's dense
    warm-up stage (dense attention is cheapest per (query, key) pair this way);
  * MQA (absorbed): with kv_b = [W_UK | W_UV], q_nope . k_nope = (q_nope W_UK^T) . latent and
    sum_s p_s v_s = (sum_s p_s latent_s) W_UV, so every head attends one shared
    [latent | k_rope] row per token (Hk = 1, kv_lora + dr wide) with the latent as value -- DSA's
    sparse stage (`dsa_attention` in training and the cache-free forward; over a decode cache, whose
    "kv" buffer holds exactly those rows, `cached_mla_attention`): top-k gathers one row per selected
    token for all heads.
"""

from __future__ import annotations

import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from glm5_jax.attention.context import context_size, over_context
from glm5_jax.attention.core import LayerCache, causal_attention, masked_softmax, row_major, visible_slots
from glm5_jax.attention.indexer import (Indexer, indexer_kl_dense, indexer_kl_sparse, oracle_topk, select_topk_cached,
                                        selection_stats)
from glm5_jax.attention.kernels import indexer_topk, mqa_sparse_attention
from glm5_jax.attention.monitor import max_attention_logit
from glm5_jax.layers.common import Dense, RMSNorm, constrain, dtype_of
from glm5_jax.layers.rope import apply_rope, softmax_scale
from pallas_kernels.dense import topk_key_mask
from pallas_kernels import dsa_xla as ref
from pallas_kernels.dsa_xla import LSE_NAME

# checkpoint names (ModelConfig.remat policies, glm5_jax.model.REMAT): the query heads after RoPE, the
# kv_a projection (latent + rope key), the attention output before o_proj, and DSA's top-k indices (int32
# [B, T, K]: saved, the backward's recompute skips the indexer, whose scores have no gradient without an
# indexer loss)
ATTN_Q, ATTN_KV, ATTN_CONTEXT, ATTN_TOPK = "attn_q", "attn_kv", "attn_context", "attn_topk"
# and the sparse attention's log-sum-exp [B, T, H] float32 (pallas_kernels.dsa_xla.sparse_mqa_uv): kept with
# attn_context, the backward does not run the sparse attention's forward again
ATTN_LSE = LSE_NAME


class MLAttention(nn.Module):
    cfg: "ModelConfig"  # noqa: F821
    indexer_type: str | None = None   # None (plain MLA) | full | shared

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids=None, prev_indices=None, indexer_loss=None,
                 monitor_logits: bool = False, *, positions=None, cache=None, write_positions=None):
        """x [B, T, D] -> (out [B, T, D], top-k indices [B, T, K] or None, new cache or None).

        With `cache` (a `LayerCache`, or an MTP depth's {"kv" [B, S, W], + "k_idx" [B, S, Di] on full indexer
        layers}: glm5_jax.infer.cache) this call's [latent | rope key] row and indexer key are written at
        write_positions (default positions) and attention runs in the absorbed form over the cache; the
        cache comes back in the form it came in.
        """
        c = self.cfg
        b, t, d = x.shape
        h, dn, dr, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        kw = dict(stddev=c.initializer_range, dtype=dtype_of(c.dtype), param_dtype=dtype_of(c.param_dtype))
        norm = lambda name: RMSNorm(1e-6, dtype_of(c.param_dtype), name=name)

        q_latent = norm("q_a_norm")(Dense(c.q_lora_rank, ("embed", "q_lora"), name="q_a_proj", **kw)(x))
        q = Dense(h * (dn + dr), ("q_lora", "heads"), name="q_b_proj", **kw)(q_latent)
        q = (q if cache is None else row_major(q, ("activation_batch", "activation_seq", "activation_heads"))
             ).reshape(b, t, h, dn + dr)
        q = jnp.concatenate([q[..., :dn], apply_rope(q[..., dn:], cos, sin)], axis=-1)
        q = checkpoint_name(constrain(q, ("activation_batch", "activation_seq", "activation_heads", None)), ATTN_Q)

        kv = checkpoint_name(Dense(c.kv_lora_rank + dr, ("embed", "kv_lora"), name="kv_a_proj", **kw)(x), ATTN_KV)
        latent = norm("kv_a_norm")(kv[..., :c.kv_lora_rank])
        k_rope = apply_rope(kv[..., c.kv_lora_rank:], cos, sin)                       # [B, T, dr]
        kv_b = Dense(h * (dn + dv), ("kv_lora", "heads"), name="kv_b_proj", **kw)
        o_proj = Dense(d, ("heads", "embed"), name="o_proj", **kw)
        scale = softmax_scale(dn + dr, c.rope_scaling_dict)     # x YaRN mscale^2 (layers.rope)
        if cache is not None:
            return self._cached(x, q, q_latent, latent, k_rope, kv_b, o_proj, cos, sin, prev_indices, positions,
                                positions if write_positions is None else write_positions, cache, scale)

        sparse = self.indexer_type is not None and indexer_loss != "dense"
        n_ctx = 1 if self.is_initializing() else context_size()   # init: the forward is dead code
        cp = n_ctx > 1
        short = sparse and not cp and short_sequence_dense(c, t)
        if sparse and not short:   # DSA's sparse stage: MQA form, K/V never expanded per head
            if self.is_initializing():   # create kv_b's kernel (its parameter path) without using it
                kv_b(latent[:, :1])
            w_uk, w_uv = self._kv_b_weights(kv_b)
            q_att, k_att, _ = mqa_operands(q[..., :dn], q[..., dn:], latent, k_rope, w_uk)
            q_att = constrain(q_att, ("activation_batch", "activation_seq", "activation_heads", None))
            v_att = None
        else:        # plain MLA, DSA's dense warm-up, and its sparse stage at short T on CPU: expanded per head
            kvb = kv_b(latent).reshape(b, t, h, dn + dv)
            k_att = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(k_rope[:, :, None], (b, t, h, dr))], axis=-1)
            v_att = kvb[..., dn:]
            k_att = constrain(k_att, ("activation_batch", "activation_seq", "activation_heads", None))
            q_att = q
        if indexer_loss not in (None, "dense", "sparse"):
            raise ValueError(f"indexer_loss={indexer_loss!r}; allowed: None, 'dense', 'sparse'")

        local, keys = {"q": q_att, "seg": segment_ids}, {"k": k_att, "v": v_att, "seg": segment_ids}
        full_kl = self.indexer_type == "full" and indexer_loss is not None
        if self.indexer_type == "full":
            # The indexer never trains through the LM loss: its input is detached; it learns from
            # its KL to the main attention (a fixed target: q/k detached).
            idx_in = (jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent))
            q_idx, k_idx, w = Indexer(c, name="indexer")(*idx_in, cos, sin)
            if full_kl:
                local.update(q_idx=q_idx, w=w)
                keys["k_idx"] = k_idx
            if c.dsa_topk_source == "indexer":
                local["indices"] = self._select(q_idx, k_idx, w, segment_ids, n_ctx)
        elif self.indexer_type == "shared":
            local["indices"] = self._shared(prev_indices)
        stats = bool(self.indexer_type) and c.dsa_selection_stats
        reduce = (("token",) + (("token",) if self.indexer_type else ()) + (("mean",) if full_kl else ())
                  + (("mean",) if full_kl and indexer_loss == "dense" else ()) + (("max",) if monitor_logits else ())
                  + (("token",) * 3 if stats else ()))

        def attend(loc, kv, q_offset, consts):
            """One shard of queries (at global positions q_offset.., None: all T) over all keys."""
            w_uv = consts.get("w_uv")
            qa, ka, seg_q, seg_k = loc["q"], kv["k"], loc["seg"], kv["seg"]
            tq = qa.shape[1]
            at = dict(q_offset=q_offset, kv_segment_ids=None if q_offset is None else seg_k)
            outs = []
            indices = loc.get("indices")
            if self.indexer_type == "full" and c.dsa_topk_source == "oracle":   # the main attention's own top-k
                indices = oracle_topk(qa, ka, scale, c.index_topk, segment_ids=seg_q, chunk=c.attn_chunk, **at)
            if not sparse or short:   # short: the same top-k set, as a dense mask over the T x T pairs
                key_mask = topk_key_mask(indices, tq) if short else None
                out = causal_attention(qa, ka, kv["v"], scale=scale, segment_ids=seg_q, chunk=c.attn_chunk,
                                       key_mask=key_mask, **at)
            else:   # value = the latent, the first kv_lora columns of each key row; then W_UV
                out = mqa_sparse_attention(qa, ka, w_uv, indices, scale=scale, impl=c.attention_impl,
                                           chunk=min(c.attn_chunk, 16))
            outs.append(out)
            if self.indexer_type:
                outs.append(indices)
            if full_kl:
                q_t, k_t = jax.lax.stop_gradient(qa), jax.lax.stop_gradient(ka)
                if indexer_loss == "dense":
                    outs += indexer_kl_dense(q_t, k_t, scale, loc["q_idx"], kv["k_idx"], loc["w"], topk=c.index_topk,
                                             segment_ids=seg_q, chunk=c.attn_chunk, **at)
                else:
                    outs.append(indexer_kl_sparse(q_t, k_t, scale, loc["q_idx"], kv["k_idx"], loc["w"], indices,
                                                  chunk=c.attn_chunk))
            if monitor_logits:   # dense max |q.k| * scale over visible keys (also for DSA: not only the top-k)
                q_pos = None if q_offset is None else jnp.broadcast_to(q_offset + jnp.arange(tq), qa.shape[:2])
                outs.append(max_attention_logit(qa, ka, scale, causal=True, q_segment_ids=seg_q,
                                                kv_segment_ids=seg_k, q_positions=q_pos, q_chunk=c.attn_chunk))
            if stats:   # the dense attention's mass on the selected keys and on the oracle's (selection_stats)
                outs += selection_stats(qa, ka, scale, indices, segment_ids=seg_q, chunk=c.attn_chunk, **at)
            return tuple(outs)

        consts = {"w_uv": w_uv} if sparse and not short else {}
        res = list(over_context(attend, local, keys, reduce, n=n_ctx, consts=consts))
        out = res.pop(0)
        indices = res.pop(0) if self.indexer_type else None
        if full_kl:
            self.sow("intermediates", "indexer_kl", res.pop(0))
            if indexer_loss == "dense":
                self.sow("intermediates", "indexer_recall", res.pop(0))
        if monitor_logits:
            self.sow("intermediates", "max_attn_logit", res.pop(0))
        if stats:
            for name in ("selected_mass", "oracle_mass", "oracle_recall"):
                self.sow("intermediates", name, res.pop(0))
        return o_proj(checkpoint_name(out.reshape(b, t, h * dv), ATTN_CONTEXT)), indices, None

    def _select(self, q_idx, k_idx, w, segment_ids, n_ctx):
        """DSA's top-k: the indexer's exact top-k keys of every query, int32 [B, T, K], named ATTN_TOPK so
        a remat policy can keep it (its own `over_context` call, apart from the attention: the backward's
        recompute of the attention then does not run the indexer again). Under context parallelism each
        local chunk scores only the static key prefix its queries can see (`key_prefix`)."""
        c = self.cfg

        def select(loc, kv, q_offset):
            at = dict(q_offset=q_offset, kv_segment_ids=None if q_offset is None else kv["seg"])
            return (indexer_topk(loc["q_idx"], kv["k_idx"], loc["w"], c.index_topk, segment_ids=loc["seg"],
                                 impl=c.indexer_impl or c.attention_impl, chunk=c.attn_chunk, **at),)

        sg = jax.lax.stop_gradient
        (indices,) = over_context(select, {"q_idx": sg(q_idx), "w": sg(w), "seg": segment_ids},
                                  {"k_idx": sg(k_idx), "seg": segment_ids}, ("token",), n=n_ctx, key_prefix=True)
        return checkpoint_name(indices, ATTN_TOPK)

    def _kv_b_weights(self, kv_b):
        """kv_b's kernel split per head: (W_UK [kv_lora, H, dn], W_UV [kv_lora, H, dv])."""
        c = self.cfg
        dn = c.qk_nope_head_dim
        w = nn.unbox(kv_b.variables["params"]["kernel"]).reshape(c.kv_lora_rank, c.num_heads, dn + c.v_head_dim)
        return w[..., :dn], w[..., dn:]

    @staticmethod
    def _shared(prev_indices):
        if prev_indices is None:
            raise ValueError("a 'shared' indexer layer needs the top-k indices of a previous 'full' layer")
        return prev_indices

    def _cached(self, x, q, q_latent, latent, k_rope, kv_b, o_proj, cos, sin, prev_indices, positions, wpos,
                cache, scale):
        """Absorbed MLA over the cache (`LayerCache`, or an MTP depth's buffer dict). With kv_b = [W_UK | W_UV]
        per head, q_nope . k_nope = (q_nope W_UK^T) . latent and sum_s p_s v_s = (sum_s p_s latent_s) W_UV,
        so attention runs over the cached [latent | k_rope] rows ("kv", glm5_jax.infer.cache) and K/V are
        never expanded. This call's rows are written in place; dense MLA reads the layer's rows, DSA reads
        the layer's index keys and gathers only the selected kv rows."""
        c = self.cfg
        b, t = x.shape[:2]
        dn = c.qk_nope_head_dim
        if positions is None:
            raise ValueError("attention over a cache needs explicit positions [B, T]")
        view = cache if isinstance(cache, LayerCache) else LayerCache(cache)
        row = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)
        width = view.buffers["kv"].shape[-1]
        view = view.write("kv", wpos, jnp.pad(row, ((0, 0), (0, 0), (0, width - row.shape[-1]))))
        indices = None
        if self.indexer_type and c.dsa_topk_source != "indexer":
            raise NotImplementedError(f"dsa_topk_source={c.dsa_topk_source!r} is an evaluation of the training / "
                                      "prefill forward (no cache); decoding over a cache selects with the indexer")
        if self.indexer_type == "full":
            q_idx, k_idx, w = Indexer(c, cached=True, name="indexer")(x, q_latent, cos, sin)
            view = view.write("k_idx", wpos, k_idx)
            indices = select_topk_cached(q_idx, view.rows("k_idx"), w, c.index_topk, positions,
                                         page=c.dsa_decode_pages)
        elif self.indexer_type == "shared":
            indices = self._shared(prev_indices)
        if self.is_initializing():
            kv_b(latent[:, :1])
        w_uk, w_uv = self._kv_b_weights(kv_b)
        out = cached_mla_attention(q[..., :dn], q[..., dn:], view, w_uk, w_uv, scale, c.kv_lora_rank,
                                   positions=positions, indices=indices, chunk=min(c.attn_chunk, 16))
        return o_proj(out.reshape(b, t, -1)), indices, (view if isinstance(cache, LayerCache) else view.buffers)


def short_sequence_dense(c, t: int) -> bool:
    """Whether DSA's sparse stage runs as expanded dense attention masked to the top-k set (the same
    result) instead of the MQA row gather: on the CPU backend with attention_impl="xla" when
    T <= c.dsa_short_dense * index_topk. There the top-k keeps a large share of the visible keys,
    and XLA CPU's row gathers / scatter-adds at [K, H] with few heads cost several times the block
    GEMMs of the masked dense form (docs/training.md, "Against Hugging Face")."""
    return (c.attention_impl == "xla" and c.dsa_short_dense > 0 and t <= c.dsa_short_dense * c.index_topk
            and jax.default_backend() == "cpu")


def mqa_operands(q_nope, q_rope, latent, k_rope, w_uk):
    """MLA's MQA form: q_nope [B,T,H,dn], q_rope [B,T,H,dr], latent [B,S,r], k_rope [B,S,dr],
    w_uk [r,H,dn] -> q [B,T,H,r+dr] = [q_nope W_UK^T | q_rope], k [B,S,1,r+dr] = [latent | k_rope],
    v [B,S,1,r] = latent (one key/value row per token, shared by all heads), in latent's dtype."""
    dt = latent.dtype
    k = jnp.concatenate([latent, k_rope.astype(dt)], axis=-1)[:, :, None]
    return mqa_query(q_nope, q_rope, w_uk, dt), k, latent[:, :, None]


def mqa_query(q_nope, q_rope, w_uk, dt):
    """The MQA form's query [B,T,H,r+dr] = [q_nope W_UK^T | q_rope] in dtype dt (the keys' dtype)."""
    q_lat = jnp.einsum("bthd,rhd->bthr", q_nope, w_uk.astype(q_nope.dtype)).astype(dt)
    return jnp.concatenate([q_lat, q_rope.astype(dt)], axis=-1)


def dsa_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, indices, *, scale, impl: str = "xla",
                  chunk: int = 16):
    """DSA's sparse MLA in MQA form over given latent / rope keys (the cache-free form; over a decode cache,
    `cached_mla_attention`).

    q_nope [B,T,H,dn], q_rope [B,T,H,dr], latent [B,S,r], k_rope [B,S,dr], w_uk [r,H,dn], w_uv [r,H,dv],
    indices [B,T,K] (key slots, -1 = none) -> [B,T,H,dv]: each head attends the selected
    [latent | k_rope] rows (scale: softmax_scale(dn + dr, ...), layers.rope), W_UV is applied after attention."""
    q, k, _ = mqa_operands(q_nope, q_rope, latent, k_rope, w_uk)
    return mqa_sparse_attention(q, k, w_uv, indices, scale=scale, impl=impl, chunk=chunk)


def cached_mla_attention(q_nope, q_rope, cache, w_uk, w_uv, scale, r: int, *, positions=None, indices=None,
                         chunk: int = 16):
    """Absorbed MLA attention over a layer's cache (`LayerCache` with a "kv" buffer: [latent | k_rope | pad]
    rows, latent r wide).

    q_nope [B,T,H,dn], q_rope [B,T,H,dr], w_uk [r,H,dn], w_uv [r,H,dv]; either positions [B,T] (dense MLA:
    the query at p sees slots 0..p, over the layer's rows) or indices [B,T,K] (-1 = none; DSA: only the
    selected rows are gathered, per chunk of queries, straight from the cache) -> [B,T,H,dv].
    The sparse form computes what `dsa_attention` (training's sparse call) computes over the same rows, in
    jnp for every attention_impl: a Pallas kernel would need the layer's rows sliced out of the stack.
    The dense form runs both matmuls over the whole padded rows (the query zero-padded to the row width, the
    value columns past r dropped after): scores over column slices of the rows (latent, k_rope) made the TPU
    compiler copy every layer's rows out of the stack at every step (tests/test_cache_layout.py)."""
    if indices is not None:
        q = mqa_query(q_nope, q_rope, w_uk, cache.buffers["kv"].dtype)
        dq = q.shape[-1]
        o = ref.sparse_mqa_rows(q, lambda safe: cache.gather("kv", safe)[..., :dq], indices, scale=scale, r=r,
                                chunk=chunk)
        return jnp.einsum("bthr,rhd->bthd", o, w_uv.astype(o.dtype))
    kv = cache.rows("kv")
    dt = kv.dtype
    q = mqa_query(q_nope, q_rope, w_uk, dt)
    q = jnp.pad(q, ((0, 0),) * 3 + ((0, kv.shape[-1] - q.shape[-1]),))
    logits = jnp.einsum("bthw,bsw->bths", q, kv, preferred_element_type=jnp.float32)
    probs = masked_softmax(logits * scale, visible_slots(positions, kv.shape[1])[:, :, None, :]).astype(dt)
    o_lat = jnp.einsum("bths,bsw->bthw", probs, kv)[..., :r]
    return jnp.einsum("bthr,rhd->bthd", o_lat, w_uv.astype(dt))
