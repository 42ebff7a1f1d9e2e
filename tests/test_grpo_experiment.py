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
