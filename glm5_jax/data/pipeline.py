"""grain pipelines over a packed, tokenized corpus (DataConfig.path, default the stdlib sources).

    data = build_lm_data(DataConfig(vocab_size=2048, seq_len=256))   # or path="data/*.jsonl.gz", tokenizer=...
    it = data.train_iter(batch_size=8)          # infinite, shuffled, checkpointable
    batch = next(it)                            # dict of int32 [8, 256]
    state = it.get_state()                      # JSON-serialisable dict
    it2 = data.train_iter(batch_size=8); it2.set_state(state)   # continues bitwise-identically
    for b in data.eval_batches(8, max_batches=4): ...           # finite, in corpus order

Train pipeline (grain.MapDataset, everything index-based, so the state is one integer):
  range(N_corpus_windows + N_retrieval) -> shuffle(seed)  (grain reshuffles every epoch with
  seed + epoch) -> repeat(None) -> map_with_index(build example): element g of the global stream;
  global batch k = elements k*B .. k*B+B-1 -> to_iter_dataset(ReadOptions(num_threads=0))
  (in-process: no worker processes, no absl flags needed; pass num_threads > 0 for threaded
  reads, still deterministic).
Data: `DataConfig.path` is raw files (corpus -> tokenizer -> token cache, each cached) or a directory
written by `python -m tools.prepare_data` (memory-mapped as is; its tokenizer is the copy stored there
unless `data.tokenizer` names the same file). A tokenizer whose vocab_size exceeds `data.vocab_size` (the
model's vocabulary) is refused before anything is tokenized.
A sharded prepared directory in a multi-process run: each process loads the train documents of its own
shards only (shard i on process i % count, token_cache.host_shards) and serves its rows of every batch
from its own stream; its state (fingerprinted with its shards) resumes on the same process count.
Otherwise (the stream is sharded by process): `select_rows(rows)` makes the iterator read only
those rows of every global batch (the training loop passes the rows its process's devices hold, from
the batch sharding), so each process builds only its part
and the global stream is the same for any number of processes. The state counts global batches, so
it does not depend on the rows: a checkpoint written by 2 processes resumes on 1 or 4.
  Item i < N_corpus is packed window i (see packing.py); item i >= N_corpus is a retrieval
  example generated from (seed, global element index), so it differs across epochs.
  N_retrieval = round(N_corpus * f / (1 - f)) for retrieval_fraction f (>= 1 when f > 0).
Eval: packed windows 0.. of the eval split in order, batched; the last batch is padded to B
rows with all-padding rows (loss_mask 0, segment_ids 0) so shapes stay static.

Batch dict (all np.int32, shape [B, T]): tokens, targets, loss_mask, segment_ids, positions.
Mixture (`DataConfig.sources`, glm5_jax.data.mixture): range(N_j).shuffle(seed_j).repeat(None) per source j
(seed_j from seed and the source's name) -> grain MapDataset.mix(weights) -> window; the state adds
per-source counts of the sequences and tokens served (`data_metrics()`, which the loop writes to
metrics.jsonl / TensorBoard), and its fingerprint names the sources, their weights and token data.
Staged training (context extension) builds one iterator per stage at that stage's T
(`train_iter(B, stage.seq_len)`); its state (fingerprinted with T) lives in that stage's checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Dict, Iterator, List, Optional

import grain
import numpy as np

from glm5_jax.batch import BATCH_KEYS
from glm5_jax.config import ConfigError
from glm5_jax.data._cache import settings_key
from glm5_jax.data.config import DataConfig
from glm5_jax.data.corpus import Corpus
from glm5_jax.data.packing import PackedStream, padding_example
from glm5_jax.data.retrieval import TRAIN_TAG, RetrievalTask, retrieval_eval_batches
from glm5_jax.data.sources import DataError
from glm5_jax.data.token_cache import (INDEX, TokenizedSplit, host_shards, load_or_build_token_cache, load_tokens,
                                       read_index)
from glm5_jax.data.tokenizer import Tokenizer, load_tokenizer_setting
from glm5_jax.fields import require

_STATE_VERSION = 1


def _check_int(name: str, v, lo: int) -> int:
    return int(require(name, int(v) if isinstance(v, np.integer) else v, integer=True, min=lo))


def _tagged(j: int, i) -> tuple:
    return j, int(i)


def _stack(rows: List[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]).astype(np.int32, copy=False) for k in BATCH_KEYS}


class TrainIterator:
    """Infinite iterator of train batches with a JSON-serialisable, restorable state."""

    # data: an LMData or a MixtureData (glm5_jax.data.mixture imports this module, so it is not imported here)
    def __init__(self, data, batch_size: int, seq_len: int, seed: int,
                 num_threads: int = 0, mix=None):
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seq_len = _check_int("seq_len", seq_len, 2)
        self.seed = _check_int("seed", seed, 0)
        self._num_threads = num_threads
        self.rows: tuple[int, ...] = tuple(range(self.batch_size))
        self._served = 0
        self._ids = None                        # a mixture: MapDataset of (source index, window index)
        self._host_local = False                # a host's own shards (LMData.host_shards): no row selection
        self.sources: tuple[str, ...] = ()      # a mixture: the names of the sources drawn
        if hasattr(data, "mixture_parts"):
            self._init_mixture(data, mix)
        else:
            if mix is not None:
                raise ConfigError(f"mix={mix!r} needs a mixture (data.sources); this data is one corpus "
                                  f"({data.cfg.path or 'stdlib *.py sources'})")
            self._init_single(data)
        self._it = self._make_iter()

    def _init_single(self, data: "LMData") -> None:
        cfg = data.cfg
        stream = data.train_stream
        self._host_local = data.host_shards is not None
        T = self.seq_len
        self.num_corpus_windows = stream.num_windows(T)
        if self.num_corpus_windows == 0:
            raise ValueError("train split is empty")
        f = float(cfg.retrieval_fraction)
        self.num_retrieval = 0
        task = None
        if f > 0:
            self.num_retrieval = max(1, round(self.num_corpus_windows * f / (1.0 - f)))
            task = data.retrieval_task("train", T)
        n_items = self.num_corpus_windows + self.num_retrieval
        n_c = self.num_corpus_windows
        seed_ = self.seed

        def make(k: int, i: int) -> Dict[str, np.ndarray]:
            i = int(i)
            if i < n_c:
                return stream.window(i, T)
            return task.example(seed_, TRAIN_TAG, int(k), mode="train")[0]

        # element g of the global stream (random access: any process reads any element directly)
        self._elements = grain.MapDataset.range(n_items).shuffle(seed=self.seed).repeat(None).map_with_index(make)
        self.fingerprint = settings_key({
            "tokens": data.data_key, "B": self.batch_size, "T": T,
            "seed": self.seed, "retrieval": [f, cfg.retrieval_pairs, cfg.retrieval_key_digits,
                                             cfg.retrieval_value_digits, cfg.min_distance(T),
                                             cfg.retrieval_min_pairs],
        })

    def _init_mixture(self, data, mix) -> None:           # data: a glm5_jax.data.mixture.MixtureData
        """Each source: its train windows shuffled (a seed of its own, from `seed` and its name) and
        repeated; grain's MapDataset.mix interleaves them in proportion to the weights (deterministic:
        every prefix of the stream holds each source within one element of its share)."""
        T = self.seq_len
        parts = data.mixture_parts(mix)
        self.sources = tuple(name for name, _, _ in parts)
        self._streams = [d.train_stream for _, _, d in parts]
        sets = []
        for j, ((name, _, _), stream) in enumerate(zip(parts, self._streams)):
            n = stream.num_windows(T)
            if n == 0:
                raise DataError(f"data.sources {name!r} has no train tokens (its train split is empty)")
            seed_j = int(settings_key({"seed": self.seed, "source": name})[:8], 16)
            sets.append(grain.MapDataset.range(n).shuffle(seed=seed_j).repeat(None)
                        .map(functools.partial(_tagged, j)))
        self.num_corpus_windows = sum(s.num_windows(T) for s in self._streams)
        self.num_retrieval = 0
        self._ids = grain.MapDataset.mix(sets, [w for _, w, _ in parts]) if len(sets) > 1 else sets[0]
        streams = self._streams
        self._elements = self._ids.map(lambda ji: streams[ji[0]].window(ji[1], T))
        self._counts = {name: [0, 0] for name in self.sources}          # sequences, tokens
        self.fingerprint = settings_key({
            "sources": [[name, w, d.data_key] for name, w, d in parts],
            "B": self.batch_size, "T": T, "seed": self.seed})

    def _make_iter(self):
        """An iterator over batches of this iterator's rows of each global batch (one batch per global
        batch, so grain's position counts global batches whatever the rows)."""
        B, rows, L = self.batch_size, self.rows, len(self.rows)
        elements = self._elements
        if L == B or self._host_local:        # every row, or this host's own shards' stream
            local = elements
        else:                                 # row j % L of global batch j // L
            local = grain.MapDataset.range(len(elements) // B * L).map(lambda j: elements[j // L * B + rows[j % L]])
        ds = local.batch(L, drop_remainder=True)
        nt = self._num_threads
        return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=nt, prefetch_buffer_size=0 if nt == 0
                                                         else max(1, 2 * L))))

    def select_rows(self, rows) -> None:
        """Read only `rows` (sorted, distinct, in [0, batch_size)) of every global batch from now on,
        keeping the position: batches then have len(rows) rows, global rows in the order given."""
        rows = tuple(int(r) for r in rows)
        if not rows or list(rows) != sorted(set(rows)) or rows[0] < 0 or rows[-1] >= self.batch_size:
            raise ValueError(f"rows={rows!r} is invalid; allowed: sorted distinct row indices in "
                             f"[0, batch_size={self.batch_size})")
        if rows == self.rows:
            return
        position = self._it.get_state()
        self.rows = rows
        self._it = self._make_iter()
        self._it.set_state(position)

    def __iter__(self) -> "TrainIterator":
        return self

    def __next__(self) -> Dict[str, np.ndarray]:
        batch = next(self._it)
        if self._ids is not None:       # global batch k's sources, from the mixture's indices (every row)
            B, T, k = self.batch_size, self.seq_len, self._served
            for g in range(k * B, k * B + B):
                j, i = self._ids[g]
                c = self._counts[self.sources[j]]
                c[0] += 1
                c[1] += min(T, max(len(self._streams[j]) - i * T, 0))     # the window's real tokens
        self._served += 1
        return {k: np.asarray(batch[k], np.int32) for k in BATCH_KEYS}

    def data_metrics(self) -> Dict[str, int]:
        """A mixture's cumulative per-source counts over the global batches served so far (all rows, so
        every process reports the same): `data_sequences/NAME` and `data_tokens/NAME` (non-padding
        input tokens). {} for one corpus."""
        out = {}
        for name in self.sources:
            n_seq, n_tok = self._counts[name]
            out[f"data_sequences/{name}"] = n_seq
            out[f"data_tokens/{name}"] = n_tok
        return out

    @property
    def epoch_batches(self) -> int:
        """Batches per pass over (corpus windows + retrieval items)."""
        return (self.num_corpus_windows + self.num_retrieval) // self.batch_size

    def get_state(self) -> Dict[str, Any]:
        state = {"version": _STATE_VERSION, "fingerprint": self.fingerprint,
                 "batches_served": self._served, "grain": self._it.get_state()}
        if self.sources:
            state["source_counts"] = {name: list(self._counts[name]) for name in self.sources}
        return json.loads(json.dumps(state))  # guarantees (and checks) JSON-serialisability

    def set_state(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"iterator state version {state.get('version') if isinstance(state, dict) else state!r}"
                             f" is not supported; expected {_STATE_VERSION}")
        if state.get("fingerprint") != self.fingerprint:
            raise ValueError(
                f"iterator state fingerprint {state.get('fingerprint')!r} != {self.fingerprint!r}: "
                "it was saved by a pipeline with different data/tokenizer/batch_size/seq_len/"
                "seed/retrieval settings")
        self._it.set_state(state["grain"])
        self._served = int(state["batches_served"])
        if self.sources:
            self._counts = {name: [int(x) for x in state["source_counts"][name]] for name in self.sources}


@dataclasses.dataclass
class LMData:
    cfg: DataConfig
    corpus: Optional[Corpus]          # None for a prepared directory (tools.prepare_data)
    tokenizer: Tokenizer
    splits: Dict[str, TokenizedSplit]
    token_cache_dir: str
    timings: Dict[str, float]
    data_key: str = ""                # hash of (tokenizer file, corpus): the iterator state checks it
    host_shards: Optional[tuple] = None   # a sharded prepared directory in a multi-process run: this host's
    _streams: Dict[str, PackedStream] = dataclasses.field(default_factory=dict, repr=False)

    def stream(self, split: str) -> PackedStream:
        if split not in self._streams:
            self._streams[split] = PackedStream(self.splits[split], self.tokenizer.eos_id,
                                                self.tokenizer.pad_id)
        return self._streams[split]

    @property
    def train_stream(self) -> PackedStream:
        return self.stream("train")

    @property
    def eval_stream(self) -> PackedStream:
        return self.stream("eval")

    def train_iter(self, batch_size: int, seq_len: Optional[int] = None,
                   seed: Optional[int] = None, num_threads: int = 0, mix=None) -> TrainIterator:
        """`mix` is for a mixture (MixtureData.train_iter); one corpus refuses it."""
        return TrainIterator(self, batch_size, self.cfg.seq_len if seq_len is None else seq_len,
                             self.cfg.seed if seed is None else seed, num_threads, mix)

    def eval_batches(self, batch_size: int, seq_len: Optional[int] = None,
                     max_batches: Optional[int] = None) -> Iterator[Dict[str, np.ndarray]]:
        """Finite, deterministic eval batches (corpus order, last batch padded)."""
        B = _check_int("batch_size", batch_size, 1)
        T = _check_int("seq_len", self.cfg.seq_len if seq_len is None else seq_len, 2)
        stream = self.eval_stream
        n = stream.num_windows(T)
        if max_batches is not None:
            n = min(n, _check_int("max_batches", max_batches, 0) * B)
        ds = grain.MapDataset.range(n).map(lambda i: stream.window(int(i), T))
        pad = padding_example(T, self.tokenizer.pad_id)
        for start in range(0, n, B):
            rows = [ds[i] for i in range(start, min(start + B, n))]
            rows += [pad] * (B - len(rows))
            yield _stack(rows)

    def retrieval_task(self, split: str = "eval", seq_len: Optional[int] = None) -> RetrievalTask:
        T = self.cfg.seq_len if seq_len is None else seq_len
        return RetrievalTask(
            self.tokenizer, self.stream(split).stream, T,
            n_pairs=self.cfg.retrieval_pairs, key_digits=self.cfg.retrieval_key_digits,
            value_digits=self.cfg.retrieval_value_digits,
            min_distance=self.cfg.min_distance(T), min_pairs=self.cfg.retrieval_min_pairs)

    def retrieval_eval_batches(self, batch_size: int, seq_len: Optional[int] = None,
                               num_batches: int = 4, seed: Optional[int] = None
                               ) -> Iterator[Dict[str, np.ndarray]]:
        """Deterministic retrieval batches with filler from the eval split; loss_mask covers
        only the answer tokens. Score with `retrieval_accuracy(logits, batch)`."""
        return retrieval_eval_batches(self.retrieval_task("eval", seq_len), batch_size,
                                      num_batches, self.cfg.seed if seed is None else seed)

    def summary(self) -> Dict[str, Any]:
        out = {"train_documents": self.splits["train"].num_docs, "eval_documents": self.splits["eval"].num_docs,
               "train_tokens": self.splits["train"].num_tokens, "eval_tokens": self.splits["eval"].num_tokens,
               "vocab_size": self.tokenizer.vocab_size, "tokenizer": self.tokenizer.model_path,
               "token_cache": self.token_cache_dir, **self.timings}
        if self.corpus is not None:
            out["files"] = len(self.corpus.files)
        return out


def is_prepared_dir(path: Optional[str]) -> bool:
    """Whether `path` is one directory written by tools.prepare_data (it holds index.json)."""
    return (path is not None and "," not in path and os.path.isdir(os.path.expanduser(path))
            and os.path.isfile(os.path.join(os.path.expanduser(path), INDEX)))


def check_vocab(tok: Tokenizer, cfg: DataConfig) -> None:
    if tok.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"tokenizer {tok.model_path!r} has vocab_size {tok.vocab_size} > DataConfig.vocab_size={cfg.vocab_size} "
            f"(the model's vocabulary); set --set data.vocab_size={tok.vocab_size} (or larger)")


def prepared_data(cfg: DataConfig) -> LMData:
    import jax
    d = os.path.expanduser(cfg.path)
    t0 = time.perf_counter()
    shards = host_shards(read_index(d), jax.process_index(), jax.process_count())   # a sharded one: per host
    splits, index = load_tokens(d, train_shards=shards)
    stored = os.path.join(d, index["tokenizer_file"])
    if cfg.tokenizer_kind != "path" and cfg.tokenizer is not None:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} (train one here) does not apply to the prepared "
                        f"directory {d!r}; leave it unset to use its tokenizer {stored!r}")
    tok = load_tokenizer_setting(cfg.tokenizer if cfg.tokenizer_kind == "path" else stored)
    if tok.fingerprint != index["tokenizer_fingerprint"]:
        raise DataError(f"data.tokenizer={cfg.tokenizer!r} is not the tokenizer {d!r} was prepared with "
                        f"({index['tokenizer']!r}); leave data.tokenizer unset to use the copy in {stored!r}")
    check_vocab(tok, cfg)
    key = settings_key({"tokenizer": index["tokenizer_fingerprint"], "corpus": index["corpus"],
                        **({"train_shards": list(shards)} if shards is not None else {})})
    return LMData(cfg, None, tok, splits, d, {"tokens_s": round(time.perf_counter() - t0, 3)}, key, shards)


def tokenized(cfg: DataConfig, corpus: Corpus, tok: Tokenizer, log=None, timings=None) -> LMData:
    """LMData of `corpus` tokenized by `tok` (through the token cache)."""
    check_vocab(tok, cfg)                   # before the (long) tokenization
    t2 = time.perf_counter()
    splits, tdir = load_or_build_token_cache(cfg.resolved_cache_dir(), tok, corpus, log=log)
    timings = {**(timings or {}), "tokens_s": round(time.perf_counter() - t2, 3)}
    return LMData(cfg, corpus, tok, splits, tdir, timings, os.path.basename(tdir))
