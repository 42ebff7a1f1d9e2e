"""Tokenizers: `load_tokenizer(path)` for a sentencepiece `.model` or a Hugging Face `tokenizer.json`,
`train_hf_tokenizer` (byte-level BPE tokenizer.json, in hf_tokenizer.py), and the default sentencepiece
BPE tokenizer trained here on the training split of the stdlib corpus (`load_or_train_tokenizer`).

Both back ends implement `Tokenizer` (tokenizer_base.py): `vocab_size`, `encode(text)` (special-token
strings inside text are NOT parsed as specials: templates insert special ids explicitly), `decode(ids)`
(specials rendered as their names), `special_id(name)`, `eos_id`, `pad_id`.

Id layout of the sentencepiece model trained here (fixed, independent of vocab_size):
  0  `<pad>`          pad_id (padding in packed batches; also the filler for `targets`)
  1  `<unk>`          unk_id (never produced in practice: byte_fallback is on)
  2  `<|endoftext|>`  eos_id (appended after every document)
  3..23  the other GLM specials of `GLM_SPECIAL_TOKENS` in order (`[MASK]`, `[gMASK]`, ..., `</arg_value>`),
         as control symbols: sentencepiece never produces them from text, exactly like the contract says
  24..279  byte-fallback pieces `<0x00>`..`<0xFF>`
  280..    learned characters and BPE merges
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
from typing import Iterator, List, Optional, Sequence

import sentencepiece as spm

from glm5_jax.data._cache import build_dir_atomically, settings_key
from glm5_jax.data.config import DataConfig
from glm5_jax.data.corpus import Corpus
from glm5_jax.data.hf_tokenizer import HFTokenizer, train_hf_tokenizer
from glm5_jax.data.sources import DataError
from glm5_jax.data.specials import EOS_TOKEN, GLM_SPECIAL_TOKENS
from glm5_jax.data.tokenizer_base import Tokenizer

__all__ = ["EOS_PIECE", "GLM_SPECIAL_TOKENS", "HFTokenizer", "PAD_PIECE", "SentencePieceTokenizer",
           "Tokenizer", "UNK_PIECE", "load_or_train_hf_tokenizer", "load_or_train_tokenizer", "load_tokenizer",
           "load_tokenizer_setting", "resolve_tokenizer", "train_hf_tokenizer"]

PAD_PIECE = "<pad>"
UNK_PIECE = "<unk>"
EOS_PIECE = EOS_TOKEN
_SENTENCE_CHARS = 4000
_FORMAT_VERSION = 2  # 2: all GLM specials as control symbols (1 had 8 user-defined ones)

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
    control_symbols=[t for t in GLM_SPECIAL_TOKENS if t != EOS_PIECE],
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


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `.model` (trained here or brought by the user), with the shared interface."""

    kind = "sentencepiece"

    def __init__(self, model_path: str):
        super().__init__(model_path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except (OSError, RuntimeError) as e:
            raise ValueError(f"tokenizer file {model_path!r} is not a readable sentencepiece model ({e})") from e
        self.unk_id = self._sp.unk_id()
        eos = self._sp.eos_id()
        if eos < 0:
            eos = self._lookup(EOS_PIECE)
        if eos is None:
            raise ValueError(f"sentencepiece model {model_path!r} has no eos id and no {EOS_PIECE!r} piece; "
                             "one is required as the end-of-document id")
        self.eos_id = int(eos)
        pad = self._sp.pad_id()
        self.pad_id = int(pad) if pad >= 0 else self.eos_id
        # sentencepiece's own decode drops control pieces; the contract renders them by name
        n = self._sp.get_piece_size()
        self._control = frozenset(i for i in range(n) if self._sp.is_control(i))

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        out: List[str] = []
        run: List[int] = []
        for i in ids:
            i = int(i)
            if i in self._control:
                if run:
                    out.append(self._sp.decode(run))
                    run = []
                out.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self._sp.decode(run))
        return "".join(out)

    def _lookup(self, name: str) -> Optional[int]:
        i = self._sp.piece_to_id(name)
        # piece_to_id answers unk_id for unknown pieces
        return int(i) if self._sp.id_to_piece(i) == name else None

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self._sp.piece_to_id(piece)


def load_tokenizer(path: str) -> Tokenizer:
    """A sentencepiece `.model` or a Hugging Face `tokenizer.json` (the file, or a directory holding
    `tokenizer.json` or exactly one `*.model`); the format comes from the file name."""
    p = os.path.expanduser(os.fspath(path))
    allowed = "a sentencepiece .model file, a Hugging Face tokenizer .json file, or a directory holding one"
    if not os.path.exists(p):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist; expected {allowed}")
    if os.path.isdir(p):
        if os.path.isfile(os.path.join(p, "tokenizer.json")):
            p = os.path.join(p, "tokenizer.json")
        else:
            models_ = sorted(f for f in os.listdir(p) if f.endswith(".model"))
            if len(models_) != 1:
                raise FileNotFoundError(f"tokenizer directory {path!r} holds no tokenizer.json and "
                                        f"{len(models_)} *.model files ({models_}); expected {allowed}")
            p = os.path.join(p, models_[0])
    if p.endswith(".json"):
        return HFTokenizer(p)
    if p.endswith(".model"):
        return SentencePieceTokenizer(p)
    raise ValueError(f"tokenizer path {path!r} has an unknown format; expected {allowed}")


def _training_sentences(corpus: Corpus, max_bytes: int) -> Iterator[str]:
    """Chunks of whole lines (<= _SENTENCE_CHARS chars) of train documents, up to max_bytes."""
    used = 0
    for text in corpus.texts("train"):
        if used >= max_bytes:
            return
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
        "corpus": corpus.fingerprint(),
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


def load_or_train_tokenizer(cfg: DataConfig, corpus: Corpus) -> SentencePieceTokenizer:
    """Load the cached sentencepiece tokenizer for (cfg, corpus) or train and cache it."""
    d = tokenizer_dir(cfg, corpus)
    build_dir_atomically(d, "meta.json", lambda tmp: _train_spm(cfg, corpus, tmp))
    return SentencePieceTokenizer(os.path.join(d, "spm.model"))


def _train_hf(cfg: DataConfig, corpus: Corpus, out_dir: str) -> None:
    t0 = time.perf_counter()
    sentences = list(_training_sentences(corpus, cfg.tokenizer_train_bytes))
    train_hf_tokenizer(sentences, cfg.vocab_size, os.path.join(out_dir, "tokenizer.json"))
    meta = dict(tokenizer_settings(cfg, corpus), kind="hf", tokenizers=_tokenizers_version(),
                train_seconds=round(time.perf_counter() - t0, 3), train_sentences=len(sentences))
    with open(os.path.join(out_dir, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1, sort_keys=True)


def _tokenizers_version() -> str:
    import tokenizers
    return tokenizers.__version__


def load_or_train_hf_tokenizer(cfg: DataConfig, corpus: Corpus) -> HFTokenizer:
    """Load the cached byte-level BPE tokenizer.json for (cfg, corpus) or train and cache it."""
    settings = dict(tokenizer_settings(cfg, corpus), kind="hf", tokenizers=_tokenizers_version())
    settings.pop("trainer"), settings.pop("sentencepiece")
    d = os.path.join(cfg.resolved_cache_dir(), "tokenizer", f"hf-v{cfg.vocab_size}-{settings_key(settings)}")
    build_dir_atomically(d, "meta.json", lambda tmp: _train_hf(cfg, corpus, tmp))
    return HFTokenizer(os.path.join(d, "tokenizer.json"))


def resolve_tokenizer(cfg: DataConfig, corpus: Corpus) -> Tokenizer:
    """`DataConfig.tokenizer`: None / "spm" -> sentencepiece trained here, "hf" -> tokenizer.json trained
    here (both on the corpus's train split, cached), else load_tokenizer(path)."""
    kind = cfg.tokenizer_kind
    if kind == "spm":
        return load_or_train_tokenizer(cfg, corpus)
    if kind == "hf":
        return load_or_train_hf_tokenizer(cfg, corpus)
    return load_tokenizer_setting(cfg.tokenizer)


def load_tokenizer_setting(path: str) -> Tokenizer:
    """load_tokenizer for `DataConfig.tokenizer`: a missing / unreadable file is one DataError naming the
    setting (a ConfigError: experiments.run prints it as one line and exits 2)."""
    try:
        return load_tokenizer(path)
    except DataError:
        raise
    except (OSError, ValueError) as e:
        raise DataError(f"DataConfig.tokenizer={path!r}: {e}") from None
