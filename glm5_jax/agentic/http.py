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
"""

from __future__ import annotations

import json
import math
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Optional

from glm5_jax.agentic.coordinator import NoWorkers, WorkerLost
from glm5_jax.agentic.envs import find_bad_string
from glm5_jax.agentic.gateway import Gateway
from glm5_jax.data.chat import ChatFormatError, ChatTemplate

__all__ = ["ChatEndpoint", "HTTPError", "serve_http"]

MAX_REWARD = 1e6      # |reward| a finish may carry: larger values are a bug in the client's scorer


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class ChatEndpoint:
    """``generate(rollout_id, request_id, ids) -> {"tokens", "logprobs", "version", "finish_reason"}``:
    the routed server call (``Coordinator.generate``)."""

    def __init__(self, template: ChatTemplate, generate: Callable, gateway: Optional[Gateway] = None, *,
                 max_tokens: int = 64, max_context: int = 4096, max_open: int = 1024):
        self.template, self.generate, self.gateway = template, generate, gateway or Gateway()
        self.max_tokens, self.max_context, self.max_open = max_tokens, max_context, max_open
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
            open_ids = self.gateway.open_ids()
            known = rid in open_ids
            if not known and len(open_ids) >= self.max_open:
                raise HTTPError(429, f"{len(open_ids)} rollouts are open (max_open={self.max_open}): finish one "
                                     "(POST /v1/rollouts/<id>/finish) before starting another")
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
        if abs(reward) > MAX_REWARD or not math.isfinite(reward):      # (a huge int never reaches float())
            raise HTTPError(400, f"reward must be a finite number with |reward| <= {MAX_REWARD:g}, got {reward!r}")
        if rid not in self.gateway.open_ids():
            raise HTTPError(404, f"unknown rollout_id {rid!r}")
        rec = self.gateway.finish(rid, float(reward), "done")
        return {"rollout_id": rid, "tokens": len(rec.tokens), "generated": rec.generated_tokens}


def _no_constant(name):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def serve_http(endpoint: ChatEndpoint, host: str = "127.0.0.1", port: int = 0, *, max_body: int = 1 << 20,
               on_finish: Optional[Callable] = None, timeout_s: float = 60.0):
    """Start a threaded HTTP server in a daemon thread -> (server, url). ``server.shutdown()`` stops it.
    ``on_finish(record)`` receives each finished record (e.g. to hand it to the trainer). ``timeout_s``: the
    deadline for reading a request (a client that drips its body is answered 408, its thread freed)."""

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
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    raise HTTPError(400, f"Content-Length {self.headers.get('Content-Length')!r} is not an "
                                         "integer") from None
                if length < 0 or length > max_body:
                    raise HTTPError(413, f"body of {length} bytes exceeds {max_body}")
                self.connection.settimeout(timeout_s)
                try:
                    raw = self.rfile.read(length)
                except TimeoutError:
                    self.close_connection = True
                    raise HTTPError(408, f"the request body was not sent within {timeout_s:g} s") from None
                try:
                    body = json.loads(raw or b"null", parse_constant=_no_constant)
                except (ValueError, UnicodeDecodeError, RecursionError) as e:
                    raise HTTPError(400, f"body is not JSON: {e}") from None
                bad = find_bad_string(body)
                if bad is not None:
                    raise HTTPError(400, f"{bad}: not Unicode text (a lone surrogate?); strings must be valid "
                                         "UTF-8")
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
