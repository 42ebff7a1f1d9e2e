"""The project's one HTTP stack (aiohttp), shared by the OpenAI server (glm5_jax.serve.openai_api), the agentic
chat endpoint (glm5_jax.agentic.http) and the tool environment services (glm5_jax.agentic.envs).

Why aiohttp for all three: one maintained asyncio server with streamed responses (SSE) and a handler
that learns when its client went away, where the standard library's HTTP server has neither; one
set of protections (body cap, request deadline, connection cap) written once here instead of per server.

What each server gets from here:
  * ``HTTPError``: the one error a handler raises for a request it refuses (status, message, the field
    ``param``, a ``code``); each server renders it in its own documented body (OpenAI's
    ``{"error": {message, type, param, code}}``, the chat endpoint's ``{"error": {message, code}}``, the
    env services' ``{"ok": false, "error"}``), through ``error_middleware`` (which also turns aiohttp's
    404 / 405 / 413 and any unexpected exception, a 500, into that body) and the protocol's answer to a
    request aiohttp could not parse (400, never its plain-text page).
  * ``read_json``: the body as JSON, bounded (413 beyond ``max_body``, before reading when the length is
    declared; 411 without a length when ``require_length``; 408 past a deadline), UTF-8, no ``NaN`` /
    ``Infinity`` literals, no string that is not Unicode text (a lone surrogate escape), no nesting deep
    enough to exhaust the stack: each a 400 naming what is wrong.
  * ``parse_as``: one pydantic schema per endpoint; a validation error is a 400 naming the field.
  * ``serve_in_thread``: run an app on its own event loop thread. Optional ``request_timeout_s`` (the
    request line, headers and body within one deadline; an idle or slow-header connection is closed,
    a slow body is answered 408) and ``max_connections`` (beyond it a 503 at once, then close).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Callable, Optional, Type

import pydantic
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from glm5_jax.errors import Glm5Error

__all__ = ["HTTPError", "Served", "error_middleware", "find_bad_string", "parse_as", "read_json", "serve_in_thread",
           "short"]

_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed", 408: "request_timeout",
          411: "length_required", 413: "request_too_large", 429: "queue_full", 503: "unavailable"}


class HTTPError(Glm5Error):
    """A request the server refuses (4xx), or its own fault (5xx). ``param``: the request field at fault."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param = int(status), message, param
        self.code = code or _CODES.get(self.status, "internal_error" if self.status >= 500 else "error")
        self.close = close         # close the connection after the reply (its unread bytes are not a request)


def short(v, n: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def find_bad_string(obj, max_nodes: int = 1 << 20) -> Optional[str]:
    """Where in a decoded JSON value the first string (key or value) that is not valid Unicode text is, e.g.
    ``"arguments.content"``: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no file,
    tokenizer or UTF-8 encoder accepts. None when every string is fine. Iterative (a deeply nested body
    cannot exhaust the stack) and bounded by ``max_nodes`` (beyond it: ``"<too large>"``)."""
    stack = [("", obj)]
    seen = 0
    while stack:
        where, v = stack.pop()
        seen += 1
        if seen > max_nodes:
            return "<too large>"
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return where or "<body>"
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return (where + "." if where else "") + "<a key>"
                stack.append((where + "." + str(k) if where else str(k), x))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (numbers must be finite)")


def parse_json_bytes(raw: bytes) -> Any:
    """UTF-8 JSON bytes -> value; HTTPError 400 for bad UTF-8, bad JSON, NaN / Infinity, deep nesting or a
    string that is not Unicode text."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HTTPError(400, f"the body is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise HTTPError(400, f"the body is not valid JSON: {type(e).__name__}: {short(str(e), 120)}") from None
    bad = find_bad_string(body)
    if bad is not None:
        raise HTTPError(400, f"{bad} is invalid: not valid Unicode text (a lone surrogate escape such as \\ud800)",
                        param=bad.split(".")[0].split("[")[0] or None)
    return body


async def read_json(request: web.Request, *, max_body: int, deadline: Optional[float] = None,
                    require_length: bool = False) -> Any:
    """The request's JSON body (module docstring). ``deadline``: a ``time.monotonic()`` value."""
    if require_length and request.headers.get("Transfer-Encoding"):
        raise HTTPError(411, "chunked/encoded bodies are not accepted: send Content-Length", close=True)
    n = request.content_length
    if n is None and require_length:
        raise HTTPError(411, "Content-Length is required", close=True)
    if n is not None and n > max_body:
        raise HTTPError(413, f"body of {n} bytes: at most {max_body}", close=True)
    try:
        if deadline is None:
            raw = await request.read()
        else:
            raw = await asyncio.wait_for(request.read(), max(deadline - time.monotonic(), 0.0))
    except asyncio.TimeoutError:
        raise HTTPError(408, "the request body was not sent within the deadline", close=True) from None
    except web.HTTPRequestEntityTooLarge:
        raise HTTPError(413, f"body larger than {max_body} bytes", close=True) from None
    if n is not None and len(raw) < n:
        raise HTTPError(400, f"body ended after {len(raw)} of {n} bytes", close=True)
    return parse_json_bytes(raw)


def parse_as(schema: Type[pydantic.BaseModel], body: Any, what: str = "the body"):
    """``schema.model_validate(body)``; a validation error is an HTTPError 400 naming the first bad field and
    what it allows (the field's description, else pydantic's message)."""
    if not isinstance(body, dict):
        raise HTTPError(400, f"{what} must be a JSON object, not {type(body).__name__}")
    try:
        return schema.model_validate(body)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        top = loc[0] if loc else None
        field = schema.model_fields.get(top) if top else None
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(schema.model_fields))
            raise HTTPError(400, f"{top} is not a field of {what}: allowed: {allowed}", param=top) from None
        if err["type"] == "missing":
            raise HTTPError(400, f"{'.'.join(loc)} is required", param=top) from None
        allowed = field.description if field is not None and field.description else err["msg"]
        value = body.get(top) if top else body
        raise HTTPError(400, f"{top}={short(value)} is invalid: {allowed}", param=top) from None


def error_middleware(render: Callable[[HTTPError], dict], *, on_internal: Optional[Callable[[], None]] = None):
    """An aiohttp middleware: HTTPError -> ``render(e)`` as JSON with its status; aiohttp's own 404 / 405 /
    413 likewise; any other exception a 500 without a traceback (``on_internal()`` counts it)."""

    @web.middleware
    async def middleware(request, handler):
        proto = request.protocol
        started = isinstance(proto, _Protocol) and proto.begin(request)
        try:
            resp = await handler(request)
            if started and proto.eof_seen:
                resp.force_close()
            return resp
        except HTTPError as e:
            return reply(render, e)
        except web.HTTPRequestEntityTooLarge as e:
            return reply(render, HTTPError(413, f"request body too large: {e.text}", close=True))
        except web.HTTPNotFound:
            return reply(render, HTTPError(404, f"no route {request.method} {short(request.path, 80)}"))
        except web.HTTPMethodNotAllowed:
            return reply(render, HTTPError(405, f"method {short(request.method)} not allowed on "
                                                f"{short(request.path, 80)}"))
        except web.HTTPException as e:
            return reply(render, HTTPError(e.status, e.reason or "error"))
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as e:      # a bug, not bad input: the server's documented body, no traceback
            if on_internal is not None:
                on_internal()
            return reply(render, HTTPError(500, f"internal error ({type(e).__name__}: {short(str(e), 200)})",
                                           close=True))
        finally:
            if started:
                proto.end()
    return middleware


def reply(render: Callable[[HTTPError], dict], e: HTTPError) -> web.Response:
    resp = web.json_response(render(e), status=e.status)
    if e.close:
        resp.force_close()
    return resp


class _Limits:
    """What one served app's connections share: the deadline, the cap, the count, the error body."""

    def __init__(self, request_timeout_s, max_connections, render):
        self.request_timeout_s, self.max_connections, self.render = request_timeout_s, max_connections, render
        self.open = 0


class _Protocol(RequestHandler):
    """aiohttp's connection handler plus the request deadline, the connection cap, a JSON body for requests
    aiohttp cannot parse, and a reply to a request whose client closed its sending side (half-close).

    It reads two attributes of aiohttp's RequestHandler that aiohttp does not document (``_waiter``: the
    future of a connection waiting for its next request; ``_loop``), for the pinned aiohttp 3.14.5; the
    env services' tests (slow headers, slow bodies, half-closed requests, the connection cap, the fuzz
    run) fail if a later aiohttp changes them."""

    def __init__(self, manager, *, limits: _Limits, **kw):
        super().__init__(manager, **kw)
        self.limits = limits
        self.current = None         # the request a handler is working on
        self.eof_seen = False       # the client shut its sending side
        self.deadline: Optional[float] = None     # time.monotonic() by which the current request must be read
        self._watch = None
        self._counted = False

    def connection_made(self, transport):
        cap = self.limits.max_connections
        if cap is not None and self.limits.open >= cap:
            transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            transport.close()
            return
        self.limits.open += 1
        self._counted = True
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc):
        if self._watch is not None:
            self._watch.cancel()
        if self._counted:
            self.limits.open -= 1
            self._counted = False
            super().connection_lost(exc)

    def data_received(self, data):
        if self._counted:
            super().data_received(data)

    def _arm(self):
        # the deadline of the next request (its line, headers and body) starts when the connection is ready
        t = self.limits.request_timeout_s
        if t is not None:
            if self._watch is not None:
                self._watch.cancel()
            self.deadline = time.monotonic() + t
            self._watch = self._loop.call_later(t, self._expire)

    def _expire(self):
        # no handler started within the deadline: an idle connection or headers still arriving
        if self.current is None and self.transport is not None:
            self.transport.close()

    def begin(self, request) -> bool:
        self.current = request
        if self.eof_seen:
            request.content.feed_eof()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        return True

    def end(self):
        self.current = None
        self._arm()

    def eof_received(self):
        # the client shut its sending side: idle (no request parsed) -> close; a request in progress ->
        # end its body (a short body is a 400 at once, not a wait for the deadline) and keep the write side
        # open for the reply
        self.eof_seen = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            return None
        if self.current is not None:
            self.current.content.feed_eof()
        return True

    def handle_error(self, request, status=500, exc=None, message=None):
        # a request aiohttp could not parse (bad request line, header, length: its parser says 4xx): the
        # server's JSON body instead of aiohttp's plain-text page, and no traceback in the log
        e = HTTPError(status, f"bad request: {message or type(exc).__name__}", close=True)
        return reply(self.limits.render, e)


class Served:
    """An app served on a daemon thread with its own event loop: ``url``, ``host``, ``port``, ``close()``."""

    def __init__(self, app: web.Application, host: str, port: int, *, render: Callable[[HTTPError], dict],
                 request_timeout_s: Optional[float] = None, max_connections: Optional[int] = None,
                 name: str = "http"):
        self._ready = threading.Event()
        self._error: Optional[BaseException] = None
        limits = _Limits(request_timeout_s, max_connections, render)
        self._thread = threading.Thread(target=self._main, args=(app, host, port, limits), daemon=True, name=name)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the HTTP server did not start")
        if self._error is not None:
            raise self._error
        self.host = host
        self.url = f"http://{host}:{self.port}"

    def _main(self, app, host, port, limits):
        loop = self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, handle_signals=False, access_log=None)
            loop.run_until_complete(runner.setup())
            manager = runner.server
            self._server = loop.run_until_complete(loop.create_server(
                lambda: _Protocol(manager, loop=loop, limits=limits, access_log=None, lingering_time=0.0),
                host, port, reuse_address=True, backlog=128))
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException as e:      # noqa: BLE001 - handed to the starting thread
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        self._server.close()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def wait(self):
        """Block until the server stops (a command line's serve-until-killed)."""
        self._thread.join()

    def close(self):
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve_in_thread(app: web.Application, host: str = "127.0.0.1", port: int = 0, **kw) -> Served:
    """``Served(app, host, port, **kw)``: see Served and the module docstring."""
    return Served(app, host, port, **kw)
