"""Tokenized corpora on disk: the cache under `<cache_dir>/tokens/<key>/`, and the directories
`python -m tools.prepare_data` writes (one such cache per shard under `shards/NNNNN/`, an `index.json`
listing them, plus a copy of the tokenizer).

Layout, for each split in (train, eval):
  `<split>.tokens.bin`   raw little-endian token ids, documents back to back, NO eos; uint16 when
                         the tokenizer's vocab_size <= 65536 (every id fits), else uint32
  `<split>.offsets.npy`  1-D int64 [n_docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
and `index.json` (dtype, tokenizer path and fingerprint, corpus fingerprint, per split documents /
tokens / text bytes / bytes per token, timing). The key hashes the tokenizer file's content and the
corpus fingerprint, so a second build with the same data and tokenizer memory-maps these arrays and
never calls the tokenizer. Tokens are written as they are produced (one pass, host memory bounded
by one batch of documents and the offsets).

A sharded directory's index.json adds `shards` (per shard: `dir` and its per-split documents / tokens);
`load_tokens` puts the shards' documents back to back in shard order (corpus order), or only the train
documents of the shards a host reads.

Chat documents (`messages`) are rendered to ids by the GLM chat template (glm5_jax.data.chat,
interleaved thinking); every token of them is an LM target in pre-training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from glm5_jax.data._cache import build_dir_atomically, settings_key
from glm5_jax.data.corpus import SPLITS, Corpus
from glm5_jax.data.sources import DataError, Document
from glm5_jax.data.tokenizer_base import Tokenizer

_FORMAT_VERSION = 2          # 2: raw .bin tokens (uint16 / uint32), document-level split
_ENCODE_CHUNK = 64           # documents per encode_batch call
INDEX = "index.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 only when every id (< vocab_size <= 2**16) fits; uint32 otherwise (GLM-5: 154,880)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    tokens: np.ndarray   # [n_tokens] uint16/uint32, documents back to back
    offsets: np.ndarray  # [n_docs + 1] int64

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d]:self.offsets[d + 1]]


class Progress:
    """A progress line on stderr (documents, tokens, rate, ETA), at most every `every` seconds."""

    def __init__(self, total: int, label: str, every: float = 2.0, stream=None, quiet: bool = False):
        self.total, self.label, self.every = max(int(total), 1), label, every
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.t0 = self.last = time.perf_counter()
        self.printed = False

    def update(self, done: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if self.quiet or not (final and self.printed or now - self.last >= self.every):
            return
        self.last, self.printed = now, True
        el = now - self.t0
        eta = el / done * (self.total - done) if done else float("nan")
        bar = "#" * int(20 * done / self.total)
        tty = getattr(self.stream, "isatty", lambda: False)()    # a log file gets one line per update
        lead = "\r" if tty else ""
        print(f"{lead}{self.label} [{bar:<20s}] {done}/{self.total} docs "
              f"{100 * done / self.total:5.1f}% {tokens:,} tokens {done / max(el, 1e-9):.0f} docs/s ETA {_fmt(eta)}   ",
              end="\n" if final or not tty else "", file=self.stream, flush=True)


def _fmt(seconds: float) -> str:
    if not np.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Encoder:
    """Documents -> ids: text through encode_batch, chat messages through the chat template."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._template = None

    def template(self):
        if self._template is None:
            from glm5_jax.data.chat import ChatTemplate     # only chat data needs it
            self._template = ChatTemplate(self.tok)
        return self._template

    def __call__(self, docs: List[Document]) -> List[List[int]]:
        texts = [d.text for d in docs if d.text is not None]
        enc = iter(self.tok.encode_batch(texts) if texts else [])
        out = []
        for d in docs:
            if d.text is not None:
                out.append(next(enc))
                continue
            try:
                out.append(self.template().render(d.messages).ids)
            except ValueError as e:   # ChatFormatError: bad roles / fields, or a tokenizer without the specials
                raise DataError(f"document {d.key!r}: chat messages cannot be rendered ({e})") from None
        return out


def write_token_items(tok: Tokenizer, items: Iterable[Tuple[str, Document]], out_dir: str, total: int, *,
                      quiet: bool = False) -> dict:
    """Tokenize (split, document) items once into `out_dir`'s `<split>.tokens.bin` / `<split>.offsets.npy`
    (layout above), in the order given; returns {split: {documents, tokens, text_bytes, bytes_per_token}}
    and tokenize_seconds. `total`: the documents expected (for the progress line)."""
    dtype = token_dtype(tok.vocab_size)
    bins = {s: open(os.path.join(out_dir, f"{s}.tokens.bin"), "wb") for s in SPLITS}
    lengths: Dict[str, List[int]] = {s: [] for s in SPLITS}
    nbytes = {s: 0 for s in SPLITS}
    encode = _Encoder(tok)
    progress = Progress(total, "tokenizing", quiet=quiet)
    t0 = time.perf_counter()
    done = tokens = 0
    pending: List[Tuple[str, Document]] = []

    def flush():
        nonlocal done, tokens
        for (s, d), ids in zip(pending, encode([d for _, d in pending])):
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= tok.vocab_size):
                raise DataError(f"tokenizer {tok.model_path!r} produced id {int(arr.max())} outside its "
                                f"vocab_size {tok.vocab_size} for document {d.key!r}")
            bins[s].write(arr.astype(dtype.newbyteorder("<")).tobytes())
            lengths[s].append(arr.size)
            nbytes[s] += len(d.plain_text().encode("utf-8"))
            tokens += arr.size
        done += len(pending)
        pending.clear()
        progress.update(done, tokens)

    try:
        for item in items:
            pending.append(item)
            if len(pending) >= _ENCODE_CHUNK:
                flush()
        flush()
    finally:
        for fh in bins.values():
            fh.close()
    progress.update(done, tokens, final=True)
    out: dict = {}
    for s in SPLITS:
        offsets = np.zeros([len(lengths[s]) + 1], np.int64)
        np.cumsum(lengths[s], out=offsets[1:])
        np.save(os.path.join(out_dir, f"{s}.offsets.npy"), offsets)
        n = int(offsets[-1])
        out[s] = {"documents": len(lengths[s]), "tokens": n, "text_bytes": nbytes[s],
                  "bytes_per_token": round(nbytes[s] / n, 4) if n else None}
    out["tokenize_seconds"] = round(time.perf_counter() - t0, 3)
    return out


def tokens_index(tok: Tokenizer, corpus: Corpus, extra: Optional[dict] = None) -> dict:
    """The index fields that name the tokenizer and the corpus (index.json, before the per-split counts)."""
    return {"format": _FORMAT_VERSION, "dtype": token_dtype(tok.vocab_size).name, "tokenizer": tok.model_path,
            "tokenizer_kind": tok.kind, "tokenizer_fingerprint": tok.fingerprint, "vocab_size": tok.vocab_size,
            "root": corpus.root, "corpus": corpus.fingerprint(), "num_files": len(corpus.files), **(extra or {})}


def write_tokens(tok: Tokenizer, corpus: Corpus, out_dir: str, *, log: Optional[Callable[[str], None]] = None,
                 quiet: bool = False, extra: Optional[dict] = None) -> dict:
    """Tokenize every document of `corpus` once into `out_dir` (layout above, corpus order); returns the index."""
    index = tokens_index(tok, corpus, extra)
    index.update(write_token_items(tok, corpus.documents(), out_dir, corpus.num_documents(), quiet=quiet))
    with open(os.path.join(out_dir, INDEX), "w") as fh:
        json.dump(index, fh, indent=1)
    if log is not None:
        log(summary_line(index))
    return index


def summary_line(index: dict) -> str:
    parts = []
    for s in SPLITS:
        x = index[s]
        parts.append(f"{s}: {x['documents']:,} documents, {x['tokens']:,} tokens, "
                     f"{x['bytes_per_token'] or float('nan'):.3f} bytes/token")
    return "; ".join(parts) + f" ({index['tokenize_seconds']:.1f} s)"


def read_index(d: str) -> dict:
    p = os.path.join(d, INDEX)
    try:
        with open(p) as fh:
            index = json.load(fh)
    except (OSError, ValueError) as e:
        raise DataError(f"{d!r} is not a tokenized data directory: cannot read {INDEX} ({e})") from None
    if index.get("format") != _FORMAT_VERSION:
        raise DataError(f"tokenized data {d!r} has format {index.get('format')!r}; this version reads "
                        f"{_FORMAT_VERSION} (prepare it again with python -m tools.prepare_data)")
    return index


def _load_split(d: str, split: str, dtype: np.dtype) -> TokenizedSplit:
    offsets = np.load(os.path.join(d, f"{split}.offsets.npy"))
    n = int(offsets[-1])
    path = os.path.join(d, f"{split}.tokens.bin")
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros([0], dtype)
    return TokenizedSplit(tokens=tokens, offsets=offsets)


def concat_splits(parts: List[TokenizedSplit], dtype: np.dtype) -> TokenizedSplit:
    """One split of the documents of `parts` back to back (in memory unless there is one part)."""
    if len(parts) == 1:
        return parts[0]
    sizes = [p.num_tokens for p in parts]
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    offsets = np.concatenate([[0]] + [p.offsets[1:] + a for p, a in zip(parts, starts[:-1])]).astype(np.int64)
    tokens = np.concatenate([np.asarray(p.tokens) for p in parts]) if parts else np.zeros([0], dtype)
    return TokenizedSplit(tokens=tokens.astype(dtype, copy=False), offsets=offsets)


def load_tokens(d: str, train_shards: Optional[Sequence[int]] = None) -> Tuple[Dict[str, TokenizedSplit], dict]:
    """({split: TokenizedSplit} with memory-mapped tokens, index) of a tokenized directory. A sharded
    directory (tools.prepare_data: index["shards"], one token cache per shard) gives its shards' documents
    back to back in shard order; `train_shards` limits the train split to those shards (a host's share in
    a multi-host run), the eval split is always whole."""
    index = read_index(d)
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    if "shards" not in index:
        if train_shards is not None:
            raise DataError(f"tokenized data {d!r} is one token cache, not sharded; it has no shards to select")
        return {s: _load_split(d, s, dtype) for s in SPLITS}, index
    dirs = [os.path.join(d, x["dir"]) for x in index["shards"]]
    pick = range(len(dirs)) if train_shards is None else train_shards
    return {"train": concat_splits([_load_split(dirs[i], "train", dtype) for i in pick], dtype),
            "eval": concat_splits([_load_split(x, "eval", dtype) for x in dirs], dtype)}, index


def host_shards(index: dict, process_index: int, process_count: int) -> Optional[Tuple[int, ...]]:
    """The shards whose train documents process `process_index` of `process_count` reads (grain's
    ShardByJaxProcess rule: shard i goes to process i % count); None (read everything) in one process or
    for an unsharded directory."""
    n = len(index.get("shards", ()))
    if process_count == 1 or n == 0:
        return None
    if n < process_count:
        raise DataError(f"the prepared directory has {n} shards; a {process_count}-process run reads at least one "
                        f"per process: prepare it again with a smaller --shard_docs (>= {process_count} shards)")
    return tuple(range(process_index, n, process_count))


def token_cache_dir(cache_root: str, tok: Tokenizer, corpus: Corpus) -> str:
    key = settings_key({"format": _FORMAT_VERSION, "tokenizer": tok.fingerprint, "corpus": corpus.fingerprint()})
    return os.path.join(cache_root, "tokens", key)


def load_or_build_token_cache(cache_root: str, tok: Tokenizer, corpus: Corpus,
                              log: Optional[Callable[[str], None]] = None
                              ) -> Tuple[Dict[str, TokenizedSplit], str]:
    """Returns ({split: TokenizedSplit}, cache directory)."""
    d = token_cache_dir(cache_root, tok, corpus)
    build_dir_atomically(d, INDEX, lambda tmp: write_tokens(tok, corpus, tmp, log=log))
    return load_tokens(d)[0], d
