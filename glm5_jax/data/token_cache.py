"""On-disk cache of the tokenized corpus.

Layout: `<cache_dir>/tokens/<key>/` with key = hash(tokenizer dir name, corpus fingerprint,
format version), containing for each split in (train, eval):
  `<split>.tokens.npy`  1-D uint16 (vocab <= 65536) or int32: documents concatenated, NO eos
  `<split>.offsets.npy` 1-D int64 [n_docs + 1]: document d is tokens[offsets[d]:offsets[d+1]]
and `index.json` (files per split, token counts, dtype, timing). A second build with the same
settings memory-maps these arrays and never calls the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Dict, List, Tuple

import numpy as np

from glm5_jax.data._cache import build_dir_atomically, settings_key
from glm5_jax.data.corpus import Corpus
from glm5_jax.data.tokenizer import Tokenizer

_FORMAT_VERSION = 1
SPLITS = ("train", "eval")
_ENCODE_CHUNK = 64  # files per encode_batch call


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    tokens: np.ndarray  # [n_tokens] uint16/int32, documents back to back
    offsets: np.ndarray  # [n_docs + 1] int64
    relpaths: Tuple[str, ...]

    @property
    def num_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def doc(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d]:self.offsets[d + 1]]


def token_cache_dir(cache_root: str, tok: Tokenizer, corpus: Corpus) -> str:
    tok_name = os.path.basename(os.path.dirname(tok.model_path))
    key = settings_key({"format": _FORMAT_VERSION, "tokenizer": tok_name,
                        "corpus": corpus.fingerprint()})
    return os.path.join(cache_root, "tokens", key)


def _build(tok: Tokenizer, corpus: Corpus, out_dir: str) -> None:
    dtype = np.uint16 if tok.vocab_size <= 65536 else np.int32
    index: Dict[str, object] = {"format": _FORMAT_VERSION, "dtype": np.dtype(dtype).name,
                                "tokenizer": tok.model_path, "root": corpus.root}
    t0 = time.perf_counter()
    for split in SPLITS:
        files = corpus.split(split)
        pieces: List[np.ndarray] = []
        lengths: List[int] = []
        for i in range(0, len(files), _ENCODE_CHUNK):
            chunk = files[i:i + _ENCODE_CHUNK]
            for ids in tok.encode_batch([corpus.read(f) for f in chunk]):
                pieces.append(np.asarray(ids, dtype=dtype))
                lengths.append(len(ids))
        tokens = np.concatenate(pieces) if pieces else np.zeros([0], dtype)
        offsets = np.zeros([len(lengths) + 1], np.int64)
        np.cumsum(lengths, out=offsets[1:])
        np.save(os.path.join(out_dir, f"{split}.tokens.npy"), tokens)
        np.save(os.path.join(out_dir, f"{split}.offsets.npy"), offsets)
        index[split] = {"files": [f.relpath for f in files], "num_tokens": int(offsets[-1]),
                        "num_bytes": int(sum(f.size for f in files))}
    index["tokenize_seconds"] = round(time.perf_counter() - t0, 3)
    with open(os.path.join(out_dir, "index.json"), "w") as fh:
        json.dump(index, fh, indent=1)


def load_or_build_token_cache(
    cache_root: str, tok: Tokenizer, corpus: Corpus
) -> Tuple[Dict[str, TokenizedSplit], str]:
    """Returns ({split: TokenizedSplit}, cache directory)."""
    d = token_cache_dir(cache_root, tok, corpus)
    build_dir_atomically(d, "index.json", lambda tmp: _build(tok, corpus, tmp))
    with open(os.path.join(d, "index.json")) as fh:
        index = json.load(fh)
    out = {}
    for split in SPLITS:
        out[split] = TokenizedSplit(
            tokens=np.load(os.path.join(d, f"{split}.tokens.npy"), mmap_mode="r"),
            offsets=np.load(os.path.join(d, f"{split}.offsets.npy")),
            relpaths=tuple(index[split]["files"]),
        )
    return out, d
