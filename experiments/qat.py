"""qat: bf16 vs int4 post-training quantisation vs int4 QAT on one arithmetic task (glm5_jax.quant).

Arms (same model, data, seeds and step count; SFT through glm5_jax.train.train):
  bf16      SFT without quantisation (float32 training); evaluated with every weight rounded to bfloat16
  ptq_int4  the bf16 arm's weights, int4-quantised once after training (glm5_jax.quant.ptq_params)
  qat_int4  SFT with the selected matrices fake-quantised in every forward (straight-through gradients,
            glm5_jax.quant.qat_params plugged into the LM loss); evaluated through the packed int4 export
            (export_int4 -> load_int4), which is bit-identical to the QAT forward
Metrics on the held-out TEST prompts (never used to choose anything): eval_loss (answer-token cross
entropy, teacher-forced) and task_success (greedy exact-match accuracy). Primary metric, fixed before
the run: task_success. A separate VALIDATION split carries the PTQ group-size sweep (the evidence for
choosing quant.group_size / quant.pattern); the test split is evaluated only for the final arms.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from experiments.registry import register
from experiments.report import eval_series, md_table, plot_curves, write_report
from glm5_jax.config import ModelConfig
from glm5_jax.eval import LMLoss, evaluate
from glm5_jax.fields import check_fields, setting
from glm5_jax.quant import ALL_LINEAR, QuantConfig, export_int4, load_int4, ptq_params, qat_params, quantized_paths
from glm5_jax.rl.program import evaluate_accuracy
from glm5_jax.rl.sft import CharVocab, SFTIterator, pack_examples
from glm5_jax.rl.tasks import distinct_tasks, draw_excluding, named_task as make_task
from glm5_jax.train import TrainConfig, train
from glm5_jax.train.step import make_loss_fn

ARMS = ("bf16", "ptq_int4", "qat_int4")


@dataclasses.dataclass(frozen=True)
class QatConfig:
    """model: a tiny DSA + MoE policy over the character vocabulary; train: the SFT run of every arm;
    quant: the int4 quantiser (group size, which matrices). sweep_group_sizes: PTQ group sizes tried on
    the validation split (0 = one group over the whole input dimension)."""
    model: ModelConfig
    train: TrainConfig
    quant: QuantConfig = QuantConfig()
    task: str = "d2d1"
    test_tasks: int = setting(256, integer=True, min=1)
    val_tasks: int = setting(256, integer=True, min=1)
    max_new_tokens: int = setting(6, integer=True, min=1)
    sweep_group_sizes: tuple[int, ...] = (0, 32, 8)

    DERIVED: ClassVar[dict] = {"model.vocab_size": "the character vocabulary"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=CharVocab().padded_size()))
        check_fields(self)
        make_task(random.Random(0), self.task)


def _policy(d: int, h: int, layers: int, experts: int, expert_ffn: int) -> ModelConfig:
    return ModelConfig(vocab_size=CharVocab().padded_size(), d_model=d, num_layers=layers, ffn_dim=3 * d,
                       attention="dsa", num_heads=h, q_lora_rank=d // 2, kv_lora_rank=d // 2,
                       qk_nope_head_dim=d // h, qk_rope_head_dim=max(4, d // (2 * h)), v_head_dim=d // h,
                       index_topk=16, index_n_heads=2, index_head_dim=16, num_experts=experts,
                       num_shared_experts=1, experts_per_tok=2, moe_ffn_dim=expert_ffn, n_group=1, topk_group=1,
                       first_k_dense=1, mtp_depth=0, attn_chunk=64)


TINY = QatConfig(
    model=_policy(64, 4, 3, 4, 128),
    train=TrainConfig(steps=500, batch_size=16, seq_len=64, learning_rate=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                      weight_decay=0.0, eval_every=250, log_every=100, ckpt_every=500, seed=0),
    # experts only (GLM-5's choice, quant.EXPERTS) lost nothing measurable at this scale (docs/qat_distill.md),
    # so the default quantises every linear layer but the router and the indexer, one scale per output column
    quant=QuantConfig(bits=4, group_size=0, pattern=ALL_LINEAR),
    sweep_group_sizes=(0, 32),
)
SMALL = dataclasses.replace(
    TINY, model=_policy(256, 8, 4, 8, 256),
    train=TINY.train.replace(steps=2000, batch_size=64, seq_len=128, learning_rate=1e-3, eval_every=500,
                             ckpt_every=2000),
    test_tasks=1024, val_tasks=1024)


def splits(cfg: QatConfig):
    """Disjoint VALIDATION and TEST prompt sets (training never sees either)."""
    out = distinct_tasks(lambda rng: make_task(rng, cfg.task), cfg.val_tasks + cfg.test_tasks,
                         random.Random(20_000 + cfg.train.seed))
    return out[:cfg.val_tasks], out[cfg.val_tasks:]


def eval_loss_fn(cfg: QatConfig, tasks, vocab):
    """Teacher-forced answer cross entropy over ``tasks`` (packed like SFT, loss on the answer only; the
    evaluator's LM loss on one batch, its float32 ratio)."""
    exs = [(vocab.encode(t.prompt, bos=True), vocab.encode(t.solution)) for t in tasks]
    per_row = cfg.train.seq_len // max(len(a) + len(b) for a, b in exs)
    batch = pack_examples(exs, -(-len(exs) // per_row), cfg.train.seq_len)

    def f(params):
        r = evaluate(cfg.model, params, [batch], [LMLoss(sums=True)])
        return float(r["eval_loss_sums"][0] / r["eval_loss_tokens"][0])
    return f


def _bf16(params):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype)
                        if jnp.issubdtype(x.dtype, jnp.floating) else x, params)


@register("qat", "INT4 weight-only quantisation (group-wise, symmetric): bf16 vs PTQ vs QAT (eval loss, task success)",
          {"tiny": TINY, "small": SMALL})
def run(cfg: QatConfig, workdir: str, log, mesh=None) -> dict:
    t0 = time.time()
    vocab = CharVocab()
    mcfg, tc, q = cfg.model, cfg.train, cfg.quant
    val, test = splits(cfg)
    exclude = {t.prompt for t in val + test}

    def sample_task(rng):
        return draw_excluding(make_task, exclude, rng, cfg.task)

    def success(params, tasks):
        return evaluate_accuracy(mcfg, params, tasks, vocab, max_new_tokens=cfg.max_new_tokens, greedy=True)["accuracy"]

    test_loss, val_loss = eval_loss_fn(cfg, test, vocab), eval_loss_fn(cfg, val, vocab)
    base_loss = make_loss_fn(mcfg, tc)

    def qat_loss(params, batch):
        return base_loss(qat_params(params, q), batch)

    runs = {}
    for arm, loss_fn in (("bf16", None), ("qat_int4", qat_loss)):
        # the training-time eval watches what that arm ships: bf16 weights / the int4 weights
        view = _bf16 if arm == "bf16" else (lambda p: ptq_params(p, q))
        it = SFTIterator(sample_task, vocab, tc.batch_size, tc.seq_len, seed=tc.seed, exclude=exclude)
        runs[arm] = train(mcfg, tc, it, os.path.join(workdir, arm), loss_fn=loss_fn, log=log, name=arm, mesh=mesh,
                          eval_fn=lambda p, view=view: {"eval_loss": val_loss(view(p))})
    bf16_params = runs["bf16"]["params"]
    exported = export_int4(runs["qat_int4"]["params"], q)
    shipped = {"bf16": _bf16(bf16_params), "ptq_int4": ptq_params(bf16_params, q),
               "qat_int4": load_int4(runs["qat_int4"]["params"], exported)}
    arms = {a: {"eval_loss": test_loss(p), "task_success": success(p, test)} for a, p in shipped.items()}
    for a, v in arms.items():
        log(f"[qat] {a}: test eval_loss {v['eval_loss']:.4f} task_success {v['task_success']:.3f}")

    # PTQ group-size sweep on the VALIDATION split (the evidence for the chosen quant settings)
    sweep = []
    for g in cfg.sweep_group_sizes:
        qg = dataclasses.replace(q, group_size=g)
        p = ptq_params(bf16_params, qg)
        sweep.append({"group_size": g, "val_eval_loss": val_loss(p), "val_task_success": success(p, val)})
    val_bf16 = {"val_eval_loss": val_loss(shipped["bf16"]), "val_task_success": success(shipped["bf16"], val)}

    n_q = sum(int(np.prod(e["shape"])) for e in exported.values())
    n_all = int(sum(x.size for x in jax.tree.leaves(bf16_params)))
    packed_bytes = sum(e["packed"].nbytes + e["scales"].nbytes for e in exported.values())
    report = {"arms": arms, "primary_metric": "task_success", "task": cfg.task, "test_prompts": len(test),
              "quant": dataclasses.asdict(q), "quantized_paths": quantized_paths(bf16_params, q),
              "quantized_params": n_q, "params": n_all, "export_bytes": packed_bytes,
              "export_bytes_float32": 4 * n_q, "val_bf16": val_bf16, "val_ptq_sweep": sweep,
              "sft_steps": tc.steps, "wall_time_s": None}
    plot_curves(os.path.join(workdir, "val_loss.png"),
                {a: eval_series(r["history"]) for a, r in runs.items()},
                title="validation answer loss during SFT (bf16 weights / int4 weights)", ylabel="eval loss")
    plot_curves(os.path.join(workdir, "train_loss.png"),
                {a: ([r["step"] for r in h["history"]], [r["loss"] for r in h["history"]]) for a, h in runs.items()},
                title="training loss (qat_int4: through the fake-quantised weights)", ylabel="loss", logy=True)
    report["wall_time_s"] = time.time() - t0
    rows = [[a, v["eval_loss"], v["task_success"]] for a, v in arms.items()]
    srows = [[s["group_size"] or "whole input", s["val_eval_loss"], s["val_task_success"]] for s in sweep]
    md = f"""# qat

Task {cfg.task} (tasks.arithmetic_task levels; character vocabulary). Model: DSA + MoE, d_model {mcfg.d_model},
{mcfg.num_layers} layers ({mcfg.first_k_dense} dense), {mcfg.num_experts} routed + {mcfg.num_shared_experts} shared
experts of width {mcfg.moe_ffn_dim}; {n_all:,} parameters, of which {n_q:,} quantised (pattern `{q.pattern}`).
SFT {tc.steps} steps per arm ({tc.batch_size}x{tc.seq_len} packed tokens, loss on the answer only), same seeds and data.
Quantiser: int{q.bits} weight-only, symmetric, group size {q.group_size or 'whole input dimension'} along the input
dimension. Export: {packed_bytes:,} bytes (packed int4 + float32 scales) vs {4 * n_q:,} bytes float32.

Test split: {len(test)} prompts never used for training or for choosing settings. Primary metric: task_success
(greedy exact match). eval_loss: teacher-forced answer cross entropy.

{md_table(["arm", "eval_loss", "task_success"], rows)}

PTQ sweep on the validation split ({len(val)} prompts; bf16: loss {val_bf16['val_eval_loss']:.4f}, success
{val_bf16['val_task_success']:.3f}):

{md_table(["group size", "val eval_loss", "val task_success"], srows)}

![validation loss](val_loss.png)

![training loss](train_loss.png)

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
