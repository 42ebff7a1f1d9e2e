"""dsa_vs_mla's phase plan (no training): `--steps N` scales every phase by N / train.steps with a
floor of one step, and the continued phases run at the base's final learning rate instead of
restarting the schedule at its peak. Closed forms: round(k * N / 150) steps for the tiny config's
1200 / 30 / 150 phases; cosine end = peak * min_lr_ratio."""

import numpy as np
import pytest

from experiments import registry
from experiments.dsa_vs_mla import TINY, lr_schedule, phase_plan
from experiments.report import chain_series
from glm5_jax.config import ConfigError


def _resolve(steps=None, **overrides):
    return registry.resolve_config(registry.get("dsa_vs_mla"), "tiny", overrides, steps)


def test_default_plan_keeps_the_configured_phase_lengths():
    plan = phase_plan(_resolve(mha_arm="true"))
    assert plan["scale"] == 1.0
    assert {k: v.steps for k, v in plan.items() if k != "scale"} == {
        "base": 1200, "mla": 150, "dsa_warmup": 30, "dsa": 150, "mha": 1350}
    assert plan["base"].warmup_steps == 50 and plan["base"].eval_every == 200


@pytest.mark.parametrize("n", [1, 2, 15, 300])
def test_steps_flag_scales_every_phase_by_n_over_train_steps_with_floor_1(n):
    cfg = _resolve(steps=n, mha_arm="true")
    plan = phase_plan(cfg)
    f = n / 150
    assert plan["scale"] == pytest.approx(f)
    want = {"base": max(1, round(1200 * f)), "mla": n, "dsa": n, "dsa_warmup": max(1, round(30 * f))}
    want["mha"] = want["base"] + n
    assert {k: v.steps for k, v in plan.items() if k != "scale"} == want
    assert plan["base"].warmup_steps == max(1, round(50 * f))
    assert plan["base"].eval_every == max(1, round(200 * f)) and plan["mla"].eval_every == max(1, round(200 * f))
    assert plan["mla"].warmup_steps == min(max(1, round(10 * f)), n)
    assert all(v.steps >= 1 for k, v in plan.items() if k != "scale")


def test_steps_2_smoke_run_is_short():
    plan = phase_plan(_resolve(steps=2))
    assert plan["base"].steps == 16 and plan["dsa_warmup"].steps == 1 and plan["mla"].steps == plan["dsa"].steps == 2


def test_set_train_steps_changes_only_the_continued_phases():
    plan = phase_plan(_resolve(**{"train.steps": "300"}))
    assert plan["scale"] == 1.0 and plan["base"].steps == 1200 and plan["dsa_warmup"].steps == 30
    assert plan["mla"].steps == plan["dsa"].steps == 300


def test_steps_field_rejects_zero():
    with pytest.raises(ConfigError, match="steps"):
        _resolve(steps=0)


def test_continued_phases_run_at_the_base_final_rate_not_the_peak():
    plan = phase_plan(TINY)
    peak, r = TINY.train.learning_rate, TINY.train.min_lr_ratio
    final = peak * r                                           # cosine end: peak * (r + (1 - r) * (1 + cos pi) / 2)
    base_lr = np.asarray(lr_schedule(plan["base"])(np.arange(plan["base"].steps + 1)))
    np.testing.assert_allclose(base_lr[-1], final, rtol=1e-6)
    np.testing.assert_allclose(base_lr.max(), peak, rtol=1e-6)
    for arm in ("mla", "dsa"):
        tc = plan[arm]
        lr = np.asarray(lr_schedule(tc)(np.arange(tc.steps)))
        w = tc.warmup_steps
        # linear warm-up to the base's final rate ((s + 1) / w of it), then constant: no restart at the peak
        np.testing.assert_allclose(lr[:w], final * (np.arange(w) + 1) / w, rtol=1e-5)
        np.testing.assert_allclose(lr[w:], final, rtol=1e-5)
        assert lr.max() <= final * (1 + 1e-5) < peak
    assert plan["dsa"].indexer_loss == "sparse" and plan["mla"].indexer_loss is None
    w = plan["dsa_warmup"]
    assert w.trainable_pattern == "indexer" and w.learning_rate == TINY.indexer_learning_rate


def test_chain_series_lays_phases_end_to_end():
    a = [{"step": 5, "eval_loss": 3.0}, {"step": 10, "eval_loss": 2.0}, {"step": 7, "loss": 9.0}]
    b = [{"step": 2, "eval_loss": 1.5}]
    assert chain_series([(a, 10), (b, 4)], start=100) == ([105, 110, 112], [3.0, 2.0, 1.5])
