"""DSA evaluations beside the LM loss: a model evaluated with oracle top-k (each query's k keys = the top-k
of its own head-averaged dense attention), query-position buckets for the attention-mass figures
(glm5_jax.attention.selection), and the wall time of one attention layer dense vs sparse."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from glm5_jax.config import ModelConfig


@functools.lru_cache(maxsize=None)
def _indexer_placeholder(dsa_cfg: ModelConfig):
    """A DSA parameter tree of zeros: a dense MLA model's params grafted onto it run as DSA with oracle
    top-k (the indexer's params are never read then: the selection comes from the main attention)."""
    from glm5_jax.model import init_params
    shapes = jax.eval_shape(lambda: init_params(dsa_cfg, jax.random.PRNGKey(0)))
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)


def oracle_config(dsa_cfg: ModelConfig, k: int) -> ModelConfig:
    return dsa_cfg.replace(index_topk=k, dsa_topk_source="oracle")


def as_oracle(dsa_cfg: ModelConfig, k: int, params) -> tuple[ModelConfig, dict]:
    """(config, params) of `params` (a dense MLA model's, or a DSA model's) evaluated with oracle top-k k."""
    from glm5_jax.train.stages import graft
    cfg = oracle_config(dsa_cfg, k)
    flat = traverse_util.flatten_dict(params)
    if not any("indexer" in key for key in flat):       # MLA params: graft onto the DSA tree
        params = graft(_indexer_placeholder(dsa_cfg.replace(index_topk=1)), params)
    return cfg, params


def mass_buckets(T: int) -> tuple[tuple[int, int], ...]:
    """Query-position buckets of the attention-mass figures: [0, T/8), [T/8, T/4), [T/4, T/2), [T/2, T)."""
    cuts = sorted({0, T // 8, T // 4, T // 2, T})
    return tuple((a, b) for a, b in zip(cuts, cuts[1:]) if b > a)


def time_attention(cfg_dense: ModelConfig, cfg_sparse: ModelConfig, seq_len: int, batch: int, reps: int = 2) -> dict:
    """Forward+backward wall time of one attention layer (with the indexer for DSA), dense vs sparse."""
    from glm5_jax.attention.mla import MLAttention
    from glm5_jax.layers.rope import rope_angles
    out = {}
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, seq_len, cfg_dense.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))
    cos, sin = rope_angles(pos, cfg_dense.qk_rope_head_dim, cfg_dense.rope_theta)
    for name, cfg, itype in (("dense_mla", cfg_dense, None), ("sparse_dsa", cfg_sparse, "full")):
        mod = MLAttention(cfg.replace(attn_chunk=256), itype)
        params = mod.init(jax.random.PRNGKey(1), x[:, :8], cos[:, :8], sin[:, :8])["params"]
        loss = jax.jit(jax.grad(lambda p, x: jnp.sum(mod.apply({"params": p}, x, cos, sin)[0] ** 2), argnums=(0, 1)))
        jax.block_until_ready(loss(params, x))
        t = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(loss(params, x))
        out[name] = (time.perf_counter() - t) / reps
    out["dense_over_sparse"] = out["dense_mla"] / out["sparse_dsa"]
    return out


__all__ = ["as_oracle", "mass_buckets", "oracle_config", "time_attention"]
