"""The routed experts' grouped matmul (pallas_kernels.gmm): the megablox kernels (gmm forward / dX, tgmm dW;
interpret mode on CPU) equal `jax.lax.ragged_dot` in outputs and in both gradients, alone and inside the
expert-parallel MoE layer on 8 CPU devices (moe_impl="a2a", the expert axis) for balanced, skewed,
empty-expert and dropless routing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gmm import grouped_matmul, tiling
from tests.test_scaleout import run8


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (1e-9 + np.max(np.abs(b)))) if b.size else 0.0


@pytest.mark.parametrize("sizes", [(10, 10, 10, 10), (33, 0, 7, 0), (0, 0, 0, 20), (0, 0, 0, 0), (5, 9, 2, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_megablox_equals_ragged_dot(sizes, dtype):
    """Forward, dX and dW of the megablox path equal ragged_dot's (float32 exactly up to summation order,
    bf16 within its rounding), including empty groups and rows past the last group (zero out, zero grads)."""
    m, k, n, g = 40, 16, 24, 4
    keys = jax.random.split(jax.random.PRNGKey(sum(sizes)), 3)
    dt = jnp.dtype(dtype)
    x = jax.random.normal(keys[0], (m, k)).astype(dt)
    w = jax.random.normal(keys[1], (g, k, n)).astype(dt)
    ct = jax.random.normal(keys[2], (m, n)).astype(dt)
    s = jnp.asarray(sizes, jnp.int32)

    def run(impl):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, s, impl=impl), x, w)
        return (out, *vjp(ct))

    want, got = run("ragged_dot"), run("megablox")
    tol = 1e-5 if dtype == "float32" else 2e-2
    for name, a, b in zip(("out", "dx", "dw"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert _rel(a, b) <= tol, (name, _rel(a, b))
    used = sum(sizes)
    assert not np.any(np.asarray(got[0][used:], np.float32)) and not np.any(np.asarray(got[1][used:], np.float32))


def test_tiling_divides_and_is_mosaic_aligned():
    """Row tiles are multiples of 8 (rows are padded to whole tiles); K / N tiles divide the dimension and
    are multiples of 128 lanes, or the whole dimension; GLM-5's expert shapes get 512 / 1024 / 1024."""
    assert tiling(40960, 6144, 2048) == (512, 1024, 1024)
    assert tiling(40, 16, 24) == (40, 16, 24)
    tm, tk, tn = tiling(1000, 6144, 1536)
    assert tm % 8 == 0 and 6144 % tk == 0 and tk % 128 == 0 and 1536 % tn == 0 and tn % 128 == 0
    with pytest.raises(ValueError, match="moe_kernel"):
        grouped_matmul(jnp.zeros((8, 4)), jnp.zeros((2, 4, 4)), jnp.asarray([4, 4]), impl="tgmm")


SCRIPT = """
    import json, jax, jax.numpy as jnp, numpy as np
    from glm5_jax.layers.moe import Experts
    from glm5_jax import sharding
    assert len(jax.devices()) == 8
    N, D, F, E, K = 64, 8, 16, 8, 2
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(N, D)), jnp.float32)
    w = jnp.asarray(r.uniform(0.2, 1.0, size=(N, K)), jnp.float32)
    ct = jnp.asarray(r.normal(size=(N, D)), jnp.float32)
    mesh = sharding.make_mesh("expert:8")
    slot = (np.arange(N)[:, None] * K + np.arange(K)[None, :]) % (8 * K)
    routings = {"balanced": slot % E,
                "skewed": np.where(r.random((N, K)) < 0.6, 1, r.integers(0, E, (N, K))),
                "empty_experts": np.where(np.arange(K)[None, :] == 0, 2, 5) + 0 * np.arange(N)[:, None]}

    def program(kernel, **kw):
        mod = Experts(E, F, "a2a", stddev=0.3, kernel=kernel, **kw)
        params = mod.init(jax.random.PRNGKey(1), x, w, jnp.zeros((N, K), jnp.int32))
        def f(params, x, w, ids):
            (out, st), vjp = jax.vjp(lambda p, x, w: mod.apply(p, x, w, ids, mutable=["intermediates"]), params, x, w)
            return out, vjp(((ct, jax.tree_util.tree_map(jnp.zeros_like, st))))
        def run(*a):
            with sharding.use_mesh(mesh):
                return jax.jit(f)(*a)
        return params, run

    err = lambda a, b: float(max(np.max(np.abs(np.asarray(p) - np.asarray(q))) / (1e-6 + np.max(np.abs(np.asarray(q))))
                                for p, q in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))))
    res = {}
    for mode, kw in {"capacity": dict(capacity_factor=1.25), "dropless": dict(capacity_factor=0.0, round_factor=1.25)}.items():
        params, ref = program("ragged_dot", **kw)
        _, kern = program("megablox", **kw)
        for name, ids in routings.items():
            ids = jnp.asarray(ids, jnp.int32)
            want, got = ref(params, x, w, ids), kern(params, x, w, ids)
            res[f"{mode}|{name}"] = {"out": err(got[0], want[0]), "grad": err(got[1], want[1]),
                                     "nonzero": float(np.max(np.abs(np.asarray(want[0]))))}
    print("RESULTS " + json.dumps(res))
    print("OK")
"""


def test_a2a_moe_megablox_equals_ragged_dot_on_8_devices():
    """Under the expert axis (expert:8, one local expert a device), the a2a layer with moe_kernel=megablox
    gives the outputs and gradients (tokens, router weights, gate / up / down) of moe_kernel=ragged_dot,
    with capacity 1.25 and dropless, for balanced, skewed and empty-expert routing (6 of 8 experts get
    no token)."""
    out = run8(SCRIPT, timeout=300)
    res = json.loads(next(l for l in out.splitlines() if l.startswith("RESULTS "))[len("RESULTS "):])
    assert len(res) == 6, res
    for key, r in res.items():
        assert r["nonzero"] > 0, key                      # the comparison is over real outputs
        assert r["out"] < 2e-6 and r["grad"] < 2e-6, (key, r)
