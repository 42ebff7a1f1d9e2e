"""Throughput of tools.prepare_data's pipeline with 1, 2 and N workers, side by side in one run.

    python -m tools.bench_data [--docs=4000] [--words=150] [--shard_docs=250] [--workers=1,2,N]
        [--dedup=near,exact] [--filters=gopher] [--json]

Writes a synthetic corpus (--docs distinct documents of about --words pseudo-words, seed 0, plus 5%
exact and 5% near copies so the dedup stages have work), trains its sentencepiece tokenizer once, then
prepares it once per worker count (N: this machine's cores) into a fresh directory and reports, per
count: wall seconds of the pipeline (the Ray cluster is started, and its workers import the pipeline,
before the clock; it is shut down after),
documents/s and tokens/s (tokens written), and the peak resident memory of each worker process
(`ru_maxrss`; with 1 worker the stages run in this process, so that figure is this process's). The
speed-up of 2 workers over 1 is `scaling_1_to_2`. Time it on a quiet machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import numpy as np
from absl import app, flags

from glm5_jax.cli import main_wrapper, run

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("docs", 4000, "distinct documents in the corpus", lower_bound=10)
    flags.DEFINE_integer("words", 150, "mean words per document", lower_bound=10)
    flags.DEFINE_integer("shard_docs", 250, "documents per shard", lower_bound=1)
    flags.DEFINE_string("workers", "1,2,N", "comma list of worker counts (N: this machine's cores)")
    flags.DEFINE_string("dedup", "near,exact", "--dedup of the pipeline")
    flags.DEFINE_string("filters", "gopher", "--filters of the pipeline")
    flags.DEFINE_bool("json", False, "print one JSON object")


def write_corpus(path: str, docs: int, words: int, seed: int = 0) -> int:
    """A jsonl of `docs` pseudo-word documents plus 5% exact and 5% near (3% of words replaced) copies."""
    rng = np.random.default_rng(seed)
    vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(20_000)]
    texts = []
    for _ in range(docs):
        w = list(rng.choice(vocab, int(rng.integers(words // 2, words * 3 // 2))))
        texts.append(w)
    extra = []
    for j, src in enumerate(rng.choice(docs, docs // 10, replace=False)):
        w = list(texts[src])
        if j % 2:
            for i in rng.choice(len(w), max(1, len(w) * 3 // 100), replace=False):
                w[i] = str(rng.choice(vocab))
        extra.append(w)
    with open(path, "w") as fh:
        for w in texts + extra:
            fh.write(json.dumps({"text": "\n".join(" ".join(w[i:i + 12]) for i in range(0, len(w), 12))}) + "\n")
    return len(texts) + len(extra)


def _warm() -> None:
    """Import the pipeline's modules in a Ray worker (a one-time cost per worker, kept off the clock)."""
    import glm5_jax.data.prep.driver  # noqa: F401
    time.sleep(1.0)


def _counts(spec: str) -> list[int]:
    n = os.cpu_count() or 1
    out = []
    for x in spec.split(","):
        try:
            v = n if x.strip() == "N" else int(x)
        except ValueError:
            v = 0
        if v < 1:
            raise app.UsageError(f"--workers={spec}: expected a comma list of worker counts >= 1 or N (this machine's cores)")
        if v not in out:
            out.append(v)
    return out


def run_bench(docs: int, words: int, shard_docs: int, workers: list[int], dedup: str, filters: str) -> dict:
    from glm5_jax.data.clean import CleanConfig
    from glm5_jax.data.prep.driver import prepare
    tmp = tempfile.mkdtemp(prefix="bench_data-")
    try:
        corpus = os.path.join(tmp, "corpus.jsonl")
        n_docs = write_corpus(corpus, docs, words)
        split = lambda v: tuple(x for x in v.split(",") if x)
        clean = CleanConfig(dedup=split(dedup), filters=split(filters), min_words=10)
        first = prepare(corpus, "spm", os.path.join(tmp, "tok"), vocab_size=1000, quiet=True,
                        cache_dir=os.path.join(tmp, "cache"), workers=1, shard_docs=shard_docs)
        tokenizer = os.path.join(tmp, "tok", first["tokenizer_file"])
        rows = []
        for w in workers:
            ray_start = None
            if w > 1:
                import ray
                t = time.perf_counter()
                ray.init(num_cpus=w, include_dashboard=False, log_to_driver=False)
                ray.get([ray.remote(num_cpus=1)(_warm).remote() for _ in range(w)])
                ray_start = round(time.perf_counter() - t, 2)
            try:
                t = time.perf_counter()
                index = prepare(corpus, tokenizer, os.path.join(tmp, f"w{w}"), quiet=True, clean=clean, workers=w,
                                shard_docs=shard_docs)
                seconds = time.perf_counter() - t
            finally:
                if w > 1:
                    ray.shutdown()
            rows.append({"workers": w, "seconds": round(seconds, 2),
                         "documents_per_second": round(index["documents_in"] / seconds, 1),
                         "tokens_per_second": round(index["tokens_out"] / seconds, 1),
                         "stage_seconds": index["run"]["stage_seconds"],
                         "peak_rss_mb_per_worker": max(index["run"]["peak_rss_mb_per_worker"]),
                         "worker_processes": len(index["run"]["peak_rss_mb_per_worker"]),
                         "ray_start_seconds": ray_start, "documents_out": index["documents_out"],
                         "tokens_out": index["tokens_out"]})
        by = {r["workers"]: r for r in rows}
        out = {"documents_in": n_docs, "shards": -(-n_docs // shard_docs), "cpu_count": os.cpu_count(),
               "load_average_1min": round(os.getloadavg()[0], 2), "dedup": dedup, "filters": filters, "rows": rows}
        if 1 in by and 2 in by:
            out["scaling_1_to_2"] = round(by[2]["documents_per_second"] / by[1]["documents_per_second"], 3)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@main_wrapper      # a Glm5Error / UsageError: one line on stderr, exit 2 (glm5_jax.cli)
def main(argv):
    del argv
    res = run_bench(FLAGS.docs, FLAGS.words, FLAGS.shard_docs, _counts(FLAGS.workers), FLAGS.dedup, FLAGS.filters)
    if FLAGS.json:
        print(json.dumps(res))
        return 0
    print(f"{res['documents_in']} documents in {res['shards']} shards, {res['cpu_count']} cores, "
          f"load {res['load_average_1min']}")
    print(f"{'workers':>7} {'seconds':>8} {'docs/s':>9} {'tokens/s':>11} {'peak MiB/worker':>16}")
    for r in res["rows"]:
        print(f"{r['workers']:>7} {r['seconds']:>8} {r['documents_per_second']:>9} {r['tokens_per_second']:>11} "
              f"{r['peak_rss_mb_per_worker']:>16}")
    if "scaling_1_to_2" in res:
        print(f"1 -> 2 workers: x{res['scaling_1_to_2']}")
    return 0


if __name__ == "__main__":
    run(main, define_flags)
