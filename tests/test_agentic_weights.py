"""Weight pushes over JAX's transfer server (glm5_jax.agentic.weights), on 8 forced CPU devices (a subprocess:
the device count is fixed at JAX start-up; ~10 s).

A policy sharded over a data:2,fsdp:4 mesh (as the agentic trainer holds it) is offered to two receivers;
each pull, with every host <-> device transfer disallowed (``jax.transfer_guard``), gives back every leaf
bitwise (float32 and bfloat16 leaves, split and replicated ones) on the receiver's device; the ticket that
the Ray call carries holds no array (it is plain JSON, a few KB, while the policy is larger); a receiver
whose model differs gets an error naming both leaf counts. The Ray path with a worker killed is
tests/test_agentic_mesh.py and tests/test_agentic_ray.py (slow; the default transport is this one).
"""

import os
import subprocess
import sys
import textwrap

import pytest

from glm5_jax.agentic.weights import transfer_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from glm5_jax.agentic.weights import WeightPublisher, receive
    from glm5_jax.parallel.distributed import build_mesh
    assert len(jax.devices()) == 8
    mesh = build_mesh("data:2,fsdp:4")
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    host = {"embed": jax.random.normal(k[0], (64, 24)),
            "layers": {"w": jax.random.normal(k[1], (3, 24, 40)).astype(jnp.bfloat16),
                       "scale": jax.random.normal(k[2], (3, 24))}}
    specs = {"embed": P("fsdp", None), "layers": {"w": P(None, None, "fsdp"), "scale": P()}}
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), host, specs)
    pub = WeightPublisher()
    with jax.transfer_guard("disallow"):
        tickets = pub.offer(params, 2)
        got = [receive(t, jax.tree.structure(params), jax.devices()[i + 6]) for i, t in enumerate(tickets)]
        jax.block_until_ready(got)
    for i, g in enumerate(got):
        for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(g)):
            assert b.dtype == a.dtype and b.devices() == {jax.devices()[i + 6]}, (b.dtype, b.devices())
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    policy = sum(a.nbytes for a in jax.tree.leaves(host))
    size = len(json.dumps(tickets[0]))
    assert tickets[0]["bytes"] == policy and size < policy / 4, (size, policy)
    try:
        receive(pub.offer(params, 1)[0], jax.tree.structure({"only": 0}))
        raise SystemExit("a mismatched tree was accepted")
    except ValueError as e:
        assert "3 leaves" in str(e) and "has 1" in str(e), e
    print("OK", size, policy)
""")


@pytest.mark.skipif(not transfer_available(), reason="the pinned jax has no jax.experimental.transfer")
def test_transfer_push_moves_each_leaf_bitwise_device_to_device_with_a_small_ticket():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
