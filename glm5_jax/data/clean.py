"""Document cleaning rules for `tools.prepare_data` (run per shard by glm5_jax.data.prep): quality
filters, the normalised digest of exact dedup, the MinHash signature and LSH banding of near dedup, and
the settings of all three dedup stages (near, exact, semantic).

* exact: a 16-byte BLAKE2b digest of the normalised text (NFKC, whitespace runs collapsed, ends
  stripped); documents with one digest are exact duplicates of the first of them.
* near: MinHash signatures (datasketch, `num_perm` permutations) of the set of lower-cased word
  `shingle_words`-grams, banded as datasketch's MinHashLSH bands them for `near_threshold` (weighted
  for recall); documents sharing a band are candidates, a candidate pair counts only if the
  signatures' estimated Jaccard similarity is >= near_threshold. Shingles of 2 words by default:
  replacing a fraction p of the words changes about f = 1 - (1 - p)^n of the n-word shingles and
  leaves Jaccard (1 - f) / (1 + f), so at p = 3% a 5-word shingle gives 0.74 (below 0.8: missed) and a
  2-word one 0.89 (measured on tests/test_data_clean.py's planted corpus: 4 / 35 / 40 of 40
  near-duplicates found with 5 / 3 / 2-word shingles, no distinct document removed).
* semantic (SemDeDup): mean-pooled embeddings of the documents by a checkpoint's trunk, k-means, and
  within a cluster a document whose cosine similarity to an earlier kept one exceeds
  `semantic_threshold` is dropped (glm5_jax.data.prep.semantic).
* filters (in the manner of Gopher's quality rules, Rae et al. 2021, each threshold settable):
  length (min_words..max_words words), alpha (share of words with an alphabetic character >=
  min_alpha_fraction), dup_lines (share of non-empty lines repeating an earlier line <=
  max_dup_line_fraction), top_ngram (characters covered by the most frequent word 2-gram <=
  max_top_ngram_fraction), dup_ngram (characters in word 10-grams that occur more than once <=
  max_dup_ngram_fraction). "gopher" selects all five.
Filters run first (a filtered document enters no dedup stage), then the dedup stages in the order
`dedup` names them (GLM-5's order: near,exact,semantic); each stage sees only what the earlier ones kept.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import re
import unicodedata
from typing import Optional

import numpy as np

from glm5_jax.errors import Glm5Error
from glm5_jax.fields import check_fields, setting

DEDUP_KINDS = ("near", "exact", "semantic")
DROP_REASONS = {"near": "near_duplicate", "exact": "exact_duplicate", "semantic": "semantic_duplicate"}
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
    # semantic (SemDeDup): the embedding checkpoint and its tokenizer (default: the one stored with it)
    embed_model: Optional[str] = None
    embed_tokenizer: Optional[str] = None
    semantic_threshold: float = setting(0.9, gt=-1, max=1)
    semantic_clusters: int = setting(0, integer=True, min=0)       # 0: ceil(sqrt(documents))
    kmeans_iters: int = setting(10, integer=True, min=1)
    embed_max_tokens: int = setting(256, integer=True, min=8)
    embed_batch: int = setting(16, integer=True, min=1)

    def __post_init__(self):
        for kind in self.dedup:
            if kind not in DEDUP_KINDS:
                raise CleanConfigError(f"--dedup has {kind!r}; allowed: a comma list of {', '.join(DEDUP_KINDS)}")
        if len(set(self.dedup)) != len(self.dedup):
            raise CleanConfigError(f"--dedup={','.join(self.dedup)} names a stage twice; allowed: each of "
                                   f"{', '.join(DEDUP_KINDS)} at most once")
        if "semantic" in self.dedup and not self.embed_model:
            raise CleanConfigError("--dedup=semantic needs --embed_model=PATH (a Hugging Face folder, an orbax params "
                                   "checkpoint or a training run's workdir whose trunk embeds the documents)")
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


def digest(text: str) -> bytes:
    """The 16-byte BLAKE2b digest of the normalised text (exact dedup's key)."""
    return hashlib.blake2b(normalize(text).encode("utf-8"), digest_size=16).digest()


def minhash_signature(text: str, cfg: CleanConfig) -> np.ndarray:
    """[num_perm] uint32: the MinHash of the lower-cased word shingle set (datasketch's hashes are < 2**32)."""
    from datasketch import MinHash
    words = text.lower().split()
    n = cfg.shingle_words
    shingles = {" ".join(words[i:i + n]).encode() for i in range(max(1, len(words) - n + 1))}
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
    m.update_batch(list(shingles))
    return m.hashvalues.astype(np.uint32)


def lsh_bands(cfg: CleanConfig) -> tuple[int, int]:
    """(bands, rows per band) that datasketch's MinHashLSH picks for near_threshold and num_perm, weighted
    for recall (false-negative weight 0.9): candidates are confirmed by the signatures' estimate."""
    return _lsh_bands(cfg.near_threshold, cfg.num_perm)


@functools.lru_cache(maxsize=8)
def _lsh_bands(threshold: float, num_perm: int) -> tuple[int, int]:
    from datasketch import MinHashLSH        # its banding optimiser integrates numerically: ~0.5 s a call
    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=(0.1, 0.9))
    return int(lsh.b), int(lsh.r)
