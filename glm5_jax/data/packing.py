"""Concat-then-split packing of documents into fixed-length LM examples.

Packing scheme (documented contract):
* Every document is followed by `eos_id` and all documents of a split are concatenated into
  one stream `S` (in corpus order; shuffling happens later at the window level).
* Window i covers S[i*T : i*T + T + 1] (consecutive windows share one token):
  `tokens = window[:-1]`, `targets = window[1:]`. A window past the end of S is padded with
  `pad_id`. There are ceil((len(S) - 1) / T) windows, so every token of S is a target once.
* `segment_ids[t]` numbers the documents present in the window starting at 1 (the document
  of tokens[0] is segment 1), 0 = padding. A document longer than T spans several windows
  and gets a new segment in each (attention never crosses windows anyway).
* `positions[t]` = offset of token t inside its document *within this window*: it restarts
  at 0 at every document start and at the start of every window.
* `loss_mask[t]` = 1 iff targets[t] is a real token of the same document as tokens[t]. So
  it is 0 on padding and on each document's final eos (whose "next token" would be the first
  token of the next document). Predicting the eos itself (from the document's last token)
  is trained.
All arrays are int32 of shape [T].

Long documents and context extension (glm5_jax.train.stages): each stage packs the same stream at its
own T (LMData.train_iter(B, stage.seq_len)). A document longer than T is split into consecutive pieces,
one per window; every piece is its own segment and its positions count from 0 at the piece's first
token (0 .. T-1 for a full piece), not from the document's start. Decision: restart, not continue.
Reason: attention never crosses windows, so a piece is a context of at most T tokens whatever came
before it, and RoPE makes attention depend only on position differences, which are the same either
way; continuing would only feed positions up to the document's length (200K for a long document at
any stage length), where float32 angles lose precision (ulp of 2e5 rad is 0.016 rad) and positions
leave the range a stage's RoPE settings (e.g. yarn's original_max_position_embeddings) and its eval
at length T describe. A longer stage then sees longer pieces of the same documents, which is the
extension. Tested: tests/test_data_packing.py::test_long_documents_split_per_stage_length.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from glm5_jax.data.token_cache import TokenizedSplit


class PackedStream:
    """A split as one eos-separated token stream, sliceable into packed windows."""

    def __init__(self, split: TokenizedSplit, eos_id: int, pad_id: int):
        self.eos_id = int(eos_id)
        self.pad_id = int(pad_id)
        n_docs = split.num_docs
        lengths = np.diff(split.offsets) + 1  # + eos
        self.doc_starts = np.zeros([n_docs + 1], np.int64)
        np.cumsum(lengths, out=self.doc_starts[1:])
        stream = np.empty([int(self.doc_starts[-1])], np.int32)
        src = np.asarray(split.tokens)
        for d in range(n_docs):
            a, b = int(split.offsets[d]), int(split.offsets[d + 1])
            s = int(self.doc_starts[d])
            stream[s:s + (b - a)] = src[a:b]
            stream[s + (b - a)] = self.eos_id
        self.stream = stream

    def __len__(self) -> int:
        return int(self.stream.shape[0])

    def num_windows(self, seq_len: int) -> int:
        n = len(self)
        return 0 if n < 2 else -(-(n - 1) // seq_len)

    def window(self, i: int, seq_len: int) -> Dict[str, np.ndarray]:
        T = seq_len
        start = i * T
        n = len(self)
        pos = start + np.arange(T + 1, dtype=np.int64)
        valid = pos < n
        win = np.full([T + 1], self.pad_id, np.int32)
        end = min(start + T + 1, n)
        if end > start:
            win[:end - start] = self.stream[start:end]
        doc = np.searchsorted(self.doc_starts, np.minimum(pos, n - 1), side="right") - 1
        seg = (doc - doc[0] + 1).astype(np.int32)
        seg = np.where(valid, seg, 0)
        doc_first = np.maximum(self.doc_starts[doc], start)
        positions = np.where(valid, pos - doc_first, 0).astype(np.int32)
        loss_mask = (valid[1:] & (doc[1:] == doc[:-1])).astype(np.int32)
        return {
            "tokens": win[:-1].copy(),
            "targets": win[1:].copy(),
            "loss_mask": loss_mask,
            "segment_ids": seg[:-1].astype(np.int32),
            "positions": positions[:-1],
        }


def padding_example(seq_len: int, pad_id: int) -> Dict[str, np.ndarray]:
    """An all-padding row (used to fill the last eval batch to a static shape)."""
    z = np.zeros([seq_len], np.int32)
    return {
        "tokens": np.full([seq_len], pad_id, np.int32),
        "targets": np.full([seq_len], pad_id, np.int32),
        "loss_mask": z.copy(),
        "segment_ids": z.copy(),
        "positions": z.copy(),
    }
