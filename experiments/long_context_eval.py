"""long_context's measurements: held-out loss per position bucket with bootstrap intervals, and the passkey
probe (one planted key and value in held-out filler, asked for at the end) packed into windows of the last
stage length, scored by exact match, value-digit loss and (DSA) the indexer's recall of the value's tokens.

`cfg` below is an experiments.long_context.LongContextConfig (read for its passkey and data settings)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from experiments.dsa_vs_mla import answer_key_hits, topk_indices_fn
from glm5_jax.config import ModelConfig
from glm5_jax.data.retrieval import TEST_TAG, RetrievalTask
from glm5_jax.model import GLM5


def eval_fn(cfg: ModelConfig):
    """jit (params, batch) -> ([B, T] next-token loss, 0 where loss_mask is 0; [B, T] argmax prediction): one
    program per model serves both the position losses and the passkey probes."""
    model = GLM5(cfg)

    def f(params, b):
        logits = model.apply({"params": params}, b["tokens"], b["positions"], b["segment_ids"])["logits"]
        logits = logits.astype(jnp.float32)
        tgt = jnp.take_along_axis(logits, b["targets"][..., None], axis=-1)[..., 0]
        nll = (jax.nn.logsumexp(logits, axis=-1) - tgt) * b["loss_mask"].astype(jnp.float32)
        return nll, jnp.argmax(logits, axis=-1)
    return jax.jit(f)


def bucket_sums(nll: np.ndarray, mask: np.ndarray, positions: np.ndarray, buckets) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the summed loss and the token count of each position bucket [lo, hi) (a token's position is
    its offset in its document within the window: the context it sees) -> ([rows, buckets], [rows, buckets])."""
    nll, mask, positions = np.asarray(nll, np.float64), np.asarray(mask) > 0, np.asarray(positions)
    sums = np.zeros((nll.shape[0], len(buckets)))
    counts = np.zeros((nll.shape[0], len(buckets)))
    for j, (lo, hi) in enumerate(buckets):
        m = mask & (positions >= lo) & (positions < hi)
        sums[:, j] = np.where(m, nll, 0.0).sum(-1)
        counts[:, j] = m.sum(-1)
    return sums, counts


def _ratio(sums, counts):
    s, c = sums.sum(0), counts.sum(0)
    return np.where(c > 0, s / np.maximum(c, 1), np.nan)


def bucket_means_interval(sums, counts, reps: int, seed: int = 0) -> dict:
    """Token-mean loss per bucket with a 95% percentile bootstrap interval over rows (windows)."""
    idx = np.random.default_rng(seed).integers(0, len(sums), size=(reps, len(sums)))
    boots = np.stack([_ratio(sums[i], counts[i]) for i in idx])
    with np.errstate(all="ignore"):
        lo, hi = np.nanpercentile(boots, 2.5, axis=0), np.nanpercentile(boots, 97.5, axis=0)
    clean = lambda a: [None if not np.isfinite(x) else float(x) for x in a]  # noqa: E731
    return {"mean": clean(_ratio(sums, counts)), "lo": clean(lo), "hi": clean(hi),
            "tokens": [int(x) for x in counts.sum(0)]}


def beyond(sums, counts, cols) -> tuple[np.ndarray, np.ndarray]:
    """Per-row sums and counts over the buckets `cols` (e.g. every position >= 128)."""
    return sums[:, cols].sum(1, keepdims=True), counts[:, cols].sum(1, keepdims=True)


def paired_difference(a: tuple, b: tuple, reps: int, seed: int = 0) -> dict:
    """Token-mean loss of a minus that of b on the same rows (each (sums, counts) of shape [rows, 1]), with a
    95% paired bootstrap interval over rows."""
    (sa, ca), (sb, cb) = a, b
    diff = float(_ratio(sa, ca)[0] - _ratio(sb, cb)[0])
    idx = np.random.default_rng(seed).integers(0, len(sa), size=(reps, len(sa)))
    boots = np.array([_ratio(sa[i], ca[i])[0] - _ratio(sb[i], cb[i])[0] for i in idx])
    return {"diff": diff, "lo": float(np.nanpercentile(boots, 2.5)), "hi": float(np.nanpercentile(boots, 97.5)),
            "a": float(_ratio(sa, ca)[0]), "b": float(_ratio(sb, cb)[0])}


def position_losses(f, params, batches, buckets) -> tuple[np.ndarray, np.ndarray]:
    """([windows, buckets] summed loss, token counts) of the model `f` (eval_fn) on the batches."""
    out = [bucket_sums(np.asarray(f(params, {k: jnp.asarray(v) for k, v in b.items()})[0]), b["loss_mask"],
                       b["positions"], buckets) for b in batches]
    return np.concatenate([s for s, _ in out]), np.concatenate([c for _, c in out])


def passkey_offset(task: RetrievalTask, depth: float) -> int:
    """The record's window index for a key at `depth` (0: the first token, 1: as late as the layout allows)."""
    return int(round(depth * task.max_offset))


def passkey_probes(tokenizer, filler: np.ndarray, cfg, seed: int) -> tuple[list, list]:
    """passkey_per_cell probes per (length L, depth): one planted key and value in held-out filler (TEST_TAG),
    asked for at the end; scored on the value's digits, exact match. Probes are packed into windows of the
    last stage length as separate segments (positions from 0, attention never crosses a segment), so one
    program per model scores every length -> (batches [eval_batch, T_last], placements [(row in the
    concatenated batches, start, L, depth, RetrievalInfo)])."""
    d, TL = cfg.data, cfg.last_len
    probes = []
    for L in cfg.passkey_lengths:
        task = RetrievalTask(tokenizer, filler, L, n_pairs=1, key_digits=d.retrieval_key_digits,
                             value_digits=d.retrieval_value_digits, min_distance=0)
        for j, depth in enumerate(cfg.passkey_depths):
            for r in range(cfg.passkey_per_cell):
                ex, info = task.example(seed, TEST_TAG, 10_000 * L + j * cfg.passkey_per_cell + r, "eval",
                                        offset=passkey_offset(task, depth))
                probes.append((L, depth, ex, info))
    rows, placements, fill = [], [], None
    for L, depth, ex, info in probes:                      # first fit, in order
        if fill is None or fill + L > TL:
            rows.append({k: np.zeros([TL], np.int32) for k in ex})
            fill = 0
        row = rows[-1]
        for k, v in ex.items():
            row[k][fill:fill + L] = v
        row["segment_ids"][fill:fill + L] = 1 + (row["segment_ids"].max() if fill else 0)
        placements.append((len(rows) - 1, fill, L, depth, info))
        fill += L
    B = cfg.eval_batch
    while len(rows) % B:
        rows.append({k: np.zeros([TL], np.int32) for k in rows[0]})
    batches = [{k: np.stack([r[k] for r in rows[s:s + B]]) for k in rows[0]} for s in range(0, len(rows), B)]
    return batches, placements


def passkey_scores(placements, preds: np.ndarray, targets: np.ndarray, indices: dict | None, value_digits: int):
    """Per probe: exact match of its value (the argmax at its answer positions) and, given the DSA layers'
    top-k key indices [rows, T, K], the fraction of the value's digits whose planted token is selected at
    the position that predicts it (dsa_vs_mla.answer_key_hits on the probe's slice, indices shifted)."""
    correct = np.array([all(preds[r, s + a] == targets[r, s + a] for a in info.answer_positions)
                        for r, s, _, _, info in placements], np.float64)
    recall = {}
    for layer, idx in (indices or {}).items():
        recall[layer] = np.concatenate([answer_key_hits(idx[r:r + 1, s:s + L] - s, [info], value_digits)
                                        for r, s, L, _, info in placements])
    return correct, recall


def score_passkey(model_cfg: ModelConfig, f, params, batches, placements, cfg) -> dict:
    """Passkey accuracy [length][depth], the loss on the value's digits by length (ln 10 = 2.303 is a uniform
    guess among digits: below it, the model uses the planted value), and for DSA the indexer's recall of the
    key's value tokens."""
    outs = [f(params, {k: jnp.asarray(v) for k, v in b.items()}) for b in batches]
    nll = np.concatenate([np.asarray(o[0]) for o in outs])
    preds = np.concatenate([np.asarray(o[1]) for o in outs])
    targets = np.concatenate([b["targets"] for b in batches])
    value_loss = np.array([np.mean([nll[r, s + a] for a in info.answer_positions]) for r, s, _, _, info in placements])
    indices = None
    if model_cfg.attention == "dsa":
        sel = topk_indices_fn(model_cfg)
        per = [sel(params, b) for b in batches]
        indices = {layer: np.concatenate([p[layer] for p in per]) for layer in per[0]}
    correct, recall = passkey_scores(placements, preds, targets, indices, cfg.data.retrieval_value_digits)
    lens = np.array([L for _, _, L, _, _ in placements])
    deps = np.array([d for _, _, _, d, _ in placements])

    def grid(v):
        return [[float(v[(lens == L) & np.isclose(deps, d)].mean()) for d in cfg.passkey_depths]
                for L in cfg.passkey_lengths]
    out = {"lengths": list(cfg.passkey_lengths), "depths": list(cfg.passkey_depths), "n_per_cell": cfg.passkey_per_cell,
           "accuracy": grid(correct), "overall": float(correct.mean()),
           "by_length": [float(correct[lens == L].mean()) for L in cfg.passkey_lengths],
           "by_depth": [float(correct[np.isclose(deps, d)].mean()) for d in cfg.passkey_depths],
           "value_digit_loss_by_length": [float(value_loss[lens == L].mean()) for L in cfg.passkey_lengths],
           "chance": 10.0 ** -cfg.data.retrieval_value_digits}
    if recall:
        out["indexer_key_recall"] = {layer: grid(v) for layer, v in recall.items()}
        out["indexer_key_recall_by_length"] = {layer: [float(v[lens == L].mean()) for L in cfg.passkey_lengths]
                                               for layer, v in recall.items()}
    return out


__all__ = ["beyond", "bucket_means_interval", "bucket_sums", "eval_fn", "paired_difference", "passkey_offset",
           "passkey_probes", "passkey_scores", "position_losses", "score_passkey"]
