"""Coordinator and router for the rollout fleet; group bookkeeping for the trainer.

* ``HashRing``: consistent hashing (md5, ``replicas`` virtual nodes per worker) of a rollout id to a
  worker, so every turn of a trajectory reaches the same server (KV-cache reuse) and removing a
  worker moves only the ids it owned.
* ``Coordinator``: the worker registry. A heartbeat thread pings every worker each ``heartbeat_s``;
  a worker that fails a ping (or a request) is deregistered (taken off the ring) for good.
  ``generate`` routes one request and raises ``WorkerLost`` when its worker died; the agent pool
  then discards the partial record and re-queues the trajectory from its prompt, so a trajectory is
  trained at most once and never lost.
* ``filter_group``: the staleness bound (a sample whose oldest token is more than ``tau`` versions
  behind the trainer is dropped), broken samples removed, and group refill (more than half valid:
  the invalid slots are filled by repeating valid samples, cycling; otherwise the group is dropped).
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from typing import Callable, Dict, List, Optional, Sequence

__all__ = ["HashRing", "WorkerLost", "NoWorkers", "Coordinator", "filter_group"]


def _h(key: str) -> int:
    return int.from_bytes(hashlib.md5(key.encode()).digest()[:8], "big")


class HashRing:
    def __init__(self, names: Sequence[str] = (), replicas: int = 64):
        self.replicas = replicas
        self._keys: List[int] = []
        self._owner: Dict[int, str] = {}
        for n in names:
            self.add(n)

    def add(self, name: str) -> None:
        for i in range(self.replicas):
            k = _h(f"{name}#{i}")
            if k not in self._owner:
                bisect.insort(self._keys, k)
                self._owner[k] = name

    def remove(self, name: str) -> None:
        dead = [k for k, n in self._owner.items() if n == name]
        for k in dead:
            del self._owner[k]
        dead = set(dead)
        self._keys = [k for k in self._keys if k not in dead]

    @property
    def names(self) -> set:
        return set(self._owner.values())

    def route(self, key: str) -> str:
        if not self._keys:
            raise NoWorkers("no live rollout worker on the ring")
        i = bisect.bisect(self._keys, _h(key)) % len(self._keys)
        return self._owner[self._keys[i]]


class WorkerLost(RuntimeError):
    """The worker serving a request died; the trajectory must be re-queued."""


class NoWorkers(RuntimeError):
    pass


class Coordinator:
    def __init__(self, workers: Dict[str, object], *, heartbeat_s: float = 1.0, ping_timeout_s: float = 60.0,
                 log: Callable[[str], None] = lambda s: None):
        self.workers = dict(workers)
        self.ring = HashRing(self.workers)
        self.dead: List[str] = []
        self.heartbeat_s, self.ping_timeout_s, self.log = heartbeat_s, ping_timeout_s, log
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._unsettled: Dict[str, object] = {}      # replies of an unawaited weight push

    # -------------------------------------------------------------- registry
    def live(self) -> Dict[str, object]:
        with self._lock:
            return {n: h for n, h in self.workers.items() if n not in self.dead}

    def deregister(self, name: str, why: str = "") -> None:
        with self._lock:
            if name in self.dead:
                return
            self.dead.append(name)
            self.ring.remove(name)
        self.log(f"[coordinator] deregistered {name}: {why}")

    def route(self, rollout_id: str) -> str:
        with self._lock:
            return self.ring.route(rollout_id)

    # -------------------------------------------------------------- heartbeats
    def check_health(self) -> List[str]:
        """Ping every live worker once; deregister the ones that fail. Returns the live names."""
        import ray
        refs = {n: h.ping.remote() for n, h in self.live().items()}
        for n, ref in refs.items():
            try:
                ray.get(ref, timeout=self.ping_timeout_s)
            except Exception as e:    # actor died / unreachable / timed out: all mean "not serving"
                self.deregister(n, f"heartbeat failed ({type(e).__name__})")
        return sorted(self.live())

    def start_heartbeats(self) -> None:
        def loop():
            while not self._stop.wait(self.heartbeat_s):
                self.check_health()
        self._thread = threading.Thread(target=loop, name="heartbeats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ping_timeout_s + 1)

    # -------------------------------------------------------------- requests
    def generate(self, rollout_id: str, request_id: str, prompt_ids, max_new_tokens: Optional[int] = None) -> dict:
        import ray
        from ray.exceptions import RayActorError
        name = self.route(rollout_id)
        try:
            return ray.get(self.workers[name].generate.remote(request_id, prompt_ids, max_new_tokens))
        except RayActorError as e:
            self.deregister(name, f"request failed ({type(e).__name__})")
            raise WorkerLost(name) from e

    def push_weights(self, version: int, params, wait: bool = True, publisher=None) -> List[str]:
        """Send ``params`` as ``version`` to every live worker; a worker that fails is deregistered. Returns
        the names that loaded it. ``wait=False`` (the asynchronous trainer): return at once with the names
        it was sent to; the replies are checked at the next push or ``settle()`` (a worker applies its
        pushes in order, and every token carries the version that made it, so the trainer need not wait
        for a busy server to swap weights). Without ``publisher``: ``params`` are host arrays, put once into
        the object store. With a ``glm5_jax.agentic.weights.WeightPublisher``: ``params`` are the trainer's
        device arrays, offered on its transfer server; each worker gets a ticket and pulls them."""
        import ray
        self.settle()
        live = self.live()
        if publisher is not None:
            tickets = dict(zip(live, publisher.offer(params, len(live))))
            refs = {n: h.pull_weights.remote(version, tickets[n]) for n, h in live.items()}
        else:
            ref = ray.put(params)
            refs = {n: h.load_weights.remote(version, ref) for n, h in live.items()}
        if not wait:
            self._unsettled = refs
            return sorted(refs)
        return self._check(refs)

    def settle(self) -> List[str]:
        """Wait for the replies of an unawaited push; deregister the workers that failed it."""
        refs, self._unsettled = self._unsettled, {}
        return self._check(refs)

    def _check(self, refs: dict) -> List[str]:
        import ray
        ok = []
        for n, r in refs.items():
            try:
                ray.get(r, timeout=self.ping_timeout_s)
                ok.append(n)
            except Exception as e:
                self.deregister(n, f"weight push failed ({type(e).__name__})")
        return ok


def filter_group(records: Sequence, version: int, tau: int, valid_status: Sequence[str] = ("done",)):
    """One group's records -> (records to train or None, {"stale", "broken", "refilled", "dropped"}).

    A record is invalid if stale (``version - record.min_version > tau``) or broken (status not in
    ``valid_status``, e.g. an environment crash). More than half valid: invalid slots are filled by
    copies of valid records (cycling, ``refill_of`` set, advantage computed over the refilled group);
    otherwise the whole group is dropped.
    """
    import copy
    stale = [r for r in records if r.status in valid_status and version - r.min_version > tau]
    broken = [r for r in records if r.status not in valid_status]
    valid = [r for r in records if r.status in valid_status and version - r.min_version <= tau]
    info = {"stale": len(stale), "broken": len(broken), "refilled": 0, "dropped": 0}
    if 2 * len(valid) <= len(records):
        info["dropped"] = len(records)
        return None, info
    out = list(valid)
    i = 0
    while len(out) < len(records):
        c = copy.copy(valid[i % len(valid)])
        c.refill_of = c.traj_id
        out.append(c)
        i += 1
    info["refilled"] = len(out) - len(valid)
    return out, info
