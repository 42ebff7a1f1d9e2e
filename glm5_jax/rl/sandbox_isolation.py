"""The sandbox's OS isolation, host side: which backend builds each child's namespaces and file system.

Two backends build the same thing from one mount plan (:func:`mount_plan`):

* ``bwrap``: Debian's ``bubblewrap`` (when installed and its probe passes): ``--unshare-pid/-ipc/-uts``
  (and ``-net``), the plan as ``--ro-bind`` / ``--dev-bind`` / ``--symlink`` / ``--size --tmpfs``, the
  root remounted read-only, ``--die-with-parent``; its pid 1 reaps and reports the child's status.
* ``unshare``: util-linux ``unshare --mount --pid --ipc --uts --fork --kill-child`` (and ``--net``) runs
  ``sandbox_nsinit.py`` as pid 1, which builds the plan with ``mount`` on a tmpfs root, remounts it
  read-only and runs the child through ``chroot``.

Either way the child itself starts through ``setpriv`` (:func:`drop_privileges`): a fresh uid / gid, no
supplementary groups, every capability dropped (bounding set too), ``no_new_privs``. Both need root or
CAP_SYS_ADMIN (bwrap is not setuid on Debian). Both report a child killed by signal n as status 128 + n.

Which backend: ``$GLM5_SANDBOX_BACKEND`` = ``auto`` (default: bwrap when its probe passes, else unshare),
``bwrap`` or ``unshare`` (force one; the other is never used). Each probe runs once per process: the
real argv with a child that prints its uid; a container where bwrap cannot create namespaces fails it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import tempfile

from glm5_jax.errors import Glm5Error

BACKENDS = ("bwrap", "unshare")
BACKEND_ENV = "GLM5_SANDBOX_BACKEND"
SIGNAL_STATUS_BASE = 128        # both backends exit 128 + n when the child died of signal n
RUNTIME_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
DEVICES = ("null", "zero", "random", "urandom")
NSINIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_nsinit.py")
PROBE_UID = 200000


@dataclasses.dataclass(frozen=True)
class Mount:
    """One entry of the new root: ``ro`` bind (read-only, nosuid, nodev), ``dev`` bind (a device node),
    ``symlink`` (``src`` is the link's target) or ``tmpfs`` of ``size_mb`` (the writable scratch)."""

    kind: str
    src: str
    dest: str
    size_mb: int = 0


def tool(name: str) -> str | None:
    """The system's ``name`` (the sbin / bin directories first, then $PATH), or None."""
    for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name)


def python() -> str:
    return os.path.realpath(sys.executable)


def ro_paths() -> list[str]:
    """Read-only runtime bind mounts beyond /usr and /bin-/lib*: the interpreter's prefixes."""
    paths = []
    for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(python()))):
        p = os.path.realpath(p)
        if p.startswith("/usr/") or p in ("/usr", "/") or ":" in p:
            continue
        if p not in paths:
            paths.append(p)
    return paths


SCRATCH = "/work"                        # the writable tmpfs; /tmp is a symlink to it
OWN_DESTS = ("/box", SCRATCH, "/tmp", "/dev")   # the plan's own places in the new root


def runtime_dest(p: str) -> str:
    """Where the interpreter prefix ``p`` (a real path of the host) is bound in the child's root so that
    the same path resolves there: at ``p`` itself, except under /tmp (a symlink to the scratch there),
    which lands at the same place under the scratch, mounted on top of it (after it, :func:`mount_plan`).
    A prefix that is one of the plan's own places (/box, /work, /tmp, /dev) or under /box or /dev
    cannot be placed: Glm5Error naming it."""
    if p in OWN_DESTS or p.startswith(("/box/", "/dev/")):
        raise Glm5Error(f"the Python runtime at {p} cannot be bound into the sandbox (/box, /work, /tmp and "
                        "/dev are its own places there): use a Python installed elsewhere")
    return SCRATCH + p[len("/tmp"):] if p.startswith("/tmp/") else p


def mount_plan(box: str, scratch_mb: int) -> list[Mount]:
    """The child's root: the runtime read-only, 4 device nodes, ``box`` read-only at /box, a scratch
    tmpfs /work (also /tmp) as the only writable place. Nothing else of the host (no /proc, /etc, /home).

    The interpreter's own prefixes (a venv, pyenv, conda, anywhere: :func:`ro_paths`) come last, each at
    :func:`runtime_dest`, so one under /tmp or /work is a read-only bind on top of the scratch tmpfs, at
    the path the child's interpreter is started by; mounts apply in this order on both backends."""
    plan, bound = [], []
    for p in RUNTIME_DIRS:
        if os.path.islink(p):
            plan.append(Mount("symlink", os.readlink(p), p))
        elif os.path.isdir(p):
            plan.append(Mount("ro", p, p))
            bound.append(p)
    plan += [Mount("dev", "/dev/" + d, "/dev/" + d) for d in DEVICES]
    plan += [Mount("ro", box, "/box"), Mount("tmpfs", "", SCRATCH, int(scratch_mb)), Mount("symlink", "work", "/tmp")]
    for p in ro_paths():
        if not any(p == b or p.startswith(b + "/") for b in bound):
            plan.append(Mount("ro", p, runtime_dest(p)))
            bound.append(p)
    return plan


def drop_privileges(uid: int) -> list[str]:
    """``setpriv`` prefix: run as ``uid`` / gid ``uid``, no groups, no capabilities, no_new_privs."""
    return [tool("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def bwrap_argv(box: str, uid: int, scratch_mb: int, net: bool) -> list[str]:
    argv = [tool("bwrap") or "bwrap", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent",
            "--new-session"] + (["--unshare-net"] if net else [])
    for m in mount_plan(box, scratch_mb):
        if m.kind == "tmpfs":          # bwrap cannot chown a tmpfs: world-writable, the child is its only user
            argv += ["--size", str(m.size_mb << 20), "--perms", "0777", "--tmpfs", m.dest]
        else:
            argv += [{"ro": "--ro-bind", "dev": "--dev-bind", "symlink": "--symlink"}[m.kind], m.src, m.dest]
    return argv + ["--remount-ro", "/", "--chdir", "/"] + drop_privileges(uid)


def unshare_argv(root: str, box: str, uid: int, scratch_mb: int, net: bool) -> list[str]:
    """``unshare`` + sandbox_nsinit.py (pid 1, builds the plan under ``root``); the child's argv follows."""
    import json
    flags = ["--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"] + (["--net"] if net else [])
    cfg = {"root": root, "uid": int(uid), "plan": [dataclasses.astuple(m) for m in mount_plan(box, scratch_mb)],
           "mount": tool("mount"), "chroot": tool("chroot"), "drop": drop_privileges(uid)}
    return [tool("unshare") or "unshare"] + flags + ["--", python(), "-I", "-S", "-B", NSINIT, json.dumps(cfg)]


def namespaced_argv(backend: str, workdir: str, box: str, uid: int, scratch_mb: int, net: bool) -> list[str]:
    """The prefix that runs a child (its argv follows) in new namespaces on ``backend``'s root."""
    if backend == "bwrap":
        return bwrap_argv(box, uid, scratch_mb, net)
    root = os.path.join(workdir, "root")
    os.makedirs(root)
    return unshare_argv(root, box, uid, scratch_mb, net)


def exit_status(rc: int | None, namespaced: bool) -> int | None:
    """The child's status as subprocess reports it (negative = signal); the backends report 128 + n."""
    if rc is not None and namespaced and SIGNAL_STATUS_BASE < rc < SIGNAL_STATUS_BASE + 65:
        return -(rc - SIGNAL_STATUS_BASE)
    return rc


def requested_backend() -> str:
    """``$GLM5_SANDBOX_BACKEND`` (``auto`` when unset)."""
    v = os.environ.get(BACKEND_ENV, "auto").strip() or "auto"
    if v not in ("auto",) + BACKENDS:
        raise Glm5Error(f"{BACKEND_ENV}={v!r} is not a sandbox backend: use auto, bwrap or unshare")
    return v


@functools.cache
def probe(backend: str) -> str:
    """"on" when ``backend`` runs a child in namespaces on the read-only root as a fresh uid, else why not."""
    need = {"bwrap": ("bwrap", "setpriv"), "unshare": ("unshare", "chroot", "setpriv", "mount")}[backend]
    missing = [t for t in need if tool(t) is None]
    if missing:
        pkg = "bubblewrap" if backend == "bwrap" else "util-linux / coreutils"
        return f"unavailable: {', '.join(missing)} not found ({pkg})"
    work = tempfile.mkdtemp(prefix="glm5_sbxprobe_")
    box = os.path.join(work, "box")
    os.makedirs(box)
    try:
        argv = namespaced_argv(backend, work, box, PROBE_UID, 1, True) + [
            python(), "-I", "-S", "-c", "import os; print(os.getuid())"]
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError, Glm5Error) as e:
        return f"unavailable: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if r.returncode != 0 or r.stdout.strip() != str(PROBE_UID).encode():
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return f"unavailable: {backend} namespace setup failed (" + (err[-1] if err else f"rc {r.returncode}")[:200] + ")"
    return "on"


def isolation_backend() -> tuple[str | None, str]:
    """(backend, "on") for the backend in use, or (None, "unavailable: <why>")."""
    want = requested_backend()
    states = []
    for backend in (BACKENDS if want == "auto" else (want,)):
        state = probe(backend)
        if state == "on":
            return backend, "on"
        states.append(state)
    return None, "; ".join(states)


def isolation_available() -> str:
    """"on" when a backend's namespaces + read-only root + uid drop work here, else the reason none does."""
    return isolation_backend()[1]


@functools.cache
def netns_available() -> bool:
    """True when ``unshare -n`` can create a network namespace here (the network layer without the others)."""
    exe = tool("unshare")
    if exe is None:
        return False
    try:
        r = subprocess.run([exe, "-n", "--", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0
