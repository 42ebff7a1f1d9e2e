"""attention_impl="pallas" (the DSA Pallas kernels, interpret mode on CPU) inside the one train step
equals attention_impl="xla" (the jnp references) on a PACKED batch, in both DSA training stages:
same loss, same gradients (read off an SGD(lr=1) update: new params = params - grad)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm5_jax.attention import kernels
from glm5_jax.config import ModelConfig
from glm5_jax.train import TrainConfig
from glm5_jax.train.state import init_train_state
from glm5_jax.train.step import make_train_step

B, T = 2, 32


def _packed_batch():
    """Two rows of 3 documents each (positions restart per document), every token trained."""
    rng = np.random.default_rng(0)
    lengths = [(9, 15, 8), (20, 5, 7)]
    seg = np.stack([np.repeat(np.arange(3), ls) for ls in lengths]).astype(np.int32)
    pos = np.stack([np.concatenate([np.arange(n) for n in ls]) for ls in lengths]).astype(np.int32)
    tokens = rng.integers(0, 256, size=(B, T)).astype(np.int32)
    targets = rng.integers(0, 256, size=(B, T)).astype(np.int32)
    return {"tokens": tokens, "targets": targets, "positions": pos, "segment_ids": seg,
            "loss_mask": np.ones((B, T), np.float32)}


def _step(impl: str, stage: str, **cfg_kw):
    # index_topk 8 < the longest document: the top-k is a real selection, and the 5-token document
    # has rows with fewer than 8 visible keys (-1 slots)
    cfg = ModelConfig(num_layers=2, first_k_dense=1, num_experts=4, experts_per_tok=2, index_topk=8,
                      mtp_depth=0, attention_impl=impl, attn_chunk=16, **cfg_kw)
    tc = TrainConfig(batch_size=B, seq_len=T, steps=1, warmup_steps=0, indexer_loss=stage,
                     bias_update_rate=0.0)
    tx = optax.sgd(1.0)
    state, tx = init_train_state(cfg, tc, tx=tx, seed=0)
    params0 = jax.tree.map(np.asarray, state["params"])
    step = make_train_step(cfg, tc, tx)
    new, metrics = step(state, jax.tree.map(jnp.asarray, _packed_batch()))
    grads = jax.tree.map(lambda a, b: a - np.asarray(b), params0, new["params"])
    return float(metrics["loss"]), grads


@pytest.mark.slow  # ~2 min per stage unloaded (interpret-mode Pallas inside the whole model)
@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_pallas_train_step_equals_xla_on_packed_batch(stage):
    loss_x, g_x = _step("xla", stage)
    loss_p, g_p = _step("pallas", stage)
    assert np.isfinite(loss_x)
    np.testing.assert_allclose(loss_p, loss_x, rtol=1e-5, atol=1e-6)
    flat_x = jax.tree_util.tree_leaves_with_path(g_x)
    flat_p = jax.tree_util.tree_leaves(g_p)
    nonzero = 0
    for (path, a), b in zip(flat_x, flat_p):
        scale = max(float(np.abs(a).max()), 1e-8)
        err = float(np.abs(a - b).max()) / scale
        assert err < 1e-4, (jax.tree_util.keystr(path), err)
        nonzero += bool(np.abs(a).max() > 0)
    assert nonzero > len(flat_x) // 2       # the gradients compared are real ones


def _assert_same_step(a, b):
    (loss_a, g_a), (loss_b, g_b) = a, b
    assert np.isfinite(loss_a)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    flat_a = jax.tree_util.tree_leaves_with_path(g_a)
    nonzero = 0
    for (path, x), y in zip(flat_a, jax.tree_util.tree_leaves(g_b)):
        err = float(np.abs(x - y).max()) / max(float(np.abs(x).max()), 1e-8)
        assert err < 1e-4, (jax.tree_util.keystr(path), err)
        nonzero += bool(np.abs(x).max() > 0)
    assert nonzero > len(flat_a) // 2


@pytest.mark.slow  # ~1-2 min (two train-step compiles); test_model_hf checks both forms against HF logits
def test_short_sequence_dense_form_equals_mqa_gather_in_the_train_step():
    """DSA's sparse stage at T <= dsa_short_dense * index_topk (CPU: expanded heads, dense flash
    attention masked to the top-k set) and with dsa_short_dense=0 (the MQA row gather) give the
    same loss and gradients on a packed batch, indexer KL included."""
    cfg = ModelConfig(index_topk=8, attn_chunk=16)
    from glm5_jax.attention.mla import short_sequence_dense
    assert short_sequence_dense(cfg, T) and not short_sequence_dense(
        ModelConfig(index_topk=8, dsa_short_dense=0), T)
    _assert_same_step(_step("xla", "sparse", dsa_short_dense=0), _step("xla", "sparse"))


def test_kernels_dispatch_pallas_equals_xla_packed():
    """The tiny variant: the one dispatch (attention/kernels.py) with packed segment ids, as MLA's
    sparse stage calls it (indexer top-k, then MQA sparse attention over a shared 1-head key row,
    Dv != Dq): same indices, same output, same gradients for both impls."""
    rng = np.random.default_rng(1)
    b, t, h, dq, dv, hi, di, topk = 1, 24, 2, 12, 8, 2, 8, 6
    seg = jnp.asarray(np.repeat([0, 1, 2], [10, 4, 10])[None], jnp.int32)
    qi, ki, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, t, hi, di), (b, t, di), (b, t, hi)))
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, t, h, dq), (b, t, 1, dq), (b, t, 1, dv)))
    idx = {impl: kernels.indexer_topk(qi, ki, w, topk, segment_ids=seg, impl=impl, chunk=8)
           for impl in ("xla", "pallas")}
    np.testing.assert_array_equal(idx["pallas"], idx["xla"])
    assert (np.asarray(idx["xla"])[0, 10:14, 4:] == -1).all()  # the 4-token document: < topk keys

    def loss(impl):
        return lambda a, b_, c: jnp.sum(jnp.sin(kernels.sparse_attention(
            a, b_, c, idx["xla"], scale=0.3, impl=impl, chunk=8)))

    vx, gx = jax.value_and_grad(loss("xla"), (0, 1, 2))(q, k, v)
    vp, gp = jax.value_and_grad(loss("pallas"), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(vp, vx, rtol=1e-5)
    for a, r in zip(gp, gx):
        np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-4)
