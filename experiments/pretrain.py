"""pretrain: train the chosen preset from scratch on any dataset, and measure held-out loss.

    python -m experiments.run --config=pretrain [--preset tiny|small]
        [--set data.path='corpus/*.jsonl.gz'] [--set data.tokenizer=glm5/tokenizer.json --set data.vocab_size=154880]

Data: `data.path` is a glob / file / directory / comma list of text, jsonl(.gz), parquet or ArrayRecord
files, or a directory written by `python -m tools.prepare_data` (glm5_jax.data). `data.tokenizer`: "hf"
(the default here: a byte-level BPE tokenizer.json trained on the train split with the `tokenizers`
library), none / "spm" (sentencepiece trained here), or a tokenizer path. `data.vocab_size` is the
model's vocabulary (model.vocab_size follows it): a loaded tokenizer must not be larger.
`data.sources` mixes several (`--set data.sources=web=corpus/web:0.6,code=data/prep:0.4`, docs/data.md).
With neither `data.path` nor `data.sources`: `default_data` says what to use. "docs+code" (default) is a
two-source mixture written into WORKDIR/data: `docs`, the docstrings of the running Python's standard
library (one document per module; glm5_jax.data.stdlib_text), and `code`, the same modules' code with
their docstrings removed (glm5_jax.data.stdlib_code; so no held-out docstring is trained on as code), weights
0.5 / 0.5. "docstrings" trains on the docstrings alone; "stdlib_py" on the stdlib *.py sources.

Annealing (a mixture with `anneal_mix` set and `anneal_fraction` > 0): the run is two stages of the one
loop (glm5_jax.train.stages): `main` (train.steps minus the anneal steps; warmup, then the LR held at
its peak: lr_schedule wsd with decay_fraction 0) and `anneal` (the last round(anneal_fraction *
train.steps) steps on the `anneal_mix` re-weighting of the sources, e.g. "docs:0.9,code:0.1": a short
re-warmup of the fresh optimizer, then the LR decays linearly to min_lr_ratio x peak). Otherwise one
stage with train.lr_schedule as set. Held-out loss is reported per source and over all of them.

Primary metric, named before any run: final_eval_loss, the token-mean next-token loss on held-out
documents of the same data (DataConfig.eval_fraction by document-key hash; never trained on; for a
mixture train.eval_batches batches of each source's held-out documents), against initial_eval_loss (the
same batches, at the initial parameters). Nothing here is tuned on that split.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import ClassVar, Optional

import jax

from experiments.registry import register
from experiments.report import chain_series, md_table, plot_curves, write_report
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.data.config import parse_mix
from glm5_jax.data.stdlib_code import write_stdlib_code
from glm5_jax.data.stdlib_text import write_stdlib_docs
from glm5_jax.train import Stage, TrainConfig, evaluate, train, train_stages
from glm5_jax.train.step import make_eval_step

DEFAULT_DATA = ("docs+code", "docstrings", "stdlib_py")
DEFAULT_MIX = (("docs", 0.5), ("code", 0.5))


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """model: the preset trained (model.vocab_size follows data.vocab_size); train: the run (train.steps
    is the step count of all stages, train.eval_batches the held-out batches of each source); data: what
    it reads (data.seq_len follows train.seq_len); default_data: the corpus when data.path and
    data.sources are unset ("docs+code", "docstrings" or "stdlib_py"); anneal_fraction: the share of
    train.steps in the annealing stage (0: none); anneal_mix: that stage's re-weighting of the sources
    (`NAME:WEIGHT,...`; none: no annealing stage); anneal_warmup_steps: its re-warmup (at most half of it)."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    default_data: str = "docs+code"
    anneal_fraction: float = 0.2
    anneal_mix: Optional[str] = "docs:0.9,code:0.1"
    anneal_warmup_steps: int = 10

    STEPS_KEY: ClassVar[str] = "train.steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "data.vocab_size", "data.seq_len": "train.seq_len"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=self.data.vocab_size))
        object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=self.train.seq_len))
        if self.default_data not in DEFAULT_DATA:
            raise ConfigError(f"PretrainConfig.default_data={self.default_data!r} is invalid; allowed: "
                              f"{', '.join(DEFAULT_DATA)}")
        if isinstance(self.anneal_fraction, bool) or not 0.0 <= self.anneal_fraction < 1.0:
            raise ConfigError(f"PretrainConfig.anneal_fraction={self.anneal_fraction!r} is invalid; allowed: a "
                              "float in [0, 1) (0 = no annealing stage)")
        if not isinstance(self.anneal_warmup_steps, int) or self.anneal_warmup_steps < 0:
            raise ConfigError(f"PretrainConfig.anneal_warmup_steps={self.anneal_warmup_steps!r} is invalid; "
                              "allowed: an integer >= 0")
        names = self.source_names()
        if self.anneal_mix is not None and names:
            try:
                parse_mix(self.anneal_mix, names)
            except ConfigError as e:
                raise ConfigError(f"PretrainConfig.anneal_mix={self.anneal_mix!r} is invalid: {e}") from None
        if self.anneal_steps and self.train.steps - self.anneal_steps < 1:
            raise ConfigError(f"PretrainConfig.anneal_fraction={self.anneal_fraction} leaves no main stage in "
                              f"train.steps={self.train.steps}; lower it or set it to 0")

    def source_names(self) -> tuple:
        """The mixture's source names (() for one corpus)."""
        if self.data.sources:
            return tuple(s.name for s in self.data.sources)
        if self.data.path is None and self.default_data == "docs+code":
            return tuple(n for n, _ in DEFAULT_MIX)
        return ()

    @property
    def anneal_steps(self) -> int:
        """Steps of the annealing stage (0: one stage): a mixture with anneal_mix and anneal_fraction > 0."""
        if not (self.anneal_mix and self.anneal_fraction > 0 and self.source_names()):
            return 0
        return max(1, round(self.anneal_fraction * self.train.steps))


# The tiny preset's architecture (DSA + MoE + MTP, GLM-5 in miniature) at a width that learns in minutes on CPU.
TINY = PretrainConfig(
    model=preset("tiny", vocab_size=2048, d_model=128, num_layers=2, ffn_dim=384, moe_ffn_dim=128,
                 q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                 index_topk=64, index_head_dim=32, attn_chunk=128),
    train=TrainConfig(steps=600, batch_size=8, seq_len=256, learning_rate=3e-3, warmup_steps=30, min_lr_ratio=0.1,
                      eval_every=100, log_every=50, ckpt_every=200, eval_batches=4, seed=0),
    data=DataConfig(vocab_size=2048, seq_len=256, tokenizer="hf", seed=0),
)
SMALL = dataclasses.replace(
    TINY, model=preset("small", vocab_size=32768),
    train=TINY.train.replace(steps=2000, batch_size=16, seq_len=2048, learning_rate=1e-3, warmup_steps=100,
                             eval_every=250, log_every=50, ckpt_every=250, eval_batches=16),
    data=dataclasses.replace(TINY.data, vocab_size=32768))


def resolve_data(cfg: PretrainConfig, workdir: str, log) -> DataConfig:
    """cfg.data, with data.path (or, for "docs+code", data.sources) filled in from default_data when unset."""
    if cfg.data.path is not None or cfg.data.sources or cfg.default_data == "stdlib_py":
        return cfg.data
    docs = os.path.join(workdir, "data", "stdlib_docstrings.jsonl")
    code = os.path.join(workdir, "data", "stdlib_code.jsonl")
    if jax.process_index() == 0:
        if not os.path.exists(docs):
            info = write_stdlib_docs(docs)
            log(f"wrote {info['documents']} stdlib module docstring documents ({info['bytes']:,} bytes) to {docs}")
        if cfg.default_data == "docs+code" and not os.path.exists(code):
            info = write_stdlib_code(code)
            log(f"wrote {info['documents']} stdlib module code documents, docstrings removed ({info['bytes']:,} "
                f"bytes) to {code}")
    if jax.process_count() > 1:       # the others wait for process 0's files
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("pretrain_default_data")
    if cfg.default_data == "docstrings":
        return dataclasses.replace(cfg.data, path=docs)
    paths = {"docs": docs, "code": code}
    return dataclasses.replace(cfg.data, sources=[(n, paths[n], w) for n, w in DEFAULT_MIX])


def _eval_fn(model_cfg, data, B: int, T: int, n_batches: int):
    """(eval_fn, eval_tokens): held-out loss / accuracy over every source's batches (token means), and per
    source (eval_loss/NAME) for a mixture."""
    eval_step = make_eval_step(model_cfg)
    names = getattr(data, "names", None)
    groups = ({n: list(data.eval_batches(B, T, max_batches=n_batches, source=n)) for n in names} if names
              else {None: list(data.eval_batches(B, T, max_batches=n_batches))})
    tokens = {n: int(sum(b["loss_mask"].sum() for b in bs)) for n, bs in groups.items()}

    def eval_fn(params):
        out, loss, acc = {}, 0.0, 0.0
        for n, bs in groups.items():
            r = evaluate(model_cfg, params, bs, eval_step)
            loss, acc = loss + r["eval_loss"] * tokens[n], acc + r["eval_accuracy"] * tokens[n]
            if n is not None:
                out[f"eval_loss/{n}"], out[f"eval_accuracy/{n}"] = r["eval_loss"], r["eval_accuracy"]
        total = max(sum(tokens.values()), 1)
        return {"eval_loss": loss / total, "eval_accuracy": acc / total, **out}

    return eval_fn, sum(tokens.values()), sum(len(bs) for bs in groups.values())


@register("pretrain", "train the chosen preset from scratch on any dataset (text / jsonl / parquet / ArrayRecord; "
          "sentencepiece or tokenizer.json); held-out eval loss before and after", {"tiny": TINY, "small": SMALL})
def run(cfg: PretrainConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    tc = cfg.train
    B, T = tc.batch_size, tc.seq_len
    dcfg = resolve_data(cfg, workdir, log)
    data = build_lm_data(dcfg, log=log)
    summary = data.summary()
    names = getattr(data, "names", ())
    log(f"data: {summary['train_documents']} train / {summary['eval_documents']} held-out documents, "
        f"{summary['train_tokens']:,} / {summary['eval_tokens']:,} tokens"
        + (f" in sources {', '.join(f'{s.name} (weight {s.weight:g})' for s in dcfg.sources)}" if names else "")
        + f"; tokenizer {data.tokenizer!r}")
    eval_fn, eval_tokens, n_eval_batches = _eval_fn(cfg.model, data, B, T, tc.eval_batches)
    # the initial parameters exactly as the run starts from them (seed or --init_from): the one loop with
    # zero steps evaluates its freshly created state (its own workdir never holds a checkpoint)
    initial = train(cfg.model, tc, data.train_iter(B, T, seed=dcfg.seed), os.path.join(workdir, "initial"),
                    eval_fn=eval_fn, log=log, name="initial", stop_after=0, mesh=mesh)["final"]
    log(f"initial held-out loss {initial['eval_loss']:.4f}")
    n_anneal = cfg.anneal_steps
    if n_anneal:
        n_main = tc.steps - n_anneal
        stages = [Stage("main", T, n_main, train={"lr_schedule": "wsd", "decay_fraction": 0.0}),
                  Stage("anneal", T, n_anneal, warmup_steps=min(cfg.anneal_warmup_steps, n_anneal // 2),
                        train={"lr_schedule": "wsd", "decay_fraction": 1.0}, data=cfg.anneal_mix)]
        out = train_stages(cfg.model, tc, stages,
                           lambda stage, i: data.train_iter(B, T, seed=dcfg.seed + i, mix=stage.data),
                           os.path.join(workdir, "train"), eval_fn_for_stage=lambda stage, i, m: eval_fn,
                           mesh=mesh, log=log)
        phases = [(st["history"], st["train_cfg"].steps) for st in out["stages"]]
        final, after_main = out["stages"][-1]["final"], out["stages"][0]["final"]
    else:
        r = train(cfg.model, tc, data.train_iter(B, T, seed=dcfg.seed), os.path.join(workdir, "train"),
                  eval_fn=eval_fn, log=log, name="pretrain", mesh=mesh)
        phases, final, after_main = [(r["history"], tc.steps)], r["final"], None
    report = {
        "initial_eval_loss": float(initial["eval_loss"]), "final_eval_loss": float(final["eval_loss"]),
        "initial_eval_accuracy": float(initial["eval_accuracy"]), "final_eval_accuracy": float(final["eval_accuracy"]),
        "eval_tokens": eval_tokens, "steps": tc.steps, "tokens_per_step": B * T, "tokens_total": B * T * tc.steps,
        "data": {k: v for k, v in summary.items() if not k.endswith("_s")}, "data_path": dcfg.path,
        "tokenizer_kind": data.tokenizer.kind, "tokenizer_vocab_size": data.tokenizer.vocab_size,
        "train_epochs": tc.steps * B / max(sum(d.train_stream.num_windows(T) for d in
                                              ([p[1] for p in data.parts] if names else [data])), 1),
        "wall_time_s": None,
    }
    if names:
        report["sources"] = {s.name: {"path": s.path, "weight": s.weight} for s in dcfg.sources}
        report["per_source"] = {n: {"initial_eval_loss": initial[f"eval_loss/{n}"],
                                    "final_eval_loss": final[f"eval_loss/{n}"]} for n in names}
        mixes = [None, cfg.anneal_mix] if n_anneal else [None]
        stage_rows = []
        for (h, steps), name, mix in zip(phases, ["main", "anneal"] if n_anneal else ["pretrain"], mixes):
            last = h[-1] if h else {}
            stage_rows.append({"stage": name, "steps": steps, "mix": data.weights(mix),
                               **{k: v for k, v in last.items() if k.startswith("data_")}})
        report["stages"] = stage_rows
    if after_main is not None:
        report["after_main_eval"] = {k: v for k, v in after_main.items() if k.startswith("eval_")}
    series = {"held-out loss (all)": tuple(a + b for a, b in zip(([0], [initial["eval_loss"]]),
                                                                    chain_series(phases)))}
    for n in names:
        series[f"held-out loss ({n})"] = tuple(a + b for a, b in zip(([0], [initial[f"eval_loss/{n}"]]),
                                                                       chain_series(phases, f"eval_loss/{n}")))
    plot_curves(os.path.join(workdir, "eval_loss.png"), series,
                title=f"pretrain: held-out loss ({B}x{T} tokens/step)"
                + (f"; anneal from step {tc.steps - n_anneal}" if n_anneal else ""))
    report["wall_time_s"] = time.time() - t_start
    m = cfg.model
    rows = [["initial (step 0)", report["initial_eval_loss"], report["initial_eval_accuracy"]]
            + [initial[f"eval_loss/{n}"] for n in names]]
    if after_main is not None:
        rows.append([f"end of main (step {tc.steps - n_anneal})", after_main["eval_loss"], after_main["eval_accuracy"]]
                    + [after_main[f"eval_loss/{n}"] for n in names])
    rows.append([f"final (step {tc.steps})", report["final_eval_loss"], report["final_eval_accuracy"]]
                + [final[f"eval_loss/{n}"] for n in names])
    if names:
        data_md = "Sources (each with its own held-out documents):\n\n" + md_table(
            ["source", "path", "weight", "train documents", "train tokens", "held-out documents"],
            [[s.name, f"`{s.path}`", f"{s.weight:g}", summary["sources"][s.name]["train_documents"],
              f"{summary['sources'][s.name]['train_tokens']:,}", summary["sources"][s.name]["eval_documents"]]
             for s in dcfg.sources])
        data_md += "\n\nStages (mix = the share of sequences drawn from each source; tokens = non-padding " \
                   "tokens drawn):\n\n" + md_table(
            ["stage", "steps", "mix"] + [f"{n} tokens" for n in names],
            [[r["stage"], r["steps"], ", ".join(f"{k} {v:.2f}" for k, v in r["mix"].items())]
             + [f"{r.get(f'data_tokens/{n}', 0):,}" for n in names] for r in report["stages"]])
        sched = (f"Stage `main`: warmup {tc.warmup_steps} steps, then the LR held at {tc.learning_rate}; stage "
                 f"`anneal`: re-warmup {min(cfg.anneal_warmup_steps, n_anneal // 2)} steps, then a linear decay "
                 f"to {tc.min_lr_ratio} x peak." if n_anneal else f"LR schedule {tc.lr_schedule}.")
    else:
        data_md = (f"Data: `{dcfg.path or 'stdlib *.py sources'}`: {summary['train_documents']} train documents "
                   f"({summary['train_tokens']:,} tokens), {summary['eval_documents']} held-out documents "
                   f"({summary['eval_tokens']:,} tokens, never trained on).")
        sched = f"LR schedule {tc.lr_schedule}."
    md = f"""# pretrain

Model: d_model {m.d_model}, {m.num_layers} layers, attention {m.attention}, {m.num_experts} experts,
MTP depth {m.mtp_depth}, vocab {m.vocab_size}. {tc.steps} steps of {B}x{T} = {B * T} tokens
({report['train_epochs']:.2f} passes over the train split), AdamW lr {tc.learning_rate}. {sched}

{data_md}

Tokenizer: {data.tokenizer.kind} `{data.tokenizer.model_path}` (vocab {data.tokenizer.vocab_size}).

Primary metric: held-out token-mean loss on {eval_tokens:,} tokens ({n_eval_batches} batches).

{md_table(["parameters", "held-out loss", "held-out token accuracy"] + [f"held-out loss {n}" for n in names], rows)}

![held-out loss](eval_loss.png)

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
