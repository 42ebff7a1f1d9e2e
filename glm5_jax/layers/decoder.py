"""One decoder layer: input norm -> attention (MLA / DSA, or GQA) -> residual -> post-attention norm ->
SwiGLU MLP or MoE -> residual. The layer stacks of glm5_jax.model scan it; the MTP blocks
(glm5_jax.mtp) run one each."""

from __future__ import annotations

import flax.linen as nn
from jax.ad_checkpoint import checkpoint_name

from glm5_jax.attention.mha import GQAttention
from glm5_jax.attention.mla import MLAttention
from glm5_jax.config import ModelConfig
from glm5_jax.layers.common import RMSNorm, constrain, dtype_of
from glm5_jax.layers.mlp import SwiGLU
from glm5_jax.layers.moe import MoE

ACT = ("activation_batch", "activation_seq", "activation_embed")

LAYER_MID = "decoder_layer_mid"         # the residual stream between a layer's attention and its MLP / MoE


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    moe: bool
    indexer_type: str | None

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids=None, prev_indices=None, indexer_loss=None,
                 monitor_logits: bool = False, *, positions=None, cache=None, write_positions=None):
        """x [B, T, D] -> (x, top-k indices [B, T, K] or None, new layer cache or None)."""
        c = self.cfg
        pdt, dt = dtype_of(c.param_dtype), dtype_of(c.dtype)
        h = RMSNorm(c.rms_norm_eps, pdt, name="input_norm")(x)
        kw = dict(positions=positions, cache=cache, write_positions=write_positions)
        if c.is_mla:
            attn, indices, cache = MLAttention(c, self.indexer_type, name="attn")(
                h, cos, sin, segment_ids, prev_indices, indexer_loss, monitor_logits, **kw)
        else:
            attn, indices, cache = GQAttention(c, name="attn")(h, cos, sin, segment_ids,
                                                               monitor_logits=monitor_logits, **kw)
        x = checkpoint_name(constrain(x + attn, ACT), LAYER_MID)
        h = RMSNorm(c.rms_norm_eps, pdt, name="post_attn_norm")(x)
        if self.moe:
            mlp = MoE(c.num_experts, c.experts_per_tok, c.moe_ffn_dim, c.num_shared_experts, c.n_group,
                      c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, c.moe_impl,
                      c.initializer_range, dt, pdt, capacity_factor=c.moe_capacity_factor,
                      token_chunk=c.moe_token_chunk, round_factor=c.moe_round_capacity_factor,
                      kernel=c.moe_kernel, overflow_factor=c.moe_overflow_capacity_factor, cached=cache is not None,
                      name="moe")(h)
        else:
            mlp = SwiGLU(c.ffn_dim, c.initializer_range, dt, pdt, name="mlp")(h)
        return constrain(x + mlp, ACT), indices, cache
