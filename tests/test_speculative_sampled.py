"""Sampled MTP speculation (glm5_jax/infer/speculative.py): rejection-sampling verification gives the
target's distribution (counted on a small vocabulary against the exact distribution), acceptance equals
the closed form sum min(p, q), greedy is the temperature -> 0 limit, per-row parameters and keys, and
end to end with the model's MTP head the same token distribution as plain sampling."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from glm5_jax import model
from glm5_jax.config import ModelConfig
from glm5_jax.infer import generate, sampling, speculative_generate
from glm5_jax.infer import speculative as sp


def _keys(n, seed):
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(n))


def _chi2_pvalue(counts, probs, min_expected=5.0):
    """Pearson chi-square p-value of counts against probs; cells expected < min_expected are pooled."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    expected = probs / probs.sum() * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert np.all(obs[~keep] == 0), "samples where the target has no mass"
    obs, exp = obs[keep], exp[keep]
    return stats.chi2.sf(np.sum((obs - exp) ** 2 / exp), len(obs) - 1)


# ----------------------------------------------------------------------------- per-row sampling pieces
def test_filter_rows_equals_filter_logits_per_row():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 11)) * 3, jnp.float32)
    logits = logits.at[2, 3].set(logits[2, 5])                          # a tie (top-k breaks it by id)
    temps, ks, ps = [0.7, 1.0, 1.3, 0.5, 2.0, 1.0], [0, 3, 5, 0, 1, 11], [1.0, 1.0, 0.6, 0.3, 1.0, 0.9]
    got = sampling.filter_rows(logits, jnp.array(temps), jnp.array(ks), jnp.array(ps))
    for b in range(6):
        want = sampling.filter_logits(logits[b:b + 1], temps[b], top_k=ks[b], use_top_p=ps[b] < 1, top_p=ps[b])
        np.testing.assert_allclose(got[b], want[0], rtol=1e-6)
    probs, lp = sampling.probs_rows(logits, jnp.array([0.0] + temps[1:]), jnp.array(ks), jnp.array(ps))
    np.testing.assert_array_equal(probs[0], jax.nn.one_hot(jnp.argmax(logits[0]), 11))   # greedy row
    np.testing.assert_allclose(probs[1:], jax.nn.softmax(got[1:], axis=-1), atol=1e-6)
    np.testing.assert_allclose(np.exp(lp), probs, atol=1e-6)


def _random_dists(rng, shape, v, peaky=2.0, zeros=True):
    x = rng.normal(size=shape + (v,)) * peaky
    if zeros:
        x[rng.random(x.shape) < 0.2] = -np.inf                         # some tokens outside the support
        x[..., 0] = np.maximum(x[..., 0], 0.0)
    p = np.exp(x - x.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def test_rejection_sample_marginals_and_closed_form_acceptance():
    """Independent p_j, q_j per position (the target does not depend on the prefix): the first output is
    distributed as p_0, the output at j given accepted >= j as p_j, and P(accept j | accepted >= j) =
    sum_x min(p_j(x), q_j(x))."""
    rng = np.random.default_rng(1)
    v, n, trials = 5, 3, 200_000
    p = _random_dists(rng, (n + 1,), v)
    q = _random_dists(rng, (n,), v)
    keys = _keys(trials, 7)
    dkeys = jax.vmap(lambda k: jax.random.split(k, n))(jax.vmap(lambda k: jax.random.fold_in(k, 99))(keys))
    drafts = jax.vmap(lambda ks: jax.vmap(lambda k, lq: jax.random.categorical(k, lq))(ks, jnp.log(q)))(dkeys)
    tokens, accepted = jax.jit(sp.rejection_sample)(keys, jnp.broadcast_to(p, (trials, n + 1, v)),
                                                    jnp.broadcast_to(q, (trials, n, v)), drafts)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert accepted.min() == 0 and accepted.max() == n
    for j in range(n + 1):
        reached = accepted >= j
        assert _chi2_pvalue(np.bincount(tokens[reached, j], minlength=v), p[j]) > 1e-3, j
        if j < n:
            rate = np.mean(accepted[reached] >= j + 1)
            want = np.minimum(p[j], q[j]).sum()
            sd = np.sqrt(want * (1 - want) / reached.sum())
            assert abs(rate - want) < 5 * sd + 1e-9, (j, rate, want)
    # drafts kept verbatim up to the first rejection
    j = np.arange(n)[None, :]
    kept = j < accepted[:, None]
    np.testing.assert_array_equal(tokens[:, :n][kept], np.asarray(drafts)[kept])


def _chain_sequences(p_tab, q_tab, start, length, n, trials, seed, verify=sp.rejection_sample):
    """Speculative sampling of a bigram chain (target p_tab[prev], drafter q_tab[prev]) for `trials` rows,
    round after round, -> [trials, length] first tokens of each row."""
    out = np.zeros((trials, length + n + 1), np.int64)
    count = np.zeros(trials, np.int64)
    prev = jnp.full((trials,), start, jnp.int32)
    p_tab, q_tab = jnp.asarray(p_tab, jnp.float32), jnp.asarray(q_tab, jnp.float32)
    verify = jax.jit(verify)
    r = 0
    while count.min() < length:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, r))(_keys(trials, seed))
        ks = jax.vmap(lambda k: jax.random.split(k, n + 1))(keys)
        drafts, qs, ctx = [], [], [prev]
        for k in range(n):
            q = q_tab[ctx[-1]]
            d = jax.vmap(jax.random.categorical)(ks[:, k], jnp.log(q)).astype(jnp.int32)
            drafts.append(d)
            qs.append(q)
            ctx.append(d)
        ps = jnp.stack([p_tab[c] for c in ctx], axis=1)                 # p_j given the drafts before j
        tokens, acc = verify(ks[:, n], ps, jnp.stack(qs, axis=1), jnp.stack(drafts, axis=1))
        tokens, acc = np.asarray(tokens), np.asarray(acc)
        live = count < length
        for j in range(n + 1):
            take = live & (j <= acc)
            out[take, count[take] + j] = tokens[take, j]
        count += np.where(live, acc + 1, 0)
        prev = jnp.asarray(out[np.arange(trials), count - 1], jnp.int32)
        r += 1
    return out[:, :length]


def test_rejection_sample_multi_round_chain_has_the_target_distribution():
    """Several rounds of drafts that depend on the prefix: the joint distribution of the first 3 tokens is
    the target chain's (chi-square over all 4^3 sequences); the drafter's own chain is rejected."""
    rng = np.random.default_rng(2)
    v, n, length, trials = 4, 2, 3, 60_000
    p_tab = _random_dists(rng, (v,), v, peaky=1.5, zeros=False)
    q_tab = _random_dists(rng, (v,), v, peaky=1.5, zeros=False)
    seqs = _chain_sequences(p_tab, q_tab, 1, length, n, trials, seed=3)
    counts = np.bincount(seqs @ (v ** np.arange(length)[::-1]), minlength=v ** length)

    def joint(tab):
        pr = np.ones([v] * length)
        for idx in np.ndindex(*pr.shape):
            prev = 1
            for t in idx:
                pr[idx] *= tab[prev, t]
                prev = t
        return pr

    assert _chi2_pvalue(counts, joint(p_tab)) > 1e-3
    assert _chi2_pvalue(counts, joint(q_tab)) < 1e-9                     # the test can tell them apart

    def accept_all(keys, p, q, d):                                       # a wrong verifier: always accept
        tok = jnp.concatenate([d, jax.vmap(jax.random.categorical)(keys, jnp.log(p[:, -1]))[:, None]], axis=1)
        return tok.astype(jnp.int32), jnp.full(d.shape[:1], d.shape[1], jnp.int32)

    wrong = _chain_sequences(p_tab, q_tab, 1, length, n, trials // 4, seed=4, verify=accept_all)
    wrong_counts = np.bincount(wrong @ (v ** np.arange(length)[::-1]), minlength=v ** length)
    assert _chi2_pvalue(wrong_counts, joint(p_tab)) < 1e-9


def test_rejection_sample_greedy_limit():
    """One-hot p and q (temperature 0): accept while draft == argmax p, then argmax p, for any key."""
    rng = np.random.default_rng(3)
    b, n, v = 64, 3, 7
    tgt = rng.integers(0, v, size=(b, n + 1))
    drafts = np.where(rng.random((b, n)) < 0.6, tgt[:, :n], rng.integers(0, v, size=(b, n)))
    p = jax.nn.one_hot(tgt, v)
    q = jax.nn.one_hot(drafts, v)
    for seed in range(3):
        tokens, acc = sp.rejection_sample(_keys(b, seed), p, q, jnp.asarray(drafts))
        want_acc = np.sum(np.cumprod(drafts == tgt[:, :n], axis=1), axis=1)
        np.testing.assert_array_equal(acc, want_acc)
        for r in range(b):
            np.testing.assert_array_equal(np.asarray(tokens)[r, :want_acc[r] + 1], tgt[r, :want_acc[r] + 1])
    with pytest.raises(ValueError, match="draft_probs"):
        sp.rejection_sample(_keys(b, 0), p, q[:, :2], jnp.asarray(drafts))


# ----------------------------------------------------------------------------- with the model's MTP head
V, PROMPT = 6, [1, 2, 3, 4]
TINY = ModelConfig(vocab_size=V, d_model=32, num_layers=1, num_experts=0, attention="mla", num_heads=2, mtp_depth=1)


@functools.lru_cache(maxsize=None)
def _tiny_params():
    """A tiny model with peaked next-token distributions and an MTP head that agrees with it often, not
    always (its block mostly passes the draft's embedding through, a bigram-like drafter for a trunk that
    is not one; acceptance ~0.8 / 0.65 at depths 1 / 2 at T = 1), so both the accept and the reject paths
    run at every depth."""
    params = model.init_params(TINY, jax.random.PRNGKey(3))
    params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 4.0
    layer = params["mtp_0"]["layer"]
    layer["attn"]["o_proj"]["kernel"] = jnp.zeros_like(layer["attn"]["o_proj"]["kernel"])
    layer["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(layer["mlp"]["down_proj"]["kernel"])
    d = TINY.d_model
    ident = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    params["mtp_0"]["eh_proj"]["kernel"] = 0.3 * ident + 7.0 * params["mtp_0"]["eh_proj"]["kernel"]
    return params


def _exact_joint(params, length, temperature, top_k=0, top_p=1.0):
    """Exact distribution of the first `length` tokens plain sampling draws after PROMPT: all V^(length-1)
    continuations through the full forward, filtered like sampling does."""
    conts = np.array(list(np.ndindex(*([V] * (length - 1)))), np.int32).reshape(-1, length - 1)
    seqs = np.concatenate([np.tile(PROMPT, (len(conts), 1)), conts], axis=1)
    logits = model.forward(TINY, params, jnp.asarray(seqs))[:, len(PROMPT) - 1:]        # [N, length, V]
    n = logits.shape[0] * length
    filt = sampling.filter_rows(logits.reshape(n, V), jnp.full((n,), temperature), jnp.full((n,), top_k),
                                jnp.full((n,), top_p))
    probs = np.asarray(jax.nn.softmax(filt, axis=-1)).reshape(len(conts), length, V)
    joint = np.zeros([V] * length)
    for idx in np.ndindex(*joint.shape):
        row = int(np.ravel_multi_index(idx[:-1], [V] * (length - 1))) if length > 1 else 0
        joint[idx] = np.prod([probs[row, j, idx[j]] for j in range(length)])
    return joint


def _counts(tokens, length):
    return np.bincount(np.asarray(tokens)[:, :length] @ (V ** np.arange(length)[::-1]), minlength=V ** length)


@pytest.mark.slow  # ~1 min on 2 shared cores
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_sampled_speculation_with_mtp_head_has_plain_sampling_distribution(temperature, top_k, top_p):
    """Speculative sampling (2 drafts from the MTP head per round, several rounds) and plain `generate`
    sampling both match the exact distribution of the first 3 tokens (chi-square over 216 sequences)."""
    params, length, trials = _tiny_params(), 3, 24_000
    joint = _exact_joint(params, length, temperature, top_k, top_p)
    spec = speculative_generate(TINY, params, [PROMPT] * trials, max_new_tokens=length, num_draft=2,
                                temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    plain = generate(TINY, params, [PROMPT] * trials, max_new_tokens=length, temperature=temperature, top_k=top_k,
                     top_p=top_p, seed=12)
    assert _chi2_pvalue(_counts(spec.tokens, length), joint) > 1e-3
    assert _chi2_pvalue(_counts(plain.tokens, length), joint) > 1e-3
    acc = spec.stats["acceptance_per_depth"]
    assert len(acc) == 2 and 0.1 < acc[1] <= acc[0] < 0.95, acc        # accepts and rejects at both depths
    assert spec.stats["accepted_per_depth"][0] == round(acc[0] * spec.stats["verify_rows"])
    # log-probs: those of the filtered target distribution, as plain sampling reports them
    lp_plain = {}
    for t, l in zip(plain.tokens[:, 0], plain.logprobs[:, 0]):
        lp_plain.setdefault(int(t), float(l))
    for t, l in zip(spec.tokens[:200, 0], spec.logprobs[:200, 0]):
        np.testing.assert_allclose(l, lp_plain[int(t)], atol=1e-5)


def _run_rows(config, params, prompts, temps, n_new, num_draft, seed=0):
    """Sequences with per-row temperatures (the greedy=False step program) on one speculative runtime, as
    the engine runs them; sequence i draws with its own key fold_in(PRNGKey(seed + i), t)."""
    from glm5_jax.infer.runtime import PagedRuntime, Seq
    rt = PagedRuntime(config, params, max_running=len(prompts), max_model_len=32, page_size=4,
                      max_num_batched_tokens=len(prompts) * (1 + num_draft) + 8, num_draft=num_draft)
    seqs = rt.run([Seq(list(p), temperature=t, seed=seed + i, max_tokens=n_new) for i, (p, t) in
                   enumerate(zip(prompts, temps))])
    return [s.tokens for s in seqs], [s.logprobs for s in seqs]


@pytest.mark.slow   # ~25 s of decoding (the rejection-sampler tests above are the fast checks)
def test_greedy_rows_of_a_sampled_batch_equal_plain_greedy_and_rows_are_independent():
    params, n_new = _tiny_params(), 8
    prompts = [PROMPT, [5, 1, 2, 0], PROMPT]
    greedy = generate(TINY, params, prompts, max_new_tokens=n_new, temperature=0.0)
    toks, lps = _run_rows(TINY, params, prompts, [0.0, 1.0, 0.0], n_new, num_draft=2)
    for r in (0, 2):                                                     # temperature 0 rows: plain greedy
        np.testing.assert_array_equal(toks[r], greedy.tokens[r])
        np.testing.assert_allclose(lps[r], greedy.logprobs[r], atol=1e-5)
    # a row's samples depend on its own key only: the same key alone gives the same tokens
    alone, _ = _run_rows(TINY, params, [prompts[1]], [1.0], n_new, num_draft=2, seed=1)
    np.testing.assert_array_equal(toks[1], alone[0])


def test_perfect_drafter_sampled_acceptance_does_not_collapse_with_depth():
    """MTP block = the trunk's bigram (test_infer_speculative's construction): q == p, so at temperature 1
    every draft at every depth is accepted (no collapse after the first draft position)."""
    from tests.test_infer_speculative import PROMPTS, _bigram_model
    cfg, params = _bigram_model()
    spec = speculative_generate(cfg, params, PROMPTS, max_new_tokens=16, num_draft=3, temperature=1.0, seed=5)
    assert spec.stats["acceptance_per_depth"] == [1.0, 1.0, 1.0]
    assert spec.acceptance_length == 4.0
    greedy = speculative_generate(cfg, params, PROMPTS, max_new_tokens=16, num_draft=3)
    assert greedy.stats["acceptance_per_depth"] == [1.0, 1.0, 1.0]
