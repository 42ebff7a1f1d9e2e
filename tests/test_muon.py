"""Tests for glm5_jax.optim (Muon, Muon Split, AdamW partition, schedule, logit monitor)."""
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm5_jax.optim import (LABELS, MuonSplitSpec, make_optimizer, max_attention_logit, muon,
                            newton_schulz, optimizer_table, orthogonalize_leaf,
                            partition_params, warmup_cosine)
from glm5_jax.optim.muon import HeadSplit, path_to_str

A, B, C = 3.4445, -4.7750, 2.0315
# tiny GLM-5-like dims
D, VOCAB, QL, KVL, H, NOPE, ROPE, VH = 16, 32, 12, 8, 2, 4, 2, 3
IDXH, IDXD, E, MFF, FF = 2, 4, 3, 6, 10
SPEC = MuonSplitSpec(H, NOPE, ROPE, VH)


def _quintic_iter(s, steps=5):
    for _ in range(steps):
        s = A * s + B * s ** 3 + C * s ** 5
    return s


def _attn(rng):
    n = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
    return {
        "q_a_proj": {"kernel": n(D, QL)}, "q_a_norm": {"scale": np.ones(QL, np.float32)},
        "q_b_proj": {"kernel": n(QL, H * (NOPE + ROPE))},
        "kv_a_proj": {"kernel": n(D, KVL + ROPE)}, "kv_a_norm": {"scale": np.ones(KVL, np.float32)},
        "kv_b_proj": {"kernel": n(KVL, H * (NOPE + VH))},
        "o_proj": {"kernel": n(H * VH, D)},
        "indexer": {"wq_b": {"kernel": n(QL, IDXH * IDXD)}, "wk": {"kernel": n(D, IDXD)},
                    "k_norm": {"scale": np.ones(IDXD, np.float32),
                               "bias": np.zeros(IDXD, np.float32)},
                    "weights_proj": {"kernel": n(D, IDXH)}},
    }


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
    ones = lambda k: np.ones(k, np.float32)
    dense = {"input_norm": {"scale": ones(D)}, "attn": _attn(rng),
             "post_attn_norm": {"scale": ones(D)},
             "mlp": {k: {"kernel": n(D, FF) if k != "down_proj" else n(FF, D)}
                     for k in ("gate_proj", "up_proj", "down_proj")}}
    moe = {"input_norm": {"scale": ones(D)}, "attn": _attn(rng),
           "post_attn_norm": {"scale": ones(D)},
           "moe": {"router": {"kernel": n(D, E),
                              "e_score_correction_bias": np.zeros(E, np.float32)},
                   "experts": {"gate_proj": n(E, D, MFF), "up_proj": n(E, D, MFF),
                               "down_proj": n(E, MFF, D)},
                   "shared_experts": {k: {"kernel": n(D, MFF) if k != "down_proj" else n(MFF, D)}
                                      for k in ("gate_proj", "up_proj", "down_proj")}}}
    mtp = {"enorm": {"scale": ones(D)}, "hnorm": {"scale": ones(D)},
           "final_norm": {"scale": ones(D)}, "eh_proj": {"kernel": n(2 * D, D)},
           "layer": jax.tree.map(lambda x: x * 0.5, dense)}   # dense here to keep compiles small
    return {"embed": {"embedding": n(VOCAB, D)}, "layer_0": dense, "layer_1": moe,
            "mtp_0": mtp, "final_norm": {"scale": ones(D)}, "lm_head": {"kernel": n(D, VOCAB)}}


def rand_like(tree, seed):
    leaves, treedef = jax.tree.flatten(tree)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [rng.standard_normal(x.shape).astype(np.float32)
                                        for x in leaves])


def flat(tree):
    return {path_to_str(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def ns_reference(g, steps=5):
    """Independent float64 numpy quintic Newton-Schulz on one matrix."""
    x = np.asarray(g, np.float64)
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        x = A * x + (B * a + C * a @ a) @ x
    return x.T if tall else x


# ------------------------------------------------------------------------------------------
def test_quintic_band_derivation():
    # p has critical points at +-0.5545 (local max p=1.2024) and +-1.0501 (local min p=0.6818).
    # [p(1.0501), p(0.6818)] = [0.6818, 1.1344] is mapped into itself, and any s in [~0.01, 1]
    # (normalised singular value) lands in it after 5 steps -> the band for NS5 outputs.
    s = np.linspace(0.01, 1.0, 20001)
    out = _quintic_iter(s)
    assert out.min() > 0.68 and out.max() < 1.135
    band = np.linspace(0.6818, 1.1344, 2001)
    one = A * band + B * band ** 3 + C * band ** 5
    assert one.min() >= 0.6818 - 1e-4 and one.max() <= 1.1344 + 1e-4


@pytest.mark.parametrize("shape", [(48, 16), (16, 40), (24, 24)])
def test_newton_schulz_singular_values(shape):
    rng = np.random.default_rng(1)
    g = rng.standard_normal(shape).astype(np.float32)
    u, s, vt = np.linalg.svd(g.astype(np.float64), full_matrices=False)
    out = np.asarray(newton_schulz(jnp.asarray(g)), np.float64)
    assert out.shape == shape
    # singular vectors preserved: U^T O V is diagonal with entries p^5(s / ||s||)
    proj = u.T @ out @ vt.T
    expect = _quintic_iter(s / np.linalg.norm(s))
    np.testing.assert_allclose(np.diag(proj), expect, atol=2e-3)
    assert np.abs(proj - np.diag(np.diag(proj))).max() < 2e-3
    ok = s / np.linalg.norm(s) >= 0.01
    assert ok.sum() >= min(shape) - 2
    d = np.diag(proj)[ok]
    assert d.min() > 0.68 - 2e-3 and d.max() < 1.135 + 2e-3
    if shape[0] != shape[1]:  # well-conditioned random rectangles: every singular value in band
        sv = np.linalg.svd(out, compute_uv=False)
        assert sv.min() > 0.678 and sv.max() < 1.137
    # batch axes: stacked matrices are orthogonalised one at a time
    stacked = np.stack([g, 2 * g[::-1]])
    out2 = np.asarray(newton_schulz(jnp.asarray(stacked)))
    np.testing.assert_allclose(out2[0], out, atol=1e-5)
    np.testing.assert_allclose(out2[1], np.asarray(newton_schulz(jnp.asarray(2 * g[::-1]))),
                               atol=1e-5)


def _split_reference(g, kind):
    """Loop over heads (and K/V parts) with the numpy NS reference and per-piece RMS scale."""
    m = g.shape[0]
    segs = (NOPE + ROPE,) if kind == "q" else (NOPE, VH)
    hd = sum(segs)
    out = np.zeros_like(g, dtype=np.float64)
    for h in range(H):
        off = h * hd
        for seg in segs:
            piece = g[:, off:off + seg]
            out[:, off:off + seg] = ns_reference(piece) * 0.2 * np.sqrt(max(m, seg))
            off += seg
    return out


def test_muon_split_equals_per_head_loop():
    rng = np.random.default_rng(2)
    gq = rng.standard_normal((QL, H * (NOPE + ROPE))).astype(np.float32)
    gkv = rng.standard_normal((KVL, H * (NOPE + VH))).astype(np.float32)
    oq = orthogonalize_leaf(jnp.asarray(gq), SPEC.q_split)
    okv = orthogonalize_leaf(jnp.asarray(gkv), SPEC.kv_split)
    np.testing.assert_allclose(np.asarray(oq), _split_reference(gq, "q"), atol=2e-4)
    np.testing.assert_allclose(np.asarray(okv), _split_reference(gkv, "kv"), atol=2e-4)
    # stacked leading axis (e.g. scanned layers) splits per layer too
    st = np.stack([gkv, -0.5 * gkv + 1])
    ost = np.asarray(orthogonalize_leaf(jnp.asarray(st), SPEC.kv_split))
    np.testing.assert_allclose(ost[1], _split_reference(st[1], "kv"), atol=2e-4)
    with pytest.raises(ValueError):
        orthogonalize_leaf(jnp.asarray(gq), HeadSplit(5, (3,)))


@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_optax_contrib_muon(bias_correction):
    rng = np.random.default_rng(4)
    p = {"w": jnp.asarray(rng.standard_normal((24, 40)).astype(np.float32))}
    ours = muon(0.02, weight_decay=0.1, beta=0.95, rms_scale=0.2,
                bias_correction=bias_correction, eps=1e-8)
    ref = optax.contrib.muon(0.02, beta=0.95, weight_decay=0.1, consistent_rms=0.2, eps=1e-8)
    so, sr = ours.init(p), ref.init(p)
    uo_f, ur_f = jax.jit(ours.update), jax.jit(ref.update)
    for step in range(4):
        g = {"w": jnp.asarray(rng.standard_normal((24, 40)).astype(np.float32))}
        uo, so = uo_f(g, so, p)
        ur, sr = ur_f(g, sr, p)
        if bias_correction or step == 0:
            np.testing.assert_allclose(np.asarray(uo["w"]), np.asarray(ur["w"]), atol=1e-6)
        else:  # original Muon (no bias correction) differs from optax only after step 1
            assert not np.allclose(np.asarray(uo["w"]), np.asarray(ur["w"]), atol=1e-6)
        p = optax.apply_updates(p, ur)


def test_partition_covers_every_param_once():
    params = make_params()
    names = set(flat(params))
    for opt in ("adamw", "muon", "muon_split"):
        labels = partition_params(params, opt)
        assert jax.tree.structure(labels) == jax.tree.structure(params)
        fl = flat(labels)
        assert set(fl) == names and all(v in LABELS for v in fl.values())
        table = optimizer_table(params, labels, SPEC if opt == "muon_split" else None)
        rows = [ln.split()[0] for ln in table.splitlines()[2:2 + len(names)]]
        assert sorted(rows) == sorted(names)  # each path exactly once
        assert f"{len(names)} leaves" in table
        assert fl["layer_1/moe/router/e_score_correction_bias"] == "zero"
        assert fl["embed/embedding"] == "adamw_nodecay"
        assert fl["lm_head/kernel"] == "adamw"
        assert fl["layer_0/attn/indexer/weights_proj/kernel"] == "adamw"
        assert fl["layer_0/attn/indexer/k_norm/bias"] == "adamw_nodecay"
        assert fl["mtp_0/enorm/scale"] == "adamw_nodecay"
        if opt == "adamw":
            assert set(fl.values()) == {"adamw", "adamw_nodecay", "zero"}
        else:
            assert fl["layer_1/moe/experts/gate_proj"] == "muon"
            assert fl["mtp_0/eh_proj/kernel"] == "muon"
            assert fl["layer_0/mlp/down_proj/kernel"] == "muon"
            qb = fl["mtp_0/layer/attn/q_b_proj/kernel"]
            assert qb == ("muon_split" if opt == "muon_split" else "muon")
    table = optimizer_table(params, partition_params(params, "muon_split"), SPEC)
    assert re.search(r"kv_b_proj/kernel\s+\[8,14\]\s+muon_split\s+per head 2x\(K\[8,4\] \+ V\[8,3\]\)",
                     table)
    assert re.search(r"experts/gate_proj\s+\[3,16,6\]\s+muon\s+\[16,6\] x3 \(expert\)", table)


def test_bad_optimizer_name():
    params = make_params()
    with pytest.raises(ValueError, match=r"adamw.*muon.*muon_split"):
        make_optimizer("sgd", params, learning_rate=1e-3)
    with pytest.raises(ValueError, match="adamw, muon, muon_split"):
        partition_params(params, "Muon")
    with pytest.raises(ValueError, match="split_spec"):
        make_optimizer("muon_split", params, learning_rate=1e-3)


def _check_zero_labels_unchanged(params, p, upd, fl):
    fp0, fp, fu = flat(params), flat(p), flat(upd)
    for path, lab in fl.items():
        if lab in ("frozen", "zero"):
            assert np.array_equal(np.asarray(fp[path]), fp0[path]), path
            assert not np.any(np.asarray(fu[path])), path
        else:
            assert not np.array_equal(np.asarray(fp[path]), fp0[path]), path


def test_muon_split_step_frozen_and_router_bias():
    """One jitted program on the representative tree: Muon Split numbers on step 1, then frozen
    leaves and the router bias stay bit-identical over 3 steps while everything else moves."""
    params = make_params()
    cfg = types.SimpleNamespace(num_attention_heads=H, qk_nope_head_dim=NOPE,
                                qk_rope_head_dim=ROPE, v_head_dim=VH, hidden_size=D)
    lr, wd = 0.01, 0.1
    tx, labels = make_optimizer("muon_split", params, learning_rate=lr, weight_decay=wd,
                                split_spec=cfg, frozen_patterns=[r"^layer_0/attn/", r"^embed/"],
                                trainable=lambda p: not p.startswith("mtp_0/layer/mlp/"),
                                warmup_steps=2, total_steps=10)
    fl = flat(labels)
    assert fl["layer_0/attn/q_b_proj/kernel"] == "frozen"
    assert fl["embed/embedding"] == "frozen"
    assert fl["mtp_0/layer/mlp/up_proj/kernel"] == "frozen"
    assert fl["layer_1/moe/router/e_score_correction_bias"] == "zero"
    state = tx.init(params)
    n_state = sum(x.size for x in jax.tree.leaves(state))
    step = jax.jit(lambda p, s, g: (lambda u, s2: (optax.apply_updates(p, u), s2, u))(
        *tx.update(g, s, p)))
    p = params
    for i in range(3):
        grads = rand_like(params, 10 + i)
        p, state, upd = step(p, state, grads)
        if i == 0:
            # step 1: Nesterov look-ahead is proportional to the (clipped) gradient, so the
            # update is -lr0 * (split-NS(g) + wd * W) with lr0 = lr / 2 (warmup 2 steps)
            fu, fg, fp = flat(upd), flat(grads), flat(params)
            lr0 = lr / 2
            for path, kind in (("layer_1/attn/q_b_proj/kernel", "q"),
                               ("mtp_0/layer/attn/kv_b_proj/kernel", "kv")):
                assert fl[path] == "muon_split"
                expect = -lr0 * (_split_reference(fg[path], kind) + wd * fp[path])
                np.testing.assert_allclose(np.asarray(fu[path]), expect, atol=2e-6)
            # experts: one matrix per expert, with the expert matrix's own fan-in/out
            path = "layer_1/moe/experts/down_proj"
            assert fl[path] == "muon"
            expect = np.stack([ns_reference(fg[path][e]) * 0.2 * np.sqrt(max(MFF, D))
                               for e in range(E)])
            np.testing.assert_allclose(np.asarray(fu[path]), -lr0 * (expect + wd * fp[path]),
                                       atol=2e-6)
            assert fl["layer_1/attn/indexer/wq_b/kernel"] == "muon"  # indexer stays whole
    # frozen / zero leaves carry no optimizer state at all, and nothing grew
    assert sum(x.size for x in jax.tree.leaves(state)) == n_state
    _check_zero_labels_unchanged(params, p, upd, fl)


def test_adamw_router_bias_and_frozen():
    rng = np.random.default_rng(7)
    params = {"layer_1": {"moe": {"router": {
        "kernel": rng.standard_normal((D, E)).astype(np.float32),
        "e_score_correction_bias": rng.standard_normal(E).astype(np.float32)}}},
        "final_norm": {"scale": np.ones(D, np.float32)},
        "lm_head": {"kernel": rng.standard_normal((D, VOCAB)).astype(np.float32)}}
    tx, labels = make_optimizer("adamw", params, learning_rate=1e-2,
                                trainable=lambda p: not p.startswith("lm_head"))
    fl = flat(labels)
    assert fl == {"layer_1/moe/router/kernel": "adamw",
                  "layer_1/moe/router/e_score_correction_bias": "zero",
                  "final_norm/scale": "adamw_nodecay", "lm_head/kernel": "frozen"}
    state = tx.init(params)
    p = params
    for i in range(2):
        u, state = tx.update(rand_like(params, 20 + i), state, p)
        p = optax.apply_updates(p, u)
    _check_zero_labels_unchanged(params, p, u, fl)


def test_muon_reduces_least_squares():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((64, 16)).astype(np.float32))
    w_true = jnp.asarray(rng.standard_normal((16, 8)).astype(np.float32))
    y = x @ w_true
    params = {"layer_0": {"mlp": {"up_proj": {"kernel": jnp.zeros((16, 8))}}}}
    loss = lambda p: jnp.mean((x @ p["layer_0"]["mlp"]["up_proj"]["kernel"] - y) ** 2)
    tx, labels = make_optimizer("muon", params, learning_rate=0.3, weight_decay=0.0,
                                grad_clip=None)
    assert flat(labels)["layer_0/mlp/up_proj/kernel"] == "muon"
    state = tx.init(params)

    @jax.jit
    def step(p, s):
        l, g = jax.value_and_grad(loss)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, l

    losses = []
    for _ in range(25):
        params, state, l = step(params, state)
        losses.append(float(l))
    assert losses[-1] < 0.1 * losses[0], losses


def test_warmup_cosine():
    f = warmup_cosine(1.0, 4, 14, 0.1)
    vals = np.array([float(f(s)) for s in range(16)])
    np.testing.assert_allclose(vals[:4], [0.25, 0.5, 0.75, 1.0], atol=1e-6)
    np.testing.assert_allclose(vals[9], 0.1 + 0.9 * 0.5, atol=1e-6)   # half way
    np.testing.assert_allclose(vals[14:], 0.1, atol=1e-6)
    assert np.all(np.diff(vals[4:15]) <= 1e-7)
    np.testing.assert_allclose(float(warmup_cosine(2.0, 0, None)(7)), 2.0)


def test_max_attention_logit_matches_bruteforce():
    rng = np.random.default_rng(6)
    b, t, s, h, hk, d = 2, 7, 11, 4, 2, 5
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hk, d)).astype(np.float32)
    qseg = np.array([[0] * 3 + [1] * 4, [0] * 7])
    kseg = np.array([[0] * 7 + [1] * 4, [0] * 5 + [2] * 6])
    kr = np.repeat(k, h // hk, axis=2)
    logits = np.abs(np.einsum("bthd,bshd->bhts", q, kr)) * 0.3
    qpos = np.arange(t) + (s - t)
    causal = np.arange(s)[None, :] <= qpos[:, None]
    seg = qseg[:, :, None] == kseg[:, None, :]
    for is_causal in (False, True):
        mask = seg & causal[None] if is_causal else seg
        ref = np.where(mask[:, None], logits, 0).max(axis=(0, 2, 3))
        got = max_attention_logit(jnp.asarray(q), jnp.asarray(k), 0.3, causal=is_causal,
                                  q_segment_ids=jnp.asarray(qseg),
                                  kv_segment_ids=jnp.asarray(kseg), per_head=True,
                                  q_chunk=3, kv_chunk=4)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)
    full = max_attention_logit(jnp.asarray(q), jnp.asarray(kr), 0.3)
    np.testing.assert_allclose(float(full), logits.max(), rtol=1e-5)


def test_grouped_equals_ungrouped():
    from glm5_jax.optim import scale_by_muon
    rng = np.random.default_rng(8)
    g = {"layer_0": {"attn": {"q_b_proj": {"kernel": rng.standard_normal((QL, 12))}}},
         "layer_1": {"attn": {"q_b_proj": {"kernel": rng.standard_normal((QL, 12))}},
                     "mlp": {"up_proj": {"kernel": rng.standard_normal((QL, 6))}}},
         "experts": rng.standard_normal((3, QL, 6))}
    g = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g)
    split = lambda path, shape: SPEC.q_split if "q_b_proj" in path else None
    outs = []
    for grp in (True, False):
        t = scale_by_muon(split_fn=split, group_same_shapes=grp)
        outs.append(t.update(g, t.init(g))[0])
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    # q_b_proj head pieces are [12, 6] like up_proj: same RMS factor, per-piece NS
    np.testing.assert_allclose(np.asarray(outs[0]["layer_1"]["mlp"]["up_proj"]["kernel"]),
                               ns_reference(g["layer_1"]["mlp"]["up_proj"]["kernel"]) * 0.2 *
                               np.sqrt(QL), atol=2e-5)
