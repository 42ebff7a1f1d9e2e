"""The solution role: execute the solution, then answer the judge's requests until it says "bye".

Answers are plain data or opaque handles (codec.py); the solution never sees the tests or the verdict.
With ``python_guard`` an audit hook refuses sockets, DNS, os.system, subprocess, fork / exec, ctypes and
signals, and marks every network attempt (``net``, reported with each answer even when the solution
caught the PermissionError). It is one layer among several: ``_posixsubprocess.fork_exec`` gets past it,
into the namespaces, seccomp and rlimits.
"""

import builtins
import itertools
import operator
import os
import sys
import traceback

from . import Exit
from .codec import MAX_NODES, Chan, decode, encode
from .limits import confine

NET_EVENTS = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
              "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg", "socket.getnameinfo")
PROCESS_EVENTS = ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
                  "os.forkpty", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
                  "ctypes.call_function", "os.kill", "os.killpg", "sys.addaudithook")
SOCKET_NAMES = ("socket", "create_connection", "create_server", "socketpair", "getaddrinfo", "gethostbyname",
                "fromfd")
MAX_ITER = 1000000
# The judge's requests on one object: op -> what it asks of the target (args already decoded).
OPS = {
    "len": lambda t, a: len(t),
    "bool": lambda t, a: bool(t),
    "str": lambda t, a: str(t),
    "repr": lambda t, a: repr(t),
    "int": lambda t, a: int(t),
    "float": lambda t, a: float(t),
    "index": lambda t, a: t.__index__(),
    "getitem": lambda t, a: t[a[0]],
    "contains": lambda t, a: a[0] in t,
    "isinstance": lambda t, a: isinstance(a[0], t),
}


def install_guard(state: dict) -> None:
    """The audit hook and a refusing ``socket`` module; ``state["net"]`` becomes True on any attempt."""
    def hook(event, args):
        if event in NET_EVENTS:
            state["net"] = True
            raise PermissionError("sandbox: network access is blocked (" + event + ")")
        if event in PROCESS_EVENTS:
            raise PermissionError("sandbox: " + event + " is blocked")
    sys.addaudithook(hook)
    import socket

    def refuse(*a, **k):
        state["net"] = True
        raise PermissionError("sandbox: network access is blocked")
    for name in SOCKET_NAMES:
        if hasattr(socket, name):
            setattr(socket, name, refuse)


class Handles:
    """Objects that are not plain data stay here; the judge holds ``["H", id, type name, callable]``."""

    def __init__(self):
        self.objects = {}

    def handle(self, v):
        hid = len(self.objects) + 1
        self.objects[hid] = v
        return ["H", hid, type(v).__name__[:64], callable(v)]

    def resolve(self, x):
        if x[0] == "H":
            return self.objects[x[1]]
        raise ValueError("not a handle")

    def enc(self, v):
        return encode(v, self.handle, [MAX_NODES])


def exc_name(e: BaseException) -> str:
    """The nearest builtin exception class of ``e`` (the judge re-raises that class)."""
    for c in type(e).__mro__:
        if getattr(builtins, c.__name__, None) is c:
            return c.__name__
    return "Exception"


def answer(req: dict, handles: Handles, state: dict) -> dict:
    """Carry out one request; the reply with its value (``ok``) or the exception it raised (``raised``)."""
    op = req.get("op")
    try:
        target = handles.resolve(req["target"])
        args = [decode(a, handles.resolve) for a in req.get("args", [])]
        kwargs = {k: decode(a, handles.resolve) for k, a in req.get("kwargs", {}).items()}
        attr = req.get("attr")
        if op == "getattr":
            val = getattr(target, attr)
        elif op == "call":
            val = (target if attr is None else getattr(target, attr))(*args, **kwargs)
        elif op == "list":
            val = list(itertools.islice(iter(target), MAX_ITER + 1))
            if len(val) > MAX_ITER:
                raise OverflowError(f"sandbox: iteration longer than {MAX_ITER} items")
        elif op == "setitem":
            target[args[0]] = args[1]
            val = None
        elif op == "delitem":
            del target[args[0]]
            val = None
        elif op == "binop":
            val = getattr(operator, attr)(target, args[0])
        elif op in OPS:
            val = OPS[op](target, args)
        else:
            raise ValueError("unknown op")
        out = {"ok": handles.enc(val), "net": state["net"]}
        if op == "call":
            out["args_after"] = [handles.enc(a) for a in args]
            out["kwargs_after"] = {k: handles.enc(a) for k, a in kwargs.items()}
        return out
    except (SystemExit, KeyboardInterrupt, GeneratorExit):
        os._exit(Exit.LOAD_ERROR)
    except BaseException as e:  # noqa: BLE001  (whatever the solution raises goes back to the judge)
        if not isinstance(e, MemoryError):
            traceback.print_exc()
        try:
            msg = str(e)[:1000]
        except BaseException:  # noqa: BLE001  (a hostile __str__)
            msg = ""
        return {"raised": exc_name(e), "msg": msg, "net": state["net"]}


def load(box: str, chan: Chan, handles: Handles, state: dict) -> dict:
    """Execute solution.py; tell the judge its names (plain values or handles), or exit if it raised."""
    with open(os.path.join(box, "solution.py"), encoding="utf-8") as f:
        code = f.read()
    ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        exec(compile(code, "solution.py", "exec"), ns)   # noqa: S102  (this process exists to run it)
    except MemoryError:
        chan.send({"load": "memory", "net": state["net"]})
        os._exit(Exit.LOAD_MEMORY)
    except BaseException:  # noqa: BLE001  (any failure to load is the solution's error)
        traceback.print_exc()
        sys.stderr.flush()
        chan.send({"load": "error", "net": state["net"]})
        os._exit(Exit.LOAD_ERROR)
    names = {}
    for k, v in list(ns.items()):
        if k.startswith("__") or type(v).__name__ == "module":
            continue
        try:
            names[k] = handles.enc(v)
        except Exception:  # noqa: BLE001  (too large or too deep: a handle)
            names[k] = handles.handle(v)
    sys.stdout.flush()
    chan.send({"load": "ok", "names": names, "net": state["net"]})
    return ns


def run(cfg: dict) -> None:
    sc = confine(cfg)
    chan = Chan(cfg["rfd"], cfg["wfd"])
    chan.send({"hello": {"seccomp": sc}})      # before any untrusted code runs
    state = {"net": False}
    if cfg["python_guard"]:
        install_guard(state)
    handles = Handles()
    load(cfg["box"], chan, handles, state)
    while True:
        req = chan.recv()
        if req is None:
            os._exit(Exit.OK)
        if req.get("op") == "bye":
            sys.stdout.flush()
            sys.stderr.flush()
            chan.send({"bye": True, "net": state["net"]})
            os._exit(Exit.NETWORK if state["net"] else Exit.OK)
        out = answer(req, handles, state)
        sys.stdout.flush()
        chan.send(out)
