"""Sandboxed execution of model-written code: pass/fail, limits, no network."""

import os
import socket
import time

import pytest

from glm5_jax.rl.sandbox import netns_available, run_sandboxed

ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def test_passes_correct_solution_and_cleans_up():
    before = set(os.listdir("/tmp"))
    r = run_sandboxed(ADD + "print('hello')\n", ADD_TESTS)
    assert r.passed and r.status == "passed", r
    assert r.stdout.strip() == "hello"  # nonce is stripped
    left = {d for d in set(os.listdir("/tmp")) - before if d.startswith("glm5_sandbox_")}
    assert not left


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


def test_infinite_loop_is_killed():
    t0 = time.monotonic()
    r = run_sandboxed("while True:\n    pass\n", "", timeout_s=1.0, cpu_s=5)
    assert r.status == "timeout" and not r.passed
    assert time.monotonic() - t0 < 4.0


def test_cpu_limit():
    t0 = time.monotonic()
    r = run_sandboxed("while True:\n    pass\n", "", timeout_s=10.0, cpu_s=1)
    assert r.status == "timeout"
    assert time.monotonic() - t0 < 5.0


def test_sleeping_child_processes_are_killed_with_the_group():
    # a sleep (no CPU) only stops on the wall clock
    t0 = time.monotonic()
    r = run_sandboxed("import time\ntime.sleep(30)\n", "", timeout_s=1.0)
    assert r.status == "timeout" and time.monotonic() - t0 < 4.0


@pytest.mark.parametrize(
    "bomb",
    [
        "x = bytearray(8 * 1024 ** 3)\n",
        "xs = []\nwhile True:\n    xs.append(bytearray(16 * 1024 * 1024))\n",
    ],
)
def test_memory_bomb_is_stopped(bomb):
    t0 = time.monotonic()
    r = run_sandboxed(bomb, "", memory_mb=128, timeout_s=5.0)
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
def test_network_namespace_alone_blocks_loopback():
    """OS layer on its own (Python guard off): the parent's 127.0.0.1 is unreachable."""
    srv = _listener()
    try:
        port = srv.getsockname()[1]
        r = run_sandboxed(CONNECT.format(port=port), "", netns=True, _python_guard=False)
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
