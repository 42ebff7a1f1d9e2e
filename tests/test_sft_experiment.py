"""The `sft` experiment: its config checks, and a micro run that writes the report the issue asks for."""

import json

import pytest

from experiments import registry
from glm5_jax.config import ConfigError

MICRO = {"train.steps": "3", "train.batch_size": "2", "train.seq_len": "192", "train.eval_every": "3",
         "train.log_every": "1", "train.ckpt_every": "3", "eval_conversations": "3", "eval_loss_conversations": "3",
         "tokenizer_conversations": "200", "max_new_tokens": "8", "max_steps": "2", "max_len": "192",
         "model.d_model": "32", "model.ffn_dim": "64", "model.num_layers": "1"}


def test_sft_config_resolves_and_rejects_bad_values():
    exp = registry.get("sft")
    cfg = registry.resolve_config(exp, "tiny", MICRO)
    assert cfg.model.vocab_size == 384 and cfg.mode == "interleaved"
    assert registry.resolve_config(exp, "tiny", {"tokenizer_vocab": "401"}).model.vocab_size == 408
    for key, value, needle in (("mode", "fast", "allowed: interleaved, preserved, turn"),
                               ("p_error", "1.5", "a probability in [0, 1]"),
                               ("tokenizer_vocab", "100", "must be >= 300"),
                               ("primary", "loss", "allowed: task_success, tool_call_valid")):
        with pytest.raises((ConfigError, ValueError), match=needle.replace("[", r"\[").replace("]", r"\]")):
            registry.resolve_config(exp, "tiny", {key: value})


@pytest.mark.slow   # tokenizer training + 3 steps + two played evaluations (~1-2 min on 2 busy cores)
def test_sft_micro_run_writes_report(tmp_path):
    from experiments.run import run_experiment
    run_experiment("sft", str(tmp_path), "tiny", MICRO)
    report = json.loads((tmp_path / "report.json").read_text())
    for k in ("initial_task_success", "final_task_success", "initial_tool_call_valid", "final_tool_call_valid"):
        assert 0.0 <= report[k] <= 1.0, k
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    assert (tmp_path / "report.md").exists() and (tmp_path / "loss.png").exists()
    assert (tmp_path / "tokenizer.json").exists()
