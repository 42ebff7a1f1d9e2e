"""Sandboxed execution of model-written code: pass/fail, limits, no network; on each namespace backend
(bubblewrap, util-linux unshare: forced through $GLM5_SANDBOX_BACKEND, skipped where its probe fails) and
without namespaces."""

import os
import socket
import tempfile
import time

import pytest

from glm5_jax.rl.sandbox import netns_available, run_sandboxed
from glm5_jax.rl.sandbox_isolation import BACKEND_ENV, BACKENDS, probe


def _force_backend(name, monkeypatch):
    state = probe(name)
    if state != "on":
        pytest.skip(f"{name}: {state}")
    monkeypatch.setenv(BACKEND_ENV, name)


@pytest.fixture(params=BACKENDS, name="backend")
def backend_fixture(request, monkeypatch):
    """Each namespace backend in turn, forced (the other is never tried); skipped where its probe fails."""
    _force_backend(request.param, monkeypatch)
    return request.param


@pytest.fixture(params=BACKENDS + ("no-namespaces",))
def mode(request, monkeypatch):
    """run_sandboxed kwargs for each backend (required: isolate=True) and for a run without namespaces."""
    if request.param == "no-namespaces":
        return {"isolate": False}
    _force_backend(request.param, monkeypatch)
    return {"isolate": True}


ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def test_passes_correct_solution_and_cleans_up(mode, tmp_path, monkeypatch):
    # the run's scratch directory goes under this test's own tmp_path (other tests may run sandboxes
    # in /tmp at the same time under xdist): it must be gone afterwards
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = run_sandboxed(ADD + "print('hello')\n", ADD_TESTS, **mode)
    assert r.passed and r.status == "passed", r
    assert r.stdout.strip() == "hello"  # nonce is stripped
    assert not [d for d in os.listdir(tmp_path) if d.startswith("glm5_sandbox_")]


def test_fails_wrong_solution_and_test_functions():
    r = run_sandboxed("def add(a, b):\n    return a - b\n", ADD_TESTS)
    assert not r.passed and r.status == "failed"
    assert "AssertionError" in r.stderr
    r = run_sandboxed(ADD, "def test_x():\n    assert add(2, 2) == 5\n")
    assert r.status == "failed"
    r = run_sandboxed(ADD, "def test_x():\n    assert add(2, 2) == 4\n")
    assert r.status == "passed"


def test_error_on_broken_code_and_early_exit_is_not_a_pass():
    assert run_sandboxed("def add(a, b) return a\n", ADD_TESTS).status == "error"
    assert run_sandboxed("raise ValueError('x')\n", ADD_TESTS).status == "error"
    # exiting with status 0 before the tests run must not count as a pass
    for hack in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n"):
        r = run_sandboxed(ADD + hack, ADD_TESTS)
        assert not r.passed and r.status == "error", (hack, r)


def test_infinite_loop_is_killed(mode):
    t0 = time.monotonic()
    r = run_sandboxed("while True:\n    pass\n", "", timeout_s=1.0, cpu_s=5, **mode)
    assert r.status == "timeout" and not r.passed
    assert time.monotonic() - t0 < 4.0


def test_cpu_limit(mode):
    """The soft RLIMIT_CPU's SIGXCPU reaches the parent as a signal on every backend (128 + n decoded)."""
    t0 = time.monotonic()
    r = run_sandboxed("while True:\n    pass\n", "", timeout_s=10.0, cpu_s=1, **mode)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < 5.0


def test_sleeping_child_processes_are_killed_with_the_group(mode):
    # a sleep (no CPU) only stops on the wall clock
    t0 = time.monotonic()
    r = run_sandboxed("import time\ntime.sleep(30)\n", "", timeout_s=1.0, **mode)
    assert r.status == "timeout" and time.monotonic() - t0 < 4.0


@pytest.mark.parametrize(
    "bomb",
    [
        "x = bytearray(8 * 1024 ** 3)\n",
        "xs = []\nwhile True:\n    xs.append(bytearray(16 * 1024 * 1024))\n",
    ],
)
def test_memory_bomb_is_stopped(bomb, mode):
    t0 = time.monotonic()
    r = run_sandboxed(bomb, "", memory_mb=128, timeout_s=5.0, **mode)
    assert not r.passed and r.status in ("memory", "killed"), r
    assert time.monotonic() - t0 < 5.0


def _listener():
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.2)
    return srv


def _assert_nobody_connected(srv):
    with pytest.raises((socket.timeout, TimeoutError, BlockingIOError)):
        conn, _ = srv.accept()
        conn.close()


CONNECT = (
    "import socket\n"
    "s = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
    "s.sendall(b'leak')\n"
)


@pytest.mark.parametrize("netns", [None, False])
def test_network_is_blocked(netns):
    srv = _listener()
    try:
        port = srv.getsockname()[1]
        r = run_sandboxed(CONNECT.format(port=port), "", netns=netns)
        assert not r.passed and r.status == "network_blocked", r
        _assert_nobody_connected(srv)
        # catching the exception does not launder the attempt
        code = "try:\n" + "".join("    " + l + "\n" for l in CONNECT.format(port=port).splitlines())
        code += "except Exception:\n    pass\n" + ADD
        r = run_sandboxed(code, ADD_TESTS, netns=netns)
        assert r.status == "network_blocked"
        _assert_nobody_connected(srv)
    finally:
        srv.close()


@pytest.mark.skipif(not netns_available(), reason="unshare -n not available")
def test_network_namespace_alone_blocks_loopback(mode):
    """OS layer on its own (Python guard and seccomp off): the parent's 127.0.0.1 is unreachable."""
    srv = _listener()
    try:
        port = srv.getsockname()[1]
        r = run_sandboxed(CONNECT.format(port=port), "", netns=True, _python_guard=False, seccomp=False, **mode)
        assert not r.passed and r.status == "error"
        assert "Error" in r.stderr  # ConnectionRefused / network unreachable
        _assert_nobody_connected(srv)
    finally:
        srv.close()


def test_process_spawning_is_blocked():
    r = run_sandboxed("import os\nos.system('echo pwned > /tmp/x')\n", "")
    assert r.status == "error" and "blocked" in r.stderr
    r = run_sandboxed("import subprocess\nsubprocess.run(['true'])\n", "")
    assert r.status == "error"


def test_audit_hook_catches_raw_socket_module():
    """Bypassing the patched ``socket`` module via ``_socket`` still hits the audit hook."""
    srv = _listener()
    try:
        port = srv.getsockname()[1]
        code = f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {port}))\n"
        r = run_sandboxed(code, "", netns=False)
        assert r.status == "network_blocked" and "socket.__new__" in r.stderr, r
        _assert_nobody_connected(srv)
    finally:
        srv.close()


# ----------------------------------------------------------------------------- backends and the child program


def test_each_backend_is_used_when_forced_and_reported(backend):
    r = run_sandboxed(ADD + "import os\nprint(os.getuid())\n", ADD_TESTS, isolate=True)
    assert r.passed and r.backend == backend, r
    assert {k for k, v in r.isolation.items() if v != "on"} <= {"seccomp"}, r.isolation
    assert int(r.stdout) >= 200000                      # the fresh uid, not root


def test_auto_falls_back_to_unshare_when_the_bwrap_probe_fails(monkeypatch):
    """A machine where bubblewrap is missing or cannot make namespaces: auto uses util-linux, and says so;
    with neither, isolation_available names both reasons and isolate=True refuses to run."""
    from glm5_jax.rl import sandbox_isolation
    if probe("unshare") != "on":
        pytest.skip(f"unshare: {probe('unshare')}")
    real = sandbox_isolation.probe
    monkeypatch.setattr(sandbox_isolation, "probe",
                        lambda b: "unavailable: bwrap probe failed (test)" if b == "bwrap" else real(b))
    monkeypatch.setenv(BACKEND_ENV, "auto")
    r = run_sandboxed(ADD, ADD_TESTS)
    assert r.passed and r.backend == "unshare" and r.isolation["namespaces"] == "on", r
    monkeypatch.setattr(sandbox_isolation, "probe", lambda b: f"unavailable: {b} (test)")
    assert sandbox_isolation.isolation_available() == "unavailable: bwrap (test); unavailable: unshare (test)"
    r = run_sandboxed(ADD, ADD_TESTS, isolate=True)
    assert r.status == "sandbox_error" and "unavailable: bwrap (test)" in r.stderr, r


def test_unknown_backend_is_a_clear_error(monkeypatch):
    from glm5_jax.errors import Glm5Error
    monkeypatch.setenv(BACKEND_ENV, "docker")
    with pytest.raises(Glm5Error, match="GLM5_SANDBOX_BACKEND='docker'.*auto, bwrap or unshare"):
        run_sandboxed(ADD, ADD_TESTS)


def test_child_is_an_isolated_interpreter_without_the_project(mode):
    """The child program runs from the box under -I -S: no project module, no site, no /box on sys.path."""
    code = ("import sys\nprint(sorted(m for m in sys.modules if 'glm5' in m), sys.flags.isolated,\n"
            "      sys.flags.no_site, [p for p in sys.path if 'box' in p or 'site-packages' in p])\n" + ADD)
    r = run_sandboxed(code, ADD_TESTS, **mode)
    assert r.passed and r.stdout.strip() == "[] 1 1 []", r


def test_codec_round_trips_plain_data_and_hands_off_everything_else():
    """decode(encode(v)) rebuilds v with exact types; a subclass of a plain type, a function or nesting past
    MAX_DEPTH goes to the handle callback; a value over the node budget raises."""
    import random

    from glm5_jax.rl.sandbox_child.codec import MAX_DEPTH, decode, encode

    rng = random.Random(0)

    def value(depth):
        leaves = [None, rng.random() < 0.5, rng.randint(-2 ** 70, 2 ** 70), rng.uniform(-1e9, 1e9),
                  complex(rng.random(), -rng.random()), "s\u00e9\n" * rng.randint(0, 3), bytes([rng.randint(0, 255)])]
        if depth > 3 or rng.random() < 0.4:
            return rng.choice(leaves)
        kind = rng.choice([list, tuple, dict, set, frozenset])
        if kind is dict:
            return {rng.randint(0, 99): value(depth + 1) for _ in range(rng.randint(0, 3))}
        if kind in (set, frozenset):
            return kind(rng.randint(0, 99) for _ in range(rng.randint(0, 3)))
        return kind(value(depth + 1) for _ in range(rng.randint(0, 3)))

    def no_handle(v):
        raise AssertionError(f"plain value sent to the handle callback: {v!r}")

    def same(a, b):
        return type(a) is type(b) and (a == b if not isinstance(a, (list, tuple)) else
                                       len(a) == len(b) and all(same(x, y) for x, y in zip(a, b)))

    for _ in range(300):
        v = value(0)
        assert same(decode(encode(v, no_handle, [10 ** 6]), no_handle), v), v

    class IntSubclass(int):
        pass

    seen = []
    def handle(v):
        seen.append(v)
        return ["H", len(seen), type(v).__name__, callable(v)]
    deep = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    for v in (IntSubclass(3), len, deep):
        seen.clear()
        encode([v], handle, [10 ** 6])
        assert len(seen) == 1 and (seen[0] is v or v is deep)
    with pytest.raises(OverflowError):
        encode(list(range(100)), handle, [50])


def test_classify_decodes_the_named_exit_statuses():
    """The statuses the children exit with (sandbox_child.Exit) decide the run where the verdict alone does
    not: a judge's "passed" is network_blocked when the solution exited NETWORK; an "error" verdict is
    memory when the solution exited LOAD_MEMORY; our own SIGKILL after a verdict is not held against it."""
    from glm5_jax.rl.sandbox import classify
    from glm5_jax.rl.sandbox_child import Exit

    def c(verdict, sol_rc, judge_rc=0, timed_out=False):
        return classify({"status": verdict}, sol_rc, judge_rc, timed_out=timed_out, wall_s=0.1, cpu_s=2, stderr="")
    assert [int(e) for e in Exit] == [0, 12, 13, 14] and len(set(Exit)) == 4
    assert c("passed", Exit.OK) == c("passed", -9) == c("passed", None) == "passed"
    assert c("passed", Exit.NETWORK) == "network_blocked"
    assert c("error", Exit.LOAD_MEMORY) == "memory" and c("error", Exit.LOAD_ERROR) == "error"
    assert c("passed", Exit.OK, timed_out=True) == "timeout"
    assert c(None, -24) == "timeout" and c(None, -25) == "output_limit" and c(None, None, -24) == "timeout"


def test_sandbox_modules_hold_no_program_in_a_string():
    """The child program and the namespace setup are modules, not source in strings: no string constant
    other than a docstring in the sandbox's modules is longer than 20 lines."""
    import ast
    import pathlib

    from glm5_jax.rl import sandbox

    root = pathlib.Path(sandbox.__file__).parent
    files = [root / "sandbox.py", root / "sandbox_isolation.py", root / "sandbox_nsinit.py",
             *sorted((root / "sandbox_child").glob("*.py"))]
    assert len(files) >= 8
    for f in files:
        tree = ast.parse(f.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                assert node.value.count("\n") < 20, f"{f.name}:{node.lineno}: a {node.value.count(chr(10))}-line string"
