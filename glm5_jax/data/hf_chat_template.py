"""A checkpoint's own chat template: the Jinja ``chat_template`` its tokenizer files carry, rendered the way
transformers' ``apply_chat_template`` renders it, then encoded with the template's control tokens as ids.

Why: a GLM checkpoint was trained on the prompts of its own template (its tools preamble, ``/nothink``
and the empty think block of thinking-off turns); vLLM, SGLang, TGI and llama.cpp serve chat requests
with it. The project's Python renderer (glm5_jax.data.chat.ChatTemplate) stays for training masks and
for checkpoints without a template.

Where the template comes from (``load_chat_template``), beside a Hugging Face tokenizer.json:
``chat_template.jinja`` if present, else tokenizer_config.json's ``"chat_template"`` (a string, or a
list of ``{"name", "template"}``: ``tool_use`` when the request has tools and the checkpoint has one,
else ``default``).

Rendering, as transformers does it (so the prompt ids equal ``apply_chat_template``'s; tests/test_serve.py
checks it against transformers itself): a sandboxed Jinja environment (``ImmutableSandboxedEnvironment``,
``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, a ``{% generation %}`` tag that
renders its body), ``tojson`` without HTML escaping (``ensure_ascii=False``), ``raise_exception``,
``strftime_now``; the template sees ``messages``, ``tools``, ``documents`` (None),
``add_generation_prompt``, the tokenizer's special tokens (``eos_token``, ...) and the request's
``chat_template_kwargs`` (``enable_thinking``, ...). Messages: keys whose value is None are dropped;
the reasoning under any of ``reasoning_content`` / ``thinking`` / ``reasoning`` is also given under the
other two names (transformers' aliasing); a tool call's ``arguments`` JSON string is handed to the
template as a mapping (vLLM does the same: GLM's template iterates ``arguments.items()``). The rendered
text is encoded with every added token matched (``HFTokenizer.encode_rendered``); user text that
contains one of them is refused first, so a message can never forge a control token.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from glm5_jax.data.chat import ChatFormatError

__all__ = ["HFChatTemplate", "load_chat_template"]

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant spans with it): its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


def _token_text(v) -> Optional[str]:
    """tokenizer_config.json writes a special token as its text or as {"content": text, ...}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def load_chat_template(tokenizer) -> Optional["HFChatTemplate"]:
    """The chat template of a Hugging Face tokenizer's files (None when they carry none, or the tokenizer is
    not a tokenizer.json). ChatFormatError for a file that is not readable or a template that does not
    compile."""
    if getattr(tokenizer, "kind", None) != "hf":
        return None
    d = os.path.dirname(os.path.abspath(tokenizer.model_path))
    cfg: Dict[str, Any] = {}
    cfg_path = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ChatFormatError(f"{cfg_path} is not a readable JSON file ({e})") from None
        if not isinstance(cfg, dict):
            raise ChatFormatError(f"{cfg_path} must hold a JSON object")
    source: Union[None, str, Dict[str, str]] = cfg.get("chat_template")
    jinja_path = os.path.join(d, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source = f.read()
    if isinstance(source, list):
        try:
            source = {t["name"]: t["template"] for t in source}
        except (TypeError, KeyError):
            raise ChatFormatError(f"{cfg_path}: a list chat_template holds {{'name', 'template'}} objects") from None
    if not source:
        return None
    specials = {k: _token_text(cfg.get(k)) for k in _SPECIAL_KEYS if _token_text(cfg.get(k)) is not None}
    return HFChatTemplate(source, tokenizer, specials)


def _message_view(m: dict, where: str) -> dict:
    """One request message as the template sees it (module docstring: None dropped, reasoning aliased,
    tool-call arguments as a mapping)."""
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
    if reasoning is not None:
        m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        out = []
        for j, tc in enumerate(calls):
            fn = tc.get("function") if isinstance(tc, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except ValueError as e:
                    raise ChatFormatError(f"{where}.tool_calls[{j}].function.arguments is not JSON ({e})") from None
                tc = {**tc, "function": {**fn, "arguments": args}}
            out.append(tc)
        m["tool_calls"] = out
    return m


class HFChatTemplate:
    """A Jinja chat template (or named templates) over an HFTokenizer. ``render_text`` -> the prompt text;
    ``encode`` -> its ids."""

    def __init__(self, source: Union[str, Dict[str, str]], tokenizer, special_tokens: Optional[Dict[str, str]] = None):
        self.tok = tokenizer
        self.special_tokens = dict(special_tokens or {})
        named = source if isinstance(source, dict) else {"default": source}
        env = _environment()
        try:
            self._compiled = {name: env.from_string(text) for name, text in named.items()}
        except jinja2.TemplateError as e:
            raise ChatFormatError(f"the checkpoint's chat_template does not compile: {e}") from None
        # user text must not contain these: encode_rendered would turn them into control ids
        self._controls = sorted({t for t in tokenizer.added_tokens() if t.strip()}, key=len, reverse=True)

    def _pick(self, tools) -> jinja2.Template:
        if tools is not None and "tool_use" in self._compiled:
            return self._compiled["tool_use"]
        if "default" in self._compiled:
            return self._compiled["default"]
        if len(self._compiled) == 1:
            return next(iter(self._compiled.values()))
        raise ChatFormatError(f"the checkpoint has named chat templates {sorted(self._compiled)} and no 'default'")

    def _check_controls(self, x, where: str) -> None:
        stack = [(where, x)]
        while stack:
            w, v = stack.pop()
            if isinstance(v, str):
                for t in self._controls:
                    if t in v:
                        raise ChatFormatError(f"{w} contains the control token {t!r}, which only the chat "
                                              f"template may write")
            elif isinstance(v, dict):
                stack.extend((f"{w}.{k}", y) for k, y in v.items())
                stack.extend((f"{w} key", k) for k in v)
            elif isinstance(v, (list, tuple)):
                stack.extend((f"{w}[{i}]", y) for i, y in enumerate(v))

    def render_text(self, messages: Sequence[dict], *, tools: Optional[Sequence[dict]] = None,
                    add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text; ChatFormatError for messages the template refuses (``raise_exception``, a
        missing field) or that carry a control token. ``kwargs``: chat_template_kwargs."""
        if not isinstance(messages, (list, tuple)) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ChatFormatError("messages must be a non-empty list of message objects")
        self._check_controls(messages, "messages")
        self._check_controls(tools, "tools")
        self._check_controls(kwargs, "chat_template_kwargs")
        msgs = [_message_view(m, f"messages[{i}]") for i, m in enumerate(messages)]
        template = self._pick(tools)
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(messages=msgs, tools=list(tools) if tools is not None else None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
                RecursionError) as e:
            raise ChatFormatError(f"the chat template refused the request: {type(e).__name__}: {e}") from None

    def encode(self, messages: Sequence[dict], *, tools: Optional[Sequence[dict]] = None,
               add_generation_prompt: bool = True, **kwargs) -> List[int]:
        """The prompt ids (``apply_chat_template(..., tokenize=True)``'s)."""
        text = self.render_text(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs)
        return [int(t) for t in self.tok.encode_rendered(text)]
