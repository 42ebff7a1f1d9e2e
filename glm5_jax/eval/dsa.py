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



def gap_pct(dsa_loss: float, mla_loss: float) -> float:
    return 100.0 * (dsa_loss - mla_loss) / mla_loss


def decomposition_entry(dsa_hists: list, mla_hists: list, k: int, step: int, buckets, interval) -> dict:
    """One gap-decomposition entry from the evaluations (decomposition_fn) each seed's DSA run (top-k k) and
    dense MLA run recorded at `step` (their metrics rows): the whole gap % (DSA with its indexer), the oracle
    gap (MLA with oracle top-k: sparsity itself), their paired difference (the indexer's choice), the DSA
    model's gap with oracle top-k instead of its indexer, and the attention mass figures. interval(values) ->
    {"mean", "lo", "hi", "n"} over seeds (glm5_jax.intervals.mean_interval)."""
    from glm5_jax.eval.stats import metric_at
    mla = [metric_at(h, step, "test_loss") for h in mla_hists]
    og = [gap_pct(metric_at(h, step, f"oracle_test_loss_k{k}"), m) for h, m in zip(mla_hists, mla)]
    ig = [gap_pct(metric_at(h, step, "test_loss"), m) for h, m in zip(dsa_hists, mla)]
    dg = [gap_pct(metric_at(h, step, "oracle_test_loss"), m) for h, m in zip(dsa_hists, mla)]
    per = lambda key: [metric_at(h, step, key) for h in dsa_hists]  # noqa: E731
    im, om, rc = per("indexer_mass"), per("oracle_mass"), per("indexer_recall_of_oracle")
    rows = [next((r for r in h if r.get("step") == step and "test_loss" in r), {}) for h in mla_hists]
    mom = [r.get(f"mla_oracle_mass_k{k}") for r in rows]
    mom = None if any(v is None for v in mom) else float(np.mean(mom))
    sel = [i - o for i, o in zip(ig, og)]
    bucket = lambda key: [float(np.mean([metric_at(h, step, f"{key}_b{j}") for h in dsa_hists]))  # noqa: E731
                          for j in range(len(buckets))]
    o_iv, s_iv = interval(og), interval(sel)
    return {"topk": k, "adaptation_steps": step,
            "oracle_gap_pct": o_iv, "oracle_gap_pct_per_seed": og,
            "indexer_gap_pct": interval(ig), "indexer_gap_pct_per_seed": ig,
            "selection_cost_pct": s_iv, "dsa_oracle_gap_pct": interval(dg),
            "selection_cost_same_params_pct": interval([i - d for i, d in zip(ig, dg)]),
            "oracle_mass": float(np.mean(om)), "oracle_mass_interval": interval(om),
            "indexer_mass": float(np.mean(im)), "indexer_mass_interval": interval(im),
            "indexer_recall_of_oracle": float(np.mean(rc)), "mla_oracle_mass": mom,
            "mass_by_bucket": {"buckets": [list(b) for b in buckets], "indexer": bucket("indexer_mass"),
                               "oracle": bucket("oracle_mass")},
            "dominant": "sparsity" if o_iv["mean"] >= s_iv["mean"] else "indexer"}



def lossless_verdict(gap: dict, margin: float) -> tuple[str, str]:
    """(verdict, one sentence) for the primary gap's interval against the +-margin fixed before the run."""
    m, lo, hi = gap["mean"], gap["lo"], gap["hi"]
    if lo is None:
        return "undetermined", (f"With one seed there is no interval, so this run cannot say whether DSA is lossless "
                                f"(gap {m:+.2f}%).")
    iv = f"{m:+.2f}% [{lo:+.2f}, {hi:+.2f}] over {gap['n']} seeds"
    if -margin <= lo and hi <= margin:
        return "lossless", (f"DSA is lossless here within the +-{margin:g}% margin fixed before the run: its test "
                            f"LM loss is {iv} from continued MLA's.")
    if lo > 0:
        return "worse", (f"DSA is not lossless here: its test LM loss is above continued MLA's by {iv} "
                         f"(the interval excludes 0{' and exceeds the margin' if lo > margin else ''}).")
    if hi < 0:
        return "better", f"DSA's test LM loss is below continued MLA's by {iv} (the interval excludes 0)."
    return "inconclusive", (f"Inconclusive: the gap {iv} includes 0 but reaches beyond the +-{margin:g}% margin, so "
                            "this run neither shows DSA lossless nor shows a loss.")



def attention_flops(mla_cfg: ModelConfig, dsa_cfg: ModelConfig, seq_len: int) -> dict:
    """Forward attention FLOPs per token of dense MLA vs DSA (+ its indexer) at seq_len (glm5_jax.flops)."""
    from glm5_jax.flops import estimate
    em, ed = estimate(mla_cfg, seq_len), estimate(dsa_cfg, seq_len)
    return {"dense_mla_attention_fwd_per_token": em["attention_flops_per_token_fwd"],
            "dsa_attention_fwd_per_token": ed["attention_flops_per_token_fwd"],
            "dsa_indexer_fwd_per_token": ed["indexer_flops_per_token_fwd"],
            "dense_over_dsa": em["attention_flops_per_token_fwd"] /
            (ed["attention_flops_per_token_fwd"] + ed["indexer_flops_per_token_fwd"]),
            "train_flops_per_token_mla": em["train_flops_per_token"], "train_flops_per_token_dsa": ed["train_flops_per_token"]}

__all__ = ["as_oracle", "attention_flops", "decomposition_entry", "decomposition_fn", "gap_pct", "lossless_verdict", "mass_buckets", "mass_row", "oracle_config", "time_attention"]
