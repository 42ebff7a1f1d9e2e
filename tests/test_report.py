"""experiments/report.py: every interval has one shape {"mean", "lo", "hi", "n"}; the tuple forms kept for
older callers return the same numbers; per-seed differences and trajectory bands."""

import math

import pytest

from glm5_jax.intervals import (fmt_interval, mean_interval, paired_bootstrap_interval, paired_interval, paired_seeds,
                                per_seed_interval, proportion_interval, trajectory_bands, wilson_interval)

SHAPE = {"mean", "lo", "hi", "n"}


def test_every_interval_has_one_shape_and_the_tuple_forms_agree():
    p = proportion_interval(8, 10)
    assert set(p) == SHAPE and p["mean"] == 0.8 and p["n"] == 10
    assert (p["lo"], p["hi"]) == wilson_interval(8, 10)
    d = paired_interval([1, 1, 1, 0], [0, 0, 0, 0])
    assert set(d) == SHAPE and d["n"] == 4
    assert (d["mean"], d["lo"], d["hi"]) == paired_bootstrap_interval([1, 1, 1, 0], [0, 0, 0, 0])
    assert set(mean_interval([1.0, 2.0])) == SHAPE
    s = per_seed_interval([0.1, 0.2, 0.3])
    assert set(s) == SHAPE | {"per_seed"} and s["mean"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match="successes"):
        proportion_interval(3, 2)
    with pytest.raises(ValueError, match="equal-length"):
        paired_interval([1, 0], [1])


def test_paired_seeds_pairs_by_seed_and_skips_missing_or_non_finite():
    a = {"0": 1.0, "1": 2.0, "2": float("nan"), "3": 4.0}
    b = {"0": 0.5, "1": 1.0, "2": 1.0}
    d = paired_seeds(a, b)
    assert d["per_seed"] == [0.5, 1.0] and d["n"] == 2 and d["mean"] == pytest.approx(0.75)
    assert paired_seeds({"0": 1.0}, {"1": 1.0}) is None


def test_fmt_interval_takes_an_interval_or_its_numbers():
    iv = {"mean": 0.5, "lo": 0.25, "hi": 0.75, "n": 3}
    assert fmt_interval(iv) == fmt_interval(0.5, 0.25, 0.75) == "0.500 [0.250, 0.750]"
    assert fmt_interval(iv, digits=2) == "0.50 [0.25, 0.75]"
    assert fmt_interval(mean_interval([0.5])) == "0.500 (n=1)" and fmt_interval(None) == "-"


def test_trajectory_bands_at_the_steps_every_run_recorded():
    h1 = [{"step": 1, "x": 1.0}, {"step": 2, "x": 3.0}, {"step": 3, "y": 0.0}]
    h2 = [{"step": 1, "x": 3.0}, {"step": 2, "x": 5.0}]
    b = trajectory_bands([h1, h2], "x")
    assert b["steps"] == [1, 2] and b["mean"] == [2.0, 4.0]
    assert b["hi"][0] - 2.0 == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))
    assert trajectory_bands([], "x") == {"steps": [], "mean": [], "lo": [], "hi": []}
