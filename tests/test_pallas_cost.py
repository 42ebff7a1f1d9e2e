"""Every DSA Pallas kernel carries a cost estimate that tools.budget counts: the sparse attention forward +
gradient and the lightning-indexer top-k compiled by the real TPU compiler (libtpu, deviceless), their
compiled FLOPs against closed forms of the shapes, and no kernel left in `unknown_cost_kernels`."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from tools.budget import hlo_budget, mosaic_cost, parse_hlo

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not importable: install the '.[tpu]' extra")


def _one_tpu():
    from jax.experimental import topologies
    devs = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
    mesh = jax.sharding.Mesh(devs[:1], ("x",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _kernels(text):
    """[(name, cost or None)] of every tpu_custom_call in the compiled module."""
    out = []
    for instrs in parse_hlo(text)["computations"].values():
        for ins in instrs:
            if 'custom_call_target="tpu_custom_call"' in ins["rest"]:
                out.append((ins["name"], mosaic_cost(ins)))
    return out


@needs_libtpu
def test_sparse_attention_fwd_bwd_compiled_flops_are_the_closed_form():
    """q [B, T, H, Dq] over K selected rows, value = the first Dv columns (MLA's MQA form): forward kernel
    2 B T H K (Dq + Dv), backward dq kernel 2 B T H K (2 Dq + Dv), the XLA dK / dV row products
    2 B T H K (Dq + Dv); the budget's FLOPs equal their sum exactly (the backward's chunk loop counted
    by its trip count) and every Mosaic kernel has a cost estimate."""
    from pallas_kernels import dsa
    rep = _one_tpu()
    b, t, h, dq, dv, kk = 1, 256, 8, 192, 128, 128
    scale = dq ** -0.5

    def loss(q, k, idx):
        o = dsa.sparse_attention(q, k, k[..., :dv], idx, scale=scale, interpret=False)
        return jnp.sum(o.astype(jnp.float32))

    sds = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=rep)
    c = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(sds((b, t, h, dq)), sds((b, t, 1, dq)),
                                                      sds((b, t, kk), jnp.int32)).compile()
    text = c.as_text()
    bud = hlo_budget(text)
    kernels = _kernels(text)
    assert len(kernels) == 2 and bud["unknown_cost_kernels"] == [], kernels
    fwd, bwd, rows = (2 * b * t * h * kk * (dq + dv), 2 * b * t * h * kk * (2 * dq + dv),
                      2 * b * t * h * kk * (dq + dv))
    assert sorted(k["flops"] for _, k in kernels) == sorted([fwd, bwd])
    assert bud["flops"] == fwd + bwd + rows, (bud["flops"], fwd + bwd + rows, bud["flops_by_source"])


@needs_libtpu
def test_fused_mqa_backward_compiled_flops_and_bytes_are_the_closed_form():
    """dsa.sparse_mqa_uv's gradient (q, k, W_UV) compiled for TPU: the forward kernel 2 B T H K (Dq + r), the
    fused backward kernel 12 B T H K Dq (three matmuls over the K rows) and the backward's W_UV einsums (dO and
    dW_UV, 2 B T H r dv each; the forward's is dead in a gradient alone) are all the FLOPs the budget counts; the
    backward kernel's bytes are its K rows
    once in bfloat16 plus its dK rows read and written in float32, besides the per-query operands."""
    from pallas_kernels import dsa
    rep = _one_tpu()
    b, t, h, dq, r, dv, kk = 1, 256, 8, 192, 128, 64, 128

    def loss(q, k, w_uv, idx):
        return jnp.sum(dsa.sparse_mqa_uv(q, k, w_uv, idx, scale=dq ** -0.5, interpret=False).astype(jnp.float32))

    sds = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=rep)
    c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(sds((b, t, h, dq)), sds((b, t, 1, dq)), sds((r, h, dv)),
                                                         sds((b, t, kk), jnp.int32)).compile()
    text = c.as_text()
    bud = hlo_budget(text)
    kernels = _kernels(text)
    assert len(kernels) == 2 and bud["unknown_cost_kernels"] == [], kernels
    fwd, bwd = 2 * b * t * h * kk * (dq + r), 12 * b * t * h * kk * dq
    assert sorted(k["flops"] for _, k in kernels) == sorted([fwd, bwd])
    assert bud["flops"] == fwd + bwd + 2 * 2 * b * t * h * r * dv, (bud["flops"], bud["flops_by_source"])
    rows = b * t * kk * dq * (2 + 4 + 4)
    io = 2 * b * t * kk * 4 + b * t * h * (2 * dq * 2 + 4) + b * t * 2 * h * dq * 2
    assert max(k["bytes_accessed"] for _, k in kernels if k["flops"] == bwd) == rows + io


@needs_libtpu
def test_indexer_topk_kernels_carry_their_cost_estimates():
    """The block bound (8 B T nk Hi Di: four [T, Di] x [Di, nk] products per index head) and every token
    scoring round (2 B T n bk Hi Di for n table entries) compiled for TPU: each Mosaic kernel's counted
    FLOPs are those closed forms, none unknown. (The token pass is a data-dependent while loop: the
    budget counts its round once and lists the loop in unknown_trip_loops.)"""
    from pallas_kernels import dsa
    rep = _one_tpu()
    b, t, hi, di, topk, bk = 1, 1024, 4, 128, 128, 128
    sds = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=rep)
    c = jax.jit(lambda q, k, w: dsa.indexer_topk(q, k, w, topk, interpret=False)).lower(
        sds((b, t, hi, di)), sds((b, t, di)), sds((b, t, hi), jnp.float32)).compile()
    text = c.as_text()
    bud = hlo_budget(text)
    kernels = _kernels(text)
    assert bud["unknown_cost_kernels"] == [] and all(k is not None for _, k in kernels), kernels
    nk = t // bk
    bound = 8 * b * t * nk * hi * di
    probe = 2 * b * t * (topk // bk) * bk * hi * di          # ceil(topk / bk) best-bounded blocks
    rnd = 2 * b * t * (2 * topk // bk) * bk * hi * di        # round_blocks = ceil(2 topk / bk)
    assert sorted(k["flops"] for _, k in kernels) == sorted([bound, probe, rnd]), kernels
    assert bud["flops"] >= bound + probe + rnd
