"""Weighted mixtures of data sources (`DataConfig.sources`): one LMData per source, one tokenizer.

    cfg = DataConfig(sources="docs=corpus/docs.jsonl:0.7,code=data/prep_code:0.3", tokenizer="hf")
    data = build_lm_data(cfg)                       # a MixtureData
    it = data.train_iter(8)                         # 70% docs, 30% code windows, deterministic
    it = data.train_iter(8, mix="docs:0.9,code:0.1")   # another mix of the same sources (a stage's)
    it.data_metrics()                               # {"data_sequences/docs": ..., "data_tokens/docs": ...}
    for b in data.eval_batches(8, source="docs"): ...   # one source's held-out windows

Order (glm5_jax.data.pipeline.TrainIterator): each source's train windows are shuffled with a seed
derived from (seed, source name) and repeated; grain's `MapDataset.mix` interleaves the sources by
their weights (weight / sum of weights), deterministically: element g of the global stream is a
function of g alone, so the state is still one integer (plus the per-source counts) and a resumed or
differently sharded run continues the same interleaving.

Tokenizer: one for every source. A tokenizer path (`data.tokenizer=PATH`) is used as it is; with a
prepared directory among the sources and no tokenizer set, that directory's tokenizer is used for all
(every prepared directory must hold the same one); a tokenizer trained here ("hf" / "spm") is trained
on the sources' train splits together (their documents taken in turn, so each source contributes
within `tokenizer_train_bytes`), never on a held-out document. Each source keeps its own held-out
split and its own token cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from glm5_jax.config import ConfigError
from glm5_jax.data.config import DataConfig, MixSource, parse_mix
from glm5_jax.data.corpus import Corpus, load_corpus
from glm5_jax.data.pipeline import LMData, TrainIterator, is_prepared_dir, prepared_data, tokenized
from glm5_jax.data.sources import DataError
from glm5_jax.data.tokenizer import Tokenizer, resolve_tokenizer
from glm5_jax.data.token_cache import INDEX


class _SourcesCorpus:
    """The train documents of several corpora, in turn (what a tokenizer trained here reads)."""

    def __init__(self, corpora: List[Corpus]):
        self.corpora = corpora

    def texts(self, split: str) -> Iterator[str]:
        if split != "train":
            raise ValueError("a tokenizer is trained on the train split only")
        for group in itertools.zip_longest(*(c.texts("train") for c in self.corpora)):
            yield from (t for t in group if t is not None)

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps([c.fingerprint() for c in self.corpora]).encode()).hexdigest()[:16]


def _in_source(src: MixSource, fn):
    """fn(), with a DataError / ConfigError prefixed by the source it is about."""
    try:
        return fn()
    except ConfigError as e:
        raise type(e)(f"data.sources {src.name!r} ({src.path}): {e}") from None


@dataclasses.dataclass
class MixtureData:
    cfg: DataConfig
    tokenizer: Tokenizer
    parts: Tuple[Tuple[MixSource, LMData], ...]
    timings: Dict[str, float]

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(s.name for s, _ in self.parts)

    def source(self, name: str) -> LMData:
        for s, d in self.parts:
            if s.name == name:
                return d
        raise ConfigError(f"source {name!r} is not one of data.sources ({', '.join(self.names)})")

    def mixture_parts(self, mix=None) -> List[Tuple[str, float, LMData]]:
        """[(name, weight / sum of weights, LMData)] of the sources drawn: data.sources' weights, or `mix`
        (`NAME:WEIGHT,...`, a {name: weight} mapping or pairs; a source left out is not drawn)."""
        pairs = ([(s.name, s.weight) for s, _ in self.parts] if mix is None
                 else list(parse_mix(mix, self.names)))
        total = sum(w for _, w in pairs)
        return [(name, w / total, self.source(name)) for name, w in pairs]

    def weights(self, mix=None) -> Dict[str, float]:
        return {name: w for name, w, _ in self.mixture_parts(mix)}

    def train_iter(self, batch_size: int, seq_len: Optional[int] = None, seed: Optional[int] = None,
                   num_threads: int = 0, mix=None) -> TrainIterator:
        return TrainIterator(self, batch_size, self.cfg.seq_len if seq_len is None else seq_len,
                             self.cfg.seed if seed is None else seed, num_threads, mix)

    def eval_batches(self, batch_size: int, seq_len: Optional[int] = None, max_batches: Optional[int] = None,
                     source: Optional[str] = None) -> Iterator[Dict[str, np.ndarray]]:
        """One source's held-out batches (LMData.eval_batches), or with `source=None` every source's in
        turn (up to max_batches each)."""
        names = self.names if source is None else (source,)
        for name in names:
            yield from self.source(name).eval_batches(batch_size, seq_len, max_batches)

    def summary(self) -> Dict[str, Any]:
        per = {s.name: {"path": s.path, "weight": s.weight, **{k: v for k, v in d.summary().items()
                                                               if k not in ("tokenizer", "vocab_size")}}
               for s, d in self.parts}
        out = {k: sum(p[k] for p in per.values()) for k in ("train_documents", "eval_documents",
                                                            "train_tokens", "eval_tokens")}
        return {**out, "vocab_size": self.tokenizer.vocab_size, "tokenizer": self.tokenizer.model_path,
                "sources": per, **self.timings}


def build_mixture(cfg: DataConfig, log=None) -> MixtureData:
    """One LMData per `cfg.sources` entry, all with one tokenizer (module docstring)."""
    if not cfg.sources:
        raise ConfigError("build_mixture needs DataConfig.sources (a non-empty mixture)")
    t0 = time.perf_counter()
    subs = [dataclasses.replace(cfg, sources=(), path=s.path) for s in cfg.sources]
    prepared = [is_prepared_dir(s.path) for s in cfg.sources]
    corpora = {i: _in_source(s, lambda c=c: load_corpus(c))
               for i, (s, c, p) in enumerate(zip(cfg.sources, subs, prepared)) if not p}
    t1 = time.perf_counter()
    if cfg.tokenizer_kind == "path":
        setting = cfg.tokenizer
    elif any(prepared):
        i = prepared.index(True)
        if cfg.tokenizer is not None:
            raise DataError(f"data.tokenizer={cfg.tokenizer!r} (train one here) does not apply to the prepared "
                            f"directory of data.sources {cfg.sources[i].name!r}; leave it unset to use the "
                            "tokenizer stored there, or give a tokenizer path")
        d = os.path.expanduser(cfg.sources[i].path)
        with open(os.path.join(d, INDEX)) as fh:
            setting = os.path.join(d, json.load(fh)["tokenizer_file"])
    else:
        setting = resolve_tokenizer(cfg, _SourcesCorpus([corpora[i] for i in sorted(corpora)])).model_path
    subs = [dataclasses.replace(c, tokenizer=setting) for c in subs]
    tok, parts = None, []
    for i, (src, sub) in enumerate(zip(cfg.sources, subs)):
        if prepared[i]:
            d = _in_source(src, lambda sub=sub: prepared_data(sub))
        else:
            if tok is None:
                from glm5_jax.data.tokenizer import load_tokenizer_setting
                tok = load_tokenizer_setting(setting)
            d = _in_source(src, lambda sub=sub, i=i: tokenized(sub, corpora[i], tok, log))
        if d.splits["train"].num_tokens == 0:
            raise DataError(f"data.sources {src.name!r} ({src.path}) has no train tokens")
        parts.append((src, d))
    tokenizer = parts[0][1].tokenizer
    timings = {"corpus_s": round(t1 - t0, 3), "tokens_s": round(time.perf_counter() - t1, 3)}
    return MixtureData(cfg, tokenizer, tuple(parts), timings)


__all__ = ["MixtureData", "build_mixture"]
