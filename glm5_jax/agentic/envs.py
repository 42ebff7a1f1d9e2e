"""Tool environments as HTTP services (issue 17 item 4): the code sandbox, the calculator / kv lookup
tools and a file tool, behind one JSON-over-HTTP server with bounded request size and time.

Why the standard library (``http.server.ThreadingHTTPServer``): the services must run wherever the
rollout agents run, including the 2-core CPU machine, with no extra dependency to pin; the few
protections a framework would add (body cap, per-request deadline, connection cap) are written here in
~60 lines and tested by the fuzz test.

Endpoints (JSON in, JSON out; every reply is an object):
  GET  /health                          -> {"ok": true, "tools": [...]}
  POST /session  {"store": {k: int}}    -> {"ok": true, "session": id}   (kv store + file root)
  POST /session/close {"session": id}   -> {"ok": true}
  POST /call {"name", "arguments", "session"?} -> {"ok": true, "result": ...}

Tools (one implementation each; none is rewritten here):
  calculator(expression), kv_get(key)   glm5_jax.post.tooldata.execute_tool (the SFT / eval tools)
  run_code(code, tests[, timeout_s])    glm5_jax.rl.sandbox.run_sandboxed; result is a dict
  file_read(path), file_write(path, content), file_list(path)   inside the session's temp root

Two kinds of failure, kept apart on purpose: a *protocol* fault (bad JSON, a body over the cap, an
unknown tool or path, arguments of the wrong names or types, a traversal path, an unknown session)
gets a 4xx with {"ok": false, "error": ...} naming the bad field; a *tool-level* mistake the model
can learn from (a bad expression, an unknown key, a missing file) is an ordinary 200 result
``"error: ..."``, exactly as ``execute_tool`` answers, because it is an observation for the agent.

Bounds: body <= ``max_body`` bytes (413 before reading it; a missing Content-Length is 411, chunked
bodies 411), the whole request (headers + body) within ``request_timeout_s`` (408; a slow-drip body is
cut off at the deadline, not per byte), at most ``max_connections`` handled at once (others get 503
and are closed), at most ``max_sessions`` sessions (oldest evicted, its files removed), file size /
file count per session capped, run_code timeouts capped at ``max_code_timeout_s`` and at most
``max_sandboxes`` concurrent sandboxes (503 beyond). Any unexpected exception inside a handler is a
500 with no traceback to the client; the fuzz test checks none happens.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional

from glm5_jax.post.tooldata import TOOL_ARGS as _POST_TOOL_ARGS
from glm5_jax.post.tooldata import execute_tool
from glm5_jax.rl.sandbox import run_sandboxed

__all__ = ["EnvLimits", "EnvServer", "ToolError", "TOOLS", "call_tool", "close_session", "find_bad_string",
           "open_session", "serve", "main"]

# name -> {argument: allowed python types}; optional arguments are listed in _OPTIONAL
TOOLS: Dict[str, Dict[str, tuple]] = {
    **{name: {a: (str,) for a in args} for name, args in _POST_TOOL_ARGS.items()},
    "run_code": {"code": (str,), "tests": (str,), "timeout_s": (int, float)},
    "file_read": {"path": (str,)},
    "file_write": {"path": (str,), "content": (str,)},
    "file_list": {"path": (str,)},
}
_OPTIONAL = {"run_code": {"timeout_s"}, "file_list": {"path"}}
_NEEDS_SESSION = {"kv_get", "file_read", "file_write", "file_list"}
_SESSION_RE = re.compile(r"[0-9a-f]{32}")
_PATH_RE = re.compile(r"[A-Za-z0-9._\-/]{0,255}")


@dataclasses.dataclass(frozen=True)
class EnvLimits:
    max_body: int = 64 * 1024             # bytes of request body
    request_timeout_s: float = 5.0        # headers + body must arrive within this
    max_connections: int = 32             # handled at once
    max_sessions: int = 256
    max_file_bytes: int = 16 * 1024
    max_files: int = 64                   # per session
    max_expression: int = 512             # calculator input characters
    max_code_timeout_s: float = 5.0
    max_sandboxes: int = 2                # concurrent run_code subprocesses

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not v > 0:
                raise ValueError(f"EnvLimits.{f.name}={v!r} is invalid: must be > 0")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class ToolError(RuntimeError):
    """A non-200 reply from an environment service (status and the server's message)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class _Session:
    def __init__(self, store: Dict[str, int]):
        self.store = store
        self.root = tempfile.mkdtemp(prefix="glm5_envfs_")
        self.lock = threading.Lock()

    def close(self):
        shutil.rmtree(self.root, ignore_errors=True)


class _State:
    """Sessions (LRU-bounded) and the sandbox semaphore, shared by handler threads."""

    def __init__(self, limits: EnvLimits):
        self.limits = limits
        self.sessions: "collections.OrderedDict[str, _Session]" = collections.OrderedDict()
        self.lock = threading.Lock()
        self.sandboxes = threading.BoundedSemaphore(limits.max_sandboxes)

    def open(self, store) -> str:
        sid = secrets.token_hex(16)
        s = _Session(store)
        with self.lock:
            self.sessions[sid] = s
            while len(self.sessions) > self.limits.max_sessions:
                _, old = self.sessions.popitem(last=False)
                old.close()
        return sid

    def get(self, sid) -> _Session:
        if not isinstance(sid, str) or not _SESSION_RE.fullmatch(sid):
            raise _HTTPError(400, f"session={_short(sid)} is invalid: expected the 32-hex id from POST /session")
        with self.lock:
            s = self.sessions.get(sid)
            if s is not None:
                self.sessions.move_to_end(sid)
        if s is None:
            raise _HTTPError(404, "session is unknown (closed, evicted or never opened)")
        return s

    def close(self, sid):
        s = self.get(sid)
        with self.lock:
            self.sessions.pop(sid, None)
        s.close()

    def close_all(self):
        with self.lock:
            for s in self.sessions.values():
                s.close()
            self.sessions.clear()


def find_bad_string(obj, max_nodes: int = 1 << 20) -> Optional[str]:
    """Where in a decoded JSON value the first string (key or value) that is not valid Unicode text
    is, e.g. ``"arguments.content"``: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which
    no file, tokenizer or UTF-8 encoder accepts. None when every string is fine. Iterative (a deeply
    nested body cannot exhaust the stack) and bounded by ``max_nodes`` (beyond it: ``"<too large>"``)."""
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
                key = where + "." + k if where else k
                if isinstance(k, str):
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return (where + "." if where else "") + "<a key>"
                stack.append((key, x))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in enumerate(v))
    return None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _short(v, n: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _check_args(name: str, args) -> None:
    spec = TOOLS[name]
    if not isinstance(args, dict):
        raise _HTTPError(400, f"arguments must be an object, not {type(args).__name__}")
    optional = _OPTIONAL.get(name, set())
    missing = set(spec) - optional - set(args)
    extra = set(args) - set(spec)
    if missing or extra:
        raise _HTTPError(400, f"{name} takes {', '.join(sorted(spec))} "
                              f"(optional: {', '.join(sorted(optional)) or '-'}); "
                              f"missing {sorted(missing)}, unknown {sorted(map(str, extra))}")
    for a, v in args.items():
        if isinstance(v, bool) or not isinstance(v, spec[a]):
            raise _HTTPError(400, f"arguments.{a}={_short(v)} is invalid: must be "
                                  f"{' or '.join(t.__name__ for t in spec[a])}")


def _resolve(session: _Session, path: str) -> str:
    """The real path of ``path`` inside the session root; anything that leaves it is refused (403).

    Relative names only, a conservative character set (no NUL, no backslash), no ``..`` component,
    and the resolved real path must stay under the root (covers symlinks, which the tool never makes)."""
    if not _PATH_RE.fullmatch(path):
        raise _HTTPError(400, f"path={_short(path)} is invalid: up to 255 of [A-Za-z0-9._-/]")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if path.startswith("/") or ".." in parts:
        raise _HTTPError(403, f"path={_short(path)} is refused: must stay inside the session root")
    root = os.path.realpath(session.root)
    full = os.path.realpath(os.path.join(root, *parts))
    if os.path.commonpath([root, full]) != root:
        raise _HTTPError(403, f"path={_short(path)} is refused: must stay inside the session root")
    return full


def _file_tool(name: str, args: dict, session: _Session, limits: EnvLimits):
    path = _resolve(session, args.get("path", ""))
    with session.lock:
        if name == "file_list":
            if not os.path.isdir(path):
                return "error: not a directory"
            return sorted(e + ("/" if os.path.isdir(os.path.join(path, e)) else "") for e in os.listdir(path))
        if name == "file_read":
            if not os.path.isfile(path):
                return "error: no such file"
            with open(path, "r", encoding="utf-8") as f:
                return f.read()
        content = args["content"]
        if len(content.encode("utf-8")) > limits.max_file_bytes:
            raise _HTTPError(413, f"arguments.content is {len(content.encode('utf-8'))} bytes: at most "
                                  f"{limits.max_file_bytes}")
        if path == os.path.realpath(session.root) or os.path.isdir(path):
            return "error: is a directory"
        n_files = sum(len(fs) for _, _, fs in os.walk(session.root))
        if not os.path.exists(path) and n_files >= limits.max_files:
            return f"error: at most {limits.max_files} files per session"
        parent = os.path.dirname(path)
        if os.path.exists(parent) and not os.path.isdir(parent):
            return "error: a parent is a file"
        os.makedirs(parent, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(content)
        return "ok"


def _dispatch(state: _State, path: str, body: Any):
    limits = state.limits
    if not isinstance(body, dict):
        raise _HTTPError(400, f"body must be a JSON object, not {type(body).__name__}")
    bad = find_bad_string(body)
    if bad is not None:
        raise _HTTPError(400, f"{bad} is invalid: not valid Unicode text (a lone surrogate escape such as "
                              f"\\ud800)")
    if path == "/session":
        store = body.get("store", {})
        if not isinstance(store, dict) or len(store) > 1024 or not all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, int) and not isinstance(v, bool)
                for k, v in store.items()):
            raise _HTTPError(400, "store must be an object of at most 1024 {string key (<= 64 chars): int}")
        return {"ok": True, "session": state.open(dict(store))}
    if path == "/session/close":
        state.close(body.get("session"))
        return {"ok": True}
    if path != "/call":
        raise _HTTPError(404, f"path {_short(path)} is unknown: /health, /session, /session/close, /call")
    name = body.get("name")
    if not isinstance(name, str) or name not in TOOLS:
        raise _HTTPError(404, f"name={_short(name)} is not a tool: allowed: {', '.join(sorted(TOOLS))}")
    args = body.get("arguments", {})
    _check_args(name, args)
    if name in _NEEDS_SESSION and "session" not in body:
        raise _HTTPError(400, f"{name} needs a session: open one with POST /session")
    session = state.get(body["session"]) if "session" in body else None
    if name in _POST_TOOL_ARGS:
        if name == "calculator" and len(args["expression"]) > limits.max_expression:
            return {"ok": True, "result": "error: invalid expression"}
        try:
            result = execute_tool({"name": name, "arguments": args}, session.store if session else {})
        except (RecursionError, MemoryError):       # a pathologically nested expression
            result = "error: invalid expression"
        return {"ok": True, "result": result}
    if name == "run_code":
        # min() before float(): a 400-digit int compares exactly but would overflow float(); NaN stays NaN
        t = min(args.get("timeout_s", limits.max_code_timeout_s), limits.max_code_timeout_s)
        if not t > 0:
            raise _HTTPError(400, f"arguments.timeout_s={args.get('timeout_s')!r} is invalid: must be > 0")
        if not state.sandboxes.acquire(blocking=False):
            raise _HTTPError(503, f"all {limits.max_sandboxes} sandboxes busy; retry later")
        t = float(t)
        try:
            r = run_sandboxed(args["code"], args["tests"], timeout_s=t, cpu_s=max(1, math.ceil(t)))
        finally:
            state.sandboxes.release()
        return {"ok": True, "result": {"passed": r.passed, "status": r.status, "stdout": r.stdout,
                                       "stderr": r.stderr, "isolation": dict(r.isolation)}}
    return {"ok": True, "result": _file_tool(name, args, session, limits)}


class _Handler(BaseHTTPRequestHandler):
    server_version = "glm5-env/1"
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):       # noqa: A002 - stdlib signature; quiet by design
        pass

    def handle_one_request(self):
        # One deadline for the request line, headers and body together. Socket timeouts alone bound
        # each recv, not the total, so a watchdog shuts the read side when the deadline passes while
        # the request is still arriving (a slow drip then reads EOF); replies can still be written.
        t = self.server.limits.request_timeout_s
        self._deadline = time.monotonic() + t
        self._reading = True
        self.connection.settimeout(t)
        timer = threading.Timer(t, self._expire)
        timer.daemon = True
        timer.start()
        try:
            super().handle_one_request()
        finally:
            timer.cancel()

    def _expire(self):
        if self._reading:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RD)
            except OSError:
                pass

    def parse_request(self):
        ok = super().parse_request()
        if ok and time.monotonic() >= self._deadline:
            # the watchdog cut the headers short: what was parsed is not the whole request
            self.send_error(408, f"headers not received within {self.server.limits.request_timeout_s} s")
            return False
        if ok and self.request_version == "HTTP/0.9":
            self.send_error(400, "HTTP/0.9 requests are not supported")
            return False
        return ok

    def send_error(self, code, message=None, explain=None):
        # http.server's own refusals (bad request line, long headers, unknown method) as JSON, with a
        # status line: the stdlib answers a request it could not parse in HTTP/0.9 style (a bare HTML
        # body), an unknown method with 501 and an unknown HTTP version with 505; both are the
        # client's fault here (405, 400): a 5xx would read as "the environment is broken".
        self._reading = False
        self.request_version = "HTTP/1.0" if self.request_version == "HTTP/0.9" else self.request_version
        code = {501: 405, 505: 400}.get(code, code)
        try:
            self._reply(code, {"ok": False, "error": f"{code} {message or ''}".strip()}, close=True)
        except OSError:
            self.close_connection = True

    def _reply(self, status: int, obj: dict, close: bool = False):
        data = json.dumps(obj).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _read_body(self) -> bytes:
        limits = self.server.limits
        if self.headers.get("Transfer-Encoding"):
            raise _HTTPError(411, "chunked/encoded bodies are not accepted: send Content-Length")
        n = self.headers.get("Content-Length")
        if n is None:
            raise _HTTPError(411, "Content-Length is required")
        try:
            n = int(n)
        except ValueError:
            raise _HTTPError(400, f"Content-Length={_short(n)} is invalid: a byte count") from None
        if n < 0:
            raise _HTTPError(400, f"Content-Length={n} is invalid: must be >= 0")
        if n > limits.max_body:
            raise _HTTPError(413, f"body of {n} bytes: at most {limits.max_body}")
        chunks, got = [], 0
        while got < n:      # the deadline is for the whole body, so a slow drip cannot hold a thread
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise _HTTPError(408, f"body not received within {limits.request_timeout_s} s")
            self.connection.settimeout(left)
            try:
                c = self.rfile.read1(n - got)
            except (TimeoutError, socket.timeout):
                raise _HTTPError(408, f"body not received within {limits.request_timeout_s} s") from None
            if not c:
                if time.monotonic() >= self._deadline:
                    raise _HTTPError(408, f"body not received within {limits.request_timeout_s} s")
                raise _HTTPError(400, f"body ended after {got} of {n} bytes")
            chunks.append(c)
            got += len(c)
        return b"".join(chunks)

    def _handle(self, method: str):
        try:
            path = self.path.split("?", 1)[0]
            if method == "GET":
                self._reading = False
                if path != "/health":
                    raise _HTTPError(404 if path not in ("/call", "/session", "/session/close") else 405,
                                     f"GET {_short(path)}: only GET /health")
                self._reply(200, {"ok": True, "tools": sorted(TOOLS)})
                return
            raw = self._read_body()
            self._reading = False       # a long tool run (run_code) is not cut by the watchdog
            self.connection.settimeout(self.server.limits.request_timeout_s)    # for writing the reply
            try:
                body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise _HTTPError(400, f"body is not JSON: {type(e).__name__}") from None
            self._reply(200, _dispatch(self.server.state, path, body))
        except _HTTPError as e:
            # after a refused body the connection cannot be reused: its unread bytes would be parsed
            # as the next request
            self._reply(e.status, {"ok": False, "error": e.message}, close=e.status in (400, 408, 411, 413))
        except (ConnectionError, TimeoutError):     # the client vanished or stopped reading
            self.close_connection = True
        except Exception as e:      # noqa: BLE001 - never take the server down; never leak a traceback
            self.server.internal_errors += 1
            try:
                self._reply(500, {"ok": False, "error": f"internal error ({type(e).__name__})"}, close=True)
            except OSError:
                self.close_connection = True

    def do_GET(self):       # noqa: N802 - stdlib names
        self._handle("GET")

    def do_POST(self):      # noqa: N802
        self._handle("POST")

    def _not_allowed(self):
        self._reading = False
        self._reply(405, {"ok": False, "error": f"method {self.command} not allowed: GET /health, POST"}, close=True)

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed     # noqa: N815


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, addr, limits: EnvLimits):
        self.limits = limits
        self.state = _State(limits)
        self.internal_errors = 0
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        super().__init__(addr, _Handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address):
        pass        # a client that vanished mid-request; nothing to report


class EnvServer:
    """A running environment service (in-process, on a daemon thread). ``url``; ``close()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, limits: Optional[EnvLimits] = None):
        self._server = _Server((host, port), limits or EnvLimits())
        self.host, self.port = self._server.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="glm5-env", daemon=True)
        self._thread.start()

    @property
    def internal_errors(self) -> int:
        return self._server.internal_errors

    def close(self):
        self._server.shutdown()
        self._server.server_close()
        self._server.state.close_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(host: str = "127.0.0.1", port: int = 0, limits: Optional[EnvLimits] = None) -> EnvServer:
    """Start the environment service on a thread of this process (port 0 = any free port)."""
    return EnvServer(host, port, limits)


def _post(url: str, path: str, body: dict, timeout: float):
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode("utf-8"),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read().decode("utf-8")).get("error", "")
        except (ValueError, AttributeError, OSError):
            msg = e.reason
        raise ToolError(e.code, str(msg)) from None


def call_tool(url: str, name: str, args: dict, timeout: float = 10.0, session: Optional[str] = None):
    """Call tool ``name`` with ``args`` on the service at ``url``; returns its result.

    Raises ToolError (with the HTTP status) on a protocol fault, ``TimeoutError``/``URLError`` when
    the service does not answer within ``timeout`` seconds."""
    body = {"name": name, "arguments": args}
    if session is not None:
        body["session"] = session
    return _post(url, "/call", body, timeout)["result"]


def open_session(url: str, store: Optional[Dict[str, int]] = None, timeout: float = 10.0) -> str:
    """A new session (kv store ``store``, an empty file root); returns its id."""
    return _post(url, "/session", {"store": dict(store or {})}, timeout)["session"]


def close_session(url: str, session: str, timeout: float = 10.0) -> None:
    _post(url, "/session/close", {"session": session}, timeout)


def main(argv=None):
    """``python -m glm5_jax.agentic.envs --port N``: serve until killed; prints the URL once ready."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = any free port (the URL is printed)")
    p.add_argument("--max-body", type=int, default=EnvLimits.max_body)
    p.add_argument("--request-timeout-s", type=float, default=EnvLimits.request_timeout_s)
    a = p.parse_args(argv)
    srv = EnvServer(a.host, a.port, EnvLimits(max_body=a.max_body, request_timeout_s=a.request_timeout_s))
    print(f"listening on {srv.url}", flush=True)
    try:
        srv._thread.join()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
