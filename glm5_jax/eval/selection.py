"""Where DSA's loss comes from: how much of the dense attention the selected keys carry (an evaluation of the
model, so it sits in glm5_jax.eval above the model; it was attention.selection, which imported the model).

`attention_mass(cfg, params, batches, buckets)` runs the model's own forward (a DSA config; its k keys from
cfg.dsa_topk_source) with `dsa_selection_stats` on, so every DSA layer sows per query (indexer.selection_stats):
  * selected_mass: the head-averaged dense softmax mass (what dense attention with these parameters would
    put) on the k keys the layer attends to;
  * oracle_mass: the same on the oracle's k keys (top-k of that mass: the most any k keys shared by the
    heads can carry), so 1 - oracle_mass is what sparsity itself must drop at this k;
  * recall: the fraction of the oracle's keys the selection holds.
Token means per layer and position bucket (a query's position = its offset in its document, the context
it sees; tokens with loss_mask 0 left out), and their mean over layers (`mass_beyond` for positions >= lo).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.model import GLM5

STATS = ("selected_mass", "oracle_mass", "oracle_recall")
KEYS = {"selected_mass": "selected_mass", "oracle_mass": "oracle_mass", "oracle_recall": "recall"}


@functools.lru_cache(maxsize=None)
def _stats_fn(cfg: ModelConfig):
    model = GLM5(cfg.replace(dsa_selection_stats=True))

    def f(p, b):
        _, st = model.apply({"params": p}, b["tokens"], b["positions"], b["segment_ids"], mutable=["intermediates"])
        flat = traverse_util.flatten_dict(st["intermediates"])
        return {("/".join(k[:-1]), k[-1]): v[0] for k, v in flat.items() if k[-1] in STATS}
    return jax.jit(f)


def layer_stats(cfg: ModelConfig, params, batch) -> dict:
    """{layer path: {stat: [B, T] numpy}} for one batch (a scanned stack's [repeats, ...] split as path[r])."""
    out: dict = {}
    for (path, name), v in _stats_fn(cfg)(params, {k: jnp.asarray(batch[k]) for k in
                                                   ("tokens", "positions", "segment_ids")}).items():
        v = np.asarray(v, np.float64)
        if v.ndim == 3:
            for r in range(v.shape[0]):
                out.setdefault(f"{path}[{r}]", {})[name] = v[r]
        else:
            out.setdefault(path, {})[name] = v
    return out


def attention_mass(cfg: ModelConfig, params, batches, buckets) -> dict:
    """Per DSA layer and position bucket [lo, hi): token means of selected_mass, oracle_mass and recall over
    the batches (dicts with tokens / positions / segment_ids, optional loss_mask) -> {"buckets", "tokens"
    (per bucket), "layers": {layer: {"selected_mass", "oracle_mass", "recall"}: [per bucket]}, "mean": the
    same averaged over layers}. A bucket without tokens gives None."""
    if cfg.attention != "dsa":
        raise ConfigError(f"attention_mass needs a DSA model config (attention='dsa'), got {cfg.attention!r}; "
                          "evaluate a dense MLA model's oracle with its params grafted onto the DSA config")
    sums: dict = {}
    counts = np.zeros(len(buckets))
    for b in batches:
        pos = np.asarray(b["positions"])
        m = np.asarray(b.get("loss_mask", np.ones_like(pos))) > 0
        masks = [m & (pos >= lo) & (pos < hi) for lo, hi in buckets]
        counts += [mk.sum() for mk in masks]
        for layer, st in layer_stats(cfg, params, b).items():
            acc = sums.setdefault(layer, {n: np.zeros(len(buckets)) for n in STATS})
            for n in STATS:
                acc[n] += [st[n][mk].sum() for mk in masks]
    if not sums:
        raise ConfigError("attention_mass: the model sowed no selection stats (no DSA layer?)")
    mean = lambda a: [None if c == 0 else float(x / c) for x, c in zip(a, counts)]
    layers = {layer: {KEYS[n]: mean(acc[n]) for n in STATS} for layer, acc in sorted(sums.items())}
    avg = {KEYS[n]: mean(np.mean([acc[n] for acc in sums.values()], axis=0)) for n in STATS}
    return {"buckets": [list(b) for b in buckets], "tokens": [int(c) for c in counts], "layers": layers, "mean": avg}


def mass_beyond(result: dict, lo: int) -> dict:
    """Token-weighted means over the buckets starting at or after position `lo`, averaged over layers:
    {"selected_mass", "oracle_mass", "recall", "tokens"}."""
    cols = [j for j, (a, _) in enumerate(result["buckets"]) if a >= lo and result["tokens"][j] > 0]
    if not cols:
        raise ValueError(f"mass_beyond: no tokens in buckets at or after position {lo} ({result['buckets']})")
    w = np.array([result["tokens"][j] for j in cols], np.float64)
    out = {k: float(np.dot([result["mean"][k][j] for j in cols], w) / w.sum()) for k in KEYS.values()}
    out["tokens"] = int(w.sum())
    return out
