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


def mass_row(prefix: str, res: dict, keys=("selected_mass", "oracle_mass", "recall")) -> dict:
    """Flat metrics-row entries of an attention-mass result: over all positions and per bucket (mean over layers)."""
    from glm5_jax.attention.selection import mass_beyond
    out = {}
    allpos = mass_beyond(res, 0)
    for key in keys:
        name = {"selected_mass": "indexer_mass", "oracle_mass": "oracle_mass", "recall": "indexer_recall_of_oracle"}[key]
        out[f"{prefix}{name}"] = allpos[key]
        for j, v in enumerate(res["mean"][key]):
            if v is not None:
                out[f"{prefix}{name}_b{j}"] = v
    return out


def decomposition_fn(dsa_cfg: ModelConfig, test_lm, mass_lm, ks, arm: str, mass_ks=None):
    """fn(params) -> the evaluations that split a DSA model's loss gap (recorded in a training run's eval rows).
    arm "mla" (params of a dense model): for each top-k k, the test LM loss with oracle top-k
    ("oracle_test_loss_k<k>": the cost of attending to k keys at all) and its oracle mass ("mla_oracle_mass_k<k>")
    for k in mass_ks (default: every k). arm "dsa" (a DSA model at top-k ks[0]): the attention mass on its
    indexer's keys and on the oracle's ("indexer_mass", "oracle_mass", "indexer_recall_of_oracle", per bucket
    "_b<j>") and its test LM loss with oracle top-k instead of its indexer ("oracle_test_loss")."""
    from glm5_jax.attention.selection import mass_beyond
    from glm5_jax.eval.evaluator import evaluate
    from glm5_jax.eval.metrics import attention_mass
    buckets = mass_buckets(test_lm[0]["tokens"].shape[1])

    def fn(params):
        out = {}
        if arm == "mla":
            for k in ks:
                c, p = as_oracle(dsa_cfg, k, params)
                out[f"oracle_test_loss_k{k}"] = evaluate(c, p, test_lm)["eval_loss"]
                if mass_ks is None or k in mass_ks:
                    out[f"mla_oracle_mass_k{k}"] = mass_beyond(attention_mass(c, p, mass_lm, buckets), 0)["oracle_mass"]
        else:
            (k,) = ks
            out.update(mass_row("", attention_mass(dsa_cfg.replace(index_topk=k), params, mass_lm, buckets)))
            oc, op = as_oracle(dsa_cfg, k, params)
            out["oracle_test_loss"] = evaluate(oc, op, test_lm)["eval_loss"]
        return out
    return fn


__all__ = ["as_oracle", "decomposition_fn", "mass_buckets", "mass_row", "oracle_config", "time_attention"]
