"""muon_split: does Muon Split let MLA match GQA under Muon, and do attention logits stay bounded?

Four arms trained from scratch for the same number of steps on the same token stream (same data seed,
same batch shape), all with the same width and depth and a dense SwiGLU MLP:
  mla_adamw        MLA, every parameter with AdamW
  mla_muon         MLA, matrices with Muon (q_b_proj / kv_b_proj orthogonalised as whole matrices)
  mla_muon_split   MLA, Muon with q_b_proj per head and kv_b_proj per head and per K / V piece
  gqa_muon         GQA (num_heads query heads, gqa_kv_heads KV heads) with Muon
The three MLA arms share their initial parameters. Every `monitor_every` steps the loop records each
layer's max |q.k| * scale over visible keys (a separate forward on the step's batch, after the update).
Output: eval-loss curves, max-attention-logit curves, final eval loss / accuracy and logits per arm.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import ClassVar

from experiments.registry import register
import numpy as np

from experiments.report import eval_series, md_table, plot_curves, write_report
from glm5_jax.intervals import fmt_interval, mean_interval, paired_seeds, trajectory_bands
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.train import TrainConfig, evaluate, train
from glm5_jax.train.loop import TrainingDiverged
from glm5_jax.train.step import make_eval_step

ARMS = (("mla_adamw", "mla", "adamw"), ("mla_muon", "mla", "muon"), ("mla_muon_split", "mla", "muon_split"),
        ("gqa_muon", "gqa", "muon"))
ARM_NAMES = tuple(a for a, _, _ in ARMS)


def model_configs(mla: ModelConfig, gqa_kv_heads: int, gqa_head_dim: int) -> dict[str, ModelConfig]:
    head_dim = gqa_head_dim or mla.qk_nope_head_dim + mla.qk_rope_head_dim
    gqa = mla.replace(attention="gqa", num_kv_heads=min(gqa_kv_heads, mla.num_heads), head_dim=head_dim)
    return {"mla": mla, "gqa": gqa}


@dataclasses.dataclass(frozen=True)
class MuonSplitConfig:
    """model: the MLA model (the three MLA arms); the GQA arm is it with attention "gqa",
    gqa_kv_heads KV heads and head dim gqa_head_dim (0 = qk_nope + qk_rope). train: every arm
    (train.learning_rate for AdamW, muon_learning_rate for the Muon arms; train.optimizer is set per
    arm). model.vocab_size and data.seq_len follow data.vocab_size and train.seq_len."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    gqa_kv_heads: int = 2
    gqa_head_dim: int = 24
    muon_learning_rate: float = 3e-3
    arms: tuple[str, ...] = ARM_NAMES
    # The regime search: plain-Muon MLA is trained `sweep_steps` steps at each of these peak LRs and
    # the LR whose final max attention logit is largest (among runs whose dev loss stays finite) sets
    # muon_learning_rate for the headline arms. Empty: no sweep, muon_learning_rate as given.
    muon_lr_sweep: tuple[float, ...] = ()
    sweep_steps: int = 80
    seeds: tuple[int, ...] = (0, 1, 2)
    # stability without QK-clip, counted per run: a "loss spike" is a step after warm-up whose train loss
    # exceeds the median of the previous `spike_window` steps by more than `spike_nats` (batch-to-batch
    # variation of code is ~0.5 nats, in every arm); a non-finite loss stops that run (counted as diverged,
    # left out of the intervals)
    spike_nats: float = 1.0
    spike_window: int = 20

    PRIMARY: ClassVar[str] = ("max_attn_logit of mla_muon vs mla_muon_split at the end of training (secondary: test "
                              "LM loss relative to gqa_muon)")

    STEPS_KEY: ClassVar[str] = "train.steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "data.vocab_size", "data.seq_len": "train.seq_len",
                               "train.optimizer": "the arm (arms=...)"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=self.data.vocab_size))
        object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=self.train.seq_len))
        if self.model.attention != "mla":
            raise ConfigError(f"MuonSplitConfig.model.attention={self.model.attention!r} is invalid: must be 'mla' "
                              "(the gqa arm is derived from it)")
        bad = [a for a in self.arms if a not in ARM_NAMES]
        if bad or not self.arms:
            raise ConfigError(f"MuonSplitConfig.arms={self.arms!r} is invalid: a non-empty subset of {', '.join(ARM_NAMES)}")
        if self.gqa_kv_heads < 1 or self.gqa_head_dim < 0:
            raise ConfigError(f"MuonSplitConfig.gqa_kv_heads={self.gqa_kv_heads} / gqa_head_dim={self.gqa_head_dim} "
                              "are invalid: kv heads >= 1, head dim >= 0 (0 = qk_nope + qk_rope)")
        if not self.muon_learning_rate > 0:
            raise ConfigError(f"MuonSplitConfig.muon_learning_rate={self.muon_learning_rate!r} is invalid: must be > 0")
        if any(not lr > 0 for lr in self.muon_lr_sweep) or self.sweep_steps < 1:
            raise ConfigError(f"MuonSplitConfig.muon_lr_sweep={self.muon_lr_sweep!r} / sweep_steps={self.sweep_steps!r} "
                              "are invalid: learning rates > 0, sweep_steps >= 1")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"MuonSplitConfig.seeds={self.seeds!r} is invalid: a non-empty tuple of distinct ints >= 0")
        if not self.spike_nats > 0 or self.spike_window < 1:
            raise ConfigError(f"MuonSplitConfig.spike_nats={self.spike_nats!r} / spike_window={self.spike_window!r} "
                              "are invalid: spike_nats > 0, spike_window >= 1")
        model_configs(self.model, self.gqa_kv_heads, self.gqa_head_dim)     # the gqa arm validates too


TINY = MuonSplitConfig(
    model=ModelConfig(vocab_size=2048, d_model=128, num_layers=2, num_heads=8, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_dim=384, num_experts=0,
                      mtp_depth=0, attention="mla", attn_chunk=128),
    train=TrainConfig(steps=160, batch_size=8, seq_len=128, learning_rate=3e-3, warmup_steps=16, weight_decay=0.1,
                      eval_every=40, log_every=20, ckpt_every=40, monitor_every=10, eval_batches=4, seed=0),
    data=DataConfig(vocab_size=2048, seq_len=128, seed=0),
    muon_lr_sweep=(3e-3, 1e-2, 3e-2), sweep_steps=80, seeds=(0, 1, 2, 3, 4),
)
# One accelerator: the "small" preset trunk (MoE, MLA dims from the preset) with 16 heads, GQA-8 (8 KV heads).
SMALL = dataclasses.replace(
    TINY, model=preset("small", vocab_size=32768, mtp_depth=0, attention="mla", num_heads=16),
    train=TINY.train.replace(steps=3000, batch_size=32, seq_len=2048, learning_rate=1e-3, warmup_steps=200,
                             eval_every=250, log_every=125, ckpt_every=250, monitor_every=50, eval_batches=16),
    data=dataclasses.replace(TINY.data, vocab_size=32768), gqa_kv_heads=8, gqa_head_dim=0, muon_learning_rate=1e-3)


def _monitor_summary(history) -> dict:
    mon = [row for row in history if "max_attn_logit" in row]
    last = mon[-1] if mon else {}
    return {"max_attn_logit": float(last.get("max_attn_logit", float("nan"))),
            "max_attn_logit_peak": float(max((row["max_attn_logit"] for row in mon), default=float("nan"))),
            "max_attn_logit_per_layer": {k.split("/", 1)[1]: float(v) for k, v in last.items()
                                         if k.startswith("max_attn_logit/")}}


def count_loss_spikes(losses, *, warmup: int, nats: float, window: int) -> int:
    """Steps after `warmup` whose loss exceeds the median of the previous `window` steps by more than
    `nats` (losses[i] is step i + 1's train loss). A non-finite loss counts as a spike."""
    n = 0
    for i in range(max(warmup, 1), len(losses)):
        prev = [x for x in losses[max(0, i - window):i] if math.isfinite(x)]
        if not math.isfinite(losses[i]) or (prev and losses[i] - float(np.median(prev)) > nats):
            n += 1
    return n


def paired_difference(per_seed: dict, a: str, b: str, key: str) -> dict | None:
    """per-seed a - b of `key` over the seeds where both ran and are finite, mean with a 95% t interval."""
    if a not in per_seed or b not in per_seed:
        return None
    return paired_seeds(*({s: v[key] for s, v in per_seed[x].items()} for x in (a, b)))


def verdict(diff: dict | None) -> str:
    """One sentence on the primary comparison: split - plain final max logit, paired by seed."""
    if not diff:
        return "The primary comparison needs both mla_muon and mla_muon_split (arms=...)."
    m, lo, hi, n = diff["mean"], diff["lo"], diff["hi"], diff["n"]
    if lo is None:
        return f"Muon Split - Muon final max logit {m:+.2f} on one seed: no interval, no conclusion."
    iv = f"{m:+.2f} [{lo:+.2f}, {hi:+.2f}] over {n} seeds"
    if hi < 0:
        return f"Muon Split lowers the final max attention logit against plain Muon: {iv} (the report's effect)."
    if lo > 0:
        return f"Muon Split RAISES the final max attention logit against plain Muon: {iv} (contrary to the report)."
    return (f"Muon Split and plain Muon are not separated in final max attention logit: {iv} includes 0 (the "
            "report's effect does not appear at this scale).")


def choose_regime(sweep: list[dict]) -> float | None:
    """The swept LR with the largest final max attention logit among runs whose dev loss is finite."""
    ok = [r for r in sweep if math.isfinite(r["dev_eval_loss"]) and math.isfinite(r["max_attn_logit"])]
    return max(ok, key=lambda r: r["max_attn_logit"])["learning_rate"] if ok else None


@register("muon_split", "MLA with AdamW / Muon / Muon Split vs GQA with Muon, from scratch at equal tokens; "
          "max attention logits in a regime where they grow, and eval loss", {"tiny": TINY, "small": SMALL})
def run(cfg: MuonSplitConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    tc = cfg.train
    B, T = tc.batch_size, tc.seq_len
    data = build_lm_data(cfg.data)
    cfgs = model_configs(cfg.model, cfg.gqa_kv_heads, cfg.gqa_head_dim)
    log(f"primary metric (named before the run): {cfg.PRIMARY}")
    # held-out LM batches: first half dev (the sweep's choice, curves), second half test (headline only)
    lm_all = list(data.eval_batches(B, T, max_batches=2 * tc.eval_batches))
    half = max(1, len(lm_all) // 2)
    lm_dev, lm_test = lm_all[:half], lm_all[half:] or lm_all[:half]
    steps_fns = {k: make_eval_step(c) for k, c in cfgs.items()}

    sweep = []
    for lr in cfg.muon_lr_sweep:
        r = train(cfgs["mla"], tc.replace(optimizer="muon", learning_rate=lr, steps=cfg.sweep_steps,
                                          eval_every=cfg.sweep_steps, monitor_every=max(1, min(tc.monitor_every or 10,
                                                                                               cfg.sweep_steps))),
                  data.train_iter(B, T, seed=cfg.data.seed), os.path.join(workdir, "sweep", f"mla_muon_lr{lr:g}"),
                  eval_fn=lambda p: evaluate(cfgs["mla"], p, lm_dev, steps_fns["mla"]), log=log, name=f"sweep-lr{lr:g}",
                  mesh=mesh)
        sweep.append({"learning_rate": lr, "dev_eval_loss": float(r["final"]["eval_loss"]), **_monitor_summary(r["history"])})
    chosen = choose_regime(sweep)
    muon_lr = chosen if chosen is not None else cfg.muon_learning_rate

    runs, per_seed, histories = {}, {}, {}
    for s in cfg.seeds:
        for arm, att, opt in ARMS:
            if arm not in cfg.arms:
                continue
            mcfg = cfgs[att]
            lr = tc.learning_rate if opt == "adamw" else muon_lr
            t0 = time.time()
            wd = os.path.join(workdir, arm) if s == cfg.seeds[0] else os.path.join(workdir, f"seed_{s}", arm)
            row = {"attention": att, "optimizer": opt, "learning_rate": lr}
            try:
                r = train(mcfg, tc.replace(optimizer=opt, learning_rate=lr, seed=tc.seed + s),
                          data.train_iter(B, T, seed=cfg.data.seed + s), wd,
                          eval_fn=lambda p, c=mcfg, e=steps_fns[att]: evaluate(c, p, lm_dev, e),
                          log=log, name=f"{arm}-s{s}", mesh=mesh)
            except TrainingDiverged as e:           # no QK-clip: a run may blow up; that is a result
                log(f"[{arm}-s{s}] diverged: {e}")
                row.update(test_eval_loss=float("nan"), test_eval_accuracy=float("nan"), max_attn_logit=float("nan"),
                           max_attn_logit_peak=float("nan"), max_attn_logit_per_layer={}, diverged=True,
                           loss_spikes=None, wall_time_s=time.time() - t0)
                per_seed.setdefault(arm, {})[str(s)] = row
                continue
            test = evaluate(mcfg, r["params"], lm_test, steps_fns[att])
            losses = [h["loss"] for h in r["history"] if "loss" in h]
            row.update(test_eval_loss=float(test["eval_loss"]), test_eval_accuracy=float(test["eval_accuracy"]),
                       **_monitor_summary(r["history"]), diverged=False,
                       loss_spikes=count_loss_spikes(losses, warmup=tc.warmup_steps, nats=cfg.spike_nats,
                                                     window=cfg.spike_window),
                       max_train_loss_after_warmup=float(max(losses[tc.warmup_steps:] or losses)),
                       wall_time_s=time.time() - t0)
            per_seed.setdefault(arm, {})[str(s)] = row
            histories.setdefault(arm, []).append(r["history"])
            if s == cfg.seeds[0]:
                runs[arm] = r

    arms = {}
    for arm, by_seed in per_seed.items():
        all_rows = list(by_seed.values())
        rows = [r for r in all_rows if not r["diverged"]]
        if not rows:                                # every seed diverged: no interval to give
            nan = {"mean": float("nan"), "lo": None, "hi": None, "n": 0}
            arms[arm] = {"attention": all_rows[0]["attention"], "optimizer": all_rows[0]["optimizer"],
                         "learning_rate": all_rows[0]["learning_rate"], "final_eval_loss": float("nan"),
                         "final_eval_loss_interval": nan, "final_eval_accuracy": float("nan"),
                         "max_attn_logit": float("nan"), "max_attn_logit_interval": nan,
                         "max_attn_logit_peak": float("nan"), "max_attn_logit_per_layer": {},
                         "diverged_seeds": len(all_rows), "loss_spikes": 0}
            continue
        loss = mean_interval([r["test_eval_loss"] for r in rows])
        logit = mean_interval([r["max_attn_logit"] for r in rows])
        arms[arm] = {"attention": rows[0]["attention"], "optimizer": rows[0]["optimizer"],
                     "learning_rate": rows[0]["learning_rate"],
                     "final_eval_loss": loss["mean"], "final_eval_loss_interval": loss,
                     "final_eval_accuracy": float(np.mean([r["test_eval_accuracy"] for r in rows])),
                     "max_attn_logit": logit["mean"], "max_attn_logit_interval": logit,
                     "max_attn_logit_peak": float(max(r["max_attn_logit_peak"] for r in rows)),
                     "max_attn_logit_per_layer": rows[0]["max_attn_logit_per_layer"],
                     "diverged_seeds": len(all_rows) - len(rows),
                     "loss_spikes": int(sum(r["loss_spikes"] for r in rows))}
    primary_diff = {"mla_muon_split - mla_muon": {
        "max_attn_logit": paired_difference(per_seed, "mla_muon_split", "mla_muon", "max_attn_logit"),
        "test_eval_loss": paired_difference(per_seed, "mla_muon_split", "mla_muon", "test_eval_loss")},
        "mla_muon_split - gqa_muon": {
        "test_eval_loss": paired_difference(per_seed, "mla_muon_split", "gqa_muon", "test_eval_loss")},
        "mla_muon - gqa_muon": {
        "test_eval_loss": paired_difference(per_seed, "mla_muon", "gqa_muon", "test_eval_loss")}}

    plot_curves(os.path.join(workdir, "eval_loss.png"), {a: eval_series(r["history"]) for a, r in runs.items()},
                title=f"muon_split: dev eval loss (B={B}, T={T}, {tc.steps} steps, seed {cfg.seeds[0]})")
    bands = {a: trajectory_bands(h, "max_attn_logit") for a, h in histories.items()}
    plot_curves(os.path.join(workdir, "max_attn_logit.png"), {a: (b["steps"], b["mean"]) for a, b in bands.items()},
                bands={a: (b["lo"], b["hi"]) for a, b in bands.items()},
                title=f"muon_split: max |q.k|*scale (mean over {len(cfg.seeds)} seeds, band 95% t)",
                ylabel="max attention logit")
    mla, gqa = cfgs["mla"], cfgs["gqa"]
    report = {"primary_metric": cfg.PRIMARY, "arms": arms, "per_seed": per_seed, "seeds": list(cfg.seeds),
              "paired_differences": primary_diff, "logit_trajectory": bands,
              "stability": {"spike_nats": cfg.spike_nats, "spike_window": cfg.spike_window, "qk_clip": False,
                            "diverged_runs": sum(v["diverged_seeds"] for v in arms.values()),
                            "loss_spikes": {a: v["loss_spikes"] for a, v in arms.items()}},
              "sweep": sweep, "chosen_muon_learning_rate": muon_lr, "regime_from_sweep": chosen is not None,
              "steps": tc.steps, "tokens_per_step": B * T, "tokens_total": B * T * tc.steps,
              "gqa_kv_heads": gqa.num_kv_heads, "num_heads": mla.num_heads, "wall_time_s": time.time() - t_start}
    report["verdict"] = verdict(primary_diff["mla_muon_split - mla_muon"]["max_attn_logit"])
    ref = arms.get("gqa_muon", {}).get("final_eval_loss")
    rows = [[a, v["optimizer"], v["learning_rate"],
             fmt_interval(v["final_eval_loss_interval"], digits=4),
             f"{100.0 * (v['final_eval_loss'] - ref) / ref:+.2f}%" if ref else "-", v["final_eval_accuracy"],
             fmt_interval(v["max_attn_logit_interval"], digits=2),
             v["max_attn_logit_peak"], v["loss_spikes"], v["diverged_seeds"]] for a, v in arms.items()]
    srows = [[r["learning_rate"], r["dev_eval_loss"], r["max_attn_logit"], r["max_attn_logit_peak"]] for r in sweep]
    sweep_md = (f"""## Regime search (plain-Muon MLA, {cfg.sweep_steps} steps per LR, dev loss)

{md_table(["muon peak lr", "dev eval loss", "final max logit", "peak max logit"], srows)}

Chosen: muon_learning_rate = {muon_lr:g} (largest final max logit with a finite loss).
""" if sweep else f"No regime search (muon_lr_sweep empty): muon_learning_rate = {muon_lr:g} as configured.\n")
    # per seed and per layer: with 2 seeds the t interval hides whether one seed or one layer drives the max
    seed_rows = [[a, s, v["test_eval_loss"], v["max_attn_logit"], v["max_attn_logit_peak"],
                  ", ".join(f"{k} {x:.1f}" for k, x in sorted(v["max_attn_logit_per_layer"].items()))]
                 for a, by_seed in per_seed.items() for s, v in by_seed.items()]
    iv = "95% t interval over seeds" if len(cfg.seeds) > 1 else "one seed, no interval"
    cell = lambda d, k, n: "-" if not d or not d.get(k) else fmt_interval(d[k], digits=n)
    diff_rows = [[name, cell(d, "max_attn_logit", 2), cell(d, "test_eval_loss", 4)] for name, d in primary_diff.items()]
    md = f"""# muon_split

**Primary metric (named before the run):** {cfg.PRIMARY}.

Four arms trained from scratch for {tc.steps} steps of {B}x{T} = {B * T} tokens (same data stream per seed, same
width/depth: d_model {mla.d_model}, {mla.num_layers} layers, {mla.num_heads} heads, dense SwiGLU {mla.ffn_dim}); seeds {list(cfg.seeds)}.
MLA: q_lora {mla.q_lora_rank}, kv_lora {mla.kv_lora_rank}, qk {mla.qk_nope_head_dim}+{mla.qk_rope_head_dim}, v {mla.v_head_dim}.
GQA: {gqa.num_heads} query heads, {gqa.num_kv_heads} KV heads, head_dim {gqa.head_dim}.
Schedule: {tc.warmup_steps} warm-up steps then cosine to 0.1x; weight decay {tc.weight_decay}; grad clip {tc.grad_clip}.
Muon's update RMS is matched to AdamW's (0.2 sqrt(max(fan_in, fan_out))); non-matrix parameters use AdamW in
every arm. Held-out Python standard-library files: {len(lm_dev)} dev batches (curves, regime choice) and
{len(lm_test)} test batches (the loss column; never used to choose anything).

{sweep_md}
## Arms (Muon arms at peak lr {muon_lr:g}; AdamW at {tc.learning_rate:g})

{md_table(["arm", "optimizer", "peak lr", "test loss (" + iv + ")", "vs gqa_muon", "test token acc",
           "final max logit (" + iv + ")", "peak max logit", "loss spikes (all seeds)", "diverged seeds"], rows)}

**{report['verdict']}**

Paired by seed (same data stream and, for the MLA arms, the same initial weights), mean difference
with a 95% t interval over seeds:

{md_table(["difference", "final max logit", "test loss"], diff_rows)}

Stability without QK-clip: {report['stability']['diverged_runs']} run(s) with a non-finite loss; a loss spike
= a step after warm-up whose train loss exceeds the median of the previous {cfg.spike_window} steps by more
than {cfg.spike_nats:g} nats (fixed before the run).

Per seed (with few seeds the t interval is wide; these are the values it summarises):

{md_table(["arm", "seed", "test loss", "final max logit", "peak max logit", "final max logit per layer"], seed_rows)}

![eval loss](eval_loss.png)

![max attention logit](max_attn_logit.png)

Max attention logit = max over layers, heads, batch and causal same-document (query, key) pairs of
|q.k| * scale, recorded every {tc.monitor_every} steps on the training batch after the update.

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
