"""SentencePiece BPE tokenizer trained on the training split of the stdlib corpus.

Id layout (fixed, independent of vocab_size):
  0  `<pad>`          pad_id (padding in packed batches; also the filler for `targets`)
  1  `<unk>`          unk_id (never produced in practice: byte_fallback is on)
  2  `<|endoftext|>`  eos_id (control symbol: appended after every document; `encode`
                      does NOT parse the literal text "<|endoftext|>", use `eos_id`)
  3..10  GLM chat specials, user-defined (so `encode` does parse them from text):
         `[gMASK]`, `<sop>`, `<|system|>`, `<|user|>`, `<|assistant|>`, `<|observation|>`,
         `<think>`, `</think>`
  11..266  byte-fallback pieces `<0x00>`..`<0xFF>`
  267..    learned characters and BPE merges
There is no BOS id.

Trainer options chosen so that `decode(encode(x)) == x` for any text: identity normalisation
(no NFKC), no dummy prefix, `remove_extra_whitespaces=false`, byte fallback, character
coverage 1.0. Training "sentences" are chunks of whole lines (newlines included, <= 4000
chars) so the model learns pieces containing "\n"; `allow_whitespace_only_pieces` lets
indentation runs become single pieces; `split_digits` keeps every digit a separate token
(the retrieval task relies on that).

The trained model lives in `<cache_dir>/tokenizer/spm-v<vocab>-<key>/spm.model` where key
hashes the trainer options, the training byte cap and the training-split fingerprint; it is
reused when present.
"""

from __future__ import annotations

import io
import json
import os
import time
from typing import Dict, Iterator, List, Sequence

import sentencepiece as spm

from glm5_jax.data._cache import build_dir_atomically, settings_key
from glm5_jax.data.config import DataConfig
from glm5_jax.data.corpus import Corpus

PAD_PIECE = "<pad>"
UNK_PIECE = "<unk>"
EOS_PIECE = "<|endoftext|>"
GLM_SPECIAL_TOKENS = (
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
)
_SENTENCE_CHARS = 4000
_FORMAT_VERSION = 1

TRAINER_OPTIONS = dict(
    model_type="bpe",
    byte_fallback=True,
    pad_id=0,
    pad_piece=PAD_PIECE,
    unk_id=1,
    unk_piece=UNK_PIECE,
    bos_id=-1,
    eos_id=2,
    eos_piece=EOS_PIECE,
    user_defined_symbols=list(GLM_SPECIAL_TOKENS),
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    normalization_rule_name="identity",
    split_digits=True,
    allow_whitespace_only_pieces=True,
    split_by_whitespace=True,
    character_coverage=1.0,
    max_sentence_length=4 * _SENTENCE_CHARS + 16,
    num_threads=1,  # deterministic and polite on a shared 2-core machine
)


class Tokenizer:
    """Thin wrapper over a SentencePieceProcessor with GLM special-token accessors."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._sp = spm.SentencePieceProcessor(model_file=model_path)
        self.pad_id = self._sp.pad_id()
        self.eos_id = self._sp.eos_id()
        self.unk_id = self._sp.unk_id()
        names = (PAD_PIECE, UNK_PIECE, EOS_PIECE) + GLM_SPECIAL_TOKENS
        self.special_ids: Dict[str, int] = {n: self._sp.piece_to_id(n) for n in names}

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def special_id(self, name: str) -> int:
        if name not in self.special_ids:
            raise KeyError(f"unknown special token {name!r}; known: {sorted(self.special_ids)}")
        return self.special_ids[name]

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.piece_to_id(piece)

    def digit_ids(self) -> List[int]:
        """Ids of the single-character pieces '0'..'9' (each digit is always one token)."""
        ids = [self._sp.piece_to_id(str(d)) for d in range(10)]
        if any(i == self.unk_id for i in ids):
            raise ValueError(f"tokenizer {self.model_path} lacks a piece for some digit: {ids}")
        return ids


def _training_sentences(corpus: Corpus, max_bytes: int) -> Iterator[str]:
    """Chunks of whole lines (<= _SENTENCE_CHARS chars) from train files, up to max_bytes."""
    used = 0
    for f in corpus.train:
        if used >= max_bytes:
            return
        text = corpus.read(f)
        used += len(text.encode("utf-8"))
        buf: List[str] = []
        n = 0
        for line in text.splitlines(keepends=True):
            while len(line) > _SENTENCE_CHARS:  # pathological long line: hard split
                if buf:
                    yield "".join(buf)
                    buf, n = [], 0
                yield line[:_SENTENCE_CHARS]
                line = line[_SENTENCE_CHARS:]
            if n + len(line) > _SENTENCE_CHARS and buf:
                yield "".join(buf)
                buf, n = [], 0
            buf.append(line)
            n += len(line)
        if buf:
            yield "".join(buf)


def tokenizer_settings(cfg: DataConfig, corpus: Corpus) -> dict:
    return {
        "format": _FORMAT_VERSION,
        "sentencepiece": spm.__version__,
        "vocab_size": cfg.vocab_size,
        "train_bytes": cfg.tokenizer_train_bytes,
        "trainer": TRAINER_OPTIONS,
        "train_split": corpus.fingerprint("train"),
    }


def tokenizer_dir(cfg: DataConfig, corpus: Corpus) -> str:
    key = settings_key(tokenizer_settings(cfg, corpus))
    return os.path.join(cfg.resolved_cache_dir(), "tokenizer", f"spm-v{cfg.vocab_size}-{key}")


def _train_spm(cfg: DataConfig, corpus: Corpus, out_dir: str) -> None:
    sentences = list(_training_sentences(corpus, cfg.tokenizer_train_bytes))
    model = io.BytesIO()
    t0 = time.perf_counter()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            vocab_size=cfg.vocab_size,
            minloglevel=2,
            **TRAINER_OPTIONS,
        )
    except RuntimeError as e:
        raise ValueError(
            f"DataConfig.vocab_size={cfg.vocab_size} could not be trained on "
            f"{sum(len(s) for s in sentences)} chars of training text ({e}); "
            "use a smaller vocab_size or a larger corpus (max_files / max_bytes)"
        ) from e
    seconds = time.perf_counter() - t0
    with open(os.path.join(out_dir, "spm.model"), "wb") as fh:
        fh.write(model.getvalue())
    meta = dict(tokenizer_settings(cfg, corpus), train_seconds=round(seconds, 3),
                train_sentences=len(sentences))
    with open(os.path.join(out_dir, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)


def load_or_train_tokenizer(cfg: DataConfig, corpus: Corpus) -> Tokenizer:
    """Load the cached tokenizer for (cfg, corpus) or train and cache it."""
    d = tokenizer_dir(cfg, corpus)
    build_dir_atomically(d, "meta.json", lambda tmp: _train_spm(cfg, corpus, tmp))
    return Tokenizer(os.path.join(d, "spm.model"))
