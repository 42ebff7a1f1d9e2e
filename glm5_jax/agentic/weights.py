"""Weight pushes from the trainer's process to the rollout servers' processes without the object store.

Transport ``"transfer"`` (``AgenticConfig.weight_transport``; docs/agentic_rl.md, "Weight pushes"): the
trainer's process runs a JAX transfer server (``jax.experimental.transfer``, in the pinned jax 0.10.2;
it runs on CPU devices too). A push offers the policy's device arrays to each receiving server under a
ticket of its own (``await_pull``: one uuid per push and server, as a registered pull is consumed by one
``pull``); the Ray call to the server carries only the ticket (address, uuid, the leaves' shapes and
shard slices: a few KB). The server's process runs a transfer server of its own, connects to the
trainer's and pulls the arrays from the trainer's devices into its own device: no pickling, no object
store, no driver, no host gather on the trainer; then ``Engine.update_weights`` lays them out in its
serving shards (device to device within the server).

A pull lands with the sender's shard structure, so the trainer offers each leaf's distinct shards
(``replica_id == 0``) as single-device arrays and the server assembles each leaf on its first device
before placing it (a transient of one policy copy on that device). The offered shards are copies on the
trainer's devices (the next train step donates the state's buffers while a slow server may still be
pulling); they are released once pulled. A server that dies before pulling leaves its offer registered
(one policy copy per such push, held until the trainer's process ends).
"""

from __future__ import annotations

import functools
import itertools
import threading

import numpy as np

__all__ = ["WeightPublisher", "receive", "transfer_available"]


def transfer_available() -> bool:
    """Whether the pinned jax has the transfer server (``jax.experimental.transfer``)."""
    try:
        from jax.experimental import transfer
        return hasattr(transfer, "start_transfer_server")
    except ImportError:
        return False


def _start_server(host: str):
    import jax
    from jax.experimental import transfer
    return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])


def _bounds(index, shape) -> list:
    return [[s.start or 0, dim if s.stop is None else s.stop] for s, dim in zip(index, shape)]


class WeightPublisher:
    """The trainer's side: ``offer(params, n)`` -> n tickets, one a receiving server."""

    def __init__(self, host: str = "127.0.0.1"):
        self.server = _start_server(host)
        self.address = self.server.address()
        self._uuids = itertools.count(1)

    def offer(self, params, receivers: int) -> list:
        """Register ``params`` (jax Arrays on this process's devices) for ``receivers`` pulls. Each ticket:
        {"address", "uuid", "leaves": [{"shape", "dtype", "pieces": [slice bounds of each offered shard]}],
        "bytes": the bytes a pull moves}."""
        import jax
        import jax.numpy as jnp
        pieces, leaves = [], []
        for a in jax.tree.leaves(params):
            if not isinstance(a, jax.Array):
                raise TypeError(f"WeightPublisher.offer: a leaf is {type(a).__name__}, not a jax Array on this "
                                "process's devices (the transfer moves device arrays)")
            shards = [s for s in a.addressable_shards if s.replica_id == 0]
            leaves.append({"shape": list(a.shape), "dtype": str(a.dtype),
                           "pieces": [_bounds(s.index, a.shape) for s in shards]})
            pieces += [jnp.copy(s.data) for s in shards]     # on the shard's device; the state's buffers get donated
        nbytes = int(sum(p.size * p.dtype.itemsize for p in pieces))
        tickets = []
        for _ in range(receivers):
            uuid = next(self._uuids)
            self.server.await_pull(uuid, pieces)
            tickets.append({"address": self.address, "uuid": uuid, "leaves": leaves, "bytes": nbytes})
        return tickets


_LOCAL: dict = {}
_LOCK = threading.Lock()


def _connection(address: str):
    """This process's transfer server and its connection to ``address`` (one each, reused)."""
    with _LOCK:
        if "server" not in _LOCAL:
            _LOCAL["server"] = _start_server("127.0.0.1")
        if address not in _LOCAL:
            _LOCAL[address] = _LOCAL["server"].connect(address)
        return _LOCAL[address]


@functools.cache
def _assemble():
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def assemble(parts, starts, shape):
        full = jnp.zeros(shape, parts[0].dtype)
        for x, start in zip(parts, starts):
            full = jax.lax.dynamic_update_slice(full, x, start)
        return full
    return assemble


def receive(ticket: dict, treedef, device=None):
    """Pull a ticket's arrays onto ``device`` (default this process's first device) -> the policy as
    ``treedef`` (the receiver's own parameter tree structure: both sides flatten the same model's tree)."""
    import jax
    device = device or jax.devices()[0]
    if treedef.num_leaves != len(ticket["leaves"]):
        raise ValueError(f"weight ticket has {len(ticket['leaves'])} leaves; this server's policy has "
                         f"{treedef.num_leaves}: trainer and server run different models")
    sh = jax.sharding.SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(tuple(hi - lo for lo, hi in b), np.dtype(leaf["dtype"]), sharding=sh)
             for leaf in ticket["leaves"] for b in leaf["pieces"]]
    got = iter(_connection(ticket["address"]).pull(ticket["uuid"], specs))
    out = []
    for leaf in ticket["leaves"]:
        shape = tuple(leaf["shape"])
        parts = [(b, next(got)) for b in leaf["pieces"]]
        if len(parts) == 1 and parts[0][1].shape == shape:
            out.append(parts[0][1])
            continue
        # assembled on the device by one program: the pieces never reach the host
        out.append(_assemble()(tuple(x for _, x in parts), tuple(tuple(lo for lo, _ in b) for b, _ in parts), shape))
    return jax.tree.unflatten(treedef, out)
