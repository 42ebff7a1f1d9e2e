"""Long-context measurements of staged runs (used by experiments.long_context): position buckets cut at a length,
the held-out loss per position bucket of a model (kept by train.stages.cached_json, so a rerun skips it), a DSA
stage's kept checkpoints evaluated with their indexer and with oracle top-k (loss and attention mass), the
attention time and FLOPs of dense MLA vs DSA per length, and the report figures and table rows built from them
(before / after intervals, per-bucket differences, the gap of one adaptation length)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from glm5_jax.eval.selection import mass_beyond
from glm5_jax.config import ModelConfig
from glm5_jax.eval.dsa import as_oracle, attention_flops, oracle_config, time_attention
from glm5_jax.eval.evaluator import evaluate
from glm5_jax.eval.metrics import PositionLoss, attention_mass
from glm5_jax.eval.stats import beyond_difference, bucket_means_interval
from glm5_jax.train.stages import cached_json, stage_params


def cut_buckets(buckets, base_len: int, last_len: int) -> tuple[tuple[int, int], ...]:
    """Position buckets [lo, hi) cut at last_len (every position of a window of last_len is in one bucket, the
    last one ends there), with a boundary at base_len (so "beyond the base length" is a set of buckets)."""
    T0, TL = base_len, last_len
    out = []
    for lo, hi in buckets:
        if lo >= TL:
            break
        hi = min(hi, TL)
        out += [(lo, T0), (T0, hi)] if lo < T0 < hi else [(lo, hi)]
    return tuple(out[:-1]) + ((out[-1][0], TL),)


def position_loss(workdir, name: str, model_cfg: ModelConfig, params, *, key, batches, buckets):
    """Per window and bucket (sums, counts) of the held-out loss of (model_cfg, params) on `batches`, kept as
    workdir/evals/position_loss-<name> under `key`; `params` may be a function, called only when not cached."""
    def go():
        r = evaluate(model_cfg, params() if callable(params) else params, batches, [PositionLoss(buckets)])
        return {"sums": r["position_loss_sums"].tolist(), "counts": r["position_loss_counts"].tolist()}
    r = cached_json(workdir, f"position_loss-{name}", key, go)
    return np.asarray(r["sums"]), np.asarray(r["counts"])


def checkpoint_evaluations(workdir, name: str, dsa_cfg: ModelConfig, stage: dict, steps, *, key, batches,
                           mass_batches, buckets, mesh=None) -> dict:
    """{step: (position loss with the indexer, with oracle top-k (the same params), attention mass)} of a DSA
    stage (an entry of a train_stages result's "stages") at each of its kept checkpoints `steps`: cached as
    position_loss-<name><step>[-oracle] and mass-<name><step>; the params are read back only when not cached."""
    out, K, kw = {}, dsa_cfg.index_topk, dict(key=key, batches=batches, buckets=buckets)
    for L in steps:
        p_at = functools.lru_cache(maxsize=1)(lambda L=L: stage_params(dsa_cfg, stage["train_cfg"], stage["workdir"],
                                                                       mesh, L))
        pd = position_loss(workdir, f"{name}{L}", dsa_cfg, p_at, **kw)
        po = position_loss(workdir, f"{name}{L}-oracle", oracle_config(dsa_cfg, K),
                           lambda p_at=p_at: as_oracle(dsa_cfg, K, p_at())[1], **kw)
        m = cached_json(workdir, f"mass-{name}{L}", key, lambda: attention_mass(dsa_cfg, p_at(), mass_batches, buckets))
        out[L] = (pd, po, m)
    return out


def attention_cost(workdir, mla_cfg: ModelConfig, dsa_cfg: ModelConfig, lengths) -> tuple[dict, dict]:
    """({"T=<T>": wall time}, {"T=<T>": FLOPs per token}) of one attention layer, dense MLA vs DSA, per length
    (eval.dsa.time_attention, batch 1, kept as attention_time-<T>; eval.dsa.attention_flops)."""
    timing, flops = {}, {}
    for T in lengths:
        timing[f"T={T}"] = cached_json(workdir, f"attention_time-{T}", {"T": T, "model": dataclasses.asdict(dsa_cfg)},
                                       lambda T=T: time_attention(mla_cfg, dsa_cfg, T, 1, reps=2 if T <= 1024 else 1))
        flops[f"T={T}"] = attention_flops(mla_cfg, dsa_cfg, T)
    return timing, flops


def position_loss_figures(before: tuple, after: tuple, buckets, reps: int) -> dict:
    """Token-mean loss per bucket before and after (each (sums, counts) on the same windows) with their 95%
    bootstrap intervals and the tokens per bucket."""
    pb, pa = bucket_means_interval(*before, reps), bucket_means_interval(*after, reps)
    return {"buckets": [list(b) for b in buckets], "before": pb["mean"], "after": pa["mean"],
            "before_interval": [pb["lo"], pb["hi"]], "after_interval": [pa["lo"], pa["hi"]], "tokens": pa["tokens"]}


def bucket_differences(p: tuple, ref_means: list, reps: int) -> list:
    """Per bucket, the token-mean loss of p ((sums, counts)) minus ref_means (None where either has no tokens)."""
    return [None if a is None or b is None else a - b
            for a, b in zip(bucket_means_interval(*p, reps)["mean"], ref_means)]


def adaptation_entry(steps: int, dsa: tuple, oracle: tuple, mass: dict, ref: tuple, ref_means: list, cols, lo: int,
                     reps: int) -> dict:
    """The DSA gap after `steps` sparse-adaptation steps: the indexer's and oracle top-k's loss minus the dense
    reference's over the buckets `cols` (paired bootstrap) and per bucket, and the attention mass on the selected
    / oracle keys over positions >= lo (eval.selection.mass_beyond) and per bucket and layer."""
    fm = mass_beyond(mass, lo)
    return {"sparse_steps": steps, "gap": beyond_difference(dsa, ref, cols, reps),
            "oracle_gap": beyond_difference(oracle, ref, cols, reps),
            "indexer_mass": fm["selected_mass"], "oracle_mass": fm["oracle_mass"],
            "indexer_recall_of_oracle": fm["recall"],
            "gap_by_bucket": bucket_differences(dsa, ref_means, reps),
            "oracle_gap_by_bucket": bucket_differences(oracle, ref_means, reps),
            "mass_by_bucket": mass["mean"], "mass_by_layer": mass["layers"]}


def adaptation_bucket_rows(entries: list[dict]) -> list[list]:
    """Table rows of adaptation_entry's per-bucket figures: [sparse steps, figure, value per bucket] for the gap,
    the oracle gap (signed, 3 decimals), the indexer's and the oracle's mass ("n/a": no tokens in the bucket)."""
    fmt = lambda name, v: "n/a" if v is None else f"{v:+.3f}" if "gap" in name else f"{v:.3f}"
    return [[e["sparse_steps"], name] + [fmt(name, v) for v in vals] for e in entries
            for name, vals in (("gap", e["gap_by_bucket"]), ("oracle gap", e["oracle_gap_by_bucket"]),
                               ("indexer mass", e["mass_by_bucket"]["selected_mass"]),
                               ("oracle mass", e["mass_by_bucket"]["oracle_mass"]))]


def attention_cost_rows(timing: dict, flops: dict) -> list[list]:
    """Table rows of attention_cost: [shape, dense s, DSA s, dense / DSA, dense FLOPs, DSA (attention + indexer)
    FLOPs] per length."""
    return [[k, v["dense_mla"], v["sparse_dsa"], f"{v['dense_over_sparse']:.2f}x",
             f"{flops[k]['dense_mla_attention_fwd_per_token']:.3g}",
             f"{flops[k]['dsa_attention_fwd_per_token'] + flops[k]['dsa_indexer_fwd_per_token']:.3g}"]
            for k, v in timing.items()]


def passkey_rows(scores: dict) -> list[list]:
    """Table rows of {model: eval.probes.score_passkey}: [model, accuracy per length, overall accuracy, value-digit
    loss per length]."""
    return [[n] + [f"{x:.2f}" for x in s["by_length"]] + [f"{s['overall']:.3f}"]
            + [f"{x:.2f}" for x in s["value_digit_loss_by_length"]] for n, s in scores.items()]


__all__ = ["adaptation_bucket_rows", "adaptation_entry", "attention_cost", "attention_cost_rows", "bucket_differences",
           "checkpoint_evaluations", "cut_buckets", "passkey_rows", "position_loss", "position_loss_figures"]
