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

import os
import time

from experiments.registry import register
from experiments.report import eval_series, md_table, plot_curves, write_report
from glm5_jax.config import ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.train import TrainConfig, evaluate, train
from glm5_jax.train.step import make_eval_step

ARMS = (("mla_adamw", "mla", "adamw"), ("mla_muon", "mla", "muon"), ("mla_muon_split", "mla", "muon_split"),
        ("gqa_muon", "gqa", "muon"))

TINY = dict(
    seq_len=128, batch_size=8, vocab_size=2048, d_model=128, num_layers=2, num_heads=8, q_lora_rank=64,
    kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, gqa_kv_heads=2, gqa_head_dim=24,
    ffn_dim=384, steps=160, warmup_steps=16, learning_rate=3e-3, muon_learning_rate=3e-3, weight_decay=0.1,
    eval_every=40, eval_batches=4, monitor_every=10, max_files=0, seed=0, model_preset="", arms="",
)
# One accelerator: the "small" preset trunk (MoE, MLA dims from the preset) with 16 heads, GQA-8 (8 KV heads).
SMALL = dict(TINY, seq_len=2048, batch_size=32, vocab_size=32768, model_preset="small", num_heads=16, gqa_kv_heads=8,
             gqa_head_dim=0, steps=3000, warmup_steps=200, learning_rate=1e-3, muon_learning_rate=1e-3,
             eval_every=250, eval_batches=16, monitor_every=50)


def model_configs(s: dict, vocab: int) -> dict[str, ModelConfig]:
    if s["model_preset"]:
        base = preset(s["model_preset"], vocab_size=vocab, mtp_depth=0, attention="mla", num_heads=s["num_heads"])
    else:
        base = ModelConfig(vocab_size=vocab, d_model=s["d_model"], num_layers=s["num_layers"], num_heads=s["num_heads"],
                           q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"],
                           qk_nope_head_dim=s["qk_nope_head_dim"], qk_rope_head_dim=s["qk_rope_head_dim"],
                           v_head_dim=s["v_head_dim"], ffn_dim=s["ffn_dim"], num_experts=0, mtp_depth=0,
                           attention="mla", attn_chunk=min(256, s["seq_len"]))
    head_dim = s["gqa_head_dim"] or base.qk_nope_head_dim + base.qk_rope_head_dim
    gqa = base.replace(attention="gqa", num_kv_heads=min(s["gqa_kv_heads"], base.num_heads), head_dim=head_dim)
    return {"mla": base, "gqa": gqa}


@register("muon_split", "MLA with AdamW / Muon / Muon Split vs GQA with Muon, from scratch at equal tokens; "
          "eval loss and max attention logits", {"tiny": TINY, "small": SMALL})
def run(s: dict, workdir: str, log) -> dict:
    t_start = time.time()
    B, T = s["batch_size"], s["seq_len"]
    data = build_lm_data(DataConfig(vocab_size=s["vocab_size"], seq_len=T, seed=s["seed"],
                                    max_files=s["max_files"] or None))
    cfgs = model_configs(s, data.tokenizer.vocab_size)
    lm_eval = list(data.eval_batches(B, T, max_batches=s["eval_batches"]))
    tc = TrainConfig(steps=s["steps"], batch_size=B, seq_len=T, learning_rate=s["learning_rate"],
                     warmup_steps=min(s["warmup_steps"], s["steps"]), weight_decay=s["weight_decay"],
                     eval_every=s["eval_every"], log_every=max(1, s["eval_every"] // 2), ckpt_every=s["eval_every"],
                     monitor_every=s["monitor_every"], seed=s["seed"])
    wanted = [a for a in s["arms"].split(",") if a] or [a for a, _, _ in ARMS]
    runs, arms = {}, {}
    for arm, att, opt in ARMS:
        if arm not in wanted:
            continue
        cfg = cfgs[att]
        eval_step = make_eval_step(cfg)
        lr = s["learning_rate"] if opt == "adamw" else s["muon_learning_rate"]
        t0 = time.time()
        r = train(cfg, tc.replace(optimizer=opt, learning_rate=lr), data.train_iter(B, T, seed=s["seed"]),
                  os.path.join(workdir, arm), eval_fn=lambda p, c=cfg, e=eval_step: evaluate(c, p, lm_eval, e),
                  log=log, name=arm)
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
                title=f"muon_split: eval loss (B={B}, T={T}, {s['steps']} steps)")
    plot_curves(os.path.join(workdir, "max_attn_logit.png"),
                {a: eval_series(r["history"], "max_attn_logit") for a, r in runs.items()},
                title="muon_split: max |q.k|*scale over layers, heads, visible keys", ylabel="max attention logit")
    mla, gqa = cfgs["mla"], cfgs["gqa"]
    report = {"arms": arms, "steps": s["steps"], "tokens_per_step": B * T, "tokens_total": B * T * s["steps"],
              "gqa_kv_heads": gqa.num_kv_heads, "num_heads": mla.num_heads, "wall_time_s": time.time() - t_start}
    ref = arms.get("gqa_muon", {}).get("final_eval_loss")
    rows = [[a, v["optimizer"], v["learning_rate"], v["final_eval_loss"],
             f"{100.0 * (v['final_eval_loss'] - ref) / ref:+.2f}%" if ref else "-", v["final_eval_accuracy"],
             v["max_attn_logit"], v["max_attn_logit_peak"]] for a, v in arms.items()]
    md = f"""# muon_split

Four arms trained from scratch for {s['steps']} steps of {B}x{T} = {B * T} tokens (same data stream, same
width/depth: d_model {mla.d_model}, {mla.num_layers} layers, {mla.num_heads} heads, dense SwiGLU {mla.ffn_dim}).
MLA: q_lora {mla.q_lora_rank}, kv_lora {mla.kv_lora_rank}, qk {mla.qk_nope_head_dim}+{mla.qk_rope_head_dim}, v {mla.v_head_dim}.
GQA: {gqa.num_heads} query heads, {gqa.num_kv_heads} KV heads, head_dim {gqa.head_dim}.
Schedule: {tc.warmup_steps} warm-up steps then cosine to 0.1x; weight decay {s['weight_decay']}; grad clip 1.0.
Muon's update RMS is matched to AdamW's (0.2 sqrt(max(fan_in, fan_out))); non-matrix parameters use AdamW in
every arm. Held-out Python standard-library files, {len(lm_eval)} eval batches.

{md_table(["arm", "optimizer", "peak lr", "final eval loss", "vs gqa_muon", "eval token acc",
           "final max logit", "peak max logit"], rows)}

![eval loss](eval_loss.png)

![max attention logit](max_attn_logit.png)

Max attention logit = max over layers, heads, batch and causal same-document (query, key) pairs of
|q.k| * scale, recorded every {s['monitor_every']} steps on the training batch after the update.

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
