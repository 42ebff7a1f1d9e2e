"""Batch generation on the paged runtime: `generate` (infer.generate) and `run_batch`, its driver.

There is one generation path (issue 65): `glm5_jax.infer.runtime.PagedRuntime`. `generate` and the RL
rollout engine (`glm5_jax.rl.rollout_engine.RolloutEngine.generate`, on its mesh with its synced rollout
copy) build a runtime sized for a batch (`batch_runtime_args`: one row of pages per prompt, every prompt
admitted at once, no prefix sharing, no preemption), add one `Seq` per prompt and step it to the end
(`run_batch`); the serving engine, the judge (through it) and the agentic servers run the same runtime.

Sampling: prompt b's i-th token is row b of one draw over the batch with the key
fold_in(PRNGKey(seed), i) (``Seq.key_row = b``; `sampling.batch_row_keys`), the scheme `generate` has
always had (one key folded per step, drawn over [B, V]), so a batch's tokens are what they were before the
runtime, while a served request (``key_row`` None) draws with its own key fold_in(PRNGKey(seed), i).
Greedy (temperature 0) is the argmax, so greedy tokens equal the serving runtime's for the same prompts.
Log-probs are those of the distribution drawn from (temperature, top-k, top-p applied; greedy: the model's
log-softmax at temperature 1).

Outputs: tokens past a row's end (after a stop token) are PAD_ID = 0 with log-prob 0.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Sequence

import numpy as np

from glm5_jax.infer import sampling
from glm5_jax.infer.decode import PAD_ID, PREFILL_CHUNK, GenerateResult, prefill_chunks, prepare_prompts, resolve_max_len
from glm5_jax.infer.runtime import PagedRuntime, Seq

__all__ = ["PAGE_SIZE", "SpeculativeResult", "acceptance_length", "batch_runtime_args", "generate", "run_batch",
           "speculative_generate"]

PAGE_SIZE = 16          # cache positions per page of a batch runtime


def batch_runtime_args(batch: int, prompt_len: int, size: int, prefill_chunk: int = PREFILL_CHUNK) -> dict:
    """PagedRuntime keyword arguments for `batch` prompts of at most `prompt_len` tokens in a cache of `size`
    positions each: every prompt running at once with a whole row of pages (no preemption, no prefix
    sharing), positions rounded up to whole pages and the prefill budget to whole pages of every prompt (so
    batches of nearby shapes share one runtime and its compiled steps), the prompts prefilled together in
    one step where that budget is within `prefill_chunk` tokens, and decode steps `batch` rows wide."""
    size = -(-int(size) // PAGE_SIZE) * PAGE_SIZE
    prompt = -(-int(prompt_len) // PAGE_SIZE) * PAGE_SIZE
    budget = max(int(batch), min(int(batch) * prompt, int(prefill_chunk)))
    return dict(max_running=int(batch), max_model_len=size, page_size=PAGE_SIZE, kv_cache_tokens=int(batch) * size,
                max_num_batched_tokens=budget, prefill_chunk=min(int(prefill_chunk), size), prefix_cache="none",
                widths=(int(batch),), table_widths="full")


def run_batch(runtime: PagedRuntime, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
              temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
              stop_tokens: Sequence[int] = (), batch_draw: bool = True) -> GenerateResult:
    """Each prompt (a token list) as row b of one batch (its i-th token drawn as row b of the batch draw with
    key fold_in(PRNGKey(seed), i); batch_draw=False: with its own key fold_in(PRNGKey(seed + b), i), as a
    served request with seed + b) on `runtime`, stepped until every row has finished -> GenerateResult
    (tokens and log-probs [B, max_new_tokens], PAD_ID / 0 after each row's end)."""
    b, n = len(prompts), int(max_new_tokens)
    seqs = [Seq(prompt=[int(t) for t in p], temperature=float(temperature), top_k=int(top_k), top_p=float(top_p),
                seed=int(seed) + (0 if batch_draw else i), max_tokens=n, stop_ids=tuple(int(t) for t in stop_tokens),
                prefix=False, key_row=i if batch_draw else None)
            for i, p in enumerate(prompts)]
    row = {id(s): i for i, s in enumerate(seqs)}
    toks = np.full((b, n), PAD_ID, np.int32)
    lps = np.zeros((b, n), np.float32)
    t0, steps0 = time.perf_counter(), runtime.stats["steps"]
    first = None
    for s in seqs:
        runtime.add(s)
    filled = [0] * b                     # tokens of each row so far (a speculative step gives several)
    while not all(s.finish for s in seqs):
        for seq, t, _, lp_s, _, _ in runtime.step():
            i = row[id(seq)]
            toks[i, filled[i]], lps[i, filled[i]] = t, lp_s
            filled[i] += 1
        first = first or time.perf_counter()
    t2 = time.perf_counter()
    lengths = np.array([len(s.tokens) for s in seqs], np.int32)
    return GenerateResult(tokens=toks, logprobs=lps, lengths=lengths,
                          finish_reasons=["stop" if s.finish == "stop" else "length" for s in seqs],
                          stats={"prefill_s": (first or t2) - t0, "decode_s": t2 - (first or t2),
                                 "prompt_tokens": int(sum(len(p) for p in prompts)),
                                 "generated_tokens": int(lengths.sum()), "steps": runtime.stats["steps"] - steps0})


_RUNTIMES: dict = {}             # (config, runtime arguments) -> PagedRuntime: its compiled steps serve later calls
_KEEP = 4
_LOCK = threading.Lock()


def _runtime(config, params, kw: dict) -> PagedRuntime:
    key = (config, tuple(sorted(kw.items())))
    rt = _RUNTIMES.pop(key, None)
    if rt is None:
        rt = PagedRuntime(config, params, **kw)
    else:
        rt.new_weights(params)
    _RUNTIMES[key] = rt                          # the most recent last
    while len(_RUNTIMES) > _KEEP:
        _RUNTIMES.pop(next(iter(_RUNTIMES)))
    return rt


def generate(config, params, prompts, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, stop_tokens: Sequence[int] = (), max_len: int | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> GenerateResult:
    """Sample up to max_new_tokens per prompt (temperature 0 = greedy) on the paged runtime (one device).

    prompts: int array [B, P] or a list of token-id lists (ragged). max_len: cache positions per prompt
    (default longest prompt + max_new_tokens); a request that needs more raises ValueError. stop_tokens: a
    row ends after emitting one (it is included in the output). prefill_chunk: the most prompt tokens a
    prefill step takes (`batch_runtime_args`). The runtime of a batch's shape is kept for later calls
    (the last few shapes), so repeated calls compile nothing again.
    """
    sampling.validate(temperature, top_p, top_k)
    tokens, lens = prepare_prompts(config, prompts)
    size = resolve_max_len(tokens.shape[1], max_new_tokens, max_len)
    prefill_chunks(tokens.shape[1], prefill_chunk)     # a bad prefill_chunk fails before any compilation
    kw = batch_runtime_args(tokens.shape[0], tokens.shape[1], size, prefill_chunk)
    rows = [list(r[:n]) for r, n in zip(tokens, lens)]
    with _LOCK:
        return run_batch(_runtime(config, params, kw), rows, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_p=top_p, top_k=top_k, seed=seed, stop_tokens=stop_tokens)


@dataclasses.dataclass
class SpeculativeResult(GenerateResult):
    acceptance_length: float = 0.0   # mean 1 + accepted drafts per (row, verification step)
    verify_steps: int = 0            # steps that verified drafts
    tokens_per_s: float = 0.0        # generated tokens / wall time after the first token


def speculative_generate(config, params, prompts, *, max_new_tokens: int, num_draft: int = 4,
                         stop_tokens: Sequence[int] = (), max_len: int | None = None,
                         temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                         prefill_chunk: int = PREFILL_CHUNK) -> SpeculativeResult:
    """MTP speculative decoding (glm5_jax.infer.speculative) on the paged runtime (`num_draft` drafts a step,
    one device). temperature 0 (default): greedy, the same outputs as generate(..., temperature=0).
    temperature > 0: sampled with rejection-sampling verification, the same output distribution as
    generate(..., temperature, top_p, top_k) (not the same samples: row b draws with its own key
    fold_in(PRNGKey(seed + b), i), as a served request with seed seed + b).
    stats: also verify_rows (verifications: (sequence, step) pairs), accepted_per_depth (verifications
    accepting >= k drafts, k = 1..num_draft) and acceptance_per_depth (the same / verify_rows)."""
    from glm5_jax.infer.speculative import check_num_draft
    sampling.validate(temperature, top_p, top_k)
    check_num_draft(config, num_draft)
    tokens, lens = prepare_prompts(config, prompts)
    size = resolve_max_len(tokens.shape[1], max_new_tokens, max_len)
    prefill_chunks(tokens.shape[1], prefill_chunk)     # a bad prefill_chunk fails before any compilation
    b, n = tokens.shape[0], int(num_draft)
    kw = batch_runtime_args(b, tokens.shape[1], size, prefill_chunk)
    rows = b * (1 + n)                   # a decode step: every sequence's next token and its drafts
    kw.update(num_draft=n, widths=(rows,), max_num_batched_tokens=max(kw["max_num_batched_tokens"], rows),
              kv_cache_tokens=b * -(-(kw["max_model_len"] + n) // PAGE_SIZE) * PAGE_SIZE)   # verify rows past the end
    with _LOCK:
        rt = _runtime(config, params, kw)
        st0 = {k: (list(v) if isinstance(v, list) else v) for k, v in rt.stats.items()}
        res = run_batch(rt, [list(r[:m]) for r, m in zip(tokens, lens)], max_new_tokens=max_new_tokens,
                        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop_tokens=stop_tokens,
                        batch_draw=False)
        v = rt.stats["verify_rows"] - st0["verify_rows"]
        acc = rt.stats["accepted"] - st0["accepted"]
        depth = [x - y for x, y in zip(rt.stats["accepted_per_depth"], st0["accepted_per_depth"])]
    gen = int(res.lengths.sum())
    stats = dict(res.stats, verify_rows=v, accepted_per_depth=depth,
                 acceptance_per_depth=[d / v if v else 0.0 for d in depth])
    return SpeculativeResult(tokens=res.tokens, logprobs=res.logprobs, lengths=res.lengths,
                             finish_reasons=res.finish_reasons, stats=stats,
                             acceptance_length=1.0 + acc / v if v else 0.0, verify_steps=res.stats["steps"],
                             tokens_per_s=gen / max(res.stats["decode_s"], 1e-9))


def acceptance_length(config, params, prompts, num_draft: int = 4, max_new_tokens: int = 64) -> float:
    """Mean tokens accepted per verification step (1 + accepted drafts) of greedy MTP speculation."""
    return speculative_generate(config, params, prompts, max_new_tokens=max_new_tokens,
                                num_draft=num_draft).acceptance_length
