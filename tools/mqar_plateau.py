"""How many retrieval episodes does a model need before its match-and-copy circuit forms?

Trains a model of the dsa_vs_mla shape (its `tiny` MLA arm by default) from scratch on pure
multi-query associative recall windows (glm5_jax/data/retrieval.py's RetrievalTask over a 128-token
synthetic vocabulary: digits, 52 letter keys, random filler tokens; no text) with the project's
own loop (glm5_jax.train.train), and scores held-out probes (the last query's value, exact match)
every --eval_every steps. Two stages show in the curve: "copy" (probe accuracy near
1/pairs + (1 - 1/pairs)/10: the value of SOME planted record is copied) and "match" (accuracy
towards 1: the record whose key equals the query is found through the previous-token feature).
This is the diagnostic behind the dsa_vs_mla retrieval figures in docs/experiments.md.

    python -m tools.mqar_plateau --pairs=2 --seq=16 --batch=64 --steps=600
    python -m tools.mqar_plateau --pairs=4 --seq=32 --batch=64 --steps=1000 [--min_pairs=1] [--json]
"""

from __future__ import annotations

import json
import tempfile

import numpy as np
from absl import flags

from experiments.dsa_vs_mla import TINY, model_configs
from glm5_jax.cli import run as run_cli
from glm5_jax.data.retrieval import EVAL_TAG, KEY_LETTERS, TRAIN_TAG, RetrievalTask, retrieval_probe_batches
from glm5_jax.eval import RetrievalAccuracy, evaluate
from glm5_jax.train import TrainConfig, train

FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_integer("pairs", 4, "records per window (every probe holds this many)")
    flags.DEFINE_integer("min_pairs", None, "train windows draw their record count from [min_pairs, pairs]")
    flags.DEFINE_integer("seq", 32, "window length T")
    flags.DEFINE_integer("min_distance", 0, "queries start more than this many tokens after the record block")
    flags.DEFINE_integer("batch", 64, "windows per step")
    flags.DEFINE_integer("steps", 1000, "optimizer steps")
    flags.DEFINE_float("lr", 3e-3, "peak AdamW learning rate (warm-up 50 steps, cosine to 0.1x)")
    flags.DEFINE_integer("eval_every", 50, "steps between probe scores")
    flags.DEFINE_integer("probes", 256, "held-out probe windows")
    flags.DEFINE_enum("attention", "mla", ["mla", "mha", "dsa"], "arm of dsa_vs_mla tiny (its model_configs) to train")
    flags.DEFINE_string("workdir", None, "run folder (default: a fresh temporary folder)")
    flags.DEFINE_bool("json", False, "print the curve as one JSON object on the last line")


VOCAB = 128
N_DIGITS, N_KEYS = 10, len(KEY_LETTERS)


class SyntheticTokenizer:
    """Ids 0-9 are the digits, 10-61 the letter keys as byte pieces (<0x41> ...), 62 pad, the rest filler."""
    vocab_size = VOCAB
    pad_id = N_DIGITS + N_KEYS

    def digit_ids(self):
        return list(range(N_DIGITS))

    def id_to_piece(self, i: int) -> str:
        if N_DIGITS <= i < N_DIGITS + N_KEYS:
            return f"<0x{ord(KEY_LETTERS[i - N_DIGITS]):02X}>"
        return str(i) if i < N_DIGITS else f"<filler{i}>"


class EpisodeIterator:
    """Train windows TRAIN_TAG 0, 1, 2, ... of the task; the state is the next index (exact resume)."""

    def __init__(self, task: RetrievalTask, batch: int, seed: int = 0):
        self.task, self.batch, self.seed, self.next = task, batch, seed, 0

    def __iter__(self):
        return self

    def __next__(self):
        rows = [self.task.example(self.seed, TRAIN_TAG, self.next + r, mode="train")[0] for r in range(self.batch)]
        self.next += self.batch
        return {k: np.stack([r[k] for r in rows]) for k in rows[0]}

    def get_state(self):
        return {"next": self.next}

    def set_state(self, state):
        self.next = int(state["next"])


def main(argv):
    del argv
    filler = np.random.default_rng(0).integers(SyntheticTokenizer.pad_id + 1, VOCAB, 1 << 16)
    task = RetrievalTask(SyntheticTokenizer(), filler, FLAGS.seq, n_pairs=FLAGS.pairs, key_digits=2, value_digits=1,
                         min_distance=FLAGS.min_distance, min_pairs=FLAGS.min_pairs)
    cfg = model_configs(TINY.model.replace(vocab_size=VOCAB))[FLAGS.attention]
    probes = [b for b, _ in retrieval_probe_batches(task, 64, max(1, FLAGS.probes // 64), 0, EVAL_TAG)]
    def eval_fn(params):                                  # exact match of the last value, through glm5_jax.eval
        return {"probe_accuracy": evaluate(cfg, params, probes, [RetrievalAccuracy()])["retrieval_accuracy"]}

    tc = TrainConfig(steps=FLAGS.steps, batch_size=FLAGS.batch, seq_len=FLAGS.seq, learning_rate=FLAGS.lr,
                     warmup_steps=50, eval_every=FLAGS.eval_every, log_every=FLAGS.eval_every,
                     ckpt_every=FLAGS.steps, eval_batches=1)
    workdir = FLAGS.workdir or tempfile.mkdtemp(prefix="mqar_plateau_")
    out = train(cfg, tc, EpisodeIterator(task, FLAGS.batch), workdir, eval_fn=eval_fn, name="mqar")
    curve = [(r["step"], r["probe_accuracy"]) for r in out["history"] if "probe_accuracy" in r]
    copy_level = 1.0 / FLAGS.pairs + (1.0 - 1.0 / FLAGS.pairs) / N_DIGITS
    for step, acc in curve:
        print(f"step {step:6d}  episodes {step * FLAGS.batch:8d}  probe accuracy {acc:.3f}")
    print(f"chance {1 / N_DIGITS:.3f}; copying a random planted value {copy_level:.3f}; workdir {workdir}")
    if FLAGS.json:
        print(json.dumps({"settings": {k: FLAGS[k].value for k in ("pairs", "min_pairs", "seq", "min_distance", "batch",
                                                                       "steps", "lr", "attention")},
                          "copy_level": copy_level, "curve": curve}))


if __name__ == "__main__":
    run_cli(main, define_flags)
