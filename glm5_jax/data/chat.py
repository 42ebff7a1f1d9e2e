"""GLM's chat template: render messages to token ids with per-token roles and a loss mask, and parse
generated text back into reasoning, content and tool calls.

Format (GLM-4.5 / GLM-5; special tokens are inserted by id, never parsed out of text):

    [gMASK]<sop><|system|>\\n{system}<|user|>\\n{user}<|assistant|>\\n<think>{reasoning}</think>\\n{content}
    \\n<tool_call>{name}\\n<arg_key>{k}</arg_key>\\n<arg_value>{v}</arg_value>\\n</tool_call><|observation|>
    \\n<tool_response>\\n{result}\\n</tool_response><|assistant|>\\n<think></think>\\n{content}<|user|>...

An assistant message is everything after ``<|assistant|>`` up to and including its stop token, which is
the next role token: ``<|observation|>`` after tool calls, ``<|user|>`` after a reply (GLM's stop ids).
The stop token is trained (the model learns when to hand over) and is also the next message's role
token, so it appears once. Consecutive tool results share one ``<|observation|>``.

Thinking modes (``ChatTemplate.mode``):
  interleaved  every assistant message, reply or tool call, starts with ``<think>...</think>``; the
               reasoning of messages before the last user message is dropped from the context (rendered
               ``<think></think>``), as GLM-4.5 does
  preserved    the same, but earlier turns' reasoning is kept in the context (GLM-5's preserved
               thinking for coding agents: the context is exactly what the model generated, so every
               turn is trainable in one sample and the KV cache can be reused across turns)
  turn         interleaved plus a per-turn switch: a user message with ``"thinking": False`` gets
               ``/nothink`` appended and the assistant messages answering it are rendered with a forced
               empty ``<think></think>`` (part of the prompt, not generated)

Loss mask (``Rendered.loss_mask``, per token; 1 = train on predicting this token): 1 exactly on the
tokens an assistant message generates (after ``<|assistant|>``, stop token included), except
  * messages marked ``"error": True`` (kept in the context, masked from the loss, as the GLM-5 report
    does with erroneous SFT segments),
  * messages whose reasoning was dropped from the context (what is shown is not what was generated),
  * a forced ``<think></think>`` of a thinking-off turn (prompt, not generated).
``sft_samples`` turns a conversation into training samples: one sample in preserved mode, one per user
turn otherwise (each training its last turn with the reasoning visible).

Deviations from GLM's Jinja template, for exact round trips: contents and reasoning are stripped; a
string argument value that would parse as JSON (``"5"``, ``"true"``) is written JSON-quoted, so the
parser (which JSON-decodes values and falls back to the raw string, like GLM's) gives the string back.
That is why serving a checkpoint that carries its own Jinja ``chat_template`` renders with it instead
(glm5_jax.data.hf_chat_template); this renderer stays for training samples and masks, parsing, and
checkpoints without one. ``generation_tail`` (thinking off, a forced tool call) serves both.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from glm5_jax.errors import Glm5Error

__all__ = ["ChatFormatError", "ChatTemplate", "MODES", "ROLE_IDS", "ParsedMessage", "Rendered", "TEMPLATE_TOKENS",
           "canonical_messages", "parse_assistant", "parse_conversation", "sft_samples"]

MODES = ("interleaved", "preserved", "turn")
ROLES = ("system", "user", "assistant", "tool")
# per-token role ids (Rendered.roles); 0 = template tokens ([gMASK]<sop>)
ROLE_IDS = {"template": 0, "system": 1, "user": 2, "assistant": 3, "tool": 4}
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": "<|observation|>"}
TEMPLATE_TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>",
                   "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                   "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
STOP_TOKENS = ("<|user|>", "<|observation|>", "<|endoftext|>")
NOTHINK = "/nothink"
_MESSAGE_KEYS = {"system": {"role", "content"}, "user": {"role", "content", "thinking"},
                 "assistant": {"role", "content", "reasoning", "reasoning_content", "tool_calls", "error"},
                 "tool": {"role", "content", "name", "tool_call_id"}}


class ChatFormatError(Glm5Error):
    """A message list, tool call or generated text that does not fit the template."""


@dataclasses.dataclass
class Rendered:
    ids: List[int]
    roles: List[int]            # ROLE_IDS per token
    loss_mask: List[int]        # 1 where the token is trained (see module docstring)
    message_index: List[int]    # index of the message a token belongs to (-1: [gMASK]<sop>)

    def __len__(self) -> int:
        return len(self.ids)


@dataclasses.dataclass
class ParsedMessage:
    """An assistant message parsed from generated text. ``errors`` lists what did not fit the format
    (empty when well formed); ``stop`` is the stop token that ended it (None: the text just ended)."""
    reasoning: Optional[str]
    content: str
    tool_calls: List[dict]
    errors: List[str]
    stop: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not self.errors

    def as_message(self) -> dict:
        m = {"role": "assistant", "content": self.content, "reasoning": self.reasoning or ""}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


# ----------------------------------------------------------------------------- validation
def _check_text(text, where: str) -> str:
    if not isinstance(text, str):
        raise ChatFormatError(f"{where} must be a string, got {type(text).__name__}: {text!r}")
    for t in TEMPLATE_TOKENS:
        if t in text:
            raise ChatFormatError(f"{where} contains the template token {t!r}; message text may not contain "
                                  f"any of {', '.join(TEMPLATE_TOKENS)}")
    return text


def _canonical_call(call, where: str) -> dict:
    if not isinstance(call, dict):
        raise ChatFormatError(f"{where} must be a dict with 'name' and 'arguments', got {call!r}")
    if "function" in call:          # OpenAI style {"type": "function", "function": {...}}
        call = call["function"]
    name, args = call.get("name"), call.get("arguments", {})
    if not isinstance(name, str) or not name.strip() or name != name.strip() or "\n" in name:
        raise ChatFormatError(f"{where}.name={name!r} is invalid: a non-empty single-line string without "
                              f"surrounding whitespace")
    _check_text(name, f"{where}.name")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ChatFormatError(f"{where}.arguments is not valid JSON ({e.msg} at char {e.pos}): {args!r}") from None
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}.arguments must be a JSON object (dict), got {type(args).__name__}: {args!r}")
    out = {}
    for k, v in args.items():
        if not isinstance(k, str) or not k.strip() or k != k.strip():
            raise ChatFormatError(f"{where}.arguments key {k!r} is invalid: a non-empty string without surrounding "
                                  f"whitespace")
        _check_text(k, f"{where}.arguments key")
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            raise ChatFormatError(f"{where}.arguments[{k!r}]={v!r} is not JSON-serialisable") from None
        out[k] = v
    return {"name": name, "arguments": out}


def canonical_messages(messages: Sequence[dict], mode: str = "interleaved") -> List[dict]:
    """Validated copies of ``messages`` in the form ``parse_conversation`` returns: stripped text,
    assistant ``reasoning`` ("" when none) and ``tool_calls`` (only when any; {"name", "arguments"}),
    user ``thinking`` only when False (turn mode). Keeps ``error``. Raises ChatFormatError naming the
    message index and field for bad roles, keys, orders, texts and tool calls."""
    if mode not in MODES:
        raise ChatFormatError(f"mode={mode!r} is invalid: allowed: {', '.join(MODES)}")
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatFormatError(f"messages must be a non-empty list of dicts, got {messages!r}")
    out, prev = [], None
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatFormatError(f"{where} must be a dict, got {type(m).__name__}: {m!r}")
        role = m.get("role")
        if role not in ROLES:
            raise ChatFormatError(f"{where}.role={role!r} is invalid: allowed: {', '.join(ROLES)}")
        extra = set(m) - _MESSAGE_KEYS[role]
        if extra:
            raise ChatFormatError(f"{where} ({role}) has unknown keys {sorted(extra)}: allowed: "
                                  f"{', '.join(sorted(_MESSAGE_KEYS[role]))}")
        # role order: system first only; tool results follow a tool call; no two replies in a row
        if role == "system" and i != 0:
            raise ChatFormatError(f"{where}: a system message may only come first")
        if role == "assistant" and prev not in ("user", "tool"):
            raise ChatFormatError(f"{where}: an assistant message must follow a user or tool message, not {prev!r}")
        if role == "tool" and not (prev == "tool" or (prev == "assistant" and out[-1].get("tool_calls"))):
            raise ChatFormatError(f"{where}: a tool message must follow an assistant message with tool_calls "
                                  f"(or another tool message)")
        if role == "user" and prev not in (None, "system", "assistant"):
            raise ChatFormatError(f"{where}: a user message cannot follow a {prev} message")
        if role == "user" and prev == "assistant" and out[-1].get("tool_calls"):
            raise ChatFormatError(f"{where}: messages[{i - 1}] made tool calls; their results (role 'tool') "
                                  f"must come next")
        c = {"role": role, "content": _check_text(m.get("content", "") or "", f"{where}.content").strip()}
        if role == "user":
            thinking = m.get("thinking", True)
            if not isinstance(thinking, bool):
                raise ChatFormatError(f"{where}.thinking={thinking!r} is invalid: True or False")
            if not thinking and mode != "turn":
                raise ChatFormatError(f"{where}.thinking=False needs mode='turn' (turn-level thinking), not {mode!r}")
            if c["content"].endswith(NOTHINK):
                raise ChatFormatError(f"{where}.content ends with {NOTHINK!r}; set thinking=False instead")
            if not thinking:
                c["thinking"] = False
        if role == "assistant":
            r = m.get("reasoning", m.get("reasoning_content")) or ""
            c["reasoning"] = _check_text(r, f"{where}.reasoning").strip()
            calls = m.get("tool_calls") or []
            if not isinstance(calls, (list, tuple)):
                raise ChatFormatError(f"{where}.tool_calls must be a list, got {calls!r}")
            calls = [_canonical_call(tc, f"{where}.tool_calls[{j}]") for j, tc in enumerate(calls)]
            if calls:
                c["tool_calls"] = calls
            if m.get("error", False):
                c["error"] = True
        out.append(c)
        prev = role
    return out


# ----------------------------------------------------------------------------- rendering
def _arg_value_text(v: Any) -> str:
    if isinstance(v, str):
        try:
            json.loads(v)
        except ValueError:
            return v                                   # GLM writes plain strings raw
        return json.dumps(v, ensure_ascii=False)       # would read back as a non-string: quote it
    return json.dumps(v, ensure_ascii=False)


class ChatTemplate:
    """GLM's chat template over a tokenizer of the project's contract (``encode``, ``decode``,
    ``special_id``): a sentencepiece model or a tokenizer.json (glm5_jax.data.tokenizer.load_tokenizer)."""

    def __init__(self, tokenizer, mode: str = "interleaved"):
        if mode not in MODES:
            raise ChatFormatError(f"ChatTemplate.mode={mode!r} is invalid: allowed: {', '.join(MODES)}")
        self.tok, self.mode = tokenizer, mode
        self.special = {}
        for t in TEMPLATE_TOKENS:
            try:
                self.special[t] = int(tokenizer.special_id(t))
            except (KeyError, ValueError) as e:
                raise ChatFormatError(f"the tokenizer lacks the chat template token {t!r} ({e}); train it with "
                                      f"the GLM special tokens (glm5_jax.data.tokenizer.GLM_SPECIAL_TOKENS)") from None
        self._name_of = {v: k for k, v in self.special.items()}
        self._enc_cache: Dict[str, List[int]] = {}

    @property
    def stop_ids(self) -> tuple:
        """Generation stop ids: the tokens that end an assistant message."""
        return tuple(self.special[t] for t in STOP_TOKENS)

    def _enc(self, text: str) -> List[int]:
        ids = self._enc_cache.get(text)
        if ids is None:
            ids = [int(i) for i in self.tok.encode(text)] if text else []
            if len(self._enc_cache) < 4096:
                self._enc_cache[text] = ids
        return ids

    def _assistant_pieces(self, m: dict, show_reasoning: bool, forced_empty: bool) -> tuple:
        """(prompt pieces, generated pieces) of an assistant message after <|assistant|>; a piece is
        ("s", special) or ("t", text)."""
        think = [("t", "\n"), ("s", "<think>")] + ([("t", m["reasoning"])] if show_reasoning and m["reasoning"] else [])
        think.append(("s", "</think>"))
        gen = []
        if m["content"]:
            gen.append(("t", "\n" + m["content"]))
        for tc in m.get("tool_calls", ()):
            gen += [("t", "\n"), ("s", "<tool_call>"), ("t", tc["name"])]
            for k, v in tc["arguments"].items():
                gen += [("t", "\n"), ("s", "<arg_key>"), ("t", k), ("s", "</arg_key>"), ("t", "\n"),
                        ("s", "<arg_value>"), ("t", _arg_value_text(v)), ("s", "</arg_value>")]
            gen += [("t", "\n"), ("s", "</tool_call>")]
        gen.append(("s", "<|observation|>" if m.get("tool_calls") else "<|user|>"))
        return (think, gen) if forced_empty else ([], think + gen)

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
               tools: Optional[Sequence[dict]] = None) -> Rendered:
        """Messages -> Rendered (ids, roles, loss_mask, message_index). ``add_generation_prompt`` ends with
        ``<|assistant|>`` (plus the forced ``\\n<think></think>`` for a thinking-off turn), the prompt to
        generate the next assistant message from; the last message must then be a user or tool message.
        ``tools``: JSON-serialisable tool descriptions, listed in the system message."""
        msgs = canonical_messages(messages, self.mode)
        if add_generation_prompt and msgs[-1]["role"] not in ("user", "tool"):
            raise ChatFormatError(f"add_generation_prompt needs the last message to be a user or tool message, "
                                  f"not {msgs[-1]['role']!r}")
        shift = 0
        if tools:
            try:
                block = "# Tools\n<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False, sort_keys=True)
                                                         for t in tools) + "\n</tools>"
            except (TypeError, ValueError) as e:
                raise ChatFormatError(f"tools must be JSON-serialisable: {e}") from None
            _check_text(block, "tools")
            if msgs[0]["role"] == "system":
                msgs[0] = dict(msgs[0], content=(msgs[0]["content"] + "\n\n" + block).strip())
            else:
                msgs.insert(0, {"role": "system", "content": block})
                shift = 1           # message_index keeps the caller's numbering (the tools block: -1)
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user") if any(
            m["role"] == "user" for m in msgs) else -1
        out = Rendered([], [], [], [])

        def emit(pieces, role, mask, index):
            for kind, x in pieces:
                ids = [self.special[x]] if kind == "s" else self._enc(x)
                out.ids.extend(ids)
                out.roles.extend([ROLE_IDS[role]] * len(ids))
                out.loss_mask.extend([mask] * len(ids))
                out.message_index.extend([max(index - shift, -1)] * len(ids))

        emit([("s", "[gMASK]"), ("s", "<sop>")], "template", 0, -1)
        thinking_on, prev = True, None
        for i, m in enumerate(msgs):
            role = m["role"]
            if role == "system":
                emit([("s", "<|system|>"), ("t", "\n" + m["content"])], role, 0, i)
            elif role == "user":
                thinking_on = m.get("thinking", True)
                text = "\n" + m["content"] + ("" if thinking_on else NOTHINK)
                head = [] if prev == "assistant" else [("s", "<|user|>")]   # else: the reply's stop token
                emit(head + [("t", text)], role, 0, i)
            elif role == "tool":
                head = [] if prev == "tool" or prev == "assistant" else [("s", "<|observation|>")]
                emit(head + [("t", "\n"), ("s", "<tool_response>"), ("t", "\n" + m["content"] + "\n"),
                             ("s", "</tool_response>")], role, 0, i)
            else:
                show = self.mode == "preserved" or i > last_user
                forced = self.mode == "turn" and not thinking_on
                if forced and m["reasoning"]:
                    raise ChatFormatError(f"messages[{i}] has reasoning but answers a thinking=False turn")
                trained = not m.get("error") and not (m["reasoning"] and not show)
                prompt, gen = self._assistant_pieces(m, show, forced)
                emit([("s", "<|assistant|>")] + prompt, role, 0, i)
                emit(gen, role, int(trained), i)
            prev = role
        if add_generation_prompt:
            forced = self.mode == "turn" and not thinking_on
            emit([("s", "<|assistant|>")] + ([("t", "\n"), ("s", "<think>"), ("s", "</think>")] if forced else []),
                 "assistant", 0, len(msgs))
        return out

    def generation_tail(self, prompt_ids: Sequence[int], *, empty_think: bool,
                        call: Optional[str] = None) -> Tuple[List[int], str]:
        """What a server appends to a generation prompt (``prompt_ids``: this template's rendering or the
        checkpoint's own Jinja template's) -> (ids to append, the text the reply's parser is fed before the
        generated text).

        The prompt ends in one of three ways: ``<|assistant|>`` (this renderer, GLM-4.5's template): an
        ``empty_think`` (thinking off, or a forced call) appends ``\\n<think></think>``; ``</think>`` (a
        thinking-off turn the template already closed): nothing to append; ``<think>`` (templates that open
        the think block for the model, GLM-4.7 / GLM-5 style): the parser is fed ``<think>`` first, and an
        ``empty_think`` appends ``</think>`` to close it. Then, when ``call`` is not None, the start of a
        forced tool call, ``\\n<tool_call>`` + ``call`` (a function's name; "" for any function)."""
        last = int(prompt_ids[-1]) if len(prompt_ids) else None
        ids: List[int] = []
        forced = ""
        if last == self.special["<think>"]:
            forced = "<think>"
            if empty_think:
                ids.append(self.special["</think>"])
                forced += "</think>"
        elif empty_think and last != self.special["</think>"]:
            ids += self._enc("\n") + [self.special["<think>"], self.special["</think>"]]
        if call is not None:
            _check_text(call, "the forced tool call's name")
            ids += self._enc("\n") + [self.special["<tool_call>"]] + self._enc(call)
            forced += "\n<tool_call>" + call
        return ids, forced

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text with the template tokens as their names (the tokenizer's decode)."""
        return self.tok.decode([int(i) for i in ids])

    def parse(self, ids: Sequence[int]) -> ParsedMessage:
        """Generated ids (after the generation prompt) -> ParsedMessage."""
        return parse_assistant(self.decode(ids))


# ----------------------------------------------------------------------------- parsing
_CALL = re.compile(r"\n?<tool_call>(?P<body>.*?)(?:\n?</tool_call>)", re.S)
_ARG = re.compile(r"\s*<arg_key>(?P<k>.*?)</arg_key>\s*<arg_value>(?P<v>.*?)</arg_value>", re.S)
_ROLE_SPLIT = re.compile(r"(<\|system\|>|<\|user\|>|<\|assistant\|>|<\|observation\|>)")


def _arg_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_assistant(text: str, *, strict: bool = False) -> ParsedMessage:
    """One assistant message's text (after ``<|assistant|>``, stop token optional) -> ParsedMessage.
    ``strict``: raise ChatFormatError on the first problem instead of listing it in ``errors``."""
    errors: List[str] = []
    stop, cut = None, len(text)
    for s in STOP_TOKENS:                       # the message ends at its first stop token
        j = text.find(s)
        if 0 <= j < cut:
            stop, cut = s, j
    if stop is not None:
        text = text[:cut]
    reasoning = None
    body = text
    if body.startswith("\n<think>") or body.startswith("<think>"):
        end = body.find("</think>")
        if end < 0:
            errors.append("<think> is never closed with </think>")
            reasoning, body = body.split("<think>", 1)[1].strip(), ""
        else:
            reasoning = body[body.find("<think>") + len("<think>"):end].strip()
            body = body[end + len("</think>"):]
    first = body.find("<tool_call>")
    content = (body if first < 0 else body[:first]).strip()
    calls = []
    if first >= 0:
        rest = body[first:]
        pos = 0
        while pos < len(rest):
            if not rest[pos:].strip():
                break
            mt = _CALL.match(rest, pos)
            if not mt:
                errors.append(f"text after the tool calls is not a <tool_call>...</tool_call>: {rest[pos:pos + 60]!r}")
                break
            b = mt.group("body")
            name, _, argtext = b.partition("<arg_key>")
            argtext = "<arg_key>" + argtext if _ else ""
            name = name.strip()
            args, apos, bad = {}, 0, False
            while apos < len(argtext.rstrip()):
                ma = _ARG.match(argtext, apos)
                if not ma:
                    errors.append(f"tool call {name!r}: malformed arguments {argtext[apos:apos + 60]!r} (expected "
                                  f"<arg_key>k</arg_key><arg_value>v</arg_value> pairs)")
                    bad = True
                    break
                k = ma.group("k").strip()
                if k in args:
                    errors.append(f"tool call {name!r}: argument {k!r} given twice")
                    bad = True
                args[k] = _arg_value(ma.group("v"))
                apos = ma.end()
            if not name or "\n" in name or "<" in name:
                errors.append(f"tool call name {name!r} is invalid")
                bad = True
            if not bad:
                calls.append({"name": name, "arguments": args})
            pos = mt.end()
    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>"):
        if t in content:
            errors.append(f"stray {t} in the content")
            break
    if strict and errors:
        raise ChatFormatError("generated text does not fit the template: " + "; ".join(errors))
    return ParsedMessage(reasoning, content, calls, errors, stop)


def parse_conversation(text: str, mode: str = "interleaved") -> List[dict]:
    """A rendered conversation's text (``ChatTemplate.decode`` of ``render(...).ids``) -> canonical messages
    (``canonical_messages`` form, without ``error``, which is training-only metadata). Strict: any text
    that does not fit raises ChatFormatError."""
    if mode not in MODES:
        raise ChatFormatError(f"mode={mode!r} is invalid: allowed: {', '.join(MODES)}")
    if not text.startswith("[gMASK]<sop>"):
        raise ChatFormatError(f"a rendered conversation starts with '[gMASK]<sop>', got {text[:30]!r}")
    parts = _ROLE_SPLIT.split(text[len("[gMASK]<sop>"):])
    if parts[0]:
        raise ChatFormatError(f"text before the first role token: {parts[0][:60]!r}")
    msgs: List[dict] = []
    role_of = {v: k for k, v in ROLE_TOKENS.items()}
    tokens, bodies = parts[1::2], parts[2::2]
    for tok, body in zip(tokens, bodies):
        role = role_of[tok]
        if msgs and msgs[-1]["role"] == "assistant" and not body:
            continue    # the reply's stop token with nothing after it (end of the conversation)
        if role == "tool":
            chunks = re.findall(r"\n<tool_response>\n(.*?)\n</tool_response>", body, re.S)
            if not chunks or "".join(f"\n<tool_response>\n{c}\n</tool_response>" for c in chunks) != body:
                raise ChatFormatError(f"malformed tool results after <|observation|>: {body[:80]!r}")
            msgs += [{"role": "tool", "content": c.strip()} for c in chunks]
        elif role == "assistant":
            p = parse_assistant(body, strict=True)
            m = p.as_message()
            msgs.append(m)
        else:
            if not body.startswith("\n"):
                raise ChatFormatError(f"{tok} must be followed by a newline: {body[:40]!r}")
            m = {"role": role, "content": body[1:].strip()}
            if role == "user" and mode == "turn" and m["content"].endswith(NOTHINK):
                m["content"] = m["content"][:-len(NOTHINK)].strip()
                m["thinking"] = False
            msgs.append(m)
    return msgs


def sft_samples(template: ChatTemplate, messages: Sequence[dict], *, tools=None) -> List[Rendered]:
    """Training samples of one conversation. preserved mode: the whole conversation, every assistant
    message trained (the context is what was generated). Other modes drop earlier turns' reasoning, so
    each user turn becomes its own sample: the conversation up to the end of that turn, the loss only on
    that turn's assistant messages (their reasoning shown); earlier turns are context."""
    msgs = canonical_messages(messages, template.mode)
    if template.mode == "preserved":
        return [template.render(msgs, tools=tools)]
    users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
    out = []
    for n, u in enumerate(users):
        end = users[n + 1] if n + 1 < len(users) else len(msgs)
        if not any(m["role"] == "assistant" for m in msgs[u:end]):
            continue
        r = template.render(msgs[:end], tools=tools)
        r.loss_mask = [x if mi >= u else 0 for x, mi in zip(r.loss_mask, r.message_index)]
        out.append(r)
    return out
