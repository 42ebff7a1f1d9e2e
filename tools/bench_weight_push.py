"""Time a weight push from the trainer's process to rollout-server actors, by transport (docs/rl.md).

    python -m tools.bench_weight_push [--mb=256] [--servers=2] [--leaves=16] [--repeats=3] [--json]

The two transports of ``glm5_jax.agentic`` (``AgenticConfig.weight_transport``), each as
``Coordinator.push_weights`` runs it, to Ray actors that take the weights as ``RolloutServer`` does, up to
the engine (a device array of every leaf on the actor's device; the engine's own placement is not timed):
* ``object_store``: ``jax.device_get`` on the trainer, one ``ray.put``, each actor ``jnp.asarray``s the
  leaves it maps from the object store;
* ``transfer``: ``WeightPublisher.offer`` (a device-side copy of each shard, registered on the trainer's JAX
  transfer server), each actor pulls with ``glm5_jax.agentic.weights.receive``.
A policy of ``--leaves`` float32 leaves, ``--mb`` MB in all, on the trainer's device. Each push waits for
every actor; the first push of each transport is a warm-up (connections, compiles). Printed: median
seconds a push and the bytes a second into each server (policy bytes / push seconds).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


class _Receiver:
    """What a RolloutServer does with a push, without the engine."""

    def load_weights(self, version, params):
        import jax
        import jax.numpy as jnp
        jax.block_until_ready(jax.tree.map(jnp.asarray, params))
        return version

    def pull_weights(self, version, ticket, treedef_leaves):
        import jax

        from glm5_jax.agentic.weights import receive
        jax.block_until_ready(receive(ticket, jax.tree.structure(list(range(treedef_leaves)))))
        return version


def bench(mb: float, servers: int, leaves: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import ray

    from glm5_jax.agentic.server import worker_env
    from glm5_jax.agentic.weights import WeightPublisher
    n = int(mb * 2**20 / 4 / leaves)
    params = [jnp.full((n,), i, jnp.float32) for i in range(leaves)]
    nbytes = sum(a.nbytes for a in params)
    ray.init(num_cpus=max(2, servers), include_dashboard=False, log_to_driver=False)
    try:
        actor = ray.remote(_Receiver).options(num_cpus=0, runtime_env=worker_env(1))
        hs = [actor.remote() for _ in range(servers)]
        ray.get([h.load_weights.remote(0, [1]) for h in hs])
        pub = WeightPublisher()
        out = {}
        for name in ("object_store", "transfer"):
            times = []
            for i in range(repeats + 1):
                t = time.perf_counter()
                if name == "object_store":
                    ref = ray.put(jax.device_get(params))
                    ray.get([h.load_weights.remote(i, ref) for h in hs])
                else:
                    tickets = pub.offer(params, servers)
                    ray.get([h.pull_weights.remote(i, tk, leaves) for h, tk in zip(hs, tickets)])
                times.append(time.perf_counter() - t)
            med = statistics.median(times[1:])
            out[name] = {"push_seconds": med, "bytes_per_s_per_server": nbytes / med, "all_seconds": times}
        return {"policy_bytes": nbytes, "servers": servers, "leaves": leaves, "repeats": repeats, **out}
    finally:
        ray.shutdown()


def define_flags(fv) -> None:
    """This CLI's flags, defined into `fv` (its own FlagValues, tools.flagparse)."""
    from absl import flags
    flags.DEFINE_float("mb", 256, "policy size, MB", flag_values=fv)
    flags.DEFINE_integer("servers", 2, "receiving actors", flag_values=fv)
    flags.DEFINE_integer("leaves", 16, "policy leaves", flag_values=fv)
    flags.DEFINE_integer("repeats", 3, "timed pushes a transport (after one warm-up)", flag_values=fv)
    flags.DEFINE_bool("json", False, "last stdout line: one JSON object", flag_values=fv)


def main(argv=None) -> int:
    from absl import flags

    from glm5_jax.cli import USAGE_EXIT
    from tools.flagparse import parse
    fv = flags.FlagValues()
    define_flags(fv)
    rest = parse(fv, "tools.bench_weight_push", argv)
    if isinstance(rest, int):
        return rest
    if rest or fv.mb <= 0 or min(fv.servers, fv.leaves, fv.repeats) < 1:
        print("error: --mb must be > 0; --servers, --leaves, --repeats >= 1; no positional arguments", file=sys.stderr)
        return USAGE_EXIT
    r = bench(fv.mb, fv.servers, fv.leaves, fv.repeats)
    for name in ("object_store", "transfer"):
        x = r[name]
        print(f"{name:<13} {x['push_seconds']:.3f} s a push of {r['policy_bytes'] / 1e6:.0f} MB to {r['servers']} "
              f"servers ({x['bytes_per_s_per_server'] / 1e9:.2f} GB/s into each)")
    if fv.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
