"""MTP draft acceptance: teacher-forced on held-out text (the evaluator's MTPAcceptance), speculative SAMPLING
at temperature 1 after held-out contexts, greedy self-speculative decoding (glm5_jax.infer), and the held-out
prompts / contexts / unigram level these are read against."""

from __future__ import annotations

import time

import jax
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.eval.evaluator import evaluate
from glm5_jax.eval.metrics import Logits, MTPAcceptance


def inference_model(cfg: ModelConfig, params, num_draft: int):
    """(config, params) that draft `num_draft` tokens: unshared blocks beyond the trained depth reuse the
    last trained block (shared configs already reuse their one block at every depth)."""
    if cfg.mtp_share or num_draft <= cfg.mtp_depth:
        return cfg, params
    extra = {f"mtp_{k}": params[f"mtp_{cfg.mtp_depth - 1}"] for k in range(cfg.mtp_depth, num_draft)}
    return cfg.replace(mtp_depth=num_draft), {**params, **extra}


def distinct_fraction(tokens: np.ndarray, lengths) -> np.ndarray:
    """[B] distinct tokens / generated tokens per row (rows of `tokens` cut at `lengths`)."""
    return np.array([len(set(row[:n].tolist())) / max(int(n), 1) for row, n in zip(np.asarray(tokens), lengths)])


def measure_acceptance(cfg: ModelConfig, params, prompts, num_draft: int, max_new_tokens: int) -> dict:
    """Greedy self-speculative decoding of the prompts with `num_draft` MTP drafts (glm5_jax.infer)."""
    from glm5_jax.infer import speculative_generate
    icfg, ip = inference_model(cfg, params, num_draft)
    t0 = time.time()
    r = speculative_generate(icfg, ip, prompts, max_new_tokens=max_new_tokens, num_draft=num_draft)
    distinct = float(np.mean(distinct_fraction(np.asarray(r.tokens), r.lengths)))
    return {"acceptance_length": float(r.acceptance_length), "verify_steps": int(r.verify_steps),
            "generated_tokens": int(np.sum(r.lengths)), "distinct_token_fraction": distinct,
            "time_s": time.time() - t0}


def greedy_by_prompt(cfg: ModelConfig, params, prompts, num_draft: int, max_new_tokens: int,
                     repetitive_below: float) -> dict:
    """Greedy self-speculative acceptance per prompt, split by whether the greedy continuation is
    repetitive (distinct-token fraction < repetitive_below), so loop-following is shown apart."""
    rows = [measure_acceptance(cfg, params, [p], num_draft, max_new_tokens) for p in prompts]
    rep = [r for r in rows if r["distinct_token_fraction"] < repetitive_below]
    non = [r for r in rows if r["distinct_token_fraction"] >= repetitive_below]
    mean = lambda rs: float(np.mean([r["acceptance_length"] for r in rs])) if rs else None
    return {"greedy_acceptance_repetitive": mean(rep), "greedy_acceptance_non_repetitive": mean(non),
            "greedy_prompts_repetitive": len(rep), "greedy_prompts_non_repetitive": len(non),
            "greedy_distinct_per_prompt": np.array([r["distinct_token_fraction"] for r in rows])}


def teacher_forced(cfg: ModelConfig, params, batches, num_draft: int) -> dict:
    """MTPAcceptance of `num_draft` drafts on held-out batches (drafting beyond the trained depth reuses a
    block: inference_model). Not distorted by greedy repetition, unlike self-speculation."""
    icfg, ip = inference_model(cfg, params, num_draft)
    return evaluate(icfg.replace(mtp_depth=num_draft), ip, batches, [MTPAcceptance(num_draft)])


def sampled_generation(cfg: ModelConfig, params, prompts, max_new_tokens: int, seed: int) -> dict:
    """Temperature-1 continuations of the held-out prompts (the decoding whose drafts the primary metric
    verifies): per-prompt distinct-token fraction; non-degenerate text does not repeat a few tokens."""
    from glm5_jax.infer import generate
    r = generate(cfg, params, [p.tolist() for p in prompts], max_new_tokens=max_new_tokens, temperature=1.0, seed=seed)
    return {"sampled_distinct_per_prompt": distinct_fraction(r.tokens, r.lengths)}


def speculative_accepts(p_draft: np.ndarray, q_draft: np.ndarray, u: np.ndarray) -> np.ndarray:
    """[N, K] 0/1 acceptance of K chained drafts (speculative-sampling verification): draft k, drawn from
    q with probability q_draft[:, k], is accepted iff u_j < min(1, p_j / q_j) for every j <= k (the chain
    stops at the first rejection). p_draft: the target's probability of each draft; u ~ U[0, 1)."""
    ok = u < np.minimum(1.0, p_draft / np.maximum(q_draft, 1e-30))
    return np.cumprod(ok, axis=1).astype(np.float64)


def sampled_acceptance(cfg: ModelConfig, params, contexts: np.ndarray, num_draft: int, draws: int,
                       seed: int = 0) -> dict:
    """Speculative SAMPLING acceptance at temperature 1 after each held-out context (as in Leviathan et
    al. / DeepSeek-V3's MTP drafting): the main head samples the next token x1 ~ p; MTP depth k samples
    draft d_k ~ q_k given the trunk state and the tokens so far; the main model then scores every
    draft and d_k is accepted with probability min(1, p(d_k) / q_k(d_k)) while all before it were.
    Acceptance length = 1 + accepted drafts, averaged over contexts x draws (each draw independent).
    The committed context is real held-out text, so the figure is not inflated by the model's own
    repetitive continuations. Every forward goes through the evaluator (Logits with MTP)."""
    icfg, ip = inference_model(cfg, params, num_draft)
    icfg = icfg.replace(mtp_depth=num_draft)
    n, c = contexts.shape
    K = num_draft
    L = c + K + 1
    toks = np.zeros((n * draws, L), np.int32)
    toks[:, :c] = np.repeat(contexts, draws, axis=0)
    batch = {"positions": np.broadcast_to(np.arange(L, dtype=np.int32), toks.shape), "segment_ids": np.ones_like(toks)}
    fwd = lambda t: evaluate(icfg, ip, [{"tokens": t, **batch}], [Logits(mtp=True)])
    key = jax.random.PRNGKey(seed)
    t = c - 1
    out = fwd(toks)
    key, k0 = jax.random.split(key)
    toks[:, c] = np.asarray(jax.random.categorical(k0, out["logits"][:, t]))
    q_of_draft = np.zeros((n * draws, K))
    for k in range(K):               # depth k+1 at position t reads token t+k+1 and predicts t+k+2
        out = fwd(toks)
        logq = jax.nn.log_softmax(out["mtp_logits"][k][:, t], -1)
        key, kk = jax.random.split(key)
        d = np.asarray(jax.random.categorical(kk, logq))
        toks[:, c + 1 + k] = d
        q_of_draft[:, k] = np.exp(np.take_along_axis(np.asarray(logq), d[:, None], -1)[:, 0])
    logp = jax.nn.log_softmax(fwd(toks)["logits"], -1)          # [N, L, V]
    p_of_draft = np.stack([np.exp(np.asarray(logp[np.arange(n * draws), c + k, toks[:, c + 1 + k]]))
                           for k in range(K)], axis=1)
    key, ku = jax.random.split(key)
    accepted = speculative_accepts(p_of_draft, q_of_draft, np.asarray(jax.random.uniform(ku, p_of_draft.shape)))
    lengths = 1.0 + accepted.sum(1)
    return {"sampled_acceptance_length": float(lengths.mean()),
            "sampled_acceptance_by_depth": [float(x) for x in accepted.mean(0)],
            "sampled_per_context": lengths.reshape(n, draws).mean(1)}


def unigram_cross_entropy(train_tokens: np.ndarray, batches, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of the held-out batches' scored targets under the training split's
    add-one-smoothed unigram distribution: the level a model that ignores context would reach."""
    counts = np.bincount(np.asarray(train_tokens, np.int64), minlength=vocab_size)[:vocab_size] + 1.0
    logp = np.log(counts / counts.sum())
    num = den = 0.0
    for b in batches:
        m = np.asarray(b["loss_mask"]) > 0
        num -= float(logp[np.asarray(b["targets"])[m]].sum())
        den += float(m.sum())
    return num / max(den, 1.0)


def held_out_prompts(data, num: int, length: int) -> list[np.ndarray]:
    """The first `length` tokens of `num` held-out files of `data` (glm5_jax.data.LMData; those at least that
    long), evenly spread."""
    split = data.splits["eval"]
    long = [d for d in range(split.num_docs) if split.offsets[d + 1] - split.offsets[d] >= length]
    if not long:
        raise ValueError(f"no held-out file has >= {length} tokens; lower prompt_len")
    pick = [long[int(i)] for i in np.linspace(0, len(long) - 1, num=min(num, len(long)))]
    pick = list(dict.fromkeys(pick))
    return [np.asarray(split.doc(d)[:length], np.int32) for d in pick]


def held_out_contexts(data, num: int, length: int) -> np.ndarray:
    """[num', length] windows of held-out files (each within one file, positions 0..length-1), taken at
    offsets 0, length, 2*length, ... of the files at least that long, spread over the eval split."""
    split = data.splits["eval"]
    out = []
    for d in range(split.num_docs):
        doc = np.asarray(split.doc(d), np.int32)
        out += [doc[o:o + length] for o in range(0, len(doc) - length + 1, length)]
    if not out:
        raise ValueError(f"no held-out file has >= {length} tokens; lower prompt_len")
    pick = np.unique(np.linspace(0, len(out) - 1, num=min(num, len(out))).astype(int))
    return np.stack([out[i] for i in pick])


__all__ = ["distinct_fraction", "greedy_by_prompt", "held_out_contexts", "held_out_prompts", "inference_model",
           "measure_acceptance", "sampled_acceptance", "sampled_generation", "speculative_accepts", "teacher_forced",
           "unigram_cross_entropy"]
