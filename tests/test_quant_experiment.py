"""The qat experiment: config validation, disjoint splits, and a micro run writing the issue's report keys."""

import json
import os

import pytest

from experiments import registry
from experiments.qat import splits
from glm5_jax.config import ConfigError

MICRO = {"model.d_model": "32", "model.num_heads": "2", "model.num_layers": "2", "model.moe_ffn_dim": "32",
         "model.q_lora_rank": "16", "model.kv_lora_rank": "16", "train.steps": "2", "train.batch_size": "2",
         "train.seq_len": "32", "train.eval_every": "2", "train.ckpt_every": "2", "train.warmup_steps": "1",
         "quant.group_size": "16", "sweep_group_sizes": "0,16", "test_tasks": "4", "val_tasks": "4"}


def test_config_and_splits():
    exp = registry.get("qat")
    cfg = registry.resolve_config(exp, "tiny", MICRO)
    val, test = splits(cfg)
    assert len(val) == len(test) == 4 and not {t.prompt for t in val} & {t.prompt for t in test}
    with pytest.raises(ConfigError, match="test_tasks"):
        registry.resolve_config(exp, "tiny", {"test_tasks": "0"})
    with pytest.raises(ValueError, match="group_size"):
        registry.resolve_config(exp, "tiny", {"quant.group_size": "-1"})


@pytest.mark.slow   # two SFT runs, generate and eval compiles
def test_qat_micro_run_writes_report(tmp_path):
    exp = registry.get("qat")
    cfg = registry.resolve_config(exp, "tiny", MICRO)
    report = exp.run(cfg, str(tmp_path), log=lambda m: None)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    for arm in ("bf16", "ptq_int4", "qat_int4"):
        assert set(on_disk["arms"][arm]) == {"eval_loss", "task_success"}
        assert 0.0 <= report["arms"][arm]["task_success"] <= 1.0
    assert [s["group_size"] for s in report["val_ptq_sweep"]] == [0, 16]
    assert all(os.path.exists(tmp_path / f) for f in ("report.md", "val_loss.png", "train_loss.png"))
