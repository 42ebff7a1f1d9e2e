"""Outcome reward model on the GLM-5 trunk: preference pairs, the Bradley-Terry loss, scoring.

The reward model is the one model (``glm5_jax.model.GLM5``) with ``ModelConfig.reward_head=True``: a
scalar head on the final-normed hidden state. A sequence's reward is the head's value at its last token
(the assistant message's stop token). Training is the one train step (``make_train_step``) with
``make_rm_loss`` plugged in, driven by the one loop (``glm5_jax.train.train``); ``tools.train_reward_model``
is the CLI.

Pair data (jsonl, one pair per line; human preference data enters this way)::

    {"prompt": str | [messages], "chosen": str | [messages], "rejected": str | [messages]}

A string prompt is one user message; a string response is one assistant message. Message lists use the
chat template's format (glm5_jax.data.chat: roles system / user / assistant / tool, tool_calls, ...): the
prompt is the conversation so far, each response the messages that continue it (ending with an assistant
message). Both sides are rendered with the GLM chat template (interleaved thinking), so the ids the reward
model scores are the ids a policy generates. A bad line raises PairFormatError naming the file, the line
and the field.

Batch layout (``pair_batch``): ``tokens`` int32 [P, 2, T] (chosen, rejected; right-padded), ``last``
int32 [P, 2] (index of each sequence's last token), ``pair_mask`` float32 [P] (0 on padding pairs).
Loss: mean over real pairs of -log sigmoid(r_chosen - r_rejected), plus ``center_weight`` times the
mean of (r_chosen + r_rejected)^2, which pins the reward's offset (BT only sees differences) near 0 so
scores are comparable across runs and a fixed normalisation can be applied in the hybrid reward.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.data.chat import ChatFormatError, ChatTemplate
from glm5_jax.errors import Glm5Error
from glm5_jax.model import GLM5
from glm5_jax.rl.sft import SFTIterator

__all__ = ["PairFormatError", "Pair", "load_pairs", "pair_texts", "encode_pair", "encode_pairs", "pair_batch",
           "PairIterator", "make_rm_loss", "reward_scores", "evaluate_pairs", "RewardModel", "rm_init_params",
           "train_reward_model"]

FIELDS = ("prompt", "chosen", "rejected")


class PairFormatError(Glm5Error):
    """A preference-pair file line that is not a valid pair (the message names file, line and field)."""


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: tuple            # messages (dicts)
    chosen: tuple            # messages continuing the prompt
    rejected: tuple
    where: str               # "FILE:LINE"


def _messages(value, field: str, where: str, role: str) -> tuple:
    if isinstance(value, str):
        if not value.strip():
            raise PairFormatError(f"{where}: field {field!r} is an empty string")
        return ({"role": role, "content": value},)
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return tuple(value)
    raise PairFormatError(f"{where}: field {field!r} must be a non-empty string or a non-empty list of message "
                          f"objects ({{\"role\", \"content\", ...}}), got {type(value).__name__}: {str(value)[:60]!r}")


def load_pairs(path, template: Optional[ChatTemplate] = None) -> List[Pair]:
    """Read and check a pair file. With ``template`` every pair is also rendered, so a message list the
    chat template refuses (bad role order, template tokens in text, ...) is reported here with its line."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PairFormatError(f"{path}: no such pair file (expected jsonl lines "
                              f"{{\"prompt\": ..., \"chosen\": ..., \"rejected\": ...}})")
    pairs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PairFormatError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise PairFormatError(f"{where}: a line must be a JSON object with fields {', '.join(FIELDS)}, "
                                      f"got {type(obj).__name__}")
            for k in FIELDS:
                if k not in obj:
                    raise PairFormatError(f"{where}: field {k!r} is missing (a pair needs {', '.join(FIELDS)})")
            pair = Pair(_messages(obj["prompt"], "prompt", where, "user"),
                        _messages(obj["chosen"], "chosen", where, "assistant"),
                        _messages(obj["rejected"], "rejected", where, "assistant"), where)
            for k in ("chosen", "rejected"):
                last = getattr(pair, k)[-1]
                if last.get("role") != "assistant":
                    raise PairFormatError(f"{where}: field {k!r} must end with an assistant message, "
                                          f"not {last.get('role')!r}")
            if template is not None:
                encode_pair(template, pair)
            pairs.append(pair)
    if not pairs:
        raise PairFormatError(f"{path}: holds no pairs (expected jsonl lines {{\"prompt\", \"chosen\", \"rejected\"}})")
    return pairs


def pair_texts(pairs: Sequence[Pair]) -> List[str]:
    """The plain texts of the pairs (for training a tokenizer; template tokens are added tokens)."""
    out = []
    for p in pairs:
        for m in p.prompt + p.chosen + p.rejected:
            out.append("\n" + str(m.get("content", "")) + "\n" + str(m.get("reasoning", "") or ""))
    return out


def encode_pair(template: ChatTemplate, pair: Pair) -> tuple:
    """(chosen ids, rejected ids): prompt + response rendered with the chat template."""
    out = []
    for k in ("chosen", "rejected"):
        try:
            out.append(template.render(list(pair.prompt) + list(getattr(pair, k))).ids)
        except ChatFormatError as e:
            raise PairFormatError(f"{pair.where}: field {k!r} (with the prompt) does not render: {e}") from None
    return tuple(out)


def encode_pairs(template: ChatTemplate, pairs: Sequence[Pair], seq_len: int) -> tuple:
    """(list of (chosen ids, rejected ids), number of pairs left-truncated to seq_len). A sequence longer
    than seq_len keeps its last seq_len tokens: the reward is read at the end."""
    enc, cut = [], 0
    for p in pairs:
        c, r = encode_pair(template, p)
        if len(c) > seq_len or len(r) > seq_len:
            cut += 1
        enc.append((c[-seq_len:], r[-seq_len:]))
    return enc, cut


def pair_batch(encoded: Sequence[tuple], batch_size: int, seq_len: int, pad_id: int = 0) -> dict:
    """Pairs -> the RM batch (module doc); fewer pairs than batch_size are padded with masked pairs."""
    if len(encoded) > batch_size:
        raise ValueError(f"{len(encoded)} pairs do not fit batch_size={batch_size}")
    tokens = np.full((batch_size, 2, seq_len), pad_id, np.int32)
    last = np.zeros((batch_size, 2), np.int32)
    mask = np.zeros((batch_size,), np.float32)
    for i, pair in enumerate(encoded):
        for j, ids in enumerate(pair):
            ids = list(ids)[-seq_len:]
            tokens[i, j, :len(ids)] = ids
            last[i, j] = len(ids) - 1
        mask[i] = 1.0
    return {"tokens": tokens, "last": last, "pair_mask": mask}


class PairIterator(SFTIterator):
    """Infinite iterator of RM batches: epoch e visits the pairs in the order of a permutation seeded by
    (seed, e), so batch i is a function of (seed, i) and the state is a counter (exact resume). The
    iteration protocol and state (index, seed) are SFTIterator's; only the batch differs."""

    def __init__(self, encoded: Sequence[tuple], batch_size: int, seq_len: int, seed: int = 0, pad_id: int = 0):
        if not encoded:
            raise ValueError("PairIterator needs at least one pair")
        self.encoded, self.batch_size, self.seq_len = list(encoded), batch_size, seq_len
        self.seed, self.pad_id, self.index = seed, pad_id, 0

    @functools.lru_cache(maxsize=4)
    def _order(self, epoch: int) -> List[int]:
        order = list(range(len(self.encoded)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def batch(self, index: int) -> dict:
        n = len(self.encoded)
        picks = []
        for k in range(index * self.batch_size, (index + 1) * self.batch_size):
            picks.append(self.encoded[self._order(k // n)[k % n]])
        return pair_batch(picks, self.batch_size, self.seq_len, self.pad_id)


def _sequence_rewards(model: GLM5, params, tokens, last):
    """tokens [N, T], last [N] -> the reward head's value at each sequence's last token [N] float32."""
    n, t = tokens.shape
    out = model.apply({"params": params}, tokens, None, jnp.ones((n, t), jnp.int32), logits=False, reward=True)
    return jnp.take_along_axis(out["reward"], last[:, None], axis=1)[:, 0]


def _pair_terms(model, params, batch):
    p, _, t = batch["tokens"].shape
    r = _sequence_rewards(model, params, batch["tokens"].reshape(2 * p, t), batch["last"].reshape(2 * p)).reshape(p, 2)
    mask = batch["pair_mask"].astype(jnp.float32)
    margin = r[:, 0] - r[:, 1]
    n = jnp.maximum(jnp.sum(mask), 1.0)
    bt = -jnp.sum(jax.nn.log_sigmoid(margin) * mask) / n
    acc = jnp.sum((margin > 0).astype(jnp.float32) * mask) / n
    center = jnp.sum(jnp.square(r[:, 0] + r[:, 1]) * mask) / n
    return r, margin, mask, n, bt, acc, center


def make_rm_loss(model_cfg: ModelConfig, center_weight: float = 0.0):
    """loss_fn(params, batch) -> (loss, (metrics, {})) for make_train_step: the Bradley-Terry loss on
    (chosen, rejected) pairs (+ center_weight * mean (r_c + r_r)^2). No expert loads are reported (the
    MoE correction biases stay where the trunk's training left them, as in the RL update)."""
    if not model_cfg.reward_head:
        raise ConfigError("make_rm_loss needs ModelConfig.reward_head=True (the scalar reward head)")
    model = GLM5(model_cfg)

    def loss_fn(params, batch):
        r, margin, mask, n, bt, acc, center = _pair_terms(model, params, batch)
        loss = bt + center_weight * center
        metrics = {"loss": loss, "bt_loss": bt, "pairwise_accuracy": acc,
                   "margin": jnp.sum(margin * mask) / n, "reward_mean": jnp.sum((r[:, 0] + r[:, 1]) * mask) / (2 * n)}
        return loss, (metrics, {})

    return loss_fn


@functools.lru_cache(maxsize=8)
def _jitted_rewards(model_cfg: ModelConfig):
    model = GLM5(model_cfg)
    return jax.jit(lambda params, tokens, last: _sequence_rewards(model, params, tokens, last))


def reward_scores(model_cfg: ModelConfig, params, seqs: Sequence[Sequence[int]], *, seq_len: int,
                  batch_size: int = 32, pad_id: int = 0, batch_sharding=None) -> np.ndarray:
    """Rewards [N] float32 of token-id sequences (left-truncated to seq_len), in fixed [batch_size, seq_len]
    batches so the forward compiles once. batch_sharding: where each batch goes (on a mesh: split over
    its batch axes, ``RewardModel(mesh=)``); default the default device."""
    fn = _jitted_rewards(model_cfg)
    out = []
    for i in range(0, len(seqs), batch_size):
        chunk = [list(s)[-seq_len:] for s in seqs[i:i + batch_size]]
        tokens = np.full((batch_size, seq_len), pad_id, np.int32)
        last = np.zeros((batch_size,), np.int32)
        for j, ids in enumerate(chunk):
            if not ids:
                raise ValueError(f"sequence {i + j} is empty; a reward needs at least one token")
            tokens[j, :len(ids)] = ids
            last[j] = len(ids) - 1
        args = (jnp.asarray(tokens), jnp.asarray(last)) if batch_sharding is None else \
            jax.device_put((tokens, last), batch_sharding)
        out.append(np.asarray(fn(params, *args))[:len(chunk)])
    return np.concatenate(out).astype(np.float32) if out else np.zeros((0,), np.float32)


def evaluate_pairs(model_cfg: ModelConfig, params, encoded: Sequence[tuple], *, seq_len: int,
                   batch_size: int = 32, pad_id: int = 0) -> dict:
    """Held-out metrics: pairwise_accuracy (fraction with r_chosen > r_rejected; a tie counts as wrong),
    eval_bt_loss, eval_margin, eval_pairs."""
    seqs = [s for pair in encoded for s in pair]
    r = reward_scores(model_cfg, params, seqs, seq_len=seq_len, batch_size=batch_size, pad_id=pad_id).reshape(-1, 2)
    margin = r[:, 0] - r[:, 1]
    bt = float(np.mean(np.logaddexp(0.0, -margin.astype(np.float64))))
    return {"pairwise_accuracy": float(np.mean(margin > 0)), "eval_bt_loss": bt, "eval_margin": float(np.mean(margin)),
            "eval_pairs": int(len(r))}


class RewardModel:
    """A trained reward model as a scorer for RL: ``rm(list of token-id sequences) -> rewards [N]``.
    The sequences are the policy's own ids (prompt + generated), never re-tokenised, so the policy and
    the RM must share the tokenizer (the same trunk's)."""

    def __init__(self, model_cfg: ModelConfig, params, *, seq_len: int, batch_size: int = 32, pad_id: int = 0,
                 mesh=None):
        if not model_cfg.reward_head:
            raise ConfigError("RewardModel needs ModelConfig.reward_head=True")
        self.batch_sharding = None
        if mesh is not None:        # resident on the mesh, sharded like a trainer's params; batches split over the batch axes
            from jax.sharding import NamedSharding, PartitionSpec

            from glm5_jax.batch import BATCH_AXES
            from glm5_jax.sharding import param_shardings
            shards = int(np.prod([dict(mesh.shape).get(a, 1) for a in BATCH_AXES]))
            if batch_size % shards:
                raise ValueError(f"RewardModel: batch_size={batch_size} must be a multiple of the mesh's batch shards "
                                 f"{'*'.join(BATCH_AXES)}={shards}")
            params = jax.device_put(params, param_shardings(model_cfg, mesh))
            self.batch_sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
        self.model_cfg, self.params = model_cfg, params
        self.seq_len, self.batch_size, self.pad_id = seq_len, batch_size, pad_id

    def __call__(self, seqs: Sequence[Sequence[int]]) -> np.ndarray:
        return reward_scores(self.model_cfg, self.params, seqs, seq_len=self.seq_len, batch_size=self.batch_size,
                             pad_id=self.pad_id, batch_sharding=self.batch_sharding)


def rm_init_params(path, model_cfg: ModelConfig, mesh=None, seed: int = 0):
    """Starting params of a reward model from the checkpoint at ``path`` (glm5_jax.train.checkpoint
    .load_params): a reward model's checkpoint is read whole; a policy's (no reward head) gives the
    trunk, and the head is initialised from ``seed`` (the Dense of GLM5.reward_head, applied alone).
    ``path`` may also be a policy's params pytree in memory (the trunk; e.g. an experiment's previous stage)."""
    from glm5_jax.layers.common import Dense, dtype_of
    from glm5_jax.train.checkpoint import checkpoint_config, load_params
    import flax.linen as nn
    if isinstance(path, dict):
        params = dict(path)
    elif checkpoint_config(path).reward_head:
        return load_params(path, model_cfg, mesh)
    else:
        params = dict(load_params(path, model_cfg.replace(reward_head=False), mesh))
    c = model_cfg
    head = Dense(1, ("embed", None), c.initializer_range, jnp.float32, dtype_of(c.param_dtype), out_dtype=jnp.float32)
    params["reward_head"] = nn.unbox(head.init(jax.random.PRNGKey(seed), jnp.zeros((1, c.d_model), jnp.float32))["params"])
    return params


def train_reward_model(model_cfg: ModelConfig, tcfg, train_pairs: Sequence[tuple], eval_pairs: Sequence[tuple],
                       workdir: str, *, trunk=None, center_weight: float = 0.0, eval_batch_size: int = 64,
                       pad_id: int = 0, log=print, name: str = "reward_model", mesh=None) -> dict:
    """A reward model trained by the one loop (glm5_jax.train.train with make_rm_loss) on encoded
    (chosen, rejected) id pairs, evaluated on ``eval_pairs`` (evaluate_pairs, logged) at every eval and at
    the end. ``trunk``: a policy's params (or checkpoint path) the trunk starts from (rm_init_params; used
    only when ``workdir`` holds no checkpoint yet: a restart resumes from it). Returns train()'s output,
    with "final" the held-out metrics of the final params."""
    from glm5_jax.train import train
    seq = tcfg.seq_len

    def eval_fn(params):
        ev = evaluate_pairs(model_cfg, params, eval_pairs, seq_len=seq, batch_size=eval_batch_size, pad_id=pad_id)
        log(f"[{name}] held-out pairwise_accuracy {ev['pairwise_accuracy']:.3f} bt_loss {ev['eval_bt_loss']:.3f} "
            f"({ev['eval_pairs']} pairs)")
        return ev
    fresh = not os.path.isdir(os.path.join(workdir, "checkpoints"))
    init = rm_init_params(trunk, model_cfg, seed=tcfg.seed) if trunk is not None and fresh else None
    out = train(model_cfg, tcfg, PairIterator(train_pairs, tcfg.batch_size, seq, seed=tcfg.seed, pad_id=pad_id),
                workdir, init_params=init, eval_fn=eval_fn, log=log, name=name, mesh=mesh,
                loss_fn=make_rm_loss(model_cfg, center_weight))
    return {**out, "final": out["final"] or eval_fn(out["params"])}
