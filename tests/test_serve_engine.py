"""The continuous-batching engine (glm5_jax.serve.engine): greedy against the static decoder, prefix reuse
against a full prefill (same slot and copied from a busy slot), nothing recompiles after warm-up, decode row
buckets equal to full-width decoding, weight push with pause / resume, static admission, the bounded queue,
MTP speculation (greedy equal to plain decoding, a perfect drafter fully accepted, sampled rows independent
of batch-mates)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.config import ModelConfig
from glm5_jax.infer import generate
from glm5_jax.serve.engine import Engine, QueueFull, SamplingParams

CFG = ModelConfig(attention="dsa", num_layers=2, index_topk=4, indexer_types=("full", "shared"), mtp_depth=0)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, jax.random.PRNGKey(0))


def test_greedy_equals_static_decoder_and_prefix_reuse_equals_full_prefill(params):
    eng = Engine(CFG, params, max_batch=3, max_model_len=64)
    ref = Engine(CFG, params, max_batch=3, max_model_len=64, prefix_reuse=False)
    try:
        p1 = [5, 6, 7, 8, 9, 10, 11, 12, 13]
        a = eng.generate([p1], GREEDY)[0]
        static = generate(CFG, params, [p1], max_new_tokens=6, temperature=0.0)
        assert a.tokens == static.tokens[0].tolist()
        np.testing.assert_allclose(a.logprobs, static.logprobs[0], atol=1e-5)
        # the next turn extends the context: reuses the slot's cache (prompt + generated tokens fed back)
        p2 = p1 + a.tokens + [3, 4, 5]
        b = eng.generate([p2], GREEDY)[0]
        assert b.reused_tokens == len(p1) + len(a.tokens) - 1
        full = ref.generate([p2], GREEDY)[0]
        assert full.reused_tokens == 0
        assert b.tokens == full.tokens
        np.testing.assert_allclose(b.logprobs, full.logprobs, atol=1e-5)
        # a shared prefix held by a busy slot is copied into a free slot
        long = eng.submit(p2 + [7] * 4, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
        while not long.tokens:
            time.sleep(0.01)
        p3 = p2 + [7] * 4 + [9, 9]
        c = eng.submit(p3, GREEDY).result(120)
        long.result(120)
        assert c.reused_tokens >= len(p2)
        c_full = ref.generate([p3], GREEDY)[0]
        assert c.tokens == c_full.tokens
        np.testing.assert_allclose(c.logprobs, c_full.logprobs, atol=1e-5)
    finally:
        eng.shutdown()
        ref.shutdown()


def test_no_recompiles_after_warmup_and_seeded_sampling_is_slot_independent(params):
    eng = Engine(CFG, params, max_batch=2, max_model_len=40)
    try:
        eng.warmup()
        n0 = eng.compiled_programs()
        rng = np.random.default_rng(1)
        hs = []
        for i in range(5):
            prompt = rng.integers(1, CFG.vocab_size, int(rng.integers(1, 30))).tolist()
            sp = SamplingParams(max_tokens=int(rng.integers(1, 8)), temperature=float(rng.uniform(0, 1.5)),
                                top_k=int(rng.integers(0, 20)), top_p=float(rng.uniform(0.5, 1.0)), seed=i,
                                stop_token_ids=[int(rng.integers(0, CFG.vocab_size))])
            hs.append((prompt, sp, eng.submit(prompt, sp)))
        for prompt, sp, h in hs:
            h.result(120)
            assert h.finish_reason in ("stop", "length")
        assert eng.compiled_programs() == n0
        # the same request alone (another slot, other batch-mates) samples the same tokens
        for prompt, sp, h in hs:
            assert eng.generate([prompt], sp)[0].tokens == h.tokens
        assert eng.compiled_programs() == n0
    finally:
        eng.shutdown()


def test_step_widths_equal_default_widths_exactly_and_nothing_recompiles(params):
    """step_widths=(2, 4) (the row buckets a rollout server passes: a decode-only step of <= 2 busy requests
    runs 2 token rows) vs the default widths (powers of two from 8): for a mix of concurrent greedy requests
    (joining and leaving the batch, a later turn reusing a prefix) the tokens and log-probs are exactly
    equal, the narrow engine ran fewer rows, and nothing compiles after warm-up."""
    kw = dict(max_batch=4, max_model_len=48, prefill_chunk=16)
    small = Engine(CFG, params, step_widths=(2, 4), **kw)
    full = Engine(CFG, params, **kw)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, CFG.vocab_size, int(rng.integers(3, 14))).tolist() for _ in range(6)]
    lens = [2, 3, 12, 14, 5, 9]

    def run(eng):
        eng.pause()                      # all six queue first: the same admissions in both engines
        hs = [eng.submit(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
              for p, n in zip(prompts, lens)]
        eng.resume()
        first = [h.result(120) for h in hs]
        eng.pause()                      # the longest request's next turn and a new prompt
        later = [eng.submit(q, SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
                 for q in (prompts[3] + first[3].tokens + [3, 4], [7, 8, 9])]
        eng.resume()
        return first + [h.result(120) for h in later]

    try:
        assert small.buckets[:2] == (2, 4) and full.buckets[0] == 8
        small.warmup()
        full.warmup()
        n0 = small.compiled_programs()
        a, b = run(small), run(full)
        assert [h.tokens for h in a] == [h.tokens for h in b]
        assert [len(h.tokens) for h in a] == lens + [7] * 2
        assert [h.logprobs for h in a] == [h.logprobs for h in b]                  # exactly
        assert [h.sample_logprobs for h in a] == [h.sample_logprobs for h in b]
        assert a[6].reused_tokens == b[6].reused_tokens > 0
        assert small.stats["decode_rows"] < full.stats["decode_rows"]              # narrower steps
        assert small.compiled_programs() == n0
    finally:
        small.shutdown()
        full.shutdown()


def test_weight_push_pause_resume_static_admission_and_bounded_queue(params):
    params2 = model.init_params(CFG, jax.random.PRNGKey(7))
    eng = Engine(CFG, params, max_batch=2, max_model_len=32, max_queue=2)
    try:
        eng.pause()
        h = eng.submit([1, 2, 3], GREEDY)
        time.sleep(0.2)
        assert not h.tokens                                  # held while paused
        eng.update_weights(params2, 7)
        eng.submit([4, 5], GREEDY)
        with pytest.raises(QueueFull):
            eng.submit([6], GREEDY)
        eng.resume()
        h.result(120)
        assert set(h.versions) == {7}
        fresh = generate(CFG, params2, [[1, 2, 3]], max_new_tokens=6, temperature=0.0)
        assert h.tokens == fresh.tokens[0].tolist()
    finally:
        eng.shutdown()
    st = Engine(CFG, params, max_batch=2, max_model_len=32, batching="static")
    try:
        long = st.submit([1, 2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        while not long.tokens:
            time.sleep(0.005)
        short = st.submit([3], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)).result(120)
        long.result(120)
        assert short.first_token_at >= long.finished_at      # it waited for the batch's longest row
    finally:
        st.shutdown()


def _perfect_drafter():
    """Attention and MLP outputs zeroed (a bigram model) and the MTP block passing embed(next token)
    through: every draft is what the trunk predicts."""
    cfg = ModelConfig(attention="gqa", num_kv_heads=2, num_layers=2, num_experts=0, mtp_depth=1)
    p = model.init_params(cfg, jax.random.PRNGKey(1))
    for blk in (p["dense_layers"]["layer_0"], p["mtp_0"]["layer"]):
        blk["attn"]["o_proj"]["kernel"] = jnp.zeros_like(blk["attn"]["o_proj"]["kernel"])
        blk["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(blk["mlp"]["down_proj"]["kernel"])
    d = cfg.d_model
    p["mtp_0"]["eh_proj"]["kernel"] = jnp.concatenate([jnp.eye(d), jnp.zeros((d, d))], axis=0)
    return cfg, p


@pytest.mark.slow   # ~70 s on 2 loaded cores (speculative programs compile for three prefill buckets)
def test_speculative_engine_equals_plain_and_accepts_a_perfect_drafter():
    cfg = CFG.replace(mtp_depth=1)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], [4] * 19]
    base = Engine(cfg, params, max_batch=3, max_model_len=48)
    spec = Engine(cfg, params, max_batch=3, max_model_len=48, speculative=2)
    try:
        g = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        a, b = base.generate(prompts, g), spec.generate(prompts, g)
        assert [x.tokens for x in a] == [y.tokens for y in b]
        np.testing.assert_allclose([x.logprobs for x in a], [y.logprobs for y in b], atol=1e-5)
        p2 = prompts[0] + b[0].tokens + [3, 4]               # prefix reuse with the MTP caches
        c = spec.generate([p2], g)[0]
        assert c.reused_tokens > 0 and c.tokens == base.generate([p2], g)[0].tokens
        sp = SamplingParams(max_tokens=8, temperature=1.0, seed=5)
        together = spec.generate(prompts, sp)
        assert [h.tokens for h in together] == [spec.generate([p], sp)[0].tokens for p in prompts]
    finally:
        base.shutdown()
        spec.shutdown()
    cfg, params = _perfect_drafter()
    spec = Engine(cfg, params, max_batch=2, max_model_len=48, speculative=3)
    try:
        h = spec.generate([[1, 2, 3]], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True))[0]
        assert h.tokens == generate(cfg, params, [[1, 2, 3]], max_new_tokens=13, temperature=0.0).tokens[0].tolist()
        assert spec.acceptance["length"] == 4.0 and spec.acceptance["per_depth"] == [1.0, 1.0, 1.0]
    finally:
        spec.shutdown()
