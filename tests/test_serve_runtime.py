"""The paged generation runtime (glm5_jax.infer.runtime): concurrent sequences sharing prompts and
prefixes (radix pages by reference, copy-on-write of a partial page), decodes and prefill chunks mixed in
one step, against the static decoder (glm5_jax.infer.generate) for greedy and against each sequence run
alone for seeded sampling; the one-row-per-slot policy (page_size = max_model_len, no sharing) gives the
same greedy tokens; a pool too small for the batch preempts and recomputes, and no page is leaked."""

import jax
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.config import ModelConfig
from glm5_jax.infer import generate
from glm5_jax.infer.runtime import PENDING, PagedRuntime, Seq

CFG = ModelConfig(num_layers=3, mtp_depth=0, index_topk=8)      # DSA, dense prefix 1 + MoE body 2
MAX_LEN = 64


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, jax.random.PRNGKey(0))


def _prompts():
    rng = np.random.default_rng(3)
    base = rng.integers(1, CFG.vocab_size, 30).tolist()
    return [base, base, base[:13], base + [5, 6], base[:22] + [9] * 4, rng.integers(1, CFG.vocab_size, 9).tolist()]


def _seqs(prompts, temp=0.0):
    return [Seq(list(p), temperature=temp, seed=7 + i, max_tokens=6) for i, p in enumerate(prompts)]


def _assert_no_page_leaked(rt):
    use = rt.pages_in_use()
    assert not rt.running and use["running"] == 0
    assert use["free"] + use["cached"] == rt.num_pages


def test_greedy_and_seeded_sequences_equal_each_alone_with_shared_pages(params):
    prompts = _prompts()
    rt = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=4, max_num_batched_tokens=16)
    greedy = rt.run(_seqs(prompts))
    for p, s in zip(prompts, greedy):
        ref = generate(CFG, params, [p], max_new_tokens=6, temperature=0.0)
        assert s.tokens == ref.tokens[0].tolist()
        np.testing.assert_allclose(s.logprobs, ref.logprobs[0], atol=1e-4)
    assert rt.stats["reused_tokens"] > 0                   # later prompts took cached pages
    sampled = rt.run(_seqs(prompts, temp=1.0))
    for i, p in enumerate(prompts):                         # each seeded sequence alone, its own seed
        one = rt.run([Seq(list(p), temperature=1.0, seed=7 + i, max_tokens=6)])[0]
        assert one.tokens == sampled[i].tokens
        assert one.logprobs == sampled[i].logprobs     # bit for bit: a narrower page table alone (DSA widths)
    _assert_no_page_leaked(rt)


@pytest.mark.slow   # ~22 s; test_long_prompts_..._preempt stays in the default run
def test_slot_policy_equals_paged_and_a_small_pool_preempts_without_leaking(params):
    prompts = _prompts()
    paged = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=4,
                         max_num_batched_tokens=16).run(_seqs(prompts))
    slots = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=MAX_LEN,
                         max_num_batched_tokens=16, prefix_cache="none").run(_seqs(prompts))
    assert [s.tokens for s in slots] == [s.tokens for s in paged]
    # 16 pages of 4 (one max_model_len) for 4 running sequences of up to 38 tokens (10 pages each): preemption by recompute
    small = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=4, kv_cache_tokens=64,
                         max_num_batched_tokens=16)
    got = small.run(_seqs(prompts))
    assert small.stats["preempted"] > 0
    assert [s.tokens for s in got] == [s.tokens for s in paged]
    _assert_no_page_leaked(small)


def test_a_step_runs_every_decode_first_then_prefill_chunks_within_the_budget(params):
    """Three sequences decoding and a 40-token prompt arriving: every step gives each decoding sequence its
    token (a long prompt delays the decodes by no step), the prompt is fed in chunks of at most
    prefill_chunk tokens that fill what the budget leaves, and no step exceeds max_num_batched_tokens."""
    rt = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=4, max_num_batched_tokens=12,
                      prefill_chunk=8)
    rng = np.random.default_rng(5)
    short = [rt.add(Seq(rng.integers(1, CFG.vocab_size, 3).tolist(), max_tokens=30)) for _ in range(3)]
    while any(not s.tokens for s in short):
        rt.step()
    long = rt.add(Seq(rng.integers(1, CFG.vocab_size, 40).tolist(), max_tokens=2))
    fed = []
    while not long.tokens:
        before = {s: len(s.tokens) for s in short}
        plan = rt.plan()
        assert plan.tokens <= 12
        decodes = [take for seq, _, _, take in plan.rows if seq in short]
        assert decodes == [1, 1, 1]                       # every decoding sequence, first
        assert [seq for seq, *_ in plan.rows][:3] == short
        chunk = [take for seq, _, _, take in plan.rows if seq is long]
        assert chunk and chunk[0] <= min(8, 12 - 3)
        fed.append(chunk[0])
        rt.commit(plan, jax.tree.map(np.asarray, rt.run_program(plan.width, plan.echo, plan.args)))
        assert all(len(s.tokens) == before[s] + 1 for s in short)
    assert sum(fed) == 40 and max(fed) == 8


def test_long_prompts_that_overfill_the_pool_preempt_younger_ones_and_all_finish(params):
    """Four 40..56-token prompts into a pool of one max_model_len (16 pages of 4), prefilled in chunks: a
    prefill that runs out of pages takes them from younger sequences (never older ones), so every sequence
    finishes with the tokens it gets alone and no page is leaked."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, CFG.vocab_size, n).tolist() for n in (40, 48, 56, 44)]
    rt = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=4, kv_cache_tokens=64,
                      max_num_batched_tokens=16, prefill_chunk=8, prefix_cache="none")
    got = rt.run(_seqs(prompts))
    assert rt.stats["preempted"] > 0
    for p, s in zip(prompts, got):
        alone = rt.run(_seqs([p]))[0]
        assert s.tokens == alone.tokens
    _assert_no_page_leaked(rt)


@pytest.mark.slow   # ~23 s; every engine and server test in the default run steps overlapped
def test_overlapped_steps_equal_one_at_a_time_with_stops_and_no_page_leaked(params):
    """Overlapped steps (step N + 1 planned and dispatched before step N's tokens reach the host: its decode
    tokens fed from step N's outputs on the device, `PagedRuntime.advance` / PENDING) give exactly the
    tokens, log-probs and finish reasons of one step at a time, greedy and seeded, with max_tokens and stop
    ids that end sequences while a later step already runs their next token (that token is dropped); no
    page is leaked."""
    prompts = _prompts()
    ref = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=4,
                       max_num_batched_tokens=16).run([Seq(list(q), max_tokens=8) for q in prompts])
    stops = [(s.tokens[3],) for s in ref]                      # each greedy sequence stops at its 4th token
    for temp in (0.0, 1.0):
        def seqs():
            return [Seq(list(q), temperature=temp, seed=7 + i, max_tokens=3 + i, stop_ids=stops[i] if temp == 0 else ())
                    for i, q in enumerate(prompts)]
        rt = PagedRuntime(CFG, params, max_running=4, max_model_len=MAX_LEN, page_size=4, max_num_batched_tokens=16)
        one, ov = rt.run(seqs()), rt.run(seqs(), overlap=True)
        assert [(s.tokens, s.logprobs, s.finish) for s in ov] == [(s.tokens, s.logprobs, s.finish) for s in one]
        assert all(PENDING not in s.tokens for s in ov)
        if temp == 0:
            assert [s.finish for s in ov].count("stop") >= 3
        _assert_no_page_leaked(rt)


@pytest.mark.slow   # ~40 s: the speculative step programs compile for several widths
def test_mtp_speculation_on_pages_equals_plain_greedy_and_sampled_alone_with_shared_prefixes_and_preemption():
    """MTP speculation (2 drafts a step) on the paged runtime, prompts sharing prefixes through the radix
    (a match stops 2 x num_draft tokens short: MTP entries read tokens ahead): greedy tokens and log-probs
    equal plain paged greedy; each seeded sampled sequence gets exactly what it gets alone; a pool too small
    for the batch preempts and recomputes with the same tokens, and no page is leaked."""
    cfg = CFG.replace(mtp_depth=1)
    p = model.init_params(cfg, jax.random.PRNGKey(0))
    prompts = _prompts()
    kw = dict(max_running=4, max_model_len=MAX_LEN, page_size=4, max_num_batched_tokens=24)
    plain = PagedRuntime(cfg, p, **kw).run(_seqs(prompts))
    rt = PagedRuntime(cfg, p, num_draft=2, **kw)
    spec = rt.run(_seqs(prompts))
    assert [s.tokens for s in spec] == [s.tokens for s in plain]
    np.testing.assert_allclose([s.logprobs for s in spec], [s.logprobs for s in plain], atol=1e-5)
    assert rt.stats["reused_tokens"] > 0 and rt.acceptance()["steps"] > 0
    sampled = rt.run(_seqs(prompts, temp=1.0))
    for i, q in enumerate(prompts):
        one = rt.run([Seq(list(q), temperature=1.0, seed=7 + i, max_tokens=6)])[0]
        assert one.tokens == sampled[i].tokens
    _assert_no_page_leaked(rt)
    small = PagedRuntime(cfg, p, num_draft=2, kv_cache_tokens=68, **kw)      # 17 pages: one max_model_len + 2
    got = small.run(_seqs(prompts))
    assert small.stats["preempted"] > 0
    assert [s.tokens for s in got] == [s.tokens for s in plain]
    _assert_no_page_leaked(small)
