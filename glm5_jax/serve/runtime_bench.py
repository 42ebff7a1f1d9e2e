"""Paged runtime vs its one-row-per-slot policy on the same cache bytes (tools.bench_serve's `paged` entry).

Two workloads, every request present at the start (a capacity measurement):
  chat  many short prompts (16..64 tokens) with heavy-tailed outputs (log-normal, median 24, sigma 1.3)
  grpo  groups of n samples of one long prompt (GRPO rollouts), sampled at temperature 1
Two policies over one cache of `cache_tokens` positions:
  paged  pages of `page_size`, radix prefix sharing, as many running sequences as pages allow
         (max_running = cache_tokens // mean context, capped)
  slots  page_size = max_model_len, no sharing: each running sequence owns a whole max_model_len row, so
         cache_tokens // max_model_len run at once (the engine's behaviour before the paged runtime)
Per policy: output tokens/s, peak running sequences, prompt tokens computed (prefilled), steps, TTFT
p50 / p99 (start to first token). Greedy tokens of the two policies are compared on the chat workload.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from glm5_jax.infer.runtime import PagedRuntime, Seq


def chat_workload(n: int, vocab: int, seed: int, max_len: int) -> list:
    rng = np.random.default_rng(seed)
    outs = np.clip(np.round(np.exp(rng.normal(np.log(24.0), 1.3, n))), 2, max_len // 2).astype(int)
    return [Seq(rng.integers(3, vocab, int(rng.integers(16, 65))).tolist(), max_tokens=int(o), seed=i)
            for i, o in enumerate(outs)]


def grpo_workload(groups: int, n: int, prompt_len: int, out: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    seqs = []
    for g in range(groups):
        p = rng.integers(3, vocab, prompt_len).tolist()
        seqs += [Seq(list(p), temperature=1.0, seed=g * n + i, max_tokens=out) for i in range(n)]
    return seqs


def _fresh(seqs):
    return [Seq(list(s.prompt), temperature=s.temperature, seed=s.seed, max_tokens=s.max_tokens) for s in seqs]


def measure(rt: PagedRuntime, seqs: list) -> dict:
    """Run seqs to completion on rt (every step program compiled first) -> the policy's figures."""
    for w in rt.widths:                                       # every program compiled before the clock starts
        for tw in rt.table_widths:
            jax.block_until_ready(rt.run_program(w, False, rt.idle_args(w, tw)))
    if rt.radix is not None:
        rt.radix.evict(rt.num_pages)
    for k in ("steps", "tokens", "prefill_tokens", "decode_tokens", "preempted", "peak_running"):
        rt.stats[k] = 0
    for s in seqs:
        rt.add(s)
    first = {}
    t0 = time.perf_counter()
    while not all(s.finish for s in seqs):
        for seq, *_ in rt.step():
            first.setdefault(id(seq), time.perf_counter() - t0)
    wall = time.perf_counter() - t0
    ttft = np.array([first[id(s)] for s in seqs])
    out = sum(len(s.tokens) for s in seqs)
    return {"output_tokens_per_s": out / wall, "output_tokens": out, "wall_s": wall,
            "peak_running": rt.stats["peak_running"], "prompt_tokens_computed": rt.stats["prefill_tokens"],
            "steps": rt.stats["steps"], "preempted": rt.stats["preempted"],
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "max_running": rt.max_running, "page_size": rt.page_size, "cache_tokens": rt.num_pages * rt.page_size}


def compare(config, params, *, cache_tokens: int, max_model_len: int, page_size: int, budget: int, chat: list,
            grpo: list, max_running: int) -> dict:
    """{workload: {"paged": figures, "slots": figures, "speedup"}} on the same cache bytes."""
    result = {}
    for name, seqs in (("chat", chat), ("grpo", grpo)):
        row, runs = {}, {}
        slots = max(1, cache_tokens // max_model_len)
        for pol, kw in (("paged", dict(page_size=page_size, max_running=max_running, prefix_cache="radix")),
                        ("slots", dict(page_size=max_model_len, max_running=slots, prefix_cache="none"))):
            rt = PagedRuntime(config, params, max_model_len=max_model_len, kv_cache_tokens=cache_tokens,
                              max_num_batched_tokens=max(budget, kw["max_running"]), **kw)
            runs[pol] = _fresh(seqs)
            row[pol] = measure(rt, runs[pol])
        row["speedup"] = row["paged"]["output_tokens_per_s"] / row["slots"]["output_tokens_per_s"]
        if name == "chat":                                    # greedy: the two policies' tokens are equal
            row["greedy_tokens_equal"] = [s.tokens for s in runs["paged"]] == [s.tokens for s in runs["slots"]]
        result[name] = row
    return result
