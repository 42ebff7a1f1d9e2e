"""pretrain: train the chosen preset from scratch on any dataset, and measure held-out loss.

    python -m experiments.run --config=pretrain [--preset tiny|small]
        [--set data.path='corpus/*.jsonl.gz'] [--set data.tokenizer=glm5/tokenizer.json --set data.vocab_size=154880]

Data: `data.path` is a glob / file / directory / comma list of text, jsonl(.gz), parquet or ArrayRecord
files, or a directory written by `python -m tools.prepare_data` (glm5_jax.data). `data.tokenizer`: "hf"
(the default here: a byte-level BPE tokenizer.json trained on the train split with the `tokenizers`
library), none / "spm" (sentencepiece trained here), or a tokenizer path. `data.vocab_size` is the
model's vocabulary (model.vocab_size follows it): a loaded tokenizer must not be larger.
With no `data.path`: `default_data` says what to use. "docstrings" (default) writes the docstrings of
the running Python's standard library (one document per module; glm5_jax.data.stdlib_text) to
WORKDIR/data/stdlib_docstrings.jsonl and trains on that; "stdlib_py" uses the stdlib *.py sources.

Primary metric, named before any run: final_eval_loss, the token-mean next-token loss on held-out
documents of the same data (DataConfig.eval_fraction by document-key hash; never trained on), against
initial_eval_loss (the same batches, at the initial parameters). Nothing here is tuned on that split.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import ClassVar

import jax

from experiments.registry import register
from experiments.report import eval_series, md_table, plot_curves, write_report
from glm5_jax.config import ConfigError, ModelConfig, preset
from glm5_jax.data import DataConfig, build_lm_data
from glm5_jax.data.stdlib_text import write_stdlib_docs
from glm5_jax.train import TrainConfig, evaluate, train
from glm5_jax.train.step import make_eval_step

DEFAULT_DATA = ("docstrings", "stdlib_py")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """model: the preset trained (model.vocab_size follows data.vocab_size); train: the run (train.steps
    is the step count, train.eval_batches the held-out batches); data: what it reads (data.seq_len follows
    train.seq_len); default_data: the corpus when data.path is unset ("docstrings" or "stdlib_py")."""
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    default_data: str = "docstrings"

    STEPS_KEY: ClassVar[str] = "train.steps"
    DERIVED: ClassVar[dict] = {"model.vocab_size": "data.vocab_size", "data.seq_len": "train.seq_len"}

    def __post_init__(self):
        object.__setattr__(self, "model", self.model.replace(vocab_size=self.data.vocab_size))
        object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=self.train.seq_len))
        if self.default_data not in DEFAULT_DATA:
            raise ConfigError(f"PretrainConfig.default_data={self.default_data!r} is invalid; allowed: "
                              f"{', '.join(DEFAULT_DATA)}")


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
    """cfg.data, with data.path filled in from default_data when unset."""
    if cfg.data.path is not None or cfg.default_data == "stdlib_py":
        return cfg.data
    path = os.path.join(workdir, "data", "stdlib_docstrings.jsonl")
    if jax.process_index() == 0 and not os.path.exists(path):
        info = write_stdlib_docs(path)
        log(f"wrote {info['documents']} stdlib module docstring documents ({info['bytes']:,} bytes) to {path}")
    if jax.process_count() > 1:       # the others wait for process 0's file
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("pretrain_default_data")
    return dataclasses.replace(cfg.data, path=path)


@register("pretrain", "train the chosen preset from scratch on any dataset (text / jsonl / parquet / ArrayRecord; "
          "sentencepiece or tokenizer.json); held-out eval loss before and after", {"tiny": TINY, "small": SMALL})
def run(cfg: PretrainConfig, workdir: str, log, mesh=None) -> dict:
    t_start = time.time()
    tc = cfg.train
    B, T = tc.batch_size, tc.seq_len
    dcfg = resolve_data(cfg, workdir, log)
    data = build_lm_data(dcfg, log=log)
    summary = data.summary()
    log(f"data: {summary['train_documents']} train / {summary['eval_documents']} held-out documents, "
        f"{summary['train_tokens']:,} / {summary['eval_tokens']:,} tokens; tokenizer {data.tokenizer!r}")
    lm_eval = list(data.eval_batches(B, T, max_batches=tc.eval_batches))
    eval_step = make_eval_step(cfg.model)
    eval_fn = lambda p: evaluate(cfg.model, p, lm_eval, eval_step)  # noqa: E731
    # the initial parameters exactly as the run starts from them (seed or --init_from): the one loop with
    # zero steps evaluates its freshly created state (its own workdir never holds a checkpoint)
    initial = train(cfg.model, tc, data.train_iter(B, T, seed=dcfg.seed), os.path.join(workdir, "initial"),
                    eval_fn=eval_fn, log=log, name="initial", stop_after=0, mesh=mesh)["final"]
    log(f"initial held-out loss {initial['eval_loss']:.4f}")
    r = train(cfg.model, tc, data.train_iter(B, T, seed=dcfg.seed), os.path.join(workdir, "train"),
              eval_fn=eval_fn, log=log, name="pretrain", mesh=mesh)
    final = r["final"]
    eval_tokens = int(sum(b["loss_mask"].sum() for b in lm_eval))
    report = {
        "initial_eval_loss": float(initial["eval_loss"]), "final_eval_loss": float(final["eval_loss"]),
        "initial_eval_accuracy": float(initial["eval_accuracy"]), "final_eval_accuracy": float(final["eval_accuracy"]),
        "eval_tokens": eval_tokens, "steps": tc.steps, "tokens_per_step": B * T, "tokens_total": B * T * tc.steps,
        "data": {k: v for k, v in summary.items() if not k.endswith("_s")}, "data_path": dcfg.path,
        "tokenizer_kind": data.tokenizer.kind, "tokenizer_vocab_size": data.tokenizer.vocab_size,
        "train_epochs": tc.steps * B / max(data.train_stream.num_windows(T), 1),
        "wall_time_s": None,
    }
    xs, ys = eval_series(r["history"])
    plot_curves(os.path.join(workdir, "eval_loss.png"), {"held-out loss": ([0] + xs, [initial["eval_loss"]] + ys)},
                title=f"pretrain: held-out loss ({B}x{T} tokens/step)")
    report["wall_time_s"] = time.time() - t_start
    m = cfg.model
    rows = [["initial (step 0)", report["initial_eval_loss"], report["initial_eval_accuracy"]],
            [f"final (step {tc.steps})", report["final_eval_loss"], report["final_eval_accuracy"]]]
    md = f"""# pretrain

Model: d_model {m.d_model}, {m.num_layers} layers, attention {m.attention}, {m.num_experts} experts,
MTP depth {m.mtp_depth}, vocab {m.vocab_size}. {tc.steps} steps of {B}x{T} = {B * T} tokens
({report['train_epochs']:.2f} passes over the train split), AdamW lr {tc.learning_rate}.

Data: `{dcfg.path or 'stdlib *.py sources'}`: {summary['train_documents']} train documents
({summary['train_tokens']:,} tokens), {summary['eval_documents']} held-out documents ({summary['eval_tokens']:,}
tokens, never trained on). Tokenizer: {data.tokenizer.kind} `{data.tokenizer.model_path}` (vocab
{data.tokenizer.vocab_size}).

Primary metric: held-out token-mean loss on {eval_tokens:,} tokens ({len(lm_eval)} batches).

{md_table(["parameters", "held-out loss", "held-out token accuracy"], rows)}

![held-out loss](eval_loss.png)

Wall time {report['wall_time_s']:.0f} s.
"""
    write_report(workdir, report, md)
    return report
