"""Model parts against independent references: RoPE closed form, MoE routing loop, indexer formula,
DSA == dense when top-k covers every key, causality, document masking, MTP."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.attention.kernels import indexer_topk
from glm5_jax.config import ModelConfig
from glm5_jax.layers.moe import MoE, route
from glm5_jax.layers.rope import apply_rope, rope_angles
from pallas_kernels import dsa_xla as ref


def test_rope_matches_complex_rotation():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 9, 100, 1000, 5]])
    cos, sin = rope_angles(jnp.asarray(pos), 8, 10000.0)
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    z = x[..., 0::2] + 1j * x[..., 1::2]                     # interleaved pairs as complex numbers
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    rot = z * np.exp(1j * pos[:, :, None, None] * inv)
    want = np.concatenate([rot.real, rot.imag], axis=-1)     # HF writes [rotated evens ; rotated odds]
    np.testing.assert_allclose(got, want, atol=2e-5)
    # relative-position property: q.k depends only on the offset
    q, k = rng.normal(size=(1, 1, 1, 8)).astype(np.float32), rng.normal(size=(1, 1, 1, 8)).astype(np.float32)
    def dot(pq, pk):
        cq, sq = rope_angles(jnp.array([[pq]]), 8, 10000.0)
        ck, sk = rope_angles(jnp.array([[pk]]), 8, 10000.0)
        return float(jnp.sum(apply_rope(jnp.asarray(q), cq, sq) * apply_rope(jnp.asarray(k), ck, sk)))
    assert abs(dot(5, 3) - dot(12, 10)) < 1e-4


def _route_loop(x, w, bias, k, n_group, topk_group, norm, scale):
    """Per-token NumPy loop of the GLM-5 router."""
    e = w.shape[1]
    weights, ids = [], []
    for xt in x:
        s = 1 / (1 + np.exp(-(xt @ w)))
        c = s + bias
        per = e // n_group
        gs = [sorted(c[g * per:(g + 1) * per])[-2:] for g in range(n_group)]
        gsum = np.array([sum(v) for v in gs])
        keep_groups = np.argsort(-gsum, kind="stable")[:topk_group]
        allowed = [i for i in range(e) if i // per in keep_groups]
        chosen = sorted(allowed, key=lambda i: -c[i])[:k]
        wt = s[chosen]
        if norm:
            wt = wt / (wt.sum() + 1e-20)
        weights.append(wt * scale)
        ids.append(chosen)
    return np.array(weights), np.array(ids)


@pytest.mark.parametrize("n_group,topk_group,norm", [(1, 1, True), (4, 2, True), (2, 1, False)])
def test_router_matches_numpy_loop(n_group, topk_group, norm):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(13, 6)).astype(np.float32)
    w = rng.normal(size=(6, 8)).astype(np.float32)
    bias = rng.uniform(-0.5, 0.5, size=8).astype(np.float32)
    got_w, got_i, _ = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), experts_per_tok=2,
                            n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    want_w, want_i = _route_loop(x, w, bias, 2, n_group, topk_group, norm, 2.5)
    order = np.argsort(np.asarray(got_i), axis=1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_i), order, 1), np.sort(want_i, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(got_w), order, 1),
                               np.take_along_axis(want_w, np.argsort(want_i, 1), 1), rtol=1e-5)


@pytest.mark.parametrize("impl", ["ragged", "dense"])
def test_moe_output_matches_numpy_loop(impl):
    mod = MoE(num_experts=4, experts_per_tok=2, moe_ffn_dim=8, num_shared_experts=1, n_group=1, topk_group=1,
              norm_topk_prob=True, routed_scaling_factor=2.5, impl=impl)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 6))
    params = mod.init(jax.random.PRNGKey(1), x)["params"]
    params = jax.tree_util.tree_map(np.asarray, jax.tree_util.tree_map(lambda v: getattr(v, "value", v), params,
                                                                       is_leaf=lambda v: hasattr(v, "value")))
    params["router"]["e_score_correction_bias"] = np.array([0.3, -0.2, 0.0, 0.1], np.float32)
    got = np.asarray(mod.apply({"params": params}, x))
    xf = np.asarray(x).reshape(-1, 6)
    r = params["router"]
    wts, ids = _route_loop(xf, r["kernel"], r["e_score_correction_bias"], 2, 1, 1, True, 2.5)
    silu = lambda a: a / (1 + np.exp(-a))
    ex, sh = params["experts"], params["shared_experts"]
    want = []
    for t, xt in enumerate(xf):
        y = sum(wts[t, j] * (silu(xt @ ex["gate_proj"][e]) * (xt @ ex["up_proj"][e])) @ ex["down_proj"][e]
                for j, e in enumerate(ids[t]))
        y = y + (silu(xt @ sh["gate_proj"]["kernel"]) * (xt @ sh["up_proj"]["kernel"])) @ sh["down_proj"]["kernel"]
        want.append(y)
    np.testing.assert_allclose(got.reshape(-1, 6), np.array(want), atol=1e-5)


def test_indexer_scores_and_topk_match_formula():
    rng = np.random.default_rng(2)
    b, t, hi, di = 2, 11, 3, 4
    q = rng.normal(size=(b, t, hi, di)).astype(np.float32)
    k = rng.normal(size=(b, t, di)).astype(np.float32)
    w = rng.normal(size=(b, t, hi)).astype(np.float32)
    want = np.zeros((b, t, t), np.float32)
    for bb in range(b):
        for i in range(t):
            for s in range(t):
                want[bb, i, s] = sum(w[bb, i, j] * max(0.0, float(q[bb, i, j] @ k[bb, s])) for j in range(hi))
    np.testing.assert_allclose(np.asarray(ref.index_scores(q, k, w)), want, rtol=1e-5, atol=1e-6)
    idx = np.asarray(indexer_topk(jnp.asarray(q), jnp.asarray(k), jnp.asarray(w), 4, chunk=4))
    for bb in range(b):
        for i in range(t):
            vis = want[bb, i, :i + 1]
            top = set(np.argsort(-vis, kind="stable")[:4].tolist())
            row = idx[bb, i]
            assert set(row[row >= 0].tolist()) == top
            assert (row < 0).sum() == max(0, 4 - (i + 1))


def _jit_forward(cfg):
    return jax.jit(lambda p, t, pos=None, seg=None: model.forward(cfg, p, t, pos, seg))


@pytest.mark.slow  # minutes on 2 cores (the default suite stays under 15 min); run with -m slow
def test_dsa_with_topk_covering_all_keys_equals_mla():
    dsa = ModelConfig(index_topk=64, mtp_depth=0)
    params = model.init_params(dsa, jax.random.PRNGKey(3))
    mla = dsa.replace(attention="mla")
    mla_params = jax.tree_util.tree_map(lambda x: x, params)
    for stack in dsa.layer_stacks:
        mla_params[stack.name]["layer_0"]["attn"].pop("indexer")
    tok = jax.random.randint(jax.random.PRNGKey(4), (2, 24), 0, dsa.vocab_size)
    np.testing.assert_allclose(_jit_forward(dsa)(params, tok), _jit_forward(mla)(mla_params, tok), atol=1e-5)
    sparse = dsa.replace(index_topk=4)              # really dropping keys changes the result
    assert float(jnp.abs(_jit_forward(sparse)(params, tok) - _jit_forward(mla)(mla_params, tok)).max()) > 1e-3


@pytest.mark.parametrize("kind", [pytest.param("mha", marks=pytest.mark.slow),
                                  pytest.param("gqa", marks=pytest.mark.slow), "mla", "dsa"])
def test_causality(kind):
    extra = dict(num_kv_heads=2) if kind == "gqa" else {}
    cfg = ModelConfig(attention=kind, index_topk=5, mtp_depth=0, **extra)
    params = model.init_params(cfg, jax.random.PRNGKey(5))
    tok = jax.random.randint(jax.random.PRNGKey(6), (1, 20), 0, cfg.vocab_size)
    tok2 = tok.at[0, 15].set((tok[0, 15] + 1) % cfg.vocab_size)
    f = _jit_forward(cfg)
    a, b = f(params, tok), f(params, tok2)
    np.testing.assert_allclose(a[:, :15], b[:, :15], atol=1e-6)
    assert float(jnp.abs(a[:, 15:] - b[:, 15:]).max()) > 1e-4


@pytest.mark.slow  # among the slowest default tests (suite budget: 15 min on 2 cores)
def test_packed_documents_equal_separate_runs():
    cfg = ModelConfig(index_topk=4, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(7))
    d1 = jax.random.randint(jax.random.PRNGKey(8), (1, 9), 0, cfg.vocab_size)
    d2 = jax.random.randint(jax.random.PRNGKey(9), (1, 7), 0, cfg.vocab_size)
    packed = jnp.concatenate([d1, d2], axis=1)
    seg = jnp.array([[1] * 9 + [2] * 7])
    pos = jnp.array([list(range(9)) + list(range(7))])
    f = _jit_forward(cfg)
    out = f(params, packed, pos, seg)
    np.testing.assert_allclose(out[:, :9], f(params, d1), atol=1e-5)
    np.testing.assert_allclose(out[:, 9:], f(params, d2), atol=1e-5)


@pytest.mark.slow  # minutes on 2 cores (the default suite stays under 15 min); run with -m slow
def test_mtp_shared_depths_reuse_one_block():
    cfg = ModelConfig(mtp_depth=3, mtp_share=True)
    params = model.init_params(cfg, jax.random.PRNGKey(10))
    assert [k for k in params if k.startswith("mtp_")] == ["mtp_0"]
    indep = cfg.replace(mtp_share=False)
    assert [k for k in model.init_params(indep, jax.random.PRNGKey(10)) if k.startswith("mtp_")] == ["mtp_0", "mtp_1", "mtp_2"]
    tok = jax.random.randint(jax.random.PRNGKey(11), (2, 12), 0, cfg.vocab_size)
    apply = jax.jit(lambda p, t: model.GLM5(cfg).apply({"params": p}, t, mtp=True))
    out = apply(params, tok)
    assert out["mtp_logits"].shape == (3, 2, 12, cfg.vocab_size)
    # depth-1 MTP logits at position i depend on token i+1 but never on tokens past i+1
    tok2 = tok.at[:, 8].set((tok[:, 8] + 1) % cfg.vocab_size)
    out2 = apply(params, tok2)
    np.testing.assert_allclose(out["mtp_logits"][0, :, :7], out2["mtp_logits"][0, :, :7], atol=1e-6)
    assert float(jnp.abs(out["mtp_logits"][0, :, 7] - out2["mtp_logits"][0, :, 7]).max()) > 1e-5


@pytest.mark.slow  # minutes on 2 cores (the default suite stays under 15 min); run with -m slow
def test_remat_gives_identical_loss_and_gradients():
    cfg = ModelConfig(index_topk=4, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(12))
    tok = jax.random.randint(jax.random.PRNGKey(13), (2, 16), 0, cfg.vocab_size)

    def loss(c):
        return jax.jit(jax.value_and_grad(lambda p: jnp.mean(model.GLM5(c).apply(
            {"params": p}, tok, indexer_loss="sparse", mutable=["intermediates"])[0]["logits"] ** 2)))(params)

    l0, g0 = loss(cfg)
    for policy in ("full", "offload", "dots", True):   # offload: on CPU the saved inputs stay put
        l1, g1 = loss(cfg.replace(remat=policy))
        np.testing.assert_allclose(l0, l1, rtol=1e-6)
        chex.assert_trees_all_close(g0, g1, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("types", [pytest.param(None, marks=pytest.mark.slow), ("full", "shared", "full", "shared", "shared")])
def test_scanned_stacks_equal_unrolled_and_per_layer_reference(types):
    """The scanned model == the same stacks unrolled (scan_layers=False) == a hand-written loop over
    the individual DecoderLayers (each global layer's parameter slice, indices carried by hand)."""
    from glm5_jax.layers.rope import rope_angles
    cfg = ModelConfig(num_layers=5, index_topk=4, mtp_depth=0, indexer_types=types)
    params = model.init_params(cfg, jax.random.PRNGKey(16))
    tok = jax.random.randint(jax.random.PRNGKey(17), (2, 12), 0, cfg.vocab_size)
    trunk = lambda c: jax.jit(lambda p, t: model.GLM5(c).apply({"params": p}, t, return_hidden=True)["trunk"])
    scanned = trunk(cfg)(params, tok)
    unrolled = trunk(cfg.replace(scan_layers=False))(params, tok)
    np.testing.assert_allclose(scanned, unrolled, atol=1e-6)
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(12), (2, 12)), cfg.qk_rope_head_dim, cfg.rope_theta)
    kinds = cfg.layer_indexer_types
    by_layer = {}
    for st in cfg.layer_stacks:
        for r in range(st.repeats):
            for j in range(st.period):
                by_layer[st.layer_index(r, j)] = jax.tree_util.tree_map(lambda a: a[r], params[st.name][f"layer_{j}"])
    assert sorted(by_layer) == list(range(cfg.num_layers))

    @jax.jit   # one program for the hand-written loop (op by op it took ~2 minutes on 2 cores)
    def per_layer(by_layer, tok):
        x, idx = params["embed"]["embedding"][tok], None
        for i in range(cfg.num_layers):
            layer = model.DecoderLayer(cfg, cfg.is_moe_layer(i), kinds[i])
            x, new_idx, _ = layer.apply({"params": by_layer[i]}, x, cos, sin, None, idx)
            idx = new_idx if new_idx is not None else idx
        return x
    np.testing.assert_allclose(scanned, per_layer(by_layer, tok), atol=1e-5)


def test_dsa_model_logits_equal_with_pallas_kernels():
    cfg = ModelConfig(index_topk=4, mtp_depth=0, indexer_types=("full", "shared", "full"))
    params = model.init_params(cfg, jax.random.PRNGKey(14))
    tok = jax.random.randint(jax.random.PRNGKey(15), (2, 20), 0, cfg.vocab_size)
    xla = _jit_forward(cfg)(params, tok)
    pallas = _jit_forward(cfg.replace(attention_impl="pallas"))(params, tok)     # interpret mode on CPU
    np.testing.assert_allclose(pallas, xla, atol=1e-5)


def test_lm_head_dense_with_nn_kernel_grad_equals_plain_dot():
    """Dense(nn_kernel_grad=True) (the LM head on CPU: kernel gradient as an NN GEMM of a copied
    x^T) has the plain dot's value and the closed-form gradients dx = g W^T, dW = x^T g."""
    from glm5_jax.layers.common import Dense
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 8)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(3, 5, 16)), jnp.float32)
    layer = Dense(16, ("embed", "vocab"), out_dtype=jnp.float32, nn_kernel_grad=True)
    params = layer.init(jax.random.PRNGKey(0), x)
    w = params["params"]["kernel"].unbox() if hasattr(params["params"]["kernel"], "unbox") else params["params"]["kernel"]
    np.testing.assert_allclose(layer.apply(params, x), np.einsum("bti,io->bto", x, w), rtol=1e-5, atol=1e-5)
    dx, dp = jax.grad(lambda x, p: jnp.sum(layer.apply(p, x) * g), argnums=(0, 1))(x, params)
    dw = dp["params"]["kernel"]
    dw = dw.unbox() if hasattr(dw, "unbox") else dw
    np.testing.assert_allclose(dx, np.einsum("bto,io->bti", g, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, np.einsum("bti,bto->io", x, g), rtol=1e-5, atol=1e-5)
