"""Serving benchmark: a long-tail workload on the tiny model, continuous vs static batching vs Hugging Face
transformers `generate` on the same weights, with MTP speculation on and off, side by side in one run.

    python -m tools.bench_serve [--json] [--requests=64] [--rate=64] [--max_batch=8] [--seed=0]

Workload: `requests` requests with Poisson arrivals (`rate` per second), prompts of 8..32 random token
ids, output lengths from a heavy-tailed (log-normal, sigma 1.3, median 24, clipped to [2, 256]) law; every
request decodes exactly its length (ignore_eos, greedy). Policies:
  continuous      glm5_jax.serve.Engine: requests join between decode steps and leave when done
  static          the same engine admitting only into an empty batch: a batch runs to its longest row,
                  new requests wait (the policy of the rollout servers before the engine)
  continuous_mtp  continuous with MTP speculation (num_draft 2; random weights, so drafts are rarely
                  accepted: this row measures the machinery's cost, acceptance is reported beside it)
  hf_generate     transformers GlmMoeDsaForCausalLM.generate (torch, CPU, float32) on the same weights,
                  batches of up to max_batch requests that have arrived, each run to its longest row
Per policy: output tokens/s (generated tokens / (last finish - first arrival)), TTFT p50 / p99 (arrival to
first token), ITL p50 / p99 (between a request's consecutive tokens). The last line printed is one JSON
object with an entry per policy (`--json` prints only that).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time

from absl import app, flags

from glm5_jax.cli import main_wrapper, run

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_bool("json", False, "Print only the JSON object.")
    flags.DEFINE_integer("requests", 64, "Requests in the workload.")
    flags.DEFINE_float("rate", 64.0, "Poisson arrival rate (requests per second): above what the engine serves, so the figures are capacities.")
    flags.DEFINE_integer("max_batch", 8, "Cache slots (and HF batch size).")
    flags.DEFINE_integer("max_model_len", 320, "Context per request.")
    flags.DEFINE_float("out_median", 24.0, "Median output length (log-normal).")
    flags.DEFINE_float("out_sigma", 1.3, "Log-normal sigma of the output length (the tail).")
    flags.DEFINE_integer("out_max", 256, "Output lengths are clipped to [2, out_max].")
    flags.DEFINE_integer("seed", 0, "Workload and weights seed.")
    flags.DEFINE_list("policies", ["paged", "continuous", "static", "continuous_mtp", "hf_generate"], "Policies to run.")
    # the paged runtime vs its one-row-per-slot policy (glm5_jax.serve.runtime_bench), on one cache size
    flags.DEFINE_integer("kv_cache_tokens", 8192, "paged: cache positions both policies share (slots: kv_cache_tokens // max_model_len rows).")
    flags.DEFINE_integer("page_size", 16, "paged: tokens a page.")
    flags.DEFINE_integer("max_running", 32, "paged: sequences running at once.")
    flags.DEFINE_integer("max_num_batched_tokens", 256, "paged: token rows a step (decodes first, then prefill chunks).")
    flags.DEFINE_integer("chat_requests", 96, "paged: requests of the chat workload.")
    flags.DEFINE_integer("grpo_groups", 4, "paged: GRPO groups (n=8 samples of one prompt each).")
    flags.DEFINE_integer("grpo_prompt", 1000, "paged: prompt tokens of a GRPO group.")
    flags.DEFINE_integer("grpo_out", 32, "paged: tokens sampled per GRPO sample.")


def workload(n: int, rate: float, vocab: int, seed: int, median: float = 24.0, sigma: float = 1.3, out_max: int = 256):
    import numpy as np
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    arrivals -= arrivals[0]
    outs = np.clip(np.round(np.exp(rng.normal(np.log(median), sigma, n))), 2, out_max).astype(int)
    prompts = [rng.integers(3, vocab, int(rng.integers(8, 33))).tolist() for _ in range(n)]
    return [dict(arrival=float(a), prompt=p, max_tokens=int(o)) for a, p, o in zip(arrivals, prompts, outs)]


def summarize(records, t0):
    """records: [{arrival, first, times}] (absolute perf_counter seconds) -> the policy's figures."""
    import numpy as np
    ttft = np.array([r["first"] - (t0 + r["arrival"]) for r in records])
    itl = np.concatenate([np.diff(r["times"]) for r in records if len(r["times"]) > 1])
    gen = sum(len(r["times"]) for r in records)
    span = max(r["times"][-1] for r in records) - t0
    return {"output_tokens_per_s": gen / span, "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)), "itl_p50_s": float(np.percentile(itl, 50)),
            "itl_p99_s": float(np.percentile(itl, 99)), "generated_tokens": int(gen), "wall_s": float(span)}


def run_engine(config, params, reqs, *, batching, max_batch, max_model_len, speculative=0):
    from glm5_jax.serve.engine import Engine, SamplingParams
    eng = Engine(config, params, max_batch=max_batch, max_model_len=max_model_len, batching=batching,
                 speculative=speculative, max_queue=len(reqs) + 8, prefix_reuse=False)
    try:
        eng.warmup()
        eng.generate([r["prompt"] for r in reqs[:max_batch]],
                     SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))   # warm every path
        n0 = eng.compiled_programs()
        s0 = dict(eng.stats)
        handles = []
        t0 = time.perf_counter()
        for r in reqs:
            wait = t0 + r["arrival"] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            handles.append(eng.submit(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], temperature=0.0,
                                                                  ignore_eos=True)))
        for h in handles:
            h.result(3600)
        recs = [{"arrival": r["arrival"], "first": h.first_token_at, "times": h.token_times}
                for r, h in zip(reqs, handles)]
        out = summarize(recs, t0)
        out["recompiles"] = eng.compiled_programs() - n0
        st = {k: eng.stats[k] - s0.get(k, 0) for k in eng.stats}
        out.update(prefill_calls=int(st.get("prefills", 0)), decode_steps=int(st.get("steps", 0)),
                   prefill_s_total=float(st.get("prefill_s", 0)), decode_s_total=float(st.get("decode_s", 0)))
        if st.get("host_gaps"):          # the paged engine: host time between back-to-back steps
            out["host_gap_ms_mean"] = 1e3 * st["host_gap_s"] / st["host_gaps"]
            out["step_ms_mean"] = 1e3 * st["decode_s"] / max(st["steps"], 1)
        if speculative:
            out["acceptance_length"] = eng.acceptance["length"]
            out["acceptance_per_depth"] = eng.acceptance["per_depth"]
        return out
    finally:
        eng.shutdown()


class _Streamer:
    """transformers streamer: put() is called with the prompt, then once per step with the new tokens."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def run_hf(ckpt, reqs, *, max_batch):
    import torch
    from transformers import GlmMoeDsaForCausalLM
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float32).eval()

    def gen(batch):
        width = max(len(r["prompt"]) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):          # left padding, as generate expects
            ids[i, width - len(r["prompt"]):] = torch.tensor(r["prompt"])
            mask[i, width - len(r["prompt"]):] = 1
        st = _Streamer()
        n = max(r["max_tokens"] for r in batch)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0, eos_token_id=None, streamer=st)
        return st.times[1:]

    gen(reqs[:2])                               # warm-up
    t0 = time.perf_counter()
    recs, i = [], 0
    while i < len(reqs):
        now = time.perf_counter() - t0
        if reqs[i]["arrival"] > now:
            time.sleep(reqs[i]["arrival"] - now)
            now = time.perf_counter() - t0
        batch = []
        while i < len(reqs) and len(batch) < max_batch and reqs[i]["arrival"] <= now:
            batch.append(reqs[i])
            i += 1
        times = gen(batch)
        for r in batch:
            t = times[:r["max_tokens"]]
            recs.append({"arrival": r["arrival"], "first": t[0], "times": t})
    return summarize(recs, t0)


@main_wrapper      # a Glm5Error / UsageError: one line on stderr, exit 2 (glm5_jax.cli)
def main(argv):
    del argv
    import jax
    import numpy as np

    from glm5_jax import hf, model
    from glm5_jax.config import preset

    config = preset("tiny", mtp_depth=1)
    params = model.init_params(config, jax.random.PRNGKey(FLAGS.seed))
    reqs = workload(FLAGS.requests, FLAGS.rate, config.vocab_size, FLAGS.seed, FLAGS.out_median, FLAGS.out_sigma,
                    FLAGS.out_max)
    result = {"workload": {"requests": len(reqs), "rate_per_s": FLAGS.rate, "max_batch": FLAGS.max_batch,
                           "output_tokens": int(sum(r["max_tokens"] for r in reqs)),
                           "output_len_p50": float(np.median([r["max_tokens"] for r in reqs])),
                           "output_len_max": int(max(r["max_tokens"] for r in reqs)),
                           "model": "tiny preset (random init), float32", "load_before": os.getloadavg()[0]}}
    kw = dict(max_batch=FLAGS.max_batch, max_model_len=FLAGS.max_model_len)
    for pol in FLAGS.policies:
        if not FLAGS.json:
            print(f"running {pol} ...", flush=True)
        if pol == "paged":
            from glm5_jax.serve import runtime_bench as rb
            cfg = config
            result[pol] = rb.compare(
                cfg, params, cache_tokens=FLAGS.kv_cache_tokens, max_model_len=FLAGS.grpo_prompt + FLAGS.grpo_out + 1,
                page_size=FLAGS.page_size, budget=FLAGS.max_num_batched_tokens, max_running=FLAGS.max_running,
                chat=rb.chat_workload(FLAGS.chat_requests, cfg.vocab_size, FLAGS.seed, 256),
                grpo=rb.grpo_workload(FLAGS.grpo_groups, 8, FLAGS.grpo_prompt, FLAGS.grpo_out, cfg.vocab_size, FLAGS.seed))
        elif pol == "continuous":
            result[pol] = run_engine(config, params, reqs, batching="continuous", **kw)
        elif pol == "static":
            result[pol] = run_engine(config, params, reqs, batching="static", **kw)
        elif pol == "continuous_mtp":
            result[pol] = run_engine(config, params, reqs, batching="continuous", speculative=2, **kw)
        elif pol == "static_mtp":
            result[pol] = run_engine(config, params, reqs, batching="static", speculative=2, **kw)
        elif pol == "hf_generate":
            missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
            if missing:      # the engine arms need nothing beyond the core install; this one needs .[fixtures]
                result[pol] = {"skipped": f"needs {' and '.join(missing)}: pip install -e '.[fixtures]'"}
                if not FLAGS.json:
                    print(f"  {pol}: skipped ({result[pol]['skipped']})", flush=True)
                continue
            with tempfile.TemporaryDirectory() as d:
                hf.save_checkpoint(config, params, d)
                result[pol] = run_hf(d, reqs, max_batch=FLAGS.max_batch)
        else:
            raise app.UsageError(f"unknown policy {pol!r}")
        if not FLAGS.json:
            print(f"  {pol}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                           for k, v in result[pol].items()), flush=True)
    if "continuous" in result and "static" in result:
        result["continuous_over_static"] = (result["continuous"]["output_tokens_per_s"]
                                            / result["static"]["output_tokens_per_s"])
    result["load_after"] = os.getloadavg()[0]
    print(json.dumps(result))


if __name__ == "__main__":
    run(main, define_flags)
