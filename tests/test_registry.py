"""Typed experiment configs: dotted overrides, the registry and the sweep machinery, on a toy
experiment (no training), plus every registered experiment's config tree."""

import dataclasses
import json
import os
import subprocess
import sys
from typing import ClassVar, Optional

import numpy as np
import pytest

from experiments import registry
from glm5_jax.overrides import OverrideError, all_keys, apply_overrides, as_dict, parse_value
from experiments.sweep import sweep
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.data import DataConfig
from glm5_jax.mtp import mtp_targets
from glm5_jax.train import TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Knobs:
    x: float = 0.0
    label: str = "a"
    tags: tuple[str, ...] = ()
    sizes: tuple[int, ...] = (1, 2)
    limit: Optional[int] = 5
    flag: bool = False

    def __post_init__(self):
        if self.x < -10:
            raise ConfigError(f"Knobs.x={self.x!r} is invalid: must be >= -10")


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    knobs: Knobs = Knobs()
    repeats: int = 1

    STEPS_KEY: ClassVar[str] = "train.steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "data.vocab_size"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=self.data.vocab_size))


TOY = ToyConfig(model=ModelConfig(), train=TrainConfig(steps=1), data=DataConfig(vocab_size=512))


@registry.register("toy_quadratic", "toy: final loss = (x - 3)^2", {"tiny": TOY})
def _toy(cfg, workdir, log, mesh=None):
    report = {"arms": {"only": {"final_eval_loss": (cfg.knobs.x - 3.0) ** 2}}, "steps": cfg.train.steps}
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f)
    return report


def test_nested_fields_parse_by_declared_type():
    c = apply_overrides(TOY, ["model.index_topk=32", "train.learning_rate=1e-3", "knobs.x=2.5",
                              "knobs.label=b", "repeats=3", "train.async_checkpoints=false", "knobs.flag=yes"])
    assert (c.model.index_topk, c.train.learning_rate, c.knobs.x, c.knobs.label, c.repeats) == (32, 1e-3, 2.5, "b", 3)
    assert c.train.async_checkpoints is False and c.knobs.flag is True
    assert c.model.d_model == TOY.model.d_model and c.data == TOY.data        # untouched fields stay
    assert apply_overrides(TOY, []) is TOY


def test_tuples_comma_list_json_and_empty():
    c = apply_overrides(TOY, ["knobs.tags=x, y", "knobs.sizes=[4, 5, 6]"])
    assert c.knobs.tags == ("x", "y") and c.knobs.sizes == (4, 5, 6)
    assert apply_overrides(TOY, ["knobs.sizes=7,8"]).knobs.sizes == (7, 8)
    assert apply_overrides(TOY, ["knobs.tags="]).knobs.tags == ()
    c = apply_overrides(TOY, ["model.indexer_types=full,shared,full", "data.exclude_dirs=[\"a\", \"b\"]"])
    assert c.model.indexer_types == ("full", "shared", "full") and c.data.exclude_dirs == ("a", "b")
    c = apply_overrides(TOY, ['model.rope_scaling={"type": "linear", "factor": 4.0}'])
    assert c.model.rope_scaling_dict == {"type": "linear", "factor": 4.0}
    with pytest.raises(OverrideError, match=r"knobs\.sizes\[1\]='b': expected int"):
        apply_overrides(TOY, ["knobs.sizes=1,b"])


def test_optional_none_and_values():
    c = apply_overrides(TOY, ["knobs.limit=none", "data.max_files=none", "train.indexer_loss=None"])
    assert c.knobs.limit is None and c.data.max_files is None and c.train.indexer_loss is None
    c = apply_overrides(TOY, ["knobs.limit=9", "data.max_files=20", "train.indexer_loss=dense",
                              "model.indexer_types=null", "data.cache_dir=/tmp/x"])
    assert (c.knobs.limit, c.data.max_files, c.train.indexer_loss, c.data.cache_dir) == (9, 20, "dense", "/tmp/x")


def test_bad_key_lists_the_valid_keys_at_that_level():
    with pytest.raises(OverrideError) as e:
        apply_overrides(TOY, ["model.no_such_field=1"])
    msg = str(e.value)
    assert "model.no_such_field" in msg and "'no_such_field'" in msg
    assert "model.index_topk" in msg and "model.d_model" in msg and "train.steps" not in msg
    with pytest.raises(OverrideError, match=r"valid keys: data\.\*, knobs\.\*, model\.\*, repeats, train\.\*"):
        apply_overrides(TOY, ["nope=1"])
    # a first-version flat key is refused with its dotted spelling
    with pytest.raises(OverrideError, match=r"did you mean model\.index_topk"):
        apply_overrides(TOY, ["index_topk=32"])
    with pytest.raises(OverrideError, match="section"):
        apply_overrides(TOY, ["model=3"])
    with pytest.raises(OverrideError, match="not a section"):
        apply_overrides(TOY, ["repeats.x=3"])
    with pytest.raises(OverrideError, match="key=value"):
        apply_overrides(TOY, ["repeats"])
    with pytest.raises(OverrideError, match="derives it from data.vocab_size"):
        apply_overrides(TOY, ["model.vocab_size=300"], TOY.DERIVED)


@pytest.mark.parametrize("item,field,typ", [("model.index_topk=abc", "model.index_topk", "int"),
                                            ("train.learning_rate=fast", "train.learning_rate", "float"),
                                            ("knobs.flag=maybe", "knobs.flag", "bool"),
                                            ("knobs.limit=lots", "knobs.limit", "int | None")])
def test_bad_value_names_field_value_and_type(item, field, typ):
    with pytest.raises(OverrideError) as e:
        apply_overrides(TOY, [item])
    msg = str(e.value)
    assert field in msg and repr(item.split("=", 1)[1]) in msg and f"expected {typ}" in msg


def test_invalid_combination_fails_through_the_config_validation():
    # each is fine alone on the default model (dsa, 4 heads); together GQA needs kv heads | heads
    apply_overrides(TOY, ["model.num_kv_heads=3"])
    with pytest.raises(ConfigError, match=r"ModelConfig\.num_kv_heads=3.*divide num_heads"):
        apply_overrides(TOY, ["model.attention=gqa", "model.num_kv_heads=3", "model.indexer_types=none"])
    # applied together, so an order-dependent pair passes when the end state is valid
    c = apply_overrides(TOY, ["model.num_kv_heads=2", "model.attention=gqa"])
    assert (c.model.attention, c.model.num_kv_heads) == ("gqa", 2)
    with pytest.raises(ConfigError, match="TrainConfig.optimizer"):
        apply_overrides(TOY, ["train.optimizer=sgd"])
    with pytest.raises(ConfigError, match="DataConfig.vocab_size"):
        apply_overrides(TOY, ["data.vocab_size=10"])
    with pytest.raises(ConfigError, match="Knobs.x"):
        apply_overrides(TOY, ["knobs.x=-11"])


def test_parse_value_types():
    assert parse_value("k", "3", int) == 3 and parse_value("k", "3", float) == 3.0
    assert parse_value("k", "none", Optional[str]) is None and parse_value("k", "x", Optional[str]) == "x"
    assert parse_value("k", "1,2", tuple[int, ...]) == (1, 2)


def test_resolve_config_steps_and_scales():
    exp = registry.get("toy_quadratic")
    c = registry.resolve_config(exp, "tiny", ["knobs.x=2.5"], steps=7)
    assert c.train.steps == 7 and c.knobs.x == 2.5
    assert registry.resolve_config(exp, "tiny", {"train.steps": 9}, steps=7).train.steps == 9   # --set wins
    with pytest.raises(registry.ExperimentError, match="no scale 'small'"):
        registry.resolve_config(exp, "small")
    with pytest.raises(registry.ExperimentError, match="unknown experiment"):
        registry.get("nope")


def test_as_dict_is_json_and_complete():
    d = as_dict(apply_overrides(TOY, ["model.indexer_types=full,shared,full"]))
    assert json.loads(json.dumps(d)) == d
    assert d["model"]["indexer_types"] == ["full", "shared", "full"] and d["knobs"]["sizes"] == [1, 2]


def _as_text(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(v).lower()
    return json.dumps(v) if isinstance(v, list) else str(v)


def test_every_registered_experiment_reaches_every_field():
    """Each scale of each experiment is a typed tree with model/train sections, and every leaf of it
    (except the derived ones) can be set back to its own value from its command-line text."""
    for name, exp in registry.load_all().items():
        for scale, cfg in exp.scales.items():
            assert isinstance(cfg.model, ModelConfig) and isinstance(cfg.train, TrainConfig), name
            derived = getattr(type(cfg), "DERIVED", {})
            d = as_dict(cfg)
            items = []
            for key in all_keys(cfg):
                v = d
                for part in key.split("."):
                    v = v[part]
                if key not in derived:
                    items.append(f"{key}={_as_text(v)}")
            assert len(items) > 60, name
            assert registry.resolve_config(exp, scale, items) == cfg, (name, scale)
        if name != "toy_quadratic":
            assert {"tiny", "small"} <= set(exp.scales), name


def test_sweep_runs_every_value_and_writes_table(tmp_path):
    results = sweep("toy_quadratic", "knobs.x=1,3,4", str(tmp_path), "tiny")
    assert results["1"]["only.final_eval_loss"] == 4.0 and results["3"]["only.final_eval_loss"] == 0.0
    table = open(tmp_path / "sweep.md").read()
    assert "| knobs.x |" in table and "only.final_eval_loss" in table
    for v in ("1", "3", "4"):
        settings = json.load(open(tmp_path / f"knobs.x={v}" / "settings.json"))
        assert settings["config"]["knobs"]["x"] == float(v)
        assert json.load(open(tmp_path / f"knobs.x={v}" / "report.json"))["config"]["knobs"]["x"] == float(v)
    with pytest.raises(OverrideError, match="no field 'nope'"):
        sweep("toy_quadratic", "nope=1,2", str(tmp_path / "bad"), "tiny")
    with pytest.raises(OverrideError, match="expected float"):     # every value checked before the first run
        sweep("toy_quadratic", "knobs.x=1,oops", str(tmp_path / "bad2"), "tiny")
    assert not os.path.exists(tmp_path / "bad2" / "knobs.x=1")


def test_cli_bad_key_exits_2_naming_it_and_valid_keys(tmp_path):
    """`python -m experiments.run --set model.no_such_field=1` fails before any compile (no workdir)."""
    wd = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "experiments.run", "--config=dsa_vs_mla", "--steps=2",
                        f"--workdir={wd}", "--set", "model.no_such_field=1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 2, r.stderr
    assert "model.no_such_field" in r.stderr and "model.index_topk" in r.stderr
    assert not wd.exists()
    r = subprocess.run([sys.executable, "-m", "experiments.run", "--config=grpo_icepop", "--show",
                        "--set", "rl.learning_rate=1e-3", "--steps=5"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    assert "rl.learning_rate = 0.001" in r.stdout and "rl.steps = 5" in r.stdout
    assert 'rl.frozen_patterns = ["indexer", "embed", "layer_0/attn"]' in r.stdout


def test_mtp_targets_shift_and_mask_documents():
    targets = np.array([[10, 11, 12, 13, 14, 15]])
    mask = np.ones((1, 6), np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 2]])
    t, m = mtp_targets(targets, mask, seg, 1)          # position i predicts token i + 2 = targets[i + 1]
    assert np.asarray(t).tolist() == [[11, 12, 13, 14, 15, 0]]
    assert np.asarray(m).tolist() == [[1, 1, 0, 1, 1, 0]]   # no target across the document boundary
