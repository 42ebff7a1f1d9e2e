"""The evaluator's metrics beyond the LM loss: loss by position bucket, per-token outputs (probes), the DSA
indexer's selected keys and recall, MTP draft acceptance (teacher-forced), raw logits. Each is a frozen dataclass
(glm5_jax.eval.evaluator.Metric): its device part runs inside the one jitted forward, its reduce on the host."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from glm5_jax.eval.evaluator import Metric, split_stacks
from glm5_jax.eval.stats import bucket_sums


@dataclasses.dataclass(frozen=True)
class PositionLoss(Metric):
    """Loss per position bucket [lo, hi) (a token's position: its offset in its document within the window)
    -> {"<key>_sums", "<key>_counts": [rows, buckets] float64 (per window, for bootstrap intervals), "<key>":
    token means per bucket (None where empty)}. Per-token losses come to the host and are summed there in
    float64, so the per-window figures do not depend on the device reduction order."""
    buckets: tuple = ()
    key: str = "position_loss"

    def device(self, out, batch):
        return out["nll"] * out["mask"]

    def reduce(self, values, batches):
        parts = [bucket_sums(v, b["loss_mask"], b["positions"], self.buckets) for v, b in zip(values, batches)]
        sums, counts = np.concatenate([s for s, _ in parts]), np.concatenate([c for _, c in parts])
        s, c = sums.sum(0), counts.sum(0)
        return {f"{self.key}_sums": sums, f"{self.key}_counts": counts,
                self.key: [None if n == 0 else float(x / n) for x, n in zip(s, c)]}


@dataclasses.dataclass(frozen=True)
class TokenOutputs(Metric):
    """Per token, every row of every batch (concatenated in order): "token_nll" (masked) and "predictions"
    (argmax) -> the probes (retrieval, passkey) score them on the host."""

    def device(self, out, batch):
        return out["nll"] * out["mask"], out["pred"]

    def reduce(self, values, batches):
        return {"token_nll": np.concatenate([v[0] for v in values]),
                "predictions": np.concatenate([v[1] for v in values])}


@dataclasses.dataclass(frozen=True)
class RetrievalAccuracy(Metric):
    """Exact match over each row's answer positions (glm5_jax.data.retrieval) -> {"<key>": mean over batches of
    each batch's accuracy over rows with answers, "<key>_correct": per row}."""
    key: str = "retrieval_accuracy"

    def device(self, out, batch):
        return out["pred"]

    def reduce(self, values, batches):
        from glm5_jax.data.retrieval import retrieval_accuracy, retrieval_correct
        return {self.key: float(np.mean([retrieval_accuracy(p, b) for p, b in zip(values, batches)])),
                f"{self.key}_correct": np.concatenate([retrieval_correct(p, b) for p, b in zip(values, batches)])}


@dataclasses.dataclass(frozen=True)
class Logits(Metric):
    """The raw logits ("logits" [rows, T, V]) and with mtp=True the MTP depths' ("mtp_logits" [depth, rows, T, V])."""
    mtp: bool = False

    @property
    def forward(self):
        return "mtp" if self.mtp else "plain"

    def device(self, out, batch):
        return (out["logits"], out["mtp_logits"]) if self.mtp else (out["logits"],)

    def reduce(self, values, batches):
        out = {"logits": np.concatenate([v[0] for v in values])}
        if self.mtp:
            out["mtp_logits"] = np.concatenate([v[1] for v in values], axis=1)
        return out


@dataclasses.dataclass(frozen=True)
class TopKIndices(Metric):
    """The [rows, T, K] key indices each DSA attention layer selected (-1: none) -> {"topk_indices": {layer:
    indices}} (a scanned stack's layers as path[r])."""
    forward = "attention"

    def device(self, out, batch):
        flat = traverse_util.flatten_dict(out["intermediates"])
        return {"/".join(k[:-2]): v[0][1] for k, v in flat.items() if k[-1] == "__call__" and v[0][1] is not None}

    def reduce(self, values, batches):
        per = [split_stacks(v) for v in values]
        return {"topk_indices": {layer: np.concatenate([p[layer] for p in per]) for layer in (per[0] if per else {})}}


@dataclasses.dataclass(frozen=True)
class IndexerRecall(Metric):
    """Recall of the true (head-summed main attention) top-k keys by the DSA indexer's top-k, mean over layers
    per batch, then over batches -> {"indexer_recall"}."""
    forward = "indexer_dense"

    def device(self, out, batch):
        flat = traverse_util.flatten_dict(out["intermediates"])
        # one value per layer; a scanned stack sows [repeats] values under one path
        return jnp.mean(jnp.concatenate([jnp.ravel(v[0]) for k, v in flat.items() if k[-1] == "indexer_recall"]))

    def reduce(self, values, batches):
        return {"indexer_recall": float(np.mean([float(v) for v in values]))}


@dataclasses.dataclass(frozen=True)
class MTPAcceptance(Metric):
    """MTP drafts on held-out text (teacher forcing; the model config's mtp_depth >= num_draft): per-depth top-1
    accuracy of depth k at position t against the true token t+k+1, and the oracle acceptance length = mean over
    positions (where all depths stay in the document) of 1 + the longest prefix of correct depths, i.e. the
    acceptance length of drafting against a target that emits the held-out text. "oracle_per_sequence": the same
    mean within each row of the batches, in order."""
    num_draft: int = 1
    forward = "mtp"

    def device(self, out, batch):
        from glm5_jax.mtp import mtp_targets
        hits, masks = [], []
        for k in range(self.num_draft):
            t, m = mtp_targets(batch["targets"], batch["loss_mask"], batch["segment_ids"], k + 1)
            hits.append((jnp.argmax(out["mtp_logits"][k], -1) == t).astype(jnp.float32))
            masks.append(m.astype(jnp.float32))
        hits, masks = jnp.stack(hits), jnp.stack(masks)                    # [n, B, T]
        acc = jnp.sum(hits * masks, axis=(1, 2)), jnp.sum(masks, axis=(1, 2))
        chain = jnp.cumprod(hits, axis=0)                                     # [n, B, T]
        run = 1.0 + jnp.sum(chain, axis=0)                                    # [B, T]
        full = masks[-1]                                                      # all depths in the document
        return acc, (jnp.sum(run * full, axis=1), jnp.sum(full, axis=1)), jnp.sum(chain * full, axis=(1, 2))

    def reduce(self, values, batches):
        nd = self.num_draft
        hit, cnt, ch = np.zeros(nd), np.zeros(nd), np.zeros(nd)
        row_sum, row_cnt = [], []
        for (h, c), (r, n), cd in values:
            hit, cnt, ch = hit + np.asarray(h), cnt + np.asarray(c), ch + np.asarray(cd)
            row_sum.append(np.asarray(r, np.float64))
            row_cnt.append(np.asarray(n, np.float64))
        rs, rc = np.concatenate(row_sum), np.concatenate(row_cnt)
        return {"oracle_acceptance_length": float(rs.sum() / max(rc.sum(), 1.0)),
                "draft_accuracy_by_depth": [float(x) for x in hit / np.maximum(cnt, 1.0)],
                # teacher-forced acceptance per depth: P(drafts 1..k all equal the held-out tokens)
                "oracle_acceptance_by_depth": [float(x) for x in ch / max(rc.sum(), 1.0)],
                "oracle_per_sequence": np.where(rc > 0, rs / np.maximum(rc, 1.0), np.nan)}


@dataclasses.dataclass(frozen=True)
class AttentionMass(Metric):
    """Per DSA layer and query-position bucket [lo, hi): token means of the head-averaged dense softmax mass on
    the selected keys, on the oracle's keys and the recall of the oracle's keys (glm5_jax.eval.selection;
    the model config needs dsa_selection_stats=True: `attention_mass` below sets it) -> {"attention_mass":
    {"buckets", "tokens", "layers": {layer: {stat: [per bucket]}}, "mean": over layers}}; sums in float64 on
    the host. Tokens with loss_mask 0 are left out."""
    buckets: tuple = ()
    forward = "intermediates"

    def device(self, out, batch):
        from glm5_jax.eval.selection import STATS
        flat = traverse_util.flatten_dict(out["intermediates"])
        return {("/".join(k[:-1]), k[-1]): v[0] for k, v in flat.items() if k[-1] in STATS}

    def reduce(self, values, batches):
        from glm5_jax.eval.selection import KEYS, STATS
        sums: dict = {}
        counts = np.zeros(len(self.buckets))
        for v, b in zip(values, batches):
            pos = np.asarray(b["positions"])
            m = np.asarray(b.get("loss_mask", np.ones_like(pos))) > 0
            masks = [m & (pos >= lo) & (pos < hi) for lo, hi in self.buckets]
            counts += [mk.sum() for mk in masks]
            stats: dict = {}
            for (path, name), x in v.items():      # a scanned stack's [repeats, B, T] split as path[r]
                x = np.asarray(x, np.float64)
                for layer, y in ([(f"{path}[{r}]", x[r]) for r in range(x.shape[0])] if x.ndim == 3 else [(path, x)]):
                    stats.setdefault(layer, {})[name] = y
            for layer, st in stats.items():
                acc = sums.setdefault(layer, {n: np.zeros(len(self.buckets)) for n in STATS})
                for n in STATS:
                    acc[n] += [st[n][mk].sum() for mk in masks]
        if not sums:
            raise ValueError("attention_mass: the model sowed no selection stats (no DSA layer?)")
        mean = lambda a: [None if c == 0 else float(x / c) for x, c in zip(a, counts)]
        layers = {layer: {KEYS[n]: mean(acc[n]) for n in STATS} for layer, acc in sorted(sums.items())}
        avg = {KEYS[n]: mean(np.mean([acc[n] for acc in sums.values()], axis=0)) for n in STATS}
        return {"attention_mass": {"buckets": [list(b) for b in self.buckets], "tokens": [int(c) for c in counts],
                                   "layers": layers, "mean": avg}}


def attention_mass(cfg, params, batches, buckets) -> dict:
    """AttentionMass of a DSA model (its keys from cfg.dsa_topk_source) over the batches, through the evaluator."""
    from glm5_jax.config import ConfigError
    from glm5_jax.eval.evaluator import evaluate
    if cfg.attention != "dsa":
        raise ConfigError(f"attention_mass needs a DSA model config (attention='dsa'), got {cfg.attention!r}; "
                          "evaluate a dense MLA model's oracle with its params grafted onto the DSA config")
    return evaluate(cfg.replace(dsa_selection_stats=True), params, batches,
                    [AttentionMass(tuple(map(tuple, buckets)))])["attention_mass"]


__all__ = ["AttentionMass", "IndexerRecall", "Logits", "MTPAcceptance", "PositionLoss", "RetrievalAccuracy", "TokenOutputs",
           "TopKIndices", "attention_mass"]
