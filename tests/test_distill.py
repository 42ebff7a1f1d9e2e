"""On-policy distillation: the per-token teacher advantage, its gradient through the GRPO/IcePop loss
(closed form), per-skill teacher routing, and run_distill pulling the student towards the teacher."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ModelConfig
from glm5_jax.model import init_params
from glm5_jax.rl.distill import distill_advantages, make_teacher_advantage_fn, run_distill
from glm5_jax.rl.losses import grpo_icepop_loss
from glm5_jax.rl.program import RLConfig, token_logprobs
from glm5_jax.rl.rollout import build_batch, collect_rollouts
from glm5_jax.rl.sft import CharVocab
from glm5_jax.rl.tasks import arithmetic_task

VOCAB = CharVocab()


def test_distill_advantages_hand_values():
    t = np.array([[-1.0, -2.0, -0.5], [0.0, -3.0, -1.0]])
    s = np.array([[-2.0, -2.0, -9.0], [-1.0, -1.0, -1.0]])
    m = np.array([[0, 1, 1], [1, 1, 0]])
    np.testing.assert_array_equal(distill_advantages(t, s, m), np.array([[0.0, 0.0, 8.5], [1.0, -2.0, 0.0]]))
    with pytest.raises(ValueError, match="one shape"):
        distill_advantages(t, s[:, :2], m)


def test_token_advantage_gradient_through_icepop_loss_is_closed_form():
    """On-policy (logp == old == infer): grad of the loss = -mean_b 1/|y_b| sum_t A_bt grad logp_bt."""
    key = jax.random.PRNGKey(0)
    theta = jax.random.normal(key, (2, 4, 5))
    tokens = jnp.array([[0, 3, 1, 4], [2, 2, 0, 1]])
    mask = jnp.array([[0, 1, 1, 1], [1, 1, 0, 0]], jnp.float32)
    adv = jax.random.normal(jax.random.PRNGKey(1), (2, 4))

    def logp(th):
        return jnp.take_along_axis(jax.nn.log_softmax(th, -1), tokens[..., None], -1)[..., 0]

    lp0 = jax.lax.stop_gradient(logp(theta))
    g = jax.grad(lambda th: grpo_icepop_loss(logp(th), lp0, lp0, adv, mask)[0])(theta)
    want = jax.grad(lambda th: -jnp.mean(jnp.sum(adv * mask * logp(th), -1) / jnp.sum(mask, -1)))(theta)
    np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig(vocab_size=VOCAB.padded_size(), d_model=32, num_layers=1, num_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=4, v_head_dim=16, ffn_dim=64,
                      attention="mla", num_experts=0, mtp_depth=0, attn_chunk=16, initializer_range=0.1)
    student = init_params(cfg, jax.random.PRNGKey(0))
    teacher = init_params(cfg, jax.random.PRNGKey(1))
    return cfg, student, teacher


def test_teacher_routing_per_skill(setup):
    cfg, student, teacher = setup
    rng = random.Random(0)
    tasks = [arithmetic_task(rng, 0), arithmetic_task(rng, 1)]
    ro = collect_rollouts(cfg, student, tasks, VOCAB, group_size=2, max_new_tokens=4, seed=0)
    batch = build_batch(ro, np.zeros(4), 8)
    inp, tgt = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    batch["old_logp"] = np.asarray(token_logprobs(cfg, student, inp, tgt))
    fn = make_teacher_advantage_fn(cfg, {"0": student, "1": teacher}, lambda t: str(t.level))
    row_tasks = [tasks[i // 2] for i in range(4)]
    adv = fn(row_tasks, batch)
    m = batch["mask"] > 0
    np.testing.assert_array_equal(adv[:2], 0.0)                     # level 0 rows: teacher == student
    want = np.where(m[2:], np.asarray(token_logprobs(cfg, teacher, inp, tgt))[2:] - batch["old_logp"][2:], 0.0)
    np.testing.assert_allclose(adv[2:], want, rtol=1e-6, atol=1e-6)
    assert np.abs(adv[2:][m[2:]]).max() > 0
    with pytest.raises(ValueError, match="no teacher"):
        make_teacher_advantage_fn(cfg, {"0": student}, lambda t: str(t.level))(row_tasks, batch)


@pytest.mark.slow
def test_run_distill_moves_student_towards_teacher(setup):
    """A few on-policy distillation steps raise the teacher-minus-student log-prob gap's mean (the
    negative of a reverse-KL estimate) on fresh student samples."""
    cfg, student, teacher = setup
    rl = RLConfig(steps=6, prompts_per_step=8, group_size=2, max_new_tokens=4, max_prompt_len=8, minibatches=1,
                  learning_rate=3e-3, mismatch="none", frozen_patterns=())
    sample = lambda rng: arithmetic_task(rng, 0)

    def gap(params):
        rng = random.Random(123)
        tasks = [sample(rng) for _ in range(16)]
        ro = collect_rollouts(cfg, params, tasks, VOCAB, group_size=1, max_new_tokens=4, seed=7)
        b = build_batch(ro, np.zeros(16), 8)
        inp, tgt = jnp.asarray(b["inputs"]), jnp.asarray(b["targets"])
        d = distill_advantages(token_logprobs(cfg, teacher, inp, tgt), token_logprobs(cfg, params, inp, tgt), b["mask"])
        return d.sum() / b["mask"].sum()

    out = run_distill(cfg, student, {"arith": teacher}, rl, sample, lambda t: "arith", VOCAB, log=lambda m: None)
    assert len(out["history"]) == 6 and out["stopped_at"] is None
    assert gap(out["params"]) > gap(student) + 0.05
