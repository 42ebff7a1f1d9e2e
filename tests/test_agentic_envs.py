"""Tool environment services (glm5_jax/agentic/envs.py): answers against hand-computed values, refusals
(4xx, never 5xx) for hostile requests, and a fuzz run after which the services still answer correctly."""

import dataclasses
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

from glm5_jax.agentic.envs import EnvLimits, ToolError, call_tool, close_session, open_session, serve

LIMITS = EnvLimits(max_body=4096, request_timeout_s=0.5, max_file_bytes=512, max_files=8)


@pytest.fixture(scope="module")
def srv():
    s = serve(limits=LIMITS)
    yield s
    s.close()


def _raw(srv, data: bytes, *, drip: float = 0.0, shut: bool = False, timeout: float = 5.0):
    """Send raw bytes; returns the status code, or None when the server closed without a reply."""
    c = socket.create_connection((srv.host, srv.port), timeout=timeout)
    try:
        if drip:
            for i in range(0, len(data), 4):
                c.sendall(data[i:i + 4])
                time.sleep(drip)
        else:
            c.sendall(data)
        if shut:
            c.shutdown(socket.SHUT_WR)
        buf = b""
        t0 = time.monotonic()
        while b"\r\n" not in buf:
            try:
                b = c.recv(4096)
            except ConnectionResetError:
                break
            if not b:
                break
            buf += b
            assert time.monotonic() - t0 < timeout, "server hung"
    except (BrokenPipeError, ConnectionResetError):
        return None             # the server closed on us mid-send (a refused body): no crash
    except socket.timeout:
        raise AssertionError(f"no answer within {timeout} s to {data[:80]!r}") from None
    finally:
        c.close()
    if not buf:
        return None
    return int(buf.split(b" ", 2)[1])


def _post(path: str, body, *, raw_body: bytes = None, headers: str = "") -> bytes:
    b = raw_body if raw_body is not None else json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(b)}\r\n{headers}Connection: close\r\n\r\n"
            .encode() + b)


def _check_answers(url):
    """The services answer correctly: values computed by hand / by Python's own arithmetic."""
    assert call_tool(url, "calculator", {"expression": "37*12+5"}) == "449"
    assert call_tool(url, "calculator", {"expression": "(2+3)*4-6"}) == str((2 + 3) * 4 - 6)
    assert call_tool(url, "calculator", {"expression": "1+"}) == "error: invalid expression"
    sid = open_session(url, {"owl": 731, "river": 5})
    assert call_tool(url, "kv_get", {"key": "owl"}, session=sid) == "731"
    assert call_tool(url, "kv_get", {"key": "ow"}, session=sid) == "error: unknown key"
    assert call_tool(url, "file_write", {"path": "d/a.txt", "content": "héllo"}, session=sid) == "ok"
    assert call_tool(url, "file_read", {"path": "d/a.txt"}, session=sid) == "héllo"
    assert call_tool(url, "file_list", {"path": ""}, session=sid) == ["d/"]
    assert call_tool(url, "file_list", {"path": "d"}, session=sid) == ["a.txt"]
    assert call_tool(url, "file_read", {"path": "d/missing"}, session=sid) == "error: no such file"
    other = open_session(url)
    assert call_tool(url, "file_list", {"path": ""}, session=other) == []     # roots are per session
    close_session(url, sid)
    close_session(url, other)
    with pytest.raises(ToolError) as e:
        call_tool(url, "kv_get", {"key": "owl"}, session=sid)
    assert e.value.status == 404


def test_tools_answer(srv):
    _check_answers(srv.url)


def test_run_code_sandbox(srv):
    r = call_tool(srv.url, "run_code", {"code": "def f(x):\n    return x + 1\n", "tests": "assert f(1) == 2"})
    assert r["passed"] and r["status"] == "passed"
    r = call_tool(srv.url, "run_code", {"code": "while True: pass", "tests": "", "timeout_s": 0.5})
    assert not r["passed"] and r["status"] == "timeout"


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../x", "d/../../../etc/passwd", "..", "./../x"])
def test_traversal_refused(srv, path):
    sid = open_session(srv.url)
    for name, args in (("file_read", {"path": path}), ("file_write", {"path": path, "content": "x"}),
                       ("file_list", {"path": path})):
        with pytest.raises(ToolError) as e:
            call_tool(srv.url, name, args, session=sid)
        assert e.value.status == 403, (name, path, e.value)
    assert call_tool(srv.url, "file_list", {"path": ""}, session=sid) == []
    close_session(srv.url, sid)


@pytest.mark.parametrize("name,args,status", [
    ("nope", {}, 404),
    ("calculator", {"expression": 5}, 400),
    ("calculator", {"expression": True}, 400),
    ("calculator", {}, 400),
    ("calculator", {"expression": "1", "x": 1}, 400),
    ("calculator", [1], 400),
    ("run_code", {"code": "", "tests": "", "timeout_s": -1}, 400),
    ("file_read", {"path": "a\\b"}, 400),
    ("file_read", {"path": "a"}, 400),          # no session
])
def test_bad_calls_are_4xx(srv, name, args, status):
    with pytest.raises(ToolError) as e:
        call_tool(srv.url, name, args)
    assert e.value.status == status, e.value


def test_size_and_time_bounds(srv):
    # (HTTP/1.1 requests name their Host: RFC 9112 makes one without it a 400, which aiohttp answers first)
    assert _raw(srv, _post("/call", None, raw_body=b"x" * (LIMITS.max_body + 1))) == 413
    big = f"POST /call HTTP/1.1\r\nHost: x\r\nContent-Length: {10 ** 12}\r\n\r\n".encode()
    assert _raw(srv, big) == 413
    assert _raw(srv, b"POST /call HTTP/1.1\r\nHost: x\r\n\r\n") == 411
    assert _raw(srv, b"POST /call HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n") == 411
    t0 = time.monotonic()       # a body that never completes: 408 at the deadline, not a hang
    assert _raw(srv, b"POST /call HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{") == 408
    assert time.monotonic() - t0 < LIMITS.request_timeout_s + 3
    # a slow drip (a few bytes every 0.1 s) is cut at the whole-request deadline
    body = json.dumps({"name": "calculator", "arguments": {"expression": "1+1" + "+1" * 20}}).encode()
    assert _raw(srv, _post("/call", None, raw_body=body), drip=0.1) in (408, None)
    # slow headers: the request is refused at the deadline, never processed from a cut-short header block
    t0 = time.monotonic()
    assert _raw(srv, b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 60 + b"\r\n\r\n", drip=0.1) in (408, None)
    assert time.monotonic() - t0 < 5
    sid = open_session(srv.url)
    with pytest.raises(ToolError) as e:
        call_tool(srv.url, "file_write", {"path": "a", "content": "x" * (LIMITS.max_file_bytes + 1)}, session=sid)
    assert e.value.status == 413
    for i in range(LIMITS.max_files):
        assert call_tool(srv.url, "file_write", {"path": f"f{i}", "content": "x"}, session=sid) == "ok"
    assert call_tool(srv.url, "file_write", {"path": "one_more", "content": "x"}, session=sid).startswith("error")
    close_session(srv.url, sid)


def _fuzz_request(rng: random.Random, sid: str) -> bytes:
    """One random, mostly hostile request."""
    kind = rng.randrange(12)
    junk = lambda n: bytes(rng.randrange(256) for _ in range(n))
    values = [None, True, 0, -1, 1.5, "", "x" * rng.randrange(1, 300), [], [1, "a"], {}, {"a": {"b": []}},
              "../../etc/passwd", "/tmp", "a/" * 200, "\u0000", "\ud7ff\u2028", 10 ** 30]
    tools = ["calculator", "kv_get", "run_code", "file_read", "file_write", "file_list", "", "CALC", None, 3]
    if kind == 0:
        return junk(rng.randrange(1, 400))
    if kind == 1:
        return _post("/call", None, raw_body=junk(rng.randrange(0, 300)))
    if kind == 2:                               # bad JSON text
        s = json.dumps({"name": "calculator", "arguments": {"expression": "1+2"}})
        cut = rng.randrange(len(s))
        return _post("/call", None, raw_body=(s[:cut] + rng.choice(["", "}", "]]", "\\", '"'])).encode())
    if kind == 3:                               # over the body cap, declared or sent
        if rng.random() < 0.5:
            n = rng.randrange(LIMITS.max_body + 1, 10 ** 9)
            return f"POST /call HTTP/1.1\r\nContent-Length: {n}\r\n\r\n".encode()
        return _post("/call", None, raw_body=b"{" * (LIMITS.max_body + rng.randrange(1, 2000)))
    if kind == 4:                               # wrong types / unknown tools / stray fields
        body = {"name": rng.choice(tools), "arguments": rng.choice(values + [{"expression": rng.choice(values)},
                                                                            {"path": rng.choice(values)}])}
        if rng.random() < 0.3:
            body["session"] = rng.choice(values + ["0" * 32])
        return _post("/call", rng.choice([body, [body], rng.choice(values)]))
    if kind == 5:                               # traversal paths, in a live session (403) or not (4xx)
        p = rng.choice(["..", "../", "/etc/passwd", "a/../../b", "%2e%2e/x", "a\\..\\b", "....//x", "/"])
        return _post("/call", {"name": rng.choice(["file_read", "file_list"]), "arguments": {"path": p},
                               "session": rng.choice([sid, sid, "0" * 32, "zz"])})
    if kind == 6:                               # random method / path / version
        m = rng.choice(["GET", "PUT", "DELETE", "HEAD", "OPTIONS", "BREW", "get", ""])
        p = rng.choice(["/", "/call", "/health", "/session", "/x" * 50, "*", "/../../etc", ""])
        v = rng.choice(["HTTP/1.1", "HTTP/1.0", "HTTP/9.9", "", "FOO"])
        return f"{m} {p} {v}\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    if kind == 7:                               # bad Content-Length headers
        cl = rng.choice(["-5", "abc", "1e3", "", " 12", "99999999999999999999999"])
        return f"POST /call HTTP/1.1\r\nContent-Length: {cl}\r\nConnection: close\r\n\r\n{{}}".encode()
    if kind == 8:                               # deep nesting (json recursion) and odd unicode
        d = rng.randrange(100, 3000)
        return _post("/call", None, raw_body=(b"[" * d + b"]" * d)[:LIMITS.max_body])
    if kind == 9:                               # sessions with bad stores
        return _post("/session", {"store": rng.choice(values + [{"k": "v"}, {"k": True}, {"k" * 100: 1}])})
    if kind == 10:                              # calculator abuse: long, nested, non-integer
        e = rng.choice(["(" * 300 + "1" + ")" * 300, "9" * 400 + "*" + "9" * 100, "1/3", "1/0", "2**99999",
                        "-" * 50 + "1", "1" + "+1" * 300, "__import__('os')"])
        return _post("/call", {"name": "calculator", "arguments": {"expression": e}})
    return _post("/call", {"name": "calculator", "arguments": {"expression": "1+1"}})   # plain valid


def _fuzz(srv, n: int, seed: int, n_slow: int):
    rng = random.Random(seed)
    sid = open_session(srv.url)
    statuses = {}
    for _ in range(n):
        data = _fuzz_request(rng, sid)
        st = _raw(srv, data, shut=True)     # EOF after the request: an incomplete one is answered at once
        statuses[st] = statuses.get(st, 0) + 1
        assert st is None or 200 <= st < 500, (st, data[:200])
    # slow bodies in parallel with normal traffic: each cut at the deadline, none blocks the rest
    slow_results = []
    body = _post("/call", {"name": "calculator", "arguments": {"expression": "1" + "+1" * 40}})
    threads = [threading.Thread(target=lambda: slow_results.append(_raw(srv, body, drip=0.2)))
               for _ in range(n_slow)]
    for t in threads:
        t.start()
    assert call_tool(srv.url, "calculator", {"expression": "6*7"}, timeout=5) == "42"
    for t in threads:
        t.join(timeout=30)
    assert all(r in (408, None) for r in slow_results), slow_results
    assert srv.internal_errors == 0
    assert call_tool(srv.url, "file_list", {"path": ""}, session=sid) == []     # nothing was written
    return statuses


def test_fuzz_then_still_correct():
    with serve(limits=LIMITS) as s:
        statuses = _fuzz(s, n=2000, seed=0, n_slow=4)
        refused = sum(v for k, v in statuses.items() if k and 400 <= k < 500)
        assert statuses.get(200, 0) > 0 and statuses.get(403, 0) > 0 and refused > 1000, statuses
        _check_answers(s.url)


@pytest.mark.slow
def test_fuzz_big():
    """20000 requests from 4 concurrent clients, 16 slow bodies each."""
    errors = []

    def client(seed):
        try:
            _fuzz(s, n=5000, seed=seed + 1, n_slow=16)
        except BaseException as e:      # noqa: BLE001 - re-raised in the main thread
            errors.append(e)
    # room for every concurrent connection: a 503 when the server is full is an overload answer, not a
    # refusal of a bad request, and is tested on its own (test_connection_cap)
    with serve(limits=dataclasses.replace(LIMITS, max_connections=128)) as s:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        _check_answers(s.url)


def test_connection_cap():
    """Connections beyond max_connections get 503 at once; the server answers again when they go."""
    with serve(limits=dataclasses.replace(LIMITS, max_connections=2, request_timeout_s=2.0)) as s:
        idle = [socket.create_connection((s.host, s.port)) for _ in range(2)]
        time.sleep(0.2)
        assert _raw(s, b"GET /health HTTP/1.1\r\n\r\n") == 503
        for c in idle:
            c.close()
        time.sleep(0.3)
        assert _raw(s, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") == 200


def test_subprocess_service():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "glm5_jax.agentic.envs", "--port", "0"], stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.startswith("listening on http://"), line
        url = line.split()[-1]
        assert call_tool(url, "calculator", {"expression": "2*21"}) == "42"
        assert _raw_ok(url)
    finally:
        p.terminate()
        p.wait(timeout=10)


def test_service_imports_without_jax():
    """The services run on rollout hosts: importing them (with the shared HTTP stack, glm5_jax.serve.http)
    loads neither jax nor the serving engine."""
    code = "import sys, glm5_jax.agentic.envs; print(sorted(m for m in ('jax', 'glm5_jax.serve.engine') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def _raw_ok(url) -> bool:
    import urllib.request
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return json.loads(r.read())["ok"] is True


# ----------------------------------------------------------------------------- malformed values (issue 44)

_HOSTILE_STRINGS = ['"\\ud800"', '"a\\udfffb"', '"\\udc00\\ud800"', '"ok\\ud83d"']    # lone surrogates (JSON text)
_HOSTILE_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 400, "-" + "9" * 400,
                    "1" + "0" * 5000, "0", "-0.0", "1e-320"]


def _hostile_bodies(rng: random.Random, sid: str):
    """JSON texts (not Python objects: json.dumps cannot write most of these) with a hostile value in
    every string / number slot of every endpoint."""
    s = lambda: rng.choice(_HOSTILE_STRINGS)
    n = lambda: rng.choice(_HOSTILE_NUMBERS)
    q = json.dumps
    return rng.choice([
        ("/call", f'{{"name": "file_write", "arguments": {{"path": "a.txt", "content": {s()}}}, "session": {q(sid)}}}'),
        ("/call", f'{{"name": "file_write", "arguments": {{"path": {s()}, "content": "x"}}, "session": {q(sid)}}}'),
        ("/call", f'{{"name": "file_read", "arguments": {{"path": {s()}}}, "session": {q(sid)}}}'),
        ("/call", f'{{"name": "run_code", "arguments": {{"code": {s()}, "tests": ""}}}}'),
        ("/call", f'{{"name": "run_code", "arguments": {{"code": "x = 1", "tests": {s()}}}}}'),
        ("/call", f'{{"name": "run_code", "arguments": {{"code": "", "tests": "", "timeout_s": {n()}}}}}'),
        ("/call", f'{{"name": "calculator", "arguments": {{"expression": {s()}}}}}'),
        ("/call", f'{{"name": "calculator", "arguments": {{"expression": {n()}}}}}'),
        ("/call", f'{{"name": "kv_get", "arguments": {{"key": {s()}}}, "session": {q(sid)}}}'),
        ("/call", f'{{"name": {s()}, "arguments": {{}}}}'),
        ("/call", f'{{{s()}: 1, "name": "calculator", "arguments": {{"expression": "1"}}}}'),
        ("/call", f'{{"name": "kv_get", "arguments": {{"key": "a"}}, "session": {s()}}}'),
        ("/session", f'{{"store": {{{s()}: 1}}}}'),
        ("/session", f'{{"store": {{"k": {n()}}}}}'),
        ("/session/close", f'{{"session": {s()}}}'),
        ("/session/close", f'{{"session": {n()}}}'),
    ])


def test_malformed_values_are_400_never_500():
    """Lone surrogates, NaN / Infinity, floats that overflow and 400-digit ints in every slot: a 4xx
    naming the problem (or an ordinary tool result), never a 500; the services answer correctly after."""
    rng = random.Random(44)
    with serve(limits=LIMITS) as s:
        sid = open_session(s.url)
        statuses = {}
        for _ in range(300):
            path, text = _hostile_bodies(rng, sid)
            st = _raw(s, _post(path, None, raw_body=text.encode()), shut=True)
            statuses[st] = statuses.get(st, 0) + 1
            assert st is not None and 200 <= st < 500, (st, text[:200])
        assert s.internal_errors == 0, statuses
        assert statuses.get(400, 0) > 100, statuses
        # the specific cases of the issue, by name
        for text in ('{"name": "file_write", "arguments": {"path": "a", "content": "\\ud800"}, "session": "%s"}' % sid,
                     '{"name": "run_code", "arguments": {"code": "\\ud800", "tests": ""}}',
                     '{"name": "run_code", "arguments": {"code": "", "tests": "", "timeout_s": NaN}}',
                     '{"name": "run_code", "arguments": {"code": "", "tests": "", "timeout_s": %s}}' % ("9" * 400)):
            if "9" * 400 in text:   # a huge timeout is capped, not refused
                continue
            assert _raw(s, _post("/call", None, raw_body=text.encode()), shut=True) == 400, text
        r = call_tool(s.url, "run_code", {"code": "def f():\n    return 1\n", "tests": "assert f() == 1",
                                          "timeout_s": 10 ** 400})
        assert r["passed"] and set(r["isolation"]) >= {"namespaces", "seccomp"}, r
        assert call_tool(s.url, "file_list", {"path": ""}, session=sid) == []     # nothing was written
        _check_answers(s.url)
