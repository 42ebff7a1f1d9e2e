"""Retrieval and passkey probes scored through the evaluator: exact match of the planted value, its digits'
loss, and for DSA models whether the indexer selected the planted tokens (answer-key recall).

Retrieval probes (glm5_jax.data.retrieval.retrieval_probe_batches: [(batch, infos)]) are scored by
`score_probes`; passkey probes (one planted key and value per probe at a set depth, packed as segments into
windows of one length so one program scores every length) are built by `passkey_probes` and scored by
`score_passkey`."""

from __future__ import annotations

import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.data.retrieval import TEST_TAG, RetrievalTask
from glm5_jax.eval.evaluator import evaluate
from glm5_jax.eval.metrics import RetrievalAccuracy, TokenOutputs, TopKIndices


def answer_key_hits(indices: np.ndarray, infos, value_digits: int) -> np.ndarray:
    """[B] fraction of a probe's answer digits whose answer-bearing key (the planted record's value
    digit, the token the query must copy) is among the top-k keys selected at the position that
    predicts it. indices [B, T, K] (-1 = none); answer digit j is predicted at T - value_digits + j."""
    T = indices.shape[1]
    hits = np.zeros(len(infos))
    for b, info in enumerate(infos):
        for j in range(value_digits):
            hits[b] += float(np.any(indices[b, T - value_digits + j] == info.value_start + j))
    return hits / value_digits


def topk_indices(cfg: ModelConfig, params, batches) -> dict:
    """{layer: [rows, T, K] key indices the DSA indexer selected} over the batches (evaluator, TopKIndices)."""
    return evaluate(cfg, params, batches, [TopKIndices()])["topk_indices"]


def score_probes(cfg: ModelConfig, params, probes, value_digits: int) -> dict:
    """Per-probe correctness, distance and (DSA) per-layer answer-key recall on retrieval probes
    [(batch, infos)] -> {"correct", "distance", "answer_key_recall": {layer: per probe}}."""
    batches = [b for b, _ in probes]
    infos = [i for _, inf in probes for i in inf]
    metrics = [RetrievalAccuracy()] + ([TopKIndices()] if cfg.attention == "dsa" else [])
    r = evaluate(cfg, params, batches, metrics)
    out = {"correct": r["retrieval_accuracy_correct"].astype(np.float64),
           "distance": np.array([i.distance for i in infos])}
    out["answer_key_recall"] = {k: answer_key_hits(v, infos, value_digits) for k, v in r.get("topk_indices", {}).items()}
    return out


def passkey_offset(task: RetrievalTask, depth: float) -> int:
    """The record's window index for a key at `depth` (0: the first token, 1: as late as the layout allows)."""
    return int(round(depth * task.max_offset))


def passkey_probes(tokenizer, filler: np.ndarray, *, lengths, depths, per_cell: int, window: int, batch_size: int,
                   key_digits: int, value_digits: int, seed: int) -> tuple[list, list]:
    """per_cell probes per (length L, depth): one planted key and value in held-out filler (TEST_TAG), asked
    for at the end; scored on the value's digits, exact match. Probes are packed into windows of `window`
    tokens as separate segments (positions from 0, attention never crosses a segment), so one program per
    model scores every length -> (batches [batch_size, window], placements [(row in the concatenated
    batches, start, L, depth, RetrievalInfo)])."""
    probes = []
    for L in lengths:
        task = RetrievalTask(tokenizer, filler, L, n_pairs=1, key_digits=key_digits, value_digits=value_digits,
                             min_distance=0)
        for j, depth in enumerate(depths):
            for r in range(per_cell):
                ex, info = task.example(seed, TEST_TAG, 10_000 * L + j * per_cell + r, "eval",
                                        offset=passkey_offset(task, depth))
                probes.append((L, depth, ex, info))
    rows, placements, fill = [], [], None
    for L, depth, ex, info in probes:                      # first fit, in order
        if fill is None or fill + L > window:
            rows.append({k: np.zeros([window], np.int32) for k in ex})
            fill = 0
        row = rows[-1]
        for k, v in ex.items():
            row[k][fill:fill + L] = v
        row["segment_ids"][fill:fill + L] = 1 + (row["segment_ids"].max() if fill else 0)
        placements.append((len(rows) - 1, fill, L, depth, info))
        fill += L
    while len(rows) % batch_size:
        rows.append({k: np.zeros([window], np.int32) for k in rows[0]})
    batches = [{k: np.stack([r[k] for r in rows[s:s + batch_size]]) for k in rows[0]}
               for s in range(0, len(rows), batch_size)]
    return batches, placements


def passkey_scores(placements, preds: np.ndarray, targets: np.ndarray, indices: dict | None, value_digits: int):
    """Per probe: exact match of its value (the argmax at its answer positions) and, given the DSA layers'
    top-k key indices [rows, T, K], the fraction of the value's digits whose planted token is selected at
    the position that predicts it (answer_key_hits on the probe's slice, indices shifted)."""
    correct = np.array([all(preds[r, s + a] == targets[r, s + a] for a in info.answer_positions)
                        for r, s, _, _, info in placements], np.float64)
    recall = {}
    for layer, idx in (indices or {}).items():
        recall[layer] = np.concatenate([answer_key_hits(idx[r:r + 1, s:s + L] - s, [info], value_digits)
                                        for r, s, L, _, info in placements])
    return correct, recall


def score_passkey(model_cfg: ModelConfig, params, batches, placements, *, lengths, depths, per_cell: int,
                  value_digits: int) -> dict:
    """Passkey accuracy [length][depth], the loss on the value's digits by length (ln 10 = 2.303 is a uniform
    guess among digits: below it, the model uses the planted value), and for DSA the indexer's recall of the
    key's value tokens."""
    metrics = [TokenOutputs()] + ([TopKIndices()] if model_cfg.attention == "dsa" else [])
    r = evaluate(model_cfg, params, batches, metrics)
    nll, preds = r["token_nll"], r["predictions"]
    targets = np.concatenate([b["targets"] for b in batches])
    value_loss = np.array([np.mean([nll[rw, s + a] for a in info.answer_positions]) for rw, s, _, _, info in placements])
    correct, recall = passkey_scores(placements, preds, targets, r.get("topk_indices"), value_digits)
    lens = np.array([L for _, _, L, _, _ in placements])
    deps = np.array([d for _, _, _, d, _ in placements])

    def grid(v):
        return [[float(v[(lens == L) & np.isclose(deps, d)].mean()) for d in depths] for L in lengths]
    out = {"lengths": list(lengths), "depths": list(depths), "n_per_cell": per_cell,
           "accuracy": grid(correct), "overall": float(correct.mean()),
           "by_length": [float(correct[lens == L].mean()) for L in lengths],
           "by_depth": [float(correct[np.isclose(deps, d)].mean()) for d in depths],
           "value_digit_loss_by_length": [float(value_loss[lens == L].mean()) for L in lengths],
           "chance": 10.0 ** -value_digits}
    if recall:
        out["indexer_key_recall"] = {layer: grid(v) for layer, v in recall.items()}
        out["indexer_key_recall_by_length"] = {layer: [float(v[lens == L].mean()) for L in lengths]
                                               for layer, v in recall.items()}
    return out


__all__ = ["answer_key_hits", "passkey_offset", "passkey_probes", "passkey_scores", "score_passkey", "score_probes",
           "topk_indices"]
