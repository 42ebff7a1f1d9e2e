"""dsa_vs_mla: is DSA, added to a dense MLA model by continued pre-training, lossless against MLA?

Primary metric (fixed before the run): the test LM-loss gap DSA - MLA in % of MLA's, on held-out
real text (the eval split of data.path; None -> the stdlib sources), paired by seed (both arms
continue the same base on the same data order), mean with a 95% t interval over the seeds. "Lossless"
is read against a margin fixed here too (`lossless_margin_pct`): the interval must lie inside it.

Phases per seed (each its own resumable workdir under seed_<s>/):
  base         pre-train a dense MLA model (train.learning_rate, warm-up, cosine to min_lr_ratio x peak)
  mla          continue it densely for train.steps                  (arm "mla")
  dsa_warmup   add the lightning indexer; base frozen, indexer trained by the dense KL (top-k free:
               attention stays dense, so one warm-up serves every top-k below)
  dsa          sparse adaptation at model.index_topk: everything trains, top-k attention  (arm "dsa")
  dsa_topk<k>  the same sparse adaptation at the other `topk_fractions` of T, for
               `short_adaptation_steps` steps (the gap against k/T)
  mha          optional: an MHA model of the same width trained from scratch on as many tokens
The continued phases evaluate dev and test LM loss every `short_adaptation_steps` steps, so the gap
at the short and the full adaptation length comes from the same runs (their schedule is constant
after its warm-up, so a run's state at step n is a run of n steps). Nothing is chosen on test data.
Learning rates (DeepSeek-V3.2's recipe: indexer warm-up at its own rate with the rest frozen, then
adaptation at DeepSeek-V3's final pre-training rate): the continued phases do not restart the base's
schedule at its peak; they run at the base's final rate (train.learning_rate x min_lr_ratio),
constant after `continued_warmup_steps` of linear warm-up (their optimizer moments start fresh).
`phase_plan` gives every phase's TrainConfig. `--steps N` (the `steps` field) scales every phase by
N / train.steps (base, warm-ups, both adaptation lengths, eval/log intervals; rounded, at least 1), so
`--steps=2` is a quick smoke run; `--set train.steps=N` changes only the continued phases.
Secondary: retrieval records (a minor share of training) scored on held-out probes with chance and
copy levels, indexer recall, and measured attention time dense vs sparse.
Where the gap comes from (issue 45, `gap_decomposition`): at each top-k, the continued MLA model evaluated
with oracle top-k (ModelConfig.dsa_topk_source="oracle": each query's k keys are the top-k of its own
head-averaged dense attention; no training, its params grafted onto the DSA config) gives the cost of
attending to k keys at all; the DSA model with its indexer gives the whole gap; their difference is the
indexer's choice. Beside them the attention mass the selected keys carry (glm5_jax.attention.selection).
All recorded by the continued phases' evaluations (every short_adaptation_steps), on the test batches.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import ClassVar

import numpy as np

from experiments.registry import register
from experiments.report import (chain_series, eval_series, fmt_interval, md_table, mean_interval,
                                paired_bootstrap_interval, plot_curves, wilson_interval, write_report)
from glm5_jax.attention.selection import mass_beyond
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.data.retrieval import EVAL_TAG, TEST_TAG, retrieval_probe_batches
from glm5_jax.eval import IndexerRecall, LMLoss, RetrievalAccuracy, evaluate
from glm5_jax.eval.dsa import as_oracle, decomposition_fn, mass_buckets, time_attention
from glm5_jax.eval.metrics import attention_mass
from glm5_jax.eval.probes import score_probes
from glm5_jax.eval.stats import distance_curve, metric_at
from glm5_jax.optim.schedules import warmup_cosine
from glm5_jax.train import Stage, TrainConfig, train_stages


PRIMARY_METRIC = ("test LM-loss gap of dsa vs mla, 100 x (loss_dsa - loss_mla) / loss_mla on held-out real text after "
                  "the full adaptation at top-k = model.index_topk, paired by seed; mean with a 95% t interval over seeds")


@dataclasses.dataclass(frozen=True)
class DsaVsMlaConfig:
    """model: the DSA model (attention "dsa"); the mla arm is the same model without the indexer and
    the mha arm has num_kv_heads = num_heads and head_dim = qk_nope + qk_rope. train: every phase's
    settings; its schedule (learning_rate, warmup_steps, min_lr_ratio) is the base's, the continued
    (mla / dsa) phases run at the base's final rate (phase_plan); train.steps: the continued phases'
    (full adaptation) steps. steps (--steps): scale every phase by steps / train.steps (None: as
    configured). data: the LM corpus with retrieval records mixed into training from the first step
    (model.vocab_size and data.seq_len follow data.vocab_size and train.seq_len).
    Held-out data: `train.eval_batches` dev LM batches and `dev_probe_batches` dev probes (EVAL_TAG)
    are scored during training and may be used to choose settings; `test_lm_batches` other held-out
    LM batches and `test_probe_batches` test probes (TEST_TAG) give the reported figures.
    topk_fractions: the gap against k/T (each fraction x T an integer top-k), each after
    `short_adaptation_steps`; the continued phases are evaluated every short_adaptation_steps, which
    gives the gap against adaptation length. lossless_margin_pct: "lossless" means the 95% interval
    of the primary gap lies within +-margin (fixed before the run).
    seeds: every phase runs once per seed (train.seed + s, data stream seed + s); the report gives
    the mean with a 95% t interval over seeds, and Wilson intervals over probes per seed.
    lr_choice_learning_rate (fixed before the run, issue 45): one more sparse adaptation at top-k =
    model.index_topk for short_adaptation_steps from the same warm-up, at this rate instead of the base's
    final rate (1e-3 at tiny): 3e-3, 3x it (towards the indexer warm-up's 1e-2). Reason, stated before the
    run: the gap is flat against adaptation length at 1e-3, so if the adaptation were step-size-limited a
    larger step shows it (a smaller rate can only move less in as many steps). None: no such arm.
    mass_batches: test LM batches the attention-mass figures are measured on (their first ones)."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    pretrain_steps: int = 320              # dense MLA base; the mha arm trains pretrain_steps + train.steps
    indexer_warmup_steps: int = 30         # dense indexer warm-up, base frozen
    indexer_learning_rate: float = 1e-2
    short_adaptation_steps: int = 40       # the shorter adaptation length, and the continued phases' eval interval
    topk_fractions: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
    lossless_margin_pct: float = 1.0
    test_lm_batches: int = 8               # held-out LM batches for the test figures (dev: train.eval_batches)
    dev_probe_batches: int = 2             # retrieval probes watched during training (dev)
    test_probe_batches: int = 16           # retrieval probes for the secondary figures (test), batches of train.batch_size
    distance_bins: int = 4                 # accuracy-vs-distance plot
    mha_arm: bool = False                  # also train an MHA model from scratch on as many tokens
    seeds: tuple[int, ...] = (0, 1, 2)
    bench_seq_len: int = 4096              # second attention-timing shape (batch 1)
    continued_warmup_steps: int = 10       # mla / dsa: linear warm-up to the base's final rate (fresh moments)
    steps: int | None = None               # --steps N: continued phases N steps, every phase x N / train.steps
    lr_choice_learning_rate: float | None = 3e-3   # the extra sparse adaptation's rate (fixed before the run)
    mass_batches: int = 2                  # test LM batches for the attention-mass figures

    STEPS_KEY: ClassVar[str] = "steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "data.vocab_size", "data.seq_len": "train.seq_len"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=self.data.vocab_size))
        object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=self.train.seq_len))
        if self.model.attention != "dsa":
            raise ConfigError(f"DsaVsMlaConfig.model.attention={self.model.attention!r} is invalid: must be 'dsa' "
                              "(the mla and mha arms are derived from it)")
        if self.model.indexer_types is not None:
            raise ConfigError(f"DsaVsMlaConfig.model.indexer_types={self.model.indexer_types!r} is invalid: must be "
                              "None (every layer 'full'), so the MLA base's layer stacks graft onto the DSA model")
        for f in ("pretrain_steps", "indexer_warmup_steps", "dev_probe_batches", "test_probe_batches",
                  "distance_bins", "bench_seq_len", "short_adaptation_steps", "test_lm_batches", "mass_batches"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                raise ConfigError(f"DsaVsMlaConfig.{f}={getattr(self, f)!r} is invalid: must be an integer >= 1")
        if self.short_adaptation_steps > self.train.steps:
            raise ConfigError(f"DsaVsMlaConfig.short_adaptation_steps={self.short_adaptation_steps} is invalid: must "
                              f"be <= train.steps={self.train.steps} (the full adaptation length)")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ConfigError(f"DsaVsMlaConfig.steps={self.steps!r} is invalid: an integer >= 1 (every phase scaled by "
                              "steps / train.steps) or None (the configured step counts)")
        if not isinstance(self.continued_warmup_steps, int) or self.continued_warmup_steps < 0:
            raise ConfigError(f"DsaVsMlaConfig.continued_warmup_steps={self.continued_warmup_steps!r} is invalid: "
                              "must be an integer >= 0")
        if self.lr_choice_learning_rate is not None and not self.lr_choice_learning_rate > 0:
            raise ConfigError(f"DsaVsMlaConfig.lr_choice_learning_rate={self.lr_choice_learning_rate!r} is invalid: must "
                              "be > 0, or None (no learning-rate-choice arm)")
        if not self.indexer_learning_rate > 0:
            raise ConfigError(f"DsaVsMlaConfig.indexer_learning_rate={self.indexer_learning_rate!r} is invalid: must be > 0")
        if not self.lossless_margin_pct > 0:
            raise ConfigError(f"DsaVsMlaConfig.lossless_margin_pct={self.lossless_margin_pct!r} is invalid: must be > 0")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"DsaVsMlaConfig.seeds={self.seeds!r} is invalid: a non-empty tuple of distinct ints >= 0")
        T = self.train.seq_len
        for fr in self.topk_fractions:
            k = fr * T
            if not 0 < fr <= 1 or abs(k - round(k)) > 1e-6:
                raise ConfigError(f"DsaVsMlaConfig.topk_fractions has {fr!r}: each must be in (0, 1] with fraction x "
                                  f"train.seq_len ({T}) a whole number of keys")
        if len(set(topk_list(self))) != len(self.topk_fractions):
            raise ConfigError(f"DsaVsMlaConfig.topk_fractions={self.topk_fractions!r} is invalid: the fractions must "
                              "be distinct")
        if self.data.retrieval_fraction <= 0:
            raise ConfigError(f"DsaVsMlaConfig.data.retrieval_fraction={self.data.retrieval_fraction!r} is invalid: "
                              "must be > 0 (the retrieval probe is the secondary figure)")
        md = self.data.min_distance(self.train.seq_len)
        if md < self.model.index_topk:
            raise ConfigError(f"DsaVsMlaConfig.data.retrieval_min_distance={md} is invalid: must be >= "
                              f"model.index_topk={self.model.index_topk}, so every probe's record lies beyond what a "
                              "local top-k window could cover and DSA must select it")


def topk_list(cfg: DsaVsMlaConfig) -> list[int]:
    """The top-k of every fraction in cfg.topk_fractions (fraction x train.seq_len keys)."""
    return [int(round(fr * cfg.train.seq_len)) for fr in cfg.topk_fractions]


TINY = DsaVsMlaConfig(
    model=ModelConfig(vocab_size=2048, d_model=128, num_layers=2, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_dim=384, num_experts=4,
                      moe_ffn_dim=128, first_k_dense=1, attention="dsa", index_topk=16, index_n_heads=2,
                      index_head_dim=32, mtp_depth=0, attn_chunk=128),
    # T=128 with top-k 16 = T/8 (the longest T whose three seeds x (base + 2 full + 3 short adaptations) fit
    # 15 minutes on 2 cores; docs/experiments.md "dsa_vs_mla"); base 320 steps at 1e-2 cosine to 1e-3.
    train=TrainConfig(steps=120, batch_size=16, seq_len=128, learning_rate=1e-2, warmup_steps=50, min_lr_ratio=0.1,
                      eval_every=80, log_every=40, ckpt_every=200, eval_batches=4, seed=0),
    # LM text from the stdlib sources; 10% of training sequences are MQAR-style retrieval records (16 one-token
    # keys each directly followed by a 1-digit value, restated at the end): the secondary probe.
    data=DataConfig(vocab_size=2048, seq_len=128, seed=0, retrieval_fraction=0.1, retrieval_pairs=16,
                    retrieval_key_digits=2, retrieval_value_digits=1, retrieval_min_distance=24),
    pretrain_steps=320, indexer_warmup_steps=30, short_adaptation_steps=40,
)
SMALL = dataclasses.replace(
    TINY,
    model=preset("small", vocab_size=32768, mtp_depth=0, index_topk=512),
    train=TINY.train.replace(steps=2000, batch_size=16, seq_len=4096, learning_rate=1e-3, eval_every=250,
                             log_every=125, ckpt_every=250, eval_batches=16),
    data=dataclasses.replace(TINY.data, vocab_size=32768, retrieval_fraction=0.1, retrieval_pairs=16,
                             retrieval_key_digits=3, retrieval_value_digits=3, retrieval_min_distance=1024),
    pretrain_steps=4000, indexer_warmup_steps=200, indexer_learning_rate=3e-3, short_adaptation_steps=500,
    test_lm_batches=16, test_probe_batches=32, mha_arm=True, bench_seq_len=32768)


def model_configs(model: ModelConfig) -> dict[str, ModelConfig]:
    """The three arms from the experiment's DSA model."""
    mla = model.replace(attention="mla", indexer_types=None)
    mha = model.replace(attention="mha", indexer_types=None, num_kv_heads=model.num_heads,
                        head_dim=model.qk_nope_head_dim + model.qk_rope_head_dim)
    return {"mla": mla, "dsa": model, "mha": mha}


def lr_schedule(tc: TrainConfig):
    """The learning-rate schedule train() builds for `tc` (glm5_jax.train.state.build_optimizer)."""
    return warmup_cosine(tc.learning_rate, min(tc.warmup_steps, tc.steps), tc.steps, tc.min_lr_ratio)


def phase_plan(cfg: DsaVsMlaConfig) -> dict:
    """{"scale": factor, "base" | "mla" | "dsa_warmup" | "dsa" | "dsa_short" | "mha": TrainConfig} of
    every phase (seed offset 0). scale = cfg.steps / train.steps (1 without --steps); every step count
    (phase lengths, short_adaptation_steps, schedule warm-ups, eval_every, log_every) is multiplied by
    it, rounded, at least 1 (a warm-up of 0 stays 0). base: train's schedule over its own steps
    (cosine to min_lr_ratio x peak); mla / dsa: the base's final rate, constant after a linear
    warm-up (no restart at the peak), evaluated every short adaptation length; dsa_short: the dsa
    phase cut at the short adaptation length (the other top-k fractions)."""
    tc = cfg.train
    f = cfg.steps / tc.steps if cfg.steps is not None else 1.0
    n = lambda k: max(1, int(round(k * f)))                      # noqa: E731
    w = lambda k: 0 if k == 0 else n(k)                          # noqa: E731
    P, C, W = n(cfg.pretrain_steps), cfg.steps if cfg.steps is not None else tc.steps, n(cfg.indexer_warmup_steps)
    S = min(n(cfg.short_adaptation_steps), C)
    base = tc.replace(steps=P, warmup_steps=w(tc.warmup_steps), eval_every=n(tc.eval_every), log_every=n(tc.log_every))
    final_lr = float(f"{float(lr_schedule(base)(P)):.6g}")      # where the base's schedule ended (float32: 6 digits)
    cont = tc.replace(steps=C, learning_rate=final_lr, warmup_steps=min(w(cfg.continued_warmup_steps), S),
                      min_lr_ratio=1.0, eval_every=S, log_every=n(tc.log_every))
    dsa = cont.replace(indexer_loss="sparse")
    plan = {"scale": f, "base": base, "mla": cont, "dsa": dsa, "dsa_short": dsa.replace(steps=S),
            "dsa_warmup": tc.replace(steps=W, indexer_loss="dense", trainable_pattern="indexer",
                                     learning_rate=cfg.indexer_learning_rate, warmup_steps=min(5, W), eval_every=W,
                                     log_every=n(tc.log_every))}
    if cfg.mha_arm:
        plan["mha"] = base.replace(steps=P + C)
    return plan


def lr_choice_plan(cfg: DsaVsMlaConfig) -> TrainConfig | None:
    """The learning-rate-choice arm (issue 45): the short sparse adaptation at top-k = model.index_topk at
    cfg.lr_choice_learning_rate instead of the base's final rate (same warm-up, steps and data); None
    without one."""
    if cfg.lr_choice_learning_rate is None:
        return None
    return phase_plan(cfg)["dsa_short"].replace(learning_rate=float(cfg.lr_choice_learning_rate))


def make_eval_fn(cfg: ModelConfig, lm_batches, ret_batches, test_lm=None, extra=None):
    """Eval during training (glm5_jax.eval): LM loss on the dev LM batches and dev retrieval accuracy (if probes
    are given); with test_lm, the test LM loss too ("test_loss", "test_accuracy"), recorded for the report and
    never used to choose anything; extra(params) -> more entries (glm5_jax.eval.dsa.decomposition_fn)."""
    def eval_fn(params):
        out = evaluate(cfg, params, lm_batches)
        if ret_batches:
            out["retrieval_accuracy"] = evaluate(cfg, params, ret_batches, [RetrievalAccuracy()])["retrieval_accuracy"]
        if test_lm:
            out.update(evaluate(cfg, params, test_lm, [LMLoss("test_loss", "test_accuracy")]))
        if extra is not None:
            out.update(extra(params))
        return out
    return eval_fn


def eval_fns(cfg: DsaVsMlaConfig, probes: dict, lm: dict) -> dict:
    """The eval functions of every phase, built once per run (every seed reuses their traces):
    "mla" / "dsa" / "mha": dev LM + dev retrieval; "mla_cont" / "dsa_cont": also the test LM loss
    (continued phases); k (int): the top-k sweep's DSA model at k, dev + test LM."""
    cfgs = model_configs(cfg.model)
    ks, K, mass_lm = topk_list(cfg), cfgs["dsa"].index_topk, lm["test"][:cfg.mass_batches]
    dec = lambda arm, kk: decomposition_fn(cfgs["dsa"], lm["test"], mass_lm, kk, arm, mass_ks=(K,))  # noqa: E731
    out = {k: make_eval_fn(c, lm["dev"], probes["dev"]) for k, c in cfgs.items()}
    out["mla_cont"] = make_eval_fn(cfgs["mla"], lm["dev"], probes["dev"], lm["test"], extra=dec("mla", tuple(ks)))
    out["dsa_cont"] = make_eval_fn(cfgs["dsa"], lm["dev"], probes["dev"], lm["test"], extra=dec("dsa", (K,)))
    out.update({k: make_eval_fn(cfgs["dsa"].replace(index_topk=k), lm["dev"], None, lm["test"], extra=dec("dsa", (k,)))
                for k in ks if k != K})
    out["dsa_lr"] = make_eval_fn(cfgs["dsa"], lm["dev"], None, lm["test"], extra=dec("dsa", (K,)))
    return out


def phase_stages(cfg: DsaVsMlaConfig, s: int) -> dict:
    """Every phase of seed s as a glm5_jax.train.stages.Stage run from the base phase's TrainConfig (model
    overrides on the MLA model: the warm-up adds the indexer, seeded train.seed + s + 7; the top-k sweep changes
    index_topk); chains of them share one workdir, so a branch reruns nothing its trunk has done."""
    seed = cfg.train.seed + s
    plan = {k: v.replace(seed=seed) for k, v in phase_plan(cfg).items() if k != "scale"}
    base, K = plan["base"], cfg.model.index_topk
    st = {"base": Stage.of("base", base, base), "mla": Stage.of("mla", plan["mla"], base),
          "dsa_warmup": Stage.of("dsa_warmup", plan["dsa_warmup"], base, model={"attention": "dsa"}, init_seed=seed + 7),
          "dsa": Stage.of("dsa", plan["dsa"], base)}
    st.update({f"dsa_topk{k}": Stage.of(f"dsa_topk{k}", plan["dsa_short"], base, model={"index_topk": k})
               for k in topk_list(cfg) if k != K})
    if lr_choice_plan(cfg) is not None:
        st["dsa_lr"] = Stage.of("dsa_lr", lr_choice_plan(cfg).replace(seed=seed), base)
    if cfg.mha_arm:
        st["mha"] = Stage.of("mha", plan["mha"], base)
    return st


def run_seed(cfg: DsaVsMlaConfig, data, s: int, workdir: str, log, mesh, probes: dict, lm: dict,
             evals: dict) -> dict:
    """Every phase for one seed (glm5_jax.train.train_stages chains in seed_<s>/); returns the trained arms'
    runs, the top-k sweep's histories, test probe scores and indexer figures. evals: eval_fns(...)."""
    cfgs, st, K = model_configs(cfg.model), phase_stages(cfg, s), cfg.model.index_topk
    base_tc = phase_plan(cfg)["base"].replace(seed=cfg.train.seed + s)
    offset = {"base": 0, "mha": 0, "dsa_warmup": 2}
    eval_key = {"base": "mla", "mla": "mla_cont", "dsa_warmup": "dsa", "dsa": "dsa_cont", "dsa_lr": "dsa_lr", "mha": "mha",
                **{f"dsa_topk{k}": k for k in topk_list(cfg)}}

    def chain(*names, model=cfgs["mla"], folder=f"seed_{s}"):
        out = train_stages(model, base_tc, [st[n] for n in names], lambda stage, i: data.train_iter(
            base_tc.batch_size, base_tc.seq_len, seed=cfg.data.seed + 1000 * s + offset.get(stage.name, 1)),
            os.path.join(workdir, folder), mesh=mesh, log=log, eval_fn_for_stage=lambda stage, i, c: evals[eval_key[stage.name]])
        last = out["stages"][-1]
        return {"params": out["params"], "history": last["history"], "final": last["final"], "all": out["stages"]}

    runs = {"mla": chain("base", "mla")}
    base = runs["mla"]["all"][0]
    warm = chain("base", "dsa_warmup")
    runs["dsa"] = chain("base", "dsa_warmup", "dsa")
    # top-k -> history of the short sparse adaptation at that k (the primary k: its run)
    sweep = {k: runs["dsa"]["history"] if k == K else chain("base", "dsa_warmup", f"dsa_topk{k}")["history"]
             for k in topk_list(cfg)}
    lr_run = chain("base", "dsa_warmup", "dsa_lr")["history"] if "dsa_lr" in st else None
    if cfg.mha_arm:
        runs["mha"] = chain("mha", model=cfgs["mha"], folder=f"seed_{s}_mha")
    log(f"[s{s}] scoring test probes ...")
    vd = cfg.data.retrieval_value_digits
    test = {name: score_probes(cfgs[name], r["params"], probes["test"], vd) for name, r in runs.items()}
    test_lm = {name: evaluate(cfgs[name], r["params"], lm["test"]) for name, r in runs.items()}
    warm_scores = score_probes(cfgs["dsa"], warm["params"], probes["test"], vd)
    # per-layer / per-bucket attention mass after the full adaptation (report.json "attention_mass")
    mass_lm, T = lm["test"][:cfg.mass_batches], base_tc.seq_len
    mass = {"dsa": attention_mass(cfgs["dsa"], runs["dsa"]["params"], mass_lm, mass_buckets(T)),
            "mla_oracle": attention_mass(*as_oracle(cfgs["dsa"], K, runs["mla"]["params"]), mass_lm, mass_buckets(T))}
    recall = lambda p: evaluate(cfgs["dsa"], p, lm["dev"][:2], [IndexerRecall()])["indexer_recall"]  # noqa: E731
    return {"base": base, "runs": runs, "warm": warm, "test": test, "test_lm": test_lm, "sweep": sweep,
            "lr_choice": lr_run, "mass": mass,
            "answer_key_recall_after_warmup": {k: float(v.mean()) for k, v in warm_scores["answer_key_recall"].items()},
            "indexer_recall_after_warmup": recall(warm["params"]), "indexer_recall_final": recall(runs["dsa"]["params"])}


def recorded_test_loss(history: list[dict], step: int) -> float:
    """The test LM loss a continued phase recorded at `step` (its eval rows, make_eval_fn with test_lm)."""
    return metric_at(history, step, "test_loss")


def _row(history: list[dict], step: int) -> dict:
    """The eval row a continued phase recorded at `step` ({} if none)."""
    return next((r for r in history if r.get("step") == step and "test_loss" in r), {})


def decomposition_entry(dsa_hists: list, mla_hists: list, k: int, step: int, buckets) -> dict:
    """One gap_decomposition entry from the recorded evaluations of each seed's DSA run (top-k k) and the
    continued MLA run, at `step`: the whole gap (DSA with its indexer), the oracle gap (continued MLA with
    oracle top-k: sparsity itself), their paired difference (the indexer's choice), the adapted DSA
    model's gap with oracle top-k instead of its indexer, and the attention mass figures; intervals over
    seeds (mean_interval's shape)."""
    mla = [recorded_test_loss(h, step) for h in mla_hists]
    og = [gap_pct(metric_at(h, step, f"oracle_test_loss_k{k}"), m) for h, m in zip(mla_hists, mla)]
    ig = [gap_pct(recorded_test_loss(h, step), m) for h, m in zip(dsa_hists, mla)]
    dg = [gap_pct(metric_at(h, step, "oracle_test_loss"), m) for h, m in zip(dsa_hists, mla)]
    per = lambda key: [metric_at(h, step, key) for h in dsa_hists]  # noqa: E731
    im, om, rc = per("indexer_mass"), per("oracle_mass"), per("indexer_recall_of_oracle")
    mom = [h_row.get(f"mla_oracle_mass_k{k}") for h_row in (_row(h, step) for h in mla_hists)]
    mom = None if any(v is None for v in mom) else float(np.mean(mom))
    sel = [i - o for i, o in zip(ig, og)]
    bucket = lambda key: [float(np.mean([metric_at(h, step, f"{key}_b{j}") for h in dsa_hists]))  # noqa: E731
                          for j in range(len(buckets))]
    o_iv, s_iv = mean_interval(og), mean_interval(sel)
    return {"topk": k, "adaptation_steps": step,
            "oracle_gap_pct": o_iv, "oracle_gap_pct_per_seed": og,
            "indexer_gap_pct": mean_interval(ig), "indexer_gap_pct_per_seed": ig,
            "selection_cost_pct": s_iv, "dsa_oracle_gap_pct": mean_interval(dg),
            "selection_cost_same_params_pct": mean_interval([i - d for i, d in zip(ig, dg)]),
            "oracle_mass": float(np.mean(om)), "oracle_mass_interval": mean_interval(om),
            "indexer_mass": float(np.mean(im)), "indexer_mass_interval": mean_interval(im),
            "indexer_recall_of_oracle": float(np.mean(rc)), "mla_oracle_mass": mom,
            "mass_by_bucket": {"buckets": [list(b) for b in buckets], "indexer": bucket("indexer_mass"),
                               "oracle": bucket("oracle_mass")},
            "dominant": "sparsity" if o_iv["mean"] >= s_iv["mean"] else "indexer"}


def decomposition_sentence(e: dict, T: int) -> str:
    """Which source dominates at one entry, with its intervals."""
    iv = lambda d: fmt_interval(d["mean"], d["lo"], d["hi"], 2)  # noqa: E731
    what = ("the cost of attending to k keys at all (oracle top-k on the continued MLA model)" if e["dominant"] == "sparsity"
            else "the indexer's choice of keys")
    return (f"At top-k {e['topk']} = T/{T // e['topk']} after {e['adaptation_steps']} sparse-adaptation steps the DSA "
            f"gap {iv(e['indexer_gap_pct'])}% splits into sparsity itself {iv(e['oracle_gap_pct'])}% and the indexer's "
            f"choice {iv(e['selection_cost_pct'])}% (on the adapted DSA params themselves, indexer vs oracle top-k: "
            f"{iv(e['selection_cost_same_params_pct'])}%): {what} dominates (attention mass on the selected keys: indexer "
            f"{e['indexer_mass']:.3f}, oracle {e['oracle_mass']:.3f}; indexer recall of the oracle's keys "
            f"{e['indexer_recall_of_oracle']:.3f}).")


def gap_pct(dsa_loss: float, mla_loss: float) -> float:
    return 100.0 * (dsa_loss - mla_loss) / mla_loss


def lossless_verdict(gap: dict, margin: float) -> tuple[str, str]:
    """(verdict, one sentence) for the primary gap's interval against the +-margin fixed before the run."""
    m, lo, hi = gap["mean"], gap["lo"], gap["hi"]
    if lo is None:
        return "undetermined", (f"With one seed there is no interval, so this run cannot say whether DSA is lossless "
                                f"(gap {m:+.2f}%).")
    iv = f"{m:+.2f}% [{lo:+.2f}, {hi:+.2f}] over {gap['n']} seeds"
    if -margin <= lo and hi <= margin:
        return "lossless", (f"DSA is lossless here within the +-{margin:g}% margin fixed before the run: its test "
                            f"LM loss is {iv} from continued MLA's.")
    if lo > 0:
        return "worse", (f"DSA is not lossless here: its test LM loss is above continued MLA's by {iv} "
                         f"(the interval excludes 0{' and exceeds the margin' if lo > margin else ''}).")
    if hi < 0:
        return "better", f"DSA's test LM loss is below continued MLA's by {iv} (the interval excludes 0)."
    return "inconclusive", (f"Inconclusive: the gap {iv} includes 0 but reaches beyond the +-{margin:g}% margin, so "
                            "this run neither shows DSA lossless nor shows a loss.")


def continued_vs_base(seeds: dict) -> dict:
    """Dev LM loss (the eval batches watched in training) at the end of the base and after the
    continued MLA phase, per seed and averaged; at_or_below: the continued arm ended at or below its
    base's dev loss in every seed (the continued phases must not jolt the base off its schedule)."""
    per = {str(s): {"base": float(r["base"]["final"]["eval_loss"]),
                    "continued_mla": float(r["runs"]["mla"]["final"]["eval_loss"]),
                    "dsa_after_warmup": float(r["warm"]["final"]["eval_loss"]),
                    "dsa": float(r["runs"]["dsa"]["final"]["eval_loss"])} for s, r in seeds.items()}
    base = float(np.mean([v["base"] for v in per.values()]))
    cont = float(np.mean([v["continued_mla"] for v in per.values()]))
    return {"base_dev_loss": base, "continued_mla_dev_loss": cont, "diff": cont - base,
            "at_or_below": all(v["continued_mla"] <= v["base"] for v in per.values()), "per_seed": per}


@register("dsa_vs_mla", "DSA added to a dense MLA model by continued pre-training vs continued MLA: test LM-loss "
          "gap on real text over seeds, against top-k / T and adaptation length; retrieval and indexer recall",
          {"tiny": TINY, "small": SMALL})
def run(cfg: DsaVsMlaConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    data = build_lm_data(cfg.data)
    if data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"tokenizer vocab {data.tokenizer.vocab_size} != data.vocab_size {cfg.model.vocab_size}")
    cfgs = model_configs(cfg.model)
    plan = phase_plan(cfg)
    tc = plan["mla"]
    P, C, W, S = plan["base"].steps, tc.steps, plan["dsa_warmup"].steps, plan["dsa_short"].steps
    B, T, K, vd = tc.batch_size, tc.seq_len, cfgs["dsa"].index_topk, cfg.data.retrieval_value_digits
    log(f"primary metric (named before the run): {PRIMARY_METRIC}; lossless = its 95% interval within "
        f"+-{cfg.lossless_margin_pct:g}%")
    # held-out LM batches: the first train.eval_batches = dev (watched in training), the next
    # test_lm_batches = test (the reported figures)
    n_dev = cfg.train.eval_batches
    lm_all = list(data.eval_batches(B, T, max_batches=n_dev + cfg.test_lm_batches))
    if len(lm_all) < n_dev + 1:
        raise ConfigError(f"the eval split gives {len(lm_all)} batches of {B}x{T}; need > train.eval_batches="
                          f"{n_dev} for dev + test (more held-out text: data.eval_fraction / data.max_files)")
    lm = {"dev": lm_all[:n_dev], "test": lm_all[n_dev:]}
    task = data.retrieval_task("eval", T)
    probes = {"dev": list(retrieval_probe_batches(task, B, cfg.dev_probe_batches, cfg.data.seed, EVAL_TAG)),
              "test": list(retrieval_probe_batches(task, B, cfg.test_probe_batches, cfg.data.seed, TEST_TAG))}
    probes_dev_batches = [b for b, _ in probes["dev"]]
    seeds = {}
    evals = eval_fns(cfg, {"dev": probes_dev_batches}, lm)
    for i, s in enumerate(cfg.seeds):
        log(f"== seed {s} ({i + 1}/{len(cfg.seeds)})" + (
            f", {(time.time() - t_start) / i * (len(cfg.seeds) - i):.0f} s left (ETA)" if i else ""))
        seeds[s] = run_seed(cfg, data, s, workdir, log, mesh, {"dev": probes_dev_batches, "test": probes["test"]}, lm,
                            evals)

    log("timing attention dense vs sparse ...")
    timing = {f"T={T}": time_attention(cfgs["mla"], cfgs["dsa"], T, B),
              f"T={cfg.bench_seq_len}": time_attention(cfgs["mla"], cfgs["dsa"], cfg.bench_seq_len, 1, reps=1)}

    # ---- primary: the test LM-loss gap, paired by seed, after the full adaptation at top-k = K
    per_seed_gap = {str(s): gap_pct(r["test_lm"]["dsa"]["eval_loss"], r["test_lm"]["mla"]["eval_loss"])
                    for s, r in seeds.items()}
    gap = mean_interval(list(per_seed_gap.values()))
    verdict, sentence = lossless_verdict(gap, cfg.lossless_margin_pct)
    # ---- what it depends on: k / T after the short adaptation, and adaptation length at K
    gap_vs_topk = []
    for fr, k in zip(cfg.topk_fractions, topk_list(cfg)):
        g = [gap_pct(recorded_test_loss(r["sweep"][k], S), recorded_test_loss(r["runs"]["mla"]["history"], S))
             for r in seeds.values()]
        iv = mean_interval(g)
        gap_vs_topk.append({"topk_fraction": fr, "topk": k, "gap_pct": iv["mean"], "interval": iv,
                            "adaptation_steps": S, "per_seed": g})
    lengths = sorted({st for st in range(S, C + 1, S)} | {C})
    gap_vs_adaptation = []
    for L in lengths:
        g = [gap_pct(recorded_test_loss(r["runs"]["dsa"]["history"], L), recorded_test_loss(r["runs"]["mla"]["history"], L))
             for r in seeds.values()]
        iv = mean_interval(g)
        gap_vs_adaptation.append({"adaptation_steps": L, "ratio_to_base": L / P, "topk_fraction": K / T,
                                  "gap_pct": iv["mean"], "interval": iv, "per_seed": g})

    # ---- where the gap comes from (issue 45): oracle top-k vs the indexer, with the attention mass
    mbk = mass_buckets(T)
    mla_h = [r["runs"]["mla"]["history"] for r in seeds.values()]
    gap_decomposition = []
    for fr, k in zip(cfg.topk_fractions, topk_list(cfg)):
        e = decomposition_entry([r["sweep"][k] for r in seeds.values()], mla_h, k, S, mbk)
        gap_decomposition.append({"topk_fraction": fr, "learning_rate": tc.learning_rate, **e})
    decomposition_vs_adaptation = [{"topk_fraction": K / T, "learning_rate": tc.learning_rate,
                                    **decomposition_entry([r["runs"]["dsa"]["history"] for r in seeds.values()],
                                                          mla_h, K, L, mbk)} for L in lengths]
    lr_plan = lr_choice_plan(cfg)
    gap_decomposition_lr = []
    if lr_plan is not None:
        gap_decomposition_lr.append({"topk_fraction": K / T, "learning_rate": lr_plan.learning_rate,
                                     **decomposition_entry([r["lr_choice"] for r in seeds.values()], mla_h, K, S, mbk)})
    primary_dec = next(e for e in gap_decomposition if e["topk"] == K)
    n_sparsity = sum(e["dominant"] == "sparsity" for e in gap_decomposition)
    dec_sentence = (decomposition_sentence(primary_dec, T) + f" Over the {len(gap_decomposition)} top-k fractions, "
                    f"sparsity itself dominates at {n_sparsity} and the indexer's choice at "
                    f"{len(gap_decomposition) - n_sparsity}.")
    if gap_decomposition_lr:
        e = gap_decomposition_lr[0]
        dec_sentence += (f" At adaptation rate {e['learning_rate']:g} (fixed before the run; the default is the base's "
                         f"final {tc.learning_rate:g}) the DSA gap is {fmt_interval(e['indexer_gap_pct']['mean'], e['indexer_gap_pct']['lo'], e['indexer_gap_pct']['hi'], 2)}% "
                         f"and the indexer's choice {fmt_interval(e['selection_cost_pct']['mean'], e['selection_cost_pct']['lo'], e['selection_cost_pct']['hi'], 2)}% "
                         f"(on those params, indexer vs oracle top-k: {fmt_interval(e['selection_cost_same_params_pct']['mean'], e['selection_cost_same_params_pct']['lo'], e['selection_cost_same_params_pct']['hi'], 2)}%; "
                         f"with oracle top-k they are {fmt_interval(e['dsa_oracle_gap_pct']['mean'], e['dsa_oracle_gap_pct']['lo'], e['dsa_oracle_gap_pct']['hi'], 2)}% "
                         "above continued MLA: the rate moved the model, not only its selection).")
    attention_mass_final = {name: {"layers_first_seed": {layer: v for layer, v in next(iter(seeds.values()))["mass"][name]["layers"].items()},
                                   "mean": {key: [float(np.mean([r["mass"][name]["mean"][key][j] for r in seeds.values()]))
                                                  if all(r["mass"][name]["mean"][key][j] is not None for r in seeds.values())
                                                  else None for j in range(len(mbk))]
                                            for key in ("selected_mass", "oracle_mass", "recall")},
                                   "buckets": [list(b) for b in mbk]}
                            for name in ("dsa", "mla_oracle")}

    names = list(next(iter(seeds.values()))["runs"])
    n_probes = len(probes["test"]) * B
    arms, per_seed = {}, {}
    for name in names:
        accs = [float(r["test"][name]["correct"].mean()) for r in seeds.values()]
        losses = [float(r["test_lm"][name]["eval_loss"]) for r in seeds.values()]
        a = {"retrieval_accuracy": float(np.mean(accs)), "retrieval_accuracy_interval": mean_interval(accs),
             "final_eval_loss": float(np.mean(losses)), "final_eval_loss_interval": mean_interval(losses),
             "final_eval_accuracy": float(np.mean([r["test_lm"][name]["eval_accuracy"] for r in seeds.values()])),
             "dev_retrieval_accuracy": float(np.mean([r["runs"][name]["final"]["retrieval_accuracy"]
                                                      for r in seeds.values()]))}
        if name == "dsa":
            layers = next(iter(seeds.values()))["test"]["dsa"]["answer_key_recall"]
            a["answer_key_recall"] = {k: float(np.mean([r["test"]["dsa"]["answer_key_recall"][k].mean()
                                                        for r in seeds.values()])) for k in layers}
            a["answer_key_recall_after_warmup"] = {k: float(np.mean([r["answer_key_recall_after_warmup"][k]
                                                                     for r in seeds.values()])) for k in layers}
        arms[name] = a
        per_seed[name] = {str(s): {"retrieval_accuracy": float(r["test"][name]["correct"].mean()),
                                   "retrieval_wilson_95": wilson_interval(int(r["test"][name]["correct"].sum()), n_probes),
                                   "final_eval_loss": float(r["test_lm"][name]["eval_loss"])}
                          for s, r in seeds.items()}
    # secondary: retrieval, paired over (seed, probe), with chance and copy levels
    pa = np.concatenate([r["test"]["dsa"]["correct"] for r in seeds.values()])
    pb = np.concatenate([r["test"]["mla"]["correct"] for r in seeds.values()])
    diff, dlo, dhi = paired_bootstrap_interval(pa, pb)
    dists = np.concatenate([r["test"]["mla"]["distance"] for r in seeds.values()])
    # copying the value of a random one of the planted records is right when it is the queried one, or by chance
    P_, chance = cfg.data.retrieval_pairs, 10.0 ** -vd
    one_of_pairs = 1.0 / P_ + (1.0 - 1.0 / P_) * chance
    retrieval = {"mla": arms["mla"]["retrieval_accuracy"], "dsa": arms["dsa"]["retrieval_accuracy"],
                 "dsa_minus_mla": {"diff": diff, "lo": dlo, "hi": dhi}, "chance_accuracy": chance,
                 "copy_accuracy": one_of_pairs, "test_probes_per_seed": n_probes,
                 "train_sequence_fraction": cfg.data.retrieval_fraction}
    report = {"primary_metric": PRIMARY_METRIC, "arms": arms, "per_seed": per_seed, "seeds": list(cfg.seeds),
              "dsa_vs_mla_gap_pct": gap["mean"], "dsa_vs_mla_gap_pct_interval": gap,
              "dsa_vs_mla_gap_pct_per_seed": per_seed_gap,
              "lossless": {"margin_pct": cfg.lossless_margin_pct, "verdict": verdict, "sentence": sentence},
              "gap_vs_topk": gap_vs_topk, "gap_vs_adaptation": gap_vs_adaptation,
              "gap_decomposition": gap_decomposition, "gap_decomposition_vs_adaptation": decomposition_vs_adaptation,
              "gap_decomposition_lr_choice": gap_decomposition_lr,
              "gap_decomposition_verdict": dec_sentence, "attention_mass": attention_mass_final,
              "retrieval": retrieval, "dsa_minus_mla_retrieval_accuracy": {"diff": diff, "lo": dlo, "hi": dhi},
              "indexer_recall_after_warmup": float(np.mean([r["indexer_recall_after_warmup"] for r in seeds.values()])),
              "indexer_recall_final": float(np.mean([r["indexer_recall_final"] for r in seeds.values()])),
              "attention_time_s": timing, "seq_len": T, "index_topk": K, "topk_fraction": K / T,
              "tokens_per_step": B * T, "test_lm_tokens": sum(int(b["loss_mask"].sum()) for b in lm["test"]),
              "test_probes_per_seed": n_probes, "probe_distance_range": [int(dists.min()), int(dists.max())],
              "chance_accuracy": chance, "one_of_pairs_accuracy": one_of_pairs,
              "train_queries_per_retrieval_sequence": task.n_queries, "key_space": len(task.key_ids),
              "phase_steps": {k: v.steps for k, v in plan.items() if k != "scale"}, "steps_scale": plan["scale"],
              "learning_rates": {k: {"peak": v.learning_rate, "warmup_steps": min(v.warmup_steps, v.steps),
                                     "final": float(f"{float(lr_schedule(v)(v.steps)):.6g}")}
                                 for k, v in plan.items() if k != "scale"},
              "continued_mla_vs_base_dev_loss": continued_vs_base(seeds),
              "wall_time_s": None}

    # plots (seed 0 / first seed for the curves; the distance plot pools every seed)
    first = next(iter(seeds.values()))
    bx, by = eval_series(first["base"]["history"])
    b0 = ([P], [by[-1]]) if by else ([], [])        # the continued phases start from the base's last eval
    mx, my = chain_series([(first["runs"]["mla"]["history"], C)], start=P)
    dx, dy = chain_series([(first["warm"]["history"], W), (first["runs"]["dsa"]["history"], C)], start=P)
    series = {"base (dense MLA)": (bx, by), "mla continued": (b0[0] + mx, b0[1] + my),
              "dsa: indexer warm-up + sparse": (b0[0] + dx, b0[1] + dy)}
    if "mha" in first["runs"]:
        series["mha (from scratch)"] = eval_series(first["runs"]["mha"]["history"])
    plot_curves(os.path.join(workdir, "eval_loss.png"), series,
                title=f"dsa_vs_mla: dev eval loss through the phases (seed {cfg.seeds[0]}, T={T}, top-k={K})",
                xlabel="training step (base, then each arm's phases in order)")
    lr = lambda k: np.asarray(lr_schedule(plan[k])(np.arange(plan[k].steps)), np.float64).tolist()  # noqa: E731
    lseries = {"base": (list(range(1, P + 1)), lr("base")),
               "mla continued": (list(range(P + 1, P + C + 1)), lr("mla")),
               "dsa warm-up (indexer only)": (list(range(P + 1, P + W + 1)), lr("dsa_warmup")),
               "dsa sparse": (list(range(P + W + 1, P + W + C + 1)), lr("dsa"))}
    plot_curves(os.path.join(workdir, "lr_schedule.png"), lseries, title="learning rate per update",
                xlabel="training step", ylabel="learning rate", logy=True)
    band = lambda rows: ([r["interval"]["lo"] if r["interval"]["lo"] is not None else r["gap_pct"] for r in rows],  # noqa: E731
                         [r["interval"]["hi"] if r["interval"]["hi"] is not None else r["gap_pct"] for r in rows])
    plot_curves(os.path.join(workdir, "gap_vs_topk.png"),
                {f"DSA - MLA after {S} adaptation steps": ([r["topk_fraction"] for r in gap_vs_topk],
                                                            [r["gap_pct"] for r in gap_vs_topk])},
                bands={f"DSA - MLA after {S} adaptation steps": band(gap_vs_topk)}, hline=0.0, logx=True,
                title=f"test LM-loss gap vs top-k / T (T={T}; band: 95% t interval over {len(cfg.seeds)} seeds)",
                xlabel="top-k / T", ylabel="gap (% of MLA's test loss)")
    plot_curves(os.path.join(workdir, "gap_vs_adaptation.png"),
                {f"top-k {K} = T/{T // K}": ([r["adaptation_steps"] for r in gap_vs_adaptation],
                                            [r["gap_pct"] for r in gap_vs_adaptation])},
                bands={f"top-k {K} = T/{T // K}": band(gap_vs_adaptation)}, hline=0.0,
                title=f"test LM-loss gap vs adaptation length (base: {P} steps)",
                xlabel="sparse adaptation steps (indexer warm-up before)", ylabel="gap (% of MLA's test loss)")
    bins = np.linspace(dists.min(), dists.max() + 1, cfg.distance_bins + 1)
    dseries = {f"{n} accuracy": distance_curve([r["test"][n] for r in seeds.values()], lambda s: s["correct"], bins)
               for n in names}
    for layer in arms["dsa"]["answer_key_recall"]:
        dseries[f"dsa recall {layer}"] = distance_curve([r["test"]["dsa"] for r in seeds.values()],
                                                        lambda s, k=layer: s["answer_key_recall"][k], bins)
    plot_curves(os.path.join(workdir, "retrieval_vs_distance.png"), dseries,
                title=f"test probes: accuracy and answer-key recall (top-{K}) vs query distance",
                xlabel="tokens from the record's end to the query", ylabel="fraction")
    warm_hist = [r for r in first["warm"]["history"] if "indexer_kl" in r]
    plot_curves(os.path.join(workdir, "indexer_warmup.png"),
                {"indexer KL": ([r["step"] for r in warm_hist], [r["indexer_kl"] for r in warm_hist])},
                title="DSA indexer dense warm-up (base frozen)", ylabel="KL(attention || indexer)")
    report["wall_time_s"] = time.time() - t_start

    def acc_cell(n):
        a = arms[n]
        iv = a["retrieval_accuracy_interval"]
        if iv["n"] > 1:
            return fmt_interval(a["retrieval_accuracy"], iv["lo"], iv["hi"])
        lo, hi = per_seed[n][str(cfg.seeds[0])]["retrieval_wilson_95"]
        return fmt_interval(a["retrieval_accuracy"], lo, hi)

    def loss_cell(n):
        iv = arms[n]["final_eval_loss_interval"]
        return fmt_interval(iv["mean"], iv["lo"], iv["hi"], 4)

    def gap_cell(r):
        return fmt_interval(r["gap_pct"], r["interval"]["lo"], r["interval"]["hi"], 2)

    cvb = report["continued_mla_vs_base_dev_loss"]
    scaled = f" Every phase scaled by --steps={cfg.steps}: x{plan['scale']:.4g} (phase_plan)." if cfg.steps else ""
    cvb_line = (f"Continued MLA ends {'at or below' if cvb['at_or_below'] else 'ABOVE'} its base's dev LM loss "
                f"{'in every seed' if cvb['at_or_below'] else 'in at least one seed'}: {cvb['base_dev_loss']:.4f} -> "
                f"{cvb['continued_mla_dev_loss']:.4f} (mean over seeds, change {cvb['diff']:+.4f}).")
    rows = [[n, loss_cell(n), arms[n]["final_eval_accuracy"], acc_cell(n)] for n in names]
    rec = arms["dsa"]["answer_key_recall"]
    rrows = [[layer, arms["dsa"]["answer_key_recall_after_warmup"][layer], v] for layer, v in rec.items()]
    trows = [[k, v["dense_mla"], v["sparse_dsa"], f"{v['dense_over_sparse']:.2f}x"] for k, v in timing.items()]
    iv_kind = "95% t interval over seeds" if len(cfg.seeds) > 1 else "one seed: no interval"
    md = f"""# dsa_vs_mla

**Primary metric (named before the run):** {PRIMARY_METRIC}. "Lossless" = that interval within
+-{cfg.lossless_margin_pct:g}% (fixed before the run).

**DSA - MLA test LM-loss gap: {fmt_interval(gap['mean'], gap['lo'], gap['hi'], 2)} %** ({iv_kind}; per seed
{", ".join(f"{v:+.2f}" for v in per_seed_gap.values())}).

**{sentence}**

A dense MLA model pre-trained for {P} steps on real text (the eval split of the corpus is held out),
then continued {C} steps two ways from the same state on the same data: densely (**mla**) and as DSA
(**dsa**: {W} indexer warm-up steps with the base frozen, then {C} sparse-adaptation steps) with
top-k = {K} of T = {T} (k/T = 1/{T // K}). {B * T} tokens per step; seeds {list(cfg.seeds)}.
{"**mha** is trained from scratch for " + str(P + C) + " steps. " if cfg.mha_arm else ""}Test LM loss:
{len(lm['test'])} held-out batches ({report['test_lm_tokens']} tokens) never used during training
(dev: {len(lm['dev'])} other batches).

{md_table(["arm", "test LM loss (" + iv_kind + ")", "test token acc.", "test retrieval acc. (secondary)"], rows)}

## What the gap depends on

Top-k / T, each after {S} sparse-adaptation steps ({S / P:.3g} x the base's {P} steps), the same
indexer warm-up before each:

{md_table(["top-k / T", "top-k", "gap % (95% t interval over seeds)"],
          [[f"1/{round(1 / r['topk_fraction'])}", r["topk"], gap_cell(r)] for r in gap_vs_topk])}

![gap vs top-k](gap_vs_topk.png)

Adaptation length at top-k {K} (the report warms the indexer up ~1,000 steps and adapts on 20B
tokens, a small fraction of its pre-training; here the ratio to the base phase is given):

{md_table(["adaptation steps", "x base steps", "gap % (95% t interval over seeds)"],
          [[r["adaptation_steps"], f"{r['ratio_to_base']:.3g}", gap_cell(r)] for r in gap_vs_adaptation])}

![gap vs adaptation length](gap_vs_adaptation.png)

## Where the gap comes from (oracle top-k vs the indexer)

**{dec_sentence}**

Oracle gap: the continued MLA model evaluated with oracle top-k (each query's k keys = the top-k of its
own head-averaged dense attention, one set for all heads as DSA's MQA form shares the indexer's; no
training), the cost of attending to k keys at all. Indexer gap: the DSA model (warm-up + sparse
adaptation) with its indexer, the whole gap. Indexer's choice = indexer gap - oracle gap (paired by seed).
DSA + oracle: the adapted DSA model with oracle top-k instead of its indexer. Mass: the head-averaged dense
softmax mass (the DSA model's own dense attention) on the k keys selected, all query positions,
{cfg.mass_batches} test batches; MLA oracle mass: the continued MLA model's (primary top-k only).

{md_table(["top-k / T", "adapt. steps", "lr", "indexer gap %", "oracle gap %", "indexer's choice %", "DSA + oracle gap %", "DSA: indexer - oracle %",
           "indexer mass", "oracle mass", "MLA oracle mass", "recall of oracle keys"],
          [[f"1/{round(1 / e['topk_fraction'])}", e["adaptation_steps"], f"{e['learning_rate']:g}",
            fmt_interval(e["indexer_gap_pct"]["mean"], e["indexer_gap_pct"]["lo"], e["indexer_gap_pct"]["hi"], 2),
            fmt_interval(e["oracle_gap_pct"]["mean"], e["oracle_gap_pct"]["lo"], e["oracle_gap_pct"]["hi"], 2),
            fmt_interval(e["selection_cost_pct"]["mean"], e["selection_cost_pct"]["lo"], e["selection_cost_pct"]["hi"], 2),
            fmt_interval(e["dsa_oracle_gap_pct"]["mean"], e["dsa_oracle_gap_pct"]["lo"], e["dsa_oracle_gap_pct"]["hi"], 2),
            fmt_interval(e["selection_cost_same_params_pct"]["mean"], e["selection_cost_same_params_pct"]["lo"],
                         e["selection_cost_same_params_pct"]["hi"], 2),
            e["indexer_mass"], e["oracle_mass"], "-" if e["mla_oracle_mass"] is None else e["mla_oracle_mass"],
            e["indexer_recall_of_oracle"]]
           for e in gap_decomposition + decomposition_vs_adaptation + gap_decomposition_lr])}

Attention mass per query-position bucket after the full adaptation (mean over layers and seeds):

{md_table(["model", "figure"] + [f"[{a},{b})" for a, b in mbk],
          [[name, key] + [("n/a" if v is None else f"{v:.3f}") for v in attention_mass_final[name]["mean"][key]]
           for name in ("dsa", "mla_oracle") for key in ("selected_mass", "oracle_mass", "recall")])}

## Through the phases: dev LM loss and learning rate

The base pre-trains at peak lr {plan['base'].learning_rate:g} ({plan['base'].warmup_steps} warm-up steps, cosine to
{plan['base'].min_lr_ratio:g} x peak). The continued phases do not restart that schedule: **mla** and **dsa** run at the
base's final rate {tc.learning_rate:.3g} ({tc.warmup_steps} linear warm-up steps for their fresh optimizer moments, then
constant; DeepSeek-V3.2 adapts at DeepSeek-V3's final pre-training rate); the indexer warm-up trains only the new
indexer at {plan['dsa_warmup'].learning_rate:g}.{scaled}

{md_table(["seed", "base end", "mla continued end", "dsa after warm-up", "dsa end"],
          [[s, v["base"], v["continued_mla"], v["dsa_after_warmup"], v["dsa"]]
           for s, v in report["continued_mla_vs_base_dev_loss"]["per_seed"].items()])}

{cvb_line}

![eval loss](eval_loss.png)

![learning rate](lr_schedule.png)

## Secondary: retrieval probe and indexer recall

{cfg.data.retrieval_fraction:.0%} of training sequences are retrieval records: {cfg.data.retrieval_pairs} planted records
`K v` (a one-token letter key of {len(task.key_ids)} directly followed by its {vd}-digit value), filler text, then
{task.n_queries} of them restated at the end. Test probes: {n_probes} per seed (TEST_TAG, filler from held-out files),
the last query scored, its record {report['probe_distance_range'][0]}-{report['probe_distance_range'][1]} tokens back
(all > top-k = {K}). **Chance {chance:.3g}; copying a random one of the {P_} planted values {one_of_pairs:.3g}.**
Test retrieval accuracy: mla {retrieval['mla']:.3f}, dsa {retrieval['dsa']:.3f}; DSA - MLA
{fmt_interval(diff, dlo, dhi)} (paired bootstrap over seeds x probes).

Answer-key recall: the fraction of test probes whose answer-bearing key (the planted value token the
query must copy) is among the top-{K} keys the layer's indexer selects at the predicting position.

{md_table(["DSA layer", "after warm-up", "after sparse adaptation"], rrows)}

Recall of the true attention top-{K} (head-summed dense attention, dev LM batches):
{report['indexer_recall_after_warmup']:.3f} after warm-up, {report['indexer_recall_final']:.3f} after sparse adaptation.

![retrieval vs distance](retrieval_vs_distance.png)

![indexer warm-up](indexer_warmup.png)

## Attention time per step (one layer, forward + backward, CPU)

{md_table(["shape", "dense MLA s", "DSA (indexer + sparse) s", "dense / sparse"], trows)}

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
