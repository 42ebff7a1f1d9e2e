"""Tests for glm5_jax.optim (Muon, Muon Split, AdamW partition, schedule) on the scanned layout:
decoder leaves carry a leading [repeats] layer axis that every optimizer treats as a batch axis."""
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from glm5_jax.optim import (LABELS, MuonSplitSpec, make_optimizer, muon, newton_schulz,
                            optimizer_table, orthogonalize_leaf, partition_params, scale_by_muon,
                            warmup_cosine)
from glm5_jax.optim.muon import HeadSplit
from glm5_jax.utils import path_to_str

A, B, C = 3.4445, -4.7750, 2.0315
# tiny GLM-5-like dims
D, VOCAB, QL, KVL, H, NOPE, ROPE, VH = 16, 32, 12, 8, 2, 4, 2, 3
IDXH, IDXD, E, MFF, FF = 2, 4, 3, 6, 10
R_DENSE, R_MOE = 1, 2          # repeats of the two layer stacks
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


def _dense_layer(rng):
    n = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
    return {"input_norm": {"scale": np.ones(D, np.float32)}, "attn": _attn(rng),
            "post_attn_norm": {"scale": np.ones(D, np.float32)},
            "mlp": {k: {"kernel": n(D, FF) if k != "down_proj" else n(FF, D)}
                    for k in ("gate_proj", "up_proj", "down_proj")}}


def _moe_layer(rng):
    n = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
    return {"input_norm": {"scale": np.ones(D, np.float32)}, "attn": _attn(rng),
            "post_attn_norm": {"scale": np.ones(D, np.float32)},
            "moe": {"router": {"kernel": n(D, E),
                               "e_score_correction_bias": np.zeros(E, np.float32)},
                    "experts": {"gate_proj": n(E, D, MFF), "up_proj": n(E, D, MFF),
                                "down_proj": n(E, MFF, D)},
                    "shared_experts": {k: {"kernel": n(D, MFF) if k != "down_proj" else n(MFF, D)}
                                       for k in ("gate_proj", "up_proj", "down_proj")}}}


def _stack(layers):
    return jax.tree.map(lambda *xs: np.stack(xs), *layers)


def make_params(seed=0):
    """The model's scanned tree: dense_layers/layer_0 [R_DENSE, ...], moe_layers/layer_0 [R_MOE, ...],
    and an unstacked MTP block."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.1
    ones = lambda k: np.ones(k, np.float32)
    mtp = {"enorm": {"scale": ones(D)}, "hnorm": {"scale": ones(D)},
           "final_norm": {"scale": ones(D)}, "eh_proj": {"kernel": n(2 * D, D)},
           "layer": _dense_layer(rng)}   # dense here to keep compiles small
    return {"embed": {"embedding": n(VOCAB, D)},
            "dense_layers": {"layer_0": _stack([_dense_layer(rng) for _ in range(R_DENSE)])},
            "moe_layers": {"layer_0": _stack([_moe_layer(rng) for _ in range(R_MOE)])},
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
        assert fl["moe_layers/layer_0/moe/router/e_score_correction_bias"] == "zero"
        assert fl["embed/embedding"] == "adamw_nodecay"
        assert fl["lm_head/kernel"] == "adamw"
        assert fl["dense_layers/layer_0/attn/indexer/weights_proj/kernel"] == "adamw"
        assert fl["dense_layers/layer_0/attn/indexer/k_norm/bias"] == "adamw_nodecay"
        assert fl["moe_layers/layer_0/input_norm/scale"] == "adamw_nodecay"    # [R, D]: 1-D per layer
        assert fl["mtp_0/enorm/scale"] == "adamw_nodecay"
        if opt == "adamw":
            assert set(fl.values()) == {"adamw", "adamw_nodecay", "zero"}
        else:
            assert fl["moe_layers/layer_0/moe/experts/gate_proj"] == "muon"
            assert fl["mtp_0/eh_proj/kernel"] == "muon"
            assert fl["dense_layers/layer_0/mlp/down_proj/kernel"] == "muon"
            qb = fl["mtp_0/layer/attn/q_b_proj/kernel"]
            assert qb == ("muon_split" if opt == "muon_split" else "muon")
    table = optimizer_table(params, partition_params(params, "muon_split"), SPEC)
    assert re.search(r"moe_layers/layer_0/attn/kv_b_proj/kernel\s+\[2,8,14\]\s+muon_split\s+"
                     r"per head 2x\(K\[8,4\] \+ V\[8,3\]\) x2 \(layers\)\n", table)
    assert re.search(r"mtp_0/layer/attn/kv_b_proj/kernel\s+\[8,14\]\s+muon_split\s+"
                     r"per head 2x\(K\[8,4\] \+ V\[8,3\]\)\n", table)
    assert re.search(r"moe_layers/layer_0/moe/experts/gate_proj\s+\[2,3,16,6\]\s+muon\s+"
                     r"\[16,6\] x2 \(layers\) x3 \(expert\)\n", table)


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


@pytest.mark.slow  # among the slowest default tests (suite budget: 15 min on 2 cores)
def test_muon_split_step_frozen_and_router_bias():
    """One jitted program on the representative tree: Muon Split numbers on step 1 (per layer of a
    stack), then frozen leaves and the router bias stay bit-identical over 3 steps while everything
    else moves."""
    params = make_params()
    cfg = types.SimpleNamespace(num_attention_heads=H, qk_nope_head_dim=NOPE,
                                qk_rope_head_dim=ROPE, v_head_dim=VH, hidden_size=D)
    lr, wd = 0.01, 0.1
    tx, labels = make_optimizer("muon_split", params, learning_rate=lr, weight_decay=wd,
                                split_spec=cfg, frozen_patterns=[r"^dense_layers/layer_0/attn/", r"^embed/"],
                                trainable=lambda p: not p.startswith("mtp_0/layer/mlp/"),
                                warmup_steps=2, total_steps=10)
    fl = flat(labels)
    assert fl["dense_layers/layer_0/attn/q_b_proj/kernel"] == "frozen"
    assert fl["moe_layers/layer_0/attn/q_b_proj/kernel"] == "muon_split"
    assert fl["embed/embedding"] == "frozen"
    assert fl["mtp_0/layer/mlp/up_proj/kernel"] == "frozen"
    assert fl["moe_layers/layer_0/moe/router/e_score_correction_bias"] == "zero"
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
            for path, kind in (("moe_layers/layer_0/attn/q_b_proj/kernel", "q"),
                               ("moe_layers/layer_0/attn/kv_b_proj/kernel", "kv"),
                               ("mtp_0/layer/attn/kv_b_proj/kernel", "kv")):
                assert fl[path] == "muon_split"
                g = fg[path]
                ref = (np.stack([_split_reference(s, kind) for s in g]) if g.ndim == 3
                       else _split_reference(g, kind))
                np.testing.assert_allclose(np.asarray(fu[path]), -lr0 * (ref + wd * fp[path]), atol=2e-6)
            # experts: one matrix per (layer, expert), with that matrix's own fan-in/out
            path = "moe_layers/layer_0/moe/experts/down_proj"
            assert fl[path] == "muon"
            expect = np.stack([np.stack([ns_reference(fg[path][r, e]) for e in range(E)])
                               for r in range(R_MOE)]) * 0.2 * np.sqrt(max(MFF, D))
            np.testing.assert_allclose(np.asarray(fu[path]), -lr0 * (expect + wd * fp[path]),
                                       atol=2e-6)
            assert fl["moe_layers/layer_0/attn/indexer/wq_b/kernel"] == "muon"  # indexer stays whole
    # frozen / zero leaves carry no optimizer state at all, and nothing grew
    assert sum(x.size for x in jax.tree.leaves(state)) == n_state
    _check_zero_labels_unchanged(params, p, upd, fl)


def test_adamw_router_bias_and_frozen():
    rng = np.random.default_rng(7)
    params = {"moe_layers": {"layer_0": {"moe": {"router": {
        "kernel": rng.standard_normal((R_MOE, D, E)).astype(np.float32),
        "e_score_correction_bias": rng.standard_normal((R_MOE, E)).astype(np.float32)}}}},
        "final_norm": {"scale": np.ones(D, np.float32)},
        "lm_head": {"kernel": rng.standard_normal((D, VOCAB)).astype(np.float32)}}
    tx, labels = make_optimizer("adamw", params, learning_rate=1e-2,
                                trainable=lambda p: not p.startswith("lm_head"))
    fl = flat(labels)
    assert fl == {"moe_layers/layer_0/moe/router/kernel": "adamw",
                  "moe_layers/layer_0/moe/router/e_score_correction_bias": "zero",
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
    params = {"dense_layers": {"layer_0": {"mlp": {"up_proj": {"kernel": jnp.zeros((1, 16, 8))}}}}}
    loss = lambda p: jnp.mean((x @ p["dense_layers"]["layer_0"]["mlp"]["up_proj"]["kernel"][0] - y) ** 2)
    tx, labels = make_optimizer("muon", params, learning_rate=0.3, weight_decay=0.0,
                                grad_clip=None)
    assert flat(labels)["dense_layers/layer_0/mlp/up_proj/kernel"] == "muon"
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


@pytest.mark.parametrize("kind", ["plain", "q", "kv"])
def test_stacked_leaf_equals_per_slice(kind):
    """Muon / Muon Split on a stacked leaf [R, m, n] (a layer stack) is Muon on each [m, n] slice:
    step 1 against the numpy reference per slice, and over 3 steps (momentum included) against
    the same optimizer run on R separate unstacked leaves."""
    rng = np.random.default_rng(9)
    reps, m = 3, QL
    n = {"plain": 10, "q": H * (NOPE + ROPE), "kv": H * (NOPE + VH)}[kind]
    name = {"plain": "mlp/up_proj", "q": "attn/q_b_proj", "kv": "attn/kv_b_proj"}[kind]
    split = lambda path, shape: (SPEC.q_split if "q_b_proj" in path else
                                 SPEC.kv_split if "kv_b_proj" in path else None)
    tx = scale_by_muon(split_fn=split)
    stacked = lambda w: {"moe_layers": {"layer_0": {name: w}}}
    sliced = lambda w: {f"layer_{r}": {name: w[r]} for r in range(reps)}
    grads = [jnp.asarray(rng.standard_normal((reps, m, n)).astype(np.float32)) for _ in range(3)]
    s_st, s_sl = tx.init(stacked(grads[0])), tx.init(sliced(grads[0]))
    upd_st, upd_sl = jax.jit(tx.update), jax.jit(tx.update)
    for t, g in enumerate(grads):
        u_st, s_st = upd_st(stacked(g), s_st)
        u_sl, s_sl = upd_sl(sliced(g), s_sl)
        got = np.asarray(u_st["moe_layers"]["layer_0"][name])
        if t == 0:      # Nesterov look-ahead on step 1 is proportional to g; NS normalises it away
            for r in range(reps):
                gr = np.asarray(g[r])
                ref = (ns_reference(gr) * 0.2 * np.sqrt(max(m, n)) if kind == "plain"
                       else _split_reference(gr, kind))
                np.testing.assert_allclose(got[r], ref, atol=2e-5)
        for r in range(reps):   # batched vs one at a time: float32 rounding only (the Gram form's: <= 1e-5)
            np.testing.assert_allclose(got[r], np.asarray(u_sl[f"layer_{r}"][name]), atol=2e-5)


@pytest.mark.parametrize("shape,decay", [((32, 96), 0), ((32, 96), 6), ((96, 32), 3), ((16, 128), 8)])
def test_gram_form_newton_schulz_equals_the_direct_form(shape, decay):
    """Wide matrices (n / m > 1.875) run NS5 in Gram space (the same polynomial, four [m, m] products a
    step): within 1e-3 of the largest entry of a float64 run of the direct form (ns_reference), on a
    random spectrum and on spectra decaying to 10^-decay; tall ones are transposed first."""
    from glm5_jax.optim.newton_schulz import gram_form_is_cheaper
    assert gram_form_is_cheaper(min(shape), max(shape), 5) and not gram_form_is_cheaper(24, 40, 5)
    rng = np.random.default_rng(7)
    m, n = shape
    u, _ = np.linalg.qr(rng.standard_normal((m, min(shape))))
    v, _ = np.linalg.qr(rng.standard_normal((n, min(shape))))
    s = np.logspace(0, -decay, min(shape)) if decay else np.abs(rng.standard_normal(min(shape)))
    g = ((u * s) @ v.T).astype(np.float32)
    want = ns_reference(g.astype(np.float64))
    got = np.asarray(newton_schulz(jnp.asarray(g)), np.float64)
    # float32 Gram form at a spectrum decaying to 1e-8 (16 x 128): 1.2e-3 of the largest entry on the AMD EPYC
    # CI machines of 2026-12-08 (below 1e-3 on earlier ones; XLA's CPU code differs by host), the direct form
    # in float32 2.6e-5: the Gram form's known loss on ill-conditioned inputs, bounded here at 2e-3
    assert np.max(np.abs(got - want)) <= 2e-3 * np.max(np.abs(want))
