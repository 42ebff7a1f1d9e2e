"""MTP speculative decoding: identical to plain greedy, sane acceptance, exact MTP semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.config import ModelConfig
from glm5_jax.infer import acceptance_length, generate, speculative_generate
from glm5_jax.infer import cache as kv
from glm5_jax.infer import speculative as sp
from glm5_jax.infer.decode import head, model_step

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3]]


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
@pytest.mark.parametrize("prefill_chunk", [2048, 3])   # 3: trunk and MTP prefill in 3 chunks (rows of 7 and 3)
def test_speculative_equals_plain_greedy_random_model(prefill_chunk):
    cfg = ModelConfig(attention="dsa", num_layers=2, index_topk=4, indexer_types=("full", "shared"), mtp_depth=1)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    n, num_draft = 10, 2
    plain = generate(cfg, params, PROMPTS, max_new_tokens=n, temperature=0.0)
    spec = speculative_generate(cfg, params, PROMPTS, max_new_tokens=n, num_draft=num_draft,
                                prefill_chunk=prefill_chunk)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    np.testing.assert_allclose(spec.logprobs, plain.logprobs, atol=1e-4)
    assert list(spec.lengths) == [n, n] and spec.finish_reasons == ["length", "length"]
    assert 1.0 <= spec.acceptance_length <= num_draft + 1
    assert spec.tokens_per_s > 0 and spec.verify_steps >= 1


def _bigram_model():
    """Attention and MLP outputs zeroed (the trunk is embed -> head, a bigram model) and the MTP
    block's eh_proj = [I; 0] (it passes embed(next token) through): every draft is what the main
    model will predict, so all drafts must be accepted."""
    cfg = ModelConfig(attention="gqa", num_kv_heads=2, num_layers=2, num_experts=0, mtp_depth=1)
    params = model.init_params(cfg, jax.random.PRNGKey(1))
    params = jax.tree_util.tree_map(lambda x: x, params)
    stack = params["dense_layers"]["layer_0"]                      # both layers: stacked [2, ...]
    stack["attn"]["o_proj"]["kernel"] = jnp.zeros_like(stack["attn"]["o_proj"]["kernel"])
    stack["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(stack["mlp"]["down_proj"]["kernel"])
    layer = params["mtp_0"]["layer"]
    layer["attn"]["o_proj"]["kernel"] = jnp.zeros_like(layer["attn"]["o_proj"]["kernel"])
    layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
    d = cfg.d_model
    params["mtp_0"]["eh_proj"]["kernel"] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    return cfg, params


def test_perfect_drafter_is_fully_accepted_and_stops_like_greedy():
    cfg, params = _bigram_model()
    num_draft, n = 4, 16
    plain = generate(cfg, params, PROMPTS, max_new_tokens=n, temperature=0.0)
    spec = speculative_generate(cfg, params, PROMPTS, max_new_tokens=n, num_draft=num_draft)
    np.testing.assert_array_equal(spec.tokens, plain.tokens)
    assert spec.acceptance_length == num_draft + 1
    # stop tokens: the same truncation, lengths and reasons as plain greedy
    stop = int(plain.tokens[0, 6])
    p2 = generate(cfg, params, PROMPTS, max_new_tokens=n, temperature=0.0, stop_tokens=[stop])
    s2 = speculative_generate(cfg, params, PROMPTS, max_new_tokens=n, num_draft=num_draft, stop_tokens=[stop])
    np.testing.assert_array_equal(s2.tokens, p2.tokens)
    np.testing.assert_array_equal(s2.lengths, p2.lengths)
    assert s2.finish_reasons == p2.finish_reasons and p2.finish_reasons[0] == "stop"
    assert acceptance_length(cfg, params, PROMPTS, num_draft=num_draft, max_new_tokens=n) == num_draft + 1


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_mtp_window_reproduces_training_mtp_logits():
    """Cached MTP depths (unshared blocks) over a known sequence == GLM5(..., mtp=True) logits."""
    cfg = ModelConfig(attention="mla", num_layers=2, mtp_depth=2, mtp_share=False)
    params = model.init_params(cfg, jax.random.PRNGKey(2))
    seq = jnp.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])
    length, n = seq.shape[1], 2
    want = model.GLM5(cfg).apply({"params": params}, seq, mtp=True)["mtp_logits"]
    cache = kv.init_cache(cfg, 1, length + 4, mtp_depths=n)
    pos = jnp.arange(length)[None]
    x, _ = jax.jit(lambda p, c: model_step(cfg, p, c, seq, pos))(params, cache["layers"])
    hbuf = jnp.zeros((1, length + 4, cfg.d_model)).at[:, :length].set(x)
    tokens = jnp.zeros((1, length + 5), jnp.int32).at[:, :length].set(seq)
    e = jnp.array([length - 2])                         # tokens known up to position e + 1
    h = hbuf[:, :length]
    base = jnp.zeros((1,), jnp.int32)
    _, _, normed, _ = jax.jit(lambda p, c: sp.mtp_window(cfg, n, p, c, h, tokens, base, pos, pos, e))(params, cache["mtp"])
    for k in range(n):
        known = length - 1 - (k + 1)                    # positions whose inputs are all committed
        np.testing.assert_allclose(head(cfg, params, normed[k])[0, :known], want[k, 0, :known], atol=1e-5)


def test_speculative_errors():
    cfg = ModelConfig(attention="mha", num_layers=1, num_experts=0, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="mtp_depth"):
        speculative_generate(cfg, params, [[1, 2]], max_new_tokens=3)
    unshared = cfg.replace(mtp_depth=2, mtp_share=False)
    with pytest.raises(ValueError, match="num_draft=4 > mtp_depth=2"):
        speculative_generate(unshared, params, [[1, 2]], max_new_tokens=3, num_draft=4)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(cfg.replace(mtp_depth=1), params, [[1, 2]], max_new_tokens=3, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        speculative_generate(cfg.replace(mtp_depth=1), params, [[1, 2]], max_new_tokens=3, temperature=1.0, top_p=0)
