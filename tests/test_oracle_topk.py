"""Oracle top-k (ModelConfig.dsa_topk_source="oracle") and the attention-mass figures (selection_stats,
glm5_jax.eval.selection) against numpy references, brute-force optimality and the dense forward."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.attention.indexer import oracle_topk, selection_stats
from glm5_jax.attention.mla import MLAttention
from glm5_jax.eval.selection import attention_mass, mass_beyond
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.layers.rope import apply_rope, rope_angles, softmax_scale
from glm5_jax.model import GLM5, init_params
from glm5_jax.train.stages import graft

B, T, H, D = 2, 9, 3, 5


def _qk(seed, hk):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    k = rng.normal(size=(B, T, hk, D)).astype(np.float32)
    seg = np.array([[1] * 5 + [2] * 4, [1] * 9], np.int32)
    return q, k, seg


def _probs_numpy(q, k, scale, seg):
    """Head-averaged causal softmax [B, T, S] (0 where invisible)."""
    b, t, h, _ = q.shape
    kk = np.broadcast_to(k, (b, k.shape[1], h, k.shape[-1]))
    p = np.zeros((b, t, kk.shape[1]))
    for bi in range(b):
        for ti in range(t):
            vis = [s for s in range(ti + 1) if seg is None or seg[bi, s] == seg[bi, ti]]
            for hi in range(h):
                z = np.array([q[bi, ti, hi] @ kk[bi, s, hi] for s in vis], np.float64) * scale
                e = np.exp(z - z.max())
                p[bi, ti, vis] += e / e.sum() / h
    return p


def _oracle_numpy(p, seg, topk):
    b, t, s = p.shape
    out = -np.ones((b, t, topk), np.int64)
    for bi in range(b):
        for ti in range(t):
            vis = [j for j in range(ti + 1) if seg is None or seg[bi, j] == seg[bi, ti]]
            order = sorted(vis, key=lambda j: (-p[bi, ti, j], j))[:topk]
            out[bi, ti, :len(order)] = order
    return out


@pytest.mark.parametrize("hk", [1, H])
@pytest.mark.parametrize("topk", [3, 12])
def test_oracle_topk_matches_numpy(hk, topk):
    q, k, seg = _qk(0, hk)
    got = np.asarray(oracle_topk(jnp.asarray(q), jnp.asarray(k), 0.7, topk, segment_ids=jnp.asarray(seg), chunk=4))
    want = _oracle_numpy(_probs_numpy(q, k, 0.7, seg), seg, topk)
    assert got.shape == (B, T, topk)
    np.testing.assert_array_equal(got, want)


def test_oracle_ties_go_to_the_lower_key():
    q = np.zeros((1, 4, 2, 3), np.float32)           # every logit 0: all keys tie
    k = np.zeros((1, 4, 1, 3), np.float32)
    got = np.asarray(oracle_topk(jnp.asarray(q), jnp.asarray(k), 1.0, 2))
    np.testing.assert_array_equal(got[0], [[0, -1], [0, 1], [0, 1], [0, 1]])


def test_selection_stats_match_numpy_and_the_oracle_is_optimal():
    q, k, seg = _qk(1, 1)
    topk = 3
    rng = np.random.default_rng(2)
    idx = -np.ones((B, T, topk), np.int32)
    for bi in range(B):
        for ti in range(T):
            vis = [j for j in range(ti + 1) if seg[bi, j] == seg[bi, ti]]
            n = min(topk, len(vis)) - (1 if (ti % 4 == 3 and len(vis) > 1) else 0)   # some rows select fewer
            idx[bi, ti, :n] = rng.permutation(vis)[:n]
    sel, orc, rec = (np.asarray(x) for x in selection_stats(jnp.asarray(q), jnp.asarray(k), 0.9, jnp.asarray(idx),
                                                             segment_ids=jnp.asarray(seg), chunk=3))
    p = _probs_numpy(q, k, 0.9, seg)
    want_orc = _oracle_numpy(p, seg, topk)
    for bi in range(B):
        for ti in range(T):
            chosen = [j for j in idx[bi, ti] if j >= 0]
            best = [j for j in want_orc[bi, ti] if j >= 0]
            np.testing.assert_allclose(sel[bi, ti], p[bi, ti, chosen].sum(), rtol=1e-5, atol=1e-6)
            # optimality, by brute force over every k-subset of the visible keys
            vis = [j for j in range(ti + 1) if seg[bi, j] == seg[bi, ti]]
            brute = max(p[bi, ti, list(c)].sum() for c in itertools.combinations(vis, min(topk, len(vis))))
            np.testing.assert_allclose(orc[bi, ti], brute, rtol=1e-5, atol=1e-6)
            assert sel[bi, ti] <= orc[bi, ti] + 1e-6
            np.testing.assert_allclose(rec[bi, ti], len(set(chosen) & set(best)) / len(best), atol=1e-6)
    # every visible key selected: all the mass
    full = np.asarray(selection_stats(jnp.asarray(q), jnp.asarray(k), 0.9,
                                      jnp.asarray(_oracle_numpy(p, seg, T).astype(np.int32)),
                                      segment_ids=jnp.asarray(seg))[0])
    np.testing.assert_allclose(full, 1.0, atol=1e-5)


def test_config_refuses_an_unknown_source():
    with pytest.raises(ConfigError, match="dsa_topk_source"):
        ModelConfig(attention="dsa", dsa_topk_source="best")
    with pytest.raises(ConfigError, match="dsa_selection_stats"):
        ModelConfig(attention="dsa", dsa_selection_stats=1)


def _tiny(**kw):
    base = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, q_lora_rank=16, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, ffn_dim=48, num_experts=0, mtp_depth=0,
                attention="dsa", index_topk=4, index_n_heads=2, index_head_dim=8, attn_chunk=8)
    return ModelConfig(**{**base, **kw})


def _batch(t=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 64, size=(2, t)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    return tokens, pos, jnp.ones((2, t), jnp.int32)


def test_oracle_at_k_ge_t_equals_the_dense_forward():
    t = 16
    dsa = _tiny(index_topk=t, dsa_topk_source="oracle")
    mla = dsa.replace(attention="mla", dsa_topk_source="indexer")
    p_mla = init_params(mla, jax.random.PRNGKey(0))
    p_dsa = graft(init_params(dsa, jax.random.PRNGKey(1)), p_mla)
    tokens, pos, seg = _batch(t)
    want = GLM5(mla).apply({"params": p_mla}, tokens, pos, seg)["logits"]
    for short in (8, 0):     # the top-k-masked dense form and the MQA row gather
        got = GLM5(dsa.replace(dsa_short_dense=short)).apply({"params": p_dsa}, tokens, pos, seg)["logits"]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def _reference_layer(cfg, params, x, cos, sin):
    """The layer's output from its own projections (captured), with attention recomputed in numpy: dense
    expanded MLA restricted to the numpy oracle's keys (head-averaged softmax top-k)."""
    mod = MLAttention(cfg, "full")
    _, st = mod.apply({"params": params}, x, cos, sin, capture_intermediates=True, mutable=["intermediates"])
    it = st["intermediates"]
    c = cfg
    h, dn, dr, dv = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    b, t, _ = x.shape
    q = it["q_b_proj"]["__call__"][0].reshape(b, t, h, dn + dr)
    q = jnp.concatenate([q[..., :dn], apply_rope(q[..., dn:], cos, sin)], -1)
    kv = it["kv_a_proj"]["__call__"][0]
    lat = it["kv_a_norm"]["__call__"][0]
    k_rope = apply_rope(kv[..., c.kv_lora_rank:], cos, sin)
    w = np.asarray(params["kv_b_proj"]["kernel"]).reshape(c.kv_lora_rank, h, dn + dv)
    kvb = np.einsum("bsr,rhd->bshd", np.asarray(lat), w)
    k = np.concatenate([kvb[..., :dn], np.broadcast_to(np.asarray(k_rope)[:, :, None], (b, t, h, dr))], -1)
    v = kvb[..., dn:]
    q = np.asarray(q, np.float64)
    scale = softmax_scale(dn + dr)
    idx = _oracle_numpy(_probs_numpy(q, k, scale, None), None, c.index_topk)
    out = np.zeros((b, t, h, dv))
    for bi in range(b):
        for ti in range(t):
            sel = [s for s in idx[bi, ti] if s >= 0]
            for hi in range(h):
                z = k[bi, sel, hi] @ q[bi, ti, hi] * scale
                e = np.exp(z - z.max())
                out[bi, ti, hi] = (e / e.sum()) @ v[bi, sel, hi]
    return out.reshape(b, t, h * dv) @ np.asarray(params["o_proj"]["kernel"]), idx


@pytest.mark.parametrize("short", [8, 0])
def test_oracle_layer_equals_a_numpy_reference(short):
    cfg = _tiny(index_topk=3, dsa_topk_source="oracle", dsa_short_dense=short)
    t = 12
    x = jax.random.normal(jax.random.PRNGKey(3), (2, t, cfg.d_model))
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(t), (2, t)), cfg.qk_rope_head_dim, cfg.rope_theta)
    mod = MLAttention(cfg, "full")
    params = nn.unbox(mod.init(jax.random.PRNGKey(4), x, cos, sin)["params"])
    out, idx, _ = mod.apply({"params": params}, x, cos, sin)
    want, want_idx = _reference_layer(cfg, params, x, cos, sin)
    np.testing.assert_array_equal(np.asarray(idx), want_idx)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)
    # the indexer source selects differently (it is untrained): the source really switches
    idx_i = MLAttention(cfg.replace(dsa_topk_source="indexer"), "full").apply({"params": params}, x, cos, sin)[1]
    assert not np.array_equal(np.asarray(idx_i), want_idx)


def test_attention_mass_per_layer_and_bucket():
    t = 16
    cfg = _tiny(index_topk=4)
    params = init_params(cfg, jax.random.PRNGKey(5))
    tokens, pos, seg = _batch(t, 1)
    batch = {"tokens": np.asarray(tokens), "positions": np.asarray(pos), "segment_ids": np.asarray(seg),
             "loss_mask": np.ones((2, t), np.int32)}
    buckets = ((0, 4), (4, 16))
    got = attention_mass(cfg, params, [batch], buckets)
    orc = attention_mass(cfg.replace(dsa_topk_source="oracle"), params, [batch], buckets)
    assert set(got["layers"]) == set(orc["layers"]) and len(got["layers"]) == 2
    for layer, v in got["layers"].items():
        # positions < k: every visible key selected, all the mass
        np.testing.assert_allclose(v["selected_mass"][0], 1.0, atol=1e-5)
        np.testing.assert_allclose(v["oracle_mass"][0], 1.0, atol=1e-5)
        assert got["tokens"] == [8, 24]
        assert v["selected_mass"][1] <= v["oracle_mass"][1] + 1e-6 and v["oracle_mass"][1] < 1.0
        # with the oracle as the source every full layer selects its own oracle keys
        o = orc["layers"][layer]
        np.testing.assert_allclose(o["selected_mass"], o["oracle_mass"], rtol=1e-5)
        np.testing.assert_allclose(o["recall"], 1.0, atol=1e-6)
    far = mass_beyond(got, 4)
    want = np.mean([v["selected_mass"][1] for v in got["layers"].values()])
    np.testing.assert_allclose(far["selected_mass"], want, rtol=1e-6)
    assert 0 < far["selected_mass"] <= far["oracle_mass"] and 0 <= far["recall"] <= 1
