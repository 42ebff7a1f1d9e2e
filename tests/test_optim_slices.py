"""Per-layer freezing inside scanned stacks: a pattern on per-layer names ("layer_1/attn") freezes
that layer's slice of a stacked leaf, and only it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm5_jax import model
from glm5_jax.config import ModelConfig
from glm5_jax.optim import make_optimizer
from glm5_jax.rl.program import RLConfig, make_rl_optimizer

CFG = ModelConfig(num_layers=3, mtp_depth=0)          # dense_layers [1] (layer 0), moe_layers [2] (layers 1, 2)


def test_layer_slice_paths_name_every_global_layer():
    paths = model.layer_slice_paths(CFG, "moe_layers/layer_0/attn/q_a_proj/kernel")
    assert paths == ["layer_1/attn/q_a_proj/kernel", "layer_2/attn/q_a_proj/kernel"]
    assert model.layer_slice_paths(CFG, "embed/embedding") is None


def _step(tx, params, grads):
    @jax.jit
    def step(params, grads):
        updates, _ = tx.update(grads, tx.init(params), params)
        return optax.apply_updates(params, updates)
    return step(params, grads)


# adamw runs by default; muon and rl_sgd share the freezing code path and are slow (suite budget)
@pytest.mark.parametrize("builder", ["adamw", pytest.param("muon", marks=pytest.mark.slow),
                                     pytest.param("rl_sgd", marks=pytest.mark.slow)])
def test_freezing_one_layer_of_a_stack_leaves_that_slice_unchanged(builder):
    params = model.init_params(CFG, jax.random.PRNGKey(0))
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, params)
    slice_paths = functools.partial(model.layer_slice_paths, CFG)
    if builder == "rl_sgd":
        rl = RLConfig(optimizer="sgd", frozen_patterns=("layer_1/attn",), weight_decay=0.1, grad_clip=1.0)
        tx, _ = make_rl_optimizer(params, rl, CFG)
        ref_tx, _ = make_rl_optimizer(params, RLConfig(optimizer="sgd", frozen_patterns=(), weight_decay=0.1,
                                                       grad_clip=1.0), CFG)
    else:
        kw = dict(learning_rate=1e-2, weight_decay=0.1, grad_clip=1.0)
        tx, _ = make_optimizer(builder, params, frozen_patterns=("layer_1/attn",), slice_paths=slice_paths, **kw)
        ref_tx, _ = make_optimizer(builder, params, **kw)
    new = _step(tx, params, grads)
    q = lambda p: p["moe_layers"]["layer_0"]["attn"]["q_a_proj"]["kernel"]
    np.testing.assert_array_equal(q(new)[0], q(params)[0])             # layer 1: frozen, weight decay too
    assert float(jnp.abs(q(new)[1] - q(params)[1]).max()) > 0            # layer 2 trains
    # the reference: the same optimizer with that slice's gradient zeroed by hand and no freezing gives
    # the same update for every trainable slice (the frozen slice is out of the clip norm)
    zeroed = jax.tree.map(lambda g: g, grads)
    zeroed["moe_layers"]["layer_0"]["attn"] = jax.tree.map(lambda g: g.at[0].set(0.0), grads["moe_layers"]["layer_0"]["attn"])
    ref = _step(ref_tx, params, zeroed)
    np.testing.assert_allclose(q(new)[1], q(ref)[1], rtol=1e-6)
    np.testing.assert_allclose(new["dense_layers"]["layer_0"]["mlp"]["up_proj"]["kernel"],
                               ref["dense_layers"]["layer_0"]["mlp"]["up_proj"]["kernel"], rtol=1e-6)
    bias = lambda p: p["moe_layers"]["layer_0"]["moe"]["router"]["e_score_correction_bias"]
    np.testing.assert_array_equal(bias(new), bias(params))              # never moved by gradients
