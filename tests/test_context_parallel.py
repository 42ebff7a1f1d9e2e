"""Context parallelism (glm5_jax.attention.context): the load-balanced layout, the kernels' global
query offset against the unsharded kernels, and the train step on a data:2,context:4 mesh of 8 CPU
devices against the unsharded step (loss and gradients), with the sequence split visible in the
compiled program."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.attention.context import chunk_order, from_layout, layout_index, to_layout
from pallas_kernels import dsa_xla as ref
from pallas_kernels.dense import flash_attention

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_layout_gives_every_device_the_same_causal_work(n):
    """Device i holds chunks (i, 2n-1-i); the number of causal (query, key) pairs of its tokens is the
    same on every device (closed form: sum over its tokens of global index + 1), and from_layout
    inverts to_layout."""
    t = 16 * 2 * n
    idx = layout_index(t, n)
    assert sorted(idx.tolist()) == list(range(t))
    per_device = (idx.reshape(n, -1) + 1).sum(axis=1)
    assert np.all(per_device == per_device[0]), per_device
    # contiguous shards (no layout) would be imbalanced by a factor (2n-1)... for n > 1
    contiguous = (np.arange(t).reshape(n, -1) + 1).sum(axis=1)
    assert n == 1 or contiguous.max() > 1.5 * contiguous.min()
    assert list(chunk_order(n)[:2]) == [0, 2 * n - 1]
    x = jnp.arange(3 * t).reshape(3, t)
    np.testing.assert_array_equal(from_layout(to_layout(x, n), n), x)


def test_chunked_cross_entropy_equals_cross_entropy_of_the_whole_logits():
    """The LM head + CE computed per chunk of tokens (TrainConfig.logits_chunk) for 3 groups (main head
    and two MTP depths) in one scan, over 1 or 4 sequence shards, gives cross_entropy's per-group
    loss (with z-loss and a mask) and its gradients (hidden states and head weight)."""
    from glm5_jax.losses import chunked_cross_entropy, cross_entropy
    g, b, t, d, v = 3, 2, 24, 8, 50
    ks = jax.random.split(jax.random.PRNGKey(2), 4)
    h = jax.random.normal(ks[0], (g, b, t, d))
    w = jax.random.normal(ks[1], (d, v))
    tg = jax.random.randint(ks[2], (g, b, t), 0, v)
    mask = (jax.random.uniform(ks[3], (g, b, t)) > 0.2).astype(jnp.float32)
    head = lambda w: lambda x: x @ w
    weights = jnp.asarray([1.0, 0.3, 0.7])
    whole = lambda h, w: sum(weights[i] * cross_entropy(head(w)(h[i]), tg[i], mask[i], z_loss=1e-2)[0]
                             for i in range(g))
    for shards, chunk in ((1, 5), (4, 2), (4, 100)):
        def part(h, w, shards=shards, chunk=chunk):
            ce, z = chunked_cross_entropy(head(w), h, tg, mask, chunk=chunk, shards=shards)
            return jnp.sum(weights * (ce + 1e-2 * z))
        np.testing.assert_allclose(jax.jit(part)(h, w), whole(h, w), rtol=1e-6)
        for a, e in zip(jax.jit(jax.grad(part, argnums=(0, 1)))(h, w), jax.grad(whole, argnums=(0, 1))(h, w)):
            np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)


def _offset_chunks(t, c):
    return [(c0, c0 + c) for c0 in range(0, t, c)]


def test_flash_attention_with_query_offset_equals_rows_of_the_full_attention():
    """Local query chunks at global offsets over all keys (packed documents) give exactly the rows of
    the unsharded causal attention, forward and gradients (q, k, v)."""
    b, t, h, hk, d, dv, c = 2, 64, 4, 1, 16, 8, 16
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (b, t, h, d))
    k = jax.random.normal(ks[1], (b, t, hk, d))
    v = jax.random.normal(ks[2], (b, t, hk, dv))
    seg = jnp.asarray(np.r_[np.ones(21), 2 * np.ones(t - 21)].astype(np.int32)[None].repeat(b, 0))

    def full(q, k, v):
        return flash_attention(q, k, v, scale=0.3, segment_ids=seg, block=8)

    def sharded(q, k, v):
        return jnp.concatenate([flash_attention(q[:, a:e], k, v, scale=0.3, segment_ids=seg[:, a:e], block=8,
                                                kv_segment_ids=seg, q_offset=jnp.int32(a))
                                for a, e in _offset_chunks(t, c)], axis=1)

    np.testing.assert_allclose(jax.jit(sharded)(q, k, v), full(q, k, v), rtol=1e-6, atol=1e-6)
    w = jax.random.normal(jax.random.PRNGKey(3), (b, t, h, dv))
    loss = lambda f: lambda *a: jnp.sum(f(*a) * w)
    g_full = jax.grad(loss(full), argnums=(0, 1, 2))(q, k, v)
    g_sh = jax.jit(jax.grad(loss(sharded), argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(g_sh, g_full):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-5)


def test_indexer_topk_with_query_offset_equals_rows_of_the_full_topk():
    """The jnp indexer top-k of query chunks at global offsets (keys' segment ids given) equals the
    unsharded top-k rows index for index."""
    b, t, hi, di, c = 2, 64, 4, 8, 16
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(ks[0], (b, t, hi, di))
    k = jax.random.normal(ks[1], (b, t, di))
    w = jax.random.normal(ks[2], (b, t, hi))
    seg = jnp.asarray(np.r_[np.ones(30), 2 * np.ones(t - 30)].astype(np.int32)[None].repeat(b, 0))
    want = ref.indexer_topk(q, k, w, 12, segment_ids=seg)
    got = jnp.concatenate([ref.indexer_topk(q[:, a:e], k, w[:, a:e], 12, segment_ids=seg[:, a:e], kv_segment_ids=seg,
                                            q_offset=jnp.int32(a)) for a, e in _offset_chunks(t, c)], axis=1)
    np.testing.assert_array_equal(got, want)


SCRIPT = textwrap.dedent("""
    import re, jax, numpy as np
    from glm5_jax import sharding
    from glm5_jax.config import ModelConfig
    from glm5_jax.model import init_params
    from glm5_jax.train import TrainConfig
    from glm5_jax.train.step import make_loss_fn
    assert len(jax.devices()) == 8
    B, T = 4, 32
    r = np.random.default_rng(0)
    tok = r.integers(1, 200, size=(B, T)).astype(np.int32)
    seg = np.ones((B, T), np.int32); pos = np.tile(np.arange(T), (B, 1)).astype(np.int32)
    seg[0, 13:] = 2; pos[0, 13:] = np.arange(T - 13)            # two packed documents in row 0
    seg[3, 5:] = 2; pos[3, 5:] = np.arange(T - 5)
    mask = np.ones((B, T), np.float32); mask[1, -3:] = 0
    batch = {"tokens": tok, "targets": np.roll(tok, -1, 1), "positions": pos, "segment_ids": seg, "loss_mask": mask}
    base = dict(num_experts=4, num_layers=1, first_k_dense=0, index_topk=8, mtp_depth=1, param_dtype="float32",
                dtype="float32", attn_chunk=4, dsa_short_dense=0, moe_impl="a2a", d_model=64)
    # (attention, indexer loss, settings of the context-parallel run only: the LM head and CE per chunk
    # of tokens, the MoE dispatch per chunk of a device's 16 tokens; the unsharded run has neither)
    cases = {"mla": ("mla", None, {}), "dsa_dense": ("dsa", "dense", {"moe_token_chunk": 8}),
             "dsa_sparse": ("dsa", "sparse", {"logits_chunk": 4})}
    cases = [cases[CASE]]
    single, cp = sharding.single_device_mesh(), sharding.make_mesh("data:2,context:4")
    for attn, iloss, chunks in cases:
        cfg = ModelConfig(attention=attn, **base)
        tc = TrainConfig(batch_size=B, seq_len=T, steps=2, warmup_steps=0, indexer_loss=iloss, z_loss=1e-3)
        params = init_params(cfg, jax.random.PRNGKey(0))
        cp_cfg = cfg.replace(moe_token_chunk=chunks.get("moe_token_chunk", 0))
        cp_tc = tc.replace(logits_chunk=chunks.get("logits_chunk", 0))
        out = []
        for mesh, m_cfg, t in ((single, cfg, tc), (cp, cp_cfg, cp_tc)):
            vg = jax.jit(jax.value_and_grad(make_loss_fn(m_cfg, t), has_aux=True))
            with sharding.use_mesh(mesh):
                compiled = vg.lower(params, batch).compile()
            (loss, (m, _)), g = compiled(params, batch)
            out.append(jax.device_get((m, g)))
        (m1, g1), (m2, g2) = out
        assert set(m1) == set(m2)
        for k in m1:   # the indexer KL is a small difference of logs: compared with an absolute tolerance too
            np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=f"{attn}/{iloss}: {k}")
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree_util.tree_leaves(g2)):
            # elementwise rtol 1e-5; elements near zero (float32 sums of many cancelling terms, e.g. the
            # indexer KL's gradients) within 2e-5 of the leaf's largest magnitude
            scale = float(np.max(np.abs(a))) or 1.0
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=2e-5 * scale,
                                       err_msg=f"{attn}/{iloss}: {jax.tree_util.keystr(path)}")
        print("equal", attn, iloss, {k: float(v) for k, v in m1.items()})
    # the compiled loss-and-gradient program splits the sequence of its [B, T, D] activations over
    # context (4 devices): the per-device residual stream is [B/2, T/4, D] = [2, 8, 64]
    text = compiled.as_text()
    split = len(re.findall(r"f32\\[2,8,64\\]", text))
    unsplit = len(re.findall(r"f32\\[2,32,64\\]", text))
    print("sequence-split activations:", split, "unsplit:", unsplit)
    assert split >= 10 and split > unsplit, (split, unsplit)
    print("OK")
""")


@pytest.mark.parametrize("case", [pytest.param("mla", marks=pytest.mark.slow), pytest.param("dsa_dense", marks=pytest.mark.slow),
                                  "dsa_sparse"])  # mla / dsa_dense ~20-25 s each: slow; dsa_sparse covers the split
def test_context_parallel_train_step_equals_unsharded_and_splits_the_sequence(case):
    """On 8 CPU devices, data:2,context:4: the LM loss's value, metrics (CE, MTP, indexer KL and
    recall) and gradients equal the unsharded ones (float32, rtol 1e-5) for MLA, DSA's dense warm-up
    (with the MoE dispatched per chunk) and DSA's sparse stage (with the LM head per chunk), with packed
    documents, a loss mask, MTP and a2a MoE; and the compiled
    loss-and-gradient program holds its [B, T, D] activations as [B/2, T/4, D] shards (fails if the
    context sharding is dropped)."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", f"CASE = {case!r}\n" + SCRIPT], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert "OK" in res.stdout
