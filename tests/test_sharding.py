"""On 8 forced CPU devices the tiny model with experts sharded over `expert` gives the 1-device logits."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import traverse_util
    from glm5_jax.config import ModelConfig
    from glm5_jax import model, sharding
    assert len(jax.devices()) == 8
    cfg = ModelConfig(num_experts=8, experts_per_tok=2, index_topk=8, num_heads=4)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    tok = jax.random.randint(jax.random.PRNGKey(1), (8, 32), 0, cfg.vocab_size)
    fwd = jax.jit(lambda p, t: model.forward(cfg, p, t))
    want = np.asarray(fwd(params, tok))
    for spec in ["data:2,expert:4", "expert:8", "fsdp:2,expert:2,tensor:2"]:
        mesh = sharding.make_mesh(spec)
        ps = sharding.shard_params(params, sharding.param_shardings(cfg, mesh))
        gp = next(v for k, v in traverse_util.flatten_dict(ps).items() if k[-1] == "gate_proj")
        spec_e = tuple(gp.sharding.spec) + (None,) * (gp.ndim - len(gp.sharding.spec))
        assert spec_e[-3] == "expert", spec_e                 # [..., experts, embed, expert_mlp]
        with sharding.use_mesh(mesh):
            got = np.asarray(fwd(ps, jax.device_put(tok, sharding.batch_sharding(mesh))))
        err = float(np.abs(got - want).max())
        assert err <= 1e-5, (spec, err)
        print(spec, err)
    for bad, msg in [("expert:3", "needs 3 devices"), ("data:2,fsdp:-1,tensor:-1", "at most one"),
                     ("pipeline:2", "unknown mesh axis")]:
        try:
            sharding.make_mesh(bad)
        except sharding.MeshError as e:
            assert msg in str(e), (bad, e)
        else:
            raise AssertionError(bad)
    try:
        sharding.check_model_fits_mesh(cfg.replace(num_experts=6, experts_per_tok=2), {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1})
    except sharding.MeshError as e:
        assert "num_experts=6" in str(e) and "expert=4" in str(e)
    else:
        raise AssertionError("no error")
    print("OK")
""")


@pytest.mark.slow  # minutes on 2 cores (the default suite stays under 15 min); run with -m slow
def test_expert_sharded_logits_equal_single_device():
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "OK" in res.stdout
