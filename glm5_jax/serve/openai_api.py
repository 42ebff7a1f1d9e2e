"""OpenAI-compatible HTTP API over the engine (aiohttp): ``GET /health``, ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /metrics`` (Prometheus text).

HTTP: the project's one stack (glm5_jax.serve.http, aiohttp): an asyncio server with streamed responses
(SSE) that tells a handler when its client went away (a write to a closed transport fails), which is what
frees a disconnected stream's slot; the engine runs in its own thread and hands tokens to the event loop
with ``call_soon_threadsafe``. Each endpoint's body is one pydantic schema (glm5_jax.serve.schemas).

Completions: ``prompt`` is a string, a list of strings, a list of token ids or a list of token-id lists;
``echo``, ``logprobs`` (top-k, <= 20) with ``choices[i].logprobs = {tokens, token_logprobs, top_logprobs,
text_offset}`` over the prompt (with echo; the first prompt token's log-prob null) and the generated
tokens, ``max_tokens=0`` with echo scores the prompt only (how evaluation harnesses read log-likelihoods);
``n``; ``stream``. Chat: the checkpoint's own Jinja ``chat_template`` when its tokenizer files carry one
(``glm5_jax.data.hf_chat_template``: rendered as transformers' ``apply_chat_template`` renders it, with
``tools`` and every ``chat_template_kwargs`` key), else the project's GLM renderer (``glm5_jax.data.chat``);
``tools`` / ``tool_choice`` (auto, none, required, or a named function: the generation prompt then ends
with the forced ``<tool_call>`` / name), ``chat_template_kwargs.enable_thinking`` (False: the prompt ends
with an empty think block) and ``clear_thinking`` (False: preserved thinking, earlier turns' reasoning
kept); the prompt's tail (empty think block, forced call) is ``ChatTemplate.generation_tail``'s for
either renderer; streamed deltas of ``content`` / ``reasoning_content`` / ``tool_calls`` through
``glm5_jax.serve.parsing.StreamParser``.
Every choice carries the TITO record as ``glm5``: ``{prompt_token_ids, token_ids, logprobs (sampling),
version, rollout_id}``.

Log-probs in ``logprobs`` are the model's log-softmax (temperature 1), as OpenAI reports them; the TITO
record's are those of the distribution the token was drawn from (what RL needs); they agree for
temperature 1 without top-k / top-p.

Errors: every refusal is a ``glm5_jax.serve.http.HTTPError`` rendered ``{"error": {"message", "type",
"param", "code"}}``, with 400 (bad JSON, NaN / Infinity, bad fields, prompt too long, token ids outside
the vocabulary, invalid UTF-8 / lone surrogates), 404 (unknown model or route), 405, 413 (body too
large), 429 (queue full); a client that disconnects mid-request cancels it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import List

from aiohttp import web

from glm5_jax.data.chat import ChatFormatError, ChatTemplate
from glm5_jax.data.hf_chat_template import load_chat_template
from glm5_jax.serve.engine import EngineError, QueueFull, SamplingParams
from glm5_jax.serve.http import HTTPError, error_middleware, parse_as, read_json, serve_in_thread
from glm5_jax.serve.metrics import CONTENT_TYPE_LATEST
from glm5_jax.parallel.distributed import multi_process
from glm5_jax.serve.multihost import lost
from glm5_jax.serve.schemas import ChatCompletionRequest, CompletionRequest

__all__ = ["OpenAIServer", "render_error", "run_in_thread"]


def render_error(e: HTTPError) -> dict:
    """The OpenAI error body."""
    return {"error": {"message": e.message, "type": "invalid_request_error" if e.status < 500 else "server_error",
                      "param": e.param, "code": e.code}}


def _bad(message, param=None, code=None):
    return HTTPError(400, message, param=param, code=code)


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
        app = web.Application(client_max_size=self.max_body, middlewares=[error_middleware(render_error)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def health(self, request):
        if lost():        # a multi-process mesh lost a host: unhealthy until the process exits (serve.multihost)
            return web.json_response({"status": "unavailable", "error": lost(), "model": self.model_name}, status=503)
        body = {"status": "ok", "model": self.model_name, "running": self.engine.active,
                "waiting": self.engine.queue_length, "version": self.engine.version}
        rt = getattr(self.engine, "runtime", None)
        if rt is not None:      # the paged runtime: {"free", "cached", "total", "running"} pages (a leak shows in running)
            body["pages"] = rt.pages_in_use()
        return web.json_response(body)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "glm5_jax",
             "max_model_len": self.engine.max_len}]})

    async def metrics(self, request):
        m = self.engine.metrics
        body = m.render() if m is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---------------------------------------------------------------- request parsing
    async def _request(self, request, schema):
        req = parse_as(schema, await read_json(request, max_body=self.max_body))
        if req.model is not None and req.model != self.model_name:
            if not isinstance(req.model, str):
                raise _bad(f"model must be a string, got {req.model!r}", "model")
            raise HTTPError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                            param="model", code="model_not_found")
        return req

    def _sampling(self, req, max_tokens: int) -> SamplingParams:
        """SamplingParams of a request whose fields the schema checked; here what depends on the model."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(req, name) not in (None, 0):
                raise _bad(f"{name} is not supported (only 0)", name)
        if req.logit_bias:
            raise _bad("logit_bias is not supported", "logit_bias")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > 16 or not all(stop):
            raise _bad("stop must be a non-empty string or a list of at most 16 non-empty strings", "stop")
        v = self.engine.config.vocab_size
        stop_ids = list(req.stop_token_ids or [])
        if not all(0 <= t < v for t in stop_ids):
            raise _bad(f"stop_token_ids must be token ids in [0, {v})", "stop_token_ids")
        top_k = req.top_k or 0
        if top_k > v:
            raise _bad(f"top_k={top_k} is invalid: an integer in [0, {v}] (-1: off)", "top_k")
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else float(req.temperature),
                              top_p=1.0 if req.top_p is None else float(req.top_p), top_k=max(top_k, 0), seed=req.seed,
                              stop=stop, stop_token_ids=stop_ids, ignore_eos=req.ignore_eos)

    def _max_tokens(self, req, prompt_len: int, default: int, *, allow_zero=False, names=("max_tokens",)) -> int:
        room = self.engine.max_len - prompt_len
        used = next((name for name in names if getattr(req, name) is not None), None)
        if used is None:
            return min(default, room)
        v = getattr(req, used)
        if v < (0 if allow_zero else 1):
            raise _bad(f"{used}={v!r} is invalid: an integer >= {0 if allow_zero else 1}", used)
        if v > room:
            raise _bad(f"this model's maximum context length is {self.engine.max_len} tokens; the prompt has "
                       f"{prompt_len} tokens and {used}={v} more were asked for ({prompt_len + v})", used,
                       "context_length_exceeded")
        return v

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
        """-> [(ids, text or None)]; ``prompt`` has the schema's shape (a string, ids, or a list of either)."""
        items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
        if not items:
            raise _bad("prompt is empty", "prompt")
        if len(items) > 64:
            raise _bad("at most 64 prompts per request", "prompt")
        out = []
        for p in items:
            if isinstance(p, str):
                out.append(([int(t) for t in self.tok.encode(p)], p))
            else:
                out.append(([int(t) for t in p], None))
            self._check_prompt_ids(out[-1][0])
        return out

    # ---------------------------------------------------------------- engine bridge
    @staticmethod
    def _check_mesh():
        """503 with the reason once the mesh lost a host (serve.multihost.lost): no request is answered after."""
        if lost():
            raise HTTPError(503, f"the server lost a host and is shutting down: {lost()}", code="host_lost", close=True)

    async def _next_event(self, q):
        """The next (handle, event) of a stream; 503 (HTTPError) once the mesh lost a host."""
        while True:
            self._check_mesh()
            try:
                return await asyncio.wait_for(q.get(), 0.25)
            except asyncio.TimeoutError:
                continue

    async def _stream_lost(self, resp, handles, e: HTTPError):
        """A stream cut by a lost host: its handles cancelled, the 503 body as the last event."""
        for h in handles:
            h.cancel()
        await self._sse(resp, render_error(e))
        return resp

    def _submit(self, ids, sp, loop, q, rid):
        self._check_mesh()

        def on_event(h, ev):
            loop.call_soon_threadsafe(q.put_nowait, (h, ev))
        try:
            return self.engine.submit(ids, sp, request_id=rid, on_event=on_event)
        except QueueFull as e:
            raise HTTPError(429, str(e)) from None
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
                    self._check_mesh()
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
            if lost() or multi_process():     # a failed step of a multi-process mesh: a peer died or hangs
                raise HTTPError(503, f"generation failed on the multi-process mesh (a host lost?): {h.error}"
                                + (f"; {lost()}" if lost() else ""), code="host_lost", close=True)
            raise HTTPError(500, f"generation failed: {h.error}", code="internal_error")

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
        req = await self._request(request, CompletionRequest)
        prompts = self._prompts(req.prompt)
        echo, stream, lp = req.echo, req.stream, req.logprobs
        n = req.n or 1
        jobs = []
        for pi, (ids, text) in enumerate(prompts):
            mt = self._max_tokens(req, len(ids), 16, allow_zero=echo)
            sp = self._sampling(req, max(mt, 1))
            sp.prompt_logprobs = bool(echo and lp is not None)
            if mt == 0:
                sp.ignore_eos = True
            for j in range(n):
                s = sp if sp.seed is None or n == 1 else SamplingParams(**{**sp.__dict__, "seed": sp.seed + j})
                jobs.append((pi, ids, text, s, mt))
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        cid = f"cmpl-{uuid.uuid4().hex}"
        rid = req.rollout or cid
        handles = []
        try:
            for k, (pi, ids, text, sp, mt) in enumerate(jobs):
                handles.append(self._submit(ids, sp, loop, q, f"{cid}-{k}"))
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        if stream:
            return await self._stream_completions(request, req, jobs, handles, q, cid, rid, echo, lp,
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

    async def _stream_completions(self, request, req, jobs, handles, q, cid, rid, echo, lp, n_prompt):
        include_usage = req.include_usage
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
                h, ev = await self._next_event(q)
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
        except HTTPError as e:
            if e.code != "host_lost":
                for h in handles:
                    h.cancel()
                raise
            return await self._stream_lost(resp, handles, e)
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return resp

    # ---------------------------------------------------------------- /v1/chat/completions
    def _messages(self, msgs):
        """OpenAI messages -> the renderer's: developer is system, text parts joined, OpenAI-only keys
        dropped; a None content is "" for the Python renderer and stays None (dropped, as transformers
        drops it) for the checkpoint's own template."""
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
                m["content"] = None if self.hf_template is not None else ""
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
        return out

    async def chat(self, request):
        req = await self._request(request, ChatCompletionRequest)
        if not self.templates and self.hf_template is None:
            raise _bad("this model's tokenizer has neither a chat_template nor the GLM chat template tokens; use "
                       "/v1/completions", "messages")
        msgs = self._messages(req.messages)
        kwargs = req.chat_template_kwargs.model_dump(exclude_unset=True) if req.chat_template_kwargs else {}
        reserved = sorted(set(kwargs) & {"messages", "tools", "documents", "add_generation_prompt"})
        if reserved:
            raise _bad(f"chat_template_kwargs may not set {reserved}: they are the request's own fields",
                       "chat_template_kwargs")
        thinking, clear = kwargs.get("enable_thinking", True), kwargs.get("clear_thinking", True)
        tools = req.tools
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        forced_name = None
        if not isinstance(choice, str):
            forced_name = choice.function.name
            names = [((t.get("function") or {}).get("name") if isinstance(t.get("function"), dict) else t.get("name"))
                     for t in tools or []]
            if forced_name not in names:
                raise _bad(f"tool_choice names a function that is not in tools: {forced_name!r}", "tool_choice")
        elif choice == "required" and not tools:
            raise _bad("tool_choice='required' needs tools", "tool_choice")
        use_tools = bool(tools) and choice != "none"
        stream, lp, top_n = req.stream, req.logprobs, req.top_logprobs
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
        mt = self._max_tokens(req, len(ids), self.engine.max_len, names=("max_completion_tokens", "max_tokens"))
        sp = self._sampling(req, mt)
        n = req.n or 1
        stop_ids = list(template.stop_ids) if template is not None else []
        sp.stop_token_ids = list(sp.stop_token_ids) + stop_ids
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        rid = req.rollout or cid
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
        # the parser looks for a reasoning block when the text it is fed (forced prefix + generated) can
        # start with one: the template left <think> open, or thinking is on and nothing closed it
        think_gen = forced.startswith("<think>") or (thinking and not forced and (
            template is None or ids[-1] != template.special["</think>"]))
        ctx = dict(thinking=think_gen, tools=use_tools, forced=forced, lp=lp, top_n=top_n or 0, rid=rid,
                   stop_ids=set(stop_ids))
        if stream:
            return await self._stream_chat(request, req, handles, q, cid, dict(ctx, n_prompt=len(ids)))
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

    async def _stream_chat(self, request, req, handles, q, cid, ctx):
        include_usage = req.include_usage
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
                h, ev = await self._next_event(q)
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
        except HTTPError as e:
            if e.code != "host_lost":
                for h in handles:
                    h.cancel()
                raise
            return await self._stream_lost(resp, handles, e)
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
    served = serve_in_thread(server.app(), host, port, render=render_error, name="openai-http")
    return served.url, served.close
