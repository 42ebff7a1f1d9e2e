"""Corpus: the documents of `DataConfig.path` (or, by default, the *.py sources of the running
Python's standard library), split into train and held-out eval documents.

* Default (`path` None): *.py files under `sysconfig.get_paths()["stdlib"]` (or `DataConfig.stdlib_root`),
  skipping any directory whose name is in `DataConfig.exclude_dirs` (test suites such as `test/`,
  `idlelib/idle_test`, `lib2to3/tests`, and `site-packages`); files that are not valid UTF-8 or are
  empty are skipped. Each file is one document.
* `path` set: the files it names (glob / file / directory, comma-separated; glm5_jax.data.sources), in
  any supported format; an unreadable or empty file is an error naming it.
* The file list is sorted by POSIX relative path; `max_files` / `max_bytes` cut that sorted list
  (a prefix), so a capped corpus is always a deterministic subset.
* Held-out split by document: a document is `eval` iff the first 8 bytes of sha256(key), read as
  a fraction of 2**64, are < eval_fraction (key: the relative path for a one-document file, else
  `relpath#i`). The split of a document does not depend on the cap or on the other files.
  If that selects no eval document (tiny corpora), the document with the smallest hash is
  moved to eval; if it selects every document, the largest-hash one is kept for train.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import sys
import sysconfig
from typing import Iterator, List, Optional, Tuple

from glm5_jax.data.config import DataConfig
from glm5_jax.data.sources import (
    DataError,
    Document,
    SourceFile,
    count_documents,
    document_key,
    is_utf8_text,
    iter_documents,
    make_sources,
    resolve_files,
    walk_files,
)

SPLITS = ("train", "eval")


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: str
    files: Tuple[SourceFile, ...]
    num_docs: Tuple[int, ...]                 # per file
    eval_docs: Tuple[Tuple[int, ...], ...]    # per file: indices of its held-out documents
    text_field: str = "text"
    messages_field: str = "messages"

    @functools.cached_property
    def _eval_sets(self):
        return tuple(frozenset(e) for e in self.eval_docs)

    def num_documents(self, split: Optional[str] = None) -> int:
        n_eval = sum(len(e) for e in self.eval_docs)
        if split is None:
            return sum(self.num_docs)
        _check_split(split)
        return n_eval if split == "eval" else sum(self.num_docs) - n_eval

    def documents(self, split: Optional[str] = None) -> Iterator[Tuple[str, Document]]:
        """(split, document) in corpus order: files by relpath, documents in file order; only `split`'s
        documents when given (files without any of them are not read)."""
        if split is not None:
            _check_split(split)
        for f, n, ev in zip(self.files, self.num_docs, self._eval_sets):
            if split == "eval" and not ev or split == "train" and len(ev) == n:
                continue
            for i, doc in enumerate(iter_documents(f, self.text_field, self.messages_field)):
                s = "eval" if i in ev else "train"
                if split is None or s == split:
                    yield s, doc

    def texts(self, split: Optional[str] = None) -> Iterator[str]:
        for _, doc in self.documents(split):
            yield doc.plain_text()

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def fingerprint(self) -> str:
        """Hash of the files (relpath, format, size, mtime), fields and split: caches key on it."""
        payload = {
            "python": sys.version.split()[0],
            "fields": [self.text_field, self.messages_field],
            "files": [[f.relpath, f.format, f.size, f.mtime_ns, n] for f, n in zip(self.files, self.num_docs)],
            "eval": hashlib.sha256(json.dumps(self.eval_docs).encode()).hexdigest(),
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is invalid; allowed: 'train', 'eval'")


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def key_hash_fraction(key: str) -> float:
    """Deterministic value in [0, 1) derived from a document key (used for the split)."""
    h = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


def _cap(files: List[SourceFile], cfg: DataConfig, skip_bad: bool) -> List[SourceFile]:
    kept: List[SourceFile] = []
    total = 0
    for f in files:
        if cfg.max_files is not None and len(kept) >= cfg.max_files:
            break
        if cfg.max_bytes is not None and total >= cfg.max_bytes:
            break
        if skip_bad and (f.size == 0 or not is_utf8_text(f)):
            continue
        kept.append(f)
        total += f.size
    return kept


def load_corpus(cfg: DataConfig) -> Corpus:
    if cfg.path is None:
        root = cfg.stdlib_root or stdlib_root()
        files = _cap(make_sources(walk_files(root, cfg.exclude_dirs, (".py",)), root), cfg, skip_bad=True)
        where = f".py files under {root!r}"
    else:
        root, files = resolve_files(cfg.path, cfg.exclude_dirs)
        files = _cap(files, cfg, skip_bad=False)
        where = f"data.path={cfg.path!r}"
    counts = []
    for f in files:
        n = count_documents(f, cfg.text_field, cfg.messages_field)
        if n == 0:
            raise DataError(f"data file {f.path!r} is empty (no documents)")
        counts.append(n)
    total = sum(counts)
    if total < 2:
        raise DataError(f"{where} gives {total} documents after caps (max_files={cfg.max_files}, "
                        f"max_bytes={cfg.max_bytes}); need >= 2 (one is held out for eval)")
    fracs = [[key_hash_fraction(document_key(f, i)) for i in range(n)] for f, n in zip(files, counts)]
    evals = [[i for i, x in enumerate(fr) if x < cfg.eval_fraction] for fr in fracs]
    n_eval = sum(len(e) for e in evals)
    if n_eval in (0, total):
        flat = [(x, fi, i) for fi, fr in enumerate(fracs) for i, x in enumerate(fr)]
        if n_eval == 0:
            _, fi, i = min(flat)
            evals[fi].append(i)
        else:
            _, fi, i = max(flat)
            evals[fi].remove(i)
    return Corpus(root=root, files=tuple(files), num_docs=tuple(counts),
                  eval_docs=tuple(tuple(sorted(e)) for e in evals),
                  text_field=cfg.text_field, messages_field=cfg.messages_field)
