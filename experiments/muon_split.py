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
import os
import time
from typing import ClassVar

from experiments.registry import register
from experiments.report import eval_series, md_table, plot_curves, write_report
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.train import TrainConfig, evaluate, train
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
        model_configs(self.model, self.gqa_kv_heads, self.gqa_head_dim)     # the gqa arm validates too


TINY = MuonSplitConfig(
    model=ModelConfig(vocab_size=2048, d_model=128, num_layers=2, num_heads=8, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, ffn_dim=384, num_experts=0,
                      mtp_depth=0, attention="mla", attn_chunk=128),
    train=TrainConfig(steps=160, batch_size=8, seq_len=128, learning_rate=3e-3, warmup_steps=16, weight_decay=0.1,
                      eval_every=40, log_every=20, ckpt_every=40, monitor_every=10, eval_batches=4, seed=0),
    data=DataConfig(vocab_size=2048, seq_len=128, seed=0),
)
# One accelerator: the "small" preset trunk (MoE, MLA dims from the preset) with 16 heads, GQA-8 (8 KV heads).
SMALL = dataclasses.replace(
    TINY, model=preset("small", vocab_size=32768, mtp_depth=0, attention="mla", num_heads=16),
    train=TINY.train.replace(steps=3000, batch_size=32, seq_len=2048, learning_rate=1e-3, warmup_steps=200,
                             eval_every=250, log_every=125, ckpt_every=250, monitor_every=50, eval_batches=16),
    data=dataclasses.replace(TINY.data, vocab_size=32768), gqa_kv_heads=8, gqa_head_dim=0, muon_learning_rate=1e-3)


@register("muon_split", "MLA with AdamW / Muon / Muon Split vs GQA with Muon, from scratch at equal tokens; "
          "eval loss and max attention logits", {"tiny": TINY, "small": SMALL})
def run(cfg: MuonSplitConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    tc = cfg.train
    B, T = tc.batch_size, tc.seq_len
    data = build_lm_data(cfg.data)
    cfgs = model_configs(cfg.model, cfg.gqa_kv_heads, cfg.gqa_head_dim)
    lm_eval = list(data.eval_batches(B, T, max_batches=tc.eval_batches))
    runs, arms = {}, {}
    for arm, att, opt in ARMS:
        if arm not in cfg.arms:
            continue
        mcfg = cfgs[att]
        eval_step = make_eval_step(mcfg)
        lr = tc.learning_rate if opt == "adamw" else cfg.muon_learning_rate
        t0 = time.time()
        r = train(mcfg, tc.replace(optimizer=opt, learning_rate=lr), data.train_iter(B, T, seed=cfg.data.seed),
                  os.path.join(workdir, arm), eval_fn=lambda p, c=mcfg, e=eval_step: evaluate(c, p, lm_eval, e),
                  log=log, name=arm, mesh=mesh)
        runs[arm] = r
        mon = [row for row in r["history"] if "max_attn_logit" in row]
        last = mon[-1] if mon else {}
        arms[arm] = {"attention": att, "optimizer": opt, "learning_rate": lr,
                     "final_eval_loss": float(r["final"]["eval_loss"]),
                     "final_eval_accuracy": float(r["final"]["eval_accuracy"]),
                     "max_attn_logit": float(last.get("max_attn_logit", float("nan"))),
                     "max_attn_logit_peak": float(max((row["max_attn_logit"] for row in mon), default=float("nan"))),
                     "max_attn_logit_per_layer": {k.split("/", 1)[1]: float(v) for k, v in last.items()
                                                  if k.startswith("max_attn_logit/")},
                     "wall_time_s": time.time() - t0}

    plot_curves(os.path.join(workdir, "eval_loss.png"), {a: eval_series(r["history"]) for a, r in runs.items()},
                title=f"muon_split: eval loss (B={B}, T={T}, {tc.steps} steps)")
    plot_curves(os.path.join(workdir, "max_attn_logit.png"),
                {a: eval_series(r["history"], "max_attn_logit") for a, r in runs.items()},
                title="muon_split: max |q.k|*scale over layers, heads, visible keys", ylabel="max attention logit")
    mla, gqa = cfgs["mla"], cfgs["gqa"]
    report = {"arms": arms, "steps": tc.steps, "tokens_per_step": B * T, "tokens_total": B * T * tc.steps,
              "gqa_kv_heads": gqa.num_kv_heads, "num_heads": mla.num_heads, "wall_time_s": time.time() - t_start}
    ref = arms.get("gqa_muon", {}).get("final_eval_loss")
    rows = [[a, v["optimizer"], v["learning_rate"], v["final_eval_loss"],
             f"{100.0 * (v['final_eval_loss'] - ref) / ref:+.2f}%" if ref else "-", v["final_eval_accuracy"],
             v["max_attn_logit"], v["max_attn_logit_peak"]] for a, v in arms.items()]
    md = f"""# muon_split

Four arms trained from scratch for {tc.steps} steps of {B}x{T} = {B * T} tokens (same data stream, same
width/depth: d_model {mla.d_model}, {mla.num_layers} layers, {mla.num_heads} heads, dense SwiGLU {mla.ffn_dim}).
MLA: q_lora {mla.q_lora_rank}, kv_lora {mla.kv_lora_rank}, qk {mla.qk_nope_head_dim}+{mla.qk_rope_head_dim}, v {mla.v_head_dim}.
GQA: {gqa.num_heads} query heads, {gqa.num_kv_heads} KV heads, head_dim {gqa.head_dim}.
Schedule: {tc.warmup_steps} warm-up steps then cosine to 0.1x; weight decay {tc.weight_decay}; grad clip {tc.grad_clip}.
Muon's update RMS is matched to AdamW's (0.2 sqrt(max(fan_in, fan_out))); non-matrix parameters use AdamW in
every arm. Held-out Python standard-library files, {len(lm_eval)} eval batches.

{md_table(["arm", "optimizer", "peak lr", "final eval loss", "vs gqa_muon", "eval token acc",
           "final max logit", "peak max logit"], rows)}

![eval loss](eval_loss.png)

![max attention logit](max_attn_logit.png)

Max attention logit = max over layers, heads, batch and causal same-document (query, key) pairs of
|q.k| * scale, recorded every {tc.monitor_every} steps on the training batch after the update.

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
