"""The distill_recovery experiment: skills, config validation, disjoint splits, a micro run's report keys."""

import json
import random

import pytest

from experiments import registry
from experiments.distill_recovery import skill_of, skill_task, splits
from glm5_jax.config import ConfigError

MICRO = {"model.d_model": "32", "model.num_heads": "2", "model.ffn_dim": "64", "model.q_lora_rank": "16",
         "model.kv_lora_rank": "16", "model.qk_nope_head_dim": "16", "model.v_head_dim": "16",
         "train.steps": "2", "train.batch_size": "2", "train.seq_len": "32", "train.eval_every": "2",
         "train.ckpt_every": "2", "rl_b.steps": "2", "rl_b.prompts_per_step": "2", "rl_b.group_size": "2",
         "distill.steps": "2", "distill.prompts_per_step": "4", "eval_every": "1", "test_tasks": "4", "val_tasks": "4",
         "test_tasks_b": "4", "val_tasks_b": "4"}


def test_skills_and_splits():
    rng = random.Random(0)
    a, b = skill_task(rng, "a"), skill_task(rng, "b")
    assert (skill_of(a), skill_of(b)) == ("a", "b") and b.prompt.endswith(":")
    cfg = registry.resolve_config(registry.get("distill_recovery"), "tiny", MICRO)
    sp = splits(cfg)
    prompts = [t.prompt for v, te in sp.values() for t in v + te]
    assert len(prompts) == len(set(prompts)) == 16
    with pytest.raises(ConfigError, match="max_prompt_len"):
        registry.resolve_config(registry.get("distill_recovery"), "tiny", {"rl_b.max_prompt_len": "8"})
    with pytest.raises(ConfigError, match="sft_b_share"):
        registry.resolve_config(registry.get("distill_recovery"), "tiny", {"sft_b_share": "1.0"})


@pytest.mark.slow   # SFT, two RL stages, generate compiles
def test_distill_recovery_micro_run_writes_report(tmp_path):
    exp = registry.get("distill_recovery")
    report = exp.run(registry.resolve_config(exp, "tiny", MICRO), str(tmp_path), log=lambda m: None)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    for stage in ("sft_a", "rl_b", "distill"):
        assert set(on_disk["stages"][stage]) == {"skill_a", "skill_b"}
    assert report["distill_steps"] == 2
    assert (tmp_path / "report.md").exists() and (tmp_path / "val_success.png").exists()
