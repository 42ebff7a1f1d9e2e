"""dsa_vs_mla's phase plan and report logic (no training): `--steps N` scales every phase by
N / train.steps with a floor of one step, the continued phases run at the base's final learning rate
instead of restarting the schedule at its peak, and the short adaptation is the full one's prefix.
Closed forms: round(k * N / 120) steps for the tiny config's 320 / 30 / 120 / 40 phases; cosine end =
peak * min_lr_ratio."""

import numpy as np
import pytest

from experiments import registry
from experiments.dsa_vs_mla import TINY, phase_plan, topk_list
from glm5_jax.eval.dsa import gap_pct, lossless_verdict, recorded_test_loss
from experiments.report import chain_series
from glm5_jax.config import ConfigError


def _resolve(steps=None, **overrides):
    return registry.resolve_config(registry.get("dsa_vs_mla"), "tiny", overrides, steps)


def test_default_plan_keeps_the_configured_phase_lengths():
    plan = phase_plan(_resolve(mha_arm="true"))
    assert plan["scale"] == 1.0
    assert {k: v.steps for k, v in plan.items() if k != "scale"} == {
        "base": 320, "mla": 120, "dsa_warmup": 30, "dsa": 120, "dsa_short": 40, "mha": 440}
    assert plan["base"].warmup_steps == 50 and plan["base"].eval_every == 80
    # the continued phases are evaluated at every short adaptation length (the gap vs adaptation length)
    assert plan["mla"].eval_every == plan["dsa"].eval_every == 40


@pytest.mark.parametrize("n", [1, 2, 15, 300])
def test_steps_flag_scales_every_phase_by_n_over_train_steps_with_floor_1(n):
    cfg = _resolve(steps=n, mha_arm="true")
    plan = phase_plan(cfg)
    f = n / 120
    assert plan["scale"] == pytest.approx(f)
    short = min(max(1, round(40 * f)), n)
    want = {"base": max(1, round(320 * f)), "mla": n, "dsa": n, "dsa_warmup": max(1, round(30 * f)),
            "dsa_short": short}
    want["mha"] = want["base"] + n
    assert {k: v.steps for k, v in plan.items() if k != "scale"} == want
    assert plan["base"].warmup_steps == max(1, round(50 * f))
    assert plan["base"].eval_every == max(1, round(80 * f)) and plan["mla"].eval_every == short
    assert plan["mla"].warmup_steps == min(max(1, round(10 * f)), short)
    assert all(v.steps >= 1 for k, v in plan.items() if k != "scale")


def test_steps_2_smoke_run_is_short():
    plan = phase_plan(_resolve(steps=2))
    assert plan["base"].steps == 5 and plan["dsa_warmup"].steps == 1 and plan["mla"].steps == plan["dsa"].steps == 2
    assert plan["dsa_short"].steps == 1


def test_set_train_steps_changes_only_the_continued_phases():
    plan = phase_plan(_resolve(**{"train.steps": "300"}))
    assert plan["scale"] == 1.0 and plan["base"].steps == 320 and plan["dsa_warmup"].steps == 30
    assert plan["mla"].steps == plan["dsa"].steps == 300 and plan["dsa_short"].steps == 40


def test_steps_field_rejects_zero():
    with pytest.raises(ConfigError, match="steps"):
        _resolve(steps=0)


def test_continued_phases_run_at_the_base_final_rate_not_the_peak():
    plan = phase_plan(TINY)
    peak, r = TINY.train.learning_rate, TINY.train.min_lr_ratio
    final = peak * r                                           # cosine end: peak * (r + (1 - r) * (1 + cos pi) / 2)
    base_lr = np.asarray(plan["base"].schedule()(np.arange(plan["base"].steps + 1)))
    np.testing.assert_allclose(base_lr[-1], final, rtol=1e-6)
    np.testing.assert_allclose(base_lr.max(), peak, rtol=1e-6)
    for arm in ("mla", "dsa"):
        tc = plan[arm]
        lr = np.asarray(tc.schedule()(np.arange(tc.steps)))
        w = tc.warmup_steps
        # linear warm-up to the base's final rate ((s + 1) / w of it), then constant: no restart at the peak
        np.testing.assert_allclose(lr[:w], final * (np.arange(w) + 1) / w, rtol=1e-5)
        np.testing.assert_allclose(lr[w:], final, rtol=1e-5)
        assert lr.max() <= final * (1 + 1e-5) < peak
    assert plan["dsa"].indexer_loss == "sparse" and plan["mla"].indexer_loss is None
    w = plan["dsa_warmup"]
    assert w.trainable_pattern == "indexer" and w.learning_rate == TINY.indexer_learning_rate


def test_short_adaptation_is_the_prefix_of_the_full_one():
    # the top-k sweep's short runs and the full runs' step-S evaluations are the same measurement only if
    # the schedule of S steps equals the first S steps of the full schedule (constant after the warm-up)
    plan = phase_plan(TINY)
    full, short = plan["dsa"], plan["dsa_short"]
    assert short.replace(steps=full.steps) == full
    np.testing.assert_array_equal(np.asarray(short.schedule()(np.arange(short.steps))),
                                  np.asarray(full.schedule()(np.arange(short.steps))))


def test_topk_sweep_fractions_of_t():
    assert topk_list(TINY) == [8, 16, 32, 64]                        # 1/16 .. 1/2 of T = 128
    assert TINY.model.index_topk * 8 <= TINY.train.seq_len            # the primary top-k is at most T/8
    with pytest.raises(ConfigError, match="topk_fractions"):
        _resolve(topk_fractions="0.3")                                # 0.3 x 128 is not a whole number of keys
    with pytest.raises(ConfigError, match="topk_fractions"):
        _resolve(topk_fractions="0.125,0.125")
    with pytest.raises(ConfigError, match="short_adaptation_steps"):
        _resolve(short_adaptation_steps="121")                       # longer than the full adaptation


@pytest.mark.parametrize("gap, verdict", [
    ({"mean": 0.2, "lo": -0.5, "hi": 0.9, "n": 3}, "lossless"),         # inside +-1
    ({"mean": 2.0, "lo": 1.5, "hi": 2.5, "n": 3}, "worse"),             # excludes 0, above
    ({"mean": 0.6, "lo": 0.1, "hi": 1.1, "n": 3}, "worse"),             # excludes 0 though partly in the margin
    ({"mean": -2.0, "lo": -2.5, "hi": -1.5, "n": 3}, "better"),
    ({"mean": 0.5, "lo": -1.5, "hi": 2.5, "n": 3}, "inconclusive"),     # includes 0, exceeds the margin
    ({"mean": 0.5, "lo": None, "hi": None, "n": 1}, "undetermined"),
])
def test_lossless_verdict_reads_the_interval_against_the_margin(gap, verdict):
    v, sentence = lossless_verdict(gap, 1.0)
    assert v == verdict and sentence.count(".") >= 1


def test_gap_and_test_loss_lookup():
    assert gap_pct(4.1, 4.0) == pytest.approx(2.5)
    hist = [{"step": 50, "loss": 1.0}, {"step": 50, "test_loss": 3.0, "eval_loss": 2.9}, {"step": 100, "test_loss": 2.5}]
    assert recorded_test_loss(hist, 50) == 3.0 and recorded_test_loss(hist, 100) == 2.5
    with pytest.raises(KeyError, match="no test_loss recorded at step 75"):
        recorded_test_loss(hist, 75)


def test_chain_series_lays_phases_end_to_end():
    a = [{"step": 5, "eval_loss": 3.0}, {"step": 10, "eval_loss": 2.0}, {"step": 7, "loss": 9.0}]
    b = [{"step": 2, "eval_loss": 1.5}]
    assert chain_series([(a, 10), (b, 4)], start=100) == ([105, 110, 112], [3.0, 2.0, 1.5])


# ---- issue 45: where the gap comes from ------------------------------------------------------------------

def test_lr_choice_is_the_short_adaptation_at_another_rate():
    from experiments.dsa_vs_mla import lr_choice_plan
    plan, lr = phase_plan(TINY), lr_choice_plan(TINY)
    assert TINY.lr_choice_learning_rate == 3e-3 and plan["dsa"].learning_rate == pytest.approx(1e-3)
    assert lr == plan["dsa_short"].replace(learning_rate=3e-3)
    assert lr_choice_plan(_resolve(lr_choice_learning_rate="none")) is None
    with pytest.raises(ConfigError, match="lr_choice_learning_rate"):
        _resolve(lr_choice_learning_rate="0")


def test_mass_buckets_tile_the_sequence():
    from glm5_jax.eval.dsa import mass_buckets
    assert mass_buckets(128) == ((0, 16), (16, 32), (32, 64), (64, 128))
    assert mass_buckets(4) == ((0, 1), (1, 2), (2, 4))


def test_decomposition_entry_splits_the_gap_paired_by_seed():
    from glm5_jax.eval.dsa import decomposition_entry
    buckets = ((0, 64), (64, 128))
    mla = [[{"step": 40, "test_loss": 4.0, "oracle_test_loss_k16": 4.02, "mla_oracle_mass_k16": 0.7}],
           [{"step": 40, "test_loss": 5.0, "oracle_test_loss_k16": 5.05, "mla_oracle_mass_k16": 0.6}]]
    dsa = [[{"step": 40, "test_loss": 4.04, "oracle_test_loss": 4.01, "indexer_mass": 0.5, "oracle_mass": 0.8,
             "indexer_recall_of_oracle": 0.6, "indexer_mass_b0": 0.9, "indexer_mass_b1": 0.3,
             "oracle_mass_b0": 1.0, "oracle_mass_b1": 0.7}],
           [{"step": 40, "test_loss": 5.15, "oracle_test_loss": 5.0, "indexer_mass": 0.7, "oracle_mass": 0.9,
             "indexer_recall_of_oracle": 0.8, "indexer_mass_b0": 1.0, "indexer_mass_b1": 0.5,
             "oracle_mass_b0": 1.0, "oracle_mass_b1": 0.8}]]
    e = decomposition_entry(dsa, mla, 16, 40, buckets)
    # closed forms: oracle gaps 0.5% and 1.0%, indexer gaps 1.0% and 3.0%, their differences 0.5% and 2.0%
    np.testing.assert_allclose(e["oracle_gap_pct_per_seed"], [0.5, 1.0])
    np.testing.assert_allclose(e["indexer_gap_pct_per_seed"], [1.0, 3.0])
    assert e["oracle_gap_pct"]["mean"] == pytest.approx(0.75) and e["oracle_gap_pct"]["n"] == 2
    assert e["selection_cost_pct"]["mean"] == pytest.approx(1.25)
    assert e["oracle_gap_pct"]["lo"] < 0.75 < e["oracle_gap_pct"]["hi"]
    assert e["dsa_oracle_gap_pct"]["mean"] == pytest.approx((0.25 + 0.0) / 2)
    assert e["selection_cost_same_params_pct"]["mean"] == pytest.approx((0.75 + 3.0) / 2)
    assert e["indexer_mass"] == pytest.approx(0.6) and e["oracle_mass"] == pytest.approx(0.85)
    assert e["mla_oracle_mass"] == pytest.approx(0.65) and e["indexer_recall_of_oracle"] == pytest.approx(0.7)
    assert e["mass_by_bucket"] == {"buckets": [[0, 64], [64, 128]], "indexer": [0.95, 0.4], "oracle": [1.0, 0.75]}
    assert e["dominant"] == "indexer"
    del mla[0][0]["mla_oracle_mass_k16"]                         # measured at the primary top-k only: None elsewhere
    assert decomposition_entry(dsa, mla, 16, 40, buckets)["mla_oracle_mass"] is None
    with pytest.raises(KeyError, match="oracle_test_loss_k8"):
        decomposition_entry(dsa, mla, 8, 40, buckets)
