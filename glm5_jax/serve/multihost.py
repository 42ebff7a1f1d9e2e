"""The serving engine over several processes (a multi-host pod slice): one scheduling decision per step,
the same on every process.

Process 0 runs the scheduler (and the HTTP server); before each device operation it broadcasts the
operation and its host arguments (`Broadcast.exchange`), and every other process (`Engine.follow`)
receives it and runs the same operation, so every process issues the same programs with the same
arguments in the same order (a jitted program over a multi-process mesh needs exactly that). Host
inputs become global arrays from the identical copies every process holds (`glm5_jax.parallel.distributed.to_global`); outputs come
back to every process whole (`glm5_jax.parallel.distributed.to_host`, an all-gather of the few per-slot values a step returns).

A lost host (`PeerWatch`, started with the engine's `Broadcast`): every process writes a heartbeat to
jax's coordination service each second and reads its peers' (process 0 all others', the others process
0's). When a peer's heartbeat stops for `GLM5_PEER_TIMEOUT_S` (default 10 s; killed, hung, partitioned)
process 0 marks itself lost (`lost()`: the HTTP server's /health and every request answer 503 with the
reason), gives in-flight requests `LOST_GRACE_S` to be answered, prints one line naming the lost process
on stderr and exits with status `LOST_EXIT_CODE`; another process whose leader is lost prints its line
and exits the same way at once. A collective that waits on a dead peer (which may never return) cannot
hold a process past that: the watch runs in its own threads and ends the process with os._exit.
The watch stands down when the engine stops normally (the "stop" operation).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["Broadcast", "LOST_EXIT_CODE", "PeerWatch", "is_leader", "lost"]

LOST_EXIT_CODE = 3
LOST_GRACE_S = 2.0                  # process 0: time for in-flight requests to get their 503 before it exits
PEER_TIMEOUT_ENV = "GLM5_PEER_TIMEOUT_S"
DEFAULT_PEER_TIMEOUT_S = 10.0
BEAT_S = 1.0
STARTUP_S = 120.0                   # a peer's first heartbeat may come this late (it is still loading)
_LOST: list = []                    # the reason, once a peer is lost (this process only)


def lost() -> str | None:
    """Why this process's mesh is broken (a peer process lost), or None while every peer answers."""
    return _LOST[0] if _LOST else None


def peer_timeout_s() -> float:
    """``$GLM5_PEER_TIMEOUT_S`` (default 10): how long a peer's heartbeat may stop before it is lost."""
    v = os.environ.get(PEER_TIMEOUT_ENV, "")
    try:
        t = float(v) if v.strip() else DEFAULT_PEER_TIMEOUT_S
    except ValueError:
        t = -1.0
    if not t > 0:
        raise ValueError(f"{PEER_TIMEOUT_ENV}={v!r} is invalid: a number of seconds > 0")
    return t


class PeerWatch:
    """Heartbeats through the coordination service's key-value store (``client``, default jax's): this
    process's counter under ``glm5_serve/beat/<process>``, the peers' read back; a peer whose counter has
    not moved for ``timeout_s`` (before its first beat: STARTUP_S) is lost (``on_lost(reason)``; default:
    :func:`_exit_lost`). Two daemon threads: one beats and reads (its calls may block on a dead
    coordinator), one judges the clock."""

    def __init__(self, *, client=None, process: int | None = None, count: int | None = None,
                 timeout_s: float | None = None, on_lost=None, beat_s: float = BEAT_S):
        if client is None:
            from jax._src import distributed
            client = distributed.global_state.client
        self.client, self.beat_s = client, beat_s
        self.me = jax.process_index() if process is None else process
        n = jax.process_count() if count is None else count
        self.peers = [p for p in range(n) if p != self.me] if self.me == 0 else [0]
        self.timeout_s = peer_timeout_s() if timeout_s is None else timeout_s
        self.on_lost = on_lost or _exit_lost
        now = time.monotonic()
        self.seen = {p: (None, now) for p in self.peers}     # peer -> (last counter, when it last moved)
        self.armed = True
        self._stop = threading.Event()
        for fn, name in ((self._beat, "beat"), (self._judge, "judge")):
            threading.Thread(target=fn, name=f"peer-watch-{name}", daemon=True).start()

    def stand_down(self) -> None:
        """A normal stop: peers leaving from now on are not lost."""
        self.armed = False
        self._stop.set()

    def _beat(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self.client.key_value_set(f"glm5_serve/beat/{self.me}", str(n), allow_overwrite=True)
                for p in self.peers:
                    v = self.client.key_value_try_get(f"glm5_serve/beat/{p}")
                    if v != self.seen[p][0]:
                        self.seen[p] = (v, time.monotonic())
            except Exception:       # the coordinator is gone or a key is not there yet: the judge decides
                pass
            self._stop.wait(self.beat_s)

    def _judge(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            now = time.monotonic()
            for p, (v, t) in self.seen.items():
                # a peer not heard from yet (still loading) gets STARTUP_S before it counts as lost
                if self.armed and now - t > (self.timeout_s if v is not None else max(self.timeout_s, STARTUP_S)):
                    role = "the leader, " if p == 0 else ""
                    self.stand_down()
                    self.on_lost(f"lost process {p} ({role}no heartbeat for {now - t:.0f} s, "
                                 f"{PEER_TIMEOUT_ENV}={self.timeout_s:g}): the mesh is broken")
                    return


def _exit_lost(reason: str) -> None:
    """The default on_lost: record the reason (process 0's HTTP answers 503 with it), give in-flight
    requests LOST_GRACE_S on process 0, then one line on stderr and exit LOST_EXIT_CODE."""
    _LOST.append(reason)
    if is_leader():
        time.sleep(LOST_GRACE_S)
    print(f"error: process {jax.process_index()}: {reason}; exiting with status {LOST_EXIT_CODE}",
          file=sys.stderr, flush=True)
    os._exit(LOST_EXIT_CODE)




def is_leader() -> bool:
    return jax.process_index() == 0


class Broadcast:
    """Process 0's Python values to every process, in order. Each call is two collectives (the length,
    then the pickled bytes padded to a power of two, so few buffer sizes ever compile). ``watch``: start a
    :class:`PeerWatch` (default: when jax.distributed is initialised); the "stop" operation stands it down."""

    def __init__(self, watch: bool | None = None):
        from jax._src import distributed
        if watch is None:
            watch = distributed.global_state.client is not None
        self.watch = PeerWatch() if watch else None

    def exchange(self, obj=None):
        data = np.frombuffer(pickle.dumps(obj), np.uint8) if is_leader() else np.zeros((0,), np.uint8)
        n = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
        buf = np.zeros((1 << max(n - 1, 1).bit_length(),), np.uint8)
        buf[:data.size] = data
        buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        obj = pickle.loads(buf[:n].tobytes())
        if self.watch is not None and isinstance(obj, tuple) and obj[:1] == ("stop",):
            self.watch.stand_down()
        return obj
