"""Document cleaning for `tools.prepare_data`: exact and near-duplicate removal and quality filters,
streamed over a corpus in order (the first document of each duplicate cluster is kept).

* exact: a 16-byte BLAKE2b digest of the normalised text (NFKC, whitespace runs collapsed, ends
  stripped); a document whose digest was seen before is an exact duplicate.
* near: MinHash signatures (datasketch, `num_perm` permutations) of the set of lower-cased word
  `shingle_words`-grams, looked up in a MinHashLSH index banded for `near_threshold`; an LSH candidate
  counts only if the signatures' estimated Jaccard similarity is >= near_threshold (LSH banding, tuned
  for recall, finds the candidates; the estimate confirms them). datasketch is a maintained
  implementation of both, so neither is written here. Shingles of 2 words by default: replacing a
  fraction p of the words changes about f = 1 - (1 - p)^n of the n-word shingles and leaves Jaccard
  (1 - f) / (1 + f), so at p = 3% a 5-word shingle gives 0.74 (below 0.8: missed) and a 2-word one
  0.89 (measured on tests/test_data_clean.py's planted corpus: 4 / 35 / 40 of 40 near-duplicates
  found with 5 / 3 / 2-word shingles, no distinct document removed).
* filters (in the manner of Gopher's quality rules, Rae et al. 2021, each threshold settable):
  length (min_words..max_words words), alpha (share of words with an alphabetic character >=
  min_alpha_fraction), dup_lines (share of non-empty lines repeating an earlier line <=
  max_dup_line_fraction), top_ngram (characters covered by the most frequent word 2-gram <=
  max_top_ngram_fraction), dup_ngram (characters in word 10-grams that occur more than once <=
  max_dup_ngram_fraction). "gopher" selects all five.
Order per document: exact digest, then filters, then near-duplicates (so filtered documents never
enter the LSH index). Only digests and signatures are kept (~1 KiB a kept document at 128
permutations), never documents. Semantic (embedding) deduplication is not built: it needs an
embedding model run over every document and an approximate nearest-neighbour index (docs/data.md).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import re
import time
import unicodedata
from typing import Optional

import numpy as np

from glm5_jax.errors import Glm5Error
from glm5_jax.fields import check_fields, setting

DEDUP_KINDS = ("exact", "near")
FILTERS = ("length", "alpha", "dup_lines", "top_ngram", "dup_ngram")
_WS = re.compile(r"\s+")


class CleanConfigError(Glm5Error):
    """A cleaning setting outside what is allowed."""


@dataclasses.dataclass(frozen=True)
class CleanConfig:
    dedup: tuple[str, ...] = ()
    near_threshold: float = setting(0.8, gt=0, max=1)
    num_perm: int = setting(128, integer=True, min=1)
    shingle_words: int = setting(2, integer=True, min=1)
    filters: tuple[str, ...] = ()
    min_words: int = setting(50, integer=True, min=1)
    max_words: int = setting(100_000, integer=True, min=1)
    min_alpha_fraction: float = setting(0.8, min=0, max=1)
    max_dup_line_fraction: float = setting(0.3, min=0, max=1)
    max_top_ngram_fraction: float = setting(0.2, min=0, max=1)
    max_dup_ngram_fraction: float = setting(0.1, min=0, max=1)
    seed: int = 1

    def __post_init__(self):
        for kind in self.dedup:
            if kind not in DEDUP_KINDS:
                raise CleanConfigError(f"--dedup has {kind!r}; allowed: a comma list of {', '.join(DEDUP_KINDS)}")
        filters = FILTERS if "gopher" in self.filters else self.filters
        for f in filters:
            if f not in FILTERS:
                raise CleanConfigError(f"--filters has {f!r}; allowed: gopher or a comma list of {', '.join(FILTERS)}")
        object.__setattr__(self, "filters", tuple(filters))
        check_fields(self, prefix="--", error=CleanConfigError)   # the fields are tools.prepare_data's flags

    @property
    def active(self) -> bool:
        return bool(self.dedup or self.filters)


def normalize(text: str) -> str:
    return _WS.sub(" ", unicodedata.normalize("NFKC", text)).strip()


def _char_share(words: list[str], covered: np.ndarray) -> float:
    lengths = np.fromiter((len(w) for w in words), np.int64, len(words))
    total = lengths.sum()
    return float(lengths[covered].sum() / total) if total else 0.0


def filter_reason(text: str, cfg: CleanConfig) -> Optional[str]:
    """The first of cfg.filters that rejects `text` (its name), else None."""
    words = text.split()
    for f in cfg.filters:
        if f == "length" and not cfg.min_words <= len(words) <= cfg.max_words:
            return f
        if f == "alpha" and words and sum(any(c.isalpha() for c in w) for w in words) / len(words) < cfg.min_alpha_fraction:
            return f
        if f == "dup_lines":
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            if lines and (len(lines) - len(set(lines))) / len(lines) > cfg.max_dup_line_fraction:
                return f
        if f == "top_ngram" and len(words) >= 2:
            grams = collections.Counter(zip(words, words[1:]))
            (a, b), _ = grams.most_common(1)[0]
            count = grams[(a, b)]
            total = sum(len(w) for w in words)
            if total and count * (len(a) + len(b)) / total > cfg.max_top_ngram_fraction:
                return f
        if f == "dup_ngram" and len(words) >= 10:
            grams = [tuple(words[i:i + 10]) for i in range(len(words) - 9)]
            counts = collections.Counter(grams)
            covered = np.zeros(len(words), bool)
            for i, g in enumerate(grams):
                if counts[g] > 1:
                    covered[i:i + 10] = True
            if _char_share(words, covered) > cfg.max_dup_ngram_fraction:
                return f
    return None


class DocumentCleaner:
    """Streamed decisions over documents in corpus order: `reason(key, text)` -> None (keep) or why it
    is dropped ("exact_duplicate", "near_duplicate", or a filter name); `dropped` lists
    (key, reason, key of the kept document it duplicates or None); `summary()` the counts."""

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg
        self._digests: dict[bytes, str] = {}
        self._lsh = self._sigs = None
        if "near" in cfg.dedup:
            from datasketch import MinHashLSH
            # banded for recall (false-negative weight 0.9): candidates are confirmed by the estimate below
            self._lsh = MinHashLSH(threshold=cfg.near_threshold, num_perm=cfg.num_perm, weights=(0.1, 0.9))
            self._sigs: dict[str, np.ndarray] = {}
        self.documents_in = 0
        self.counts = collections.Counter()
        self.dropped: list[tuple[str, str, Optional[str]]] = []
        self._t0 = time.perf_counter()

    def _signature(self, text: str):
        from datasketch import MinHash
        words = text.lower().split()
        n = self.cfg.shingle_words
        shingles = {" ".join(words[i:i + n]).encode() for i in range(max(1, len(words) - n + 1))}
        m = MinHash(num_perm=self.cfg.num_perm, seed=self.cfg.seed)
        m.update_batch(list(shingles))
        return m

    def reason(self, key: str, text: str) -> Optional[str]:
        self.documents_in += 1
        why, other = None, None
        if "exact" in self.cfg.dedup:
            d = hashlib.blake2b(normalize(text).encode("utf-8"), digest_size=16).digest()
            if d in self._digests:
                why, other = "exact_duplicate", self._digests[d]
            else:
                self._digests[d] = key
        if why is None and self.cfg.filters:
            why = filter_reason(text, self.cfg)
        if why is None and self._lsh is not None:
            m = self._signature(text)
            for cand in self._lsh.query(m):
                if np.mean(self._sigs[cand] == m.hashvalues) >= self.cfg.near_threshold:
                    why, other = "near_duplicate", cand
                    break
            if why is None:
                self._lsh.insert(key, m)
                self._sigs[key] = m.hashvalues
        if why is not None:
            self.counts[why] += 1
            self.dropped.append((key, why, other))
        return why

    def summary(self, tokens_out: int) -> dict:
        seconds = time.perf_counter() - self._t0
        filtered = {f: self.counts[f] for f in self.cfg.filters}
        return {"documents_in": self.documents_in, "exact_duplicates": self.counts["exact_duplicate"],
                "near_duplicates": self.counts["near_duplicate"], "filtered": filtered,
                "documents_out": self.documents_in - sum(self.counts.values()), "tokens_out": tokens_out,
                "documents_per_second": round(self.documents_in / seconds, 1) if seconds > 0 else None,
                "settings": dataclasses.asdict(self.cfg)}
