"""The three skills of the post-training pipeline on one character-vocabulary policy (experiments/post_train):
their tasks, their held-out splits and what on-policy distillation recovered of each.

  reasoning  d2d1 arithmetic ("47+8=" -> "55": glm5_jax.rl.tasks.d2d1_task)
  agentic    multi-turn pointer chasing through a key-value tool (glm5_jax.agentic.agent.make_chain_task)
  general    digit sorting ("4827>" -> "2478": glm5_jax.rl.tasks.sort_task)
"""

from __future__ import annotations

import random
from typing import Dict, Mapping, Sequence

from glm5_jax.agentic.agent import make_chain_task
from glm5_jax.errors import ConfigError
from glm5_jax.rl.tasks import d2d1_task, distinct_tasks, sort_task

SKILLS = ("reasoning", "agentic", "general")


def make_skill_task(rng: random.Random, skill: str, cfg):
    """One task of `skill`; cfg: anything with max_hops, hop_alpha (agentic) and sort_digits (general)."""
    if skill == "reasoning":
        return d2d1_task(rng)
    if skill == "agentic":
        return make_chain_task(rng, max_hops=cfg.max_hops, alpha=cfg.hop_alpha)
    if skill == "general":
        return sort_task(rng, cfg.sort_digits)
    raise ValueError(f"unknown skill {skill!r}; allowed: {', '.join(SKILLS)}")


def distinct_skill_tasks(cfg, skill: str, n: int, stream: int, exclude=frozenset()) -> list:
    """The first ``n`` distinct tasks of ``skill`` drawn from ``random.Random(stream)``, none in ``exclude``;
    ConfigError when the skill has fewer distinct prompts."""
    try:
        return distinct_tasks(lambda rng: make_skill_task(rng, skill, cfg), n, random.Random(stream), exclude=exclude)
    except ValueError as e:
        raise ConfigError(f"skill {skill}: {e} (lower test_tasks / test_tasks_agentic / rm_eval_pairs)") from None


def skill_splits(cfg, sizes: Mapping[str, int], dev_sizes: Mapping[str, int], val_general: int, seed: int) -> dict:
    """{"test": {skill: sizes[skill] tasks}, "val_general": val_general more general tasks}: distinct prompts,
    disjoint. Skill k's TEST comes from stream 70_000 + 31 k + seed with every prompt of its development split
    (dev_sizes[skill] prompts of stream 50_000 + 31 k + seed, the split settings were chosen on) left out."""
    out = {"test": {}}
    for k, skill in enumerate(SKILLS):
        n = sizes[skill] + (val_general if skill == "general" else 0)
        dev = {t.prompt for t in distinct_skill_tasks(cfg, skill, dev_sizes[skill], 50_000 + 31 * k + seed)}
        ts = distinct_skill_tasks(cfg, skill, n, 70_000 + 31 * k + seed, exclude=dev)
        if skill == "general":
            out["val_general"], ts = ts[sizes[skill]:], ts[:sizes[skill]]
        out["test"][skill] = ts
    return out


def skill_recovery(skills: Dict[str, Dict[str, float]], trained_at: Mapping[str, str],
                   rl_stages: Sequence[str]) -> dict:
    """Per skill: how much of what the later RL stages took away the distill stage gave back.
    ``skills[stage][skill]`` for every stage of rl_stages and "distill"; trained_at[skill]: the RL stage T that
    trained it. best_before = value at T; min_later = min over the RL stages after T (= best_before when there
    is none); lost = best_before - min_later; recovered = distill - min_later; fraction = recovered / lost when
    lost > 0, else None."""
    out = {}
    for skill, trained in trained_at.items():
        best = float(skills[trained][skill])
        later = rl_stages[rl_stages.index(trained) + 1:]
        low = min(float(skills[s][skill]) for s in later) if later else best
        lost = best - low
        rec = float(skills["distill"][skill]) - low
        out[skill] = {"trained_at": trained, "later_stages": list(later), "best_before": best, "min_later": low,
                      "distill": float(skills["distill"][skill]), "lost": lost, "recovered": rec,
                      "fraction": (rec / lost) if lost > 0 else None}
    return out


__all__ = ["SKILLS", "distinct_skill_tasks", "make_skill_task", "skill_recovery", "skill_splits"]
