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

The same packing serves chat SFT (glm5_jax.data.chat): an example may also be a rendered conversation
(anything with ``ids`` and a per-token ``loss_mask``, e.g. ``chat.Rendered``), whose mask says which
tokens are trained (assistant tokens, erroneous segments excluded); ``SFTIterator(encode=...)`` turns
each drawn item into such examples.
"""

from __future__ import annotations

import random
from typing import Callable, List, Sequence

import numpy as np

from glm5_jax.config import ModelConfig

__all__ = ["CHARS", "CharVocab", "SFTIterator", "char_policy", "pack_examples", "pack_eval_batches"]

CHARS = "0123456789+-*/=;():> \n"


def char_policy(d: int, h: int, layers: int, ffn: int) -> ModelConfig:
    """The tiny DSA policy of the RL experiments on the character vocabulary: d_model ``d``, ``h`` heads,
    ``layers`` dense layers of FFN width ``ffn``, MLA ranks d/2, indexer top-16 (2 heads of 16), no MoE,
    no MTP."""
    return ModelConfig(vocab_size=CharVocab().padded_size(), d_model=d, num_layers=layers, ffn_dim=ffn,
                       attention="dsa", num_heads=h, q_lora_rank=d // 2, kv_lora_rank=d // 2,
                       qk_nope_head_dim=d // h, qk_rope_head_dim=max(4, d // (2 * h)), v_head_dim=d // h,
                       index_topk=16, index_n_heads=2, index_head_dim=16, num_experts=0, mtp_depth=0, attn_chunk=64)


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


def _as_tokens_and_mask(ex) -> tuple:
    """An example -> (ids, per-token mask: 1 = predicting this token is trained)."""
    if hasattr(ex, "ids") and hasattr(ex, "loss_mask"):
        ids, m = list(ex.ids), list(ex.loss_mask)
        if len(ids) != len(m):
            raise ValueError(f"example has {len(ids)} ids but {len(m)} loss_mask entries")
        return ids, m
    prompt, answer = ex
    return list(prompt) + list(answer), [0] * len(prompt) + [1] * len(answer)


def pack_examples(examples: Sequence, batch_size: int, seq_len: int) -> dict:
    """Examples -> one packed batch dict (numpy, [batch_size, seq_len]).

    An example is a (prompt_ids, answer_ids) pair (the answer is trained) or an object with ``ids`` and
    a per-token ``loss_mask`` (chat.Rendered: the tokens whose mask is 1 are trained). ``loss_mask`` of
    the batch is indexed by target: position j (predicting token j+1) is trained iff token j+1 is.
    Examples are placed in order; one that does not fit in the current row starts the next row; the
    examples that do not fit in the batch are dropped (the caller supplies enough).
    """
    tokens = np.zeros((batch_size, seq_len), np.int32)
    targets = np.zeros((batch_size, seq_len), np.int32)
    mask = np.zeros((batch_size, seq_len), np.float32)
    seg = np.zeros((batch_size, seq_len), np.int32)
    pos = np.zeros((batch_size, seq_len), np.int32)
    row, col, sid = 0, 0, 1
    for example in examples:
        ex, tm = _as_tokens_and_mask(example)
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
        mask[row, col:col + n - 1] = tm[1:]
        seg[row, sl] = sid
        pos[row, sl] = np.arange(n)
        col, sid = col + n, sid + 1
    return {"tokens": tokens, "targets": targets, "loss_mask": mask, "segment_ids": seg, "positions": pos}



def pack_eval_batches(examples: Sequence, n_batches: int, seq_len: int) -> List[dict]:
    """Held-out examples packed like training batches, in order: about ``n_batches`` batches of
    len(examples) // n_batches examples each (one row per example: pack_examples' rows), the last one the
    remainder."""
    per, out = max(1, len(examples) // max(1, n_batches)), []
    for i in range(0, len(examples), per):
        chunk = examples[i:i + per]
        out.append(pack_examples(chunk, len(chunk), seq_len))
    return out

class SFTIterator:
    """Infinite iterator of packed SFT batches from ``make_task(rng) -> Task`` (seeded per batch).

    ``exclude``: prompts never used (the held-out set). ``encode(item) -> list of examples`` (see
    pack_examples); default: ``<bos> prompt`` / ``solution`` of a Task with ``vocab``.
    """

    def __init__(self, make_task: Callable[[random.Random], object], vocab: CharVocab | None, batch_size: int,
                 seq_len: int, seed: int = 0, exclude: Sequence[str] = (), *,
                 encode: Callable[[object], list] | None = None):
        self.make_task, self.vocab = make_task, vocab
        self.encode = encode or (lambda t: [(vocab.encode(t.prompt, bos=True), vocab.encode(t.solution))])
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
            if getattr(t, "prompt", None) in self.exclude:
                continue
            for ex in self.encode(t):
                exs.append(ex)
                used += len(_as_tokens_and_mask(ex)[0])
        return pack_examples(exs, self.batch_size, self.seq_len)

    def __next__(self) -> dict:
        b = self.batch(self.index)
        self.index += 1
        return b

    def get_state(self) -> dict:
        return {"index": self.index, "seed": self.seed}

    def set_state(self, state: dict) -> None:
        self.index = int(state["index"])
