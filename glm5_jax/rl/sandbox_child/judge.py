"""The judge role: run the tests against proxies of the solution's names and write the verdict.

Every name the solution defined is bound in the tests' globals to its plain value or to a
:class:`Handle`; calling a handle asks the solution process and decodes the answer into values the
judge builds itself. A handle never equals a plain value, and arithmetic / ordering between a handle
and a plain value raises TypeError, so an object whose ``__eq__`` says True to everything cannot pass
an assert. The verdict goes to the parent on ``vfd``, a pipe only this process holds.
"""

import builtins
import json
import keyword
import os
import sys
import traceback

from . import Exit
from .codec import MAX_NODES, Chan, decode, encode
from .limits import confine

GARBLED = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError)
BINOPS = (("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">="), ("add", "+"), ("sub", "-"), ("mul", "*"),
          ("truediv", "/"), ("floordiv", "//"), ("mod", "%"), ("pow", "**"), ("and_", "&"), ("or_", "|"),
          ("xor", "^"), ("matmul", "@"), ("lshift", "<<"), ("rshift", ">>"))


class SolutionDied(BaseException):
    """The solution process exited or sent garbage: the run is an error (tests cannot catch it)."""


class SolutionError(Exception):
    """An exception of a non-builtin class raised by the solution."""


class Peer:
    """The judge's end of the conversation with the solution process."""

    def __init__(self, chan: Chan):
        self.chan = chan
        self.net = False                # the solution reported a network attempt
        self.seccomp = "unknown"        # the solution's seccomp state (from its hello)

    def recv(self) -> dict:
        try:
            m = self.chan.recv()
        except (ValueError, OSError, MemoryError, RecursionError) as e:
            raise SolutionDied(f"garbled reply from the solution process ({type(e).__name__})")
        if m is None or not isinstance(m, dict):
            raise SolutionDied("the solution process exited or stopped answering")
        if m.get("net") is True:
            self.net = True
        return m

    def rpc(self, op, target, args=(), kwargs=None, attr=None):
        """Ask the solution to apply ``op`` to ``target``; its value, or its exception re-raised here."""
        req = {"op": op, "target": target._h, "args": [_enc(a) for a in args],
               "kwargs": {str(k): _enc(v) for k, v in (kwargs or {}).items()}}
        if attr is not None:
            req["attr"] = attr
        self.chan.send(req)
        m = self.recv()
        if "ok" in m:
            try:
                val = decode(m["ok"], Handle)
                if op == "call":
                    for a, after in zip(args, m.get("args_after") or []):
                        _write_back(a, after)
                    for k, after in (m.get("kwargs_after") or {}).items():
                        if k in (kwargs or {}):
                            _write_back(kwargs[k], after)
            except GARBLED as e:
                raise SolutionDied(f"garbled reply from the solution process ({e})")
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


_peer = None     # the one Peer of this process (run() sets it before any test runs)


def _rpc(op, target, args=(), kwargs=None, attr=None):
    return _peer.rpc(op, target, args, kwargs, attr)


def _typed(v, t, what):
    if type(v) is not t:
        raise TypeError(f"sandbox: {what} of a solution object gave {type(v).__name__}, not {t.__name__}")
    return v


class Handle:
    """A solution object the tests can call, index, iterate and compare with other solution objects."""

    __slots__ = ("_h",)

    def __init__(self, h):
        object.__setattr__(self, "_h", ["H", int(h[1]), str(h[2])])

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _rpc("getattr", self, attr=name)

    def __setattr__(self, name, value):
        raise TypeError("sandbox: setting attributes of solution objects is not supported")

    def __call__(self, *args, **kwargs):
        return _rpc("call", self, args, kwargs)

    def __len__(self):
        return _typed(_rpc("len", self), int, "len")

    def __iter__(self):
        return iter(_typed(_rpc("list", self), list, "iter"))

    def __bool__(self):
        return _typed(_rpc("bool", self), bool, "bool")

    def __str__(self):
        return _typed(_rpc("str", self), str, "str")

    def __repr__(self):
        return _typed(_rpc("repr", self), str, "repr")

    def __int__(self):
        return _typed(_rpc("int", self), int, "int")

    def __float__(self):
        return _typed(_rpc("float", self), float, "float")

    def __index__(self):
        return _typed(_rpc("index", self), int, "index")

    def __getitem__(self, k):
        return _rpc("getitem", self, [k])

    def __setitem__(self, k, v):
        _rpc("setitem", self, [k, v])

    def __delitem__(self, k):
        _rpc("delitem", self, [k])

    def __contains__(self, x):
        return _typed(_rpc("contains", self, [x]), bool, "in")

    def __instancecheck__(self, x):     # isinstance(obj, SolutionClass): asked of the solution
        return _typed(_rpc("isinstance", self, [x]), bool, "isinstance")

    def __hash__(self):
        return hash(("sandbox-handle", self._h[1]))

    def __eq__(self, other):
        if isinstance(other, Handle):
            if other._h[1] == self._h[1]:
                return True
            return _typed(_rpc("binop", self, [other], attr="eq"), bool, "==")
        return False        # a solution object never equals a plain value

    def __ne__(self, other):
        return not self.__eq__(other)


def _binop(name, sym):
    def f(self, other):
        if isinstance(other, Handle):
            return _rpc("binop", self, [other], attr=name)
        raise TypeError(f"sandbox: {sym} between a solution object ({self._h[2]}) and a plain "
                        f"{type(other).__name__} is not evaluated; return plain values")

    def r(self, other):
        raise TypeError(f"sandbox: {sym} between a plain {type(other).__name__} and a solution object "
                        f"({self._h[2]}) is not evaluated; return plain values")
    return f, r


for _name, _sym in BINOPS:
    _f, _r = _binop(_name, _sym)
    _dn = _name.rstrip("_")
    setattr(Handle, f"__{_dn}__", _f)
    if _dn not in ("lt", "le", "gt", "ge"):
        setattr(Handle, f"__r{_dn}__", _r)


def _enc(v):
    def h(obj):
        if isinstance(obj, Handle):
            return obj._h
        raise TypeError(f"sandbox: cannot pass a {type(obj).__name__} to the solution (plain data and "
                        "solution objects only)")
    return encode(v, h, [MAX_NODES])


def _write_back(orig, after):
    """In-place mutation of a list / dict / set argument, as the solution left it."""
    new = decode(after, Handle)
    if type(orig) is list and type(new) is list:
        orig[:] = new
    elif type(orig) is type(new) and type(orig) in (dict, set):
        orig.clear()
        orig.update(new)


def tests_globals(names: dict) -> dict:
    """The tests' globals: each solution name decoded, except those that would shadow a builtin or a dunder."""
    g = {"__name__": "tests", "__builtins__": builtins}
    for k, x in dict(names or {}).items():
        k = str(k)
        # a solution's own `len` / `abs` / `__builtins__` must not replace what the tests call
        if not k.isidentifier() or keyword.iskeyword(k) or k.startswith("__") or hasattr(builtins, k):
            continue
        g[k] = decode(x, Handle)
    return g


def run(cfg: dict) -> None:
    global _peer
    sc = confine(cfg)
    _peer = peer = Peer(Chan(cfg["rfd"], cfg["wfd"]))
    vfd = cfg["vfd"]

    def verdict(status, reason=""):
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.write(vfd, json.dumps({"status": status, "reason": reason[:2000], "net": peer.net,
                                      "seccomp": sc, "peer_seccomp": peer.seccomp}).encode())
        finally:
            os._exit(Exit.OK)
    try:
        hello = peer.recv()
        peer.seccomp = str((hello.get("hello") or {}).get("seccomp", "unknown"))[:200]
        load = peer.recv()
        if load.get("load") == "memory":
            verdict("memory", "MemoryError while loading the solution")
        if load.get("load") != "ok":
            verdict("error", "the solution raised while loading")
        g = tests_globals(load.get("names"))
    except SolutionDied as e:
        verdict("error", str(e))
    except MemoryError:
        verdict("memory", "MemoryError in the judge")
    except GARBLED as e:
        verdict("error", f"garbled names from the solution process ({e})")
    with open(os.path.join(cfg["box"], "tests.py"), encoding="utf-8") as f:
        tests = f.read()
    try:
        exec(compile(tests, "tests.py", "exec"), g)   # noqa: S102  (the tests are trusted: the caller's)
        for key in sorted(k for k in list(g) if k.startswith("test_")):
            fn = g[key]
            if callable(fn) and not isinstance(fn, Handle):
                fn()
    except SolutionDied as e:
        verdict("error", str(e))
    except MemoryError:
        verdict("memory", "MemoryError")
    except BaseException:  # noqa: BLE001  (whatever a test raises fails it)
        traceback.print_exc()
        verdict("failed", "a test raised")
    try:
        peer.chan.send({"op": "bye"})
        peer.recv()
    except SolutionDied as e:
        verdict("error", str(e))
    verdict("network_blocked" if peer.net else "passed")
