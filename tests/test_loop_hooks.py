"""train(..., hooks=[Hook]): hooks run at their steps with the step's params / row / step time, their dicts join
metrics.jsonl, eval_fn is the first hook, and hooks never change the training (same losses and params with
and without them, and after a resume); train_stages passes each stage its hooks."""

import json

import chex
import jax
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.train import TrainConfig, train
from glm5_jax.train.loop import Hook
from glm5_jax.train.stages import Stage, cached_json, train_stages

CFG = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, q_lora_rank=16, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, ffn_dim=64, num_experts=0, attention="mla",
                  mtp_depth=0, attn_chunk=16)
TC = TrainConfig(steps=6, batch_size=2, seq_len=16, learning_rate=1e-2, warmup_steps=1, eval_every=3, log_every=2,
                 ckpt_every=2, seed=0)


class Data:
    def __init__(self, seq_len=16):
        self.i, self.t = 0, seq_len

    def __next__(self):
        self.i += 1
        tok = np.random.default_rng(self.i).integers(0, 64, (2, self.t)).astype(np.int32)
        return {"tokens": tok, "targets": np.roll(tok, -1, 1), "loss_mask": np.ones((2, self.t), np.float32),
                "segment_ids": np.ones((2, self.t), np.int32),
                "positions": np.broadcast_to(np.arange(self.t), (2, self.t)).astype(np.int32)}

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


def test_hooks_run_at_their_steps_and_never_change_the_training(tmp_path):
    seen = []

    def probe(ctx):
        assert ctx.params is not None and "loss" in ctx.row and ctx.total_steps == 6
        seen.append(("probe", ctx.step, ctx.row.get("eval_loss")))
        return {"probe": float(ctx.step)}

    def timing(ctx):
        assert ctx.params is None and ctx.step_seconds > 0
        seen.append(("time", ctx.step))

    eval_fn = lambda p: {"eval_loss": float(sum(np.sum(np.asarray(x)) for x in jax.tree.leaves(p)))}
    hooks = [Hook(probe, every=4), Hook(timing, every=1, at_end=False, params=False)]
    a = train(CFG, TC, Data(), tmp_path / "a", eval_fn=eval_fn, hooks=hooks, log=lambda m: None)
    b = train(CFG, TC, Data(), tmp_path / "b", log=lambda m: None)
    assert [r["loss"] for r in a["history"]] == [r["loss"] for r in b["history"]]
    chex.assert_trees_all_equal(a["params"], b["params"])
    assert [s for s in seen if s[0] == "time"] == [("time", i) for i in range(1, 7)]
    probes = [s for s in seen if s[0] == "probe"]
    assert [s[1] for s in probes] == [4, 6]                   # every 4 and at the end
    assert probes[1][2] is not None                           # the eval hook ran first and is in the row
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "probe" in r] == [4, 6]
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6] and a["final"]["step"] == 6
    # a resumed run (past its last step) keeps its final eval and runs no hook
    seen.clear()
    c = train(CFG, TC, Data(), tmp_path / "a", eval_fn=eval_fn, hooks=hooks, log=lambda m: None)
    assert seen == [] and c["final"]["eval_loss"] == a["final"]["eval_loss"]


def test_train_stages_passes_each_stage_its_hooks_and_caches(tmp_path):
    steps = {}

    def hooks_for(stage, i, cfg):
        return [Hook(lambda ctx: steps.setdefault(stage.name, []).append(ctx.step), every=1, params=False)]
    stages = [Stage("a", seq_len=16, steps=2), Stage("b", seq_len=16, steps=3, learning_rate=1e-3,
                                                     init_seed=5, model={"rope_theta": 1e5})]
    out = train_stages(CFG, TC, stages, lambda s, i: Data(s.seq_len), tmp_path, hooks_for_stage=hooks_for,
                       log=lambda m: None)
    assert steps == {"a": [1, 2], "b": [1, 2, 3]} and out["model_cfg"].rope_theta == 1e5
    assert Stage.of("x", TC.replace(learning_rate=3e-3, eval_every=7), TC).train == (("eval_every", 7),)
    calls = []
    f = lambda: calls.append(1) or {"v": 1.5}
    assert cached_json(tmp_path, "e", {"k": 1}, f) == cached_json(tmp_path, "e", {"k": 1}, f) == {"v": 1.5}
    assert len(calls) == 1


def test_the_optimizer_table_is_printed_once_a_run(tmp_path, monkeypatch):
    """A run's phases log the optimizer table once: the first train() logs it whole, every later one (same or
    another optimizer) one line of totals pointing at the table written into its workdir."""
    from glm5_jax.optim import optimizer_table
    from glm5_jax.train import loop
    from glm5_jax.train.state import abstract_param_shapes, build_optimizer
    monkeypatch.setattr(loop, "_LOGGED_TABLES", set())
    logs = []
    tc = TC.replace(steps=1, eval_every=1, ckpt_every=1)
    for i, t in enumerate((tc, tc, tc.replace(optimizer="muon"))):
        train(CFG, t, Data(), tmp_path / str(i), log=logs.append, name=f"p{i}")
    lines = [m for m in logs if " optimizer " in m]
    assert len(lines) == 3 and "\n" in lines[0] and all("\n" not in m for m in lines[1:])
    assert lines[1].startswith("[p1] optimizer adamw (same as an earlier phase): adamw ") and "total" in lines[1]
    assert lines[2].startswith("[p2] optimizer muon: ") and lines[2].endswith(str(tmp_path / "2" / "optimizer.txt"))
    shapes = abstract_param_shapes(CFG)
    for i, t in enumerate((tc, tc, tc.replace(optimizer="muon"))):
        want = optimizer_table(shapes, build_optimizer(CFG, t, shapes)[1])
        assert (tmp_path / str(i) / "optimizer.txt").read_text() == want + "\n"
