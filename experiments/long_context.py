"""long_context: extend a short-context MLA model in stages (RoPE base raised), add DSA; what is kept at long range?

Phases (glm5_jax.train.stages; each stage its own resumable folder):
  base            MLA at T = train.seq_len (128), RoPE base model.rope_theta (theta0); passkeys in the mix
  mla             base -> ext_seq_lens[0] (1024) -> ext_seq_lens[1] (4096), the RoPE adjusted per stage
                  (rope_adjust "theta": base raised to ext_rope_thetas; "yarn": theta0 with YaRN scaling)
  mla_no_adjust   the same stages, data and schedule with the RoPE unchanged (the control)
  dsa             the mla arm's stages continued at the last length: indexer warm-up (base frozen, dense KL), then
                  sparse adaptation; it branches from the mla arm's extended params (its stages run in the mla arm's
                  folder after the mla stages), so it has trained dsa_warmup_steps + dsa_steps more steps than mla
  dsa_long        (issue 45) the same warm-up's params adapted sparsely for max(dsa_adaptation_lengths) steps at
                  dsa_learning_rate held constant after its warm-up (so the state at step n is an n-step run), a
                  checkpoint kept at every length: the DSA gap against adaptation length from one run, beside the
                  oracle top-k gap (the same params selecting by the main attention's own scores) and the
                  attention mass the indexer's / the oracle's keys carry (glm5_jax.eval.selection)
Then: held-out loss per position bucket at T = the last length before extension (the base model) and
after each arm's last stage, with bootstrap intervals over held-out windows; a passkey probe by context
length and key depth (and for dsa the indexer's recall of the key's value tokens); attention time and
FLOPs of DSA vs dense MLA per stage length; step time per stage.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import ClassVar

from experiments.registry import register
from experiments.report import md_table, plot_curves, plot_heatmap, write_report
from glm5_jax.intervals import fmt_interval
from glm5_jax.eval.selection import mass_beyond
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.eval.dsa import as_oracle
from glm5_jax.eval.long_context import (adaptation_bucket_rows, adaptation_entry, attention_cost, attention_cost_rows,
                                        bucket_differences, checkpoint_evaluations, cut_buckets, passkey_rows,
                                        position_loss, position_loss_figures)
from glm5_jax.eval.metrics import attention_mass
from glm5_jax.eval.probes import passkey_probes, score_passkey
from glm5_jax.eval.stats import beyond_difference, bucket_means_interval
from glm5_jax.flops import relative_cost
from glm5_jax.train import Stage, TrainConfig, train_stages
from glm5_jax.train.stages import (Invocation, PhaseProgress, StepTimes, cached_json, describe_invocations, stage_plan,
                                   stage_summaries)

PRIMARY_METRIC = ("held-out LM loss over positions >= 128 (token mean, at T = the last stage length) after the "
                  "extension stages minus before them (the base model), per arm, with a paired bootstrap interval "
                  "over held-out windows; secondary: the dsa - mla difference of that loss after the last stage")
BUCKETS = ((0, 128), (128, 512), (512, 1024), (1024, 2048), (2048, 4096))
ROPE_ADJUST = ("theta", "yarn")


@dataclasses.dataclass(frozen=True)
class LongContextConfig:
    """model: the MLA model of the base stage (attention "mla"; rope_theta = theta0; the index_* fields are the indexer
    the dsa arm adds). train: the base stage (train.seq_len, train.steps, schedule) and what every stage shares. data:
    the corpus and the passkeys mixed into training from the first step (retrieval_pairs = 1: one planted key and value,
    asked for at the end). ext_*: the extension stages, one entry per stage (lengths, steps, batch sizes, the raised
    RoPE bases). dsa_*: the two DSA stages at the last length; dsa_adaptation_lengths: the sparse-adaptation lengths of
    the dsa_long run (one run, evaluated at each; ~3 s per step at T=4096 on 2 CPU cores); mass_windows: held-out
    windows for the attention-mass figures. Evaluation: eval_windows held-out windows at the last length (the eval
    split, never trained on, nothing tuned on it); passkey probes (held-out filler, TEST_TAG) at passkey_lengths x
    passkey_depths, passkey_per_cell each."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    ext_seq_lens: tuple[int, ...] = (1024, 4096)
    ext_steps: tuple[int, ...] = (60, 40)
    ext_batch_sizes: tuple[int, ...] = (2, 1)
    ext_rope_thetas: tuple[float, ...] = (1e5, 1e6)     # rope_adjust "theta": the base per extension stage
    rope_adjust: str = "theta"                          # theta | yarn (theta0 kept, YaRN factor T / train.seq_len)
    ext_learning_rate: float = 1e-3
    ext_warmup_steps: int = 5
    dsa_warmup_steps: int = 6
    dsa_warmup_learning_rate: float = 1e-2
    dsa_steps: int = 15
    dsa_learning_rate: float = 5e-4
    dsa_adaptation_lengths: tuple[int, ...] = (15, 60, 180)
    mass_windows: int = 8
    eval_windows: int = 32
    eval_batch: int = 2
    passkey_lengths: tuple[int, ...] = (128, 1024, 4096)
    passkey_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    passkey_per_cell: int = 4
    bench_lengths: tuple[int, ...] = (128, 1024, 4096)
    bootstrap_reps: int = 2000

    STEPS_KEY: ClassVar[str] = "train.steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "data.vocab_size", "data.seq_len": "train.seq_len"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=self.data.vocab_size))
        object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=self.train.seq_len))
        bad = lambda f, allowed: ConfigError(
            f"LongContextConfig.{f}={getattr(self, f)!r} is invalid: {allowed}")
        if self.model.attention != "mla":
            raise bad("model", "model.attention must be 'mla' (the dsa arm adds the indexer by continued pre-training)")
        if self.model.indexer_types is not None:
            raise bad("model",
                      "model.indexer_types must be None (every layer 'full'), so the MLA stacks graft onto DSA")
        n = len(self.ext_seq_lens)
        if n < 1 or len(self.ext_steps) != n or len(self.ext_batch_sizes) != n or len(self.ext_rope_thetas) != n:
            raise bad("ext_seq_lens", "ext_seq_lens, ext_steps, ext_batch_sizes and ext_rope_thetas need one "
                      "entry per extension stage (>= 1)")
        lens = (self.train.seq_len,) + tuple(self.ext_seq_lens)
        if any(b <= a for a, b in zip(lens, lens[1:])):
            raise bad("ext_seq_lens", f"lengths must grow from train.seq_len={self.train.seq_len}")
        for f in ("ext_steps", "ext_batch_sizes"):
            if any(not isinstance(v, int) or v < 1 for v in getattr(self, f)):
                raise bad(f, "integers >= 1")
        if any(t <= 0 for t in self.ext_rope_thetas):
            raise bad("ext_rope_thetas", "bases > 0")
        if self.rope_adjust not in ROPE_ADJUST:
            raise bad("rope_adjust", f"allowed: {', '.join(ROPE_ADJUST)}")
        lens_a = self.dsa_adaptation_lengths
        if (len(lens_a) < 1 or any(not isinstance(v, int) or v < 1 for v in lens_a)
                or any(b <= a for a, b in zip(lens_a, lens_a[1:]))):
            raise bad("dsa_adaptation_lengths",
                      "increasing integers >= 1 (sparse-adaptation steps evaluated in one run)")
        for f in ("dsa_warmup_steps", "dsa_steps", "eval_windows", "eval_batch", "passkey_per_cell",
                  "bootstrap_reps", "ext_warmup_steps", "mass_windows"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < (0 if f == "ext_warmup_steps" else 1):
                raise bad(f, "an integer >= 1")
        for f in ("ext_learning_rate", "dsa_warmup_learning_rate", "dsa_learning_rate"):
            if not getattr(self, f) > 0:
                raise bad(f, "must be > 0")
        if not self.passkey_lengths or any(L < 16 or L > self.last_len for L in self.passkey_lengths):
            raise bad("passkey_lengths", f"lengths in [16, the last stage length {self.last_len}]")
        if not self.passkey_depths or any(not 0.0 <= d <= 1.0 for d in self.passkey_depths):
            raise bad("passkey_depths", "depths in [0, 1] (the key's place as a fraction of the filler before it)")
        if any(L < 8 for L in self.bench_lengths):
            raise bad("bench_lengths", "lengths >= 8")
        d = self.data
        if d.retrieval_fraction <= 0 or d.retrieval_pairs != 1 or (d.retrieval_min_distance or 0) != 0:
            raise ConfigError("LongContextConfig.data: the passkey mix needs retrieval_fraction > 0, retrieval_pairs=1 "
                              f"and retrieval_min_distance=0 (got {d.retrieval_fraction}, {d.retrieval_pairs}, "
                              f"{d.retrieval_min_distance})")

    @property
    def last_len(self) -> int:
        return self.ext_seq_lens[-1]

    @property
    def buckets(self) -> tuple[tuple[int, int], ...]:
        """BUCKETS cut at the last length (every position of a window is in one bucket), with a boundary at
        the base length train.seq_len (the primary metric's 'beyond the base length')."""
        return cut_buckets(BUCKETS, self.train.seq_len, self.last_len)


# A tiny MLA model (the tiny preset, dense FFN, no MTP) sized so base + two arms x two extension stages + the
# DSA stages + the evaluations fit 20 minutes on 2 CPU cores. 52 one-token keys, 3-digit values.
TINY = LongContextConfig(
    model=preset("tiny", vocab_size=2048, d_model=64, num_layers=2, ffn_dim=192, num_experts=0, mtp_depth=0,
                 attention="mla", num_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=16, v_head_dim=16, index_topk=256, index_n_heads=2, index_head_dim=32,
                 rope_theta=1e4, attn_chunk=256),
    train=TrainConfig(steps=500, batch_size=16, seq_len=128, learning_rate=3e-3, warmup_steps=30, min_lr_ratio=0.1,
                      eval_every=100000, log_every=50, ckpt_every=100, eval_batches=1, seed=0),
    data=DataConfig(vocab_size=2048, seq_len=128, seed=0, eval_fraction=0.1, retrieval_fraction=0.5,
                    retrieval_pairs=1, retrieval_key_digits=2, retrieval_value_digits=3, retrieval_min_distance=0),
)
SMALL = dataclasses.replace(
    TINY,
    model=preset("small", vocab_size=32768, mtp_depth=0, attention="mla", index_topk=2048, rope_theta=1e4),
    train=TINY.train.replace(steps=4000, batch_size=64, seq_len=4096, learning_rate=1e-3, warmup_steps=200,
                             log_every=100, ckpt_every=500),
    data=dataclasses.replace(TINY.data, vocab_size=32768, retrieval_fraction=0.2),
    ext_seq_lens=(32768, 131072), ext_steps=(1000, 500), ext_batch_sizes=(8, 2), ext_rope_thetas=(1e5, 1e6),
    ext_learning_rate=3e-4, ext_warmup_steps=50, dsa_warmup_steps=100, dsa_warmup_learning_rate=1e-3, dsa_steps=500,
    dsa_learning_rate=3e-4, eval_windows=16, eval_batch=1, passkey_lengths=(4096, 32768, 131072), passkey_per_cell=8,
    bench_lengths=(4096, 32768, 131072))


# ---- stages ----------------------------------------------------------------------------------------------

def rope_override(cfg: LongContextConfig, i: int) -> dict:
    """The RoPE settings of extension stage i of the adjusted arm."""
    if cfg.rope_adjust == "theta":
        return {"rope_theta": float(cfg.ext_rope_thetas[i])}
    T0 = cfg.train.seq_len
    return {"rope_scaling": {"type": "yarn", "factor": cfg.ext_seq_lens[i] / T0,
                             "original_max_position_embeddings": T0}}


def base_stage(cfg: LongContextConfig) -> Stage:
    return Stage("base", seq_len=cfg.train.seq_len, steps=cfg.train.steps)


def extension_stages(cfg: LongContextConfig, adjust: bool) -> list[Stage]:
    return [Stage(f"ext{T}", seq_len=T, steps=s, learning_rate=cfg.ext_learning_rate,
                  warmup_steps=cfg.ext_warmup_steps, model=rope_override(cfg, i) if adjust else {},
                  train={"batch_size": B})
            for i, (T, s, B) in enumerate(zip(cfg.ext_seq_lens, cfg.ext_steps, cfg.ext_batch_sizes))]


def dsa_stages(cfg: LongContextConfig) -> list[Stage]:
    T, B = cfg.last_len, cfg.ext_batch_sizes[-1]
    return [Stage("dsa_warmup", seq_len=T, steps=cfg.dsa_warmup_steps, learning_rate=cfg.dsa_warmup_learning_rate,
                  warmup_steps=min(2, cfg.dsa_warmup_steps), model={"attention": "dsa"},
                  train={"indexer_loss": "dense", "trainable_pattern": "indexer", "batch_size": B}),
            Stage("dsa", seq_len=T, steps=cfg.dsa_steps, learning_rate=cfg.dsa_learning_rate,
                  warmup_steps=min(cfg.ext_warmup_steps, cfg.dsa_steps),
                  train={"indexer_loss": "sparse", "batch_size": B})]


def dsa_long_stages(cfg: LongContextConfig) -> list[Stage]:
    """The dsa_long run (issue 45): the dsa arm's warm-up stage, then one sparse adaptation of
    max(dsa_adaptation_lengths) steps at dsa_learning_rate, constant after its warm-up (min_lr_ratio 1), with a
    checkpoint kept at every multiple of the lengths' gcd (so at every length)."""
    T, B = cfg.last_len, cfg.ext_batch_sizes[-1]
    lens = cfg.dsa_adaptation_lengths
    g = functools.reduce(math.gcd, lens)
    return [dsa_stages(cfg)[0],
            Stage("dsa_long", seq_len=T, steps=lens[-1], learning_rate=cfg.dsa_learning_rate,
                  warmup_steps=min(cfg.ext_warmup_steps, lens[0]), min_lr_ratio=1.0,
                  train={"indexer_loss": "sparse", "batch_size": B, "ckpt_every": g, "keep_period": g})]


@register("long_context", "context extension in stages (T=128 -> 1024 -> 4096, RoPE base raised vs unchanged), "
          "then DSA added at the last length: held-out loss by position, passkey by length and depth, indexer recall",
          {"tiny": TINY, "small": SMALL})
def run(cfg: LongContextConfig, workdir: str, log, mesh=None) -> dict:
    invocation = Invocation()                   # wall time, load average, every invocation on this workdir
    log(f"primary metric (named before the run): {PRIMARY_METRIC}")
    data = build_lm_data(cfg.data)
    if data.tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"tokenizer vocab {data.tokenizer.vocab_size} != data.vocab_size {cfg.model.vocab_size}")
    tc, T0, TL, reps, buckets = cfg.train, cfg.train.seq_len, cfg.last_len, cfg.bootstrap_reps, cfg.buckets
    far = [j for j, (lo, _) in enumerate(buckets) if lo >= T0]
    step_times = StepTimes()                    # each stage's step times, through a hook

    def make_iter(stage, i):
        return data.train_iter(dict(stage.train).get("batch_size", tc.batch_size), stage.seq_len,
                               seed=cfg.data.seed + 100 * i)
    stages = lambda arm, chain, wd, **kw: train_stages(
        kw.pop("model", None) or base["model_cfg"], tc, chain, make_iter, os.path.join(workdir, wd), mesh=mesh, log=log,
        hooks_for_stage=step_times.hooks(arm), **kw)

    ext = sum(relative_cost(s, B, T) for s, B, T in zip(cfg.ext_steps, cfg.ext_batch_sizes, cfg.ext_seq_lens))
    w = {"base": relative_cost(tc.steps, tc.batch_size, T0), "mla": ext, "mla_no_adjust": ext,
         "dsa": relative_cost(6 * cfg.dsa_warmup_steps + 3 * cfg.dsa_steps, cfg.ext_batch_sizes[-1], TL),
         "dsa_long": relative_cost(3 * cfg.dsa_adaptation_lengths[-1], cfg.ext_batch_sizes[-1], TL),
         "evaluation": 2.0 * ext}                     # weights as measured at the tiny defaults
    prog = PhaseProgress(log, w, "long_context", invocation.t_start)
    base = stages("base", [base_stage(cfg)], "base", model=cfg.model)
    prog.finished("base")
    ext_adj, ext_none = extension_stages(cfg, True), extension_stages(cfg, False)
    # the base stage's params start each arm; its folder is shared, so the arms' stages are numbered from 0
    runs = {"mla": stages("mla", ext_adj, "mla", init_params=base["params"])}
    prog.finished("mla")
    runs["mla_no_adjust"] = stages("mla_no_adjust", ext_none, "mla_no_adjust", init_params=base["params"])
    prog.finished("mla_no_adjust")
    # dsa: the mla arm's stages (already done: skipped, its final params read back) + the two DSA stages
    runs["dsa"] = stages("mla", ext_adj + dsa_stages(cfg), "mla", init_params=base["params"])
    prog.finished("dsa")
    # dsa_long (issue 45): after the same warm-up (done: skipped), one longer sparse adaptation, checkpoints kept
    runs_long = stages("mla", ext_adj + dsa_long_stages(cfg), "mla", init_params=base["params"])
    prog.finished("dsa_long")

    log("[long_context] evaluating: held-out loss by position, passkey probes ...")
    eval_batches = list(data.eval_batches(cfg.eval_batch, TL, max_batches=-(-cfg.eval_windows // cfg.eval_batch)))
    d = cfg.data
    pk = dict(lengths=cfg.passkey_lengths, depths=cfg.passkey_depths, per_cell=cfg.passkey_per_cell)
    pk_batches, placements = passkey_probes(data.tokenizer, data.eval_stream.stream, **pk, window=TL,
                                            batch_size=cfg.eval_batch, key_digits=d.retrieval_key_digits,
                                            value_digits=d.retrieval_value_digits, seed=d.seed)
    # an evaluation is reused only by a rerun of the same settings (the whole config) on the same tokens
    ekey = {"config": dataclasses.asdict(cfg), "data": data.data_key}
    pos_eval = functools.partial(position_loss, workdir, key=ekey, batches=eval_batches, buckets=buckets)
    models = {"base": (base["model_cfg"], base["params"]),
              **{a: (r["model_cfg"], r["params"]) for a, r in runs.items()}}
    pos, passkey = {}, {}
    for name, (m, p) in models.items():
        pos[name] = pos_eval(name, m, p)
        passkey[name] = cached_json(workdir, f"passkey-{name}", ekey, lambda m=m, p=p: score_passkey(
            m, p, pk_batches, placements, **pk, value_digits=d.retrieval_value_digits))

    # ---- issue 45: the DSA gap against sparse-adaptation length, with oracle top-k and the attention mass
    log("[long_context] dsa_long: gap vs adaptation length, oracle top-k, attention mass ...")
    long_cfg = runs_long["model_cfg"]
    mass_batches = eval_batches[:max(1, -(-cfg.mass_windows // cfg.eval_batch))]
    oracle_cfg, mla_oracle_params = as_oracle(long_cfg, long_cfg.index_topk, runs["mla"]["params"])
    pos["mla_oracle"] = pos_eval("mla_oracle", oracle_cfg, mla_oracle_params)
    mass_mla_oracle = cached_json(workdir, "mass-mla_oracle", ekey,
                                  lambda: attention_mass(oracle_cfg, mla_oracle_params, mass_batches, buckets))
    long_evals = checkpoint_evaluations(workdir, "dsa_long", long_cfg, runs_long["stages"][-1],
                                        cfg.dsa_adaptation_lengths, key=ekey, batches=eval_batches,
                                        mass_batches=mass_batches, buckets=buckets, mesh=mesh)

    log("[long_context] timing attention dense vs DSA per stage length ...")
    mla_cfg, dsa_cfg = runs["mla"]["model_cfg"].replace(attention="mla"), runs["dsa"]["model_cfg"]
    timing, flops = attention_cost(workdir, mla_cfg, dsa_cfg, cfg.bench_lengths)
    prog.finished("evaluation")

    recorded = step_times.record(workdir)       # step time per stage (this run's, else an earlier one's)
    gap = lambda a, b: beyond_difference(a, b, far, reps)
    arms, before = {}, pos["base"]
    for arm in runs:
        arms[arm] = {"position_loss": position_loss_figures(before, pos[arm], buckets, reps),
                     "beyond_base_after_minus_before": gap(pos[arm], before), "passkey": passkey[arm],
                     "stages": stage_summaries(runs[arm]["stages"], recorded, "mla" if arm == "dsa" else arm)}
    mla_means = bucket_means_interval(*pos["mla"], reps)["mean"]
    dsa = arms["dsa"]
    dsa["gap_vs_adaptation"] = [adaptation_entry(L, pd, po, m, pos["mla"], mla_means, far, T0, reps)
                                for L, (pd, po, m) in long_evals.items()]
    dsa.update(mla_oracle_gap=gap(pos["mla_oracle"], pos["mla"]), adaptation_learning_rate=cfg.dsa_learning_rate,
               mla_oracle_gap_by_bucket=bucket_differences(pos["mla_oracle"], mla_means, reps),
               mla_oracle_mass=mass_beyond(mass_mla_oracle, T0)["oracle_mass"],
               mla_oracle_mass_by_bucket=mass_mla_oracle["mean"]["oracle_mass"],
               mass_windows=int(sum(len(b["tokens"]) for b in mass_batches)))
    report = {"primary_metric": PRIMARY_METRIC, "arms": arms, "buckets": [list(b) for b in buckets],
              "base": {"passkey": passkey["base"], "position_loss": bucket_means_interval(*before, reps)["mean"],
                       "final_train_loss": base["stages"][0]["history"][-1]["loss"],
                       "step_time_s": recorded.get("base/base", {}).get("median_s")},
              "dsa_minus_mla_beyond_base": gap(pos["dsa"], pos["mla"]),
              "mla_minus_no_adjust_beyond_base": gap(pos["mla"], pos["mla_no_adjust"]),
              "attention_time_s": timing, "attention_flops": flops, "step_time_s": recorded,
              "eval_windows": int(len(before[0])), "eval_tokens_per_bucket": [int(x) for x in before[1].sum(0)],
              "index_topk": dsa_cfg.index_topk, "rope_adjust": cfg.rope_adjust, "dsa_branches_from_mla": True}

    # plots
    mids = [(lo + hi) / 2 for lo, hi in buckets]
    for arm, a in arms.items():
        pl = a["position_loss"]
        plot_curves(os.path.join(workdir, f"position_loss_{arm}.png"),
                    {"before (base, T=%d)" % T0: (mids, pl["before"]), f"after ({arm})": (mids, pl["after"])},
                    title=f"long_context {arm}: held-out loss by position (eval at T={TL})",
                    xlabel="position in the document (bucket centre)", ylabel="loss")
    names = ["base"] + list(runs)
    grid = dict(rows=[str(L) for L in cfg.passkey_lengths], cols=[f"{d:.2f}" for d in cfg.passkey_depths],
                xlabel="key depth", ylabel="context length")
    plot_heatmap(os.path.join(workdir, "passkey.png"), {n: passkey[n]["accuracy"] for n in names},
                 title="passkey accuracy by context length and key depth", **grid)
    if "indexer_key_recall" in passkey["dsa"]:
        plot_heatmap(os.path.join(workdir, "passkey_indexer_recall.png"), passkey["dsa"]["indexer_key_recall"],
                     title=f"dsa: indexer recall of the key's value tokens (top-{dsa_cfg.index_topk})", **grid)
    invocation.finish(workdir, report, step_times.trained())
    write_report(workdir, report, _markdown(cfg, report, arms, passkey, names, buckets, timing, flops, recorded))
    return report


def _markdown(cfg, report, arms, passkey, names, buckets, timing, flops, recorded) -> str:
    T0, TL = cfg.train.seq_len, cfg.last_len
    ci = lambda m, lo, hi: "n/a" if m is None else fmt_interval(m, lo, hi)
    di = lambda x: fmt_interval(x["diff"], x["lo"], x["hi"])
    prow = [[f"{arm} {when}"] + [ci(m, lo, hi) for m, lo, hi in zip(pl[when], *pl[f"{when}_interval"])]
            for arm, pl in ((arm, a["position_loss"]) for arm, a in arms.items()) for when in ("before", "after")]
    primary = [[arm, di(a["beyond_base_after_minus_before"]), a["beyond_base_after_minus_before"]["b"],
                a["beyond_base_after_minus_before"]["a"]] for arm, a in arms.items()]
    rec = passkey["dsa"].get("indexer_key_recall_by_length", {})
    rrow = [[layer] + [f"{x:.2f}" for x in v] for layer, v in rec.items()]
    srow = [[n, v["median_s"], v["steps_timed"]] for n, v in recorded.items()]
    dsa, gva = arms["dsa"], arms["dsa"]["gap_vs_adaptation"]
    return f"""# long_context

**Primary metric (named before the run):** {PRIMARY_METRIC}.

Base: MLA at T={T0} for {cfg.train.steps} steps x B={cfg.train.batch_size} (RoPE theta {cfg.model.rope_theta:g}),
passkeys ({cfg.data.retrieval_fraction:.0%} of training sequences: one key letter +
{cfg.data.retrieval_value_digits}-digit value planted in text, asked for at the end) in the mix from the first step.
Stages of the mla / dsa arms: {stage_plan(dsa["stages"])}.
mla_no_adjust: the same extension stages with the RoPE unchanged. dsa branches from the mla arm's extended params.
Held-out: {report['eval_windows']} windows of T={TL} from the eval split (files never trained on; nothing tuned on
them); "before" = the base model (the same for every arm). Intervals: 95% bootstrap over windows.

## Primary: loss over positions >= {T0}, after - before

{md_table(["arm", "after - before [95% CI]", "before", "after"], primary)}

DSA - MLA after the last stage (positions >= {T0}): **{di(report["dsa_minus_mla_beyond_base"])}**;
mla - mla_no_adjust (the RoPE adjustment's effect): **{di(report["mla_minus_no_adjust_beyond_base"])}**.

## Where the DSA gap comes from: against sparse-adaptation length, oracle top-k, attention mass

One sparse adaptation (dsa_long: after the dsa arm's warm-up, lr {cfg.dsa_learning_rate:g} constant after
{min(cfg.ext_warmup_steps, cfg.dsa_adaptation_lengths[0])} warm-up steps) evaluated at
{list(cfg.dsa_adaptation_lengths)} steps.
Gap: DSA - MLA over positions >= {T0} (95% paired bootstrap over windows); oracle gap: the same DSA params
with oracle top-k (each query's {report['index_topk']} keys = the top-k of its own head-averaged dense attention)
instead of the indexer. Mass: head-averaged dense softmax mass on the selected keys over positions >= {T0}
(mean over layers, {dsa['mass_windows']} windows). Continued MLA with oracle top-k (no adaptation):
gap {di(dsa['mla_oracle_gap'])}, oracle mass {dsa['mla_oracle_mass']:.3f}.

{md_table(["sparse steps", "gap (indexer) [95% CI]", "oracle gap [95% CI]", "indexer mass", "oracle mass",
           "indexer recall of oracle keys"],
          [[e["sparse_steps"], di(e["gap"]), di(e["oracle_gap"]), e["indexer_mass"], e["oracle_mass"],
            e["indexer_recall_of_oracle"]] for e in gva])}

Per position bucket (gap = DSA - MLA loss; mass mean over layers):

{md_table(["sparse steps", "figure"] + [f"[{lo},{hi})" for lo, hi in buckets], adaptation_bucket_rows(gva))}

## Held-out loss per position bucket (eval at T={TL})

{md_table(["arm"] + [f"[{lo},{hi})" for lo, hi in buckets], prow)}

Tokens per bucket: {report['eval_tokens_per_bucket']}.

## Passkey accuracy by context length (all depths; heatmap: passkey.png)

{md_table(["model"] + [f"acc. L={L}" for L in cfg.passkey_lengths] + ["acc. overall"]
         + [f"value-digit loss L={L}" for L in cfg.passkey_lengths], passkey_rows({n: passkey[n] for n in names}))}

{cfg.passkey_per_cell} probes per (length, depth) cell, depths {list(cfg.passkey_depths)}; chance
{10.0 ** -cfg.data.retrieval_value_digits:g} (exact match of the value). Value-digit loss: the mean loss on the
value's digits; a uniform guess among the 10 digits is ln 10 = 2.303.

DSA indexer recall of the key's value tokens (the planted digits among the top-{report['index_topk']} keys at the
positions that predict them), by length:

{md_table(["layer"] + [f"L={L}" for L in cfg.passkey_lengths], rrow)}

## Attention time (one layer, forward + backward, CPU) and FLOPs per token (forward)

{md_table(["shape", "dense MLA s", "DSA (indexer + sparse) s", "dense / DSA", "dense FLOPs", "DSA FLOPs"],
          attention_cost_rows(timing, flops))}

## Step time per stage (median)

{md_table(["stage", "s / step", "steps timed"], srow)}

{describe_invocations(report)}

{"".join(f"![{a}](position_loss_{a}.png)" + chr(10) + chr(10) for a in arms)}![passkey](passkey.png)
"""


__all__ = ["BUCKETS", "LongContextConfig", "PRIMARY_METRIC", "base_stage", "dsa_stages", "extension_stages"]
