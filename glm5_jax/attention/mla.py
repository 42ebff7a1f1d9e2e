"""Multi-head latent attention (MLA), and DSA = MLA over the keys the lightning indexer selects.

q = q_b(RMSNorm(q_a(x))) -> per head [nope ; rope]; [latent ; k_rope] = kv_a(x);
[k_nope ; v] = kv_b(RMSNorm(latent)) per head; the rope key is shared by all heads.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.attention.core import causal_attention
from glm5_jax.attention.indexer import Indexer, indexer_kl_dense, indexer_kl_sparse, select_topk
from glm5_jax.layers.common import Dense, RMSNorm, constrain, dtype_of
from glm5_jax.layers.rope import apply_rope
from glm5_jax.optim.monitor import max_attention_logit
from pallas_kernels import reference as ref


def sparse_attention(q, k, v, indices, *, scale, impl: str = "xla", chunk: int = 128):
    if impl == "pallas":
        from pallas_kernels import dsa
        return dsa.sparse_attention(q, k, v, indices, scale=scale)
    return ref.sparse_attention(q, k, v, indices, scale=scale, chunk=chunk)


class MLAttention(nn.Module):
    cfg: "ModelConfig"  # noqa: F821
    indexer_type: str | None = None   # None (plain MLA) | full | shared

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids=None, prev_indices=None, indexer_loss=None,
                 monitor_logits: bool = False):
        """x [B, T, D] -> (out [B, T, D], top-k indices [B, T, K] or None)."""
        c = self.cfg
        b, t, d = x.shape
        h, dn, dr, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        kw = dict(stddev=c.initializer_range, dtype=dtype_of(c.dtype), param_dtype=dtype_of(c.param_dtype))
        norm = lambda name: RMSNorm(1e-6, dtype_of(c.param_dtype), name=name)

        q_latent = norm("q_a_norm")(Dense(c.q_lora_rank, ("embed", "q_lora"), name="q_a_proj", **kw)(x))
        q = Dense(h * (dn + dr), ("q_lora", "heads"), name="q_b_proj", **kw)(q_latent).reshape(b, t, h, dn + dr)
        q = jnp.concatenate([q[..., :dn], apply_rope(q[..., dn:], cos, sin)], axis=-1)

        kv = Dense(c.kv_lora_rank + dr, ("embed", "kv_lora"), name="kv_a_proj", **kw)(x)
        latent = norm("kv_a_norm")(kv[..., :c.kv_lora_rank])
        k_rope = apply_rope(kv[..., c.kv_lora_rank:], cos, sin)                       # [B, T, dr]
        kvb = Dense(h * (dn + dv), ("kv_lora", "heads"), name="kv_b_proj", **kw)(latent).reshape(b, t, h, dn + dv)
        k = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(k_rope[:, :, None], (b, t, h, dr))], axis=-1)
        v = kvb[..., dn:]
        q = constrain(q, ("activation_batch", "activation_seq", "activation_heads", None))
        k = constrain(k, ("activation_batch", "activation_seq", "activation_heads", None))
        scale = (dn + dr) ** -0.5
        if monitor_logits:   # dense max |q.k| * scale over visible keys (also for DSA: not only the top-k)
            self.sow("intermediates", "max_attn_logit",
                     max_attention_logit(q, k, scale, causal=True, q_segment_ids=segment_ids,
                                         kv_segment_ids=segment_ids, q_chunk=c.attn_chunk))

        indices = None
        if self.indexer_type == "full":
            # The indexer never trains through the LM loss: its input is detached.
            idx_in = (jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent))
            q_idx, k_idx, w = Indexer(c, name="indexer")(*idx_in, cos, sin)
            indices = select_topk(jax.lax.stop_gradient(q_idx), jax.lax.stop_gradient(k_idx),
                                  jax.lax.stop_gradient(w), c.index_topk, segment_ids=segment_ids,
                                  impl=c.attention_impl, chunk=c.attn_chunk)
            if indexer_loss == "dense":
                kl, recall = indexer_kl_dense(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), scale,
                                              q_idx, k_idx, w, topk=c.index_topk, segment_ids=segment_ids,
                                              chunk=c.attn_chunk)
                self.sow("intermediates", "indexer_kl", kl)
                self.sow("intermediates", "indexer_recall", recall)
            elif indexer_loss == "sparse":
                kl = indexer_kl_sparse(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), scale,
                                       q_idx, k_idx, w, indices, chunk=c.attn_chunk)
                self.sow("intermediates", "indexer_kl", kl)
        elif self.indexer_type == "shared":
            if prev_indices is None:
                raise ValueError("a 'shared' indexer layer needs the top-k indices of a previous 'full' layer")
            indices = prev_indices

        if indices is None or indexer_loss == "dense":
            out = causal_attention(q, k, v, scale=scale, segment_ids=segment_ids, chunk=c.attn_chunk)
        else:
            out = sparse_attention(q, k, v, indices, scale=scale, impl=c.attention_impl, chunk=min(c.attn_chunk, 16))
        out = Dense(d, ("heads", "embed"), name="o_proj", **kw)(out.reshape(b, t, h * dv))
        return out, indices
