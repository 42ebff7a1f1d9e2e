"""Run untrusted model-written Python against unit tests in a sandboxed subprocess.

Layers (each one holds when the sandbox runs as root):

1. **Fresh temporary directory** as cwd and HOME, removed afterwards; minimal environment;
   the interpreter runs isolated (``-I``: no PYTHONPATH / user site / cwd on sys.path) and
   without site-packages (``-S``) unless ``allow_site=True``.
2. **Resource limits** set by the child on itself with the ``resource`` module before any
   untrusted code runs: RLIMIT_CPU (soft ``cpu_s``, hard ``cpu_s + 1``), RLIMIT_AS
   (``memory_mb``), RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0 and RLIMIT_NPROC (the last
   one is not enforced for root). They are set in the child rather than through
   ``preexec_fn`` because ``preexec_fn`` is unsafe in a multi-threaded parent (a JAX trainer
   is one); without it ``subprocess`` can use vfork/posix_spawn.
3. **No network, OS level**: when ``unshare -n`` works on this machine (root, or user
   namespaces allowed) the child runs in a fresh network namespace whose only interface is a
   down loopback, so nothing at all is reachable, including the parent's 127.0.0.1.
4. **No network, Python level**: an audit hook in the child refuses socket creation /
   connect / bind / DNS look-ups, process spawning (``os.system``, ``subprocess``, ``fork``,
   ``exec``) and ``ctypes``. Any network attempt marks the run ``network_blocked`` (not
   passed), even if the code catches the exception.
5. **Wall-clock kill**: the child is started in its own session / process group; on timeout
   the whole group gets SIGKILL.
6. **Result integrity**: success is reported by the runner printing a per-run random nonce
   (received on stdin and kept out of the solution's namespace) after all tests ran; an early
   ``sys.exit(0)`` / ``os._exit(0)`` from the solution therefore is not a pass.

Statuses: ``passed`` | ``failed`` (a test raised) | ``error`` (the solution itself raised or
does not compile) | ``timeout`` (wall clock or CPU limit) | ``memory`` (MemoryError or
RLIMIT_AS) | ``network_blocked`` | ``output_limit`` (RLIMIT_FSIZE) | ``killed`` (other
signal) | ``sandbox_error`` (could not start).

This is a best-effort sandbox for RL reward computation, not a security boundary against a
determined adversary (no seccomp, no mount/pid namespace, root inside stays root).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["SandboxResult", "run_sandboxed", "netns_available", "STATUSES"]

STATUSES = (
    "passed",
    "failed",
    "error",
    "timeout",
    "memory",
    "network_blocked",
    "output_limit",
    "killed",
    "sandbox_error",
)

_RC_FAILED = 11
_RC_ERROR = 12
_RC_MEMORY = 13
_RC_NETWORK = 14
_RC_SETUP = 15


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str
    stdout: str
    stderr: str
    returncode: int | None = None
    wall_s: float = 0.0


# The runner is written into the temporary directory. Everything that must stay out of the
# solution's reach lives in function locals (the nonce) or is installed before user code.
_RUNNER = r'''
import sys, resource

def _main():
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    cpu_s, mem_b, fsize_b, python_guard = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    def lim(which, soft, hard=None):
        try:
            resource.setrlimit(which, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass
    lim(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)
    lim(resource.RLIMIT_AS, mem_b)
    lim(resource.RLIMIT_FSIZE, fsize_b)
    lim(resource.RLIMIT_CORE, 0)
    lim(resource.RLIMIT_NOFILE, 64)
    if hasattr(resource, "RLIMIT_NPROC"):
        lim(resource.RLIMIT_NPROC, 16)

    state = {"net": False}
    if python_guard:
        NET = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
               "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto",
               "socket.sendmsg", "socket.getnameinfo")
        PROC = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn",
                "os.fork", "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
                "ctypes.cdata", "ctypes.call_function", "os.kill", "os.killpg",
                "sys.addaudithook")
        def hook(event, args):
            if event in NET:
                state["net"] = True
                raise PermissionError("sandbox: network access is blocked (" + event + ")")
            if event in PROC:
                raise PermissionError("sandbox: " + event + " is blocked")
        sys.addaudithook(hook)
        # second Python-level layer: a socket module whose constructors refuse
        import socket as _s
        def _refuse(*a, **k):
            state["net"] = True
            raise PermissionError("sandbox: network access is blocked")
        for name in ("socket", "create_connection", "create_server", "socketpair",
                     "getaddrinfo", "gethostbyname", "fromfd"):
            if hasattr(_s, name):
                setattr(_s, name, _refuse)

    code = open("solution.py", encoding="utf-8").read()
    tests = open("tests.py", encoding="utf-8").read()
    import traceback
    ns = {"__name__": "solution", "__builtins__": __builtins__}

    def finish(rc):
        sys.stdout.flush()
        sys.stderr.flush()
        if state["net"]:
            rc = 14
        if rc == 0:
            sys.stdout.write("\n" + nonce + "\n")
            sys.stdout.flush()
        import os
        os._exit(rc)

    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except MemoryError:
        finish(13)
    except BaseException:
        traceback.print_exc()
        finish(12)
    try:
        exec(compile(tests, "tests.py", "exec"), ns)
        for key in sorted(k for k in list(ns) if k.startswith("test_")):
            if callable(ns[key]):
                ns[key]()
    except MemoryError:
        finish(13)
    except BaseException:
        traceback.print_exc()
        finish(11)
    finish(0)

_main()
'''


@functools.lru_cache(maxsize=None)
def netns_available() -> bool:
    """True when ``unshare -n`` can create a network namespace here."""
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        r = subprocess.run(
            [exe, "-n", "--", "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _read(f, limit: int) -> str:
    f.seek(0)
    data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    if len(data) > limit:
        text += "\n...[truncated]"
    return text


def run_sandboxed(
    code: str,
    tests: str,
    *,
    timeout_s: float = 2.0,
    cpu_s: int = 2,
    memory_mb: int = 256,
    max_output_bytes: int = 64 * 1024,
    netns: bool | None = None,
    allow_site: bool = False,
    _python_guard: bool = True,
) -> SandboxResult:
    """Execute ``code`` then ``tests`` (plain asserts and/or ``test_*`` functions) sandboxed.

    ``netns``: None = use a network namespace when available, True = require it (status
    ``sandbox_error`` when unavailable), False = Python-level blocking only.
    ``_python_guard=False`` disables the in-child audit hook (tests of the OS layer only).
    """
    use_netns = netns_available() if netns is None else bool(netns)
    if use_netns and not netns_available():
        return SandboxResult(False, "sandbox_error", "", "network namespace unavailable")
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="glm5_sandbox_")
    t0 = time.monotonic()
    try:
        with open(os.path.join(workdir, "solution.py"), "w", encoding="utf-8") as f:
            f.write(code)
        with open(os.path.join(workdir, "tests.py"), "w", encoding="utf-8") as f:
            f.write(tests)
        with open(os.path.join(workdir, "_runner.py"), "w", encoding="utf-8") as f:
            f.write(_RUNNER)
        py = [sys.executable, "-I"] + ([] if allow_site else ["-S"])
        argv = py + [
            "_runner.py",
            str(int(cpu_s)),
            str(int(memory_mb) * 1024 * 1024),
            str(int(max_output_bytes) * 4),
            "1" if _python_guard else "0",
        ]
        if use_netns:
            argv = [shutil.which("unshare"), "-n", "--"] + argv
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "TMPDIR": workdir,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    close_fds=True,
                )
            except OSError as e:
                return SandboxResult(False, "sandbox_error", "", f"could not start: {e}")
            timed_out = False
            try:
                proc.communicate(input=(nonce + "\n").encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # Kill the whole group: the child and anything it managed to spawn.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            rc = proc.returncode
            stdout = _read(out, max_output_bytes)
            stderr = _read(err, max_output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - t0

    ok_marker = "\n" + nonce + "\n"
    nonce_seen = stdout.endswith(ok_marker)
    if nonce_seen:
        stdout = stdout[: -len(ok_marker)]
    if timed_out:
        status = "timeout"
    elif rc == 0 and nonce_seen:
        status = "passed"
    elif rc == _RC_FAILED:
        status = "failed"
    elif rc == _RC_ERROR:
        status = "error"
    elif rc == _RC_MEMORY:
        status = "memory"
    elif rc == _RC_NETWORK:
        status = "network_blocked"
    elif rc == -signal.SIGXCPU:
        status = "timeout"  # soft RLIMIT_CPU
    elif rc == -signal.SIGKILL and "MemoryError" not in stderr:
        # SIGKILL that is not ours: the hard RLIMIT_CPU, or the kernel OOM killer.
        status = "timeout" if wall >= cpu_s else "killed"
    elif rc == -signal.SIGXFSZ:
        status = "output_limit"
    elif rc is not None and rc < 0 and "MemoryError" in stderr:
        status = "memory"
    elif rc == 0:
        status = "error"  # exited early (sys.exit(0) / os._exit(0)) before the tests finished
    elif rc is not None and rc < 0:
        status = "killed"
    else:
        status = "memory" if "MemoryError" in stderr else "error"
    if status in ("failed", "error") and "[Errno 27] File too large" in stderr:
        status = "output_limit"  # Python ignores SIGXFSZ; the write raises instead
    return SandboxResult(status == "passed", status, stdout, stderr, rc, wall)
