"""Multi-head / grouped-query attention with interleaved RoPE on the whole head."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from glm5_jax.attention.core import cached_attention, causal_attention, write_cache
from glm5_jax.layers.common import Dense, constrain, dtype_of
from glm5_jax.layers.rope import apply_rope
from glm5_jax.attention.monitor import max_attention_logit


class GQAttention(nn.Module):
    cfg: "ModelConfig"  # noqa: F821

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids=None, prev_indices=None, monitor_logits: bool = False, *,
                 positions=None, cache=None, write_positions=None):
        """x [B, T, D] -> (out [B, T, D], None, new cache or None); with `cache` ({"k", "v"} [B, S, Hk, hd])
        this call's keys/values are written at write_positions (default positions) and attended over."""
        c = self.cfg
        b, t, _ = x.shape
        kw = dict(stddev=c.initializer_range, dtype=dtype_of(c.dtype), param_dtype=dtype_of(c.param_dtype))
        q = Dense(c.num_heads * c.head_dim, ("embed", "heads"), name="q_proj", **kw)(x).reshape(b, t, c.num_heads, c.head_dim)
        k = Dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), name="k_proj", **kw)(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = Dense(c.num_kv_heads * c.head_dim, ("embed", "kv_heads"), name="v_proj", **kw)(x).reshape(b, t, c.num_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = constrain(q, ("activation_batch", "activation_seq", "activation_heads", None))
        if monitor_logits:   # max |q.k| * scale over heads and visible (causal, same-segment) keys
            self.sow("intermediates", "max_attn_logit",
                     max_attention_logit(q, k, c.head_dim ** -0.5, causal=True, q_segment_ids=segment_ids,
                                         kv_segment_ids=segment_ids, q_chunk=c.attn_chunk))
        if cache is not None:
            if positions is None:
                raise ValueError("attention over a cache needs explicit positions [B, T]")
            wpos = positions if write_positions is None else write_positions
            cache = {"k": write_cache(cache["k"], wpos, k), "v": write_cache(cache["v"], wpos, v)}
            out = cached_attention(q, cache["k"], cache["v"], positions, scale=c.head_dim ** -0.5)
        else:
            out = causal_attention(q, k, v, scale=c.head_dim ** -0.5, segment_ids=segment_ids, chunk=c.attn_chunk)
        out = Dense(x.shape[-1], ("heads", "embed"), name="o_proj", **kw)(out.reshape(b, t, -1))
        return out, None, cache
