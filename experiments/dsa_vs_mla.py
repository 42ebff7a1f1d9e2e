"""dsa_vs_mla: does DSA, added to a dense MLA model by continued pre-training, match MLA?

Phases (each its own resumable workdir):
  base         pre-train a dense MLA model
  mla          continue it densely                                   (arm "mla")
  dsa_warmup   add the lightning indexer; base frozen, indexer trained by the dense KL
  dsa          sparse adaptation: everything trains, top-k attention  (arm "dsa")
  mha          an MHA model of the same width trained from scratch on as many tokens (arm "mha")
Then: eval-loss curves, final eval loss and retrieval accuracy per arm, the DSA-vs-MLA gap, indexer
recall of the true attention top-k, and measured attention time per step, dense vs sparse.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from experiments.registry import register
from experiments.report import eval_series, md_table, plot_curves, write_report
from glm5_jax.attention.mla import MLAttention
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data, retrieval_accuracy
from glm5_jax.layers.rope import rope_angles
from glm5_jax.model import GLM5, init_params
from glm5_jax.train import TrainConfig, evaluate, train
from glm5_jax.train.step import make_eval_step


@dataclasses.dataclass(frozen=True)
class DsaVsMlaConfig:
    """model: the DSA model (attention "dsa"); the mla arm is the same model without the indexer and
    the mha arm has num_kv_heads = num_heads and head_dim = qk_nope + qk_rope. train: the continued
    (mla / dsa) phases; train.steps is the main step count. data: the LM corpus and retrieval probes
    (model.vocab_size and data.seq_len follow data.vocab_size and train.seq_len)."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    pretrain_steps: int = 160              # dense MLA base; the mha arm trains pretrain_steps + train.steps
    indexer_warmup_steps: int = 30         # dense indexer warm-up, base frozen
    indexer_learning_rate: float = 1e-2
    retrieval_batches: int = 4             # held-out retrieval probe batches
    bench_seq_len: int = 4096              # second attention-timing shape (batch 1)

    STEPS_KEY: ClassVar[str] = "train.steps"
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
        for f in ("pretrain_steps", "indexer_warmup_steps", "retrieval_batches", "bench_seq_len"):
            if getattr(self, f) < 1:
                raise ConfigError(f"DsaVsMlaConfig.{f}={getattr(self, f)!r} is invalid: must be an integer >= 1")
        if not self.indexer_learning_rate > 0:
            raise ConfigError(f"DsaVsMlaConfig.indexer_learning_rate={self.indexer_learning_rate!r} is invalid: must be > 0")


TINY = DsaVsMlaConfig(
    model=ModelConfig(vocab_size=2048, d_model=128, num_layers=2, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_dim=384, num_experts=4,
                      moe_ffn_dim=128, first_k_dense=1, attention="dsa", index_topk=64, index_n_heads=2,
                      index_head_dim=32, mtp_depth=0, attn_chunk=128),
    train=TrainConfig(steps=100, batch_size=4, seq_len=512, learning_rate=3e-3, warmup_steps=20, min_lr_ratio=0.1,
                      eval_every=40, log_every=20, ckpt_every=40, eval_batches=4, seed=0),
    data=DataConfig(vocab_size=2048, seq_len=512, seed=0, retrieval_fraction=0.25, retrieval_pairs=2,
                    retrieval_value_digits=1),
)
SMALL = dataclasses.replace(
    TINY,
    model=preset("small", vocab_size=32768, mtp_depth=0, index_topk=512),
    train=TINY.train.replace(steps=2000, batch_size=16, seq_len=4096, learning_rate=1e-3, eval_every=250,
                             log_every=125, ckpt_every=250, eval_batches=16),
    data=dataclasses.replace(TINY.data, vocab_size=32768, retrieval_pairs=4, retrieval_value_digits=3),
    pretrain_steps=4000, indexer_warmup_steps=200, indexer_learning_rate=3e-3, retrieval_batches=16,
    bench_seq_len=32768)


def model_configs(model: ModelConfig) -> dict[str, ModelConfig]:
    """The three arms from the experiment's DSA model."""
    mla = model.replace(attention="mla", indexer_types=None)
    mha = model.replace(attention="mha", indexer_types=None, num_kv_heads=model.num_heads,
                        head_dim=model.qk_nope_head_dim + model.qk_rope_head_dim)
    return {"mla": mla, "dsa": model, "mha": mha}


def graft(dst, src):
    """Copy every parameter `src` has into `dst` (DSA params = MLA params + a fresh indexer), by path.

    With scanned layers both trees hold the same stacks (dense_layers, moe_layers, ...) as long as the
    DSA layout has one indexer type per stack (every layer "full"); a shared-indexer layout stacks its
    layers in blocks, so the MLA paths would not exist in it and this refuses."""
    flat_dst, flat_src = traverse_util.flatten_dict(dst), traverse_util.flatten_dict(src)
    missing = ["/".join(k) for k in flat_src if k not in flat_dst]
    if missing:
        raise ValueError(f"graft: {len(missing)} source parameters have no place in the target, e.g. {missing[:3]}")
    bad = ["/".join(k) for k, v in flat_src.items() if flat_dst[k].shape != v.shape]
    if bad:
        raise ValueError(f"graft: shapes differ for {bad[:3]}")
    flat_dst.update(flat_src)
    return traverse_util.unflatten_dict(flat_dst)


def make_eval_fn(cfg: ModelConfig, lm_batches, ret_batches):
    eval_step = make_eval_step(cfg)
    fwd = jax.jit(lambda p, b: GLM5(cfg).apply({"params": p}, b["tokens"], b["positions"], b["segment_ids"])["logits"])

    def eval_fn(params):
        out = evaluate(cfg, params, lm_batches, eval_step)
        accs = [retrieval_accuracy(np.asarray(fwd(params, {k: jnp.asarray(v) for k, v in b.items()})), b)
                for b in ret_batches]
        out["retrieval_accuracy"] = float(np.mean(accs))
        return out

    return eval_fn


def indexer_recall(cfg: ModelConfig, params, batches) -> float:
    """Mean recall of the true (head-summed main attention) top-k keys by the indexer's top-k."""
    def f(p, b):
        _, st = GLM5(cfg).apply({"params": p}, b["tokens"], b["positions"], b["segment_ids"],
                                indexer_loss="dense", mutable=["intermediates"])
        flat = traverse_util.flatten_dict(st["intermediates"])
        # one value per layer; a scanned stack sows [repeats] values under one path
        return jnp.mean(jnp.concatenate([jnp.ravel(v[0]) for k, v in flat.items() if k[-1] == "indexer_recall"]))
    f = jax.jit(f)
    return float(np.mean([float(f(params, {k: jnp.asarray(v) for k, v in b.items()})) for b in batches]))


def time_attention(cfg_dense: ModelConfig, cfg_sparse: ModelConfig, seq_len: int, batch: int, reps: int = 2) -> dict:
    """Forward+backward wall time of one attention layer (with the indexer for DSA), dense vs sparse."""
    out = {}
    x = jax.random.normal(jax.random.PRNGKey(0), (batch, seq_len, cfg_dense.d_model), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))
    cos, sin = rope_angles(pos, cfg_dense.qk_rope_head_dim, cfg_dense.rope_theta)
    for name, cfg, itype in (("dense_mla", cfg_dense, None), ("sparse_dsa", cfg_sparse, "full")):
        mod = MLAttention(cfg.replace(attn_chunk=256), itype)
        params = mod.init(jax.random.PRNGKey(1), x[:, :8], cos[:, :8], sin[:, :8])["params"]
        loss = jax.jit(jax.grad(lambda p, x: jnp.sum(mod.apply({"params": p}, x, cos, sin)[0] ** 2), argnums=(0, 1)))
        jax.block_until_ready(loss(params, x))
        t = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(loss(params, x))
        out[name] = (time.perf_counter() - t) / reps
    out["dense_over_sparse"] = out["dense_mla"] / out["sparse_dsa"]
    return out


@register("dsa_vs_mla", "DSA added to a dense MLA model by continued pre-training vs continued MLA (and an MHA arm)",
          {"tiny": TINY, "small": SMALL})
def run(cfg: DsaVsMlaConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    data = build_lm_data(cfg.data)
    if data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"tokenizer vocab {data.tokenizer.vocab_size} != data.vocab_size {cfg.model.vocab_size}")
    cfgs = model_configs(cfg.model)
    tc = cfg.train
    B, T, seed = tc.batch_size, tc.seq_len, tc.seed
    lm_eval = list(data.eval_batches(B, T, max_batches=tc.eval_batches))
    ret_eval = list(data.retrieval_eval_batches(B, T, num_batches=cfg.retrieval_batches))
    it = lambda offset: data.train_iter(B, T, seed=cfg.data.seed + offset)  # noqa: E731
    evals = {k: make_eval_fn(c, lm_eval, ret_eval) for k, c in cfgs.items()}
    runs = {}

    base = train(cfgs["mla"], tc.replace(steps=cfg.pretrain_steps), it(0), os.path.join(workdir, "base"),
                 eval_fn=evals["mla"], log=log, name="base-mla", mesh=mesh)
    runs["mla"] = train(cfgs["mla"], tc, it(1), os.path.join(workdir, "mla"),
                        init_params=base["params"], eval_fn=evals["mla"], log=log, name="mla", mesh=mesh)
    dsa_init = graft(init_params(cfgs["dsa"], jax.random.PRNGKey(seed + 7)), base["params"])
    w = cfg.indexer_warmup_steps
    warm = train(cfgs["dsa"], tc.replace(steps=w, indexer_loss="dense", trainable_pattern="indexer",
                                         learning_rate=cfg.indexer_learning_rate, warmup_steps=min(5, w), eval_every=w),
                 it(2), os.path.join(workdir, "dsa_warmup"), init_params=dsa_init,
                 eval_fn=evals["dsa"], log=log, name="dsa-warmup", mesh=mesh)
    recall_after_warmup = indexer_recall(cfgs["dsa"], warm["params"], lm_eval[:2])
    runs["dsa"] = train(cfgs["dsa"], tc.replace(indexer_loss="sparse"), it(1), os.path.join(workdir, "dsa"),
                        init_params=warm["params"], eval_fn=evals["dsa"], log=log, name="dsa", mesh=mesh)
    recall_final = indexer_recall(cfgs["dsa"], runs["dsa"]["params"], lm_eval[:2])
    runs["mha"] = train(cfgs["mha"], tc.replace(steps=cfg.pretrain_steps + tc.steps), it(0),
                        os.path.join(workdir, "mha"), eval_fn=evals["mha"], log=log, name="mha", mesh=mesh)
    log("timing attention dense vs sparse ...")
    timing = {f"T={T}": time_attention(cfgs["mla"], cfgs["dsa"], T, B),
              f"T={cfg.bench_seq_len}": time_attention(cfgs["mla"], cfgs["dsa"], cfg.bench_seq_len, 1, reps=1)}

    arms = {name: {"final_eval_loss": r["final"]["eval_loss"], "retrieval_accuracy": r["final"]["retrieval_accuracy"],
                   "final_eval_accuracy": r["final"]["eval_accuracy"]} for name, r in runs.items()}
    gap = 100.0 * (arms["dsa"]["final_eval_loss"] - arms["mla"]["final_eval_loss"]) / arms["mla"]["final_eval_loss"]
    report = {"arms": arms, "dsa_vs_mla_gap_pct": gap, "indexer_recall_after_warmup": recall_after_warmup,
              "indexer_recall_final": recall_final, "attention_time_s": timing,
              "base_final_eval_loss": base["final"]["eval_loss"], "seq_len": T, "index_topk": cfgs["dsa"].index_topk,
              "tokens_per_step": B * T, "wall_time_s": None}

    P = cfg.pretrain_steps
    bx, by = eval_series(base["history"])
    series = {"mha (from scratch)": eval_series(runs["mha"]["history"]),
              "mla (base + continued)": (bx + eval_series(runs["mla"]["history"], offset=P)[0],
                                         by + eval_series(runs["mla"]["history"], offset=P)[1]),
              "dsa (base + warm-up + sparse)": eval_series(runs["dsa"]["history"], offset=P)}
    plot_curves(os.path.join(workdir, "eval_loss.png"), series,
                title=f"dsa_vs_mla: eval loss (T={T}, top-k={cfgs['dsa'].index_topk})", xlabel="LM training step")
    warm_hist = [r for r in warm["history"] if "indexer_kl" in r]
    plot_curves(os.path.join(workdir, "indexer_warmup.png"),
                {"indexer KL": ([r["step"] for r in warm_hist], [r["indexer_kl"] for r in warm_hist])},
                title="DSA indexer dense warm-up (base frozen)", ylabel="KL(attention || indexer)")
    report["wall_time_s"] = time.time() - t_start
    rows = [[n, a["final_eval_loss"], a["retrieval_accuracy"], a["final_eval_accuracy"]] for n, a in arms.items()]
    trows = [[k, v["dense_mla"], v["sparse_dsa"], f"{v['dense_over_sparse']:.2f}x"] for k, v in timing.items()]
    md = f"""# dsa_vs_mla

Dense MLA pre-trained for {P} steps, then continued {tc.steps} steps two ways: densely (**mla**) and as
DSA (**dsa**: {w} indexer warm-up steps with the base frozen, then {tc.steps} sparse-adaptation
steps) with top-k = {cfgs['dsa'].index_topk} of T = {T} tokens. **mha** is trained from scratch for {P + tc.steps} steps.
{B * T} tokens per step; held-out Python standard-library files; {len(lm_eval)} eval batches.

{md_table(["arm", "final eval loss", "retrieval accuracy", "eval token accuracy"], rows)}

Retrieval accuracy is exact match of the {cfg.data.retrieval_value_digits}-digit value on {sum(len(b["tokens"]) for b in ret_eval)}
held-out probe sequences (chance: {10.0 ** -cfg.data.retrieval_value_digits:.3g}).

**DSA vs MLA gap: {gap:+.2f}%** of the continued-MLA eval loss (negative = DSA lower).

Indexer recall of the true attention top-{cfgs['dsa'].index_topk}: {recall_after_warmup:.3f} after warm-up,
{recall_final:.3f} after sparse adaptation.

![eval loss](eval_loss.png)

![indexer warm-up](indexer_warmup.png)

## Attention time per step (one layer, forward + backward, CPU)

{md_table(["shape", "dense MLA s", "DSA (indexer + sparse) s", "dense / sparse"], trows)}

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
