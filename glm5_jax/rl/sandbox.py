"""Run untrusted model-written Python against unit tests; the verdict is decided outside its process.

Two processes per run, each sandboxed on its own:

* the **solution process** executes the solution and then only answers requests: "call this
  function of yours with these arguments", "give me this attribute". Its answers are serialised as
  *plain data* (None / bool / int / float / complex / str / bytes and lists, tuples, dicts, sets of
  those, checked with ``type(x) is ...``, so a subclass of ``int`` is not an ``int``); anything
  else stays in the solution process and is handed out as an opaque handle.
* the **judge process** executes the tests. Every name the solution defined is bound there to a
  proxy: calling it sends a request to the solution process and decodes the answer into genuine
  plain Python values, built by the judge. Asserts therefore compare values the judge built
  itself: an object whose ``__eq__`` says True to everything is a handle, and a handle never equals
  a plain value (handle vs handle comparisons go to the solution: both sides are its own objects).
  The judge writes the verdict on a pipe only it holds; the parent reads it there.

So the solution cannot reach the verdict: it never sees the tests, the expected values or the
judge's memory (another process, another pid namespace, another uid); a frame walk or a patched
builtin only changes the solution's own process; an early ``sys.exit(0)`` / ``os._exit(0)`` ends
the conversation (the judge sees EOF: ``error``), and a forged "pass" message would have to come
from the judge, which runs no solution code.

Isolation of each child (``isolation`` in the result says which layers held; a layer that is not
available is reported, never skipped silently; ``isolate=True`` refuses to run without it):

1. ``namespaces``: ``unshare --mount --pid --net --ipc --uts --fork`` (util-linux, needs root or
   CAP_SYS_ADMIN). The pid namespace's init is a root shell that waits for the child; when the run
   ends the parent kills it and the kernel kills everything else in the namespace, ``setsid`` /
   double-forked children included.
2. ``filesystem``: a new root (tmpfs, read-only) holding read-only, nosuid, nodev bind mounts of
   the runtime only (``/usr``, the interpreter's prefix, ``/dev/{null,zero,random,urandom}``), the
   run's own files read-only at ``/box`` and a size-capped tmpfs scratch ``/work`` (also ``/tmp``),
   the only writable place. No ``/proc``, ``/etc``, ``/root``, ``/home`` or host ``/tmp``.
3. ``uid``: the child drops to a fresh unprivileged uid/gid (random in 200000..) with every
   capability dropped (bounding set too) and ``no_new_privs``; the solution and judge get different
   uids.
4. ``network``: the net namespace has only a down loopback: nothing is reachable, including the
   parent's 127.0.0.1 (``netns=False`` leaves the host network namespace; Python-level blocking only).
5. ``seccomp`` (libseccomp via ctypes, when present): ptrace / process_vm_*, mount family, unshare /
   setns / clone with namespace flags, keyctl, bpf, perf_event_open, io_uring, kexec / modules /
   reboot and non-AF_UNIX sockets fail with EPERM (clone3 with ENOSYS so libc falls back to clone).
6. ``rlimits``: RLIMIT_CPU (soft ``cpu_s``, hard ``cpu_s + 1``), RLIMIT_AS (``memory_mb``),
   RLIMIT_FSIZE, RLIMIT_NOFILE, RLIMIT_CORE = 0, RLIMIT_NPROC (enforced: the uid is not root).
7. ``python_guard``: an audit hook in the solution process refuses sockets, DNS, ``os.system``,
   ``subprocess``, fork/exec and ctypes, and marks any network attempt (``network_blocked``, even
   when the exception is caught). It is one layer among several: ``_posixsubprocess.fork_exec``
   gets past it, into the layers above.
8. Wall clock: ``timeout_s`` for the whole run, then SIGKILL to both process groups (and with them
   both pid namespaces).

Without namespaces (not root, a container without CAP_SYS_ADMIN, ``isolate=False``) the two
processes still run apart (the verdict stays out of reach of a frame walk or a lying ``__eq__``),
with rlimits, the Python guard and process-group kills only; ``isolation`` then says
``"unavailable: ..."`` for the missing layers and the solution can read what the parent's user can.

Statuses: ``passed`` | ``failed`` (a test raised) | ``error`` (the solution raised while loading, does
not compile, or exited / died mid-run) | ``timeout`` (wall clock or CPU limit) | ``memory``
(MemoryError or RLIMIT_AS) | ``network_blocked`` | ``output_limit`` (RLIMIT_FSIZE) | ``killed`` (other
signal) | ``sandbox_error`` (could not start, or a required isolation layer is unavailable).

Test programs are ordinary Python (asserts, ``test_*`` functions, loops, try/except, helpers) run in
the judge. What a test can do with a solution object is limited to what keeps the verdict honest:
call it, read attributes, ``len`` / ``iter`` / ``in`` / ``[]`` / ``str`` / ``repr`` / ``bool`` /
``int`` / ``float`` / ``index`` / ``isinstance(x, SolutionClass)``, and compare or combine it with another solution object. Arithmetic
or ordering between a solution object and a plain value raises TypeError (return plain values).
Lists, dicts and sets passed as arguments are written back after the call (in-place mutation works).
Arguments are plain data or solution objects (a test's own function or class cannot be passed). A
solution name that shadows a builtin (``len``, ``abs``, ...) or a dunder is not visible to the tests:
the tests' ``abs(f(x) - y)`` always means the real ``abs`` (so do not name a task's function after a
builtin).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional

__all__ = ["SandboxResult", "run_sandboxed", "netns_available", "isolation_available", "STATUSES",
           "LAYERS"]

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

LAYERS = ("namespaces", "filesystem", "uid", "network", "seccomp", "rlimits", "python_guard")

_RC_NETWORK = 14
_MAX_VERDICT = 1 << 16


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    passed: bool
    status: str
    stdout: str
    stderr: str
    returncode: Optional[int] = None           # the solution process's exit status (signal: negative)
    wall_s: float = 0.0
    isolation: Dict[str, str] = dataclasses.field(default_factory=dict)   # layer -> "on" | "off" | "unavailable: ..."

    @property
    def isolated(self) -> bool:
        """True when every isolation layer held for this run."""
        return bool(self.isolation) and all(v == "on" for v in self.isolation.values())


# ----------------------------------------------------------------------------- child program
# One script, two roles; argv[1] is a JSON config: role ("solution" | "judge"), limits, the box
# directory, rfd / wfd (pipe ends from / to the peer) and, for the judge, vfd (verdict to the parent).
_CHILD = r'''
import sys, os, json, resource

def _limits(cpu_s, mem_b, fsize_b):
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

_DENY = ("ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot",
         "unshare", "setns", "keyctl", "add_key", "request_key", "bpf", "perf_event_open", "kexec_load",
         "kexec_file_load", "reboot", "swapon", "swapoff", "init_module", "finit_module", "delete_module",
         "iopl", "ioperm", "userfaultfd", "open_by_handle_at", "name_to_handle_at", "mount_setattr",
         "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "acct", "settimeofday",
         "clock_settime", "adjtimex", "quotactl", "syslog", "vhangup", "io_uring_setup", "io_uring_enter",
         "io_uring_register", "lookup_dcookie")

def _seccomp():
    """Install the deny-list filter; returns "on" or why not."""
    try:
        import ctypes
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError as e:
        return "unavailable: libseccomp.so.2 not found"
    class Cmp(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(Cmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ALLOW, EPERM, ENOSYS = 0x7fff0000, 0x00050000 | 1, 0x00050000 | 38
    NE, MASKED_EQ = 1, 7
    ctx = lib.seccomp_init(ALLOW)
    if not ctx:
        return "unavailable: seccomp_init failed"
    def add(name, action, cmps=()):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return
        arr = (Cmp * max(1, len(cmps)))(*[Cmp(*c) for c in cmps])
        rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
        if rc != 0:
            raise OSError(-rc, "seccomp_rule_add " + name)
    try:
        for name in _DENY:
            add(name, EPERM)
        add("clone3", ENOSYS)
        for flag in (0x20000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000):
            add("clone", EPERM, [(0, MASKED_EQ, flag, flag)])
        add("socket", EPERM, [(0, NE, 1, 0)])      # only AF_UNIX
        rc = lib.seccomp_load(ctx)
        if rc != 0:
            return "unavailable: seccomp_load failed (%d)" % rc
    except OSError as e:
        return "unavailable: %s" % e
    finally:
        lib.seccomp_release(ctx)
    return "on"

# -- codec: plain data only, exact types; everything else is a handle
_MAX_NODES = 200000
_MAX_DEPTH = 64

def _encode(v, handle, budget, depth=0):
    budget[0] -= 1
    if budget[0] < 0:
        raise OverflowError("sandbox: value too large to return")
    t = type(v)
    if v is None:
        return ["N"]
    if t is bool:
        return ["B", v]
    if t is int:
        return ["I", format(v, "x")]
    if t is float:
        return ["F", v.hex()]
    if t is complex:
        return ["C", v.real.hex(), v.imag.hex()]
    if t is str:
        budget[0] -= len(v) // 64
        return ["S", v]
    if t is bytes:
        budget[0] -= len(v) // 64
        return ["Y", v.hex()]
    if depth < _MAX_DEPTH:
        if t is list:
            return ["L", [_encode(x, handle, budget, depth + 1) for x in v]]
        if t is tuple:
            return ["T", [_encode(x, handle, budget, depth + 1) for x in v]]
        if t is dict:
            return ["D", [[_encode(k, handle, budget, depth + 1), _encode(x, handle, budget, depth + 1)]
                          for k, x in v.items()]]
        if t is set:
            return ["E", [_encode(x, handle, budget, depth + 1) for x in v]]
        if t is frozenset:
            return ["Z", [_encode(x, handle, budget, depth + 1) for x in v]]
    return handle(v)

def _decode(x, handle, depth=0):
    if depth > _MAX_DEPTH + 2:
        raise ValueError("sandbox: value nested too deep")
    tag = x[0]
    if tag == "N":
        return None
    if tag == "B":
        if type(x[1]) is not bool:
            raise ValueError("bad bool")
        return x[1]
    if tag == "I":
        return int(x[1], 16)
    if tag == "F":
        return float.fromhex(x[1])
    if tag == "C":
        return complex(float.fromhex(x[1]), float.fromhex(x[2]))
    if tag == "S":
        if type(x[1]) is not str:
            raise ValueError("bad str")
        return x[1]
    if tag == "Y":
        return bytes.fromhex(x[1])
    if tag in ("L", "T", "E", "Z"):
        items = [_decode(y, handle, depth + 1) for y in x[1]]
        return {"L": list, "T": tuple, "E": set, "Z": frozenset}[tag](items)
    if tag == "D":
        return {_decode(k, handle, depth + 1): _decode(y, handle, depth + 1) for k, y in x[1]}
    if tag == "H":
        return handle(x)
    raise ValueError("bad tag %r" % (tag,))

_MAX_LINE = 32 << 20

class _Chan:
    def __init__(self, rfd, wfd):
        self.r = os.fdopen(rfd, "rb", buffering=1 << 16)
        self.w = os.fdopen(wfd, "wb", buffering=0)
    def send(self, obj):
        self.w.write(json.dumps(obj).encode() + b"\n")
    def recv(self):
        line = self.r.readline(_MAX_LINE)
        if not line or not line.endswith(b"\n"):
            return None
        return json.loads(line)

def _common(cfg):
    sc = _seccomp() if cfg["seccomp"] else "off"
    _limits(cfg["cpu_s"], cfg["mem_b"], cfg["fsize_b"])
    try:
        os.chdir(os.environ.get("HOME", "/"))
    except OSError:
        pass
    return sc

# ----------------------------------------------------------------------------- solution role
def _solution(cfg):
    sc = _common(cfg)
    python_guard = cfg["python_guard"]
    box = cfg["box"]
    chan = _Chan(cfg["rfd"], cfg["wfd"])
    chan.send({"hello": {"seccomp": sc}})      # before any untrusted code runs
    import traceback, builtins, itertools
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
        import socket as _s
        def _refuse(*a, **k):
            state["net"] = True
            raise PermissionError("sandbox: network access is blocked")
        for name in ("socket", "create_connection", "create_server", "socketpair",
                     "getaddrinfo", "gethostbyname", "fromfd"):
            if hasattr(_s, name):
                setattr(_s, name, _refuse)
    handles = {}
    def handle(v):
        hid = len(handles) + 1
        handles[hid] = v
        return ["H", hid, type(v).__name__[:64], callable(v)]
    def resolve(x):
        if x[0] == "H":
            return handles[x[1]]
        raise ValueError("not a handle")
    def enc(v):
        return _encode(v, handle, [_MAX_NODES])
    def exc_name(e):
        for c in type(e).__mro__:
            if getattr(builtins, c.__name__, None) is c:
                return c.__name__
        return "Exception"
    code = open(os.path.join(box, "solution.py"), encoding="utf-8").read()
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), ns)
    except MemoryError:
        chan.send({"load": "memory", "net": state["net"]})
        os._exit(13)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        chan.send({"load": "error", "net": state["net"]})
        os._exit(12)
    names = {}
    for k, v in list(ns.items()):
        if k.startswith("__") or type(v).__name__ == "module":
            continue
        try:
            names[k] = enc(v)
        except Exception:
            names[k] = handle(v)
    sys.stdout.flush()
    chan.send({"load": "ok", "names": names, "net": state["net"]})
    while True:
        req = chan.recv()
        if req is None:
            os._exit(0)
        op = req.get("op")
        if op == "bye":
            sys.stdout.flush()
            sys.stderr.flush()
            chan.send({"bye": True, "net": state["net"]})
            os._exit(_RC_NETWORK if state["net"] else 0)
        try:
            target = resolve(req["target"])
            args = [_decode(a, resolve) for a in req.get("args", [])]
            kwargs = {k: _decode(a, resolve) for k, a in req.get("kwargs", {}).items()}
            attr = req.get("attr")
            if op == "getattr":
                val = getattr(target, attr)
            elif op == "call":
                val = (target if attr is None else getattr(target, attr))(*args, **kwargs)
            elif op == "len":
                val = len(target)
            elif op == "list":
                val = list(itertools.islice(iter(target), 1000001))
                if len(val) > 1000000:
                    raise OverflowError("sandbox: iteration longer than 1000000 items")
            elif op == "bool":
                val = bool(target)
            elif op == "str":
                val = str(target)
            elif op == "repr":
                val = repr(target)
            elif op == "int":
                val = int(target)
            elif op == "float":
                val = float(target)
            elif op == "index":
                val = target.__index__()
            elif op == "getitem":
                val = target[args[0]]
            elif op == "setitem":
                target[args[0]] = args[1]
                val = None
            elif op == "delitem":
                del target[args[0]]
                val = None
            elif op == "contains":
                val = args[0] in target
            elif op == "isinstance":
                val = isinstance(args[0], target)
            elif op == "binop":
                import operator
                val = getattr(operator, attr)(target, args[0])
            else:
                raise ValueError("unknown op")
            out = {"ok": enc(val), "net": state["net"]}
            if op == "call":
                out["args_after"] = [enc(a) for a in args]
                out["kwargs_after"] = {k: enc(a) for k, a in kwargs.items()}
        except (SystemExit, KeyboardInterrupt, GeneratorExit):
            os._exit(12)
        except BaseException as e:
            if not isinstance(e, MemoryError):
                traceback.print_exc()
            try:
                msg = str(e)[:1000]
            except BaseException:
                msg = ""
            out = {"raised": exc_name(e), "msg": msg, "net": state["net"]}
        sys.stdout.flush()
        chan.send(out)

# ----------------------------------------------------------------------------- judge role
class SolutionDied(BaseException):
    """The solution process exited or sent garbage: the run is an error (tests cannot catch it)."""

class SolutionError(Exception):
    """An exception of a non-builtin class raised by the solution."""

def _judge(cfg):
    sc = _common(cfg)
    box = cfg["box"]
    import builtins, traceback
    chan = _Chan(cfg["rfd"], cfg["wfd"])
    vfd = cfg["vfd"]
    peer = {"net": False, "seccomp": "unknown"}
    def verdict(status, reason=""):
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.write(vfd, json.dumps({"status": status, "reason": reason[:2000], "net": peer["net"],
                                      "seccomp": sc, "peer_seccomp": peer["seccomp"]}).encode())
        finally:
            os._exit(0)
    def recv():
        try:
            m = chan.recv()
        except (ValueError, OSError, MemoryError, RecursionError) as e:
            raise SolutionDied("garbled reply from the solution process (%s)" % type(e).__name__)
        if m is None or not isinstance(m, dict):
            raise SolutionDied("the solution process exited or stopped answering")
        if m.get("net") is True:
            peer["net"] = True
        return m

    class Handle:
        __slots__ = ("_h",)
        def __init__(self, h):
            object.__setattr__(self, "_h", ["H", int(h[1]), str(h[2])])
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return rpc("getattr", self, attr=name)
        def __setattr__(self, name, value):
            raise TypeError("sandbox: setting attributes of solution objects is not supported")
        def __call__(self, *args, **kwargs):
            return rpc("call", self, args, kwargs)
        def __len__(self):
            return _typed(rpc("len", self), int, "len")
        def __iter__(self):
            return iter(_typed(rpc("list", self), list, "iter"))
        def __bool__(self):
            return _typed(rpc("bool", self), bool, "bool")
        def __str__(self):
            return _typed(rpc("str", self), str, "str")
        def __repr__(self):
            return _typed(rpc("repr", self), str, "repr")
        def __int__(self):
            return _typed(rpc("int", self), int, "int")
        def __float__(self):
            return _typed(rpc("float", self), float, "float")
        def __index__(self):
            return _typed(rpc("index", self), int, "index")
        def __getitem__(self, k):
            return rpc("getitem", self, [k])
        def __setitem__(self, k, v):
            rpc("setitem", self, [k, v])
        def __delitem__(self, k):
            rpc("delitem", self, [k])
        def __contains__(self, x):
            return _typed(rpc("contains", self, [x]), bool, "in")
        def __instancecheck__(self, x):     # isinstance(obj, SolutionClass): asked of the solution
            return _typed(rpc("isinstance", self, [x]), bool, "isinstance")
        def __hash__(self):
            return hash(("sandbox-handle", self._h[1]))
        def __eq__(self, other):
            if isinstance(other, Handle):
                if other._h[1] == self._h[1]:
                    return True
                return _typed(rpc("binop", self, [other], attr="eq"), bool, "==")
            return False        # a solution object never equals a plain value
        def __ne__(self, other):
            return not self.__eq__(other)

    def _binop(name, sym):
        def f(self, other):
            if isinstance(other, Handle):
                return rpc("binop", self, [other], attr=name)
            raise TypeError("sandbox: %s between a solution object (%s) and a plain %s is not evaluated; "
                            "return plain values" % (sym, self._h[2], type(other).__name__))
        def r(self, other):
            raise TypeError("sandbox: %s between a plain %s and a solution object (%s) is not evaluated; "
                            "return plain values" % (sym, type(other).__name__, self._h[2]))
        return f, r
    for name, sym in (("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="), ("add", "+"), ("sub", "-"),
                      ("mul", "*"), ("truediv", "/"), ("floordiv", "//"), ("mod", "%"), ("pow", "**"),
                      ("and_", "&"), ("or_", "|"), ("xor", "^"), ("matmul", "@"), ("lshift", "<<"),
                      ("rshift", ">>")):
        f, r = _binop(name, sym)
        dn = name.rstrip("_")
        setattr(Handle, "__%s__" % dn, f)
        if dn not in ("lt", "le", "gt", "ge"):
            setattr(Handle, "__r%s__" % dn, r)

    def _typed(v, t, what):
        if type(v) is not t:
            raise TypeError("sandbox: %s of a solution object gave %s, not %s" % (what, type(v).__name__, t.__name__))
        return v

    def to_handle(x):
        return Handle(x)
    def enc(v):
        def h(obj):
            if isinstance(obj, Handle):
                return obj._h
            raise TypeError("sandbox: cannot pass a %s to the solution (plain data and solution objects only)"
                            % type(obj).__name__)
        return _encode(v, h, [_MAX_NODES])
    def write_back(orig, after):
        new = _decode(after, to_handle)
        if type(orig) is list and type(new) is list:
            orig[:] = new
        elif type(orig) is dict and type(new) is dict:
            orig.clear(); orig.update(new)
        elif type(orig) is set and type(new) is set:
            orig.clear(); orig.update(new)
    def rpc(op, target, args=(), kwargs=None, attr=None):
        req = {"op": op, "target": target._h, "args": [enc(a) for a in args],
               "kwargs": {str(k): enc(v) for k, v in (kwargs or {}).items()}}
        if attr is not None:
            req["attr"] = attr
        chan.send(req)
        m = recv()
        if "ok" in m:
            try:
                val = _decode(m["ok"], to_handle)
                if op == "call":
                    for a, after in zip(args, m.get("args_after") or []):
                        write_back(a, after)
                    for k, after in (m.get("kwargs_after") or {}).items():
                        if k in (kwargs or {}):
                            write_back(kwargs[k], after)
            except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
                raise SolutionDied("garbled reply from the solution process (%s)" % e)
            return val
        if "raised" in m:
            name, msg = str(m["raised"]), str(m.get("msg", ""))
            cls = getattr(builtins, name, None)
            if (isinstance(cls, type) and issubclass(cls, BaseException)
                    and not issubclass(cls, (SystemExit, KeyboardInterrupt, GeneratorExit))):
                try:
                    raise cls(msg)
                except TypeError:
                    raise SolutionError(name + ": " + msg)
            raise SolutionError(name + ": " + msg)
        raise SolutionDied("garbled reply from the solution process")

    try:
        hello = recv()
        peer["seccomp"] = str((hello.get("hello") or {}).get("seccomp", "unknown"))[:200]
        load = recv()
        if load.get("load") == "memory":
            verdict("memory", "MemoryError while loading the solution")
        if load.get("load") != "ok":
            verdict("error", "the solution raised while loading")
        g = {"__name__": "tests", "__builtins__": builtins}
        import keyword
        for k, x in dict(load.get("names") or {}).items():
            k = str(k)
            # a solution's own `len` / `abs` / `__builtins__` must not replace what the tests call
            if not k.isidentifier() or keyword.iskeyword(k) or k.startswith("__") or hasattr(builtins, k):
                continue
            g[k] = _decode(x, to_handle)
    except SolutionDied as e:
        verdict("error", str(e))
    except MemoryError:
        verdict("memory", "MemoryError in the judge")
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
        verdict("error", "garbled names from the solution process (%s)" % e)
    tests = open(os.path.join(box, "tests.py"), encoding="utf-8").read()
    try:
        exec(compile(tests, "tests.py", "exec"), g)
        for key in sorted(k for k in list(g) if k.startswith("test_")):
            fn = g[key]
            if callable(fn) and not isinstance(fn, Handle):
                fn()
    except SolutionDied as e:
        verdict("error", str(e))
    except MemoryError:
        verdict("memory", "MemoryError")
    except BaseException:
        traceback.print_exc()
        verdict("failed", "a test raised")
    try:
        chan.send({"op": "bye"})
        recv()
    except SolutionDied as e:
        verdict("error", str(e))
    verdict("network_blocked" if peer["net"] else "passed")

_RC_NETWORK = 14
_cfg = json.loads(sys.argv[1])
if _cfg["role"] == "solution":
    _solution(_cfg)
else:
    _judge(_cfg)
'''


# ----------------------------------------------------------------------------- namespace setup
# Runs as root (pid 1) inside the new namespaces: builds the read-only root, then runs the child
# as a fresh unprivileged uid, waits for it and exits with its status (128 + signal when killed).
_SETUP = r'''
set -eu
R=$1; BOX=$2; ID=$3; SCRATCH_MB=$4; RO=$5; MOUNT=$6; CHROOT=$7; SETPRIV=$8; shift 8
mount() { "$MOUNT" "$@"; }
mount -t tmpfs -o size=1m,mode=755,nosuid,nodev tmpfs "$R"
for p in /usr /bin /sbin /lib /lib64 /lib32 /libx32; do
  if [ -L "$p" ]; then ln -s "$(readlink "$p")" "$R$p"; elif [ -d "$p" ]; then mkdir -p "$R$p"; mount --bind -o ro,nosuid,nodev "$p" "$R$p"; fi
done
OLDIFS=$IFS; IFS=:
for p in $RO; do
  if [ -n "$p" ] && [ ! -e "$R$p" ]; then mkdir -p "$R$p"; mount --bind -o ro,nosuid,nodev "$p" "$R$p"; fi
done
IFS=$OLDIFS
mkdir -p "$R/dev" "$R/box" "$R/work"
for d in null zero random urandom; do touch "$R/dev/$d"; mount --bind "/dev/$d" "$R/dev/$d"; done
mount --bind -o ro,nosuid,nodev "$BOX" "$R/box"
mount -t tmpfs -o "size=${SCRATCH_MB}m,mode=700,uid=$ID,gid=$ID,nosuid,nodev" tmpfs "$R/work"
ln -s work "$R/tmp"
mount -o remount,ro,bind "$R"
"$CHROOT" "$R" "$SETPRIV" --reuid="$ID" --regid="$ID" --clear-groups --inh-caps=-all \
  --bounding-set=-all --no-new-privs -- "$@" && rc=0 || rc=$?
exit $rc
'''


def _ns_argv(root: str, box: str, uid: int, scratch_mb: int, net: bool) -> list:
    """``unshare`` + setup-shell prefix; the child's own argv follows."""
    flags = ["--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child"] + (["--net"] if net else [])
    return [_tool("unshare")] + flags + ["--", "/bin/sh", "-c", _SETUP, "sh", root, box, str(uid),
                                         str(int(scratch_mb)), _ro_paths(), _tool("mount"), _tool("chroot"),
                                         _tool("setpriv")]


def _ro_paths() -> str:
    """Read-only runtime bind mounts beyond /usr and /bin-/lib*: the interpreter's prefixes."""
    paths = []
    for p in (sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        p = os.path.realpath(p)
        if p.startswith("/usr/") or p in ("/usr", "/") or ":" in p:
            continue
        if p not in paths:
            paths.append(p)
    return ":".join(paths)


def _tool(name: str) -> Optional[str]:
    for d in ("/usr/bin", "/usr/sbin", "/bin", "/sbin"):
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name)


@functools.lru_cache(maxsize=None)
def netns_available() -> bool:
    """True when ``unshare -n`` can create a network namespace here."""
    exe = _tool("unshare")
    if exe is None:
        return False
    try:
        r = subprocess.run([exe, "-n", "--", "true"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


@functools.lru_cache(maxsize=None)
def isolation_available() -> str:
    """"on" when the namespace + read-only root + uid drop path works here, else the reason it does not."""
    missing = [t for t in ("unshare", "chroot", "setpriv", "mount") if _tool(t) is None]
    if missing:
        return f"unavailable: {', '.join(missing)} not found (util-linux / coreutils)"
    root = tempfile.mkdtemp(prefix="glm5_sbxprobe_")
    box = tempfile.mkdtemp(prefix="glm5_sbxprobe_box_")
    try:
        argv = _ns_argv(root, box, 200000, 1, True) + [
            os.path.realpath(sys.executable), "-I", "-S", "-c", "import os; print(os.getuid())"]
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable: {type(e).__name__}: {e}"
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(box, ignore_errors=True)
    if r.returncode != 0 or r.stdout.strip() != b"200000":
        err = r.stderr.decode(errors="replace").strip().splitlines()
        return "unavailable: namespace setup failed (" + (err[-1] if err else f"rc {r.returncode}")[:200] + ")"
    return "on"


def _read(f, limit: int) -> str:
    f.seek(0)
    data = f.read(limit + 1)
    text = data[:limit].decode("utf-8", errors="replace")
    if len(data) > limit:
        text += "\n...[truncated]"
    return text


def _rc(rc: Optional[int], namespaced: bool) -> Optional[int]:
    """The child's status as subprocess reports it (negative = signal); the setup shell reports 128+n."""
    if rc is not None and namespaced and 128 < rc < 128 + 65:
        return -(rc - 128)
    return rc


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except OSError:
        pass


def run_sandboxed(
    code: str,
    tests: str,
    *,
    timeout_s: float = 2.0,
    cpu_s: int = 2,
    memory_mb: int = 256,
    max_output_bytes: int = 64 * 1024,
    netns: Optional[bool] = None,
    isolate: Optional[bool] = None,
    seccomp: bool = True,
    scratch_mb: int = 16,
    allow_site: bool = False,
    _python_guard: bool = True,
) -> SandboxResult:
    """Execute ``code`` in one sandboxed process and ``tests`` (plain asserts, ``test_*`` functions,
    any Python) in another that decides the verdict; see the module docstring.

    ``isolate``: None = namespaces + read-only root + uid drop when available (``isolation`` says
    which layers held), True = require them (``sandbox_error`` when unavailable), False = do not use
    them. ``netns``: None = a network namespace when available, True = require it, False = host
    network namespace (Python-level blocking only). ``seccomp``: install the syscall filter when
    libseccomp is present. ``scratch_mb``: size of the writable /work tmpfs (namespaced runs).
    ``_python_guard=False`` disables the audit hook (tests of the OS layers only).
    """
    for name, v in (("code", code), ("tests", tests)):
        if not isinstance(v, str):
            raise TypeError(f"{name} must be a str, not {type(v).__name__}")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name} is not valid text: {e.reason} at position {e.start}") from None
    iso_state = isolation_available()
    use_ns = (iso_state == "on") if isolate is None else bool(isolate)
    if use_ns and iso_state != "on":
        return SandboxResult(False, "sandbox_error", "", f"isolation required but {iso_state}",
                             isolation={"namespaces": iso_state})
    net_ok = netns_available()
    use_net = net_ok if netns is None else bool(netns)
    if use_net and not net_ok:
        return SandboxResult(False, "sandbox_error", "", "network namespace unavailable",
                             isolation={"network": "unavailable: unshare -n failed"})
    isolation = {
        "namespaces": "on" if use_ns else ("off" if isolate is False else iso_state),
        "filesystem": "on" if use_ns else ("off" if isolate is False else iso_state),
        "uid": "on" if use_ns else ("off" if isolate is False else iso_state),
        "network": "on" if use_net else ("off" if netns is False else "unavailable: unshare -n failed"),
        "seccomp": "off" if not seccomp else "unknown",
        "rlimits": "on",
        "python_guard": "on" if _python_guard else "off",
    }
    t0 = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="glm5_sandbox_")
    procs, pipes = [], []
    try:
        boxes = {}
        for role, files in (("solution", {"solution.py": code}), ("judge", {"tests.py": tests})):
            box = os.path.join(tmp, role + "_box")
            os.makedirs(box)
            files["_child.py"] = _CHILD
            for fname, text in files.items():
                with open(os.path.join(box, fname), "w", encoding="utf-8") as f:
                    f.write(text)
            os.chmod(box, 0o755)
            for fname in files:
                os.chmod(os.path.join(box, fname), 0o644)
            boxes[role] = box
        # pipes: judge -> solution (requests), solution -> judge (replies), judge -> parent (verdict)
        j2s_r, j2s_w = os.pipe()
        s2j_r, s2j_w = os.pipe()
        v_r, v_w = os.pipe()
        pipes = [j2s_r, j2s_w, s2j_r, s2j_w, v_r, v_w]
        base_id = 200000 + secrets.randbelow(1 << 20) * 2
        py = os.path.realpath(sys.executable)
        outs = []
        for i, role in enumerate(("solution", "judge")):
            box = boxes[role]
            inside_box = "/box" if use_ns else box
            cfg = {"role": role, "cpu_s": int(cpu_s), "mem_b": int(memory_mb) * 1024 * 1024,
                   "fsize_b": int(max_output_bytes) * 4, "seccomp": bool(seccomp), "box": inside_box,
                   "python_guard": bool(_python_guard)}
            if role == "solution":
                cfg.update(rfd=j2s_r, wfd=s2j_w)
                fds = (j2s_r, s2j_w)
            else:
                cfg.update(rfd=s2j_r, wfd=j2s_w, vfd=v_w)
                fds = (s2j_r, j2s_w, v_w)
            child = [py, "-I"] + ([] if allow_site else ["-S"]) + [os.path.join(inside_box, "_child.py"),
                                                                  json.dumps(cfg)]
            scratch = os.path.join(tmp, role + "_work")
            os.makedirs(scratch)
            if use_ns:
                root = os.path.join(tmp, role + "_root")
                os.makedirs(root)
                argv = _ns_argv(root, box, base_id + i, scratch_mb, use_net) + child
                home = "/work"
            else:
                argv = ([_tool("unshare"), "-n", "--"] if use_net else []) + child
                home = scratch
            env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            outs.append((out, err))
            try:
                proc = subprocess.Popen(argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True, close_fds=True, pass_fds=fds)
            except OSError as e:
                return SandboxResult(False, "sandbox_error", "", f"could not start: {e}",
                                     wall_s=time.monotonic() - t0, isolation=isolation)
            procs.append(proc)
        for fd in (j2s_r, s2j_w, s2j_r, j2s_w, v_w):
            os.close(fd)
        pipes = [v_r]
        sol, judge = procs
        # read the verdict (bounded) until the judge closes its end or the wall clock runs out
        deadline = t0 + timeout_s
        verdict_raw, timed_out = b"", False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            r, _, _ = select.select([v_r], [], [], left)
            if not r:
                timed_out = True
                break
            chunk = os.read(v_r, 65536)
            if not chunk:
                break
            verdict_raw += chunk
            if len(verdict_raw) > _MAX_VERDICT:
                break
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
        sol_rc = _rc(sol.returncode, use_ns)
        judge_rc = _rc(judge.returncode, use_ns)
        stdout = _read(outs[0][0], max_output_bytes)
        j_out = _read(outs[1][0], max_output_bytes)
        if j_out:
            stdout = stdout + j_out
        stderr = _read(outs[0][1], max_output_bytes)
        j_err = _read(outs[1][1], max_output_bytes)
        if j_err:
            stderr = (stderr + "\n" if stderr else "") + j_err
        for out, err in outs:
            out.close()
            err.close()
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
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.monotonic() - t0

    try:
        verdict = json.loads(verdict_raw.decode("utf-8")) if verdict_raw else {}
        if not isinstance(verdict, dict):
            verdict = {}
    except (ValueError, UnicodeDecodeError):
        verdict = {}
    if seccomp:
        states = {str(verdict.get("seccomp", "unknown")), str(verdict.get("peer_seccomp", "unknown"))}
        isolation["seccomp"] = "on" if states == {"on"} else sorted(states - {"on"})[0]
        if isolation["seccomp"] == "unknown":
            isolation["seccomp"] = "unknown: the run ended before it was reported"
    v = verdict.get("status")
    if timed_out:
        status = "timeout"
    elif v == "passed" and sol_rc in (0, None) or v == "passed" and sol_rc == -signal.SIGKILL:
        status = "passed"
    elif v == "network_blocked" or sol_rc == _RC_NETWORK or verdict.get("net") is True:
        status = "network_blocked"
    elif v == "memory":
        status = "memory"
    elif sol_rc == -signal.SIGXCPU:
        status = "timeout"  # soft RLIMIT_CPU
    elif sol_rc == -signal.SIGXFSZ:
        status = "output_limit"
    elif sol_rc == -signal.SIGKILL and v != "failed":
        # SIGKILL that is not ours (ours comes after the verdict): the hard RLIMIT_CPU or the OOM killer
        status = "memory" if "MemoryError" in stderr else ("timeout" if wall >= cpu_s else "killed")
    elif sol_rc is not None and sol_rc < 0 and v != "failed":
        status = "memory" if "MemoryError" in stderr else "killed"
    elif v == "failed":
        status = "failed"
    elif v == "error":
        status = "memory" if sol_rc == 13 else "error"
    elif judge_rc == -signal.SIGXCPU or judge_rc == -signal.SIGKILL and wall >= cpu_s:
        status = "timeout"  # the tests themselves ran past the CPU limit
    else:
        status = "error"  # the judge died without a verdict
    if status in ("failed", "error") and "[Errno 27] File too large" in stderr:
        status = "output_limit"  # Python ignores SIGXFSZ; the write raises instead
    return SandboxResult(status == "passed", status, stdout, stderr, sol_rc, wall, isolation)

