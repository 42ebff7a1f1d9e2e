"""Synthetic long-range key/value retrieval sequences (multi-query associative recall, MQAR-style).

Built directly in token space, length T + 1 per window (`tokens`/`targets` as in packing):

  [filler a] [pair block] [filler b] [queries]
  pair block = n_pairs records `K v..v`       (distinct keys, no separators)
  queries    = n_queries of the planted records restated (distinct, random order), the last one,
               record q, ending exactly at the end of the window.

Why this format: it is the textbook induction pattern (a key token directly followed by its value,
so "find the earlier copy of the current token, copy the token after it" answers every query: a
previous-token head in one layer and a match-and-copy head in the next), and every restated record
is a supervised lookup, so one sequence carries up to n_pairs long-range recall targets instead of
one answer among T. Earlier formats (`key<digits>=<digits>;` records, 1-4 lookups per sequence)
stayed at chance for a ~1M-parameter model in 1,000 steps (docs/experiments.md, dsa_vs_mla).

* A key is ONE token from `key_token_ids` (letters A-Z, a-z), disjoint from the values (digit
  tokens), so the key is never confused with a value. With a sentencepiece tokenizer the key is the
  letter's byte-fallback piece (`<0x41>` for "A"): it decodes to the letter but is never produced
  when ordinary text is encoded, so no filler token matches a key; other tokenizers use the
  letter's own token. The key space has min(10**key_digits, 52) keys (key_digits keeps
  DataConfig's `retrieval_pairs <= 10**retrieval_key_digits` rule meaningful).
* A value is `value_digits` single-digit tokens (`split_digits` guarantees one token per digit), so
  the answer of the last query is exactly targets[T - value_digits : T].
* n_queries = as many of the n_pairs records as fit while the first query still starts more than
  `min_distance` tokens after the block ends (min_distance defaults to T // 2; set it >= the DSA
  `index_topk` to force sparse-attention retrieval), so every query is that far from its record.
* "train" and "eval" examples have the same layout; they differ in loss_mask: "train" = every
  position (the train-stream mixer's example is also a normal LM example), "eval" = the last
  query's value digits only (one scored probe per sequence). With `min_pairs` a train example
  holds a record count drawn uniformly from [min_pairs, n_pairs] (queries and filler fill the
  rest); eval / test probes always hold n_pairs. Why: with one or two records, copying any earlier
  value is already often right, so a one-layer copy head gets a gradient at once; the
  match-by-previous-token step that picks the right record then sharpens it. With n_pairs records
  in every sequence, copying a random value is right only 1/n_pairs of the time and the two-step
  circuit has no gradient to start from (measured: docs/experiments.md, dsa_vs_mla).
* Filler is a contiguous random slice of the split's packed token stream (it may contain eos ids
  between documents; the whole sequence is a single segment, positions 0..T-1).
* Stream tags: TRAIN_TAG (train mixer), EVAL_TAG (dev probes: watched during training, may be used
  to choose settings), TEST_TAG (test probes: scored once at the end, never used to choose settings).
Every example is a pure function of (seed, stream tag, index) through numpy's PCG64 seeded with a
SeedSequence of those integers, so it is reproducible and checkpoint-free.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Dict, Iterator, List, Tuple

import numpy as np

TRAIN_TAG = 1
EVAL_TAG = 2
TEST_TAG = 3

KEY_LETTERS = string.ascii_uppercase + string.ascii_lowercase


def key_token_ids(tokenizer) -> List[int]:
    """One token id per letter of KEY_LETTERS: the letter's byte-fallback piece `<0xHH>` where the
    vocabulary has one (never emitted for text a tokenizer has a letter piece for), else the letter's
    single-token encoding. Raises if a letter has neither, or if two letters share an id."""
    pieces = {tokenizer.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    ids = []
    for c in KEY_LETTERS:
        i = pieces.get(f"<0x{ord(c):02X}>")
        if i is None:
            enc = tokenizer.encode(c)
            if len(enc) != 1:
                raise ValueError(f"retrieval: tokenizer {tokenizer!r} has no byte piece for {c!r} and encodes it "
                                 f"as {enc} (need one token per key letter)")
            i = enc[0]
        ids.append(int(i))
    if len(set(ids)) != len(ids):
        raise ValueError(f"retrieval: key letters map to repeated token ids {ids}")
    return ids


@dataclasses.dataclass(frozen=True)
class RetrievalInfo:
    key: str  # the queried key's letter
    value: str  # its value digits
    pair_start: int  # window index of the queried record's first token (its key)
    pair_end: int  # window index one past the queried record
    query_start: int  # window index of the last query's first token (its key)
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
        min_pairs: int | None = None,
    ):
        self.seq_len = int(seq_len)
        self.n_pairs = int(n_pairs)
        self.key_digits = int(key_digits)
        self.value_digits = int(value_digits)
        self.min_distance = self.seq_len // 2 if min_distance is None else int(min_distance)
        self.pad_id = int(tokenizer.pad_id)
        self.digits = np.asarray(tokenizer.digit_ids(), np.int32)
        self.key_ids = np.asarray(key_token_ids(tokenizer)[:min(10 ** self.key_digits, len(KEY_LETTERS))], np.int32)
        if set(self.key_ids.tolist()) & set(self.digits.tolist()):
            raise ValueError("retrieval: key tokens overlap the digit (value) tokens")
        if self.n_pairs > len(self.key_ids):
            raise ValueError(f"retrieval: n_pairs={self.n_pairs} exceeds the {len(self.key_ids)} distinct keys "
                             f"(key_digits={self.key_digits}); allowed: n_pairs <= {len(self.key_ids)}")
        self.min_pairs = self.n_pairs if min_pairs is None else int(min_pairs)
        if not 1 <= self.min_pairs <= self.n_pairs:
            raise ValueError(f"retrieval: min_pairs={min_pairs} is invalid; allowed: None or 1 <= min_pairs <= "
                             f"n_pairs={self.n_pairs}")
        self.record_len = 1 + self.value_digits
        self.query_len = self.record_len
        L = self.seq_len + 1
        if L - self.n_pairs * self.record_len - self.min_distance - 1 < self.record_len:
            need = (self.n_pairs + 1) * self.record_len + self.min_distance
            raise ValueError(
                f"retrieval: seq_len={self.seq_len} too short for n_pairs={self.n_pairs} "
                f"(record {self.record_len} tokens), one query and min_distance={self.min_distance}; "
                f"need seq_len >= {need}")
        self.block_len, self.n_queries, self.queries_len, self.filler_len, self.max_offset = self._layout(self.n_pairs)
        filler_stream = np.asarray(filler_stream, np.int32)
        if filler_stream.size == 0:
            raise ValueError("retrieval: empty filler stream")
        longest = self._layout(self.min_pairs)[3]
        if filler_stream.size < longest:
            filler_stream = np.resize(filler_stream, longest)
        self.filler_stream = filler_stream

    def _layout(self, n: int) -> Tuple[int, int, int, int, int]:
        """(block_len, n_queries, queries_len, filler_len, max_offset) of a window holding n records:
        as many queries as fit while the first starts more than min_distance after the block."""
        L = self.seq_len + 1
        block_len = n * self.record_len
        slack = L - block_len - self.min_distance - 1   # room for queries and filler a
        n_queries = min(n, slack // self.record_len)
        queries_len = n_queries * self.record_len
        filler_len = L - block_len - queries_len
        return block_len, n_queries, queries_len, filler_len, filler_len - self.min_distance - 1

    @property
    def train_queries(self) -> int:
        """Supervised lookups per sequence (kept under its old name for reports)."""
        return self.n_queries

    def _record(self, key: int, value: int) -> np.ndarray:
        digits = self.digits[[int(c) for c in f"{value:0{self.value_digits}d}"]]
        return np.concatenate([self.key_ids[[key]], digits])

    def example(self, seed: int, tag: int, index: int, mode: str = "eval", offset: int | None = None
                ) -> Tuple[Dict[str, np.ndarray], RetrievalInfo]:
        """One example; `offset` (None: drawn) places the record block at that window index, in
        [0, self.max_offset] for an eval example (a passkey probe at a chosen depth); the random draws are the
        same either way."""
        if mode not in ("eval", "train"):
            raise ValueError(f"mode={mode!r} is invalid; allowed: 'eval', 'train'")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, tag, index])))
        T, L = self.seq_len, self.seq_len + 1
        n = self.n_pairs
        if mode == "train" and self.min_pairs < n:
            n = int(rng.integers(self.min_pairs, n + 1))
        _, n_queries, _, filler_len, max_offset = self._layout(n)
        keys = rng.choice(len(self.key_ids), size=n, replace=False)
        values = rng.integers(0, 10 ** self.value_digits, size=n)
        q = int(rng.integers(0, n))
        drawn = int(rng.integers(0, max_offset + 1))
        if offset is None:
            offset = drawn
        elif not 0 <= int(offset) <= max_offset:
            raise ValueError(f"offset={offset!r} is invalid; allowed: 0 <= offset <= {max_offset} (seq_len="
                             f"{self.seq_len}, {n} records, min_distance={self.min_distance})")
        offset = int(offset)
        block = np.concatenate([self._record(int(k), int(v)) for k, v in zip(keys, values)])
        others = [int(i) for i in rng.permutation(n) if i != q][:n_queries - 1]
        queries = np.concatenate([self._record(int(keys[i]), int(values[i])) for i in others + [q]])
        fstart = int(rng.integers(0, self.filler_stream.size - filler_len + 1))
        filler = self.filler_stream[fstart:fstart + filler_len]
        win = np.concatenate([filler[:offset], block, filler[offset:], queries]).astype(np.int32)
        assert win.shape == (L,), win.shape
        pair_start = offset + q * self.record_len
        info = RetrievalInfo(
            key=KEY_LETTERS[int(keys[q])],
            value=f"{int(values[q]):0{self.value_digits}d}",
            pair_start=pair_start,
            pair_end=pair_start + self.record_len,
            query_start=L - self.record_len,
            answer_positions=tuple(range(T - self.value_digits, T)),
            value_start=pair_start + 1,
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

