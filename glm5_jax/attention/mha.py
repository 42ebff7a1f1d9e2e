"""Multi-head / grouped-query attention with interleaved RoPE on the whole head."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from glm5_jax.attention.context import over_context
from glm5_jax.attention.core import LayerCache, cached_attention, causal_attention
from glm5_jax.layers.common import Dense, constrain, dtype_of
from glm5_jax.layers.rope import apply_rope, softmax_scale
from glm5_jax.attention.monitor import max_attention_logit


class GQAttention(nn.Module):
    cfg: "ModelConfig"  # noqa: F821

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids=None, prev_indices=None, monitor_logits: bool = False, *,
                 positions=None, cache=None, write_positions=None):
        """x [B, T, D] -> (out [B, T, D], None, new cache or None); with `cache` (a `LayerCache`, or an MTP
        depth's {"k", "v"} [B, S, Hk, hd]; returned in the same form)
        this call's keys/values are written at write_positions (default positions) and attended over."""
        c = self.cfg
        b, t, _ = x.shape
        kw = dict(stddev=c.initializer_range, dtype=dtype_of(c.dtype), param_dtype=dtype_of(c.param_dtype))
        q = Dense(c.num_heads * c.head_dim, ("embed", "heads"), name="q_proj", **kw)(x).reshape(b, t, c.num_heads, c.head_dim)
        k = Dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), name="k_proj", **kw)(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = Dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), name="v_proj", **kw)(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = constrain(q, ("activation_batch", "activation_seq", "activation_heads", None))
        scale = softmax_scale(c.head_dim, c.rope_scaling_dict)  # x YaRN mscale^2 (layers.rope)
        if cache is not None:
            if monitor_logits:
                raise ValueError("monitor_logits is for training forwards, not attention over a cache")
            if positions is None:
                raise ValueError("attention over a cache needs explicit positions [B, T]")
            wpos = positions if write_positions is None else write_positions
            view = cache if isinstance(cache, LayerCache) else LayerCache(cache)
            view = view.write("k", wpos, k).write("v", wpos, v)
            out = cached_attention(q, view.rows("k"), view.rows("v"), positions, scale=scale)
            cache = view if isinstance(cache, LayerCache) else view.buffers
        else:
            def attend(loc, kv, q_offset):   # one shard of queries over all keys (glm5_jax.attention.context)
                out = causal_attention(loc["q"], kv["k"], kv["v"], scale=scale, segment_ids=loc["seg"],
                                       chunk=c.attn_chunk, q_offset=q_offset,
                                       kv_segment_ids=None if q_offset is None else kv["seg"])
                if not monitor_logits:
                    return (out,)
                # max |q.k| * scale over heads and visible (causal, same-segment) keys
                tq = loc["q"].shape[1]
                q_pos = None if q_offset is None else jnp.broadcast_to(q_offset + jnp.arange(tq), (b, tq))
                return out, max_attention_logit(loc["q"], kv["k"], scale, causal=True, q_segment_ids=loc["seg"],
                                                kv_segment_ids=kv["seg"], q_positions=q_pos, q_chunk=c.attn_chunk)

            res = over_context(attend, {"q": q, "seg": segment_ids}, {"k": k, "v": v, "seg": segment_ids},
                               ("token", "max") if monitor_logits else ("token",),
                               n=1 if self.is_initializing() else None)
            out = res[0]
            if monitor_logits:
                self.sow("intermediates", "max_attn_logit", res[1])
        out = Dense(x.shape[-1], ("heads", "embed"), name="o_proj", **kw)(out.reshape(b, t, -1))
        return out, None, cache
