"""Clean and tokenize a dataset once into a sharded directory that training reads.

    python -m tools.prepare_data --input='corpus/*.jsonl.gz' --tokenizer=glm5/tokenizer.json --out=data/prepared
        [--workers=N | --ray_address=HOST:PORT] [--shard_docs=10000]
        [--vocab_size=N] [--text_field=text] [--messages_field=messages] [--eval_fraction=0.02]
        [--max_files=N] [--max_bytes=N] [--cache_dir=DIR] [--json]
        [--dedup=near,exact,semantic] [--near_threshold=0.8] [--shingle_words=2] [--num_perm=128]
        [--embed_model=CKPT] [--embed_tokenizer=PATH] [--semantic_threshold=0.9] [--semantic_clusters=K]
        [--filters=gopher | length,alpha,dup_lines,top_ngram,dup_ngram] [--min_words=50] [--max_words=100000]
        [--min_alpha_fraction=0.8] [--max_dup_line_fraction=0.3] [--max_top_ngram_fraction=0.2]
        [--max_dup_ngram_fraction=0.1]
    python -m experiments.run --config=pretrain --set data.path=data/prepared --set data.vocab_size=N

--input: a glob, file, directory or comma-separated list (text / jsonl(.gz) / parquet / ArrayRecord; the
format comes from the extension, glm5_jax.data.sources). --tokenizer: a sentencepiece .model or a
Hugging Face tokenizer.json (file or directory), or "spm" / "hf" to train one here on the train split
(--vocab_size). The same corpus (document-level held-out split), tokenizer and token-cache writer as
training's own cache (glm5_jax.data.token_cache): the output is one such cache per shard of
--shard_docs documents (OUT/shards/NNNNN/), an index.json listing them, and a copy of the tokenizer, so
`data.path=OUT` trains on it without the tokenizer or the raw files, and a multi-host run reads its own
shards on each host.

Engine (glm5_jax.data.prep): the stages run as Ray tasks on a local cluster of --workers CPUs (default:
this machine's cores), or on a running cluster with --ray_address=HOST:PORT (OUT on a filesystem every
node mounts); --workers=1 runs them in this process without Ray. The output does not depend on the
workers. Killed, the same command resumes: finished shards are kept, half-written ones discarded.

Cleaning (glm5_jax.data.clean; off unless asked, so by default the directory holds exactly the input):
--filters drops documents that fail Gopher-style quality rules; --dedup runs its stages in the order
given (GLM-5's: near,exact,semantic), each over what the earlier kept, keeping the first document
(corpus order) of each duplicate group: near = MinHash LSH over word shingles (Jaccard >=
--near_threshold), exact = digest of the normalised text, semantic = SemDeDup on the mean-pooled trunk
embeddings of --embed_model (a Hugging Face folder, an orbax params checkpoint or a run workdir, with
its own tokenizer), k-means, cosine > --semantic_threshold within a cluster. The summary then holds
documents_in, exact_duplicates, near_duplicates, semantic_duplicates, filtered (per filter),
documents_out, tokens_out and documents_per_second; OUT/cleaning.json holds it too, and
OUT/dropped.jsonl one line per dropped document (key, reason, the kept document it duplicates).

Progress goes to stderr while it works (glm5_jax.progress): per stage, documents and shards done, the rate
and an ETA (dedup: partitions done); with --json it is off, so stdout holds only the JSON. The summary
(documents, tokens, bytes/token per split) is printed at the end (with --json: one JSON object on stdout).
A bad input or flag gives one error line naming what is wrong, and exit status 2.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from glm5_jax.cli import main_wrapper
from glm5_jax.data.clean import FILTERS, CleanConfig
from glm5_jax.data.prep.driver import DEFAULT_SHARD_DOCS, prepare
from glm5_jax.data.token_cache import summary_line
from tools.flagparse import parse

__all__ = ["define_flags", "main", "prepare"]


def define_flags(fv: flags.FlagValues) -> None:
    """This CLI's flags, defined into `fv` (its own FlagValues, so it never collides with another tool's)."""
    d = CleanConfig()
    S, I, F = flags.DEFINE_string, flags.DEFINE_integer, flags.DEFINE_float
    S("input", None, "files: glob, file, directory or comma list", flag_values=fv, required=True)
    S("tokenizer", None, "sentencepiece .model / tokenizer.json (file or folder), or spm / hf to train one here",
      flag_values=fv, required=True)
    S("out", None, "output directory (new or empty, or an unfinished run of the same command)", flag_values=fv,
      required=True)
    I("vocab_size", None, "size of a tokenizer trained here (spm / hf); with a tokenizer path: refuse one larger "
      "than this", flag_values=fv)
    S("text_field", "text", "record field holding the text", flag_values=fv)
    S("messages_field", "messages", "record field holding chat messages", flag_values=fv)
    F("eval_fraction", 0.02, "held-out share of documents", flag_values=fv)
    I("max_files", None, "use at most this many files (a prefix by relative path)", flag_values=fv)
    I("max_bytes", None, "use files up to this many bytes (a prefix)", flag_values=fv)
    S("cache_dir", None, "where a tokenizer trained here is cached", flag_values=fv)
    flags.DEFINE_bool("json", False, "print the summary as one JSON object", flag_values=fv)
    I("workers", os.cpu_count() or 1, "Ray workers (CPUs) of the local cluster; 1 = run in this process",
      lower_bound=1, flag_values=fv)
    S("ray_address", None, "join this Ray cluster (HOST:PORT or auto) instead of starting one", flag_values=fv)
    I("shard_docs", DEFAULT_SHARD_DOCS, "documents per shard", lower_bound=1, flag_values=fv)
    S("dedup", "", "comma list of near, exact, semantic, run in that order (default: none)", flag_values=fv)
    F("near_threshold", d.near_threshold, "Jaccard similarity of a near-duplicate", flag_values=fv)
    I("shingle_words", d.shingle_words, "words per shingle (near)", flag_values=fv)
    I("num_perm", d.num_perm, "MinHash permutations (near)", flag_values=fv)
    S("embed_model", None, "semantic: checkpoint whose trunk embeds documents (HF folder, orbax params, run "
      "workdir)", flag_values=fv)
    S("embed_tokenizer", None, "semantic: the checkpoint's tokenizer (default: the one stored with it)",
      flag_values=fv)
    F("semantic_threshold", d.semantic_threshold, "semantic: cosine similarity above which a document is a "
      "duplicate of an earlier one in its cluster", flag_values=fv)
    I("semantic_clusters", d.semantic_clusters, "semantic: k-means clusters (0: sqrt of the documents)",
      flag_values=fv)
    I("kmeans_iters", d.kmeans_iters, "semantic: at most this many k-means iterations", flag_values=fv)
    I("embed_max_tokens", d.embed_max_tokens, "semantic: tokens of a document embedded", flag_values=fv)
    I("embed_batch", d.embed_batch, "semantic: documents per embedding forward", flag_values=fv)
    S("filters", "", "gopher, or a comma list of " + ", ".join(FILTERS) + " (default: none)", flag_values=fv)
    for f in ("min_words", "max_words"):
        I(f, getattr(d, f), f"filter threshold ({f})", flag_values=fv)
    for f in ("min_alpha_fraction", "max_dup_line_fraction", "max_top_ngram_fraction", "max_dup_ngram_fraction"):
        F(f, getattr(d, f), f"filter threshold ({f})", flag_values=fv)


def _split(v: str) -> tuple:
    return tuple(x.strip() for x in v.split(",") if x.strip())


@main_wrapper(also=(OSError,))    # a bad setting or input (Glm5Error), a missing file: one line, exit 2
def main(argv=None) -> int:
    """argv: the flags (without the program name; default sys.argv[1:])."""
    fv = flags.FlagValues()
    define_flags(fv)
    rest = parse(fv, "tools.prepare_data", argv)
    if isinstance(rest, int):          # --help (0) or a bad flag (2)
        return rest
    a = fv
    clean = CleanConfig(dedup=_split(a.dedup), filters=_split(a.filters), near_threshold=a.near_threshold,
                        shingle_words=a.shingle_words, num_perm=a.num_perm, min_words=a.min_words,
                        max_words=a.max_words, min_alpha_fraction=a.min_alpha_fraction,
                        max_dup_line_fraction=a.max_dup_line_fraction,
                        max_top_ngram_fraction=a.max_top_ngram_fraction,
                        max_dup_ngram_fraction=a.max_dup_ngram_fraction, embed_model=a.embed_model,
                        embed_tokenizer=a.embed_tokenizer, semantic_threshold=a.semantic_threshold,
                        semantic_clusters=a.semantic_clusters, kmeans_iters=a.kmeans_iters,
                        embed_max_tokens=a.embed_max_tokens, embed_batch=a.embed_batch)
    index = prepare(a.input, a.tokenizer, a.out, vocab_size=a.vocab_size, text_field=a.text_field,
                    messages_field=a.messages_field, eval_fraction=a.eval_fraction, max_files=a.max_files,
                    max_bytes=a.max_bytes, cache_dir=a.cache_dir, clean=clean, workers=a.workers,
                    ray_address=a.ray_address, shard_docs=a.shard_docs, quiet=a.json)
    if a.json:
        print(json.dumps(index))
    else:
        print(f"{a.out}: {index['num_files']} files in {len(index['shards'])} shards, tokenizer {index['tokenizer']} "
              f"(vocab {index['vocab_size']}, {index['dtype']})\n" + summary_line(index))
        if "documents_in" in index:
            print(f"cleaning: {index['documents_in']} documents in, {index['near_duplicates']} near, "
                  f"{index['exact_duplicates']} exact and {index['semantic_duplicates']} semantic duplicates, "
                  f"filtered {index['filtered']}, {index['documents_out']} out "
                  f"({index['documents_per_second']} documents/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
