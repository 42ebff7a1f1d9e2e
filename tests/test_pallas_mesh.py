"""attention_impl="pallas" (the DSA Pallas kernels, interpret mode on CPU) under multi-device meshes on 8
forced CPU devices: the loss, metrics and gradients of a tiny DSA model equal attention_impl="xla" run
unsharded, in DSA's dense warm-up (indexer_loss="dense") and sparse stage, (a) under a mesh of batch axes
only (data:2,fsdp:2,expert:2: glm5_jax.attention.kernels runs the kernels per device in a shard_map over
them) and (b) under context parallelism (data:2,context:4: the kernels inside over_context's shard_map
with the chunk's global query offset). Every pallas_call of the traced program sees the per-device batch
(fails if the kernels ran on the whole, replicated batch)."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from glm5_jax import sharding
    from glm5_jax.config import ModelConfig
    from glm5_jax.model import init_params
    from glm5_jax.train import TrainConfig
    from glm5_jax.train.step import make_loss_fn
    assert len(jax.devices()) == 8
    MESH, B, STAGES = CASE
    T = 32
    r = np.random.default_rng(0)
    tok = r.integers(1, 200, size=(B, T)).astype(np.int32)
    seg = np.ones((B, T), np.int32); pos = np.tile(np.arange(T), (B, 1)).astype(np.int32)
    seg[0, 13:] = 2; pos[0, 13:] = np.arange(T - 13)            # two packed documents in row 0
    seg[3, 5:] = 2; pos[3, 5:] = np.arange(T - 5)
    mask = np.ones((B, T), np.float32); mask[1, -3:] = 0
    batch = {"tokens": tok, "targets": np.roll(tok, -1, 1), "positions": pos, "segment_ids": seg, "loss_mask": mask}
    # index_topk 8 < the documents' lengths: a real selection, and rows with fewer visible keys (-1 slots)
    base = dict(num_experts=4, num_layers=1, first_k_dense=0, index_topk=8, mtp_depth=0, param_dtype="float32",
                dtype="float32", attn_chunk=4, dsa_short_dense=0, moe_impl="a2a", d_model=64, attention="dsa",
                moe_kernel="ragged_dot")   # the only pallas_calls left are the DSA kernels
    single, mesh = sharding.single_device_mesh(), sharding.make_mesh(MESH)
    n_batch = B // int(np.prod([dict(mesh.shape).get(a, 1) for a in ("data", "fsdp", "expert")]))

    def pallas_batches(jaxpr, out):
        # leading dim of every >= 2-d operand of every pallas_call (the kernel's own jaxpr not entered)
        for e in jaxpr.eqns:
            if e.primitive.name == "pallas_call":
                out.append({v.aval.shape[0] for v in e.invars if len(getattr(v.aval, "shape", ())) >= 2})
                continue
            for p in e.params.values():
                for sub in (p if isinstance(p, (list, tuple)) else [p]):
                    if hasattr(sub, "eqns"):
                        pallas_batches(sub, out)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        pallas_batches(sub.jaxpr, out)
        return out

    cfg_x = ModelConfig(attention_impl="xla", **base)
    params = init_params(cfg_x, jax.random.PRNGKey(0))
    for iloss in STAGES:
        tc = TrainConfig(batch_size=B, seq_len=T, steps=2, warmup_steps=0, indexer_loss=iloss, z_loss=1e-3)
        out = []
        for m, impl in ((single, "xla"), (mesh, "pallas")):
            vg = jax.jit(jax.value_and_grad(make_loss_fn(cfg_x.replace(attention_impl=impl), tc), has_aux=True))
            with sharding.use_mesh(m):
                if impl == "pallas":
                    calls = pallas_batches(jax.make_jaxpr(vg)(params, batch).jaxpr, [])
                    # the sparse stage runs the indexer top-k and the sparse attention as kernels; the dense
                    # warm-up none (dense attention under a mesh is the jnp flash, and jit's dead-code
                    # elimination drops the top-k, which its loss does not use)
                    assert (bool(calls) == (iloss == "sparse")) and all(s == {n_batch} for s in calls), (n_batch, calls)
                compiled = vg.lower(params, batch).compile()
            (loss, (met, _)), g = compiled(params, batch)
            out.append(jax.device_get((met, g)))
        (m1, g1), (m2, g2) = out
        assert set(m1) == set(m2)
        for k in m1:
            np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=f"{iloss}: {k}")
        nonzero = 0
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves(g2)):
            scale = float(np.max(np.abs(a))) or 1.0
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5 * scale, err_msg=f"{iloss}: {jax.tree_util.keystr(path)}")
            nonzero += scale > 1e-12
        assert nonzero > len(jax.tree_util.tree_leaves(g1)) // 2
        print("equal", MESH, iloss, len(calls), "pallas calls at batch", n_batch, {k: float(v) for k, v in m1.items()})
    print("OK")
""")

CASES = {"batch_axes": ("data:2,fsdp:2,expert:2", 8, ("dense", "sparse")),
         "context": ("data:2,context:4", 4, ("dense", "sparse"))}


KERNELS = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from glm5_jax import sharding
    from glm5_jax.attention import kernels
    from glm5_jax.attention.context import from_layout, over_context, to_layout
    assert len(jax.devices()) == 8
    B, T, H, D, DV, HI, DI, K = 8, 32, 2, 16, 8, 2, 8, 6
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q, k = jax.random.normal(ks[0], (B, T, H, D)), jax.random.normal(ks[1], (B, T, 1, D))
    qi, ki, w = jax.random.normal(ks[2], (B, T, HI, DI)), jax.random.normal(ks[3], (B, T, DI)), jax.random.normal(ks[4], (B, T, HI))
    seg = jnp.asarray(np.repeat(np.r_[np.zeros(12), np.ones(T - 12)][None], B, 0).astype(np.int32))

    w_uv = jax.random.normal(ks[5], (DV, H, 4)) * 0.5

    def model(impl, ctx, idx_impl=None, mqa=False):
        def attend(loc, kv, off, consts):
            at = dict(q_offset=off, kv_segment_ids=None if off is None else kv["seg"])
            idx = kernels.indexer_topk(loc["qi"], kv["ki"], loc["w"], K, segment_ids=loc["seg"], impl=idx_impl or impl,
                                       **at)
            if mqa:   # the model's call: W_UV applied, the fused backward on the pallas path
                o = kernels.mqa_sparse_attention(loc["q"], kv["k"], consts["w_uv"], idx, scale=0.3, impl=impl)
            else:
                o = kernels.sparse_attention(loc["q"], kv["k"], None, idx, scale=0.3, impl=impl, dv=DV)
            return o, idx
        lay = (lambda x: to_layout(x, ctx)) if ctx > 1 else (lambda x: x)     # the train step's context layout
        nat = (lambda x: from_layout(x, ctx)) if ctx > 1 else (lambda x: x)
        def f(q, k, w_uv):
            loc = {"q": lay(q), "qi": lay(qi), "w": lay(w), "seg": lay(seg)}
            o, idx = over_context(attend, loc, {"k": lay(k), "ki": lay(ki), "seg": lay(seg)}, ("token", "token"), n=ctx,
                                  consts={"w_uv": w_uv})
            return jnp.sum(jnp.sin(nat(o)) * jnp.arange(T)[:, None, None] / T), nat(idx)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    for mqa in (False, True):
        (v0, i0), g0 = model("xla", 1, mqa=mqa)(q, k, w_uv)
        # the 128K default's pairing (tools.aot DEFAULTS): Pallas attention, jnp indexer, on the context mesh
        runs = [("data:2,fsdp:2,expert:2", 1, None), ("data:2,context:4", 4, None)] + (
            [("data:2,context:4", 4, "xla")] if mqa else [])
        for spec, ctx, idx_impl in runs:
            with sharding.use_mesh(sharding.make_mesh(spec)):
                fn = model("pallas", ctx, idx_impl, mqa)
                text = fn.lower(q, k, w_uv).as_text()
                (v1, i1), g1 = fn(q, k, w_uv)
            assert "shard_map" in text or "sdy.manual_computation" in text, spec
            np.testing.assert_array_equal(i1, i0)
            np.testing.assert_allclose(v1, v0, rtol=1e-5)
            for a, b in zip(g1, g0):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
            print("equal", spec, "mqa" if mqa else "", idx_impl or "")
    print("OK")
""")


def test_pallas_kernels_under_mesh_equal_xla_unsharded():
    """The two DSA kernels alone (indexer top-k -> sparse attention in MQA form, packed documents), value
    and gradients in q and k: attention_impl="pallas" under data:2,fsdp:2,expert:2 (per-device shard_map)
    and under data:2,context:4 (over_context, global query offsets) equal "xla" unsharded; same indices. The
    same for the model's call with W_UV (`mqa_sparse_attention`: the fused backward, W_UV's gradient summed
    over the shard_map), and on the context mesh with the indexer in jnp (the 128K default's pairing)."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", KERNELS], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert "OK" in res.stdout, res.stdout


@pytest.mark.slow  # interpret-mode Pallas inside the whole model, 4 compiles: ~2-4 min on 2 loaded cores
@pytest.mark.parametrize("case", sorted(CASES))
def test_pallas_under_mesh_equals_xla_unsharded(case):
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", f"CASE = {CASES[case]!r}\n" + SCRIPT], env=env, capture_output=True,
                         text=True, timeout=1800, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert "OK" in res.stdout, res.stdout
