"""experiments/report.py: every interval has one shape {"mean", "lo", "hi", "n"}; the tuple forms kept for
older callers return the same numbers; per-seed differences and trajectory bands."""

import math

import pytest

from glm5_jax.intervals import (fmt_interval, mean_interval, paired_bootstrap_interval, paired_interval, paired_seeds,
                                per_seed_interval, proportion_interval, t95, trajectory_bands, wilson_interval)

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
    assert b["hi"][0] - 2.0 == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2), rel=1e-4)   # t(1), 3 decimals
    assert trajectory_bands([], "x") == {"steps": [], "mean": [], "lo": [], "hi": []}


# The two-sided 95% Student-t table the project typed in by hand before issue 60 (3 decimals, 1..30 dof)
OLD_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
           2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def test_t_quantile_is_the_printed_table_and_tends_to_the_normal():
    """scipy's quantile rounds to the printed table for 1..30 degrees of freedom (so intervals over <= 31
    values move by < 1.2e-4 of their half-width), and tends to 1.960 (the table used 1.96 beyond 30)."""
    assert [round(t95(d), 3) for d in range(1, 31)] == list(OLD_T95)
    assert t95(31) < OLD_T95[-1] and 1.96 < t95(1000) < 1.9624 and t95(10 ** 7) == pytest.approx(1.959964, abs=1e-6)
    iv = mean_interval([1.0, 2.0, 4.0, 7.0])            # sd 2.6458, n 4: half = t(3) * sd / 2
    assert iv["hi"] - iv["mean"] == pytest.approx(OLD_T95[2] * (7 ** 0.5) / 2, rel=2e-4)
