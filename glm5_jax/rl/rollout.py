"""Rollouts from the inference engine, the deliberate train/inference mismatch, and the training batch.

Token ids are never re-derived from text: ``generate`` returns ids and the log-probs it sampled them
with; the training batch is built from exactly those ids (prompt ids + generated ids), and text is
decoded only to *score* a completion with the task checker.

Training batch layout (all [B, S] with S = max_prompt_len + max_new_tokens - 1, fixed so the
jitted programs never recompile): row b holds ``prompt_b + generated_b`` (right-padded with 0);
``inputs = seq[:, :-1]``, ``targets = seq[:, 1:]``; the log-prob of ``targets[b, t]`` is read from
the logits at input position t. ``mask[b, t] = 1`` exactly for the generated tokens: t in
[p_b - 1, p_b - 1 + len_b) where p_b is the prompt length and len_b the generated length *including*
the stop token; prompt and padding positions are 0. ``infer_logp`` holds the inference engine's
log-probs at those positions (0 elsewhere).

Mismatch modes (``rollout_params``), applied only to the copy of the parameters the inference engine
samples with, while training stays float32:

* ``none``  identical parameters (infer_logp == old_logp up to kernel round-off);
* ``bf16``  every floating leaf rounded to bfloat16 and back;
* ``int8`` / ``int6`` / ``int5`` / ``int4`` / ``int3`` / ``int2``  symmetric per-output-channel fake
  quantisation (with that many bits; int2 is ternary) of every matrix (kernels [..., in, out]: one scale per output channel of each matrix,
  so every layer of a scanned stack and every expert has its own; embeddings: one scale per token
  row); vectors (norm scales, biases) are kept.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax import quant
from glm5_jax.infer import generate
from glm5_jax.optim import path_to_str
from glm5_jax.rl.tasks import aggregate_statuses

__all__ = ["MISMATCH_MODES", "fake_quant", "rollout_params", "Rollout", "collect_rollouts", "build_batch"]

MISMATCH_MODES = ("none", "bf16", "int8", "int6", "int5", "int4", "int3", "int2")
MATRIX_LEAVES = ("kernel", "embedding", "gate_proj", "up_proj", "down_proj")   # quantised by int* modes


def fake_quant(x, bits: int, axis: int):
    """Symmetric fake quantisation with one scale per index of ``axis`` (max |x| over the others):
    glm5_jax.quant's quantiser with one group spanning every other axis."""
    moved = jnp.moveaxis(x, axis, -1)
    flat = moved.reshape(-1, moved.shape[-1])                  # [rest, axis]: one group over `rest`
    q = quant.fake_quant(flat, quant.QuantConfig(bits=bits, group_size=0), "rollout weight")
    return jnp.moveaxis(q.reshape(moved.shape), -1, axis)


def rollout_params(params, mode: str = "none"):
    """The parameters the inference engine uses under mismatch ``mode`` (see module doc)."""
    if mode not in MISMATCH_MODES:
        raise ValueError(f"unknown mismatch mode {mode!r}; choose from {MISMATCH_MODES}")
    if mode == "none":
        return params
    return _rollout_params(params, mode)


def mismatch_params(params, mode: str):
    """The traced body of ``rollout_params`` (mode != "none"), for programs that also reshard the result
    (``glm5_jax.rl.rollout_engine.RolloutEngine.sync``)."""
    if mode == "none":
        return params
    if mode == "bf16":
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    bits = int(mode[3:])

    def q(path, x):
        # matrices by leaf name, not by ndim: a scanned stack's norm scales are [layers, D] but vectors
        if path[-1].key not in MATRIX_LEAVES or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        # one scale per output channel of each matrix: reduce over the input axis only, so leading
        # axes (a scanned stack's layers, the experts) each keep their own scales.
        # embedding [V, D]: one scale per token row
        if path_to_str(path).endswith("embedding"):
            return fake_quant(x, bits, 0)
        return quant.fake_quant(x, quant.QuantConfig(bits=bits, group_size=0), path_to_str(path))

    return jax.tree_util.tree_map_with_path(q, params)


_rollout_params = jax.jit(mismatch_params, static_argnums=1)


@dataclasses.dataclass
class Rollout:
    prompts: List[List[int]]       # [B] prompt ids (each prompt repeated group_size times, consecutive)
    tokens: np.ndarray             # int32 [B, N] generated ids, exactly as generated (0 after the end)
    infer_logp: np.ndarray         # float32 [B, N] the inference engine's log-probs (0 after the end)
    lengths: np.ndarray            # int32 [B] generated tokens incl. the stop token
    texts: List[str]               # decoded completions (for scoring / logging only)
    rewards: np.ndarray            # float32 [B]
    statuses: List[str]

    def status_summary(self) -> dict:
        return aggregate_statuses(list(zip(self.rewards.tolist(), self.statuses)))


def collect_rollouts(config, params, tasks: Sequence, vocab, *, group_size: int, max_new_tokens: int,
                     seed: int, temperature: float = 1.0, mismatch: str = "none", engine=None) -> Rollout:
    """``group_size`` samples per task from the inference engine (params under ``mismatch``), scored.
    engine: a synced ``RolloutEngine`` (glm5_jax.rl.rollout_engine; its mismatch mode, its mesh) samples
    instead of ``infer.generate`` on ``params`` (then None); the same sampling, so the same rollouts."""
    prompts = [vocab.encode(t.prompt, bos=True) for t in tasks for _ in range(group_size)]
    kw = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "stop_tokens": (vocab.newline_id,)}
    if engine is not None:
        if engine.mismatch != mismatch:
            raise ValueError(f"collect_rollouts: mismatch={mismatch!r} but the engine samples under {engine.mismatch!r}")
        res = engine.generate(prompts, **kw)
    else:
        res = generate(config, rollout_params(params, mismatch), prompts, **kw)
    texts = [vocab.decode(res.tokens[i, :res.lengths[i]]) for i in range(len(prompts))]
    scored = [tasks[i // group_size].score(txt) for i, txt in enumerate(texts)]
    return Rollout(prompts=prompts, tokens=np.asarray(res.tokens, np.int32),
                   infer_logp=np.asarray(res.logprobs, np.float32), lengths=np.asarray(res.lengths, np.int32),
                   texts=texts, rewards=np.array([r for r, _ in scored], np.float32),
                   statuses=[s for _, s in scored])


def build_batch(rollout: Rollout, advantages, max_prompt_len: int) -> dict:
    """Rollout -> numpy training batch (layout in the module doc); ``advantages`` [B]."""
    b, n = rollout.tokens.shape
    s = max_prompt_len + n - 1
    seq = np.zeros((b, s + 1), np.int32)
    mask = np.zeros((b, s), np.float32)
    infer = np.zeros((b, s), np.float32)
    for i, prompt in enumerate(rollout.prompts):
        p, length = len(prompt), int(rollout.lengths[i])
        if p > max_prompt_len:
            raise ValueError(f"prompt of {p} tokens exceeds max_prompt_len={max_prompt_len}")
        seq[i, :p] = prompt
        seq[i, p:p + length] = rollout.tokens[i, :length]
        mask[i, p - 1:p - 1 + length] = 1.0
        infer[i, p - 1:p - 1 + length] = rollout.infer_logp[i, :length]
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "mask": mask, "infer_logp": infer,
            "advantages": np.asarray(advantages, np.float32).reshape(b)}
