"""The wire format between the two children: tagged JSON of plain data, one message a line.

Plain data means exact types (``type(x) is int``, not ``isinstance``): None, bool, int, float, complex,
str, bytes and lists, tuples, dicts, sets, frozensets of those. Anything else is handed to ``handle``
(the solution turns it into an opaque reference; the judge refuses it). Both directions are bounded:
``MAX_NODES`` per value, ``MAX_DEPTH`` of nesting, ``MAX_LINE`` bytes per message.
"""

import json
import os

MAX_NODES = 200000
MAX_DEPTH = 64
MAX_LINE = 32 << 20


def encode(v, handle, budget, depth=0):
    """``v`` as a tagged list; ``budget`` is a one-element list of nodes left (OverflowError at 0)."""
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
    if depth < MAX_DEPTH:
        if t is list:
            return ["L", [encode(x, handle, budget, depth + 1) for x in v]]
        if t is tuple:
            return ["T", [encode(x, handle, budget, depth + 1) for x in v]]
        if t is dict:
            return ["D", [[encode(k, handle, budget, depth + 1), encode(x, handle, budget, depth + 1)]
                          for k, x in v.items()]]
        if t is set:
            return ["E", [encode(x, handle, budget, depth + 1) for x in v]]
        if t is frozenset:
            return ["Z", [encode(x, handle, budget, depth + 1) for x in v]]
    return handle(v)


def decode(x, handle, depth=0):
    """The value ``encode`` tagged, built from scratch; ``["H", ...]`` goes to ``handle``."""
    if depth > MAX_DEPTH + 2:
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
        items = [decode(y, handle, depth + 1) for y in x[1]]
        return {"L": list, "T": tuple, "E": set, "Z": frozenset}[tag](items)
    if tag == "D":
        return {decode(k, handle, depth + 1): decode(y, handle, depth + 1) for k, y in x[1]}
    if tag == "H":
        return handle(x)
    raise ValueError(f"bad tag {tag!r}")


class Chan:
    """One JSON message a line over a pair of pipe ends; ``recv`` is None at EOF or on a cut line."""

    def __init__(self, rfd, wfd):
        self.r = os.fdopen(rfd, "rb", buffering=1 << 16)
        self.w = os.fdopen(wfd, "wb", buffering=0)

    def send(self, obj):
        self.w.write(json.dumps(obj).encode() + b"\n")

    def recv(self):
        line = self.r.readline(MAX_LINE)
        if not line or not line.endswith(b"\n"):
            return None
        return json.loads(line)
