"""Tokenize a dataset once into a directory that training memory-maps.

    python -m tools.prepare_data --input='corpus/*.jsonl.gz' --tokenizer=glm5/tokenizer.json --out=data/prepared
        [--vocab_size=N] [--text_field=text] [--messages_field=messages] [--eval_fraction=0.02]
        [--max_files=N] [--max_bytes=N] [--cache_dir=DIR] [--json]
        [--dedup=exact,near] [--near_threshold=0.8] [--shingle_words=5] [--num_perm=128]
        [--filters=gopher | length,alpha,dup_lines,top_ngram,dup_ngram] [--min_words=50] [--max_words=100000]
        [--min_alpha_fraction=0.8] [--max_dup_line_fraction=0.3] [--max_top_ngram_fraction=0.2]
        [--max_dup_ngram_fraction=0.1]
    python -m experiments.run --config=pretrain --set data.path=data/prepared --set data.vocab_size=N

--input: a glob, file, directory or comma-separated list (text / jsonl(.gz) / parquet / ArrayRecord; the
format comes from the extension, glm5_jax.data.sources). --tokenizer: a sentencepiece .model or a
Hugging Face tokenizer.json (file or directory), or "spm" / "hf" to train one here on the train split
(--vocab_size). The same corpus (document-level held-out split), tokenizer and writer as training's
own token cache (glm5_jax.data.token_cache.write_tokens): the output is that cache's layout, plus a
copy of the tokenizer file, so `data.path=OUT` trains on it without the tokenizer or the raw files.

Cleaning (glm5_jax.data.clean; off unless asked, so by default the directory holds exactly the input):
--dedup=exact,near drops exact copies (digest of the normalised text) and near-duplicates (MinHash over
word shingles, LSH, Jaccard >= --near_threshold), keeping the first document of each cluster in corpus
order; --filters drops documents that fail Gopher-style quality rules (thresholds are flags). The
summary then holds documents_in, exact_duplicates, near_duplicates, filtered (per filter),
documents_out, tokens_out and documents_per_second; OUT/cleaning.json holds it too, and
OUT/dropped.jsonl one line per dropped document (key, reason, the kept document it duplicates).

A progress line (documents, tokens, rate, ETA) goes to stderr; the summary (documents, tokens,
bytes/token per split) is printed at the end (with --json: one JSON object on stdout). A bad input gives
one error line naming the file and what is wrong, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from glm5_jax.cli import main_wrapper
from glm5_jax.data.clean import FILTERS, CleanConfig, DocumentCleaner
from glm5_jax.data.config import DataConfig
from glm5_jax.data.corpus import load_corpus
from glm5_jax.data.pipeline import check_vocab
from glm5_jax.data.sources import DataError
from glm5_jax.data.token_cache import INDEX, summary_line, write_tokens
from glm5_jax.data.tokenizer import resolve_tokenizer


def prepare(input: str, tokenizer: str, out: str, *, vocab_size: int | None = None, text_field: str = "text",
            messages_field: str = "messages", eval_fraction: float = 0.02, max_files: int | None = None,
            max_bytes: int | None = None, cache_dir: str | None = None, quiet: bool = False,
            clean: CleanConfig | None = None) -> dict:
    """Tokenize `input` with `tokenizer` into `out` (refused if `out` already holds a prepared dataset);
    returns the index (index.json), with the cleaning summary's fields at its top level when `clean`
    removes anything (dedup or filters)."""
    if os.path.exists(os.path.join(out, INDEX)):
        raise DataError(f"--out={out!r} already holds a prepared dataset; choose another directory or remove it")
    if os.path.isdir(out) and os.listdir(out):
        raise DataError(f"--out={out!r} is a non-empty directory; choose an empty or new one")
    kw = dict(path=input, tokenizer=tokenizer, text_field=text_field, messages_field=messages_field,
              eval_fraction=eval_fraction, max_files=max_files, max_bytes=max_bytes, cache_dir=cache_dir)
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    cfg = DataConfig(**kw)
    if cfg.tokenizer_kind == "path" and vocab_size is None:
        cfg = DataConfig(**{**kw, "vocab_size": 1 << 24})   # any loaded vocabulary is fine here
    corpus = load_corpus(cfg)
    tok = resolve_tokenizer(cfg, corpus)
    check_vocab(tok, cfg)
    os.makedirs(out, exist_ok=True)
    name = os.path.basename(tok.model_path)
    shutil.copyfile(tok.model_path, os.path.join(out, name))
    cleaner = DocumentCleaner(clean) if clean is not None and clean.active else None
    drop = (lambda doc: cleaner.reason(doc.key, doc.plain_text())) if cleaner else None
    index = write_tokens(tok, corpus, out, quiet=quiet, extra={"tokenizer_file": name, "input": input}, drop=drop)
    if cleaner is None:
        return index
    summary = cleaner.summary(index["train"]["tokens"] + index["eval"]["tokens"])
    with open(os.path.join(out, "cleaning.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    with open(os.path.join(out, "dropped.jsonl"), "w") as fh:
        for key, why, other in cleaner.dropped:
            fh.write(json.dumps({"key": key, "reason": why, "duplicate_of": other}) + "\n")
    index.update(summary)
    with open(os.path.join(out, INDEX), "w") as fh:
        json.dump(index, fh, indent=1)
    return index


@main_wrapper(also=(OSError,))    # a bad setting or input (Glm5Error), a missing file: one line, exit 2
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab_size", type=int, default=None, help="size of a tokenizer trained here (spm / hf); "
                    "with a tokenizer path: refuse one larger than this")
    ap.add_argument("--text_field", default="text")
    ap.add_argument("--messages_field", default="messages")
    ap.add_argument("--eval_fraction", type=float, default=0.02)
    ap.add_argument("--max_files", type=int, default=None)
    ap.add_argument("--max_bytes", type=int, default=None)
    ap.add_argument("--cache_dir", default=None, help="where a tokenizer trained here is cached")
    ap.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    d = CleanConfig()
    ap.add_argument("--dedup", default="", help="comma list of exact, near (default: none)")
    ap.add_argument("--near_threshold", type=float, default=d.near_threshold, help="Jaccard similarity of a near-duplicate")
    ap.add_argument("--shingle_words", type=int, default=d.shingle_words, help="words per shingle (near)")
    ap.add_argument("--num_perm", type=int, default=d.num_perm, help="MinHash permutations (near)")
    ap.add_argument("--filters", default="", help="gopher, or a comma list of " + ", ".join(FILTERS) + " (default: none)")
    for f in ("min_words", "max_words"):
        ap.add_argument(f"--{f}", type=int, default=getattr(d, f))
    for f in ("min_alpha_fraction", "max_dup_line_fraction", "max_top_ngram_fraction", "max_dup_ngram_fraction"):
        ap.add_argument(f"--{f}", type=float, default=getattr(d, f))
    a = ap.parse_args(argv)
    split = lambda v: tuple(x.strip() for x in v.split(",") if x.strip())     # noqa: E731
    clean = CleanConfig(dedup=split(a.dedup), filters=split(a.filters), near_threshold=a.near_threshold,
                        shingle_words=a.shingle_words, num_perm=a.num_perm, min_words=a.min_words,
                        max_words=a.max_words, min_alpha_fraction=a.min_alpha_fraction,
                        max_dup_line_fraction=a.max_dup_line_fraction,
                        max_top_ngram_fraction=a.max_top_ngram_fraction,
                        max_dup_ngram_fraction=a.max_dup_ngram_fraction)
    index = prepare(a.input, a.tokenizer, a.out, vocab_size=a.vocab_size, text_field=a.text_field,
                    messages_field=a.messages_field, eval_fraction=a.eval_fraction, max_files=a.max_files,
                    max_bytes=a.max_bytes, cache_dir=a.cache_dir, clean=clean)
    if a.json:
        print(json.dumps(index))
    else:
        print(f"{a.out}: {index['num_files']} files, tokenizer {index['tokenizer']} (vocab {index['vocab_size']}, "
              f"{index['dtype']})\n" + summary_line(index))
        if "documents_in" in index:
            print(f"cleaning: {index['documents_in']} documents in, {index['exact_duplicates']} exact and "
                  f"{index['near_duplicates']} near duplicates, filtered {index['filtered']}, "
                  f"{index['documents_out']} out ({index['documents_per_second']} documents/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
