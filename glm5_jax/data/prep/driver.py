"""`prepare`: the pipeline of tools.prepare_data, stage by stage on an executor (glm5_jax.data.prep.executor).

    plan     corpus -> shards of <= shard_docs documents in corpus order (plan.py); the tokenizer (trained
             here on the train split when "spm" / "hf", as before) is copied into OUT
    scan     per shard: filters, digests, MinHash band keys (scan.py)          [only when cleaning]
    dedup    the stages of --dedup in the order given (GLM-5: near,exact,semantic), each over what the
             earlier ones kept: exact / near per hash partition (dedup.py), semantic per shard and per
             cluster partition (semantic.py)
    tokenize per shard: OUT/shards/<shard>/ token caches (tokenize.py)
    finish   OUT/index.json (the shards, per split totals), cleaning.json, dropped.jsonl
Everything a stage produces is a file published by an atomic rename under OUT/_work (or OUT/shards),
and every task first checks whether its file exists: re-running the same command after a kill
resumes, redoing no finished shard or partition and reading no half-written one. OUT/_work/plan.json
records the settings; a re-run with other settings is refused. index.json is written last, so a
directory with index.json is complete (and `data.path=OUT` trains on it); _work is then removed."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import shutil
import sys
import time

import numpy as np

from glm5_jax import progress
from glm5_jax.data._cache import settings_key
from glm5_jax.data.clean import DROP_REASONS, FILTERS, CleanConfig
from glm5_jax.data.config import DataConfig
from glm5_jax.data.corpus import SPLITS, load_corpus
from glm5_jax.data.pipeline import check_vocab
from glm5_jax.data.prep import dedup, semantic
from glm5_jax.data.prep.executor import make_executor
from glm5_jax.data.prep.plan import DocKeys, plan_shards
from glm5_jax.data.prep.scan import scan_shard
from glm5_jax.data.prep.tokenize import tokenize_shard
from glm5_jax.data.sources import DataError
from glm5_jax.data.token_cache import INDEX, tokens_index
from glm5_jax.data.tokenizer import resolve_tokenizer

WORK = "_work"
PLAN = "plan.json"
DEFAULT_SHARD_DOCS = 10_000


def _write_json(path: str, obj) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def _remove_partial(out: str) -> None:
    """Drop the temporaries a killed run left (never read: only renamed files are)."""
    for p in glob.glob(os.path.join(out, "**", ".tmp-*"), recursive=True) + \
            glob.glob(os.path.join(out, "**", "*.tmp-*"), recursive=True):
        shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)


def _check_out(out: str, key: str) -> bool:
    """Whether `out` holds an unfinished run of these settings (resume); refuses any other non-empty one."""
    if os.path.exists(os.path.join(out, INDEX)):
        raise DataError(f"--out={out!r} already holds a prepared dataset; choose another directory or remove it")
    plan = os.path.join(out, WORK, PLAN)
    if os.path.exists(plan):
        with open(plan) as fh:
            if json.load(fh).get("key") == key:
                return True
        raise DataError(f"--out={out!r} holds an unfinished run with other settings ({plan}); re-run it with its "
                        "own flags to finish it, or choose another directory")
    if os.path.isdir(out) and os.listdir(out):
        raise DataError(f"--out={out!r} is a non-empty directory; choose an empty or new one")
    return False


def _semantic(ex, work, shards, clean: CleanConfig, prior, partitions) -> np.ndarray:
    res = ex.map(semantic.embed_shard, [(work, s, clean, tuple(prior)) for s in shards])
    counts = [r["count"] for r in res]
    total = sum(counts)
    if total < 2:
        return np.zeros([0, 2], np.int64)
    mean = sum(r["sum"] for r in res) / total                          # added in shard order
    k = min(total, clean.semantic_clusters or math.ceil(math.sqrt(total)))
    cents = semantic.initial_centroids(work, shards, counts, k, clean.seed, mean)
    for it in range(1, clean.kmeans_iters + 1):
        path = os.path.join(work, "semantic", f"centroids_{it}.npy")
        if os.path.exists(path):
            cents = np.load(path)
            continue
        steps = ex.map(semantic.kmeans_step, [(work, s, cents, mean) for s in shards])
        sums = sum(x[0] for x in steps)
        new = semantic.update_centroids(cents, sums, sum(x[1] for x in steps))
        dedup.save_atomic(path, new)
        converged = np.array_equal(new, cents)
        cents = new
        if converged:
            break
    ex.map(semantic.assign_shard, [(work, s, cents, mean, partitions) for s in shards])
    ex.map(semantic.semantic_partition, [(work, shards, r, mean, clean.semantic_threshold) for r in range(partitions)])
    return dedup.merge_partitions(work, "semantic", partitions)


def _dedup_stage(ex, work, shards, clean: CleanConfig, stage: str, done: tuple, partitions: int,
                 quiet: bool = False) -> np.ndarray:
    """Run one dedup stage over what the `done` stages kept (unless finished); its removal list."""
    path = dedup.removed_path(work, stage)
    if not os.path.exists(path):
        if stage in ("exact", "near"):
            fn, extra = (dedup.exact_partition, ()) if stage == "exact" else (dedup.near_partition, (clean.near_threshold,))
            with progress.bar(partitions, desc=f"prepare_data: {stage} dedup", unit="partition", quiet=quiet) as bar:
                ex.map(fn, [(work, shards, r, done, *extra) for r in range(partitions)], lambda i: bar.update(1))
            pairs = dedup.merge_partitions(work, stage, partitions)
        else:
            with progress.heartbeat("prepare_data: semantic dedup (embed, k-means, assign)", quiet=quiet):
                pairs = _semantic(ex, work, shards, clean, done, partitions)
        dedup.save_atomic(path, pairs)
    return np.load(path)


def _log(quiet: bool, msg: str) -> None:
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


def _progress(quiet: bool, desc: str, shards) -> tuple:
    """A bar over the documents of `shards` (done / total, documents/s, ETA on stderr) and the on_done(i)
    that advances it by shard i's documents -> (bar, on_done)."""
    bar = progress.bar(total=sum(s.num_docs for s in shards), desc=f"prepare_data: {desc}", unit="doc",
                       quiet=quiet, postfix=f"0/{len(shards)} shards")
    done = [0]

    def on_done(i: int) -> None:
        done[0] += 1
        bar.set_postfix_str(f"{done[0]}/{len(shards)} shards", refresh=False)
        bar.update(shards[i].num_docs)
    return bar, on_done


def prepare(input: str, tokenizer: str, out: str, *, vocab_size: int | None = None, text_field: str = "text",
            messages_field: str = "messages", eval_fraction: float = 0.02, max_files: int | None = None,
            max_bytes: int | None = None, cache_dir: str | None = None, quiet: bool = False,
            clean: CleanConfig | None = None, workers: int = 1, ray_address: str | None = None,
            shard_docs: int = DEFAULT_SHARD_DOCS) -> dict:
    """Clean and tokenize `input` into sharded token caches under `out` (module docstring); returns the
    index (index.json), with the cleaning summary's fields at its top level when `clean` is active, and
    `run` (workers, seconds, stage seconds, peak memory per worker process)."""
    t0 = time.perf_counter()
    if shard_docs < 1:
        raise DataError(f"--shard_docs={shard_docs} is invalid: must be an integer >= 1")
    kw = dict(path=input, tokenizer=tokenizer, text_field=text_field, messages_field=messages_field,
              eval_fraction=eval_fraction, max_files=max_files, max_bytes=max_bytes, cache_dir=cache_dir)
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    cfg = DataConfig(**kw)
    if cfg.tokenizer_kind == "path" and vocab_size is None:
        cfg = DataConfig(**{**kw, "vocab_size": 1 << 24})   # any loaded vocabulary is fine here
    clean = clean or CleanConfig()
    if "semantic" in clean.dedup:
        semantic.check_embedder(clean)
    corpus = load_corpus(cfg)
    tok = resolve_tokenizer(cfg, corpus)
    check_vocab(tok, cfg)
    key = settings_key({"corpus": corpus.fingerprint(), "tokenizer": tok.fingerprint, "shard_docs": shard_docs,
                        "clean": dataclasses.asdict(clean) if clean.active else None})
    resume = _check_out(out, key)
    work = os.path.join(out, WORK)
    os.makedirs(work, exist_ok=True)
    if resume:
        _remove_partial(out)
        _log(quiet, f"prepare_data: resuming the unfinished run in {out}")
    _write_json(os.path.join(work, PLAN), {"key": key, "input": input, "shard_docs": shard_docs})  # first: resumable
    name = os.path.basename(tok.model_path)
    tok_copy = os.path.join(out, name)
    if not os.path.exists(tok_copy):
        shutil.copyfile(tok.model_path, tok_copy + ".tmp-copy")
        os.replace(tok_copy + ".tmp-copy", tok_copy)
    shards = plan_shards(corpus, shard_docs)
    partitions = len(shards)
    ex = make_executor(workers, ray_address)
    seconds, filtered = {}, {f: 0 for f in clean.filters}
    removed = {}
    try:
        if clean.active:
            t = time.perf_counter()
            bar, on_done = _progress(quiet, "scan", shards)
            for counts in ex.map(scan_shard, [(work, s, clean, partitions) for s in shards], on_done):
                for f in clean.filters:
                    filtered[f] += counts[f]
            bar.close()
            seconds["scan"] = round(time.perf_counter() - t, 3)
        done: list[str] = []
        for stage in clean.dedup:
            t = time.perf_counter()
            removed[stage] = _dedup_stage(ex, work, shards, clean, stage, tuple(done), partitions, quiet)
            done.append(stage)
            seconds[stage] = round(time.perf_counter() - t, 3)
            _log(quiet, f"prepare_data: {stage} dedup removed {len(removed[stage])} documents ({seconds[stage]} s)")
        t = time.perf_counter()
        bar, on_done = _progress(quiet, "tokenize", shards)
        stats = ex.map(tokenize_shard, [(out, work, s, tok_copy, tuple(done), clean.active) for s in shards], on_done)
        bar.close()
        seconds["tokenize"] = round(time.perf_counter() - t, 3)
    finally:
        ex.close()
    index = tokens_index(tok, corpus, {"tokenizer_file": name, "input": input})
    index["shards"] = [{"dir": f"shards/{s.name}", **{sp: {k: st[sp][k] for k in ("documents", "tokens")}
                                                       for sp in SPLITS}} for s, st in zip(shards, stats)]
    for sp in SPLITS:
        n = sum(st[sp]["tokens"] for st in stats)
        b = sum(st[sp]["text_bytes"] for st in stats)
        index[sp] = {"documents": sum(st[sp]["documents"] for st in stats), "tokens": n, "text_bytes": b,
                     "bytes_per_token": round(b / n, 4) if n else None}
    index["tokenize_seconds"] = seconds["tokenize"]
    total_s = time.perf_counter() - t0
    if clean.active:
        summary = _summary(corpus.num_documents(), removed, filtered, index, total_s, clean)
        _write_json(os.path.join(out, "cleaning.json"), summary)
        _write_dropped(out, work, shards, removed, DocKeys(corpus))
        index.update(summary)
    index["run"] = {"workers": ex.workers, "shards": len(shards), "seconds": round(total_s, 3),
                    "stage_seconds": seconds,
                    "peak_rss_mb_per_worker": sorted(ex.peak_rss_mb.values(), reverse=True)}
    _write_json(os.path.join(out, INDEX), index)
    shutil.rmtree(work, ignore_errors=True)
    return index


def _summary(documents_in, removed, filtered, index, seconds, clean: CleanConfig) -> dict:
    dups = {f"{DROP_REASONS[k].split('_')[0]}_duplicates": len(removed.get(k, ())) for k in DROP_REASONS}
    out = index["train"]["documents"] + index["eval"]["documents"]
    return {"documents_in": documents_in, **dups, "filtered": filtered, "documents_out": out,
            "tokens_out": index["train"]["tokens"] + index["eval"]["tokens"],
            "documents_per_second": round(documents_in / seconds, 1) if seconds > 0 else None,
            "settings": dataclasses.asdict(clean)}


def _write_dropped(out, work, shards, removed, key_of: DocKeys) -> None:
    """OUT/dropped.jsonl in corpus order: key, reason, the kept document it duplicates (None: a filter)."""
    rows = [(int(g), DROP_REASONS[stage], int(k)) for stage, pairs in removed.items() for g, k in pairs.tolist()]
    for s in shards:
        p = os.path.join(work, "scan", s.name, "filtered.npy")
        if os.path.exists(p):
            codes = np.load(p)
            rows += [(s.first + int(i), FILTERS[codes[i] - 1], None) for i in np.flatnonzero(codes)]
    with open(os.path.join(out, "dropped.jsonl"), "w") as fh:
        fh.writelines(json.dumps({"key": key_of(g), "reason": why,
                                  "duplicate_of": None if other is None else key_of(other)}) + "\n"
                      for g, why, other in sorted(rows, key=lambda r: r[0]))
