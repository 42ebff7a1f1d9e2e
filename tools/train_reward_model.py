"""Train an outcome reward model (the GLM-5 trunk + a scalar head) on preference pairs.

    python -m tools.train_reward_model --data=PAIRS.jsonl --eval=HELDOUT.jsonl --workdir=DIR
        [--tokenizer=PATH] [--init_from=CHECKPOINT] [--set model.X=V --set train.X=V --set rm.X=V ...] [--json]

PAIRS / HELDOUT: jsonl lines {"prompt": str | messages, "chosen": str | messages, "rejected": str | messages}
(format: glm5_jax.rl.reward_model; docs/post_training.md). Both files are checked before anything is
trained: a bad line is one error line naming the file, the line and the field (exit status 2).

Training is the one loop (glm5_jax.train.train) with the Bradley-Terry loss plugged into the one train
step: progress lines with ETA on stderr, metrics.jsonl, checkpoints in DIR/checkpoints; running the same
command again resumes from the latest checkpoint (the data order is a function of the seed and the step).
--tokenizer: a tokenizer.json / sentencepiece model with the GLM chat tokens; without it a byte-level BPE
is trained on the training pairs into DIR/tokenizer.json (reused when resuming). model.vocab_size
defaults to the tokenizer's size rounded up to a multiple of 8. --init_from: start from a checkpoint
(Hugging Face folder, params checkpoint, or a training run): a policy's trunk with a fresh reward head,
or a reward model's whole; the model config is then the checkpoint's (--tokenizer required).

At the end the held-out `pairwise_accuracy` (fraction of HELDOUT pairs scored chosen > rejected) is
printed; with --json the last stdout line is one JSON object holding it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

from absl import flags

from glm5_jax.cli import main_wrapper, run as run_cli
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.fields import check_fields, setting
from glm5_jax.train.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class RMConfig:
    center_weight: float = setting(0.01, min=0)   # weight of mean (r_chosen + r_rejected)^2 (pins the reward's offset)
    tokenizer_vocab: int = 512           # size of a tokenizer trained here (no --tokenizer)
    template_mode: str = "interleaved"   # chat template thinking mode (glm5_jax.data.chat.MODES)
    eval_batch_size: int = setting(32, integer=True, min=1)

    def __post_init__(self):
        check_fields(self)


@dataclasses.dataclass(frozen=True)
class RewardRunConfig:
    model: ModelConfig = ModelConfig(d_model=64, num_layers=2, mtp_depth=0, reward_head=True)
    train: TrainConfig = TrainConfig(steps=200, batch_size=16, seq_len=128, learning_rate=1e-3, warmup_steps=10,
                                     weight_decay=0.0, eval_every=50, ckpt_every=50, log_every=10)
    rm: RMConfig = RMConfig()


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _has_checkpoint(workdir: str) -> bool:
    ck = os.path.join(workdir, "checkpoints")
    return os.path.isdir(ck) and any(n.isdigit() for n in os.listdir(ck))


def _tokenizer(args, train_pairs, rm: RMConfig):
    from glm5_jax.data.hf_tokenizer import train_hf_tokenizer
    from glm5_jax.data.tokenizer import load_tokenizer
    from glm5_jax.rl.reward_model import pair_texts
    if args.tokenizer:
        return load_tokenizer(args.tokenizer), os.path.abspath(args.tokenizer)
    path = os.path.join(args.workdir, "tokenizer.json")
    if os.path.exists(path):                 # a resumed run keeps its ids
        return load_tokenizer(path), path
    return train_hf_tokenizer(pair_texts(train_pairs), rm.tokenizer_vocab, path), path


def run(args) -> dict:
    from glm5_jax.overrides import apply_overrides, split_item
    from glm5_jax.data.chat import ChatTemplate
    from glm5_jax.rl.reward_model import (PairIterator, encode_pairs, evaluate_pairs, load_pairs, make_rm_loss,
                                          rm_init_params)
    from glm5_jax.train import train

    t0 = time.time()
    train_pairs = load_pairs(args.data)
    eval_pairs = load_pairs(args.eval)
    keys = {split_item(s)[0] for s in args.set}
    base = RewardRunConfig()
    if args.init_from:
        from glm5_jax.train.checkpoint import checkpoint_config
        if not args.tokenizer:
            raise ConfigError("--init_from needs --tokenizer (the checkpoint's tokenizer: the ids must mean what "
                              "they meant when it was trained)")
        base = dataclasses.replace(base, model=checkpoint_config(args.init_from).replace(reward_head=True))
    cfg = apply_overrides(base, args.set)
    if not cfg.model.reward_head:
        raise ConfigError("model.reward_head must stay true: a reward model is the trunk with its scalar head")
    os.makedirs(args.workdir, exist_ok=True)
    tok, tok_path = _tokenizer(args, train_pairs, cfg.rm)
    if not args.init_from and "model.vocab_size" not in keys:
        cfg = dataclasses.replace(cfg, model=cfg.model.replace(vocab_size=-(-tok.vocab_size // 8) * 8))
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer {tok_path} has {tok.vocab_size} ids > model.vocab_size={cfg.model.vocab_size}")
    template = ChatTemplate(tok, cfg.rm.template_mode)
    seq_len, pad = cfg.train.seq_len, int(getattr(tok, "pad_id", 0) or 0)
    train_enc, train_cut = encode_pairs(template, train_pairs, seq_len)    # render errors name file:line
    eval_enc, eval_cut = encode_pairs(template, eval_pairs, seq_len)
    mcfg, tcfg = cfg.model, cfg.train
    _log(f"[rm] {len(train_enc)} training pairs ({train_cut} left-truncated to {seq_len} tokens), {len(eval_enc)} "
         f"held-out ({eval_cut} truncated); tokenizer {tok_path} ({tok.vocab_size} ids); model d_model {mcfg.d_model}, "
         f"{mcfg.num_layers} layers, {mcfg.attention}")
    evals = {"n": 0}

    def eval_fn(params):
        ev = evaluate_pairs(mcfg, params, eval_enc, seq_len=seq_len, batch_size=cfg.rm.eval_batch_size, pad_id=pad)
        evals["n"] += 1
        _log(f"[rm] held-out pairwise_accuracy {ev['pairwise_accuracy']:.4f} bt_loss {ev['eval_bt_loss']:.4f} "
             f"margin {ev['eval_margin']:.3f} ({ev['eval_pairs']} pairs)")
        return ev

    init = None
    if args.init_from and not _has_checkpoint(args.workdir):
        init = rm_init_params(args.init_from, mcfg, seed=tcfg.seed)
    it = PairIterator(train_enc, tcfg.batch_size, seq_len, seed=tcfg.seed, pad_id=pad)
    out = train(mcfg, tcfg, it, args.workdir, init_params=init, eval_fn=eval_fn, log=_log, name="rm",
                loss_fn=make_rm_loss(mcfg, cfg.rm.center_weight))
    final = out["final"]
    hist = out["history"]
    tail = hist[-min(len(hist), 10):]
    summary = {"pairwise_accuracy": final["pairwise_accuracy"], "eval_bt_loss": final["eval_bt_loss"],
               "eval_margin": final["eval_margin"], "eval_pairs": final["eval_pairs"], "train_pairs": len(train_enc),
               "truncated_pairs": train_cut + eval_cut, "steps": tcfg.steps,
               "final_train_accuracy": (sum(r["pairwise_accuracy"] for r in tail) / len(tail)) if tail else None,
               "tokenizer": tok_path, "workdir": os.path.abspath(args.workdir), "wall_s": round(time.time() - t0, 1)}
    if summary["final_train_accuracy"] is not None and not math.isfinite(summary["final_train_accuracy"]):
        summary["final_train_accuracy"] = None
    return summary


FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_string("data", None, "training pairs (jsonl)", required=True)
    flags.DEFINE_string("eval", None, "held-out pairs (jsonl), never trained on", required=True)
    flags.DEFINE_string("workdir", None, "output folder (checkpoints, metrics.jsonl; resumed when run again)",
                        required=True)
    flags.DEFINE_string("tokenizer", None, "tokenizer.json / sentencepiece model (default: one trained here)")
    flags.DEFINE_string("init_from", None, "start from this checkpoint (HF folder, params checkpoint, run)")
    flags.DEFINE_multi_string("set", [], "model.* / train.* / rm.* overrides KEY=VALUE, e.g. --set train.steps=400")
    flags.DEFINE_bool("json", False, "last stdout line: one JSON object with the results")


@main_wrapper(also=(OSError,))    # bad pairs, settings or checkpoint (Glm5Error), a missing file: one line, exit 2
def main(argv) -> int:
    del argv
    args = FLAGS
    summary = run(args)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"pairwise_accuracy {summary['pairwise_accuracy']:.4f} on {summary['eval_pairs']} held-out pairs "
              f"(bt_loss {summary['eval_bt_loss']:.4f}, margin {summary['eval_margin']:.3f}); workdir {summary['workdir']}")
    return 0


if __name__ == "__main__":
    run_cli(main, define_flags)
