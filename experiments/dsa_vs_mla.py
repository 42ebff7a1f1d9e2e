"""dsa_vs_mla: does DSA, added to a dense MLA model by continued pre-training, match MLA?

Phases (each its own resumable workdir):
  base         pre-train a dense MLA model (train.learning_rate, warm-up, cosine to min_lr_ratio x peak)
  mla          continue it densely                                   (arm "mla")
  dsa_warmup   add the lightning indexer; base frozen, indexer trained by the dense KL
  dsa          sparse adaptation: everything trains, top-k attention  (arm "dsa")
  mha          an MHA model of the same width trained from scratch on as many tokens (arm "mha")
Learning rates (DeepSeek-V3.2's recipe: indexer warm-up at its own rate with the rest frozen, then
adaptation at 7.3e-6, DeepSeek-V3's final pre-training rate): the continued phases (mla, dsa) do not
restart the base's schedule at its peak; they run at the base's final rate (train.learning_rate x
min_lr_ratio, what the base's cosine ended at), constant after `continued_warmup_steps` of linear
warm-up (their optimizer moments start fresh). The indexer warm-up trains only the new indexer, at
`indexer_learning_rate`. `phase_plan` gives every phase's TrainConfig.
`--steps N` (the `steps` field) scales every phase by N / train.steps: the continued phases run N
steps; base, indexer warm-up, the mha arm, the warm-ups of the schedules and eval_every / log_every
are scaled by the same factor (rounded, at least 1 step), so `--steps=2` is a quick smoke run.
`--set train.steps=N` changes only the continued phases, as before.
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
from experiments.report import (chain_series, eval_series, fmt_interval, md_table, mean_interval,
                                paired_bootstrap_interval, plot_curves, wilson_interval, write_report)
from glm5_jax.attention.mla import MLAttention
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data, retrieval_accuracy
from glm5_jax.data.retrieval import EVAL_TAG, TEST_TAG, retrieval_correct, retrieval_probe_batches
from glm5_jax.layers.rope import rope_angles
from glm5_jax.model import GLM5, init_params
from glm5_jax.optim.schedules import warmup_cosine
from glm5_jax.train import TrainConfig, evaluate, train
from glm5_jax.train.stages import graft
from glm5_jax.train.step import make_eval_step


PRIMARY_METRIC = ("test retrieval accuracy of dsa vs mla (exact match of the value on held-out test probes "
                  "whose record lies further back than index_topk; paired difference with a bootstrap interval)")


@dataclasses.dataclass(frozen=True)
class DsaVsMlaConfig:
    """model: the DSA model (attention "dsa"); the mla arm is the same model without the indexer and
    the mha arm has num_kv_heads = num_heads and head_dim = qk_nope + qk_rope. train: every phase's
    settings; its schedule (learning_rate, warmup_steps, min_lr_ratio) is the base's, the continued
    (mla / dsa) phases run at the base's final rate (phase_plan); train.steps: the continued phases'
    steps. steps (--steps): scale every phase by steps / train.steps (None: as configured). data: the
    LM corpus and retrieval records mixed into training from the first step (model.vocab_size and
    data.seq_len follow data.vocab_size and train.seq_len). Probes: `dev_probe_batches` dev probes
    (EVAL_TAG) are scored during training and may be used to choose settings; `test_probe_batches`
    test probes (TEST_TAG) and the second half of the held-out LM batches are scored once at the end
    and give the headline figures.
    seeds: every phase runs once per seed (train.seed + s, data stream seed + s); the report gives
    the mean with a 95% t interval over seeds, and Wilson intervals over probes per seed."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    pretrain_steps: int = 160              # dense MLA base; the mha arm trains pretrain_steps + train.steps
    indexer_warmup_steps: int = 30         # dense indexer warm-up, base frozen
    indexer_learning_rate: float = 1e-2
    dev_probe_batches: int = 2             # retrieval probes watched during training (dev)
    test_probe_batches: int = 16           # retrieval probes for the headline (test), batches of train.batch_size
    distance_bins: int = 4                 # accuracy-vs-distance plot
    mha_arm: bool = False                  # also train an MHA model from scratch on as many tokens
    seeds: tuple[int, ...] = (0,)
    bench_seq_len: int = 4096              # second attention-timing shape (batch 1)
    continued_warmup_steps: int = 10       # mla / dsa: linear warm-up to the base's final rate (fresh moments)
    steps: int | None = None               # --steps N: continued phases N steps, every phase x N / train.steps

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
                  "distance_bins", "bench_seq_len"):
            if getattr(self, f) < 1:
                raise ConfigError(f"DsaVsMlaConfig.{f}={getattr(self, f)!r} is invalid: must be an integer >= 1")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ConfigError(f"DsaVsMlaConfig.steps={self.steps!r} is invalid: an integer >= 1 (every phase scaled by "
                              "steps / train.steps) or None (the configured step counts)")
        if not isinstance(self.continued_warmup_steps, int) or self.continued_warmup_steps < 0:
            raise ConfigError(f"DsaVsMlaConfig.continued_warmup_steps={self.continued_warmup_steps!r} is invalid: "
                              "must be an integer >= 0")
        if not self.indexer_learning_rate > 0:
            raise ConfigError(f"DsaVsMlaConfig.indexer_learning_rate={self.indexer_learning_rate!r} is invalid: must be > 0")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise ConfigError(f"DsaVsMlaConfig.seeds={self.seeds!r} is invalid: a non-empty tuple of distinct ints >= 0")
        if self.data.retrieval_fraction <= 0:
            raise ConfigError(f"DsaVsMlaConfig.data.retrieval_fraction={self.data.retrieval_fraction!r} is invalid: "
                              "must be > 0 (the retrieval records are what the arms are compared on)")
        md = self.data.min_distance(self.train.seq_len)
        if md < self.model.index_topk:
            raise ConfigError(f"DsaVsMlaConfig.data.retrieval_min_distance={md} is invalid: must be >= "
                              f"model.index_topk={self.model.index_topk}, so every probe's record lies beyond what a "
                              "local top-k window could cover and DSA must select it")


TINY = DsaVsMlaConfig(
    model=ModelConfig(vocab_size=2048, d_model=128, num_layers=2, num_heads=4, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, ffn_dim=384, num_experts=4,
                      moe_ffn_dim=128, first_k_dense=1, attention="dsa", index_topk=16, index_n_heads=2,
                      index_head_dim=32, mtp_depth=0, attn_chunk=128),
    train=TrainConfig(steps=150, batch_size=16, seq_len=128, learning_rate=1e-2, warmup_steps=50, min_lr_ratio=0.1,
                      eval_every=200, log_every=50, ckpt_every=200, eval_batches=4, seed=0),
    # MQAR-style records (B1, glm5_jax/data/retrieval.py): 16 one-token keys each directly followed by a 1-digit
    # value, all 16 restated at the end, so 16 supervised lookups per 128 tokens; T=128 halves the span the copy
    # head searches (top-k 16 = 1/8 of it, records > 24 tokens back). Earlier formats stayed at chance
    # (docs/experiments.md).
    data=DataConfig(vocab_size=2048, seq_len=128, seed=0, retrieval_fraction=0.9, retrieval_pairs=16,
                    retrieval_key_digits=2, retrieval_value_digits=1, retrieval_min_distance=24),
    pretrain_steps=1200, indexer_warmup_steps=30,
)
SMALL = dataclasses.replace(
    TINY,
    model=preset("small", vocab_size=32768, mtp_depth=0, index_topk=512),
    train=TINY.train.replace(steps=2000, batch_size=16, seq_len=4096, learning_rate=1e-3, eval_every=250,
                             log_every=125, ckpt_every=250, eval_batches=16),
    data=dataclasses.replace(TINY.data, vocab_size=32768, retrieval_fraction=0.25, retrieval_pairs=16,
                             retrieval_key_digits=3, retrieval_value_digits=3, retrieval_min_distance=1024),
    pretrain_steps=4000, indexer_warmup_steps=200, indexer_learning_rate=3e-3, test_probe_batches=32,
    mha_arm=True, seeds=(0, 1), bench_seq_len=32768)


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
    """{"scale": factor, "base" | "mla" | "dsa_warmup" | "dsa" | "mha": TrainConfig} of every phase
    (seed offset 0). scale = cfg.steps / train.steps (1 without --steps); every step count (phase
    lengths, schedule warm-ups, eval_every, log_every) is multiplied by it, rounded, at least 1 (a
    warm-up of 0 stays 0). base: train's schedule over its own steps (cosine to min_lr_ratio x peak);
    mla / dsa: the base's final rate, constant after a linear warm-up (no restart at the peak)."""
    tc = cfg.train
    f = cfg.steps / tc.steps if cfg.steps is not None else 1.0
    n = lambda k: max(1, int(round(k * f)))                      # noqa: E731
    w = lambda k: 0 if k == 0 else n(k)                          # noqa: E731
    common = dict(eval_every=n(tc.eval_every), log_every=n(tc.log_every))
    P, C, W = n(cfg.pretrain_steps), cfg.steps if cfg.steps is not None else tc.steps, n(cfg.indexer_warmup_steps)
    base = tc.replace(steps=P, warmup_steps=w(tc.warmup_steps), **common)
    final_lr = float(f"{float(lr_schedule(base)(P)):.6g}")      # where the base's schedule ended (float32: 6 digits)
    cont = tc.replace(steps=C, learning_rate=final_lr, warmup_steps=min(w(cfg.continued_warmup_steps), C),
                      min_lr_ratio=1.0, **common)
    plan = {"scale": f, "base": base, "mla": cont, "dsa": cont.replace(indexer_loss="sparse"),
            "dsa_warmup": tc.replace(steps=W, indexer_loss="dense", trainable_pattern="indexer",
                                     learning_rate=cfg.indexer_learning_rate, warmup_steps=min(5, W), eval_every=W,
                                     log_every=n(tc.log_every))}
    if cfg.mha_arm:
        plan["mha"] = base.replace(steps=P + C)
    return plan


def make_eval_fn(cfg: ModelConfig, lm_batches, ret_batches):
    """Eval during training (dev data only): LM loss on the dev LM batches, dev retrieval accuracy."""
    eval_step = make_eval_step(cfg)
    fwd = _forward(cfg)

    def eval_fn(params):
        out = evaluate(cfg, params, lm_batches, eval_step)
        accs = [retrieval_accuracy(np.asarray(fwd(params, _dev(b))), b) for b in ret_batches]
        out["retrieval_accuracy"] = float(np.mean(accs))
        return out

    return eval_fn


def _dev(b):
    return {k: jnp.asarray(v) for k, v in b.items()}


def _forward(cfg: ModelConfig):
    return jax.jit(lambda p, b: GLM5(cfg).apply({"params": p}, b["tokens"], b["positions"], b["segment_ids"])["logits"])


def _is_attention(mdl, method_name: str) -> bool:
    return method_name == "__call__" and isinstance(mdl, MLAttention)


def topk_indices_fn(cfg: ModelConfig):
    """jit fn(params, batch) -> {layer path: [B, T, K] top-k key indices the indexer selected}, one per
    DSA attention layer (a scanned stack gives [repeats, B, T, K] under one path; split here). Read
    with flax capture_intermediates: the attention module's outputs are (out, indices, cache)."""
    def f(p, b):
        _, st = GLM5(cfg).apply({"params": p}, b["tokens"], b["positions"], b["segment_ids"],
                                capture_intermediates=_is_attention, mutable=["intermediates"])
        flat = traverse_util.flatten_dict(st["intermediates"])
        return {"/".join(k[:-2]): v[0][1] for k, v in flat.items() if k[-1] == "__call__" and v[0][1] is not None}
    f = jax.jit(f)

    def g(params, batch):
        out = {}
        for path, idx in f(params, _dev(batch)).items():
            idx = np.asarray(idx)
            if idx.ndim == 4:                        # scanned stack: [repeats, B, T, K]
                for r in range(idx.shape[0]):
                    out[f"{path}[{r}]"] = idx[r]
            else:
                out[path] = idx
        return out
    return g


def answer_key_hits(indices: np.ndarray, infos, value_digits: int) -> np.ndarray:
    """[B] fraction of a probe's answer digits whose answer-bearing key (the planted record's value
    digit, the token the query must copy) is among the top-k keys selected at the position that
    predicts it. indices [B, T, K] (-1 = none); answer digit j is predicted at T - value_digits + j."""
    T = indices.shape[1]
    hits = np.zeros(len(infos))
    for b, info in enumerate(infos):
        for j in range(value_digits):
            hits[b] += float(np.any(indices[b, T - value_digits + j] == info.value_start + j))
    return hits / value_digits


def score_probes(cfg: ModelConfig, params, probes, value_digits: int) -> dict:
    """Per-probe correctness, distance and (DSA) per-layer answer-key recall on the given probes."""
    fwd = _forward(cfg)
    sel = topk_indices_fn(cfg) if cfg.attention == "dsa" else None
    correct, dist, hits = [], [], {}
    for batch, infos in probes:
        correct.append(retrieval_correct(np.asarray(fwd(params, _dev(batch))), batch))
        dist.append(np.array([i.distance for i in infos]))
        if sel is not None:
            for layer, idx in sel(params, batch).items():
                hits.setdefault(layer, []).append(answer_key_hits(idx, infos, value_digits))
    out = {"correct": np.concatenate(correct).astype(np.float64), "distance": np.concatenate(dist)}
    out["answer_key_recall"] = {k: np.concatenate(v) for k, v in hits.items()}
    return out


def indexer_recall(cfg: ModelConfig, params, batches) -> float:
    """Mean recall of the true (head-summed main attention) top-k keys by the indexer's top-k."""
    def f(p, b):
        _, st = GLM5(cfg).apply({"params": p}, b["tokens"], b["positions"], b["segment_ids"],
                                indexer_loss="dense", mutable=["intermediates"])
        flat = traverse_util.flatten_dict(st["intermediates"])
        # one value per layer; a scanned stack sows [repeats] values under one path
        return jnp.mean(jnp.concatenate([jnp.ravel(v[0]) for k, v in flat.items() if k[-1] == "indexer_recall"]))
    f = jax.jit(f)
    return float(np.mean([float(f(params, _dev(b))) for b in batches]))


def distance_curve(scores: list[dict], key, bins: np.ndarray) -> tuple[list, list]:
    """Mean of a per-probe quantity (pooled over seeds) in each distance bin -> (bin centres, means)."""
    d = np.concatenate([s["distance"] for s in scores])
    v = np.concatenate([key(s) for s in scores])
    xs, ys = [], []
    for lo, hi in zip(bins[:-1], bins[1:]):
        m = (d >= lo) & (d < hi)
        if m.any():
            xs.append(float((lo + hi) / 2))
            ys.append(float(v[m].mean()))
    return xs, ys


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


def run_seed(cfg: DsaVsMlaConfig, data, s: int, workdir: str, log, mesh, probes: dict, lm: dict) -> dict:
    """Every phase for one seed; returns the trained arms' runs, test scores and indexer figures."""
    cfgs = model_configs(cfg.model)
    seed = cfg.train.seed + s
    plan = {k: v.replace(seed=seed) for k, v in phase_plan(cfg).items() if k != "scale"}
    tc = plan["mla"]
    B, T = tc.batch_size, tc.seq_len
    it = lambda offset: data.train_iter(B, T, seed=cfg.data.seed + 1000 * s + offset)  # noqa: E731
    evals = {k: make_eval_fn(c, lm["dev"], probes["dev"]) for k, c in cfgs.items()}
    wd = lambda name: os.path.join(workdir, f"seed_{s}", name)  # noqa: E731
    tag = f"s{s}"
    runs = {}
    base = train(cfgs["mla"], plan["base"], it(0), wd("base"),
                 eval_fn=evals["mla"], log=log, name=f"base-mla-{tag}", mesh=mesh)
    runs["mla"] = train(cfgs["mla"], plan["mla"], it(1), wd("mla"), init_params=base["params"], eval_fn=evals["mla"],
                        log=log, name=f"mla-{tag}", mesh=mesh)
    dsa_init = graft(init_params(cfgs["dsa"], jax.random.PRNGKey(tc.seed + 7)), base["params"])
    warm = train(cfgs["dsa"], plan["dsa_warmup"], it(2), wd("dsa_warmup"), init_params=dsa_init, eval_fn=evals["dsa"],
                 log=log, name=f"dsa-warmup-{tag}", mesh=mesh)
    runs["dsa"] = train(cfgs["dsa"], plan["dsa"], it(1), wd("dsa"),
                        init_params=warm["params"], eval_fn=evals["dsa"], log=log, name=f"dsa-{tag}", mesh=mesh)
    if cfg.mha_arm:
        runs["mha"] = train(cfgs["mha"], plan["mha"], it(0), wd("mha"),
                            eval_fn=evals["mha"], log=log, name=f"mha-{tag}", mesh=mesh)
    log(f"[{tag}] scoring test probes ...")
    vd = cfg.data.retrieval_value_digits
    test = {name: score_probes(cfgs[name], r["params"], probes["test"], vd) for name, r in runs.items()}
    test_lm = {name: evaluate(cfgs[name], r["params"], lm["test"], make_eval_step(cfgs[name]))
               for name, r in runs.items()}
    warm_scores = score_probes(cfgs["dsa"], warm["params"], probes["test"], vd)
    return {"base": base, "runs": runs, "warm": warm, "test": test, "test_lm": test_lm,
            "answer_key_recall_after_warmup": {k: float(v.mean()) for k, v in warm_scores["answer_key_recall"].items()},
            "indexer_recall_after_warmup": indexer_recall(cfgs["dsa"], warm["params"], lm["dev"][:2]),
            "indexer_recall_final": indexer_recall(cfgs["dsa"], runs["dsa"]["params"], lm["dev"][:2])}


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


@register("dsa_vs_mla", "DSA added to a dense MLA model by continued pre-training vs continued MLA: long-range "
          "retrieval beyond the top-k, indexer recall of the answer-bearing key, eval loss",
          {"tiny": TINY, "small": SMALL})
def run(cfg: DsaVsMlaConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    data = build_lm_data(cfg.data)
    if data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"tokenizer vocab {data.tokenizer.vocab_size} != data.vocab_size {cfg.model.vocab_size}")
    cfgs = model_configs(cfg.model)
    plan = phase_plan(cfg)
    tc = plan["mla"]
    P, C, W = plan["base"].steps, tc.steps, plan["dsa_warmup"].steps
    B, T, K, vd = tc.batch_size, tc.seq_len, cfgs["dsa"].index_topk, cfg.data.retrieval_value_digits
    log(f"primary metric (named before the run): {PRIMARY_METRIC}")
    # LM: first half of the held-out batches = dev (watched in training), second half = test (scored once).
    lm_all = list(data.eval_batches(B, T, max_batches=2 * tc.eval_batches))
    half = len(lm_all) // 2
    if half < 1:
        raise ConfigError(f"the eval split gives {len(lm_all)} batches of {B}x{T}; need >= 2 for dev + test halves")
    lm = {"dev": lm_all[:half], "test": lm_all[half:]}
    task = data.retrieval_task("eval", T)
    probes = {"dev": list(retrieval_probe_batches(task, B, cfg.dev_probe_batches, cfg.data.seed, EVAL_TAG)),
              "test": list(retrieval_probe_batches(task, B, cfg.test_probe_batches, cfg.data.seed, TEST_TAG))}
    probes_dev_batches = [b for b, _ in probes["dev"]]
    seeds = {s: run_seed(cfg, data, s, workdir, log, mesh, {"dev": probes_dev_batches, "test": probes["test"]}, lm)
             for s in cfg.seeds}

    log("timing attention dense vs sparse ...")
    timing = {f"T={T}": time_attention(cfgs["mla"], cfgs["dsa"], T, B),
              f"T={cfg.bench_seq_len}": time_attention(cfgs["mla"], cfgs["dsa"], cfg.bench_seq_len, 1, reps=1)}

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
    # primary: paired over (seed, probe)
    pa = np.concatenate([r["test"]["dsa"]["correct"] for r in seeds.values()])
    pb = np.concatenate([r["test"]["mla"]["correct"] for r in seeds.values()])
    diff, dlo, dhi = paired_bootstrap_interval(pa, pb)
    gaps = [100.0 * (r["test_lm"]["dsa"]["eval_loss"] - r["test_lm"]["mla"]["eval_loss"]) / r["test_lm"]["mla"]["eval_loss"]
            for r in seeds.values()]
    gap = mean_interval(gaps)
    dists = np.concatenate([r["test"]["mla"]["distance"] for r in seeds.values()])
    # copying the value of a random one of the planted records is right when it is the queried one, or by chance
    P_, chance = cfg.data.retrieval_pairs, 10.0 ** -vd
    one_of_pairs = 1.0 / P_ + (1.0 - 1.0 / P_) * chance
    report = {"primary_metric": PRIMARY_METRIC, "arms": arms, "per_seed": per_seed, "seeds": list(cfg.seeds),
              "dsa_minus_mla_retrieval_accuracy": {"diff": diff, "lo": dlo, "hi": dhi},
              "dsa_vs_mla_gap_pct": gap["mean"], "dsa_vs_mla_gap_pct_interval": gap,
              "indexer_recall_after_warmup": float(np.mean([r["indexer_recall_after_warmup"] for r in seeds.values()])),
              "indexer_recall_final": float(np.mean([r["indexer_recall_final"] for r in seeds.values()])),
              "attention_time_s": timing, "seq_len": T, "index_topk": K, "tokens_per_step": B * T,
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
                title=f"dsa_vs_mla: dev eval loss through the phases (T={T}, top-k={K})",
                xlabel="training step (base, then each arm's phases in order)")
    lr = lambda k: np.asarray(lr_schedule(plan[k])(np.arange(plan[k].steps)), np.float64).tolist()  # noqa: E731
    lseries = {"base": (list(range(1, P + 1)), lr("base")),
               "mla continued": (list(range(P + 1, P + C + 1)), lr("mla")),
               "dsa warm-up (indexer only)": (list(range(P + 1, P + W + 1)), lr("dsa_warmup")),
               "dsa sparse": (list(range(P + W + 1, P + W + C + 1)), lr("dsa"))}
    plot_curves(os.path.join(workdir, "lr_schedule.png"), lseries, title="learning rate per update",
                xlabel="training step", ylabel="learning rate", logy=True)
    rx, ry = eval_series(first["base"]["history"], "retrieval_accuracy")
    mx, my = eval_series(first["runs"]["mla"]["history"], "retrieval_accuracy", offset=P)
    rseries = {"mla (base + continued)": (rx + mx, ry + my),
               "dsa": eval_series(first["runs"]["dsa"]["history"], "retrieval_accuracy", offset=P + W)}
    plot_curves(os.path.join(workdir, "retrieval_curve.png"), rseries, title="dev retrieval accuracy during training",
                xlabel="LM training step", ylabel="exact-match accuracy")
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

    cvb = report["continued_mla_vs_base_dev_loss"]
    scaled = f" Every phase scaled by --steps={cfg.steps}: x{plan['scale']:.4g} (phase_plan)." if cfg.steps else ""
    cvb_line = (f"Continued MLA ends {'at or below' if cvb['at_or_below'] else 'ABOVE'} its base's dev LM loss "
                f"{'in every seed' if cvb['at_or_below'] else 'in at least one seed'}: {cvb['base_dev_loss']:.4f} -> "
                f"{cvb['continued_mla_dev_loss']:.4f} (mean over seeds, change {cvb['diff']:+.4f}).")
    rows = [[n, acc_cell(n), loss_cell(n), arms[n]["final_eval_accuracy"], arms[n]["dev_retrieval_accuracy"]]
            for n in names]
    rec = arms["dsa"]["answer_key_recall"]
    rrows = [[layer, arms["dsa"]["answer_key_recall_after_warmup"][layer], v] for layer, v in rec.items()]
    trows = [[k, v["dense_mla"], v["sparse_dsa"], f"{v['dense_over_sparse']:.2f}x"] for k, v in timing.items()]
    iv_kind = ("95% t interval over seeds" if len(cfg.seeds) > 1
               else f"95% Wilson interval over the {n_probes} test probes (one seed)")
    md = f"""# dsa_vs_mla

**Primary metric (named before the run):** {PRIMARY_METRIC}.

**DSA - MLA test retrieval accuracy: {fmt_interval(diff, dlo, dhi)}** (paired bootstrap over seeds x probes).

Dense MLA pre-trained for {P} steps with retrieval records mixed into training from the first step
({cfg.data.retrieval_fraction:.0%} of sequences: {cfg.data.retrieval_pairs} planted records `K v` (a one-token letter key
of {len(task.key_ids)} directly followed by its {vd}-digit value), filler text, then
{task.n_queries} of them restated at the end, each a supervised lookup),
then continued {C} steps two ways: densely (**mla**) and as DSA (**dsa**: {W} indexer
warm-up steps with the base frozen, then {C} sparse-adaptation steps) with top-k = {K} of T = {T}.
{"**mha** is trained from scratch for " + str(P + C) + " steps. " if cfg.mha_arm else ""}{B * T} tokens per step;
seeds {list(cfg.seeds)}.

Test probes: {n_probes} per seed (TEST_TAG, filler from held-out files, never used to choose settings), laid out
as the training sequences; the last query is scored, its record ends {report['probe_distance_range'][0]}-{report['probe_distance_range'][1]} tokens
earlier (all > top-k = {K}); exact match of the {vd}-digit value. Chance {chance:.3g}; copying a random
one of the {cfg.data.retrieval_pairs} planted values {one_of_pairs:.3g}. Test LM loss: {len(lm['test'])}
held-out batches not used during training (dev: {len(lm['dev'])} other batches and {len(probes['dev']) * B} dev probes).

{md_table(["arm", "test retrieval acc. (" + iv_kind + ")", "test LM loss", "test token acc.", "dev retrieval acc."], rows)}

DSA vs MLA test LM-loss gap: **{fmt_interval(gap['mean'], gap['lo'], gap['hi'], 2)} %** of MLA's (negative = DSA lower).

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

## Indexer recall

Answer-key recall: the fraction of test probes whose answer-bearing key (the planted value token the
query must copy) is among the top-{K} keys the layer's indexer selects at the predicting position.

{md_table(["DSA layer", "after warm-up", "after sparse adaptation"], rrows)}

Recall of the true attention top-{K} (head-summed dense attention, dev LM batches):
{report['indexer_recall_after_warmup']:.3f} after warm-up, {report['indexer_recall_final']:.3f} after sparse adaptation.

![retrieval vs distance](retrieval_vs_distance.png)

![dev retrieval during training](retrieval_curve.png)

![indexer warm-up](indexer_warmup.png)

## Attention time per step (one layer, forward + backward, CPU)

{md_table(["shape", "dense MLA s", "DSA (indexer + sparse) s", "dense / sparse"], trows)}

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
