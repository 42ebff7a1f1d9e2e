"""Tool environments as HTTP services (issue 17 item 4): the code sandbox, the calculator / kv lookup
tools and a file tool, behind one JSON-over-HTTP server with bounded request size and time.

HTTP: the project's one stack (glm5_jax.serve.http, aiohttp), whose protections (body cap, one deadline
for the request line, headers and body, connection cap, JSON for requests it cannot parse) the fuzz
test exercises. Each endpoint's body is one pydantic schema (``SessionRequest``, ``CloseRequest``,
``CallRequest``, and per tool its arguments, built from ``TOOLS``); every refusal is an ``HTTPError``
rendered ``{"ok": false, "error"}``. Tools block (a sandbox run takes seconds), so they run in a thread
pool of ``max_connections`` threads while the event loop keeps answering.

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
bodies 411), the whole request (headers + body) within ``request_timeout_s`` (a slow-drip body: 408 at
the deadline, not per byte; headers still arriving, or an idle connection: closed), at most
``max_connections`` open at once (others get 503 and are closed), at most ``max_sessions`` sessions (oldest evicted, its files removed), file size /
file count per session capped, run_code timeouts capped at ``max_code_timeout_s`` and at most
``max_sandboxes`` concurrent sandboxes (503 beyond). Any unexpected exception inside a handler is a
500 with no traceback to the client; the fuzz test checks none happens.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from typing import Annotated, Any, Dict, Optional, Union

from absl import flags
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, create_model

from glm5_jax.cli import run
from glm5_jax.post.tooldata import TOOL_ARGS as _POST_TOOL_ARGS
from glm5_jax.post.tooldata import execute_tool
from glm5_jax.rl.sandbox import run_sandboxed
from glm5_jax.serve.http import HTTPError, error_middleware, parse_as, read_json, serve_in_thread, short

__all__ = ["CallRequest", "CloseRequest", "EnvLimits", "EnvServer", "SessionRequest", "ToolError", "TOOLS", "call_tool",
           "close_session", "open_session", "serve", "main"]

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
            raise HTTPError(400, f"session={short(sid)} is invalid: expected the 32-hex id from POST /session")
        with self.lock:
            s = self.sessions.get(sid)
            if s is not None:
                self.sessions.move_to_end(sid)
        if s is None:
            raise HTTPError(404, "session is unknown (closed, evicted or never opened)")
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


_PYDANTIC = {str: StrictStr, int: StrictInt, float: StrictFloat}


def _arg_type(types: tuple):
    t = [_PYDANTIC[x] for x in types]
    return t[0] if len(t) == 1 else Union[tuple(t)]


# one schema per tool's arguments, from TOOLS: unknown names and wrong types are 400. An optional argument's
# default is None but its type is not Optional: an explicit null is refused, as a wrong type.
ARGUMENTS = {name: create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"),
                                **{a: (_arg_type(t), None if a in _OPTIONAL.get(name, ()) else ...)
                                   for a, t in spec.items()})
             for name, spec in TOOLS.items()}


class SessionRequest(BaseModel):
    """``POST /session``: the session's kv store."""
    model_config = ConfigDict(extra="ignore")
    store: Dict[Annotated[StrictStr, Field(max_length=64)], StrictInt] = Field(
        default_factory=dict, max_length=1024, description="an object of at most 1024 {string key (<= 64 chars): int}")


class CloseRequest(BaseModel):
    """``POST /session/close``."""
    model_config = ConfigDict(extra="ignore")
    session: Any = None


class CallRequest(BaseModel):
    """``POST /call``: ``name`` (404 unless a tool), ``arguments`` (its ARGUMENTS schema), ``session``."""
    model_config = ConfigDict(extra="ignore")
    name: Any = None
    arguments: Any = Field(default_factory=dict)
    session: Any = None


def _resolve(session: _Session, path: str) -> str:
    """The real path of ``path`` inside the session root; anything that leaves it is refused (403).

    Relative names only, a conservative character set (no NUL, no backslash), no ``..`` component,
    and the resolved real path must stay under the root (covers symlinks, which the tool never makes)."""
    if not _PATH_RE.fullmatch(path):
        raise HTTPError(400, f"path={short(path)} is invalid: up to 255 of [A-Za-z0-9._-/]")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if path.startswith("/") or ".." in parts:
        raise HTTPError(403, f"path={short(path)} is refused: must stay inside the session root")
    root = os.path.realpath(session.root)
    full = os.path.realpath(os.path.join(root, *parts))
    if os.path.commonpath([root, full]) != root:
        raise HTTPError(403, f"path={short(path)} is refused: must stay inside the session root")
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
            raise HTTPError(413, f"arguments.content is {len(content.encode('utf-8'))} bytes: at most "
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
    """A POST body (already JSON, strings checked) -> the reply; HTTPError for a protocol fault."""
    limits = state.limits
    if path == "/session":
        return {"ok": True, "session": state.open(dict(parse_as(SessionRequest, body).store))}
    if path == "/session/close":
        state.close(parse_as(CloseRequest, body).session)
        return {"ok": True}
    req = parse_as(CallRequest, body)
    name = req.name
    if not isinstance(name, str) or name not in TOOLS:
        raise HTTPError(404, f"name={short(name)} is not a tool: allowed: {', '.join(sorted(TOOLS))}", param="name")
    args = parse_as(ARGUMENTS[name], req.arguments, f"{name}'s arguments").model_dump(exclude_unset=True)
    has_session = "session" in req.model_fields_set
    if name in _NEEDS_SESSION and not has_session:
        raise HTTPError(400, f"{name} needs a session: open one with POST /session")
    session = state.get(req.session) if has_session else None
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
            raise HTTPError(400, f"arguments.timeout_s={args.get('timeout_s')!r} is invalid: must be > 0")
        if not state.sandboxes.acquire(blocking=False):
            raise HTTPError(503, f"all {limits.max_sandboxes} sandboxes busy; retry later")
        t = float(t)
        try:
            r = run_sandboxed(args["code"], args["tests"], timeout_s=t, cpu_s=max(1, math.ceil(t)))
        finally:
            state.sandboxes.release()
        return {"ok": True, "result": {"passed": r.passed, "status": r.status, "stdout": r.stdout,
                                       "stderr": r.stderr, "isolation": dict(r.isolation)}}
    return {"ok": True, "result": _file_tool(name, args, session, limits)}


def _render(e: HTTPError) -> dict:
    return {"ok": False, "error": e.message}


class EnvServer:
    """A running environment service (in-process, its event loop on a daemon thread). ``url``; ``close()``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, limits: Optional[EnvLimits] = None):
        limits = limits or EnvLimits()
        self.state = _State(limits)
        self.internal_errors = 0
        pool = concurrent.futures.ThreadPoolExecutor(limits.max_connections, thread_name_prefix="glm5-env")

        def count_internal():
            self.internal_errors += 1

        async def health(request):
            return web.json_response({"ok": True, "tools": sorted(TOOLS)})

        async def post(request):
            deadline = getattr(request.protocol, "deadline", None)
            body = await read_json(request, max_body=limits.max_body, deadline=deadline, require_length=True)
            out = await asyncio.get_running_loop().run_in_executor(pool, _dispatch, self.state, request.path, body)
            return web.json_response(out)

        async def stop_pool(_app):
            pool.shutdown(wait=False)

        app = web.Application(client_max_size=limits.max_body,
                              middlewares=[error_middleware(_render, on_internal=count_internal)])
        app.router.add_get("/health", health)
        for path in ("/session", "/session/close", "/call"):
            app.router.add_post(path, post)
        app.on_cleanup.append(stop_pool)
        self._served = serve_in_thread(app, host, port, render=_render, request_timeout_s=limits.request_timeout_s,
                                       max_connections=limits.max_connections, name="glm5-env")
        self.host, self.port, self.url = self._served.host, self._served.port, self._served.url

    def wait(self):
        """Block until the service stops (the command line's serve-until-killed)."""
        self._served.wait()

    def close(self):
        self._served.close()
        self.state.close_all()

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


def define_flags() -> None:
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
    flags.DEFINE_integer("port", 0, "Port (0 = any free port; the URL is printed).")
    flags.DEFINE_integer("max_body", EnvLimits.max_body, "Largest request body in bytes.")
    flags.DEFINE_float("request_timeout_s", EnvLimits.request_timeout_s,
                       "Deadline for a request's line, headers and body together.")


def main(argv):
    """``python -m glm5_jax.agentic.envs --port=N``: serve until killed; prints the URL once ready."""
    del argv
    f = flags.FLAGS
    srv = EnvServer(f.host, f.port, EnvLimits(max_body=f.max_body, request_timeout_s=f.request_timeout_s))
    print(f"listening on {srv.url}", flush=True)
    try:
        srv.wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    run(main, define_flags)
