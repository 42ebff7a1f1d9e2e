"""distill_recovery: SFT skill A -> RL on skill B until A degrades -> on-policy distillation from both teachers.

Skills (character vocabulary, glm5_jax.rl.tasks): A = ``d2d1`` two-digit +/- one-digit arithmetic
("47+8=" -> "55"), B = countdown level 0 ("3 5->15:" -> "3*5").
Stages (one tiny DSA policy, everything through the one train step):
  sft_a    SFT (glm5_jax.train.train) on A, with a minority share of B worked examples
           (``sft_b_share``) so that RL on B has a non-zero reward to start from
  rl_b     GRPO/IcePop on B prompts only (glm5_jax.rl.program.run_grpo) until A's VALIDATION success
           falls ``degrade_margin`` below its sft_a value (checked every ``eval_every`` steps), or
           ``rl_b.steps`` steps
  distill  on-policy distillation (glm5_jax.rl.distill.run_distill) of the rl_b student: prompts drawn
           from A and B half and half; A prompts are scored by the A-teacher (the sft_a checkpoint),
           B prompts by the B-teacher (the rl_b checkpoint)
Reported (primary, fixed before the run): greedy success on the TEST prompts of each skill after every
stage, stages.<stage>.{skill_a, skill_b}. Validation prompts drive the stop rule only; test prompts
are never used to choose anything. Neither split is ever trained on.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import time
from typing import ClassVar

import jax

from experiments.registry import register
from experiments.report import md_table, plot_curves, write_report
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.fields import check_fields, setting
from glm5_jax.rl.distill import run_distill
from glm5_jax.rl.program import RLConfig, evaluate_accuracy, run_grpo
from glm5_jax.rl.sft import CharVocab, SFTIterator, char_policy
from glm5_jax.rl.tasks import countdown_task, d2d1_task, distinct_tasks, draw_excluding
from glm5_jax.train import TrainConfig, train

SKILLS = ("a", "b")
STAGES = ("sft_a", "rl_b", "distill")


def skill_task(rng: random.Random, skill: str):
    if skill == "a":
        return d2d1_task(rng)
    if skill == "b":
        return countdown_task(rng, 0)
    raise ValueError(f"unknown skill {skill!r}: a | b")


def skill_of(task) -> str:
    return "b" if task.kind == "countdown" else "a"


@dataclasses.dataclass(frozen=True)
class DistillRecoveryConfig:
    """model: the policy; train: SFT on A; rl_b: GRPO on B; distill: the distillation stage (its loss /
    optimiser / batch shape; the advantage is the teacher's)."""
    model: ModelConfig
    train: TrainConfig
    rl_b: RLConfig
    distill: RLConfig
    sft_b_share: float = 0.2               # fraction of SFT examples that are skill B
    degrade_margin: float = 0.1            # stop rl_b once val A success <= sft_a val A - margin
    eval_every: int = setting(10, integer=True, min=1)  # rl_b steps between validation checks of skill A
    test_tasks: int = setting(256, integer=True, min=1)  # skill A (d2d1: 1,800 distinct prompts)
    val_tasks: int = setting(128, integer=True, min=1)  # skill A
    test_tasks_b: int = setting(64, integer=True, min=1)  # skill B (countdown level 0 has only 208 distinct prompts)
    val_tasks_b: int = setting(32, integer=True, min=1)  # skill B

    STEPS_KEY: ClassVar[str] = "rl_b.steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "the character vocabulary"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=CharVocab().padded_size()))
        if not 0.0 <= self.sft_b_share < 1.0:
            raise ConfigError(f"DistillRecoveryConfig.sft_b_share={self.sft_b_share!r} is invalid: must be in [0, 1)")
        if not 0.0 < self.degrade_margin < 1.0:
            raise ConfigError(f"DistillRecoveryConfig.degrade_margin={self.degrade_margin!r} is invalid: must be in (0, 1)")
        check_fields(self)
        for f in ("rl_b", "distill"):
            if getattr(self, f).max_prompt_len < 9:
                raise ConfigError(f"DistillRecoveryConfig.{f}.max_prompt_len={getattr(self, f).max_prompt_len} is "
                                  "invalid: countdown prompts need >= 9 tokens (bos + '3 5->15:')")


_RL = RLConfig(steps=80, prompts_per_step=32, group_size=8, max_new_tokens=6, max_prompt_len=10, minibatches=1,
               learning_rate=1e-3, optimizer="adamw", adam_b2=0.999, adv_norm="informative",
               frozen_patterns=("indexer",), mismatch="none", seed=0)
TINY = DistillRecoveryConfig(
    model=char_policy(64, 4, 2, 192),
    train=TrainConfig(steps=400, batch_size=16, seq_len=64, learning_rate=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                      weight_decay=0.0, eval_every=400, log_every=100, ckpt_every=400, seed=0),
    rl_b=_RL,
    distill=_RL.replace(steps=60, prompts_per_step=64, group_size=1, learning_rate=5e-4, seed=1),
)
SMALL = dataclasses.replace(
    TINY, model=char_policy(256, 8, 4, 768),
    train=TINY.train.replace(steps=1500, batch_size=64, seq_len=128, learning_rate=1e-3, eval_every=1500,
                             ckpt_every=1500),
    rl_b=_RL.replace(steps=200, learning_rate=3e-4), distill=TINY.distill.replace(steps=200, learning_rate=2e-4),
    test_tasks=1024, val_tasks=512)


def splits(cfg: DistillRecoveryConfig):
    """{skill: (val tasks, test tasks)}: disjoint prompt sets per skill, never trained on."""
    out = {}
    for k, skill in enumerate(SKILLS):
        n_val, n_test = (cfg.val_tasks, cfg.test_tasks) if skill == "a" else (cfg.val_tasks_b, cfg.test_tasks_b)
        try:
            ts = distinct_tasks(lambda rng: skill_task(rng, skill), n_val + n_test,
                                random.Random(30_000 + 17 * k + cfg.train.seed))
        except ValueError as e:
            raise ConfigError(f"skill {skill}: {e} (val + test = {n_val + n_test})") from None
        out[skill] = (ts[:n_val], ts[n_val:])
    return out


@register("distill_recovery", "SFT skill A, RL on skill B until A degrades, then on-policy distillation from "
          "the A- and B-teachers: A and B success per stage", {"tiny": TINY, "small": SMALL})
def run(cfg: DistillRecoveryConfig, workdir: str, log, mesh=None) -> dict:
    t0 = time.time()
    vocab = CharVocab()
    mcfg, tc = cfg.model, cfg.train
    sp = splits(cfg)
    exclude = {t.prompt for v, te in sp.values() for t in v + te}
    max_new = cfg.rl_b.max_new_tokens

    draw = functools.partial(draw_excluding, skill_task, exclude)

    def success(params, tasks):
        return evaluate_accuracy(mcfg, params, tasks, vocab, max_new_tokens=max_new, greedy=True)["accuracy"]

    def test_eval(params):
        return {f"skill_{s}": success(params, sp[s][1]) for s in SKILLS}

    def val_eval(params):
        return {f"val_{s}": success(params, sp[s][0]) for s in SKILLS}

    stages, walls = {}, {}

    # ---- sft_a
    t = time.time()
    it = SFTIterator(lambda rng: draw(rng, "b" if rng.random() < cfg.sft_b_share else "a"), vocab,
                     tc.batch_size, tc.seq_len, seed=tc.seed, exclude=exclude)
    sft = train(mcfg, tc, it, os.path.join(workdir, "sft_a"), log=log, name="sft_a", mesh=mesh)
    teacher_a = sft["params"]
    stages["sft_a"] = test_eval(teacher_a)
    val0 = val_eval(teacher_a)
    walls["sft_a"] = time.time() - t
    log(f"[sft_a] test {stages['sft_a']} val {val0}")

    # ---- rl_b: GRPO on B until A (validation) degrades
    t = time.time()
    threshold = val0["val_a"] - cfg.degrade_margin
    rl = run_grpo(mcfg, teacher_a, cfg.rl_b, lambda rng: draw(rng, "b"), vocab, log=log, eval_fn=val_eval,
                  eval_every=cfg.eval_every, metrics_path=os.path.join(workdir, "rl_b.jsonl"), name="rl_b", mesh=mesh,
                  stop_fn=lambda ev: ev["val_a"] <= threshold)
    teacher_b = rl["params"]
    stages["rl_b"] = test_eval(teacher_b)
    walls["rl_b"] = time.time() - t
    log(f"[rl_b] stopped at {rl['stopped_at']} (threshold val_a <= {threshold:.3f}); test {stages['rl_b']}")

    # ---- distill: student = rl_b, teachers = {a: sft_a, b: rl_b}
    t = time.time()
    dist = run_distill(mcfg, teacher_b, {"a": teacher_a, "b": teacher_b}, cfg.distill,
                       lambda rng: draw(rng, "a" if rng.random() < 0.5 else "b"), skill_of, vocab, log=log,
                       eval_fn=val_eval, eval_every=cfg.eval_every,
                       metrics_path=os.path.join(workdir, "distill.jsonl"), name="distill", mesh=mesh)
    stages["distill"] = test_eval(dist["params"])
    walls["distill"] = time.time() - t
    log(f"[distill] test {stages['distill']}")

    # ---- report
    n_rl = len(rl["history"])
    curve = {s: ([0] + [e["step"] for e in rl["evals"]] + [n_rl + e["step"] for e in dist["evals"]],
                 [val0[f"val_{s}"]] + [e[f"val_{s}"] for e in rl["evals"]] + [e[f"val_{s}"] for e in dist["evals"]])
             for s in SKILLS}
    plot_curves(os.path.join(workdir, "val_success.png"), {f"skill {s} (val)": v for s, v in curve.items()},
                title=f"validation success: rl_b steps 1..{n_rl}, then distillation", xlabel="RL step (cumulative)",
                ylabel="greedy success")
    plot_curves(os.path.join(workdir, "test_success.png"),
                {f"skill {s}": (list(range(len(STAGES))), [stages[st][f"skill_{s}"] for st in STAGES]) for s in SKILLS},
                title="test success per stage (0 sft_a, 1 rl_b, 2 distill)", xlabel="stage", ylabel="greedy success")
    report = {"stages": stages, "primary_metric": "greedy test success per skill and stage",
              "skills": {"a": "d2d1 arithmetic", "b": "countdown level 0"},
              "val_sft_a": val0, "rl_b_steps": n_rl, "rl_b_stopped_at": rl["stopped_at"],
              "degrade_threshold_val_a": threshold, "distill_steps": len(dist["history"]),
              "distill_reward_first_last": [dist["history"][0]["reward_mean"], dist["history"][-1]["reward_mean"]],
              "stage_wall_s": walls, "test_prompts": {"a": cfg.test_tasks, "b": cfg.test_tasks_b},
              "params": int(sum(x.size for x in jax.tree.leaves(teacher_a))), "wall_time_s": time.time() - t0}
    rows = [[st, stages[st]["skill_a"], stages[st]["skill_b"]] for st in STAGES]
    stop = (f"stopped at step {rl['stopped_at']} (val A <= {threshold:.3f})" if rl["stopped_at"]
            else f"ran all {n_rl} steps without val A falling to {threshold:.3f}")
    md = f"""# distill_recovery

Skill A: two-digit +/- one-digit arithmetic ("47+8=" -> "55"). Skill B: countdown level 0 ("3 5->15:" -> "3*5").
Model: DSA, d_model {mcfg.d_model}, {mcfg.num_layers} layers, {report['params']:,} parameters, character vocabulary.

1. sft_a: {tc.steps} SFT steps ({tc.batch_size}x{tc.seq_len}), {1 - cfg.sft_b_share:.0%} A / {cfg.sft_b_share:.0%} B examples.
2. rl_b: GRPO/IcePop on B prompts only ({cfg.rl_b.prompts_per_step} prompts x {cfg.rl_b.group_size} samples per step,
   AdamW lr {cfg.rl_b.learning_rate}); stop rule on the validation split: {stop}.
3. distill: {len(dist['history'])} on-policy distillation steps ({cfg.distill.prompts_per_step} student samples per step,
   half A, half B prompts; advantage sg[log pi_teacher - log pi_student] per token through the IcePop loss;
   A-teacher = sft_a, B-teacher = rl_b; AdamW lr {cfg.distill.learning_rate}).

Greedy success on the test prompts ({cfg.test_tasks} A, {cfg.test_tasks_b} B; never trained on, never used for a
decision; binomial standard error up to {0.5 / cfg.test_tasks ** 0.5:.3f} for A and {0.5 / cfg.test_tasks_b ** 0.5:.3f} for B):

{md_table(["stage", "skill A", "skill B"], rows)}

![validation success](val_success.png)

![test success](test_success.png)

Wall time {report['wall_time_s']:.0f} s (sft_a {walls['sft_a']:.0f} s, rl_b {walls['rl_b']:.0f} s, distill {walls['distill']:.0f} s).
"""
    write_report(workdir, report, md)
    return report
