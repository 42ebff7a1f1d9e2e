"""Incremental detokenisation of a request's generated tokens, with stop strings.

Decoding the whole generated text again for every new token costs O(n) per token (O(n^2) a request).
`TextStream` decodes a short window instead: the text of ids[prefix:read] (already released) and of
ids[prefix:] (the same window plus the new tokens); the new text is the difference. Both decodes start
at the same token, so whatever a tokenizer does to a window's first token (sentencepiece drops its
leading space) cancels out; a window whose text ends in U+FFFD (an incomplete UTF-8 sequence split
over byte tokens) waits for the next token. The concatenated deltas equal the full decode
(tests/test_serve_detok.py checks it on real text for both tokenizer kinds).

Stop strings: the text is cut before the first stop string; the last len(longest stop) - 1 characters
are held back until they can no longer start one.
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["TextStream"]


class TextStream:
    """One request's text: ``push(token) -> (delta to release, stop string hit)``, ``flush() -> rest``."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: List[int] = []
        self.prefix = 0          # window start (token index)
        self.read = 0            # tokens whose text is in self.text
        self.text = ""           # decoded so far (cut before a stop string)
        self.released = 0        # characters of self.text handed out
        self.stopped = False

    def _new_text(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        full = self.tokenizer.decode(self.ids[self.prefix:])
        if len(full) <= len(done) or full.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return full[len(done):]

    def push(self, token: int) -> tuple[str, bool]:
        """Add a generated token -> (text delta safe to release now, whether a stop string ended the text)."""
        self.ids.append(int(token))
        new = self._new_text()
        if not new:
            return "", False
        start = len(self.text)
        self.text += new
        for s in self.stop:
            j = self.text.find(s, max(0, start - len(s) + 1))
            if j >= 0:
                self.text, self.stopped = self.text[:j], True
        if self.stopped:
            return self.flush(), True
        safe = len(self.text) - self.hold
        if safe <= self.released:
            return "", False
        d = self.text[self.released:safe]
        self.released = safe
        return d, False

    def flush(self) -> str:
        """The text not yet released (the request ended), including a trailing incomplete sequence."""
        if not self.stopped and self.read < len(self.ids):
            done = self.tokenizer.decode(self.ids[self.prefix:self.read])
            self.text += self.tokenizer.decode(self.ids[self.prefix:])[len(done):]
            self.prefix = self.read = len(self.ids)
        d = self.text[self.released:]
        self.released = len(self.text)
        return d
