"""Run untrusted model-written Python against unit tests; the verdict is decided outside its process.

Two processes per run, each sandboxed on its own, both running the child program
(``glm5_jax/rl/sandbox_child/``, copied into the run's box and executed by an isolated interpreter):
the **solution process** executes the solution and then only answers requests in plain data; the
**judge process** executes the tests against proxies of the solution's names and writes the verdict
on a pipe only it holds. So the solution cannot reach the verdict: it never sees the tests, the
expected values or the judge's memory (another process, another pid namespace, another uid); a frame
walk or a patched builtin only changes its own process; an early exit ends the conversation
(``error``); an object whose ``__eq__`` says True to everything is a handle, never equal to a plain value.

Isolation of each child (``isolation`` in the result says which layers held, :data:`LAYERS`; a layer
that is not available is reported, never skipped silently; ``isolate=True`` refuses to run without it):
``namespaces`` / ``filesystem`` / ``uid`` (glm5_jax.rl.sandbox_isolation: bubblewrap when installed and
working, else util-linux ``unshare``; a read-only root of the runtime, the box at /box, a tmpfs scratch
/work; a fresh uid with no capabilities), ``network`` (a network namespace with only a down loopback),
``seccomp`` and ``rlimits`` (sandbox_child/limits.py), ``python_guard`` (an audit hook in the solution
process, sandbox_child/solution.py), and the wall clock (``timeout_s``, then SIGKILL to both process
groups and with them both pid namespaces). Fail closed: when no backend works here (not root, no
CAP_SYS_ADMIN, no ``unshare``), a run is ``sandbox_error`` (never ``passed``) and a run's start
(:func:`require_isolation`, ``rl.sandbox_isolation``) refuses with one line naming the fix. Only an
explicit opt-out runs without namespaces: ``isolate=False``, or the policy "off" (``$GLM5_SANDBOX_ISOLATION``,
``rl.sandbox_isolation=off``, logged loudly); the two processes then still run apart with rlimits, the
Python guard and process-group kills, and the solution can read what the parent's user can. docs/rl.md
has the layer table.

Statuses (:data:`STATUSES`): ``passed`` | ``failed`` (a test raised) | ``error`` (the solution raised while
loading, does not compile, or exited / died mid-run) | ``timeout`` (wall clock or CPU limit) | ``memory``
(MemoryError or RLIMIT_AS) | ``network_blocked`` | ``output_limit`` (RLIMIT_FSIZE) | ``killed`` (other
signal) | ``sandbox_error`` (could not start, or a required isolation layer is unavailable).

Test programs are ordinary Python (asserts, ``test_*`` functions, loops, try/except, helpers). What a
test can do with a solution object: call it, read attributes, ``len`` / ``iter`` / ``in`` / ``[]`` /
``str`` / ``repr`` / ``bool`` / ``int`` / ``float`` / ``index`` / ``isinstance(x, SolutionClass)``, and
compare or combine it with another solution object; arithmetic or ordering with a plain value raises
TypeError (return plain values). Lists, dicts and sets passed as arguments are written back after the
call. A solution name that shadows a builtin or a dunder is not visible to the tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time

from glm5_jax.errors import Glm5Error
from glm5_jax.rl.sandbox_child import Exit
from glm5_jax.rl.sandbox_isolation import (
    exit_status,
    isolation_available,
    isolation_backend,
    namespaced_argv,
    netns_available,
    python,
    tool,
)

__all__ = [
    "LAYERS",
    "STATUSES",
    "SandboxResult",
    "classify",
    "isolation_available",
    "isolation_policy",
    "require_isolation",
    "require_isolation_for",
    "netns_available",
    "run_sandboxed",
]

STATUSES = ("passed", "failed", "error", "timeout", "memory", "network_blocked", "output_limit", "killed",
            "sandbox_error")
LAYERS = ("namespaces", "filesystem", "uid", "network", "seccomp", "rlimits", "python_guard")
CHILD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child")
MAX_VERDICT = 1 << 16
ROLES = ("solution", "judge")
POLICY_ENV = "GLM5_SANDBOX_ISOLATION"     # "required" (default) | "off": the process's (and its children's) policy
POLICIES = ("required", "off")
FIX = ("run as root or with CAP_SYS_ADMIN, with util-linux unshare, mount, chroot and setpriv installed, or "
       "install bubblewrap (apt-get install bubblewrap)")


def isolation_policy() -> str:
    """``$GLM5_SANDBOX_ISOLATION``: "required" (default: a run without namespaces is a ``sandbox_error``)
    or "off" (the development opt-out, set by :func:`require_isolation`: runs go un-isolated when no backend works)."""
    v = os.environ.get(POLICY_ENV, "required").strip() or "required"
    if v not in POLICIES:
        raise Glm5Error(f"{POLICY_ENV}={v!r} is not a sandbox isolation policy: use required or off")
    return v


def require_isolation(policy: str = "required", *, setting: str = "rl.sandbox_isolation") -> str:
    """A run's start: with ``policy`` "required", Glm5Error (one line: why, and what fixes it) unless a
    namespace backend works here; "off" (or the process's policy already off: ``$GLM5_SANDBOX_ISOLATION``)
    sets the process's policy to off (inherited by child processes) and logs loudly that model-written
    code may run without isolation. Returns the isolation state."""
    if policy not in POLICIES:
        raise Glm5Error(f"{setting}={policy!r} is invalid: use required or off")
    state = isolation_available()
    if policy == "off" or isolation_policy() == "off":
        setting = setting if policy == "off" else POLICY_ENV
        os.environ[POLICY_ENV] = "off"
        if state != "on":
            logging.getLogger(__name__).warning(
                "%s=off: MODEL-WRITTEN CODE RUNS WITHOUT ISOLATION (it can read and write what this user can): %s",
                setting, state)
        return state
    if state != "on":
        raise Glm5Error(f"model-written code runs only in the sandbox's namespaces and none work here ({state}); "
                        f"to fix: {FIX}; or set {setting}=off (development only: the code then runs un-isolated)")
    return state


def require_isolation_for(cfg, *, path: str = "") -> list[str]:
    """:func:`require_isolation` for every ``sandbox_isolation`` field in the (nested dataclass) config
    ``cfg``: the check a run makes before anything else. Returns the settings checked."""
    checked = []
    if not dataclasses.is_dataclass(cfg):
        return checked
    if hasattr(cfg, "sandbox_isolation"):
        name = (path + "." if path else "") + "sandbox_isolation"
        require_isolation(cfg.sandbox_isolation, setting=name)
        checked.append(name)
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name, None)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            checked += require_isolation_for(v, path=(path + "." if path else "") + f.name)
    return checked


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str
    stdout: str
    stderr: str
    returncode: int | None = None           # the solution process's exit status (signal: negative)
    wall_s: float = 0.0
    isolation: dict[str, str] = dataclasses.field(default_factory=dict)   # layer -> "on" | "off" | "unavailable: ..."
    backend: str = ""                          # "bwrap" | "unshare" when namespaced, else ""

    @property
    def isolated(self) -> bool:
        """True when every isolation layer held for this run."""
        return bool(self.isolation) and all(v == "on" for v in self.isolation.values())


@dataclasses.dataclass
class _Plan:
    """What a run uses: namespaces on ``backend`` (None: none), a network namespace, and the layer report."""

    backend: str | None
    net: bool
    isolation: dict[str, str]


def _check_text(code: str, tests: str) -> None:
    for name, v in (("code", code), ("tests", tests)):
        if not isinstance(v, str):
            raise TypeError(f"{name} must be a str, not {type(v).__name__}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise Glm5Error(f"{name} is not valid text: {e.reason} at position {e.start}") from None


def plan_isolation(isolate: bool | None, netns: bool | None, seccomp: bool,
                   python_guard: bool) -> _Plan | SandboxResult:
    """Which layers a run gets, or the ``sandbox_error`` result when a required one is unavailable.
    Namespaces are required unless ``isolate`` is False or the process's policy is "off"
    (:func:`isolation_policy`); with neither, a run that cannot have them never starts (fail closed)."""
    iso_state = isolation_available()
    if isolate is None:
        use_ns = iso_state == "on" or isolation_policy() == "required"
    else:
        use_ns = bool(isolate)
    if use_ns and iso_state != "on":
        return SandboxResult(False, "sandbox_error", "",
                             f"isolation required but {iso_state}; to fix: {FIX} (or set {POLICY_ENV}=off / "
                             "rl.sandbox_isolation=off for development: the code then runs un-isolated)",
                             isolation={"namespaces": iso_state})
    net_ok = netns_available()
    use_net = net_ok if netns is None else bool(netns)
    if use_net and not net_ok:
        return SandboxResult(False, "sandbox_error", "", "network namespace unavailable",
                             isolation={"network": "unavailable: unshare -n failed"})
    ns_state = "on" if use_ns else ("off" if isolate is False else iso_state)
    isolation = {
        "namespaces": ns_state, "filesystem": ns_state, "uid": ns_state,
        "network": "on" if use_net else ("off" if netns is False else "unavailable: unshare -n failed"),
        "seccomp": "off" if not seccomp else "unknown",
        "rlimits": "on",
        "python_guard": "on" if python_guard else "off",
    }
    return _Plan(isolation_backend()[0] if use_ns else None, use_net, isolation)


def _write_box(box: str, files: dict[str, str]) -> None:
    """The run's read-only files for one child: its input (solution.py or tests.py) and the child program."""
    os.makedirs(box)
    for fname, text in files.items():
        with open(os.path.join(box, fname), "w", encoding="utf-8") as f:
            f.write(text)
    shutil.copytree(CHILD_DIR, os.path.join(box, "sandbox_child"), ignore=shutil.ignore_patterns("__pycache__"))
    for d, _, fs in os.walk(box):
        os.chmod(d, 0o755)
        for fname in fs:
            os.chmod(os.path.join(d, fname), 0o644)


def _spawn(plan: _Plan, tmp: str, role: str, uid: int, cfg: dict, fds: tuple[int, ...], *, scratch_mb: int,
           allow_site: bool, out, err) -> subprocess.Popen:
    """Start one child: in ``plan.backend``'s namespaces as ``uid`` when namespaced, else a plain process
    (in a network namespace alone when ``plan.net``)."""
    host_box = os.path.join(tmp, role + "_box")
    box = "/box" if plan.backend else host_box
    child = [python(), "-I", "-B"] + ([] if allow_site else ["-S"]) + [
        os.path.join(box, "sandbox_child"), json.dumps(dict(cfg, box=box))]
    scratch = os.path.join(tmp, role + "_work")
    os.makedirs(scratch)
    if plan.backend:
        workdir = os.path.join(tmp, role + "_ns")
        os.makedirs(workdir)
        argv = namespaced_argv(plan.backend, workdir, host_box, uid, scratch_mb, plan.net) + child
        home = "/work"
    else:
        argv = ([tool("unshare"), "-n", "--"] if plan.net else []) + child
        home = scratch
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
    return subprocess.Popen(argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                            start_new_session=True, close_fds=True, pass_fds=fds)


def _await_verdict(v_r: int, deadline: float) -> tuple[bytes, bool]:
    """The judge's verdict bytes (bounded), read until it closes its end; and whether the clock ran out."""
    raw = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return raw, True
        r, _, _ = select.select([v_r], [], [], left)
        if not r:
            return raw, True
        chunk = os.read(v_r, 65536)
        if not chunk:
            return raw, False
        raw += chunk
        if len(raw) > MAX_VERDICT:
            return raw, False


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except OSError:
        pass


def _read(f, limit: int) -> str:
    f.seek(0)
    data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    if len(data) > limit:
        text += "\n...[truncated]"
    return text


def _outputs(outs: list[tuple], limit: int) -> tuple[str, str]:
    """stdout and stderr of both children (solution first), each bounded to ``limit`` bytes."""
    (s_out, s_err), (j_out, j_err) = [(_read(o, limit), _read(e, limit)) for o, e in outs]
    return s_out + j_out, (s_err + "\n" if s_err and j_err else s_err) + j_err


def _parse_verdict(raw: bytes) -> dict:
    try:
        verdict = json.loads(raw.decode("utf-8")) if raw else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return verdict if isinstance(verdict, dict) else {}


def seccomp_state(verdict: dict) -> str:
    """"on" when both children reported the filter installed, else the first other state."""
    states = {str(verdict.get("seccomp", "unknown")), str(verdict.get("peer_seccomp", "unknown"))}
    state = "on" if states == {"on"} else min(states - {"on"})
    return "unknown: the run ended before it was reported" if state == "unknown" else state


def classify(verdict: dict, sol_rc: int | None, judge_rc: int | None, *, timed_out: bool, wall_s: float,
             cpu_s: float, stderr: str) -> str:
    """The run's status from the judge's verdict and both exit statuses (negative = signal)."""
    v = verdict.get("status")
    if timed_out:
        return "timeout"
    if v == "passed" and sol_rc in (Exit.OK, None, -signal.SIGKILL):     # our SIGKILL comes after the verdict
        return "passed"
    if v == "network_blocked" or sol_rc == Exit.NETWORK or verdict.get("net") is True:
        return "network_blocked"
    if v == "memory":
        return "memory"
    if sol_rc == -signal.SIGXCPU:
        return "timeout"        # soft RLIMIT_CPU
    if sol_rc == -signal.SIGXFSZ:
        return "output_limit"
    if sol_rc == -signal.SIGKILL and v != "failed":
        # SIGKILL that is not ours (ours comes after the verdict): the hard RLIMIT_CPU or the OOM killer
        return "memory" if "MemoryError" in stderr else ("timeout" if wall_s >= cpu_s else "killed")
    if sol_rc is not None and sol_rc < 0 and v != "failed":
        return "memory" if "MemoryError" in stderr else "killed"
    if v in ("failed", "error"):
        status = "memory" if v == "error" and sol_rc == Exit.LOAD_MEMORY else v
    elif judge_rc == -signal.SIGXCPU or judge_rc == -signal.SIGKILL and wall_s >= cpu_s:
        return "timeout"        # the tests themselves ran past the CPU limit
    else:
        status = "error"        # the judge died without a verdict
    if status in ("failed", "error") and "[Errno 27] File too large" in stderr:
        return "output_limit"   # Python ignores SIGXFSZ; the write raises instead
    return status


def run_sandboxed(
    code: str,
    tests: str,
    *,
    timeout_s: float = 2.0,
    cpu_s: int = 2,
    memory_mb: int = 256,
    max_output_bytes: int = 64 * 1024,
    netns: bool | None = None,
    isolate: bool | None = None,
    seccomp: bool = True,
    scratch_mb: int = 16,
    allow_site: bool = False,
    _python_guard: bool = True,
) -> SandboxResult:
    """Execute ``code`` in one sandboxed process and ``tests`` (plain asserts, ``test_*`` functions,
    any Python) in another that decides the verdict; see the module docstring.

    ``isolate``: None = namespaces + read-only root + uid drop, required unless the process's policy is
    "off" (:func:`isolation_policy`; then used when available, ``isolation`` says which layers held),
    True = required (``sandbox_error`` when unavailable), False = do not use them (explicit opt-out).
    ``netns``: None = a network namespace when available, True = require it, False = host network
    namespace (Python-level blocking only). ``seccomp``: install the syscall filter when libseccomp is
    present. ``scratch_mb``: size of the writable /work tmpfs (namespaced runs).
    ``_python_guard=False`` disables the audit hook (tests of the OS layers only).
    """
    _check_text(code, tests)
    plan = plan_isolation(isolate, netns, seccomp, _python_guard)
    if isinstance(plan, SandboxResult):
        return plan
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="glm5_sandbox_")
    procs, pipes, outs = [], [], []
    try:
        _write_box(os.path.join(tmp, "solution_box"), {"solution.py": code})
        _write_box(os.path.join(tmp, "judge_box"), {"tests.py": tests})
        # pipes: judge -> solution (requests), solution -> judge (replies), judge -> parent (verdict)
        j2s_r, j2s_w = os.pipe()
        s2j_r, s2j_w = os.pipe()
        v_r, v_w = os.pipe()
        pipes = [j2s_r, j2s_w, s2j_r, s2j_w, v_r, v_w]
        base_uid = 200000 + secrets.randbelow(1 << 20) * 2
        limits = {"cpu_s": int(cpu_s), "mem_b": int(memory_mb) << 20, "fsize_b": int(max_output_bytes) * 4,
                  "seccomp": bool(seccomp), "python_guard": bool(_python_guard)}
        ends = {"solution": {"rfd": j2s_r, "wfd": s2j_w}, "judge": {"rfd": s2j_r, "wfd": j2s_w, "vfd": v_w}}
        for i, role in enumerate(ROLES):
            outs.append((tempfile.TemporaryFile(), tempfile.TemporaryFile()))  # noqa: SIM115  (closed in finally)
            try:
                procs.append(_spawn(plan, tmp, role, base_uid + i, dict(limits, role=role, **ends[role]),
                                    tuple(ends[role].values()), scratch_mb=scratch_mb, allow_site=allow_site,
                                    out=outs[-1][0], err=outs[-1][1]))
            except OSError as e:
                return SandboxResult(False, "sandbox_error", "", f"could not start: {e}",
                                     wall_s=time.monotonic() - t0, isolation=plan.isolation,
                                     backend=plan.backend or "")
        for fd in pipes[:-2] + [v_w]:
            os.close(fd)
        pipes = [v_r]
        sol, judge = procs
        deadline = t0 + timeout_s
        verdict_raw, timed_out = _await_verdict(v_r, deadline)
        if not timed_out:
            # the solution exits right after the judge's "bye"; give it a moment, then kill
            try:
                sol.wait(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            _kill_group(p)
        for p in procs:
            p.wait()
        ns = plan.backend is not None
        sol_rc, judge_rc = exit_status(sol.returncode, ns), exit_status(judge.returncode, ns)
        stdout, stderr = _outputs(outs, max_output_bytes)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
                p.wait()
        for fd in pipes:
            try:
                os.close(fd)
            except OSError:
                pass
        for out, err in outs:
            out.close()
            err.close()
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - t0
    verdict = _parse_verdict(verdict_raw)
    if seccomp:
        plan.isolation["seccomp"] = seccomp_state(verdict)
    status = classify(verdict, sol_rc, judge_rc, timed_out=timed_out, wall_s=wall, cpu_s=cpu_s, stderr=stderr)
    return SandboxResult(status == "passed", status, stdout, stderr, sol_rc, wall, plan.isolation,
                         plan.backend or "")
