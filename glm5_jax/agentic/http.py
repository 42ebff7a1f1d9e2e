"""OpenAI-style ``POST /v1/chat/completions`` over the GLM chat template, for agents that speak HTTP.

The endpoint renders the request's messages with ``glm5_jax.data.chat.ChatTemplate`` (generation
prompt appended), sends the token ids through the gateway to the routed rollout server, and parses the
generated ids back into content / reasoning / tool calls. TITO across turns: a request that names a
``rollout_id`` the gateway already holds does not re-render the earlier turns; its context is the
recorded tokens (exactly what was generated) plus the rendering of the messages after the last
assistant message (tool results, a new user turn) and the generation prompt, appended as masked
context. ``finish`` (``POST /v1/rollouts/<id>/finish`` with ``{"reward"}``) closes the record.

Requests are bounded (``max_body`` bytes, ``max_tokens`` <= the server's limit); malformed JSON, bad
messages or fields get 400, an unknown path 404, an oversized body 413, no live worker 503; the
response adds ``glm5: {token_ids, logprobs, version}`` so a client can check what was recorded.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from glm5_jax.agentic.coordinator import NoWorkers, WorkerLost
from glm5_jax.agentic.gateway import Gateway
from glm5_jax.data.chat import ChatFormatError, ChatTemplate

__all__ = ["ChatEndpoint", "HTTPError", "serve_http"]


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ChatEndpoint:
    """``generate(rollout_id, request_id, ids) -> {"tokens", "logprobs", "version", "finish_reason"}``:
    the routed server call (``Coordinator.generate``)."""

    def __init__(self, template: ChatTemplate, generate: Callable, gateway: Optional[Gateway] = None, *,
                 max_tokens: int = 64, max_context: int = 4096):
        self.template, self.generate, self.gateway = template, generate, gateway or Gateway()
        self.max_tokens, self.max_context = max_tokens, max_context
        self._lock = threading.Lock()

    def completions(self, body: dict) -> dict:
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise HTTPError(400, "messages must be a non-empty list of message objects")
        n = body.get("max_tokens", self.max_tokens)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.max_tokens:
            raise HTTPError(400, f"max_tokens must be an integer in [1, {self.max_tokens}], got {n!r}")
        rid = body.get("rollout_id") or f"http-{uuid.uuid4().hex[:12]}"
        if not isinstance(rid, str) or len(rid) > 128:
            raise HTTPError(400, "rollout_id must be a string of at most 128 characters")
        try:
            rendered = self.template.render(msgs, add_generation_prompt=True, tools=body.get("tools"))
        except (ChatFormatError, TypeError, KeyError, AttributeError) as e:
            raise HTTPError(400, f"bad messages: {e}") from None
        with self._lock:
            known = rid in self.gateway.open_ids()
            if not known:
                self.gateway.open(rid, rid, rendered.ids)
            else:
                # TITO: keep the recorded tokens; append only what came after the last assistant message
                last = max((i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"),
                           default=-1)
                self.gateway.observe(rid, [t for t, mi in zip(rendered.ids, rendered.message_index) if mi > last])
        if len(self.gateway.context(rid)) + n > self.max_context:
            raise HTTPError(400, f"context of {len(self.gateway.context(rid))} tokens + max_tokens {n} exceeds "
                                 f"{self.max_context}")
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

    def finish(self, rid: str, body: dict) -> dict:
        reward = body.get("reward") if isinstance(body, dict) else None
        if not isinstance(reward, (int, float)) or isinstance(reward, bool):
            raise HTTPError(400, "finish needs a numeric reward")
        if rid not in self.gateway.open_ids():
            raise HTTPError(404, f"unknown rollout_id {rid!r}")
        rec = self.gateway.finish(rid, float(reward), "done")
        return {"rollout_id": rid, "tokens": len(rec.tokens), "generated": rec.generated_tokens}


def serve_http(endpoint: ChatEndpoint, host: str = "127.0.0.1", port: int = 0, *, max_body: int = 1 << 20,
               on_finish: Optional[Callable] = None):
    """Start a threaded HTTP server in a daemon thread -> (server, url). ``server.shutdown()`` stops it.
    ``on_finish(record)`` receives each finished record (e.g. to hand it to the trainer)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):     # quiet
            pass

        def _send(self, status: int, obj: dict):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length < 0 or length > max_body:
                    raise HTTPError(413, f"body of {length} bytes exceeds {max_body}")
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except (ValueError, UnicodeDecodeError) as e:
                    raise HTTPError(400, f"body is not JSON: {e}") from None
                path = self.path.rstrip("/")
                if path == "/v1/chat/completions":
                    self._send(200, endpoint.completions(body))
                elif path.startswith("/v1/rollouts/") and path.endswith("/finish"):
                    rid = path[len("/v1/rollouts/"):-len("/finish")]
                    rec_open = rid in endpoint.gateway.open_ids()
                    res = endpoint.finish(rid, body)
                    if on_finish is not None and rec_open:
                        on_finish(res)
                    self._send(200, res)
                else:
                    raise HTTPError(404, f"no route {self.path!r}: POST /v1/chat/completions or "
                                         f"/v1/rollouts/<id>/finish")
            except HTTPError as e:
                self._send(e.status, {"error": {"message": str(e), "code": e.status}})
            except Exception as e:     # never let one request take the server down
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}", "code": 500}})

        def do_GET(self):
            self._send(404, {"error": {"message": "use POST /v1/chat/completions", "code": 404}})

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="chat-http").start()
    return server, f"http://{host}:{server.server_address[1]}"
