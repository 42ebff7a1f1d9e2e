"""The shard plan of a corpus: shard k is a contiguous range of documents in corpus order (files by
relative path, documents in file order), cut into pieces that each lie in one file. Every document has
a global id (its position in corpus order); stage outputs name documents by it, and `DocKeys` turns it
back into the document key (glm5_jax.data.sources.document_key) for provenance.

The plan depends only on the corpus and `shard_docs`, never on the number of workers, so every stage's
per-shard output, and the prepared directory, is the same whatever ran it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from glm5_jax.data.corpus import Corpus
from glm5_jax.data.sources import (
    Document,
    SourceFile,
    document_key,
    iter_document_range,
)


@dataclasses.dataclass(frozen=True)
class Piece:
    file: SourceFile
    start: int                    # documents start..stop-1 of the file
    stop: int
    evals: tuple[int, ...]        # those of them in the held-out split (file-local indices)


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    first: int                    # global id of its first document
    pieces: tuple[Piece, ...]
    text_field: str = "text"
    messages_field: str = "messages"

    @property
    def num_docs(self) -> int:
        return sum(p.stop - p.start for p in self.pieces)

    @property
    def name(self) -> str:
        return f"{self.index:05d}"

    def documents(self) -> Iterator[tuple[int, str, Document]]:
        """(global id, split, document) of the shard's documents in corpus order."""
        g = self.first
        for p in self.pieces:
            ev = set(p.evals)
            for i, doc in iter_document_range(p.file, p.start, p.stop, self.text_field, self.messages_field):
                yield g, ("eval" if i in ev else "train"), doc
                g += 1


def plan_shards(corpus: Corpus, shard_docs: int) -> list[Shard]:
    """Shards of at most `shard_docs` documents covering the corpus in order."""
    shards: list[Shard] = []
    pieces: list[Piece] = []
    room, first, g = shard_docs, 0, 0

    def close():
        nonlocal pieces, room, first
        if pieces:
            shards.append(Shard(len(shards), first, tuple(pieces), corpus.text_field, corpus.messages_field))
        pieces, room, first = [], shard_docs, g

    for f, n, ev in zip(corpus.files, corpus.num_docs, corpus.eval_docs):
        start = 0
        while start < n:
            stop = min(n, start + room)
            pieces.append(Piece(f, start, stop, tuple(i for i in ev if start <= i < stop)))
            g += stop - start
            room -= stop - start
            start = stop
            if room == 0:
                close()
    close()
    return shards


class DocKeys:
    """Global document id -> document key (for dropped.jsonl)."""

    def __init__(self, corpus: Corpus):
        self.files = corpus.files
        self.starts = np.concatenate([[0], np.cumsum(corpus.num_docs)]).astype(np.int64)

    def __call__(self, g: int) -> str:
        f = int(np.searchsorted(self.starts, g, side="right")) - 1
        return document_key(self.files[f], int(g - self.starts[f]))
