"""KV-cache allocation for the model's own attention modules (they read and write it; see
`glm5_jax.model.GLM5.__call__(..., cache=...)`).

Layout: {"layers": {stack name: {"layer_j": buffers [repeats, B, S, ...]}}, "mtp": [one per MTP depth]}
  * mla / dsa: "latent" [B, S, kv_lora] (after kv_a_norm) and "k_rope" [B, S, qk_rope] (after RoPE):
    the compressed MLA cache, kv_lora + qk_rope numbers per token (512 + 64 at GLM-5 scale);
    dsa "full" indexer layers add "k_idx" [B, S, index_head_dim] (after LayerNorm and RoPE).
    "shared" indexer layers keep no indexer keys: they reuse the previous full layer's selection.
  * mha / gqa: "k" [B, S, kv_heads, head_dim] (after RoPE) and "v" [B, S, kv_heads, head_dim].

Cache slot == absolute token position of its row (prompts are RIGHT-padded, see decode.py), so a
query at position p sees exactly the slots 0..p; slots past a row's frontier may hold garbage
(pad tokens, rejected drafts) and are never visible before they are overwritten.
"""

from __future__ import annotations

import jax.numpy as jnp

from glm5_jax.attention.core import write_cache as write
from glm5_jax.layers.common import dtype_of

__all__ = ["cache_numbers_per_token", "init_cache", "layer_cache", "write"]


def layer_cache(config, batch: int, size: int, indexer: bool, lead: tuple = ()) -> dict:
    """Zeroed cache of one attention layer ([*lead, B, S, ...] buffers in the compute dtype)."""
    c, dt = config, dtype_of(config.dtype)
    z = lambda *shape: jnp.zeros(lead + (batch, size) + shape, dt)
    if c.is_mla:
        out = {"latent": z(c.kv_lora_rank), "k_rope": z(c.qk_rope_head_dim)}
        if indexer:
            out["k_idx"] = z(c.index_head_dim)
        return out
    return {"k": z(c.num_kv_heads, c.head_dim), "v": z(c.num_kv_heads, c.head_dim)}


def init_cache(config, batch: int, size: int, mtp_depths: int = 0) -> dict:
    """{"layers": per stack, stacked like its parameters; "mtp": per MTP depth (dsa 'full' when dsa)}."""
    layers = {s.name: {f"layer_{j}": layer_cache(config, batch, size, t == "full", (s.repeats,))
                       for j, t in enumerate(s.indexer_types)} for s in config.layer_stacks}
    mtp = [layer_cache(config, batch, size, config.attention == "dsa") for _ in range(mtp_depths)]
    return {"layers": layers, "mtp": mtp}


def cache_numbers_per_token(config) -> int:
    """Cached numbers per token summed over the main layers (e.g. GLM-5: 78 * 576 + indexer keys)."""
    types = config.layer_indexer_types
    total = 0
    for i in range(config.num_layers):
        if config.is_mla:
            total += config.kv_lora_rank + config.qk_rope_head_dim
            if types and types[i] == "full":
                total += config.index_head_dim
        else:
            total += 2 * config.num_kv_heads * config.head_dim
    return total
