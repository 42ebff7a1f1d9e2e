"""Micro end-to-end run of the grpo_icepop experiment: SFT -> three GRPO arms -> report.json/report.md."""

from __future__ import annotations

import pytest

import json
import os

from experiments.run import run_experiment
from tests.test_experiments import MICRO


@pytest.mark.slow   # ~2 min of compiles on 2 cores; the full experiment run is in BUILD_NOTES
def test_grpo_icepop_micro(tmp_path):
    wd = str(tmp_path / "grpo")
    report = run_experiment("grpo_icepop", wd, "tiny", MICRO["grpo_icepop"])
    with open(os.path.join(wd, "report.json")) as f:
        on_disk = json.load(f)
    assert set(on_disk["arms"]) == {"icepop", "none", "tis"}
    for arm in on_disk["arms"].values():
        assert 0.0 <= arm["initial_accuracy"] <= 1.0 and 0.0 <= arm["final_accuracy"] <= 1.0
        for k in ("greedy", "sampled"):
            assert 0.0 <= arm[f"initial_{k}_accuracy"] <= 1.0 and 0.0 <= arm[f"final_{k}_accuracy"] <= 1.0
        # the primary metric is the designated one of the two
        assert arm["initial_accuracy"] == arm[f"initial_{on_disk['primary_metric']}_accuracy"]
    assert report["arms"]["icepop"]["initial_accuracy"] == report["arms"]["tis"]["initial_accuracy"]
    for arm in on_disk["arms"].values():      # the headline: test prompts, with an interval
        iv = arm["test_final_accuracy_interval"]
        assert iv["lo"] <= arm["test_final_accuracy"] <= iv["hi"]
        assert arm["test_delta"] == pytest.approx(arm["test_final_accuracy"] - arm["test_initial_accuracy"])
        assert 0.0 <= arm["test_initial_greedy_accuracy"] <= 1.0
    assert "Primary metric" in open(os.path.join(wd, "report.md")).read()
    for name in ("report.md", "reward.png", "pop_frac.png", "mismatch_kl.png", "rl_icepop.jsonl"):
        assert os.path.exists(os.path.join(wd, name)), name
    rows = [json.loads(l) for l in open(os.path.join(wd, "rl_tis.jsonl"))]
    assert len(rows) == 2 and {"reward_mean", "pop_frac", "clip_frac", "mismatch_kl"} <= set(rows[0])


def test_dev_and_test_prompts_disjoint():
    from experiments.grpo_icepop import TINY, held_out
    cfg = TINY
    dev, test = held_out(cfg, "dev"), held_out(cfg, "test")
    assert len(dev) == cfg.eval_tasks and len(test) == cfg.test_tasks
    assert not {t.prompt for t in dev} & {t.prompt for t in test}
    assert len({t.prompt for t in test}) == len(test)
    assert [t.prompt for t in held_out(cfg, "test")] == [t.prompt for t in test]   # deterministic


def test_test_delta_interval_and_paired_differences_closed_form():
    """test_delta per seed = final - SFT accuracy, mean with a t interval over seeds (t(2) = 4.303); arm
    differences are paired by seed."""
    from experiments.grpo_icepop import paired_arm_differences
    from glm5_jax.intervals import per_seed_interval
    d = per_seed_interval([v - 0.4 for v in (0.5, 0.6, 0.7)])     # as the report's test_delta_interval
    assert d["per_seed"] == pytest.approx([0.1, 0.2, 0.3]) and d["mean"] == pytest.approx(0.2) and d["n"] == 3
    assert d["hi"] - d["mean"] == pytest.approx(4.303 * 0.1 / 3 ** 0.5, rel=2e-4)   # t(2) to 3 decimals
    one = per_seed_interval([0.5 - 0.4])
    assert one["lo"] is None and one["mean"] == pytest.approx(0.1)
    acc = lambda *v: {str(i): {"accuracy": x} for i, x in enumerate(v)}
    got = paired_arm_differences({"icepop": acc(0.5, 0.6, 0.7), "none": acc(0.4, 0.5, 0.6), "tis": acc(0.5, 0.5, 0.5)})
    assert set(got) == {"icepop - none", "tis - none", "icepop - tis"}
    # a constant per-seed gap: exact, zero-width interval although the seeds vary a lot
    assert got["icepop - none"]["mean"] == pytest.approx(0.1)
    assert got["icepop - none"]["hi"] - got["icepop - none"]["lo"] == pytest.approx(0.0, abs=1e-12)
    assert got["tis - none"]["per_seed"] == pytest.approx([0.1, 0.0, -0.1])
    assert paired_arm_differences({"icepop": acc(0.5)}) == {}


def test_training_signals_detect_collapse():
    """last10 reward well below the best 10-step mean marks a collapse; KL and pop fraction averaged."""
    from experiments.grpo_icepop import training_signals
    rew = [0.3] * 10 + [0.6] * 10 + [0.1] * 10
    h = [{"reward_mean": r, "mismatch_kl": 0.01 * (i + 1), "pop_frac": 0.5} for i, r in enumerate(rew)]
    s = training_signals(h)
    assert s["first_reward"] == 0.3 and s["max_reward"] == pytest.approx(0.6) and s["last10_reward"] == pytest.approx(0.1)
    assert s["mean_mismatch_kl"] == pytest.approx(0.155) and s["last10_mismatch_kl"] == pytest.approx(0.255)
    assert s["mean_pop_frac"] == 0.5
