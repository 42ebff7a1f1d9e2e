"""Tokenize a dataset once into a directory that training memory-maps.

    python -m tools.prepare_data --input='corpus/*.jsonl.gz' --tokenizer=glm5/tokenizer.json --out=data/prepared
        [--vocab_size=N] [--text_field=text] [--messages_field=messages] [--eval_fraction=0.02]
        [--max_files=N] [--max_bytes=N] [--cache_dir=DIR] [--json]
    python -m experiments.run --config=pretrain --set data.path=data/prepared --set data.vocab_size=N

--input: a glob, file, directory or comma-separated list (text / jsonl(.gz) / parquet / ArrayRecord; the
format comes from the extension, glm5_jax.data.sources). --tokenizer: a sentencepiece .model or a
Hugging Face tokenizer.json (file or directory), or "spm" / "hf" to train one here on the train split
(--vocab_size). The same corpus (document-level held-out split), tokenizer and writer as training's
own token cache (glm5_jax.data.token_cache.write_tokens): the output is that cache's layout, plus a
copy of the tokenizer file, so `data.path=OUT` trains on it without the tokenizer or the raw files.

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

from glm5_jax.data.config import DataConfig
from glm5_jax.data.corpus import load_corpus
from glm5_jax.data.pipeline import check_vocab
from glm5_jax.data.sources import DataError
from glm5_jax.data.token_cache import INDEX, summary_line, write_tokens
from glm5_jax.data.tokenizer import resolve_tokenizer


def prepare(input: str, tokenizer: str, out: str, *, vocab_size: int | None = None, text_field: str = "text",
            messages_field: str = "messages", eval_fraction: float = 0.02, max_files: int | None = None,
            max_bytes: int | None = None, cache_dir: str | None = None, quiet: bool = False) -> dict:
    """Tokenize `input` with `tokenizer` into `out` (refused if `out` already holds a prepared dataset);
    returns the index (index.json)."""
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
    return write_tokens(tok, corpus, out, quiet=quiet, extra={"tokenizer_file": name, "input": input})


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
    a = ap.parse_args(argv)
    try:
        index = prepare(a.input, a.tokenizer, a.out, vocab_size=a.vocab_size, text_field=a.text_field,
                        messages_field=a.messages_field, eval_fraction=a.eval_fraction, max_files=a.max_files,
                        max_bytes=a.max_bytes, cache_dir=a.cache_dir)
    except (ValueError, OSError) as e:    # DataError / ConfigError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(index))
    else:
        print(f"{a.out}: {index['num_files']} files, tokenizer {index['tokenizer']} (vocab {index['vocab_size']}, "
              f"{index['dtype']})\n" + summary_line(index))
    return 0


if __name__ == "__main__":
    sys.exit(main())
