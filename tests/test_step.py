"""The one train step: the router-bias update against a NumPy loop (stacked and unstacked leaves), and
the activation sharding constraints really reach the compiled program on a mesh."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest
import jax.numpy as jnp
import numpy as np

from glm5_jax.train.step import _bias_update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bias_update_matches_numpy_loop_for_stacked_and_unstacked_leaves():
    rng = np.random.default_rng(0)
    rate = 0.01
    e, repeats = 6, 3
    params = {
        "layer_1": {"moe": {"router": {"e_score_correction_bias": rng.normal(size=(e,)).astype(np.float32),
                                       "kernel": rng.normal(size=(4, e)).astype(np.float32)}}},
        "moe_layers": {"layer_0": {"moe": {"router": {
            "e_score_correction_bias": rng.normal(size=(repeats, e)).astype(np.float32)}}}},
    }
    # integer-valued loads with ties to the layer mean in one row (sign(0) = 0: no move)
    flat_load = rng.integers(0, 10, size=(e,)).astype(np.float32)
    stacked_load = rng.integers(0, 10, size=(repeats, e)).astype(np.float32)
    stacked_load[1] = [2, 4, 3, 3, 3, 3]                         # mean 3: experts 2..5 stay put
    loads = {("layer_1", "moe"): jnp.asarray(flat_load), ("moe_layers", "layer_0", "moe"): jnp.asarray(stacked_load)}
    out = _bias_update(jax.tree.map(jnp.asarray, params), loads, rate)

    def np_update(bias, load):
        bias = bias.copy()
        for i in range(load.shape[0]):
            mean = sum(load) / len(load)
            bias[i] += rate * (1.0 if mean > load[i] else -1.0 if mean < load[i] else 0.0)
        return bias

    want_flat = np_update(params["layer_1"]["moe"]["router"]["e_score_correction_bias"], flat_load)
    want_stacked = np.stack([np_update(params["moe_layers"]["layer_0"]["moe"]["router"]["e_score_correction_bias"][r],
                                       stacked_load[r]) for r in range(repeats)])
    np.testing.assert_allclose(np.asarray(out["layer_1"]["moe"]["router"]["e_score_correction_bias"]), want_flat,
                               rtol=0, atol=1e-7)
    got = np.asarray(out["moe_layers"]["layer_0"]["moe"]["router"]["e_score_correction_bias"])
    np.testing.assert_allclose(got, want_stacked, rtol=0, atol=1e-7)
    assert np.array_equal(got[1, 2:], params["moe_layers"]["layer_0"]["moe"]["router"]["e_score_correction_bias"][1, 2:])
    np.testing.assert_array_equal(np.asarray(out["layer_1"]["moe"]["router"]["kernel"]),
                                  params["layer_1"]["moe"]["router"]["kernel"])      # only the bias moves


SCRIPT = textwrap.dedent("""
    import re, jax, numpy as np
    from glm5_jax.config import ModelConfig
    from glm5_jax.train import TrainConfig
    from glm5_jax.train.state import abstract_batch, abstract_state, init_train_state
    from glm5_jax.train.step import make_train_step
    from glm5_jax import sharding
    assert len(jax.devices()) == 8
    cfg = ModelConfig(num_experts=8, num_layers=2, first_k_dense=1, index_topk=8, mtp_depth=0)
    tc = TrainConfig(batch_size=8, seq_len=16, steps=2, warmup_steps=0)
    mesh = sharding.make_mesh("data:2,fsdp:2,expert:2")
    state, tx = init_train_state(cfg, tc, mesh)
    step = make_train_step(cfg, tc, tx, mesh)
    text = step.lower(abstract_state(cfg, tc, mesh, tx)[0], abstract_batch(8, 16, mesh)).as_text()
    # [B, T, D] activations constrained with the batch dim over (data, fsdp, expert): Shardy
    # (sdy.sharding_constraint) or GSPMD (custom_call @Sharding, 8 tiles on dim 0)
    sdy = re.findall(r'sdy\\.sharding_constraint .*<@mesh, \\[\\{"data", "fsdp", "expert"\\}, \\{("context")?\\}, \\{\\}\\]>', text)
    gspmd = re.findall(r'@Sharding\\(.*devices=\\[8,1,1\\]', text)
    n = len(sdy) + len(gspmd)
    print("batch-sharded activation constraints:", n)
    assert n >= 3, text[:3000]          # embedding output + each layer's residual stream
    # and the step runs, its state keeps the shardings it was created with
    b = {k: np.ones((8, 16), np.float32 if k == "loss_mask" else np.int32)
         for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}
    new, m = step(state, jax.device_put(b, step.batch_sharding))
    for a, s in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(step.shardings)):
        assert a.sharding.is_equivalent_to(s, a.ndim), (a.sharding, s)
    assert np.isfinite(float(m["loss"]))
    print("OK")
""")


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_train_step_constrains_activations_over_batch_axes():
    """Fails when the model's logical constraints are dropped (e.g. a mesh context flax does not see)."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                         cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert "OK" in res.stdout


def test_cross_entropy_value_and_grad_match_log_softmax_reference():
    """losses.cross_entropy's custom VJP (softmax - onehot written in one pass) against plain autodiff
    of -log_softmax at the target, with a loss mask and the z-loss term."""
    from glm5_jax.losses import cross_entropy

    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    logits = 3.0 * jax.random.normal(k1, (2, 5, 11))
    targets = jax.random.randint(k2, (2, 5), 0, 11)
    mask = (jax.random.uniform(k3, (2, 5)) > 0.3).astype(jnp.float32)
    z = 1e-2

    def reference(lg):
        nll = -jnp.take_along_axis(jax.nn.log_softmax(lg, -1), targets[..., None], -1)[..., 0]
        lse = jax.nn.logsumexp(lg, -1)
        denom = jnp.maximum(mask.sum(), 1.0)
        return (nll * mask).sum() / denom + z * (lse ** 2 * mask).sum() / denom

    ours = lambda lg: cross_entropy(lg, targets, mask, z_loss=z)[0]
    np.testing.assert_allclose(ours(logits), reference(logits), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(ours))(logits), jax.grad(reference)(logits), atol=1e-6)
    # masked positions get exactly zero gradient
    g = np.asarray(jax.grad(ours)(logits))
    assert np.all(g[np.asarray(mask) == 0] == 0)


@pytest.mark.parametrize("bad,msg", [({"loss_mask": (2, 9)}, "assert_equal_shape"),
                                     ({"tokens": (2, 8), "tokens_dtype": jnp.float32}, "assert_type"),
                                     ({k: (2, 2, 8) for k in ("tokens", "targets", "positions", "segment_ids",
                                                              "loss_mask")}, "assert_rank")])
def test_the_step_refuses_a_batch_outside_its_contract_while_tracing(bad, msg):
    """chex at the step's boundary: token-level leaves of unequal shapes, float token ids, or an LM batch that is
    not [B, T] fail when the step is traced (lowered), naming the check, before anything runs."""
    from glm5_jax.config import ModelConfig
    from glm5_jax.train import TrainConfig
    from glm5_jax.sharding import single_device_mesh
    from glm5_jax.train.state import abstract_param_shapes, abstract_state, build_optimizer
    from glm5_jax.train.step import make_train_step
    cfg = ModelConfig(vocab_size=64, d_model=8, num_layers=1, num_heads=1, num_kv_heads=1, attention="mha",
                      num_experts=0, mtp_depth=0, ffn_dim=8)
    tc = TrainConfig(batch_size=2, seq_len=8, steps=1)
    tx, _ = build_optimizer(cfg, tc, abstract_param_shapes(cfg))
    step = make_train_step(cfg, tc, tx)
    shapes = {k: bad.get(k, (2, 8)) for k in ("tokens", "targets", "positions", "segment_ids", "loss_mask")}
    dtypes = {k: jnp.float32 if k == "loss_mask" else jnp.int32 for k in shapes}
    dtypes["tokens"] = bad.get("tokens_dtype", jnp.int32)
    batch = {k: jax.ShapeDtypeStruct(shapes[k], dtypes[k]) for k in shapes}
    good = {k: jax.ShapeDtypeStruct((2, 8), dtypes[k] if k != "tokens" else jnp.int32) for k in shapes}
    state, _ = abstract_state(cfg, tc, single_device_mesh(), tx)
    step.lower(state, good)                      # the contract holds: it lowers
    with pytest.raises(AssertionError, match=msg):
        step.lower(state, batch)
