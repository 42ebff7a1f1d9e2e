"""A character-level vocabulary for the RL tasks and a packed SFT iterator for ``glm5_jax.train``.

Vocabulary (``CharVocab``): id 0 ``<pad>`` (== ``glm5_jax.infer.PAD_ID``), id 1 ``<bos>``, then one id
per character of ``CHARS`` (digits, ``+ - * / = ; ( ) : >``, space and newline). Every task prompt
and solution of ``glm5_jax.rl.tasks`` (arithmetic and countdown) encodes losslessly, so a token is a
character and "decode the generated ids" is exact: there is no re-tokenisation anywhere. The
newline (the tasks' terminator) is the stop token for generation.

``SFTIterator`` yields the batch dicts ``glm5_jax.train.train`` consumes: each example is
``<bos> prompt solution``; examples are packed greedily into rows of ``seq_len`` tokens with
``segment_ids`` 1, 2, ... per example (0 = padding) and ``positions`` restarting at 0 per example.
``loss_mask`` is 1 exactly where the *target* is a solution (answer) token, so the prompt is
conditioned on, never trained on. Batch ``i`` is a pure function of ``(seed, i)``: ``get_state`` /
``set_state`` is just the batch counter, which makes the SFT phase resumable.
"""

from __future__ import annotations

import random
from typing import Callable, List, Sequence

import numpy as np

__all__ = ["CHARS", "CharVocab", "SFTIterator", "pack_examples"]

CHARS = "0123456789+-*/=;():> \n"


class CharVocab:
    pad_id = 0
    bos_id = 1

    def __init__(self, chars: str = CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("duplicate characters in the vocabulary")
        self.chars = chars
        self._to_id = {c: i + 2 for i, c in enumerate(chars)}

    @property
    def size(self) -> int:
        return len(self.chars) + 2

    def padded_size(self, multiple: int = 8) -> int:
        return -(-self.size // multiple) * multiple

    @property
    def newline_id(self) -> int:
        return self._to_id["\n"]

    def encode(self, text: str, *, bos: bool = False) -> List[int]:
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the RL vocabulary {self.chars!r}") from None
        return [self.bos_id] + ids if bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Characters of ``ids``; ``<pad>``/``<bos>`` and ids outside the vocabulary are dropped."""
        out = []
        for i in ids:
            i = int(i)
            if 2 <= i < self.size:
                out.append(self.chars[i - 2])
        return "".join(out)


def pack_examples(examples: Sequence[tuple[List[int], List[int]]], batch_size: int, seq_len: int) -> dict:
    """(prompt_ids, answer_ids) pairs -> one packed batch dict (numpy, [batch_size, seq_len]).

    Examples are placed in order; one that does not fit in the current row starts the next row; the
    examples that do not fit in the batch are dropped (the caller supplies enough).
    """
    tokens = np.zeros((batch_size, seq_len), np.int32)
    targets = np.zeros((batch_size, seq_len), np.int32)
    mask = np.zeros((batch_size, seq_len), np.float32)
    seg = np.zeros((batch_size, seq_len), np.int32)
    pos = np.zeros((batch_size, seq_len), np.int32)
    row, col, sid = 0, 0, 1
    for prompt, answer in examples:
        ex = list(prompt) + list(answer)
        n = len(ex)
        if n > seq_len:
            raise ValueError(f"example of {n} tokens does not fit seq_len={seq_len}")
        if col + n > seq_len:
            row, col = row + 1, 0
            if row == batch_size:
                break
        sl = slice(col, col + n)
        tokens[row, sl] = ex
        targets[row, col:col + n - 1] = ex[1:]
        # target index j (predicting ex[j+1]) is an answer token iff j + 1 >= len(prompt)
        mask[row, col + len(prompt) - 1:col + n - 1] = 1.0
        seg[row, sl] = sid
        pos[row, sl] = np.arange(n)
        col, sid = col + n, sid + 1
    return {"tokens": tokens, "targets": targets, "loss_mask": mask, "segment_ids": seg, "positions": pos}


class SFTIterator:
    """Infinite iterator of packed SFT batches from ``make_task(rng) -> Task`` (seeded per batch).

    ``exclude``: prompts never used (the held-out set).
    """

    def __init__(self, make_task: Callable[[random.Random], object], vocab: CharVocab, batch_size: int,
                 seq_len: int, seed: int = 0, exclude: Sequence[str] = ()):
        self.make_task, self.vocab = make_task, vocab
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.exclude = set(exclude)
        self.index = 0

    def __iter__(self):
        return self

    def batch(self, index: int) -> dict:
        rng = random.Random(self.seed * 1_000_003 + index)
        exs, used = [], 0
        budget = self.batch_size * self.seq_len
        while used < budget:
            t = self.make_task(rng)
            if t.prompt in self.exclude:
                continue
            ex = (self.vocab.encode(t.prompt, bos=True), self.vocab.encode(t.solution))
            exs.append(ex)
            used += len(ex[0]) + len(ex[1])
        return pack_examples(exs, self.batch_size, self.seq_len)

    def __next__(self) -> dict:
        b = self.batch(self.index)
        self.index += 1
        return b

    def get_state(self) -> dict:
        return {"index": self.index, "seed": self.seed}

    def set_state(self, state: dict) -> None:
        self.index = int(state["index"])
