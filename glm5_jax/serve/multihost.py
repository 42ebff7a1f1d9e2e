"""The serving engine over several processes (a multi-host pod slice): one scheduling decision per step,
the same on every process.

Process 0 runs the scheduler (and the HTTP server); before each device operation it broadcasts the
operation and its host arguments (`Broadcast.exchange`), and every other process (`Engine.follow`)
receives it and runs the same operation, so every process issues the same programs with the same
arguments in the same order (a jitted program over a multi-process mesh needs exactly that). Host
inputs become global arrays from the identical copies every process holds (`to_global`); outputs come
back to every process whole (`to_host`, an all-gather of the few per-slot values a step returns).
"""

from __future__ import annotations

import pickle

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["Broadcast", "is_leader", "multi_process", "to_global", "to_host"]


def multi_process(mesh=None) -> bool:
    """Whether `mesh` (default: every device) spans several processes."""
    if mesh is None:
        return jax.process_count() > 1
    return len({d.process_index for d in mesh.devices.flat}) > 1


def is_leader() -> bool:
    return jax.process_index() == 0


class Broadcast:
    """Process 0's Python values to every process, in order. Each call is two collectives (the length,
    then the pickled bytes padded to a power of two, so few buffer sizes ever compile)."""

    def exchange(self, obj=None):
        data = np.frombuffer(pickle.dumps(obj), np.uint8) if is_leader() else np.zeros((0,), np.uint8)
        n = int(multihost_utils.broadcast_one_to_all(np.int64(data.size)))
        buf = np.zeros((1 << max(n - 1, 1).bit_length(),), np.uint8)
        buf[:data.size] = data
        buf = np.asarray(multihost_utils.broadcast_one_to_all(buf))
        return pickle.loads(buf[:n].tobytes())


def to_global(value, sharding):
    """A host value that every process holds identically -> a global array with `sharding`; a global jax
    array is resharded on the devices (device to device)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(tree):
    """Device outputs -> numpy on this process (all-gathered where other processes hold shards)."""
    def get(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)
    return jax.tree.map(get, tree)
