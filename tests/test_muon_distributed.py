"""Distributed Muon / Muon Split (glm5_jax.optim.distributed, issue 31): on 8 forced CPU devices, with the
parameters sharded by the model's logical rules, the optimizer updates of two consecutive steps equal the
single-device optimizer's (float32, rtol 1e-5 plus an atol of 1e-5 x the leaf's largest update: NS runs the
same float32 matmuls in another order), for muon and muon_split, with one layer of a stack frozen
(slice_paths), and the compiled update really exchanges matrix shards (an all-to-all is in the program)."""

from tests.test_scaleout import run8

SCRIPT = """
    import functools, jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from glm5_jax.config import ModelConfig
    from glm5_jax.model import init_params, layer_slice_paths
    from glm5_jax.optim import make_optimizer
    from glm5_jax.train.state import opt_state_specs, param_specs
    from glm5_jax import sharding
    assert len(jax.devices()) == 8
    # a stack of 3 MoE layers (8 experts): layer and expert batch axes, and leaves whose matrix count does not
    # divide the group (zero-padded)
    cfg = ModelConfig(num_experts=8, num_layers=3, first_k_dense=0, mtp_depth=0)
    params = init_params(cfg, jax.random.PRNGKey(1))
    specs = param_specs(cfg)
    r = np.random.default_rng(0)
    grads = [jax.tree.map(lambda p: jnp.asarray(r.normal(size=p.shape), p.dtype), params) for _ in range(2)]
    named = lambda mesh, t: jax.tree.map(lambda s: NamedSharding(mesh, s), t, is_leaf=lambda x: isinstance(x, P))

    def updates(name, mesh, frozen):
        kw = dict(learning_rate=1e-2, split_spec=cfg, grad_clip=1.0, frozen_patterns=frozen,
                  slice_paths=functools.partial(layer_slice_paths, cfg))
        if mesh is None:                      # the single-device optimizer, as experiments run it
            tx, _ = make_optimizer(name, params, **kw)
            st, upd, p, put = tx.init(params), jax.jit(tx.update), params, lambda g: g
        else:
            tx, _ = make_optimizer(name, params, param_specs=specs, **kw)
            psh = named(mesh, specs)
            osh = named(mesh, opt_state_specs(params, specs, jax.eval_shape(tx.init, params)))
            p, put = jax.device_put(params, psh), lambda g: jax.device_put(g, psh)
            st = jax.jit(tx.init, out_shardings=osh)(p)
            upd = jax.jit(tx.update, in_shardings=(psh, osh, psh), out_shardings=(psh, osh))
        outs = []
        with sharding.use_mesh(mesh if mesh is not None else sharding.single_device_mesh()):
            if mesh is not None:
                assert "all_to_all" in upd.lower(grads[0], st, p).as_text(), "matrix shards not exchanged"
            for g in grads:
                u, st = upd(put(g), st, p)
                outs.append(u)
        return outs

    # fsdp x expert on the embed / latent dims (m), tensor on the heads (n; Muon Split keeps heads whole)
    mesh = sharding.make_mesh("fsdp:2,expert:2,tensor:2")
    for name, frozen in (("muon", ()), ("muon_split", ("layer_0/",))):
        want, got = updates(name, None, frozen), updates(name, mesh, frozen)
        for ua, ub in zip(want, got):
            for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(ua)[0], jax.tree.leaves(ub)):
                x, y = np.asarray(x), np.asarray(y)
                np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5 * np.abs(x).max(), err_msg=f"{name} {path}")
        if frozen:   # layer 0 is slice 0 of the MoE stack: its update is exactly zero in both
            x = np.asarray(got[1]["moe_layers"]["layer_0"]["attn"]["q_b_proj"]["kernel"])
            assert np.all(x[0] == 0) and np.any(x[1] != 0)
        print(name, "equal")
    print("OK")
"""


def test_distributed_muon_equals_single_device():
    """muon and muon_split (one stacked layer frozen) on fsdp:2,expert:2,tensor:2 give the single-device updates."""
    out = run8(SCRIPT)
    assert "muon equal" in out and "muon_split equal" in out
