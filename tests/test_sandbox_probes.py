"""Probes against the code sandbox (issue 44 item 1): each way to forge a verdict or leave the sandbox
that worked against the old single-process runner, plus controls (correct code passes, wrong code
fails, timeouts are reported). Every probe is also a control: it is paired with the behaviour the
same code gets when it is honest, so a sandbox that failed everything would not pass these tests.
The escapes that need namespaces run on each backend (``backend``: bubblewrap and util-linux, each
forced; skipped where its probe fails)."""

import os
import time

import pytest

from glm5_jax.rl import sandbox
from glm5_jax.rl.sandbox import LAYERS, isolation_available, run_sandboxed
from glm5_jax.rl.tasks import score_function
from tests.test_sandbox import backend_fixture  # noqa: F401  (registers the fixture "backend")

ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(10, 25) == 35\n"
WRONG_ADD = "def add(a, b):\n    return a - b\n"


def _wrong_add_plus(hack: str) -> str:
    return WRONG_ADD + hack


# ----------------------------------------------------------------------------- verdict forgery


@pytest.mark.parametrize("hack", [
    # the two-liner: call the runner's finish(0) from a frame walk
    "import sys\nsys._getframe(1).f_locals['finish'](0)\n",
    # the same from inside the function under test (frame walk up the call stack)
    None,
    # walk every frame and send forged protocol messages with whatever channel object is there
    ("import sys\nf = sys._getframe()\nwhile f is not None:\n"
    "    for v in list(f.f_locals.values()):\n"
    "        if hasattr(v, 'send') and hasattr(v, 'recv'):\n"
    "            v.send({'load': 'ok', 'names': {}, 'net': False})\n"
    "            v.send({'bye': True, 'net': False})\n"
    "    f = f.f_back\n"
    "import os\nos._exit(0)\n"),
    # a forged verdict on every fd the process holds (the verdict pipe is not among them)
    ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'{\"status\": \"passed\"}')\n"
    "    except OSError:\n        pass\n"),
    # early exits with status 0
    "import os\nos._exit(0)\n",
    "import sys\nsys.exit(0)\n",
    # patched builtins: assertion helpers / comparisons the tests might use
    ("import builtins\nbuiltins.AssertionError = type('X', (BaseException,), {})\nbuiltins.abs = lambda x: 0\n"
    "builtins.len = lambda x: 3\n"),
])
def test_forged_verdicts_do_not_pass(hack):
    if hack is None:
        code = ("def add(a, b):\n    import sys\n    f = sys._getframe(1)\n    for k in ('finish', 'verdict'):\n"
                "        if k in f.f_locals:\n            f.f_locals[k](0)\n    return a - b\n")
    else:
        code = _wrong_add_plus(hack)
    r = run_sandboxed(code, ADD_TESTS + "assert abs(add(2, 2) - 4) < 1e-9\nassert len([add(1, 1)]) == 1\n")
    assert not r.passed and r.status in ("failed", "error"), (hack, r)
    # control: the honest version of the same solution, with the same (harmless when honest) tail, passes
    if hack is not None and "builtins" in hack:
        # (without the len patch: the solution's own process uses len; breaking it is its own loss)
        ok = run_sandboxed("def add(a, b):\n    return a + b\n" + hack.replace("builtins.len = lambda x: 3\n", ""),
                           ADD_TESTS)
        assert ok.passed, (hack, ok)


@pytest.mark.parametrize("ret", [
    ("class E:\n        def __eq__(self, o):\n            return True\n        __hash__ = object.__hash__\n"
    "    return E()"),
    ("class I(int):\n        def __eq__(self, o):\n            return True\n        __hash__ = int.__hash__\n"
    "    return I(0)"),
    ("class S(str):\n        def __eq__(self, o):\n            return True\n        __hash__ = str.__hash__\n"
    "    return S('')"),
    # arithmetic that lies: abs(result - expected) == 0 whatever expected is
    ("class Z:\n        def __sub__(self, o):\n            return self\n        def __abs__(self):\n"
    "            return 0.0\n        def __lt__(self, o):\n            return True\n    return Z()"),
])
def test_objects_equal_to_everything_do_not_pass(ret):
    body = "    " + ret + "\n"
    tests = ADD_TESTS + "assert abs(add(1, 1) - 2) < 1e-9\n"
    r = run_sandboxed("def add(a, b):\n" + body, tests)
    assert not r.passed and r.status == "failed", r
    # through the RL scorer, as in the issue
    assert score_function(body + "\n", "def add(a, b):\n", tests) == (0.0, "wrong")
    assert score_function("    return a + b\n\n", "def add(a, b):\n", tests) == (1.0, "correct")


def test_solution_cannot_read_the_tests(backend):
    """A lookup table needs the tests: they are not in the solution's file system (nor its memory)."""
    code = ("import os, sys\nfound = []\nfor d, ds, fs in os.walk('/'):\n"
            "    if d.startswith(('/usr', '/dev', sys.base_prefix)):\n        ds[:] = []\n        continue\n"
            "    found += [os.path.join(d, f) for f in fs if f.endswith('.py')]\n"
            "print(sorted(found))\n"
            "def add(a, b):\n    return a + b\n")
    r = run_sandboxed(code, ADD_TESTS + "# secret-marker\n")
    assert r.passed and r.backend == backend, r
    assert "tests.py" not in r.stdout and "/box/solution.py" in r.stdout, r.stdout


# ----------------------------------------------------------------------------- controls


def test_controls_plain_values_classes_mutation_exceptions():
    functions = (
        "def add(a, b):\n    return a + b\n"
        "def halve(x):\n    if x % 2:\n        raise ValueError('odd')\n    return x // 2\n"
        "def sort_in_place(xs):\n    xs.sort()\n"
        "def stats(xs):\n    return {'n': len(xs), 'mean': sum(xs) / len(xs), 'items': (tuple(xs), set(xs))}\n"
    )
    classes = (
        "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
        "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
        "    def __len__(self):\n        return len(self.items)\n"
        "class P:\n    def __init__(self, x):\n        self.x = x\n"
        "    def __eq__(self, o):\n        return isinstance(o, P) and o.x == self.x\n"
        "LIMIT = 10 ** 30\n"
    )
    code = functions + classes
    tests = (
        "assert add(1, 2) == 3 and add('a', 'b') == 'ab' and add([1], [2]) == [1, 2]\n"
        "assert add(0.1, 0.2) == 0.1 + 0.2 and add(1j, 1) == 1 + 1j and LIMIT == 10 ** 30\n"
        "assert add(2 ** 100, 1) == 2 ** 100 + 1 and add(b'x', b'y') == b'xy'\n"
        "assert isinstance(add(1, 2), int) and add(True, False) == 1\n"
        "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]\n"
        "assert stats([1, 2, 3]) == {'n': 3, 'mean': 2.0, 'items': ((1, 2, 3), {1, 2, 3})}\n"
        "try:\n    halve(3)\n    raise AssertionError('no raise')\nexcept ValueError as e:\n    assert 'odd' in str(e)\n"
        "def test_stack():\n    s = Stack()\n    s.push(1)\n    s.push(2)\n    assert len(s) == 2\n"
        "    assert s.pop() == 2 and s.items == [1]\n"
        "    assert isinstance(s, Stack) and not isinstance(P(1), Stack) and not isinstance(3, Stack)\n"
        "def test_objects():\n    assert P(1) == P(1) and P(1) != P(2) and P(1) != 1\n"
        "for i in range(5):\n    assert halve(2 * i) == i\n"
    )
    r = run_sandboxed(code, tests)
    assert r.passed and r.status == "passed", r
    # each line of the tests can fail: a wrong variant of every function fails
    for wrong in ("def add(a, b):\n    return b + a if isinstance(a, str) else a + b\n",
                  "def sort_in_place(xs):\n    return sorted(xs)\n",
                  "def halve(x):\n    return x // 2\n",
                  "class Stack(Stack):\n    def pop(self):\n        return self.items[0]\n",
                  "class P:\n    def __init__(self, x):\n        self.x = x\n"):
        r = run_sandboxed(code + wrong, tests)
        assert not r.passed and r.status == "failed", (wrong, r)


def test_wrong_solution_fails_and_timeouts_are_reported():
    r = run_sandboxed(WRONG_ADD, ADD_TESTS)
    assert r.status == "failed" and "AssertionError" in r.stderr
    t0 = time.monotonic()
    r = run_sandboxed("def add(a, b):\n    while True:\n        pass\n", ADD_TESTS, timeout_s=1.0, cpu_s=5)
    assert r.status == "timeout" and not r.passed
    assert time.monotonic() - t0 < 4.0
    r = run_sandboxed("def add(a, b):\n    return a + b\n", "while True:\n    pass\n", timeout_s=6.0, cpu_s=1)
    assert r.status == "timeout" and r.wall_s < 5.0, r      # the judge's own CPU limit, not the wall clock
    r = run_sandboxed("def add(a, b):\n    raise SystemExit(0)\n", ADD_TESTS)       # exit mid-call
    assert r.status == "error" and not r.passed


def test_isolation_is_reported_and_never_silent(monkeypatch):
    r = run_sandboxed("def add(a, b):\n    return a + b\n", ADD_TESTS)
    assert set(r.isolation) == set(LAYERS)
    assert r.isolation["namespaces"] == isolation_available()
    r = run_sandboxed("def add(a, b):\n    return a + b\n", ADD_TESTS, isolate=False, seccomp=False)
    assert r.passed and r.isolation["namespaces"] == "off" and r.isolation["seccomp"] == "off"
    assert not r.isolated
    monkeypatch.setattr(sandbox, "isolation_available", lambda: "unavailable: probe")
    monkeypatch.delenv(sandbox.POLICY_ENV, raising=False)                     # the default policy: required
    r = run_sandboxed("def add(a, b):\n    return a + b\n", ADD_TESTS, isolate=True)
    assert r.status == "sandbox_error" and not r.passed and "unavailable: probe" in r.stderr
    r = run_sandboxed("def add(a, b):\n    return a + b\n", ADD_TESTS)     # fail closed (issue 66)
    assert r.status == "sandbox_error" and not r.passed and "unavailable: probe" in r.stderr
    monkeypatch.setenv(sandbox.POLICY_ENV, "off")                              # the explicit opt-out
    r = run_sandboxed("def add(a, b):\n    return a + b\n", ADD_TESTS)
    assert r.passed and r.isolation["namespaces"] == "unavailable: probe" and not r.isolated


# ----------------------------------------------------------------------------- escapes (namespaced)

FORK_EXEC = (
    "import _posixsubprocess, os\n"
    "def spawn(argv, setsid=False):\n"
    "    r, w = os.pipe()\n"
    "    pid = _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None,\n"
    "        None, -1, -1, -1, -1, -1, -1, r, w, False, setsid, -1, None, None, None, -1, None, False)\n"
    "    os.close(w)\n"
    "    err = os.read(r, 100)\n"
    "    os.close(r)\n"
    "    return pid, err\n"
)


def test_fork_exec_children_are_confined_and_die_with_the_run(tmp_path, backend):
    secret = tmp_path / "host_secret.txt"
    secret.write_text("host-secret-value")
    outside = tmp_path / "written_from_sandbox"
    marker = f"{os.getpid() % 1000}.{time.monotonic_ns() % 100000:05d}"
    shell = (f"id -u; cat {secret} /root/.bashrc /etc/hostname; ls /root /home /etc; "
             f"echo x > {outside}; echo x > /usr/pwned; echo x > /box/pwned; echo x > /pwned; "
             f"echo ok > /work/scratch && cat /work/scratch; echo done")
    code = FORK_EXEC + (
        f"pid, err = spawn(['/bin/sh', '-c', {shell!r}])\n"
        "print('spawn', pid > 0, err)\n"
        "os.waitpid(pid, 0)\n"
        f"spawn(['/bin/sleep', '{marker}'], setsid=True)\n"      # a setsid child that would outlive the run
        "def add(a, b):\n    return a + b\n")
    r = run_sandboxed(code, ADD_TESTS, _python_guard=False)
    assert r.passed and r.backend == backend, r     # the escapes are harmless: the correct solution passes
    out = r.stdout + r.stderr
    assert "spawn True" in out and "done" in out and "\nok\n" in out, out
    assert "host-secret-value" not in out
    assert not outside.exists() and not os.path.exists("/usr/pwned")
    assert out.count("Read-only file system") + out.count("No such file or directory") >= 4, out
    uid = int(r.stdout.split("\n")[0])
    assert uid >= 200000, r.stdout                         # not root
    time.sleep(0.2)
    alive = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        alive.append(p)
            except OSError:
                pass
    assert not alive, f"sandbox children outlived the run: {alive}"


def test_seccomp_layer_refuses_inet_sockets(backend):
    code = "import _socket\ns = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\nprint('socket-made')\n"
    r = run_sandboxed(code, "", _python_guard=False)
    if r.isolation["seccomp"] != "on":
        pytest.skip(f"seccomp: {r.isolation['seccomp']}")
    assert r.status == "error" and "PermissionError" in r.stderr and "socket-made" not in r.stdout, r
    r = run_sandboxed(code, "", _python_guard=False, seccomp=False)   # control: the layer is what refused it
    assert r.passed and "socket-made" in r.stdout and r.isolation["seccomp"] == "off", r


def test_scratch_is_bounded_and_is_the_only_writable_place(backend):
    code = ("import os\nassert os.getcwd() == '/work'\nopen('/tmp/a', 'w').write('x')\n"
            "with open('/work/big', 'wb') as f:\n    f.write(b'x' * (3 << 20))\n")
    r = run_sandboxed(code, "", scratch_mb=2, max_output_bytes=4 << 20)
    assert r.status == "error" and "No space left on device" in r.stderr, r
    r = run_sandboxed(code, "", scratch_mb=8, max_output_bytes=4 << 20)
    assert r.passed, r


def test_shadowed_builtins_do_not_reach_the_tests():
    """A solution that defines ``abs`` / ``len`` / ``isinstance`` / ``__builtins__`` next to a wrong answer."""
    tail = ("def abs(x):\n    return 0\ndef len(x):\n    return 1\ndef isinstance(a, b):\n    return True\n"
            "__builtins__ = {}\n")
    tests = ("assert abs(add(2, 2) - 4) < 1e-9\nassert len([add(1, 1), 0]) == 2\n"
             "assert isinstance(add(1, 1), int)\n")
    r = run_sandboxed("def add(a, b):\n    return str(a - b)\n" + tail, tests)
    assert r.status == "failed", r
    r = run_sandboxed("def add(a, b):\n    return a + b\n" + tail, tests)     # control
    assert r.passed, r


@pytest.mark.parametrize("body", [
    "    return [0] * 10 ** 7",                                   # over the reply budget
    "    x = []\n    for _ in range(10 ** 5):\n        x = [x]\n    return x",     # nested past any depth limit
    ("    import os\n    for fd in range(3, 64):\n        try:\n            os.write(fd, b'[[[[' * 100000 + b'\\n')\n"
    "        except OSError:\n            pass\n    return a + b"),                # garbage on the channel
    ("    import os\n    for fd in range(64):\n        try:\n            os.close(fd)\n        except OSError:\n"
    "            pass\n    return a + b"),                        # closes its own channel
])
def test_hostile_replies_are_not_a_pass_and_do_not_hang(body):
    t0 = time.monotonic()
    r = run_sandboxed("def add(a, b):\n" + body + "\n", ADD_TESTS, timeout_s=5.0)
    assert not r.passed and r.status in ("failed", "error", "memory"), r
    assert time.monotonic() - t0 < 5.0
