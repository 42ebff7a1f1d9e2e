"""Cached decoding (glm5_jax.infer) against the full forward: greedy tokens, log-probs, ragged
batches, absorbed MLA == expanded MLA, sampling filters, and the error paths.

By causality (tested in test_layers.py) the full forward's logits at position t on the final
sequence equal those of model.forward on the sequence grown to t + 1, so one forward per row checks
every decoding step.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.attention.mla import MLAttention
from glm5_jax.config import ModelConfig
from glm5_jax.infer import PAD_ID, generate
from glm5_jax.infer import cache as kv
from glm5_jax.infer import sampling
from glm5_jax.layers.rope import rope_angles

CONFIGS = {
    "mha": ModelConfig(attention="mha", num_layers=2, num_experts=0, mtp_depth=0),
    "gqa": ModelConfig(attention="gqa", num_kv_heads=2, num_layers=2, num_experts=0, mtp_depth=0),
    "mla": ModelConfig(attention="mla", num_layers=2, num_experts=0, mtp_depth=0),
    # more tokens than index_topk, and a shared indexer layer reusing layer 0's decode-time indices
    "dsa": ModelConfig(attention="dsa", index_topk=4, indexer_types=("full", "shared", "full"), mtp_depth=0),
}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]


@functools.lru_cache(maxsize=None)
def _params(kind):
    return model.init_params(CONFIGS[kind], jax.random.PRNGKey(0))


@functools.lru_cache(maxsize=None)
def _forward(cfg):
    return jax.jit(lambda p, t: jax.nn.log_softmax(model.forward(cfg, p, t), axis=-1))


def _full_logprobs(cfg, params, prompt, generated, width=32):
    """log_softmax of the full forward at the positions that produced each generated token (the
    sequence is right-padded to a fixed width: causal, so real positions are unaffected)."""
    seq = list(prompt) + list(generated)
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(seq)] = seq
    lsm = np.asarray(_forward(cfg)(params, padded))[0]
    return lsm[np.arange(len(prompt) - 1, len(seq) - 1)]


@pytest.mark.parametrize("kind,prefill_chunk", [
    pytest.param("mha", 2048, marks=pytest.mark.slow), pytest.param("gqa", 2048, marks=pytest.mark.slow),
    ("mla", 2048), ("dsa", 2048),
    # chunked prefill: 3 chunks of 3 (the last one padded; the short row ends in the first chunk)
    pytest.param("dsa", 3, id="dsa-prefill_chunk3")])
def test_cached_greedy_equals_full_forward_argmax(kind, prefill_chunk):
    cfg, params = CONFIGS[kind], _params(kind)
    n = 9
    res = generate(cfg, params, PROMPTS, max_new_tokens=n, temperature=0.0, prefill_chunk=prefill_chunk)
    assert res.tokens.shape == (2, n) and res.tokens.dtype == np.int32
    assert list(res.lengths) == [n, n] and res.finish_reasons == ["length", "length"]
    for b, prompt in enumerate(PROMPTS):
        lsm = _full_logprobs(cfg, params, prompt, res.tokens[b])
        np.testing.assert_array_equal(res.tokens[b], lsm.argmax(-1))
        # greedy log-prob = log-softmax (temperature 1) of the argmax token
        np.testing.assert_allclose(res.logprobs[b], lsm[np.arange(n), res.tokens[b]], atol=1e-4)
    if kind == "dsa":
        assert len(PROMPTS[0]) + n > 2 * cfg.index_topk


def test_ragged_rows_equal_running_each_alone():
    """Right-padding: the short row of a ragged batch decodes exactly as it does alone (the long
    row is unpadded, so it is the same program as alone up to batch size)."""
    cfg, params = CONFIGS["dsa"], _params("dsa")
    both = generate(cfg, params, PROMPTS, max_new_tokens=9, temperature=0.0)      # same shapes as above
    alone = generate(cfg, params, [PROMPTS[1]], max_new_tokens=9, temperature=0.0, max_len=16)
    np.testing.assert_array_equal(both.tokens[1], alone.tokens[0])
    np.testing.assert_allclose(both.logprobs[1], alone.logprobs[0], atol=1e-5)


def test_sampled_logprobs_equal_full_forward_log_softmax():
    cfg, params = CONFIGS["mla"], _params("mla")
    res = generate(cfg, params, np.array([[3, 1, 4, 1, 5]]), max_new_tokens=8, temperature=1.0, seed=3)
    lsm = _full_logprobs(cfg, params, [3, 1, 4, 1, 5], res.tokens[0])
    np.testing.assert_allclose(res.logprobs[0], lsm[np.arange(8), res.tokens[0]], atol=1e-4)
    again = generate(cfg, params, np.array([[3, 1, 4, 1, 5]]), max_new_tokens=8, temperature=1.0, seed=3)
    np.testing.assert_array_equal(res.tokens, again.tokens)            # seeded


def test_top_k_generation_stays_in_top_k_of_full_forward():
    cfg, params = CONFIGS["gqa"], _params("gqa")
    res = generate(cfg, params, [[7, 7, 2]], max_new_tokens=8, temperature=1.5, top_k=3, seed=1)
    lsm = _full_logprobs(cfg, params, [7, 7, 2], res.tokens[0])
    top3 = np.argsort(-lsm, axis=-1, kind="stable")[:, :3]
    assert all(t in top3[i] for i, t in enumerate(res.tokens[0]))
    # log-prob under the filtered distribution: renormalised over the top 3 at temperature 1.5
    z = lsm / 1.5
    want = [z[i, t] - np.log(np.exp(z[i, top3[i]]).sum()) for i, t in enumerate(res.tokens[0])]
    np.testing.assert_allclose(res.logprobs[0], want, atol=1e-4)


def test_stop_tokens_end_rows_and_pad():
    cfg, params = CONFIGS["mha"], _params("mha")
    free = generate(cfg, params, PROMPTS, max_new_tokens=8, temperature=0.0)
    stop = int(free.tokens[0, 2])
    first = int(np.argmax(free.tokens[0] == stop))
    res = generate(cfg, params, PROMPTS, max_new_tokens=8, temperature=0.0, stop_tokens=[stop])
    assert res.finish_reasons[0] == "stop" and res.lengths[0] == first + 1
    np.testing.assert_array_equal(res.tokens[0, :first + 1], free.tokens[0, :first + 1])
    assert (res.tokens[0, first + 1:] == PAD_ID).all() and (res.logprobs[0, first + 1:] == 0).all()
    if stop not in free.tokens[1]:
        assert res.finish_reasons[1] == "length" and res.lengths[1] == 8
        np.testing.assert_array_equal(res.tokens[1], free.tokens[1])


def test_request_errors():
    cfg, params = CONFIGS["mha"], _params("mha")
    with pytest.raises(ValueError, match="exceeds the cache size max_len=10"):
        generate(cfg, params, [[1, 2, 3, 4]], max_new_tokens=7, max_len=10)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(cfg, params, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        generate(cfg, params, np.zeros((1, 0), np.int32), max_new_tokens=2)
    with pytest.raises(ValueError, match="empty"):
        generate(cfg, params, [], max_new_tokens=2)
    with pytest.raises(ValueError, match="vocab_size"):
        generate(cfg, params, [[1, cfg.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        generate(cfg, params, [[1]], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(cfg, params, [[1]], max_new_tokens=2, temperature=-1.0)


def test_top_k_top_p_never_sample_outside_the_allowed_set():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(1, 50)) * 3, jnp.float32)
    n = 4000
    tiled = jnp.tile(logits, (n, 1))
    p = np.asarray(jax.nn.softmax(logits[0]))
    order = np.argsort(-p, kind="stable")
    for top_k, top_p in [(5, 1.0), (0, 0.7), (10, 0.5), (1, 1.0), (0, 1e-6)]:
        # allowed set computed independently in NumPy
        allowed = order[:top_k] if top_k else order
        q = p[allowed] / p[allowed].sum()
        if top_p < 1:
            cum_before = np.cumsum(q) - q
            allowed = allowed[cum_before < top_p]
        tok, lp = sampling.sample(jax.random.PRNGKey(top_k), tiled, greedy=False, temperature=1.0,
                                  top_k=top_k, use_top_p=top_p < 1, top_p=top_p)
        tok = np.asarray(tok)
        assert set(tok.tolist()) <= set(allowed.tolist()), (top_k, top_p)
        if len(allowed) > 1:
            assert len(set(tok.tolist())) > 1
        ref_lp = np.log(p[tok] / p[allowed].sum())
        np.testing.assert_allclose(np.asarray(lp), ref_lp, atol=1e-4)


@pytest.mark.parametrize("kind", ["mla", "dsa"])
def test_absorbed_mla_decode_equals_expanded_attention(kind):
    """Unit level: the training-path MLAttention on T tokens == absorbed attention over a latent
    cache, both filled at once (prefill) and token by token (decode)."""
    cfg = CONFIGS[kind]
    p = jax.tree_util.tree_map(lambda a: a[0], _params(kind)["dense_layers"]["layer_0"]["attn"])
    t, s = 11, 16
    x = jax.random.normal(jax.random.PRNGKey(1), (2, t, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    cos, sin = rope_angles(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    itype = "full" if kind == "dsa" else None
    attn = MLAttention(cfg, itype)
    want, want_idx, _ = attn.apply({"params": p}, x, cos, sin)
    lc = kv.layer_cache(cfg, 2, s, kind == "dsa")
    got, idx, _ = attn.apply({"params": p}, x, cos, sin, positions=pos, cache=lc)
    np.testing.assert_allclose(got, want, atol=2e-5)
    step = jax.jit(lambda lc, x1, c1, s1, p1: attn.apply({"params": p}, x1, c1, s1, positions=p1, cache=lc)[::2])
    steps = []
    for i in range(t):
        out, lc = step(lc, x[:, i:i + 1], cos[:, i:i + 1], sin[:, i:i + 1], pos[:, i:i + 1])
        steps.append(out)
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), want, atol=2e-5)
    # one [latent | k_rope | zero padding] buffer (glm5_jax.infer.cache): its row width a multiple of KV_ALIGN
    assert lc["kv"].shape == (2, s, kv.kv_width(cfg)) and kv.kv_width(cfg) % kv.KV_ALIGN == 0
    assert not np.any(np.asarray(lc["kv"][..., cfg.kv_lora_rank + cfg.qk_rope_head_dim:]))
    if kind == "dsa":
        k = cfg.index_topk
        np.testing.assert_array_equal(np.sort(np.asarray(idx[..., :k]), -1), np.sort(np.asarray(want_idx[..., :k]), -1))


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_cached_prefill_then_decode_equals_full_forward():
    """The model's own modules over a cache (prefill 7 tokens, then 5 single-token steps) give the
    trunk of one full forward, with a MoE stack made of a repeating (shared, full) block plus a
    (shared) tail stack: the top-k of the last full layer is carried through the scans."""
    cfg = ModelConfig(num_layers=4, indexer_types=("full", "shared", "full", "shared"), index_topk=4)
    assert [(s.name, s.period, s.repeats) for s in cfg.layer_stacks] == [
        ("dense_layers", 1, 1), ("moe_layers", 2, 1), ("moe_layers_tail", 1, 1)]
    from glm5_jax.infer.decode import model_step
    params = model.init_params(cfg, jax.random.PRNGKey(3))
    toks = jax.random.randint(jax.random.PRNGKey(4), (2, 12), 0, cfg.vocab_size)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    want = model.GLM5(cfg).apply({"params": params}, toks, return_hidden=True)["trunk"]
    step = jax.jit(lambda p, c, t, q: model_step(cfg, p, c, t, q))
    x, cache = step(params, kv.init_cache(cfg, 2, 16)["layers"], toks[:, :7], pos[:, :7])
    got = [x]
    for i in range(7, 12):
        x, cache = step(params, cache, toks[:, i:i + 1], pos[:, i:i + 1])
        got.append(x)
    np.testing.assert_allclose(jnp.concatenate(got, axis=1), want, atol=2e-5)
