"""Staged training (glm5_jax.train.stages): a run killed inside and between stages resumes to the losses
of an uninterrupted run; RoPE-only stages keep the params pytree; adding DSA carries the shared params
bit-exactly and initialises the indexer; bad stages are refused by name."""

import json
import os
import shutil

import chex
import jax
import numpy as np
import pytest
from flax import traverse_util

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.model import init_params
from glm5_jax.train import Stage, TrainConfig, train_stages
from glm5_jax.train.stages import _carry, plan_stages, stage_dir

MODEL = ModelConfig(vocab_size=512, d_model=32, num_layers=1, attention="mla", num_heads=2, q_lora_rank=16,
                    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_experts=0,
                    mtp_depth=0, ffn_dim=64, index_topk=8, index_n_heads=2, index_head_dim=8)
TRAIN = TrainConfig(batch_size=2, ckpt_every=2, log_every=1, eval_every=1000, warmup_steps=1, learning_rate=1e-2,
                    async_checkpoints=False, keep_checkpoints=1)
# the programme in miniature: base length, longer context with the RoPE base raised, then DSA added
# (indexer warm-up: only the indexer trains, on the dense KL)
STAGES = [Stage("base", seq_len=32, steps=2),
          Stage("long", seq_len=64, steps=5, model={"rope_theta": 1e5}, learning_rate=5e-3, min_lr_ratio=0.5),
          Stage("dsa", seq_len=64, steps=2, model={"attention": "dsa"}, warmup_steps=0,
                train={"indexer_loss": "dense", "trainable_pattern": "indexer"})]
quiet = lambda msg: None


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return build_lm_data(DataConfig(vocab_size=512, seq_len=32, max_files=20, tokenizer_train_bytes=200_000,
                                    retrieval_fraction=0.0, cache_dir=str(tmp_path_factory.mktemp("cache"))))


class Killed(Exception):
    pass


class _Iter:
    """The stage's pipeline iterator; checks each batch has the stage's length; raises after `fail_after`
    batches (a killed run)."""

    def __init__(self, it, stage, fail_after=None):
        self.it, self.stage, self.fail_after, self.n = it, stage, fail_after, 0

    def __next__(self):
        if self.fail_after is not None and self.n >= self.fail_after:
            raise Killed(f"killed in stage {self.stage.name}")
        self.n += 1
        b = next(self.it)
        assert b["tokens"].shape == (TRAIN.batch_size, self.stage.seq_len)
        return b

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)


def _make_iter(data, kill=None):
    """kill: (stage index, batches served before the kill)."""
    def make(stage, i):
        return _Iter(data.train_iter(TRAIN.batch_size, stage.seq_len, seed=10 + i), stage,
                     kill[1] if kill is not None and kill[0] == i else None)
    return make


def _rows(workdir, i, stage):
    return [json.loads(l) for l in open(os.path.join(stage_dir(workdir, i, stage), "metrics.jsonl")) if l.strip()]


def _flat(params):
    return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(jax.device_get(params)).items()}


@pytest.mark.slow   # ~33 s: three staged runs (test_rl_faults' killed GRPO stage resume stays in the default run)
def test_staged_run_killed_in_and_between_stages_resumes_to_uninterrupted_losses(data, tmp_path):
    """One programme checks (a) exact resume, (b) the RoPE stage keeps the params pytree, (c) adding DSA
    carries every shared parameter bit-exactly and adds a freshly initialised indexer."""
    start = init_params(MODEL, jax.random.PRNGKey(0))
    finals = []
    eval_for = lambda stage, i, cfg: lambda params: finals.append(_flat(params)) or {}
    full, killed = tmp_path / "full", tmp_path / "killed"
    out = train_stages(MODEL, TRAIN, STAGES, _make_iter(data), full, init_params=start, eval_fn_for_stage=eval_for,
                       log=quiet)
    # killed between stages 0 and 1 (stage 0 done: its folder as the uninterrupted run left it; stage 1 then
    # starts from stage 0's final checkpoint), and then inside stage 1 after 3 batches (its last checkpoint:
    # step 2); the rerun resumes stage 1 from there and runs stage 2
    shutil.copytree(stage_dir(full, 0, STAGES[0]), stage_dir(killed, 0, STAGES[0]))
    with pytest.raises(Killed, match="killed in stage long"):
        train_stages(MODEL, TRAIN, STAGES, _make_iter(data, kill=(1, 3)), killed, init_params=start, log=quiet)
    assert len(_rows(killed, 1, STAGES[1])) == 2
    resumed = train_stages(MODEL, TRAIN, STAGES, _make_iter(data), killed, init_params=start, log=quiet)
    for i, s in enumerate(STAGES):
        a, b = _rows(full, i, s), _rows(killed, i, s)
        assert [r["step"] for r in b] == list(range(1, s.steps + 1))
        assert a == b, s.name                       # every metric of every step, bitwise
        assert [r["loss"] for r in resumed["stages"][i]["history"]] == [r["loss"] for r in a]
    chex.assert_trees_all_equal(out["params"], resumed["params"])

    # (b) RoPE-only stage: the same pytree (paths, shapes, dtypes), only the model's rope_theta changed
    p0, p1, p2 = finals
    shapes = lambda p: {k: (v.shape, v.dtype) for k, v in p.items()}
    assert shapes(p0) == shapes(p1)
    (c0, _), (c1, _), (c2, _) = plan_stages(MODEL, TRAIN, STAGES)
    assert (c0.rope_theta, c1.rope_theta, c2.rope_theta) == (MODEL.rope_theta, 1e5, 1e5)
    # (c) DSA added: every stage-1 parameter is carried bit-exactly (frozen while the indexer warms up) and
    # the new ones are exactly the indexer's, trained from a fresh init
    new = set(p2) - set(p1)
    assert new and all("indexer" in k for k in new) and shapes({k: p2[k] for k in p1}) == shapes(p1)
    for k, v in p1.items():
        np.testing.assert_array_equal(p2[k], v)
    assert all(np.isfinite(r["indexer_kl"]) for r in out["stages"][2]["history"])
    assert out["model_cfg"].attention == "dsa"
    key = jax.random.PRNGKey(3)
    grafted, fresh = _flat(_carry(c1, c2, start, key)), _flat(init_params(c2, key))
    ref = _flat(start)
    assert set(grafted) == set(fresh)
    for k, v in grafted.items():     # shared: the source values bit-exactly; new: the DSA model's own init
        np.testing.assert_array_equal(v, ref[k] if k in ref else fresh[k])


@pytest.mark.parametrize("make,msg", [
    (lambda: [Stage("a", seq_len=0, steps=1)], r"Stage 'a': seq_len=0 is invalid: must be an integer >= 1"),
    (lambda: [Stage("a", seq_len=8, steps=-2)], r"Stage 'a': steps=-2 is invalid"),
    (lambda: [Stage("a/b", seq_len=8, steps=1)], r"Stage.name='a/b' is invalid"),
    (lambda: [Stage("a", 8, 1, model={"num_layers": 4})], r"model\['num_layers'\].*allowed: rope_theta, rope_scaling"),
    (lambda: [Stage("a", 8, 1, train={"seq_len": 16})], r"train\['seq_len'\].*set Stage.seq_len"),
    (lambda: [Stage("a", 8, 1, train={"lr": 1.0})], r"train\['lr'\].*TrainConfig fields; allowed: batch_size"),
    (lambda: [], r"non-empty list of Stage"),
    (lambda: [Stage("a", 8, 1), Stage("b", 8, 1, model={"rope_theta": -1.0})], r"stage 1 'b': .*rope_theta"),
    (lambda: [Stage("a", 8, 1), Stage("b", 8, 1, learning_rate=-1.0)], r"stage 1 'b': .*learning_rate"),
    (lambda: [Stage("a", 8, 1), Stage("b", 8, 1, model={"attention": "mha"})],
     r"stage 1 'b': model\['attention'\]='mha' is invalid after 'mla'.*only from 'mla' to 'dsa'"),
    (lambda: [Stage("a", 8, 1, model={"attention": "dsa"}), Stage("b", 8, 1, model={"index_head_dim": 16})],
     r"stage 1 'b': model overrides \{'index_head_dim': 16\} change the parameters carried"),
    (lambda: [Stage("a", 8, 1, model={"attention": "dsa"}), Stage("b", 8, 1, model={"attention": "mla"})],
     r"stage 1 'b': model\['attention'\]='mla' is invalid after 'dsa'"),
])
def test_bad_stages_are_refused_by_name(make, msg):
    with pytest.raises(ConfigError, match=msg):
        plan_stages(MODEL, TRAIN, make())


def test_a_started_stage_cannot_change(tmp_path):
    d = stage_dir(tmp_path, 0, STAGES[0])
    d.mkdir(parents=True)
    (d / "stage.json").write_text(json.dumps({"stage": Stage("base", 32, 99).to_json(), "done": False, "final": None}))
    with pytest.raises(ConfigError, match="stage 0 'base': .* a started stage cannot change"):
        train_stages(MODEL, TRAIN, STAGES, lambda s, i: None, tmp_path, log=quiet)
