"""dsa_vs_mla: is DSA, added to a dense MLA model by continued pre-training, lossless against MLA?

Primary metric (fixed before the run): the test LM-loss gap DSA - MLA in % of MLA's on held-out real text,
paired by seed, mean with a 95% t interval over seeds, read against `lossless_margin_pct` (also fixed before).
Phases per seed (`phase_stages`: train_stages chains in seed_<s>/): base (dense MLA pre-training), mla
(continued densely), dsa_warmup (indexer added, base frozen, dense KL), dsa (sparse adaptation at
model.index_topk), dsa_topk<k> (the other `topk_fractions`, short adaptation), dsa_lr (issue 45: the short
adaptation at lr_choice_learning_rate), mha (optional, from scratch). The continued phases run at the base's
final rate (constant after `continued_warmup_steps`) and evaluate dev and test LM loss every
short_adaptation_steps, so the gap against adaptation length comes from the same runs; `--steps N` scales
every phase by N / train.steps (phase_plan). Where the gap comes from (gap_decomposition): the continued MLA
model with oracle top-k (sparsity itself) vs the DSA model with its indexer, and the attention mass the
selected keys carry (glm5_jax.eval.dsa). Secondary: retrieval probes with chance and copy levels, indexer
recall, attention time dense vs sparse. Every evaluation goes through glm5_jax.eval (sharded under --mesh).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import ClassVar

import numpy as np

from experiments.registry import register
from experiments.report import chain_series, eval_series, md_table, plot_curves, write_report
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.data.build import dev_test_batches
from glm5_jax.data.retrieval import EVAL_TAG, TEST_TAG, retrieval_probe_batches
from glm5_jax.eval import IndexerRecall, evaluate
from glm5_jax.eval.dsa import (arm_figures, as_oracle, attention_mass_table, continued_vs_base, decomposition_fn,
                               decomposition_table, distance_series, gap_figures, gap_pct,
                               lossless_verdict, mass_buckets, mean_attention_mass, phase_eval_fn, retrieval_figures,
                               time_attention)
from glm5_jax.eval.metrics import attention_mass
from glm5_jax.eval.probes import score_probes
from glm5_jax.intervals import fmt_interval, mean_interval
from glm5_jax.fields import check_fields, invalid, setting
from glm5_jax.train import Stage, TrainConfig, train_stages


PRIMARY_METRIC = ("test LM-loss gap of dsa vs mla, 100 x (loss_dsa - loss_mla) / loss_mla on held-out real text after "
                  "the full adaptation at top-k = model.index_topk, paired by seed; mean with a 95% t interval over seeds")


@dataclasses.dataclass(frozen=True)
class DsaVsMlaConfig:
    """model: the DSA model (the mla arm drops the indexer; mha: num_kv_heads = num_heads). train: every phase's
    settings, its schedule the base's (the continued phases run at the base's final rate: phase_plan);
    train.steps: the full adaptation. data: the LM corpus with retrieval records mixed in from the first step.
    Held-out: train.eval_batches dev LM batches and dev_probe_batches dev probes (EVAL_TAG) are watched during
    training; test_lm_batches other LM batches and test_probe_batches probes (TEST_TAG) give the figures.
    topk_fractions: the gap against k/T after short_adaptation_steps (also the continued phases' eval
    interval: the gap against adaptation length). seeds: every phase once per seed (train.seed + s, data
    seed + 1000 s). lr_choice_learning_rate (fixed before the run, issue 45): one more short sparse adaptation
    at this rate (3e-3, 3x the tiny base's final rate: if the flat gap were step-size-limited a larger step
    shows it); None: no such arm. mass_batches: test batches of the attention-mass figures."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    pretrain_steps: int = setting(320, integer=True, min=1)        # dense MLA base; mha: pretrain_steps + train.steps
    indexer_warmup_steps: int = setting(30, integer=True, min=1)   # dense indexer warm-up, base frozen
    indexer_learning_rate: float = setting(1e-2, gt=0)
    short_adaptation_steps: int = setting(40, integer=True, min=1)  # the shorter length, and the eval interval
    topk_fractions: tuple[float, ...] = (1 / 16, 1 / 8, 1 / 4, 1 / 2)
    lossless_margin_pct: float = setting(1.0, gt=0)
    test_lm_batches: int = setting(8, integer=True, min=1)         # held-out LM batches for the test figures
    dev_probe_batches: int = setting(2, integer=True, min=1)       # retrieval probes watched during training
    test_probe_batches: int = setting(16, integer=True, min=1)     # retrieval probes for the secondary figures
    distance_bins: int = setting(4, integer=True, min=1)           # accuracy-vs-distance plot
    mha_arm: bool = False                  # also train an MHA model from scratch on as many tokens
    seeds: tuple[int, ...] = (0, 1, 2)
    bench_seq_len: int = setting(4096, integer=True, min=1)        # second attention-timing shape (batch 1)
    continued_warmup_steps: int = setting(10, integer=True, min=0)  # mla / dsa: linear warm-up to the final rate
    steps: int | None = setting(None, integer=True, min=1, optional=True)  # --steps N: every phase x N / train.steps
    lr_choice_learning_rate: float | None = setting(3e-3, gt=0, optional=True)  # the extra arm's rate (None: none)
    mass_batches: int = setting(2, integer=True, min=1)            # test LM batches for the attention-mass figures

    STEPS_KEY: ClassVar[str] = "steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "data.vocab_size", "data.seq_len": "train.seq_len"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=self.data.vocab_size))
        object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=self.train.seq_len))
        check_fields(self)
        def bad(f, allowed, value=None):
            return invalid("DsaVsMlaConfig", f, getattr(self, f) if value is None else value, allowed)
        if self.model.attention != "dsa":
            raise bad("model.attention", "must be 'dsa' (the arms are derived from it)", self.model.attention)
        if self.model.indexer_types is not None:
            raise bad("model.indexer_types", "must be None (every layer 'full'), so the MLA stacks graft onto DSA",
                      self.model.indexer_types)
        if self.short_adaptation_steps > self.train.steps:
            raise bad("short_adaptation_steps", f"must be <= train.steps={self.train.steps} (the full adaptation length)")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise bad("seeds", "a non-empty tuple of distinct ints >= 0")
        T = self.train.seq_len
        if any(not 0 < fr <= 1 or abs(fr * T - round(fr * T)) > 1e-6 for fr in self.topk_fractions):
            raise bad("topk_fractions", f"each must be in (0, 1] with fraction x train.seq_len ({T}) a whole number "
                      "of keys")
        if len(set(topk_list(self))) != len(self.topk_fractions):
            raise bad("topk_fractions", "the fractions must be distinct")
        if self.data.retrieval_fraction <= 0:
            raise bad("data.retrieval_fraction", "must be > 0 (the secondary probe)", self.data.retrieval_fraction)
        if self.data.min_distance(T) < self.model.index_topk:
            raise bad("data.retrieval_min_distance", f"must be >= model.index_topk={self.model.index_topk}, so DSA "
                      "must select every probe's record", self.data.min_distance(T))


def topk_list(cfg: DsaVsMlaConfig) -> list[int]:
    """The top-k of every fraction in cfg.topk_fractions (fraction x train.seq_len keys)."""
    return [int(round(fr * cfg.train.seq_len)) for fr in cfg.topk_fractions]


TINY = DsaVsMlaConfig(
    model=ModelConfig(vocab_size=2048, d_model=128, num_layers=2, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_dim=384, num_experts=4,
                      moe_ffn_dim=128, first_k_dense=1, attention="dsa", index_topk=16, index_n_heads=2,
                      index_head_dim=32, mtp_depth=0, attn_chunk=128),
    # T=128, top-k 16 = T/8 (the longest T whose three seeds fit 15 minutes on 2 cores); base 320 steps 1e-2 -> 1e-3
    train=TrainConfig(steps=120, batch_size=16, seq_len=128, learning_rate=1e-2, warmup_steps=50, min_lr_ratio=0.1,
                      eval_every=80, log_every=40, ckpt_every=200, eval_batches=4, seed=0),
    # stdlib text; 10% of sequences are MQAR-style retrieval records (16 one-token keys, 1-digit values)
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


def phase_plan(cfg: DsaVsMlaConfig) -> dict:
    """{"scale", "base" | "mla" | "dsa_warmup" | "dsa" | "dsa_short" | "mha": TrainConfig} (seed offset 0). Every
    step count is x scale = cfg.steps / train.steps, rounded, >= 1 (a warm-up of 0 stays 0). base: train's
    schedule; mla / dsa: the base's final rate, constant after a linear warm-up, evaluated every short
    adaptation length; dsa_short: dsa cut at that length (the other top-k fractions)."""
    tc = cfg.train
    f = cfg.steps / tc.steps if cfg.steps is not None else 1.0
    n = lambda k: max(1, int(round(k * f)))
    w = lambda k: 0 if k == 0 else n(k)
    P, C, W = n(cfg.pretrain_steps), cfg.steps if cfg.steps is not None else tc.steps, n(cfg.indexer_warmup_steps)
    S = min(n(cfg.short_adaptation_steps), C)
    base = tc.replace(steps=P, warmup_steps=w(tc.warmup_steps), eval_every=n(tc.eval_every), log_every=n(tc.log_every))
    final_lr = float(f"{float(base.schedule()(P)):.6g}")      # where the base's schedule ended (float32: 6 digits)
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
    """The issue-45 arm: the short sparse adaptation at cfg.lr_choice_learning_rate (None without one)."""
    if cfg.lr_choice_learning_rate is None:
        return None
    return phase_plan(cfg)["dsa_short"].replace(learning_rate=float(cfg.lr_choice_learning_rate))


def eval_fns(cfg: DsaVsMlaConfig, probes: dict, lm: dict) -> dict:
    """Every phase's eval fn: "mla" / "dsa" / "mha" dev LM + retrieval; "mla_cont" / "dsa_cont" (continued
    phases), k (the top-k sweep), "dsa_lr": also the test LM loss and the gap decomposition's evaluations."""
    cfgs = model_configs(cfg.model)
    ks, K, mass_lm = topk_list(cfg), cfgs["dsa"].index_topk, lm["test"][:cfg.mass_batches]
    dec = lambda arm, kk: decomposition_fn(cfgs["dsa"], lm["test"], mass_lm, kk, arm, mass_ks=(K,))
    out = {k: phase_eval_fn(c, lm["dev"], probes["dev"]) for k, c in cfgs.items()}
    out["mla_cont"] = phase_eval_fn(cfgs["mla"], lm["dev"], probes["dev"], lm["test"], extra=dec("mla", tuple(ks)))
    out["dsa_cont"] = phase_eval_fn(cfgs["dsa"], lm["dev"], probes["dev"], lm["test"], extra=dec("dsa", (K,)))
    out.update({k: phase_eval_fn(cfgs["dsa"].replace(index_topk=k), lm["dev"], None, lm["test"], extra=dec("dsa", (k,)))
                for k in ks if k != K})
    out["dsa_lr"] = phase_eval_fn(cfgs["dsa"], lm["dev"], None, lm["test"], extra=dec("dsa", (K,)))
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
    recall = lambda p: evaluate(cfgs["dsa"], p, lm["dev"][:2], [IndexerRecall()])["indexer_recall"]
    return {"base": base, "runs": runs, "warm": warm, "test": test, "test_lm": test_lm, "sweep": sweep,
            "lr_choice": lr_run, "mass": mass,
            "answer_key_recall_after_warmup": {k: float(v.mean()) for k, v in warm_scores["answer_key_recall"].items()},
            "indexer_recall_after_warmup": recall(warm["params"]), "indexer_recall_final": recall(runs["dsa"]["params"])}


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
    lm = dev_test_batches(data, B, T, cfg.train.eval_batches, cfg.test_lm_batches)   # held-out LM: dev, then test
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
    # ---- what it depends on (k / T after the short adaptation, adaptation length at K) and where the gap
    # comes from (issue 45: oracle top-k vs the indexer, with the attention mass)
    lr_plan, mbk = lr_choice_plan(cfg), mass_buckets(T)
    g = gap_figures(seeds, dict(zip(cfg.topk_fractions, topk_list(cfg))), K, T, S, P, C, mbk, tc.learning_rate,
                    None if lr_plan is None else lr_plan.learning_rate)
    gap_vs_topk, gap_vs_adaptation, gap_decomposition = g["gap_vs_topk"], g["gap_vs_adaptation"], g["gap_decomposition"]
    decomposition_vs_adaptation, gap_decomposition_lr = g["gap_decomposition_vs_adaptation"], g["gap_decomposition_lr_choice"]
    dec_sentence = g["gap_decomposition_verdict"]
    attention_mass_final = {name: mean_attention_mass([r["mass"][name] for r in seeds.values()], mbk)
                            for name in ("dsa", "mla_oracle")}

    names = list(next(iter(seeds.values()))["runs"])
    n_probes = len(probes["test"]) * B
    arms, per_seed = arm_figures(seeds, names, n_probes)
    retrieval = retrieval_figures(seeds, arms, cfg.data.retrieval_pairs, vd)   # secondary, with chance and copy levels
    dists, chance, one_of_pairs = retrieval.pop("distances"), retrieval["chance_accuracy"], retrieval["copy_accuracy"]
    diff, dlo, dhi = (retrieval["dsa_minus_mla"][k] for k in ("diff", "lo", "hi"))
    retrieval.update(test_probes_per_seed=n_probes, train_sequence_fraction=cfg.data.retrieval_fraction)
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
                                     "final": float(f"{float(v.schedule()(v.steps)):.6g}")}
                                 for k, v in plan.items() if k != "scale"},
              "continued_mla_vs_base_dev_loss": continued_vs_base(seeds),
              "wall_time_s": None}

    # plots (the first seed's curves; the distance plot pools every seed)
    first, pj = next(iter(seeds.values())), lambda name: os.path.join(workdir, name)
    bx, by = eval_series(first["base"]["history"])
    b0 = ([P], [by[-1]]) if by else ([], [])        # the continued phases start from the base's last eval
    mx, my = chain_series([(first["runs"]["mla"]["history"], C)], start=P)
    dx, dy = chain_series([(first["warm"]["history"], W), (first["runs"]["dsa"]["history"], C)], start=P)
    series = {"base (dense MLA)": (bx, by), "mla continued": (b0[0] + mx, b0[1] + my),
              "dsa: indexer warm-up + sparse": (b0[0] + dx, b0[1] + dy)}
    if "mha" in first["runs"]:
        series["mha (from scratch)"] = eval_series(first["runs"]["mha"]["history"])
    plot_curves(pj("eval_loss.png"), series, title=f"dsa_vs_mla: dev eval loss (seed {cfg.seeds[0]}, T={T}, top-k={K})",
                xlabel="training step (base, then each arm's phases in order)")
    lr = lambda k, a: (list(range(a + 1, a + plan[k].steps + 1)),
                       np.asarray(plan[k].schedule()(np.arange(plan[k].steps)), np.float64).tolist())
    plot_curves(pj("lr_schedule.png"), {"base": lr("base", 0), "mla continued": lr("mla", P),
                                        "dsa warm-up (indexer only)": lr("dsa_warmup", P), "dsa sparse": lr("dsa", P + W)},
                title="learning rate per update", xlabel="training step", ylabel="learning rate", logy=True)
    band = lambda rows: ([r["gap_pct"] if r["interval"][e] is None else r["interval"][e] for r in rows]
                         for e in ("lo", "hi"))
    for name, rows, x, label, kw in (
            ("gap_vs_topk", gap_vs_topk, "topk_fraction", f"DSA - MLA after {S} adaptation steps", {"logx": True}),
            ("gap_vs_adaptation", gap_vs_adaptation, "adaptation_steps", f"top-k {K} = T/{T // K}", {})):
        plot_curves(pj(f"{name}.png"), {label: ([r[x] for r in rows], [r["gap_pct"] for r in rows])},
                    bands={label: tuple(band(rows))}, hline=0.0, title=f"test LM-loss gap vs {x} (95% t band over seeds)",
                    xlabel=x, ylabel="gap (% of MLA's test loss)", **kw)
    bins = np.linspace(dists.min(), dists.max() + 1, cfg.distance_bins + 1)
    plot_curves(pj("retrieval_vs_distance.png"), distance_series(seeds, names, bins), title=f"test probes: accuracy and answer-key recall (top-{K})",
                xlabel="tokens from the record's end to the query", ylabel="fraction")
    warm_hist = [r for r in first["warm"]["history"] if "indexer_kl" in r]
    plot_curves(pj("indexer_warmup.png"), {"indexer KL": ([r["step"] for r in warm_hist], [r["indexer_kl"] for r in warm_hist])},
                title="DSA indexer dense warm-up (base frozen)", ylabel="KL(attention || indexer)")
    report["wall_time_s"] = time.time() - t_start

    ivs = lambda iv, d=2: fmt_interval(iv, digits=d)
    seed0 = str(cfg.seeds[0])
    acc = lambda n: fmt_interval(arms[n]["retrieval_accuracy"], *(
        (arms[n]["retrieval_accuracy_interval"]["lo"], arms[n]["retrieval_accuracy_interval"]["hi"])
        if arms[n]["retrieval_accuracy_interval"]["n"] > 1 else per_seed[n][seed0]["retrieval_wilson_95"]))
    cvb = report["continued_mla_vs_base_dev_loss"]
    iv_kind = "95% t interval over seeds" if len(cfg.seeds) > 1 else "one seed: no interval"
    md = f"""# dsa_vs_mla

**Primary metric (named before the run):** {PRIMARY_METRIC}; "lossless" = that interval within
+-{cfg.lossless_margin_pct:g}%. **Gap: {ivs(gap)} %** ({iv_kind}; per seed
{", ".join(f"{v:+.2f}" for v in per_seed_gap.values())}). **{sentence}**

Dense MLA base {P} steps, then {C} steps two ways from it on the same data: densely (**mla**) and as DSA (**dsa**:
{W} indexer warm-up steps, base frozen, then {C} sparse steps), top-k {K} of T {T}; {B * T} tokens per step; seeds
{list(cfg.seeds)}{"; **mha** from scratch for " + str(P + C) + " steps" if cfg.mha_arm else ""}. Test: {len(lm['test'])}
held-out batches ({report['test_lm_tokens']} tokens; dev: {len(lm['dev'])} others). Learning rates: base peak
{plan['base'].learning_rate:g} (cosine to {plan['base'].min_lr_ratio:g} x), mla / dsa at the base's final {tc.learning_rate:.3g}
after {tc.warmup_steps} warm-up steps, indexer warm-up {plan['dsa_warmup'].learning_rate:g}.{
f" Every phase scaled by --steps={cfg.steps}: x{plan['scale']:.4g}." if cfg.steps else ""}

{md_table(["arm", "test LM loss (" + iv_kind + ")", "test token acc.", "test retrieval acc. (secondary)"],
          [[n, ivs(arms[n]["final_eval_loss_interval"], 4), arms[n]["final_eval_accuracy"], acc(n)] for n in names])}

## The gap against top-k / T (after {S} sparse steps) and against adaptation length (top-k {K})

{md_table(["top-k / T", "top-k", "gap %"], [[f"1/{round(1 / r['topk_fraction'])}", r["topk"], ivs(r["interval"])]
                                           for r in gap_vs_topk])}

{md_table(["adaptation steps", "x base steps", "gap %"],
          [[r["adaptation_steps"], f"{r['ratio_to_base']:.3g}", ivs(r["interval"])] for r in gap_vs_adaptation])}

![gap vs top-k](gap_vs_topk.png) ![gap vs adaptation length](gap_vs_adaptation.png)

## Where the gap comes from (oracle top-k vs the indexer)

**{dec_sentence}**

Oracle: the continued MLA model with oracle top-k (each query's k keys = the top-k of its own head-averaged
dense attention; no training); indexer: the DSA model; choice = indexer - oracle (paired by seed); DSA + oracle:
the DSA model with oracle top-k. Mass: head-averaged dense softmax mass on the selected keys ({cfg.mass_batches}
test batches).

{md_table(*decomposition_table(gap_decomposition + decomposition_vs_adaptation + gap_decomposition_lr))}

{md_table(*attention_mass_table(attention_mass_final, mbk))}

## Dev LM loss through the phases

{md_table(["seed", "base end", "mla continued end", "dsa after warm-up", "dsa end"],
          [[s, v["base"], v["continued_mla"], v["dsa_after_warmup"], v["dsa"]] for s, v in cvb["per_seed"].items()])}

Continued MLA ends {'at or below' if cvb['at_or_below'] else 'ABOVE'} its base's dev loss: {cvb['base_dev_loss']:.4f} ->
{cvb['continued_mla_dev_loss']:.4f} ({cvb['diff']:+.4f}, mean over seeds).

![eval loss](eval_loss.png) ![learning rate](lr_schedule.png)

## Secondary: retrieval probe, indexer recall, attention time

{cfg.data.retrieval_fraction:.0%} of training sequences hold {cfg.data.retrieval_pairs} records `K v` (one-token keys of
{len(task.key_ids)}, {vd}-digit values), {task.n_queries} restated at the end. {n_probes} test probes per seed, the
last query scored, its record {report['probe_distance_range'][0]}-{report['probe_distance_range'][1]} tokens back.
Chance {chance:.3g}, copying a random planted value {one_of_pairs:.3g}; DSA - MLA {fmt_interval(diff, dlo, dhi)}
(paired bootstrap). Indexer recall of the attention top-{K}: {report['indexer_recall_after_warmup']:.3f} after warm-up,
{report['indexer_recall_final']:.3f} after adaptation. Answer-key recall (the value token among the selected keys):

{md_table(["DSA layer", "after warm-up", "after sparse adaptation"],
          [[layer, arms["dsa"]["answer_key_recall_after_warmup"][layer], v]
           for layer, v in arms["dsa"]["answer_key_recall"].items()])}

{md_table(["attention shape (fwd + bwd, one layer)", "dense MLA s", "DSA s", "dense / sparse"],
          [[k, v["dense_mla"], v["sparse_dsa"], f"{v['dense_over_sparse']:.2f}x"] for k, v in timing.items()])}

![retrieval vs distance](retrieval_vs_distance.png) ![indexer warm-up](indexer_warmup.png)

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
