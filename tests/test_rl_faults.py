"""RL stage faults (issue 44): run_grpo checkpoints inside the stage; SIGTERM checkpoints the step reached,
a rerun resumes to the same rows and params as an uninterrupted run; a non-finite update is not applied."""

from __future__ import annotations

import os
import signal

import jax
import numpy as np
import pytest

from glm5_jax.config import ModelConfig
from glm5_jax.model import init_params
from glm5_jax.rl.program import TIMING_KEYS, RLConfig, run_grpo
from glm5_jax.rl.sft import CharVocab
from glm5_jax.rl.tasks import arithmetic_task
from glm5_jax.train.preempt import PREEMPTED_EXIT_CODE, Preempted

VOCAB = CharVocab()
CFG = ModelConfig(vocab_size=VOCAB.padded_size(), d_model=32, num_layers=2, num_heads=2, q_lora_rank=16,
                  kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=4, v_head_dim=16, ffn_dim=64,
                  attention="mla", num_experts=0, mtp_depth=0, attn_chunk=16, initializer_range=0.1)
RL = RLConfig(steps=4, prompts_per_step=2, group_size=2, minibatches=2, max_new_tokens=4, max_prompt_len=8,
              learning_rate=3e-3, mismatch="none", seed=1)


def _rows(history):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in history]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(jax.device_get(a)),
                                                    jax.tree_util.tree_leaves(jax.device_get(b))))


def _finite(tree):
    return all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree_util.tree_leaves(jax.device_get(tree)))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, jax.random.PRNGKey(0))


def test_killed_grpo_stage_resumes_to_the_same_rows(params, tmp_path):
    """SIGTERM while step 3 draws its prompts: step 3 finishes, is checkpointed (ckpt_every=10: not a
    regular one), Preempted (143) is raised with one log line; the same call again resumes at step 4
    and ends with the rows, evals and params of an uninterrupted run (no checkpoints), bitwise."""
    evalf = lambda p: {"norm": float(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree_util.tree_leaves(p)))}
    sample = lambda rng: arithmetic_task(rng, 1)
    ref = run_grpo(CFG, params, RL, sample, VOCAB, log=lambda m: None, eval_fn=evalf, eval_every=2)
    calls = {"n": 0}

    def killing_sample(rng):
        calls["n"] += 1
        if calls["n"] == 2 * RL.prompts_per_step + 1:               # the first prompt of step 3
            os.kill(os.getpid(), signal.SIGTERM)
        return sample(rng)

    lines = []
    ck = str(tmp_path / "ckpt")
    with pytest.raises(Preempted) as info:
        run_grpo(CFG, params, RL, killing_sample, VOCAB, log=lines.append, eval_fn=evalf, eval_every=2,
                 ckpt_dir=ck, ckpt_every=10)
    assert info.value.code == PREEMPTED_EXIT_CODE and info.value.step == 3
    assert sum("preempted" in l for l in lines) == 1 and sorted(os.listdir(ck)) == ["3"]
    lines = []
    out = run_grpo(CFG, params, RL, sample, VOCAB, log=lines.append, eval_fn=evalf, eval_every=2,
                   ckpt_dir=ck, ckpt_every=10, metrics_path=str(tmp_path / "m.jsonl"))
    assert any("resumed from step 3" in l for l in lines)
    assert _rows(out["history"]) == _rows(ref["history"]) and [r["step"] for r in out["history"]] == [1, 2, 3, 4]
    assert out["evals"] == ref["evals"] and _same(out["params"], ref["params"])
    assert len(open(tmp_path / "m.jsonl").read().splitlines()) == 4
    # a finished stage returns at once from its last checkpoint
    again = run_grpo(CFG, params, RL, sample, VOCAB, log=lambda m: None, ckpt_dir=ck, ckpt_every=10)
    assert _same(again["params"], ref["params"]) and _rows(again["history"]) == _rows(ref["history"])


def test_non_finite_rl_update_is_not_applied(params, tmp_path):
    """advantage_fn returns NaN at step 2: both of its updates are skipped (params as after step 1), the
    run goes on, every checkpoint is finite and the rows count the skipped updates."""
    sample = lambda rng: arithmetic_task(rng, 1)
    seen = {"n": 0}

    def adv(row_tasks, batch):
        seen["n"] += 1
        a = np.where(batch["mask"] > 0, 1.0, 0.0).astype(np.float32) * (1 if seen["n"] % 2 else -1)
        return np.full_like(a, np.nan) if seen["n"] == 2 else a

    after = {}

    def evalf(p):                     # called after each step's updates: keep a copy of the params
        after[len(after) + 1] = jax.tree_util.tree_map(np.array, jax.device_get(p))
        return {}

    lines = []
    out = run_grpo(CFG, params, RL.replace(steps=3), sample, VOCAB, log=lines.append, advantage_fn=adv,
                   eval_fn=evalf, eval_every=1, ckpt_dir=str(tmp_path / "ck"), ckpt_every=1)
    assert [r["skipped_updates"] for r in out["history"]] == [0, 2, 2]
    assert sum("not applied" in l for l in lines) == 1
    assert _same(after[2], after[1]) and not _same(after[3], after[2]) and _finite(out["params"])
    from glm5_jax.train.checkpoint import Checkpointer
    from glm5_jax.train.state import abstract_state
    from glm5_jax.rl.program import make_rl_optimizer
    from glm5_jax.sharding import single_device_mesh
    tx, _ = make_rl_optimizer(params, RL, CFG)
    ck = Checkpointer(str(tmp_path / "ck"), async_save=False)
    for s in ck.all_steps():
        state, _ = ck.restore(s, abstract_state(CFG, None, single_device_mesh(), tx)[0])
        assert _finite(state)
