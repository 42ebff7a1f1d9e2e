"""Synthetic long-range key/value retrieval sequences.

Built directly in token space from pieces of the trained tokenizer (so they are ordinary
text and decode to readable strings), length T + 1 per window (`tokens`/`targets` as in
packing):

  [filler a] [pair block] [filler b] [queries]
  pair block = n_pairs records  `key<k digits>=<v digits>;\\n`   (distinct keys)
  queries    = "eval": one query `key<k digits>=<v digits>` ending exactly at the end of the window;
               "train": `train_queries` of the planted records restated (`;\\n`-separated, random
               order, the last one ending the window), so one training sequence carries several
               long-range lookups instead of one answer token among T (the retrieval signal a small
               model needs to learn the lookup at CPU scale).

* Key/value digits are the tokenizer's single-digit pieces (`split_digits` guarantees every
  digit is its own token), so a k-digit key is k tokens and the answer is exactly
  `value_digits` tokens: targets[T - value_digits : T].
* One record of the block is the queried one; the block starts at a random offset chosen so
  that `query_start - queried_record_end > min_distance` (min_distance defaults to T // 2;
  set it above the DSA `index_topk` to force sparse-attention retrieval).
* Filler is a contiguous random slice of the split's packed token stream (it may contain
  eos ids between documents; the whole sequence is a single segment, positions 0..T-1).
* `loss_mask`: answer positions only ("eval" mode), or every position ("train" mode, used by
  the train-stream mixer so the example is also a normal LM example).
* Stream tags: TRAIN_TAG (train mixer), EVAL_TAG (dev probes: watched during training, may be used
  to choose settings), TEST_TAG (test probes: scored once at the end, never used to choose settings).
Every example is a pure function of (seed, stream tag, index) through numpy's PCG64 seeded
with a SeedSequence of those integers, so it is reproducible and checkpoint-free.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, Tuple

import numpy as np

TRAIN_TAG = 1
EVAL_TAG = 2
TEST_TAG = 3


@dataclasses.dataclass(frozen=True)
class RetrievalInfo:
    key: str
    value: str
    pair_start: int  # window index of the queried record's first token
    pair_end: int  # window index one past the queried record
    query_start: int  # window index of the query's first token
    answer_positions: Tuple[int, ...]  # indices into targets / loss_mask

    value_start: int = -1  # window (= token) index of the queried record's first value digit

    @property
    def distance(self) -> int:
        return self.query_start - self.pair_end


class RetrievalTask:
    """Generator of retrieval examples for one sequence length and one filler stream."""

    def __init__(
        self,
        tokenizer,
        filler_stream: np.ndarray,
        seq_len: int,
        n_pairs: int = 4,
        key_digits: int = 3,
        value_digits: int = 3,
        min_distance: int | None = None,
    ):
        self.seq_len = int(seq_len)
        self.n_pairs = int(n_pairs)
        self.key_digits = int(key_digits)
        self.value_digits = int(value_digits)
        self.min_distance = self.seq_len // 2 if min_distance is None else int(min_distance)
        self.pad_id = int(tokenizer.pad_id)
        self.digits = np.asarray(tokenizer.digit_ids(), np.int32)
        self.key_ids = np.asarray(tokenizer.encode("key"), np.int32)
        self.eq_ids = np.asarray(tokenizer.encode("="), np.int32)
        self.end_ids = np.asarray(tokenizer.encode(";\n"), np.int32)
        if min(len(self.key_ids), len(self.eq_ids), len(self.end_ids)) == 0:
            raise ValueError("tokenizer produced an empty encoding for a retrieval separator")
        self.query_len = len(self.key_ids) + key_digits + len(self.eq_ids) + value_digits
        self.record_len = self.query_len + len(self.end_ids)
        self.block_len = self.n_pairs * self.record_len
        L = self.seq_len + 1
        self.max_offset = L - self.query_len - self.block_len - self.min_distance - 1
        if self.max_offset < 0:
            need = self.query_len + self.block_len + self.min_distance
            raise ValueError(
                f"retrieval: seq_len={self.seq_len} too short for n_pairs={n_pairs} "
                f"(record {self.record_len} tokens), query {self.query_len} tokens and "
                f"min_distance={self.min_distance}; need seq_len >= {need}"
            )
        self.filler_len = L - self.query_len - self.block_len
        # "train" mode restates up to n_pairs records at the end, as many as the slack allows.
        step = self.query_len + len(self.end_ids)
        self.train_queries = 1 + min(self.n_pairs - 1, self.max_offset // step)
        self.train_max_offset = self.max_offset - (self.train_queries - 1) * step
        filler_stream = np.asarray(filler_stream, np.int32)
        if filler_stream.size == 0:
            raise ValueError("retrieval: empty filler stream")
        if filler_stream.size < self.filler_len:   # the longest filler (eval mode: one query)
            filler_stream = np.resize(filler_stream, self.filler_len)
        self.filler_stream = filler_stream

    def _num(self, n: int, width: int) -> np.ndarray:
        return self.digits[[int(c) for c in f"{n:0{width}d}"]]

    def _record(self, key: int, value: int, with_end: bool) -> np.ndarray:
        parts = [self.key_ids, self._num(key, self.key_digits), self.eq_ids,
                 self._num(value, self.value_digits)]
        if with_end:
            parts.append(self.end_ids)
        return np.concatenate(parts)

    def example(self, seed: int, tag: int, index: int, mode: str = "eval"
                ) -> Tuple[Dict[str, np.ndarray], RetrievalInfo]:
        if mode not in ("eval", "train"):
            raise ValueError(f"mode={mode!r} is invalid; allowed: 'eval', 'train'")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, tag, index])))
        T, L = self.seq_len, self.seq_len + 1
        keys = rng.choice(10**self.key_digits, size=self.n_pairs, replace=False)
        values = rng.integers(0, 10**self.value_digits, size=self.n_pairs)
        q = int(rng.integers(0, self.n_pairs))
        train = mode == "train"
        offset = int(rng.integers(0, (self.train_max_offset if train else self.max_offset) + 1))
        block = np.concatenate([self._record(int(k), int(v), True) for k, v in zip(keys, values)])
        if train:   # earlier restated records first (random order), the last one is record q
            others = [int(i) for i in rng.permutation(self.n_pairs) if i != q][:self.train_queries - 1]
            query = np.concatenate([self._record(int(keys[i]), int(values[i]), True) for i in others]
                                   + [self._record(int(keys[q]), int(values[q]), False)])
        else:
            query = self._record(int(keys[q]), int(values[q]), False)
        flen = L - len(query) - self.block_len
        fstart = int(rng.integers(0, self.filler_stream.size - flen + 1))
        filler = self.filler_stream[fstart:fstart + flen]
        win = np.concatenate([filler[:offset], block, filler[offset:], query]).astype(np.int32)
        assert win.shape == (L,), win.shape
        pair_start = offset + q * self.record_len
        info = RetrievalInfo(
            key=f"{int(keys[q]):0{self.key_digits}d}",
            value=f"{int(values[q]):0{self.value_digits}d}",
            pair_start=pair_start,
            pair_end=pair_start + self.record_len,
            query_start=L - self.query_len,
            answer_positions=tuple(range(T - self.value_digits, T)),
            value_start=pair_start + len(self.key_ids) + self.key_digits + len(self.eq_ids),
        )
        if mode == "eval":
            loss_mask = np.zeros([T], np.int32)
            loss_mask[T - self.value_digits:] = 1
        else:
            loss_mask = np.ones([T], np.int32)
        ex = {
            "tokens": win[:-1].copy(),
            "targets": win[1:].copy(),
            "loss_mask": loss_mask,
            "segment_ids": np.ones([T], np.int32),
            "positions": np.arange(T, dtype=np.int32),
        }
        return ex, info


def retrieval_eval_batches(
    task: RetrievalTask, batch_size: int, num_batches: int, seed: int = 0, tag: int = EVAL_TAG
) -> Iterator[Dict[str, np.ndarray]]:
    """`num_batches` deterministic [batch_size, T] retrieval batches (eval loss_mask)."""
    for batch, _ in retrieval_probe_batches(task, batch_size, num_batches, seed, tag):
        yield batch


def retrieval_probe_batches(
    task: RetrievalTask, batch_size: int, num_batches: int, seed: int = 0, tag: int = EVAL_TAG
) -> Iterator[Tuple[Dict[str, np.ndarray], Tuple[RetrievalInfo, ...]]]:
    """Like retrieval_eval_batches, with each row's RetrievalInfo (distance, answer-bearing key
    position) beside the batch. tag: EVAL_TAG (dev probes) or TEST_TAG (test probes)."""
    if batch_size < 1 or num_batches < 0:
        raise ValueError(f"batch_size={batch_size} (>= 1), num_batches={num_batches} (>= 0)")
    if tag not in (EVAL_TAG, TEST_TAG):
        raise ValueError(f"tag={tag!r} is invalid; allowed: EVAL_TAG={EVAL_TAG}, TEST_TAG={TEST_TAG}")
    for b in range(num_batches):
        rows = [task.example(seed, tag, b * batch_size + r, "eval") for r in range(batch_size)]
        yield {k: np.stack([r[0][k] for r in rows]) for k in rows[0][0]}, tuple(r[1] for r in rows)


def retrieval_correct(logits_or_predictions, batch: Dict[str, np.ndarray]) -> np.ndarray:
    """Per-row exact match (bool [B]) over the answer positions (loss_mask == 1); rows without
    answer positions are False. retrieval_accuracy is its mean over rows with answers."""
    x = np.asarray(logits_or_predictions)
    targets = np.asarray(batch["targets"])
    mask = np.asarray(batch["loss_mask"]) > 0
    if x.ndim == targets.ndim + 1:
        x = x.argmax(-1)
    if x.shape != targets.shape:
        raise ValueError(f"predictions shape {x.shape} does not match targets {targets.shape}")
    return ((x == targets) | ~mask).all(-1) & mask.any(-1)


def retrieval_accuracy(logits_or_predictions, batch: Dict[str, np.ndarray]) -> float:
    """Exact-match accuracy: fraction of rows whose argmax equals the target at EVERY answer
    position (loss_mask == 1). Accepts logits [B, T, V] or predicted ids [B, T]; rows with no
    answer positions (padding rows) are ignored."""
    rows = (np.asarray(batch["loss_mask"]) > 0).any(-1)
    if not rows.any():
        raise ValueError("batch has no answer positions (loss_mask is all zero)")
    return float(retrieval_correct(logits_or_predictions, batch)[rows].mean())

