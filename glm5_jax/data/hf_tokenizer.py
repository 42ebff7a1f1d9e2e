"""Hugging Face `tokenizer.json` back end (through the `tokenizers` library), and a trainer for
byte-level BPE tokenizer.json files (tests and experiments build one here; nothing is downloaded).

GLM-5 ships its tokenizer as a tokenizer.json whose GLM special tokens ([gMASK], <sop>, <|user|>,
<think>, ...) are added tokens; they are looked up by name (`special_id`).

Contract (shared with the sentencepiece back end in tokenizer.py):
* `encode(text)` never turns the literal text "<|user|>" into the special id: `encode_special_tokens`
  is switched on, so added special tokens are matched only when a template inserts their ids
  explicitly. `add_special_tokens=False`: no post-processor (BOS / [gMASK]<sop> prefixes) is applied.
* `decode(ids)` renders special ids as their names.
* `encode_rendered(text)` is the one exception: the text of a checkpoint's own Jinja chat template
  (glm5_jax.data.hf_chat_template), whose control tokens the template wrote as text, encoded the way
  transformers encodes `apply_chat_template`'s output (every added token in the text becomes its id).
* `eos_id` = id of "<|endoftext|>" (required); `pad_id` = "<|pad|>" or "<pad>" if the file has one,
  else `eos_id` (padding is always masked out of the loss, so sharing the id is harmless).
"""

from __future__ import annotations

import os
from typing import Iterable, List, Optional, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from glm5_jax.data.specials import EOS_TOKEN, GLM_SPECIAL_TOKENS
from glm5_jax.data.tokenizer_base import Tokenizer

_PAD_NAMES = ("<|pad|>", "<pad>")


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer.json, with the shared tokenizer interface."""

    kind = "hf"

    def __init__(self, path: str):
        super().__init__(path)
        try:
            self._tk = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises a bare Exception for malformed JSON
            raise ValueError(f"tokenizer file {path!r} is not a readable Hugging Face tokenizer.json ({e})") from e
        # specials are inserted by templates as ids, never parsed out of user text
        self._tk.encode_special_tokens = True
        # a second instance (the flag is per object and not thread-safe to toggle) for rendered templates
        self._tk_rendered = tokenizers.Tokenizer.from_file(path)
        self._tk_rendered.encode_special_tokens = False
        vocab = self._tk.get_vocab(with_added_tokens=True)
        # max id + 1, not len(vocab): a released vocabulary may have holes in its id range
        self._vocab_size = max(vocab.values()) + 1 if vocab else 0
        eos = self._tk.token_to_id(EOS_TOKEN)
        if eos is None:
            raise ValueError(f"tokenizer file {path!r} has no {EOS_TOKEN!r} token; it is required as the "
                             "end-of-document id (train one with train_hf_tokenizer, which adds it)")
        self.eos_id = int(eos)
        pads = [self._tk.token_to_id(n) for n in _PAD_NAMES]
        self.pad_id = next((int(p) for p in pads if p is not None), self.eos_id)
        self.unk_id = None  # byte-level BPE has no unknown token

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> List[int]:
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_rendered(self, text: str) -> List[int]:
        """A rendered Jinja chat template -> ids, added tokens in the text matched (transformers'
        `tokenizer(rendered, add_special_tokens=False)`); never use it on user text."""
        return self._tk_rendered.encode(text, add_special_tokens=False).ids

    def added_tokens(self) -> List[str]:
        """The added tokens' texts (GLM's control tokens among them): what user text may not contain
        when it goes through `encode_rendered`."""
        return [t.content for t in self._tk.get_added_tokens_decoder().values()]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tk.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def _lookup(self, name: str) -> Optional[int]:
        i = self._tk.token_to_id(name)
        return None if i is None else int(i)

    def id_to_piece(self, i: int) -> str:
        piece = self._tk.id_to_token(int(i))
        if piece is None:
            raise KeyError(f"id {i} is not in tokenizer {self.model_path!r} (vocab_size {self.vocab_size})")
        return piece


def train_hf_tokenizer(texts: Iterable[str], vocab_size: int, out_path: str,
                       special_tokens: Sequence[str] = GLM_SPECIAL_TOKENS) -> HFTokenizer:
    """Train a byte-level BPE tokenizer.json on `texts` and write it to `out_path` (a .json file, or a
    directory that gets `tokenizer.json`); returns it loaded.

    Special tokens take ids 0..len(special_tokens)-1 in the order given, then the 256 byte symbols,
    then merges. Digits are split into single tokens before BPE (as the sentencepiece trainer's
    `split_digits`), so every digit is one token (the retrieval task relies on that); no normaliser,
    no prefix space: `decode(encode(x)) == x` for any text.
    """
    special_tokens = list(special_tokens)
    if EOS_TOKEN not in special_tokens:
        raise ValueError(f"special_tokens must include {EOS_TOKEN!r} (the end-of-document id); got {special_tokens}")
    floor = len(special_tokens) + 256
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < floor:
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; allowed: int >= {floor} "
                         f"({len(special_tokens)} special tokens + 256 byte symbols)")
    out_path = os.fspath(out_path)
    if not out_path.endswith(".json"):
        out_path = os.path.join(out_path, "tokenizer.json")
    tk = tokenizers.Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer)
    if tk.get_vocab_size() <= floor:
        raise ValueError(f"train_hf_tokenizer learned no merges from the given texts (vocab {tk.get_vocab_size()}); "
                         "pass more (non-empty) text")
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    tk.save(tmp)
    os.replace(tmp, out_path)  # atomic: a concurrent reader never sees a half-written file
    return HFTokenizer(out_path)
