"""OpenAI-style ``POST /v1/chat/completions`` over the GLM chat template, for agents that speak HTTP.

The endpoint renders the request's messages with ``glm5_jax.data.chat.ChatTemplate`` (generation
prompt appended), sends the token ids through the gateway to the routed rollout server, and parses the
generated ids back into content / reasoning / tool calls. TITO across turns: a request that names a
``rollout_id`` the gateway already holds does not re-render the earlier turns; its context is the
recorded tokens (exactly what was generated) plus the rendering of the messages after the last
assistant message (tool results, a new user turn) and the generation prompt, appended as masked
context. ``finish`` (``POST /v1/rollouts/<id>/finish`` with ``{"reward"}``) closes the record.

Requests are bounded (``max_body`` bytes, ``max_tokens`` <= the server's limit, ``max_open`` rollouts
open at once, ``timeout_s`` to send a request); malformed JSON (NaN / Infinity literals included), a
string that is not Unicode text (a lone surrogate such as ``"\\ud800"``), bad messages or fields and a
reward that is not a finite number within 1e6 get 400, an unknown path 404, a request not sent within
the deadline 408, an oversized body 413, a new rollout beyond ``max_open`` 429, no live worker 503; the
response adds ``glm5: {token_ids, logprobs, version}`` so a client can check what was recorded.

HTTP: the project's one stack (glm5_jax.serve.http, aiohttp): bodies read by ``read_json``, each endpoint's
request one pydantic schema (``ChatRequest``, ``FinishRequest``), every refusal an ``HTTPError`` rendered
as ``{"error": {"message", "code": status}}``. The routed generation call blocks (a Ray request), so a
handler runs the endpoint in a thread pool and the event loop keeps answering.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
import time
import uuid
from typing import Callable, List, Optional, Union

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr

from glm5_jax.agentic.coordinator import NoWorkers, WorkerLost
from glm5_jax.agentic.gateway import Gateway
from glm5_jax.data.chat import ChatFormatError, ChatTemplate
from glm5_jax.serve.http import HTTPError, Served, error_middleware, parse_as, read_json, serve_in_thread

__all__ = ["ChatEndpoint", "ChatRequest", "FinishRequest", "HTTPError", "serve_http"]

MAX_REWARD = 1e6      # |reward| a finish may carry: larger values are a bug in the client's scorer


class ChatRequest(BaseModel):
    """``POST /v1/chat/completions`` (other OpenAI fields are accepted and ignored)."""
    model_config = ConfigDict(extra="allow")
    messages: List[dict] = Field(min_length=1, description="a non-empty list of message objects")
    max_tokens: Optional[StrictInt] = Field(None, description="an integer in [1, the endpoint's max_tokens]")
    rollout_id: Optional[StrictStr] = Field(None, max_length=128, description="a string of at most 128 characters")
    tools: Optional[List[dict]] = Field(None, description="a list of tool objects")


class FinishRequest(BaseModel):
    """``POST /v1/rollouts/<id>/finish``."""
    model_config = ConfigDict(extra="allow")
    reward: Union[StrictInt, StrictFloat] = Field(description=f"a finite number with |reward| <= {MAX_REWARD:g}")


class ChatEndpoint:
    """``generate(rollout_id, request_id, ids) -> {"tokens", "logprobs", "version", "finish_reason"}``:
    the routed server call (``Coordinator.generate``)."""

    def __init__(self, template: ChatTemplate, generate: Callable, gateway: Optional[Gateway] = None, *,
                 max_tokens: int = 64, max_context: int = 4096, max_open: int = 1024):
        self.template, self.generate, self.gateway = template, generate, gateway or Gateway()
        self.max_tokens, self.max_context, self.max_open = max_tokens, max_context, max_open
        self._lock = threading.Lock()

    def completions(self, body) -> dict:
        req = parse_as(ChatRequest, body)
        msgs = req.messages
        n = self.max_tokens if req.max_tokens is None else req.max_tokens
        if not 1 <= n <= self.max_tokens:
            raise HTTPError(400, f"max_tokens must be an integer in [1, {self.max_tokens}], got {n!r}",
                            param="max_tokens")
        rid = req.rollout_id or f"http-{uuid.uuid4().hex[:12]}"
        try:
            rendered = self.template.render(msgs, add_generation_prompt=True, tools=req.tools)
        except (ChatFormatError, TypeError, KeyError, AttributeError) as e:
            raise HTTPError(400, f"bad messages: {e}", param="messages") from None
        with self._lock:
            open_ids = self.gateway.open_ids()
            known = rid in open_ids
            if not known and len(open_ids) >= self.max_open:
                raise HTTPError(429, f"{len(open_ids)} rollouts are open (max_open={self.max_open}): finish one "
                                     "(POST /v1/rollouts/<id>/finish) before starting another")
            if not known:
                self.gateway.open(rid, rid, rendered.ids)
            else:
                # TITO: keep the recorded tokens; append only what came after the last assistant message
                last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=-1)
                self.gateway.observe(rid, [t for t, mi in zip(rendered.ids, rendered.message_index) if mi > last])
        if len(self.gateway.context(rid)) + n > self.max_context:
            raise HTTPError(400, f"context of {len(self.gateway.context(rid))} tokens + max_tokens {n} exceeds "
                                 f"{self.max_context}", param="max_tokens")
        try:
            out = self.gateway.generate(rid, lambda ids: self.generate(rid, f"{rid}.{time.monotonic_ns()}", ids, n))
        except NoWorkers as e:
            raise HTTPError(503, str(e)) from None
        except WorkerLost as e:
            self.gateway.discard(rid)
            raise HTTPError(503, f"worker {e} died; retry the rollout from its start") from None
        toks = [int(t) for t in out["tokens"]]
        parsed = self.template.parse(toks)
        msg = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            msg["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            msg["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                  "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                                 for i, c in enumerate(parsed.tool_calls)]
        finish = "tool_calls" if parsed.tool_calls else ("stop" if out["finish_reason"] == "stop" else "length")
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "rollout_id": rid,
                "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(self.gateway.context(rid)) - len(toks), "completion_tokens": len(toks)},
                "glm5": {"token_ids": toks, "logprobs": [float(x) for x in out["logprobs"]],
                         "version": int(out["version"])}}

    def finish(self, rid: str, body) -> dict:
        reward = parse_as(FinishRequest, body).reward
        if abs(reward) > MAX_REWARD or not math.isfinite(reward):      # (a huge int never reaches float())
            raise HTTPError(400, f"reward must be a finite number with |reward| <= {MAX_REWARD:g}, got {reward!r}",
                            param="reward")
        if rid not in self.gateway.open_ids():
            raise HTTPError(404, f"unknown rollout_id {rid!r}")
        rec = self.gateway.finish(rid, float(reward), "done")
        return {"rollout_id": rid, "tokens": len(rec.tokens), "generated": rec.generated_tokens}


def _render(e: HTTPError) -> dict:
    return {"error": {"message": e.message, "code": e.status}}


def serve_http(endpoint: ChatEndpoint, host: str = "127.0.0.1", port: int = 0, *, max_body: int = 1 << 20,
               on_finish: Optional[Callable] = None, timeout_s: float = 60.0, max_workers: int = 64) -> Served:
    """Serve the endpoint on a daemon thread -> Served (``url``, ``host``, ``port``, ``close()``).
    ``on_finish(record)`` receives each finished record (e.g. to hand it to the trainer). ``timeout_s``: the
    deadline for reading a request body (a client that drips its body is answered 408). ``max_workers``:
    requests handled at once (each blocks a thread while its generation runs)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="chat-http")

    async def run(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def chat(request):
        body = await read_json(request, max_body=max_body, deadline=time.monotonic() + timeout_s)
        return web.json_response(await run(endpoint.completions, body))

    async def finish(request):
        body = await read_json(request, max_body=max_body, deadline=time.monotonic() + timeout_s)
        rid = request.match_info["rid"]
        rec_open = rid in endpoint.gateway.open_ids()
        res = await run(endpoint.finish, rid, body)
        if on_finish is not None and rec_open:
            on_finish(res)
        return web.json_response(res)

    app = web.Application(client_max_size=max_body, middlewares=[error_middleware(_render)])
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/chat/completions/", chat)
    app.router.add_post("/v1/rollouts/{rid}/finish", finish)
    app.router.add_post("/v1/rollouts/{rid}/finish/", finish)

    async def stop_pool(_app):
        pool.shutdown(wait=False)
    app.on_cleanup.append(stop_pool)
    return serve_in_thread(app, host, port, render=_render, name="chat-http")
