"""Registry, settings overrides and the sweep machinery, on a toy experiment (no training)."""

import json
import os

import numpy as np
import pytest

from experiments import registry
from experiments.sweep import sweep
from glm5_jax.losses import mtp_targets


@registry.register("toy_quadratic", "toy: final loss = (x - 3)^2", {"tiny": {"x": 0.0, "steps": 1, "label": "a"}})
def _toy(s, workdir, log):
    report = {"arms": {"only": {"final_eval_loss": (s["x"] - 3.0) ** 2}}, "steps": s["steps"]}
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f)
    return report


def test_resolve_settings_coerces_and_rejects():
    exp = registry.get("toy_quadratic")
    s = registry.resolve_settings(exp, "tiny", ["x=2.5", "label=b"], steps=7)
    assert s == {"x": 2.5, "steps": 7, "label": "b"}
    with pytest.raises(registry.ExperimentError, match="no setting 'y'.*valid settings: label, steps, x"):
        registry.resolve_settings(exp, "tiny", ["y=1"])
    with pytest.raises(registry.ExperimentError, match="expected a float"):
        registry.resolve_settings(exp, "tiny", ["x=abc"])
    with pytest.raises(registry.ExperimentError, match="key=value"):
        registry.resolve_settings(exp, "tiny", ["x"])
    with pytest.raises(registry.ExperimentError, match="no scale 'small'"):
        registry.resolve_settings(exp, "small")


def test_sweep_runs_every_value_and_writes_table(tmp_path):
    results = sweep("toy_quadratic", "x=1,3,4", str(tmp_path), "tiny")
    assert results["1"]["only.final_eval_loss"] == 4.0 and results["3"]["only.final_eval_loss"] == 0.0
    table = open(tmp_path / "sweep.md").read()
    assert "| x |" in table and "only.final_eval_loss" in table
    for v in ("1", "3", "4"):
        assert os.path.exists(tmp_path / f"x={v}" / "settings.json")
    with pytest.raises(registry.ExperimentError, match="no setting 'nope'"):
        sweep("toy_quadratic", "nope=1,2", str(tmp_path / "bad"), "tiny")


def test_mtp_targets_shift_and_mask_documents():
    targets = np.array([[10, 11, 12, 13, 14, 15]])
    mask = np.ones((1, 6), np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 2]])
    t, m = mtp_targets(targets, mask, seg, 1)          # position i predicts token i + 2 = targets[i + 1]
    assert np.asarray(t).tolist() == [[11, 12, 13, 14, 15, 0]]
    assert np.asarray(m).tolist() == [[1, 1, 0, 1, 1, 0]]   # no target across the document boundary
