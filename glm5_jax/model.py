"""The GLM-5 decoder: embed -> layers -> norm -> head, plus multi-token-prediction (MTP) blocks.

`GLM5` is the Flax Linen module; `forward(config, params, tokens)` is the plain-function entry.
Layers are unrolled: GLM-5 mixes dense and MoE MLPs and full / shared indexer layers, and a shared
layer consumes the indices of the full layer before it.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from glm5_jax.attention.mha import GQAttention
from glm5_jax.attention.mla import MLAttention
from glm5_jax.config import ModelConfig
from glm5_jax.layers.common import Dense, RMSNorm, constrain, dtype_of, init_normal
from glm5_jax.layers.mlp import SwiGLU
from glm5_jax.layers.moe import MoE
from glm5_jax.layers.rope import rope_angles

ACT = ("activation_batch", "activation_seq", "activation_embed")


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    moe: bool
    indexer_type: str | None

    @nn.compact
    def __call__(self, x, cos, sin, segment_ids=None, prev_indices=None, indexer_loss=None,
                 monitor_logits: bool = False):
        c = self.cfg
        pdt, dt = dtype_of(c.param_dtype), dtype_of(c.dtype)
        h = RMSNorm(c.rms_norm_eps, pdt, name="input_norm")(x)
        if c.is_mla:
            attn, indices = MLAttention(c, self.indexer_type, name="attn")(h, cos, sin, segment_ids, prev_indices,
                                                                           indexer_loss, monitor_logits)
        else:
            attn, indices = GQAttention(c, name="attn")(h, cos, sin, segment_ids, monitor_logits=monitor_logits)
        x = constrain(x + attn, ACT)
        h = RMSNorm(c.rms_norm_eps, pdt, name="post_attn_norm")(x)
        if self.moe:
            mlp = MoE(c.num_experts, c.experts_per_tok, c.moe_ffn_dim, c.num_shared_experts, c.n_group,
                      c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, c.moe_impl,
                      c.initializer_range, dt, pdt, capacity_factor=c.moe_capacity_factor, name="moe")(h)
        else:
            mlp = SwiGLU(c.ffn_dim, c.initializer_range, dt, pdt, name="mlp")(h)
        return constrain(x + mlp, ACT), indices


class MTPBlock(nn.Module):
    """h' = eh_proj([RMSNorm(embed(next token)) ; RMSNorm(h_prev)]) -> decoder layer -> RMSNorm.

    The concatenation order (embedding first) follows the released DeepSeek-V3-style checkpoints.
    """
    cfg: ModelConfig

    @nn.compact
    def __call__(self, h_prev, emb, cos, sin, segment_ids=None):
        c = self.cfg
        pdt, dt = dtype_of(c.param_dtype), dtype_of(c.dtype)
        e = RMSNorm(c.rms_norm_eps, pdt, name="enorm")(emb)
        hp = RMSNorm(c.rms_norm_eps, pdt, name="hnorm")(h_prev)
        h = Dense(c.d_model, ("mtp_in", "embed"), c.initializer_range, dt, pdt, name="eh_proj")(
            jnp.concatenate([e, hp], axis=-1))
        idx_type = "full" if c.attention == "dsa" else None
        h, _ = DecoderLayer(c, c.num_experts > 0, idx_type, name="layer")(h, cos, sin, segment_ids)
        return h, RMSNorm(c.rms_norm_eps, pdt, name="final_norm")(h)


def shift_left(x, k: int, fill=0):
    """x [B, T] -> x[:, k:] padded with `fill` on the right (the token k steps ahead)."""
    return jnp.concatenate([x[:, k:], jnp.full((x.shape[0], k), fill, x.dtype)], axis=1) if k else x


class GLM5(nn.Module):
    cfg: ModelConfig

    def setup(self):
        c = self.cfg
        pdt = dtype_of(c.param_dtype)
        self.embed = nn.Embed(c.vocab_size, c.d_model, param_dtype=pdt, dtype=dtype_of(c.dtype),
                              embedding_init=init_normal(c.initializer_range, ("vocab", "embed")))
        types = c.layer_indexer_types
        # static_argnums count `self`: 6 = indexer_loss, 7 = monitor_logits
        layer_cls = nn.remat(DecoderLayer, static_argnums=(6, 7)) if c.remat else DecoderLayer
        self.layers = [layer_cls(c, c.is_moe_layer(i), types[i] if types else None, name=f"layer_{i}")
                       for i in range(c.num_layers)]
        self.final_norm = RMSNorm(c.rms_norm_eps, pdt)
        if not c.tie_embeddings:
            self.lm_head = Dense(c.vocab_size, ("embed", "vocab"), c.initializer_range, jnp.float32, pdt)
        n_mtp = (1 if c.mtp_share else c.mtp_depth) if c.mtp_depth else 0
        self.mtp = [MTPBlock(c, name=f"mtp_{k}") for k in range(n_mtp)]

    def head(self, h):
        """Final-normed hidden [.., D] -> float32 logits [.., V]."""
        if self.cfg.tie_embeddings:
            return self.embed.attend(h.astype(jnp.float32)).astype(jnp.float32)
        return self.lm_head(h.astype(jnp.float32))

    def __call__(self, tokens, positions=None, segment_ids=None, *, indexer_loss=None, mtp: bool = False,
                 return_hidden: bool = False, monitor_logits: bool = False) -> dict[str, Any]:
        """tokens [B, T] int -> {"logits": [B, T, V] float32, "mtp_logits": [depth, B, T, V] if mtp,
        "hidden": [B, T, D] final-normed if return_hidden}.

        positions [B, T] default arange (restart them per document when packing); segment_ids [B, T]
        keep attention inside documents; indexer_loss in (None, "dense", "sparse") sows indexer KL;
        monitor_logits sows each main layer's max |q.k|*scale as intermediates/layer_i/attn/max_attn_logit.
        """
        c = self.cfg
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        rope_dim = c.qk_rope_head_dim if c.is_mla else c.head_dim
        cos, sin = rope_angles(positions, rope_dim, c.rope_theta, c.rope_scaling_dict or None)
        x = constrain(self.embed(tokens), ACT)
        indices = None
        for layer in self.layers:
            x, new_indices = layer(x, cos, sin, segment_ids, indices, indexer_loss, monitor_logits)
            indices = new_indices if new_indices is not None else indices
        hidden = self.final_norm(x)
        out = {"logits": self.head(hidden)}
        if return_hidden:
            out["hidden"] = hidden
        if mtp and c.mtp_depth:
            h, mtp_logits = x, []
            for k in range(1, c.mtp_depth + 1):
                block = self.mtp[0] if c.mtp_share else self.mtp[k - 1]
                emb = self.embed(shift_left(tokens, k))
                h, hn = block(h, emb, cos, sin, segment_ids)
                mtp_logits.append(self.head(hn))
            out["mtp_logits"] = jnp.stack(mtp_logits)
        return out


def init_params(config: ModelConfig, rng, seq_len: int = 8):
    """Unboxed parameter pytree for `config` (logical axis metadata stripped)."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    variables = GLM5(config).init(rng, tokens, mtp=config.mtp_depth > 0)
    return nn.unbox(variables["params"])


def abstract_params(config: ModelConfig, seq_len: int = 8):
    """Shapes/dtypes of the parameters (and their logical axes) without allocating anything."""
    tokens = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    boxed = jax.eval_shape(lambda r, x: GLM5(config).init(r, x, mtp=config.mtp_depth > 0)["params"],
                           jax.random.PRNGKey(0), tokens)
    return boxed


def forward(config: ModelConfig, params, tokens, positions=None, segment_ids=None):
    """Main-head logits [B, T, vocab] float32 of `tokens` [B, T]."""
    return GLM5(config).apply({"params": params}, jnp.asarray(tokens), positions, segment_ids)["logits"]
