"""Intervals for run evidence, in one shape: {"mean", "lo", "hi", "n"} (lo = hi = None: no interval).
Student-t quantiles come from scipy.stats; experiments format intervals with fmt_interval."""

from __future__ import annotations

import math

from scipy import stats


def t95(dof: int) -> float:
    """The two-sided 95% Student-t quantile for `dof` degrees of freedom (12.706 at 1, 2.042 at 30, -> 1.960)."""
    return float(stats.t.ppf(0.975, dof))


def proportion_interval(successes: int, n: int, z: float = 1.96) -> dict:
    """successes / n with its 95% Wilson score interval (sound at 0 and 1, unlike p +- z*se)."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"proportion_interval: need 0 <= successes <= n and n >= 1, got successes={successes}, n={n}")
    p = successes / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5 / den
    return {"mean": p, "lo": max(0.0, mid - half), "hi": min(1.0, mid + half), "n": n}


def mean_interval(values) -> dict:
    """Mean over seeds (or any repeats) with a 95% Student-t interval; one value gives no interval
    (lo = hi = None), so a report says 'n=1' instead of inventing one."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_interval: no values")
    n = len(xs)
    m = sum(xs) / n
    if n == 1:
        return {"mean": m, "lo": None, "hi": None, "n": 1}
    sd = (sum((x - m) ** 2 for x in xs) / (n - 1)) ** 0.5
    half = t95(n - 1) * sd / n ** 0.5
    return {"mean": m, "lo": m - half, "hi": m + half, "n": n}


def per_seed_interval(values) -> dict:
    """mean_interval of per-seed values (e.g. a change from a shared start, or a paired difference), with
    the values themselves under "per_seed"."""
    d = [float(v) for v in values]
    return {**mean_interval(d), "per_seed": d}


def paired_seeds(a: dict, b: dict) -> dict | None:
    """a[seed] - b[seed] over the seeds both have and where both are finite, as per_seed_interval; None
    when there is no such seed."""
    d = [a[s] - b[s] for s in a if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
    return per_seed_interval(d) if d else None


def paired_interval(a, b, *, reps: int = 2000, seed: int = 0) -> dict:
    """mean(a - b) over paired items (e.g. per-probe correctness of two arms on the same probes) with a
    95% percentile bootstrap interval over items; n = the number of items."""
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size == 0:
        raise ValueError(f"paired_interval: need two equal-length 1-d samples, got {a.shape} and {b.shape}")
    d = a - b
    idx = np.random.default_rng(seed).integers(0, d.size, size=(reps, d.size))
    boots = d[idx].mean(1)
    return {"mean": float(d.mean()), "lo": float(np.percentile(boots, 2.5)), "hi": float(np.percentile(boots, 97.5)),
            "n": int(d.size)}


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """(lo, hi) of proportion_interval (the tuple form, kept for callers not yet moved to the dict)."""
    iv = proportion_interval(successes, n, z)
    return iv["lo"], iv["hi"]


def paired_bootstrap_interval(a, b, *, reps: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(diff, lo, hi) of paired_interval (the tuple form, kept for callers not yet moved to the dict)."""
    iv = paired_interval(a, b, reps=reps, seed=seed)
    return iv["mean"], iv["lo"], iv["hi"]


def trajectory_bands(histories: list[list[dict]], key: str) -> dict:
    """{"steps", "mean", "lo", "hi"} of `key` at the steps every history recorded it: the mean over runs
    with a 95% t interval (lo = hi = mean for one run)."""
    per = [{r["step"]: r[key] for r in h if key in r} for h in histories]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    ivs = [mean_interval([p[st] for p in per]) for st in steps]
    return {"steps": steps, "mean": [iv["mean"] for iv in ivs],
            "lo": [iv["mean"] if iv["lo"] is None else iv["lo"] for iv in ivs],
            "hi": [iv["mean"] if iv["hi"] is None else iv["hi"] for iv in ivs]}


def fmt_interval(x, lo=None, hi=None, digits: int = 3) -> str:
    """'0.812 [0.760, 0.856]' (or '0.812 (n=1)' when there is no interval); x is an interval dict, or a
    value with its lo and hi; None (no interval at all) gives '-'."""
    if x is None:
        return "-"
    if isinstance(x, dict):
        x, lo, hi = x["mean"], x["lo"], x["hi"]
    if lo is None or hi is None:
        return f"{x:.{digits}f} (n=1)"
    return f"{x:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"
