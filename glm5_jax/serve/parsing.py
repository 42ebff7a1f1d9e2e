"""Incremental parsing of a generated GLM assistant message into OpenAI chat-completion deltas.

``StreamParser`` turns the text of one assistant message, fed in pieces of any size (one token at a time,
or several at once as speculative decoding yields them), into OpenAI ``delta`` fragments:

    {"content": str}
    {"reasoning_content": str}
    {"tool_calls": [{"index": i, "id": "call_...", "type": "function",
                     "function": {"name": name, "arguments": ""}}]}        first fragment of call i
    {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}        later fragments of call i

Contract: the concatenation of the deltas equals ``glm5_jax.data.chat.parse_assistant`` of the whole text
(content, reasoning, and per call the name and ``json.dumps`` of its arguments), for every chunking
(tests/test_stream_parser.py). The format is the project's chat template (glm5_jax/data/chat.py):

    \\n<think>{reasoning}</think>\\n{content}\\n<tool_call>{name}\\n<arg_key>{k}</arg_key>\\n<arg_value>{v}</arg_value>
    \\n</tool_call><|observation|>

with ``parse_assistant``'s rules, which this parser follows step by step:
  * the message ends at its first stop token (``<|user|>``, ``<|observation|>``, ``<|endoftext|>``);
  * reasoning only when the text starts with ``<think>`` or ``\\n<think>``, up to the first ``</think>``
    (a ``<tool_call>`` inside it is reasoning text); reasoning and content are stripped;
  * content runs to the first ``<tool_call>``; then ``<tool_call>...</tool_call>`` blocks, each separated by at
    most one newline; anything else there ends the calls;
  * a call's name is the text before its first ``<arg_key>``, stripped; an argument value is JSON-decoded,
    falling back to the raw string; a call with a bad name, malformed arguments or a repeated key is dropped.

Held back: only text that could still change meaning, i.e. a suffix that is a proper prefix of a tag (or stop
token) relevant in the current state, whitespace that ``strip`` may remove, the name of a call until it is
complete, and an argument value until it is known to be a raw string (then it streams) or it ends (a JSON
value: ``5`` could still become ``5a``).

Tool-call streaming modes:
  ``stream_arguments=True`` (default): a call's name is sent as soon as it is complete and its arguments as
  they become certain, the way OpenAI clients expect. Exact whenever the final tool calls are well formed
  (``parse_assistant`` reports no tool-call errors); a call that later turns out malformed (never closed,
  bad arguments) has already been partly sent and is not retracted; ``parsed()`` gives the authoritative
  message.
  ``stream_arguments=False``: each call is sent whole when its ``</tool_call>`` arrives and validates: exact
  for every text, well formed or not.
"""

from __future__ import annotations

import json
import uuid
from typing import Callable, List, Optional

from glm5_jax.data.chat import STOP_TOKENS, ParsedMessage, parse_assistant

__all__ = ["StreamParser"]

_THINK_OPEN = ("<think>", "\n<think>")
_CALL_OPEN = ("<tool_call>", "\n<tool_call>")
_JSON_WS = " \t\n\r"                       # what json.loads skips before a value
_JSON_START = set('{["-0123456789tfnNI')   # first characters of a JSON value (NaN / Infinity included)


def _held(buf: str, tags) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of tags (text to hold back)."""
    best = 0
    for t in tags:
        for n in range(min(len(t) - 1, len(buf)), best, -1):
            if buf.endswith(t[:n]):
                best = n
                break
    return best


def _find(buf: str, tags):
    """(index, tag) of the earliest occurrence of any tag in buf, or (-1, None)."""
    at, which = -1, None
    for t in tags:
        j = buf.find(t)
        if j >= 0 and (at < 0 or j < at):
            at, which = j, t
    return at, which


class _Stripped:
    """Emits a text stream as text.strip() would end up: leading whitespace dropped, trailing whitespace held
    until something non-blank follows (and dropped at the end)."""

    def __init__(self):
        self.started, self.ws = False, ""

    def push(self, s: str) -> str:
        if not self.started:
            s = s.lstrip()
            if not s:
                return ""
            self.started = True
        body = s.rstrip()
        if not body:
            self.ws += s
            return ""
        out = self.ws + body
        self.ws = s[len(body):]
        return out


class _Call:
    def __init__(self):
        self.name = ""              # raw name text (before the first <arg_key>)
        self.key = ""               # raw key text of the current argument
        self.value = ""             # raw value text of the current argument (until known to be raw)
        self.raw = False            # the current value is a raw string being streamed
        self.keys: List[str] = []
        self.bad = False
        self.index: Optional[int] = None
        self.pending: list = []     # (kind, text) fragments not yet sent (stream_arguments=False)


class StreamParser:
    """Incremental GLM reasoning / tool-call parser. ``feed(text) -> list of deltas``, ``finish() -> the
    rest``. ``thinking=False``: no reasoning block is looked for (a leading ``<think>`` is content);
    ``tools=False``: ``<tool_call>`` is content text. See the module docstring for the contract."""

    def __init__(self, thinking: bool = True, tools: bool = True, *, stream_arguments: bool = True,
                 call_id: Optional[Callable[[], str]] = None):
        self.thinking, self.tools, self.stream_arguments = bool(thinking), bool(tools), bool(stream_arguments)
        self._call_id = call_id or (lambda: f"call_{uuid.uuid4().hex[:24]}")
        self.text = ""              # everything fed so far
        self._raw = ""              # fed text held back as a possible stop-token prefix
        self._buf = ""              # text (before any stop token) not yet consumed by the state machine
        self._state = "start" if self.thinking else "content"
        self._reasoning, self._content = _Stripped(), _Stripped()
        self._call: Optional[_Call] = None
        self._ended = False         # a stop token was seen (or finish() was called)
        self._finished = False
        self.tool_calls = 0         # calls sent so far (finish_reason "tool_calls" when > 0)
        self._out: list = []

    # ------------------------------------------------------------------ public
    def feed(self, text: str) -> List[dict]:
        if not isinstance(text, str):
            raise TypeError(f"StreamParser.feed takes str, got {type(text).__name__}")
        if self._finished:
            raise RuntimeError("StreamParser.feed after finish()")
        self.text += text
        if not self._ended:
            s = self._raw + text
            j, _ = _find(s, STOP_TOKENS)
            if j >= 0:
                self._buf += s[:j]
                self._raw, self._ended = "", True
            else:
                h = _held(s, STOP_TOKENS)
                self._buf += s[:len(s) - h]
                self._raw = s[len(s) - h:]
            self._run(final=self._ended)
        return self._take()

    def finish(self) -> List[dict]:
        """Flush at the end of the message (held-back text is resolved as final)."""
        if not self._finished:
            self._finished = True
            if not self._ended:
                self._buf += self._raw
                self._raw, self._ended = "", True
                self._run(final=True)
        return self._take()

    def parsed(self) -> ParsedMessage:
        """``parse_assistant`` of everything fed (the authoritative message, with its errors)."""
        return parse_assistant(self.text)

    # ------------------------------------------------------------------ output
    def _emit(self, kind: str, text: str, call: Optional[_Call] = None):
        if not text and kind in ("content", "reasoning_content", "arguments"):
            return
        if kind in ("content", "reasoning_content"):
            if self._out and kind in self._out[-1]:
                self._out[-1][kind] += text
            else:
                self._out.append({kind: text})
            return
        # tool-call fragments: ("name", name) or ("arguments", piece); nothing more of a malformed call
        if call.bad:
            return
        if not self.stream_arguments:
            call.pending.append((kind, text))
            return
        self._send(call, kind, text)

    def _send(self, call: _Call, kind: str, text: str):
        if kind == "name":
            call.index = self.tool_calls
            self.tool_calls += 1
            self._out.append({"tool_calls": [{"index": call.index, "id": self._call_id(), "type": "function",
                                              "function": {"name": text, "arguments": ""}}]})
            return
        last = self._out[-1] if self._out else None
        if last is not None and "tool_calls" in last and last["tool_calls"][0]["index"] == call.index:
            last["tool_calls"][0]["function"]["arguments"] += text
        else:
            self._out.append({"tool_calls": [{"index": call.index, "function": {"arguments": text}}]})

    def _take(self) -> List[dict]:
        out, self._out = self._out, []
        return out

    # ------------------------------------------------------------------ state machine
    def _run(self, final: bool):
        while True:
            state = self._state
            getattr(self, "_st_" + state)(final)
            if self._state == state:
                return

    def _st_start(self, final):
        b = self._buf
        for t in _THINK_OPEN:
            if b.startswith(t):
                self._buf = b[len(t):]
                self._state = "think"
                return
        if not final and any(t.startswith(b) for t in _THINK_OPEN):
            return                                           # could still open a reasoning block
        self._state = "content"

    def _st_think(self, final):
        b = self._buf
        j = b.find("</think>")
        if j >= 0:
            self._emit("reasoning_content", self._reasoning.push(b[:j]))
            self._buf = b[j + len("</think>"):]
            self._state = "content"
            return
        h = 0 if final else _held(b, ("</think>",))
        self._emit("reasoning_content", self._reasoning.push(b[:len(b) - h]))
        self._buf = b[len(b) - h:]

    def _st_content(self, final):
        b = self._buf
        if self.tools:
            j = b.find("<tool_call>")
            if j >= 0:
                self._emit("content", self._content.push(b[:j]))
                self._buf = b[j:]
                self._state = "calls"
                return
        h = 0 if (final or not self.tools) else _held(b, ("<tool_call>",))
        self._emit("content", self._content.push(b[:len(b) - h]))
        self._buf = b[len(b) - h:]

    def _st_calls(self, final):
        """Between calls: the next one opens with at most one newline before it; blank text to the end of
        the message is fine; anything else ends the calls (parse_assistant's error), all later text ignored."""
        b = self._buf
        for t in _CALL_OPEN:
            if b.startswith(t):
                self._buf = b[len(t):]
                self._call = _Call()
                self._state = "name"
                return
        if not final and any(t.startswith(b) for t in _CALL_OPEN):
            return
        self._buf, self._state = "", "dead"                  # (blank text to the end is no call either)

    def _st_dead(self, final):
        self._buf = ""

    def _in_call(self, final, stop_tags):
        """Common scan inside a call: -> (index, tag) of the first of stop_tags + </tool_call>, else the
        amount of text that is safe to consume (-1, safe)."""
        b = self._buf
        j, tag = _find(b, stop_tags + ("</tool_call>",))
        if j >= 0:
            return j, tag
        h = 0 if final else _held(b, stop_tags + ("</tool_call>",))
        return -1, len(b) - h

    def _st_name(self, final):
        c = self._call
        j, tag = self._in_call(final, ("<arg_key>",))
        if j < 0:
            c.name += self._buf[:tag]
            self._buf = self._buf[tag:]
            if final:
                self._drop_call()                            # never closed
            return
        c.name += self._buf[:j]
        self._buf = self._buf[j + len(tag):]
        name = c.name.strip()
        if not name or "\n" in name or "<" in name:
            c.bad = True
        else:
            self._emit("name", name, c)
        if tag == "</tool_call>":
            self._emit("arguments", "{}", c)
            self._end_call()
        else:
            self._state = "key"

    def _st_key(self, final):
        c = self._call
        j, tag = self._in_call(final, ("</arg_key>",))
        if j < 0:
            c.key += self._buf[:tag]
            self._buf = self._buf[tag:]
            if final:
                self._drop_call()
            return
        c.key += self._buf[:j]
        self._buf = self._buf[j + len(tag):]
        if tag == "</tool_call>":
            self._drop_call(consumed=True)                  # the body ends inside a key: malformed
        else:
            self._state = "sep"

    def _st_sep(self, final):
        """After </arg_key>: whitespace, then <arg_value>. Otherwise the key's regex (non-greedy up to a
        </arg_key> followed by <arg_value>) extends the key to a later </arg_key>."""
        c, b = self._call, self._buf
        s = b.lstrip()
        if s.startswith("<arg_value>"):
            self._buf = s[len("<arg_value>"):]
            key = c.key.strip()
            if key in c.keys:
                c.bad = True                                 # repeated argument: the call is dropped
            c.keys.append(key)
            self._emit("arguments", ("{" if len(c.keys) == 1 else ", ") + json.dumps(key, ensure_ascii=False)
                       + ": ", c)
            c.value, c.raw = "", False
            self._state = "value"
            return
        if not final and "<arg_value>".startswith(s):
            return
        c.key += "</arg_key>"                               # not a separator: the key goes on
        self._state = "key"

    def _st_value(self, final):
        c = self._call
        j, tag = self._in_call(final, ("</arg_value>",))
        piece = self._buf[:j] if j >= 0 else self._buf[:tag]
        self._buf = self._buf[j + len(tag):] if j >= 0 else self._buf[tag:]
        if c.raw:
            self._emit("arguments", json.dumps(piece, ensure_ascii=False)[1:-1], c)
        else:
            c.value += piece
            lead = c.value.lstrip(_JSON_WS)
            if lead and lead[0] not in _JSON_START:         # can never parse as JSON: a raw string, stream it
                c.raw = True
                self._emit("arguments", json.dumps(c.value, ensure_ascii=False)[:-1], c)
        if j < 0:
            if final:
                self._drop_call()
            return
        if tag == "</tool_call>":
            self._drop_call(consumed=True)
            return
        if c.raw:
            self._emit("arguments", '"', c)
        else:
            try:
                v = json.loads(c.value)
            except ValueError:
                v = c.value
            self._emit("arguments", json.dumps(v, ensure_ascii=False), c)
        self._state = "args"

    def _st_args(self, final):
        """After </arg_value>: whitespace, then the next <arg_key> or the end of the call."""
        c, b = self._call, self._buf
        s = b.lstrip()
        if s.startswith("<arg_key>"):
            self._buf = s[len("<arg_key>"):]
            c.key = ""
            self._state = "key"
            return
        if s.startswith("</tool_call>"):
            self._buf = s[len("</tool_call>"):]
            self._emit("arguments", "}", c)
            self._end_call()
            return
        if not final and ("<arg_key>".startswith(s) or "</tool_call>".startswith(s)):
            return
        self._drop_call()                                    # junk between arguments: malformed

    def _st_skip(self, final):
        """A malformed call: skip to the end of its body (the first </tool_call>), then the next call."""
        j = self._buf.find("</tool_call>")
        if j >= 0:
            self._buf = self._buf[j + len("</tool_call>"):]
            self._call = None
            self._state = "calls"
            return
        h = 0 if final else _held(self._buf, ("</tool_call>",))
        self._buf = self._buf[len(self._buf) - h:]

    def _end_call(self):
        c = self._call
        if c.bad:
            self._call, self._state = None, "calls"
            return
        if not self.stream_arguments:
            for kind, text in c.pending:
                self._send(c, kind, text)
        self._call, self._state = None, "calls"

    def _drop_call(self, consumed: bool = False):
        """The current call is malformed. consumed: its closing </tool_call> is already consumed."""
        self._call.bad = True
        if consumed:
            self._call, self._state = None, "calls"
        else:
            self._state = "skip"
