"""KV-cache allocation for the model's own attention modules (they read and write it; see
`glm5_jax.model.GLM5.__call__(..., cache=...)`).

Layout: {"layers": {stack name: {"layer_j": buffers [repeats, B, S, ...]}}, "mtp": [one per MTP depth]}
  * mla / dsa: "kv" [B, S, kv_width(config)]: per token [latent (after kv_a_norm) | k_rope (after RoPE) |
    zeros], kv_lora + qk_rope numbers (512 + 64 at GLM-5 scale) padded to a multiple of KV_ALIGN. The
    buffer's first kv_lora + qk_rope columns ARE the absorbed (MQA) form's key row, and its first kv_lora
    its value row: attention reads the buffer, nothing is concatenated over the cache;
    dsa "full" indexer layers add "k_idx" [B, S, index_head_dim] (after LayerNorm and RoPE).
    "shared" indexer layers keep no indexer keys: they reuse the previous full layer's selection.
  * mha / gqa: "k" [B, S, kv_heads, head_dim] (after RoPE) and "v" [B, S, kv_heads, head_dim].
B is axis 1 of a stacked buffer (axis 0 of an MTP depth's): a batch-sharded cache shards that axis.

Why the padding (docs/inference.md, "Cache layout and DSA decode"): the TPU's default layout of a
[.., S, 576] bf16 array puts S minor (576 is not a multiple of the 128-lane tile, S is), and a decode
step that writes and gathers token rows then copied the whole cache into the row-major layout and back
at every call (compiled for v5p, tools.aot's compiler). A multiple of 128 keeps the row-major layout, in
which a 576-wide row occupies 640 lanes anyway.

Cache slot == absolute token position of its row (prompts are RIGHT-padded, see decode.py), so a
query at position p sees exactly the slots 0..p; slots past a row's frontier may hold garbage
(pad tokens, rejected drafts) and are never visible before they are overwritten.
"""

from __future__ import annotations

import jax.numpy as jnp

from glm5_jax.attention.core import write_cache as write
from glm5_jax.layers.common import dtype_of

__all__ = ["KV_ALIGN", "cache_numbers_per_token", "init_cache", "kv_width", "layer_cache", "write"]

KV_ALIGN = 128      # the MLA "kv" row width is padded to a multiple of this (module docstring)


def kv_width(config) -> int:
    """Columns of an MLA layer's "kv" buffer: kv_lora + qk_rope rounded up to a multiple of KV_ALIGN."""
    n = config.kv_lora_rank + config.qk_rope_head_dim
    return -(-n // KV_ALIGN) * KV_ALIGN


def layer_cache(config, batch: int, size: int, indexer: bool, lead: tuple = ()) -> dict:
    """Zeroed cache of one attention layer ([*lead, B, S, ...] buffers in the compute dtype)."""
    c, dt = config, dtype_of(config.dtype)
    z = lambda *shape: jnp.zeros(lead + (batch, size) + shape, dt)
    if c.is_mla:
        out = {"kv": z(kv_width(c))}
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
    """Cached numbers per token summed over the main layers (e.g. GLM-5: 78 * 576 + indexer keys): the
    model's numbers, without the "kv" row padding (`kv_width` gives the stored width)."""
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
