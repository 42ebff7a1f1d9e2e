"""Host-side statistics of evaluations: loss per position bucket per window, token means with percentile
bootstrap intervals over windows, paired differences of two models on the same windows."""

from __future__ import annotations

import numpy as np


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
    clean = lambda a: [None if not np.isfinite(x) else float(x) for x in a]
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


def beyond_difference(a: tuple, b: tuple, cols, reps: int, seed: int = 0) -> dict:
    """paired_difference of a and b (each (sums, counts) per row and bucket) over the buckets `cols`
    (e.g. every position beyond a model's base length)."""
    return paired_difference(beyond(*a, cols), beyond(*b, cols), reps, seed)


def distance_curve(scores: list[dict], key, bins: np.ndarray) -> tuple[list, list]:
    """Mean of a per-probe quantity (pooled over seeds) in each distance bin -> (bin centres, means);
    scores: dicts with a "distance" array, key(score) -> the per-probe values."""
    d = np.concatenate([s["distance"] for s in scores])
    v = np.concatenate([key(s) for s in scores])
    xs, ys = [], []
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (d >= lo) & (d < hi)
        if m.any():
            xs.append(float((lo + hi) / 2))
            ys.append(float(v[m].mean()))
    return xs, ys


def metric_at(history: list[dict], step: int, key: str) -> float:
    """The value a run's metrics row recorded for `key` at `step` (its eval rows), else KeyError naming the
    steps that have it."""
    for row in history:
        if row.get("step") == step and key in row:
            return float(row[key])
    raise KeyError(f"no {key} recorded at step {step} (steps with it: {[r['step'] for r in history if key in r]})")


__all__ = ["beyond", "beyond_difference", "bucket_means_interval", "bucket_sums", "distance_curve", "metric_at",
           "paired_difference"]
