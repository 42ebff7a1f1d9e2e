"""`Tokenizer`: the interface both back ends (sentencepiece, Hugging Face tokenizer.json) implement.

Everything downstream (token cache, packing, retrieval, chat templates) talks to this interface only:
`vocab_size`, `encode`, `encode_batch`, `decode`, `special_id`, `eos_id`, `pad_id`, `digit_ids`,
`id_to_piece`, `model_path`, `fingerprint`.
"""

from __future__ import annotations

import functools
import hashlib
from typing import List, Optional, Sequence

from glm5_jax.data.specials import GLM_SPECIAL_TOKENS


class Tokenizer:
    kind = "base"
    eos_id: int
    pad_id: int
    unk_id: Optional[int]

    def __init__(self, path: str):
        self.model_path = path

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def id_to_piece(self, i: int) -> str:
        raise NotImplementedError

    def _lookup(self, name: str) -> Optional[int]:
        raise NotImplementedError

    def special_id(self, name: str) -> int:
        """Id of the special token `name` (e.g. "<|user|>"); KeyError listing the GLM specials present."""
        i = self._lookup(name)
        if i is None:
            have = [n for n in GLM_SPECIAL_TOKENS if self._lookup(n) is not None]
            raise KeyError(f"tokenizer {self.model_path!r} has no special token {name!r}; "
                           f"GLM special tokens it has: {have}")
        return i

    def has_special(self, name: str) -> bool:
        return self._lookup(name) is not None

    def digit_ids(self) -> List[int]:
        """Ids of '0'..'9', each of which must encode to exactly one token (retrieval relies on it)."""
        ids = [self.encode(str(d)) for d in range(10)]
        if any(len(e) != 1 for e in ids) or (self.unk_id is not None and any(e[0] == self.unk_id for e in ids)):
            raise ValueError(f"tokenizer {self.model_path!r} does not encode every digit as one token: "
                             f"{dict(zip('0123456789', ids))}")
        return [e[0] for e in ids]

    @functools.cached_property
    def fingerprint(self) -> str:
        """16 hex chars of sha256 over the tokenizer file: caches keyed on it follow the file's content."""
        h = hashlib.sha256()
        with open(self.model_path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()[:16]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_path!r}, vocab_size={self.vocab_size})"
