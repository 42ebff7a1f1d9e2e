"""On-policy cross-stage distillation (GLM-5's last post-training stage).

The student samples (the ordinary rollout of ``run_grpo``); each prompt belongs to one skill, and the
teacher of that skill (the final checkpoint of the stage that taught it) scores the student's own
tokens. The per-token advantage is

    A[b, t] = stop_gradient(log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t))

on the generated tokens (0 on prompt and padding), where pi_student is the training engine's
rollout-time student (``old_logp``, already stop-gradient). It goes through the unchanged GRPO/IcePop
loss and update (``run_grpo(..., advantage_fn=...)``): one loss path. At ratio 1 the gradient is
``E[A_t grad log pi(y_t)]``, the policy gradient of -KL(pi_student || pi_teacher) with a per-token
reward (reverse KL: the student is pulled towards what the teacher would have said on the student's
own prefixes, the on-policy property).

Teachers share the student's ModelConfig (one compiled forward for all of them).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Dict, Sequence

import jax.numpy as jnp
import numpy as np

from glm5_jax.rl.program import run_grpo, token_logprobs

__all__ = ["Taught", "distill_advantages", "make_teacher_advantage_fn", "run_distill"]


@dataclasses.dataclass(frozen=True)
class Taught:
    """A distillation prompt with the name of its teacher (``skill_of=lambda t: t.teacher``)."""
    task: object
    teacher: str

    @property
    def prompt(self) -> str:
        return self.task.prompt

    @property
    def kind(self) -> str:
        return self.task.kind

    def score(self, text: str):
        return self.task.score(text)


def distill_advantages(teacher_logp, student_logp, mask) -> np.ndarray:
    """[B, S] log pi_teacher - log pi_student on masked (generated) tokens, 0 elsewhere (numpy)."""
    t, s, m = np.asarray(teacher_logp, np.float32), np.asarray(student_logp, np.float32), np.asarray(mask) > 0
    if not t.shape == s.shape == m.shape:
        raise ValueError(f"teacher_logp {t.shape}, student_logp {s.shape} and mask {m.shape} must have one shape")
    return np.where(m, t - s, 0.0).astype(np.float32)


def make_teacher_advantage_fn(config, teachers: Dict[str, object], skill_of: Callable[[object], str], mesh=None):
    """advantage_fn for ``run_grpo``: row b is scored by ``teachers[skill_of(task_b)]``.

    Every teacher scores the whole batch (fixed shapes: one compiled forward) and each row keeps the
    log-probs of its own skill's teacher. mesh: the teachers are placed once on it, device to device, in
    the training layout (``LOGICAL_RULES``: sharded like the student's parameters, never replicated), and
    score through the very program that computes the student's ``old_logp`` (so a teacher equal to the
    student gives advantages of exactly 0, as on one device).
    """
    if not teachers:
        raise ValueError("teachers is empty: give at least one {skill: params}")
    if mesh is not None:
        import jax
        from glm5_jax.sharding import param_shardings
        teachers = {k: jax.device_put(v, param_shardings(config, mesh)) for k, v in teachers.items()}

    def advantage_fn(row_tasks: Sequence, batch: dict) -> np.ndarray:
        skills = [skill_of(t) for t in row_tasks]
        unknown = sorted(set(skills) - set(teachers))
        if unknown:
            raise ValueError(f"no teacher for skill(s) {unknown}; teachers: {sorted(teachers)}")
        inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
        teacher_logp = np.zeros(batch["mask"].shape, np.float32)
        for skill, params in teachers.items():
            rows = np.array([s == skill for s in skills])
            if rows.any():
                teacher_logp[rows] = np.asarray(token_logprobs(config, params, inputs, targets))[rows]
        return distill_advantages(teacher_logp, batch["old_logp"], batch["mask"])

    return advantage_fn


def run_distill(config, student_params, teachers: Dict[str, object], rl, sample_task: Callable[[random.Random], object],
                skill_of: Callable[[object], str], vocab, **kwargs) -> dict:
    """On-policy distillation of ``teachers`` ({skill: params}) into the student: ``run_grpo`` with the
    teacher advantage. kwargs go to run_grpo (log, eval_fn, eval_every, metrics_path, name, mesh, stop_fn).
    The task rewards are still computed and logged (reward_mean), but they do not enter the loss."""
    return run_grpo(config, student_params, rl, sample_task, vocab,
                    advantage_fn=make_teacher_advantage_fn(config, teachers, skill_of, kwargs.get("mesh")), **kwargs)
