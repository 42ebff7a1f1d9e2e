"""Named-activation remat policies (ModelConfig.remat save_qkv / save_attention / custom, glm5_jax.model.remat_policy):
every policy gives the loss and gradients of no remat; keeping a named activation removes its recompute from
the compiled backward (compiled matmul FLOPs, tools.budget, strictly between remat full and none); bad
remat_custom entries are refused naming the allowed names and places."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.config import REMAT_NAMES, ConfigError, ModelConfig
from tools.budget import hlo_budget

CFG = ModelConfig(num_layers=2, first_k_dense=1, index_topk=4, mtp_depth=0, moe_impl="a2a", moe_kernel="ragged_dot")


def _grad_fn(cfg):
    params = model.init_params(cfg, jax.random.PRNGKey(3))
    tok = jax.random.randint(jax.random.PRNGKey(4), (2, 16), 0, cfg.vocab_size)

    def loss(p):
        out = model.GLM5(cfg).apply({"params": p}, tok, indexer_loss="sparse", mutable=["intermediates"])[0]
        return jnp.mean(out["logits"] ** 2)
    return jax.jit(jax.value_and_grad(loss)), params


POLICIES = {"save_qkv": (), "save_attention": (),
            "custom": ("attn_q:device", "attn_context:offload", "expert_gate:device", "expert_up:device")}


@pytest.fixture(scope="module")
def reference():
    f, params = _grad_fn(CFG)
    return f(params), f.lower(params).compile(), params


@pytest.mark.parametrize("policy", list(POLICIES))
def test_named_policies_equal_no_remat_and_recompute_less_than_full(reference, policy):
    (l0, g0), none_c, params = reference
    f, _ = _grad_fn(CFG.replace(remat=policy, remat_custom=POLICIES[policy]))
    l1, g1 = f(params)
    np.testing.assert_allclose(l0, l1, rtol=1e-6)
    chex.assert_trees_all_close(g0, g1, rtol=1e-5, atol=1e-7)
    flops = lambda c: hlo_budget(c.as_text())["flops"]
    full = flops(_grad_fn(CFG.replace(remat="full"))[0].lower(params).compile())
    got = flops(f.lower(params).compile())
    assert flops(none_c) < got < full, (flops(none_c), got, full)


def test_remat_custom_is_validated():
    with pytest.raises(ConfigError, match="remat_custom"):
        ModelConfig(remat="custom", remat_custom=("attn_q:disk",))
    with pytest.raises(ConfigError, match="remat_custom"):
        ModelConfig(remat="custom", remat_custom=("attn_qq:device",))
    with pytest.raises(ConfigError, match="only read with remat='custom'"):
        ModelConfig(remat="full", remat_custom=("attn_q:device",))
    assert ModelConfig(remat="custom", remat_custom="attn_q:device,expert_in:offload").remat_custom == \
        ("attn_q:device", "expert_in:offload")
    assert set(REMAT_NAMES) >= {"decoder_layer_input", "attn_q", "attn_kv", "attn_context", "expert_in"}


def _pretrain_grads(cfg, t: int, variants: dict):
    """{name: jitted value_and_grad of a no-indexer-loss (pre-training) loss} for cfg.replace(**kw) of each
    variant over one [2, t] batch, the params, and a check that every variant's loss and gradients equal the
    first one's."""
    params = model.init_params(cfg, jax.random.PRNGKey(3))
    tok = jax.random.randint(jax.random.PRNGKey(4), (2, t), 0, cfg.vocab_size)

    def grad_fn(c):
        def loss(p):
            return jnp.mean(model.GLM5(c).apply({"params": p}, tok)["logits"] ** 2)
        return jax.jit(jax.value_and_grad(loss))

    fns = {k: grad_fn(cfg.replace(**kw)) for k, kw in variants.items()}
    (l0, g0), *rest = [f(params) for f in fns.values()]
    for l1, g1 in rest:
        np.testing.assert_allclose(l0, l1, rtol=1e-6)
        chex.assert_trees_all_close(g0, g1, rtol=1e-5, atol=1e-7)

    def flops(name, spec):   # compiled dot FLOPs of the einsum `spec` (tools.budget's source names end with it)
        by = hlo_budget(fns[name].lower(params).compile().as_text())["flops_by_source_all"]
        return sum(v for k, v in by.items() if k.endswith(spec))
    return flops


def test_saved_topk_indices_remove_the_indexer_from_the_backward():
    """attn_topk (DSA's top-k indices) kept by remat custom: the loss and gradients equal remat full's, and the
    compiled step scores the indexer (its `bthd,bsd->bths` dot) once, where remat full scores it twice
    (forward and the backward's recompute); no indexer loss, as in pre-training (the indexer has no gradient)."""
    flops = _pretrain_grads(CFG, 16, {"full": dict(remat="full"),
                                      "saved": dict(remat="custom", remat_custom=("attn_topk:device",))})
    i_full, i_saved = flops("full", "bthd,bsd->bths"), flops("saved", "bthd,bsd->bths")
    assert i_saved > 0 and i_full == pytest.approx(2 * i_saved), (i_full, i_saved)


def test_saved_attention_output_and_lse_remove_the_sparse_forward_from_the_backward():
    """DSA's sparse stage (the MQA row gather, dsa_short_dense=0; 64 tokens, so its query-chunk loops run
    several steps) with attn_context and attn_lse kept (and the top-k): loss and gradients equal remat full's
    and no remat's, and the compiled step runs the sparse attention's score and value matmuls (`btkd,bthd->btkh`,
    `btkh,btkd->bthd`) exactly as often as without remat, where remat full runs them more (the backward's
    recompute of the attention's forward)."""
    flops = _pretrain_grads(CFG.replace(dsa_short_dense=0), 64, {
        "full": dict(remat="full"), "none": dict(remat="none"),
        "saved": dict(remat="custom", remat_custom=("attn_topk:device", "attn_context:device", "attn_lse:device"))})
    specs = ("btkd,bthd->btkh", "btkh,btkd->bthd")
    a_none, a_full, a_saved = ([flops(k, sp) for sp in specs] for k in ("none", "full", "saved"))
    assert a_saved == a_none and all(n < f for n, f in zip(a_none, a_full)), (a_none, a_saved, a_full)
