"""OpenAI-compatible HTTP API over the engine (aiohttp): ``GET /health``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /metrics`` (Prometheus text).

Why aiohttp: one maintained package gives an asyncio HTTP/1.1 server with streamed responses (SSE) and
tells a handler when its client went away (a write to a closed transport fails), which is what frees a
disconnected stream's slot; the engine runs in its own thread and hands tokens to the event loop with
``call_soon_threadsafe``. (The agentic endpoint's stdlib ``http.server`` has neither streaming nor
disconnect detection.)

Completions: ``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists;
``echo``, ``logprobs`` (top-k, <= 20) with ``choices[i].logprobs = {tokens, token_logprobs, top_logprobs,
text_offset}`` over the prompt (with echo; the first prompt token's log-prob null) and the generated
tokens, ``max_tokens=0`` with echo scores the prompt only (how evaluation harnesses read log-likelihoods);
``n``; ``stream``. Chat: the GLM chat template (``glm5_jax.data.chat``), ``tools`` / ``tool_choice`` (auto,
none, required, or a named function: the generation prompt then ends with the forced ``<tool_call>`` /
name), ``chat_template_kwargs.enable_thinking`` (False: the prompt ends with an empty think block) and
``clear_thinking`` (False: preserved thinking, earlier turns' reasoning kept), streamed deltas of
``content`` / ``reasoning_content`` / ``tool_calls`` through ``glm5_jax.serve.parsing.StreamParser``.
Every choice carries the TITO record as ``glm5``: ``{prompt_token_ids, token_ids, logprobs (sampling),
version, rollout_id}``.

Log-probs in ``logprobs`` are the model's log-softmax (temperature 1), as OpenAI reports them; the TITO
record's are those of the distribution the token was drawn from (what RL needs); they agree for
temperature 1 without top-k / top-p.

Errors: ``{"error": {"message", "type", "param", "code"}}`` with 400 (bad JSON, bad fields, prompt too
long, token ids outside the vocabulary, invalid UTF-8 / lone surrogates), 404 (unknown model or route),
405, 413 (body too large), 429 (queue full); a client that disconnects mid-request cancels it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, List, Optional

from aiohttp import web

from glm5_jax.data.chat import ChatFormatError, ChatTemplate
from glm5_jax.data.hf_chat_template import load_chat_template
from glm5_jax.serve.engine import EngineError, QueueFull, SamplingParams
from glm5_jax.serve.metrics import CONTENT_TYPE_LATEST

__all__ = ["APIError", "OpenAIServer", "run_in_thread"]

MAX_N = 16
MAX_LOGPROBS = 20


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request", 404: "not_found", 405: "method_not_allowed",
                             413: "request_too_large", 429: "queue_full"}.get(status, "error")
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status)


def _bad(message, param=None, code=None):
    return APIError(400, message, param, code)


def _check_str(s: str, param: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(f"{param} is not valid Unicode text (a lone surrogate)", param) from None
    return s


def _deep_check_str(x, param: str):
    if isinstance(x, str):
        _check_str(x, param)
    elif isinstance(x, dict):
        for k, v in x.items():
            _deep_check_str(k, param)
            _deep_check_str(v, param)
    elif isinstance(x, list):
        for v in x:
            _deep_check_str(v, param)


def _int(body, name, default, lo, hi):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{name}={v!r} is invalid: an integer in [{lo}, {hi}]", name)
    return v


def _num(body, name, default, lo, hi, lo_open=False):
    v = body.get(name, default)
    if v is None:
        v = default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise _bad(f"{name}={v!r} is invalid: a number in {'(' if lo_open else '['}{lo}, {hi}]", name)
    return float(v)


class OpenAIServer:
    def __init__(self, engine, tokenizer, *, model_name: str = "glm5", chat_mode: str = "interleaved",
                 max_body: int = 8 << 20):
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.max_body = max_body
        self.templates = {}
        self.chat_mode = chat_mode
        try:
            self.templates[chat_mode] = ChatTemplate(tokenizer, chat_mode)
            self.templates.setdefault("preserved", ChatTemplate(tokenizer, "preserved"))
        except ChatFormatError:
            self.templates = {}       # a tokenizer without GLM chat tokens: no tool-call / thinking tail
        # the checkpoint's own Jinja template renders chat prompts when its tokenizer files carry one
        self.hf_template = load_chat_template(tokenizer)
        self.created = int(time.time())
        self._piece_cache = {}

    # ---------------------------------------------------------------- app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        try:
            return await handler(request)
        except APIError as e:
            return e.response()
        except web.HTTPRequestEntityTooLarge as e:
            return APIError(413, f"request body too large: {e.text}").response()
        except web.HTTPNotFound:
            return APIError(404, f"no route {request.method} {request.path}").response()
        except web.HTTPMethodNotAllowed:
            return APIError(405, f"method {request.method} not allowed on {request.path}").response()
        except web.HTTPException as e:
            return APIError(e.status, e.reason or "error").response()
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:      # a bug, not bad input: still an OpenAI-style body
            return APIError(500, f"{type(e).__name__}: {e}", type_="server_error", code="internal_error").response()

    async def health(self, request):
        return web.json_response({"status": "ok", "model": self.model_name, "running": self.engine.active,
                                  "waiting": self.engine.queue_length, "version": self.engine.version})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "glm5_jax",
             "max_model_len": self.engine.max_len}]})

    async def metrics(self, request):
        m = self.engine.metrics
        body = m.render() if m is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---------------------------------------------------------------- request parsing
    async def _body(self, request) -> dict:
        raw = await request.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad(f"the body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            body = json.loads(text)
        except ValueError as e:
            raise _bad(f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            if not isinstance(model, str):
                raise _bad(f"model must be a string, got {model!r}", "model")
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")
        return body

    def _sampling(self, body, max_tokens: int, *, min_tokens: int = 1) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if _num(body, name, 0.0, -2.0, 2.0) != 0.0:
                raise _bad(f"{name} is not supported (only 0)", name)
        if body.get("logit_bias"):
            raise _bad("logit_bias is not supported", "logit_bias")
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or len(stop) > 16 or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop must be a non-empty string or a list of at most 16 non-empty strings", "stop")
        for s in stop:
            _check_str(s, "stop")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                     and 0 <= t < self.engine.config.vocab_size for t in stop_ids):
            raise _bad(f"stop_token_ids must be token ids in [0, {self.engine.config.vocab_size})", "stop_token_ids")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2 ** 63 <= seed < 2 ** 64):
            raise _bad(f"seed={seed!r} is invalid: an integer", "seed")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise _bad("ignore_eos must be a boolean", "ignore_eos")
        return SamplingParams(max_tokens=max_tokens, temperature=_num(body, "temperature", 1.0, 0.0, 2.0),
                              top_p=_num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
                              top_k=_int(body, "top_k", 0, 0, self.engine.config.vocab_size) if body.get("top_k") != -1
                              else 0, seed=seed, stop=stop, stop_token_ids=stop_ids, ignore_eos=ignore_eos)

    def _max_tokens(self, body, prompt_len: int, *, allow_zero=False, names=("max_tokens",)):
        room = self.engine.max_len - prompt_len
        v = None
        for name in names:
            if body.get(name) is not None:
                v, used = body[name], name
                break
        if v is None:
            return (16 if names[0] == "max_tokens" and "messages" not in body else room), room
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if allow_zero else 1):
            raise _bad(f"{used}={v!r} is invalid: an integer >= {0 if allow_zero else 1}", used)
        if v > room:
            raise _bad(f"this model's maximum context length is {self.engine.max_len} tokens; the prompt has "
                       f"{prompt_len} tokens and {used}={v} more were asked for ({prompt_len + v})", used,
                       "context_length_exceeded")
        return v, room

    def _check_prompt_ids(self, ids: List[int], param="prompt"):
        v = self.engine.config.vocab_size
        for t in ids:
            if not 0 <= t < v:
                raise _bad(f"token id {t} is outside the vocabulary [0, {v})", param)
        if not ids:
            raise _bad("the prompt is empty", param)
        if len(ids) >= self.engine.max_len:
            raise _bad(f"this model's maximum context length is {self.engine.max_len} tokens; the prompt has "
                       f"{len(ids)}", param, "context_length_exceeded")

    def _prompts(self, prompt) -> List[tuple]:
        """-> [(ids, text or None)]"""
        def is_ids(x):
            return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        if isinstance(prompt, str):
            items = [prompt]
        elif is_ids(prompt):
            items = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            items = prompt
        else:
            raise _bad("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
                       "prompt")
        if len(items) > 64:
            raise _bad("at most 64 prompts per request", "prompt")
        out = []
        for p in items:
            if isinstance(p, str):
                _check_str(p, "prompt")
                ids = [int(t) for t in self.tok.encode(p)]
                out.append((ids, p))
            else:
                out.append(([int(t) for t in p], None))
            self._check_prompt_ids(out[-1][0])
        return out

    # ---------------------------------------------------------------- engine bridge
    def _submit(self, ids, sp, loop, q, rid):
        def on_event(h, ev):
            loop.call_soon_threadsafe(q.put_nowait, (h, ev))
        try:
            return self.engine.submit(ids, sp, request_id=rid, on_event=on_event)
        except QueueFull as e:
            raise APIError(429, str(e)) from None
        except EngineError as e:
            raise _bad(str(e), e.param) from None

    async def _wait_all(self, request, handles, q):
        """Wait until every handle finished; cancel them all if the client goes away."""
        left = {h.id for h in handles}
        try:
            while left:
                try:
                    h, ev = await asyncio.wait_for(q.get(), 0.25)
                except asyncio.TimeoutError:
                    tr = request.transport
                    if tr is None or tr.is_closing():
                        raise ConnectionResetError("client went away")
                    continue
                if isinstance(ev, str):
                    left.discard(h.id)
        except BaseException:
            for h in handles:
                h.cancel()
            raise

    def _error_of(self, h):
        if h.finish_reason == "error":
            raise APIError(500, f"generation failed: {h.error}", type_="server_error", code="internal_error")

    def _piece(self, t: int) -> str:
        s = self._piece_cache.get(t)
        if s is None:
            s = self._piece_cache[t] = self.tok.decode([t])
        return s

    @staticmethod
    def _tito(h, rid):
        return {"prompt_token_ids": h.prompt, "token_ids": list(h.tokens), "logprobs": list(h.sample_logprobs),
                "version": h.versions[-1] if h.versions else None, "versions": sorted(set(h.versions)),
                "rollout_id": rid, "reused_prefix_tokens": h.reused_tokens}

    @staticmethod
    def _usage(prompt_tokens, handles, counted=None):
        comp = sum(len(h.tokens) for i, h in enumerate(handles) if counted is None or counted[i])
        return {"prompt_tokens": prompt_tokens, "completion_tokens": comp, "total_tokens": prompt_tokens + comp}

    # ---------------------------------------------------------------- /v1/completions
    def _completion_logprobs(self, h, k, echo, prompt_text_len, gen_tokens):
        tokens, lps, tops, offs = [], [], [], []
        off = 0 if echo else prompt_text_len
        if echo:
            for i, t in enumerate(h.prompt):
                s = self._piece(t)
                tokens.append(s)
                lps.append(h.prompt_logprobs[i] if h.prompt_logprobs else None)
                tops.append(None if i == 0 or not h.prompt_top_logprobs else
                            {self._piece(a): b for a, b in h.prompt_top_logprobs[i][:k]} if k else None)
                offs.append(off)
                off += len(s)
        for i in range(gen_tokens):
            s = self._piece(h.tokens[i])
            tokens.append(s)
            lps.append(h.logprobs[i])
            tops.append({self._piece(a): b for a, b in h.top_logprobs[i][:k]} if k else None)
            offs.append(off)
            off += len(s)
        if echo and k and tops:
            tops = [t if t is not None or i == 0 else {} for i, t in enumerate(tops)]
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}

    async def completions(self, request):
        body = await self._body(request)
        if "prompt" not in body:
            raise _bad("prompt is required", "prompt")
        for name, ok in (("suffix", None), ("best_of", 1)):
            if body.get(name) not in (None, ok):
                raise _bad(f"{name} is not supported", name)
        prompts = self._prompts(body["prompt"])
        echo = body.get("echo", False)
        stream = body.get("stream", False)
        if not isinstance(echo, bool) or not isinstance(stream, bool):
            raise _bad("echo and stream must be booleans", "echo" if not isinstance(echo, bool) else "stream")
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS):
            raise _bad(f"logprobs={lp!r} is invalid: an integer in [0, {MAX_LOGPROBS}]", "logprobs")
        n = _int(body, "n", 1, 1, MAX_N)
        jobs = []
        for pi, (ids, text) in enumerate(prompts):
            mt, _ = self._max_tokens(body, len(ids), allow_zero=echo)
            sp = self._sampling(body, max(mt, 1))
            sp.prompt_logprobs = bool(echo and lp is not None)
            if mt == 0:
                sp.ignore_eos = True
            for j in range(n):
                s = sp if sp.seed is None or n == 1 else SamplingParams(**{**sp.__dict__, "seed": sp.seed + j})
                jobs.append((pi, ids, text, s, mt))
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        cid = f"cmpl-{uuid.uuid4().hex}"
        rid = body.get("rollout_id") if isinstance(body.get("rollout_id"), str) else cid
        handles = []
        try:
            for k, (pi, ids, text, sp, mt) in enumerate(jobs):
                handles.append(self._submit(ids, sp, loop, q, f"{cid}-{k}"))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        if stream:
            return await self._stream_completions(request, body, jobs, handles, q, cid, rid, echo, lp,
                                                  sum(len(ids) for ids, _ in prompts))
        await self._wait_all(request, handles, q)
        choices = []
        for k, ((pi, ids, text, sp, mt), h) in enumerate(zip(jobs, handles)):
            self._error_of(h)
            ptext = text if text is not None else self.tok.decode(ids)
            gen = len(h.tokens) if mt > 0 else 0
            out = (ptext if echo else "") + (h.text if mt > 0 else "")
            c = {"index": k, "text": out, "finish_reason": h.finish_reason if mt > 0 else "length",
                 "logprobs": self._completion_logprobs(h, lp, echo, len(ptext), gen) if lp is not None else None,
                 "glm5": self._tito(h, rid)}
            choices.append(c)
        usage = self._usage(sum(len(ids) for ids, _ in prompts), handles, [j[4] > 0 for j in jobs])
        return web.json_response({"id": cid, "object": "text_completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": choices, "usage": usage})

    async def _sse_start(self, request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _sse(resp, obj):
        await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

    async def _stream_completions(self, request, body, jobs, handles, q, cid, rid, echo, lp, n_prompt):
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) \
            if isinstance(body.get("stream_options"), dict) else False
        by_id = {h.id: k for k, h in enumerate(handles)}
        left = set(by_id)
        offsets = {}
        created = int(time.time())
        resp = await self._sse_start(request)
        base = {"id": cid, "object": "text_completion", "created": created, "model": self.model_name}
        try:
            if echo:
                for k, (pi, ids, text, sp, mt) in enumerate(jobs):
                    ptext = text if text is not None else self.tok.decode(ids)
                    await self._sse(resp, {**base, "choices": [{"index": k, "text": ptext, "logprobs": None,
                                                                "finish_reason": None}]})
            while left:
                h, ev = await q.get()
                k = by_id[h.id]
                mt = jobs[k][4]
                if isinstance(ev, str):
                    left.discard(h.id)
                    self._error_of(h)
                    await self._sse(resp, {**base, "choices": [{"index": k, "text": "", "logprobs": None,
                                                                "finish_reason": ev if mt > 0 else "length",
                                                                "glm5": self._tito(h, rid)}]})
                    continue
                if mt == 0:
                    continue
                lpo = None
                if lp is not None:
                    s = self._piece(ev.token)
                    if k not in offsets:
                        ptext = jobs[k][2] if jobs[k][2] is not None else self.tok.decode(jobs[k][1])
                        offsets[k] = len(ptext)
                    lpo = {"tokens": [s], "token_logprobs": [ev.logprob],
                           "top_logprobs": [{self._piece(a): b for a, b in ev.top[:lp]} if lp else None],
                           "text_offset": [offsets[k]]}
                    offsets[k] += len(s)
                if ev.text or lpo is not None:
                    await self._sse(resp, {**base, "choices": [{"index": k, "text": ev.text, "logprobs": lpo,
                                                                "finish_reason": None}]})
            if include_usage:
                await self._sse(resp, {**base, "choices": [],
                                       "usage": self._usage(n_prompt, handles, [j[4] > 0 for j in jobs])})
            await self._sse(resp, b"[DONE]")
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return resp

    # ---------------------------------------------------------------- /v1/chat/completions
    def _messages(self, msgs):
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages must be a non-empty list of message objects", "messages")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise _bad(f"messages[{i}] must be an object", "messages")
            m = dict(m)
            if m.get("role") == "developer":
                m["role"] = "system"
            c = m.get("content")
            if isinstance(c, list):       # content parts: text only
                texts = []
                for part in c:
                    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
                    texts.append(part["text"])
                m["content"] = "".join(texts)
            elif c is None:
                m["content"] = ""
            elif not isinstance(c, str):
                raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
            m.pop("name", None) if m.get("role") in ("user", "system", "assistant") else None
            if m.get("role") == "assistant":
                m.pop("refusal", None)
                m.pop("audio", None)
                m.pop("function_call", None)
                if m.get("tool_calls") is None:
                    m.pop("tool_calls", None)
            out.append(m)
        _deep_check_str(out, "messages")
        return out

    async def chat(self, request):
        body = await self._body(request)
        if not self.templates and self.hf_template is None:
            raise _bad("this model's tokenizer has neither a chat_template nor the GLM chat template tokens; use "
                       "/v1/completions", "messages")
        msgs = self._messages(body.get("messages"))
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise _bad("chat_template_kwargs must be an object", "chat_template_kwargs")
        reserved = sorted(set(kwargs) & {"messages", "tools", "documents", "add_generation_prompt"})
        if reserved:
            raise _bad(f"chat_template_kwargs may not set {reserved}: they are the request's own fields",
                       "chat_template_kwargs")
        thinking = kwargs.get("enable_thinking", True)
        clear = kwargs.get("clear_thinking", True)
        if not isinstance(thinking, bool) or not isinstance(clear, bool):
            raise _bad("chat_template_kwargs.enable_thinking / clear_thinking must be booleans", "chat_template_kwargs")
        tools = body.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise _bad("tools must be a list of tool objects", "tools")
        _deep_check_str(tools, "tools")
        choice = body.get("tool_choice", "auto" if tools else "none")
        forced_name = None
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            forced_name = fn.get("name") if isinstance(fn, dict) else None
            names = [((t.get("function") or {}).get("name") if isinstance(t.get("function"), dict) else t.get("name"))
                     for t in tools or []]
            if not isinstance(forced_name, str) or forced_name not in names:
                raise _bad(f"tool_choice names a function that is not in tools: {choice!r}", "tool_choice")
        elif choice not in ("auto", "none", "required"):
            raise _bad(f"tool_choice={choice!r} is invalid: auto, none, required or a named function", "tool_choice")
        elif choice == "required" and not tools:
            raise _bad("tool_choice='required' needs tools", "tool_choice")
        use_tools = bool(tools) and choice != "none"
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise _bad("stream must be a boolean", "stream")
        lp = body.get("logprobs", False)
        top_n = body.get("top_logprobs")
        if not isinstance(lp, bool) or (top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int)
                                                               or not 0 <= top_n <= MAX_LOGPROBS)):
            raise _bad(f"logprobs must be a boolean and top_logprobs an integer in [0, {MAX_LOGPROBS}]", "logprobs")
        force_call = use_tools and (forced_name is not None or choice == "required")
        template = self.templates.get("preserved" if not clear else self.chat_mode)
        try:
            if self.hf_template is not None:
                ids = self.hf_template.encode(msgs, tools=tools if use_tools else None, add_generation_prompt=True,
                                              **kwargs)
            else:
                ids = list(template.render(msgs, add_generation_prompt=True, tools=tools if use_tools else None).ids)
        except ChatFormatError as e:
            raise _bad(f"bad messages: {e}", "messages") from None
        forced = ""
        if template is not None:
            tail, forced = template.generation_tail(ids, empty_think=not thinking or force_call,
                                                    call=(forced_name or "") if force_call else None)
            ids += tail
        elif force_call:
            raise _bad("a forced tool call needs the GLM chat template tokens in the tokenizer", "tool_choice")
        self._check_prompt_ids(ids, "messages")
        mt, _ = self._max_tokens(body, len(ids), names=("max_completion_tokens", "max_tokens"))
        sp = self._sampling(body, mt)
        n = _int(body, "n", 1, 1, MAX_N)
        stop_ids = list(template.stop_ids) if template is not None else []
        sp.stop_token_ids = list(sp.stop_token_ids) + stop_ids
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        rid = body.get("rollout_id") if isinstance(body.get("rollout_id"), str) else cid
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        handles = []
        try:
            for j in range(n):
                s = sp if sp.seed is None or n == 1 else SamplingParams(**{**sp.__dict__, "seed": sp.seed + j})
                handles.append(self._submit(ids, s, loop, q, f"{cid}-{j}"))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        think_gen = thinking and not forced and (template is None or ids[-1] != template.special["</think>"])
        ctx = dict(thinking=think_gen, tools=use_tools, forced=forced, lp=lp, top_n=top_n or 0, rid=rid,
                   stop_ids=set(stop_ids))
        if stream:
            return await self._stream_chat(request, body, handles, q, cid, dict(ctx, n_prompt=len(ids)))
        await self._wait_all(request, handles, q)
        choices = []
        for j, h in enumerate(handles):
            self._error_of(h)
            p = self._parser(ctx)
            msg, calls = _assemble(p.feed(forced + self._chat_text(h, ctx)) + p.finish())
            fin = "tool_calls" if calls else h.finish_reason
            c = {"index": j, "message": msg, "finish_reason": fin, "logprobs": self._chat_logprobs(h, ctx) if lp else None,
                 "glm5": self._tito(h, rid)}
            choices.append(c)
        return web.json_response({"id": cid, "object": "chat.completion", "created": int(time.time()),
                                  "model": self.model_name, "choices": choices,
                                  "usage": self._usage(len(ids), handles)})

    def _chat_text(self, h, ctx) -> str:
        """The generated text with its stop token's name (parse_assistant reads it) unless cut by length."""
        text = h.text
        if h.tokens and h.tokens[-1] in ctx["stop_ids"] and h.finish_reason == "stop":
            text += self._piece(h.tokens[-1])
        return text

    def _chat_logprobs(self, h, ctx):
        k = ctx["top_n"]
        items = []
        for i, t in enumerate(h.tokens):
            s = self._piece(t)
            items.append({"token": s, "logprob": h.logprobs[i], "bytes": list(s.encode("utf-8")),
                          "top_logprobs": [{"token": self._piece(a), "logprob": b,
                                            "bytes": list(self._piece(a).encode("utf-8"))}
                                           for a, b in h.top_logprobs[i][:k]]})
        return {"content": items}

    def _parser(self, ctx):
        from glm5_jax.serve.parsing import StreamParser
        return StreamParser(thinking=ctx["thinking"], tools=ctx["tools"])

    async def _stream_chat(self, request, body, handles, q, cid, ctx):
        so = body.get("stream_options")
        include_usage = bool(so.get("include_usage")) if isinstance(so, dict) else False
        by_id = {h.id: j for j, h in enumerate(handles)}
        parsers = [self._parser(ctx) for _ in handles]
        left = set(by_id)
        created = int(time.time())
        base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        resp = await self._sse_start(request)

        def chunk(j, delta, finish=None, **extra):
            return {**base, "choices": [{"index": j, "delta": delta, "logprobs": extra.pop("logprobs", None),
                                         "finish_reason": finish, **extra}]}
        try:
            for j, p in enumerate(parsers):
                await self._sse(resp, chunk(j, {"role": "assistant", "content": ""}))
                if ctx["forced"]:
                    for d in p.feed(ctx["forced"]):
                        await self._sse(resp, chunk(j, d))
            while left:
                h, ev = await q.get()
                j = by_id[h.id]
                p = parsers[j]
                if isinstance(ev, str):
                    left.discard(h.id)
                    self._error_of(h)
                    tail = self._piece(h.tokens[-1]) if (h.tokens and h.tokens[-1] in ctx["stop_ids"]
                                                         and ev == "stop") else ""
                    for d in (p.feed(tail) if tail else []) + p.finish():
                        await self._sse(resp, chunk(j, d))
                    fin = "tool_calls" if p.tool_calls else ev
                    await self._sse(resp, chunk(j, {}, fin, glm5=self._tito(h, ctx["rid"])))
                    continue
                lpo = None
                if ctx["lp"]:
                    s = self._piece(ev.token)
                    lpo = {"content": [{"token": s, "logprob": ev.logprob, "bytes": list(s.encode("utf-8")),
                                        "top_logprobs": [{"token": self._piece(a), "logprob": b,
                                                          "bytes": list(self._piece(a).encode("utf-8"))}
                                                         for a, b in ev.top[:ctx["top_n"]]]}]}
                deltas = p.feed(ev.text) if ev.text else []
                for i, d in enumerate(deltas):
                    await self._sse(resp, chunk(j, d, logprobs=lpo if i == 0 else None))
                if lpo is not None and not deltas:
                    await self._sse(resp, chunk(j, {}, logprobs=lpo))
            if include_usage:
                await self._sse(resp, {**base, "choices": [], "usage": self._usage(ctx["n_prompt"], handles)})
            await self._sse(resp, b"[DONE]")
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return resp


def _assemble(deltas):
    """Concatenated parser deltas -> (assistant message, tool calls)."""
    content, reasoning, calls = [], [], {}
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        if "reasoning_content" in d:
            reasoning.append(d["reasoning_content"])
        for tc in d.get("tool_calls", ()):
            c = calls.setdefault(tc["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            c["id"] = tc.get("id") or c["id"]
            fn = tc.get("function") or {}
            c["function"]["name"] += fn.get("name") or ""
            c["function"]["arguments"] += fn.get("arguments") or ""
    calls = [calls[i] for i in sorted(calls)]
    msg = {"role": "assistant", "content": "".join(content) if (content or not calls) else None}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg, calls


def run_in_thread(server: OpenAIServer, host: str = "127.0.0.1", port: int = 0):
    """Serve ``server.app()`` on an event loop in a daemon thread -> (url, stop()). For tests and tools."""
    import threading
    ready = threading.Event()
    state: dict = {}

    def main():
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(server.app(), handle_signals=False, access_log=None)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, host, port)
        loop.run_until_complete(site.start())
        state["port"] = site._server.sockets[0].getsockname()[1]
        state["loop"], state["runner"] = loop, runner
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    t = threading.Thread(target=main, daemon=True, name="openai-http")
    t.start()
    if not ready.wait(60):
        raise RuntimeError("the HTTP server did not start")

    def stop():
        state["loop"].call_soon_threadsafe(state["loop"].stop)
        t.join(timeout=30)

    return f"http://{host}:{state['port']}", stop
