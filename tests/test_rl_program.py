"""The GRPO RL program: rollout -> batch bookkeeping, old_logp == generate's logprobs, frozen indexer,
the mismatch switch, and that an update raises the log-prob of positive-advantage completions."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from glm5_jax.config import ModelConfig
from glm5_jax.model import init_params
from glm5_jax.rl.program import (RLConfig, make_rl_optimizer, make_update_step, policy_temperature, rl_train_config,
                                 token_logprobs)
from glm5_jax.rl.rollout import Rollout, build_batch, collect_rollouts, fake_quant, rollout_params
from glm5_jax.rl.sft import CharVocab, SFTIterator, pack_examples
from glm5_jax.rl.tasks import arithmetic_task
from glm5_jax.train.state import init_train_state

VOCAB = CharVocab()
MAX_NEW, MAX_PROMPT = 6, 8


@pytest.fixture(scope="module")
def setup():
    cfg = ModelConfig(vocab_size=VOCAB.padded_size(), d_model=32, num_layers=2, num_heads=2, q_lora_rank=16,
                      kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=4, v_head_dim=16, ffn_dim=64,
                      attention="dsa", index_topk=4, index_n_heads=2, index_head_dim=8, num_experts=0,
                      mtp_depth=0, attn_chunk=16, initializer_range=0.1)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = random.Random(0)
    tasks = [arithmetic_task(rng, level) for level in (0, 1, 2, 2)]    # prompts of different lengths
    ro = collect_rollouts(cfg, params, tasks, VOCAB, group_size=2, max_new_tokens=MAX_NEW, seed=3)
    return cfg, params, tasks, ro


def _dev(batch, cfg, params):
    dev = {k: jnp.asarray(v) for k, v in batch.items()}
    dev["old_logp"] = token_logprobs(cfg, params, dev["inputs"], dev["targets"])
    return dev


def test_vocab_roundtrip_and_sft_packing():
    t = arithmetic_task(random.Random(1), 3, worked=True)
    ids = VOCAB.encode(t.sft_text, bos=True)
    assert ids[0] == VOCAB.bos_id and VOCAB.decode(ids) == t.sft_text
    p, a = VOCAB.encode("12+3=", bos=True), VOCAB.encode("15\n")
    b = pack_examples([(p, a), (p, a)], 2, 10)        # second example does not fit row 0 -> row 1
    assert b["segment_ids"][0].tolist() == [1] * 9 + [0] and b["segment_ids"][1, :9].tolist() == [2] * 9
    assert b["positions"][1, :9].tolist() == list(range(9))
    # loss only where the target is an answer token: targets at index 5, 6, 7 are "1", "5", "\n"
    assert b["loss_mask"][0].tolist() == [0] * 5 + [1] * 3 + [0, 0]
    assert VOCAB.decode(b["targets"][0][b["loss_mask"][0] > 0]) == "15\n"
    it = SFTIterator(lambda r: arithmetic_task(r, 2), VOCAB, 2, 32, seed=5)
    first = next(it)
    st = it.get_state()
    second = next(it)
    it.set_state(st)
    np.testing.assert_array_equal(next(it)["tokens"], second["tokens"])
    assert not np.array_equal(first["tokens"], second["tokens"])


def test_rollout_tokens_and_logprobs_reach_batch_unchanged(setup):
    cfg, params, tasks, ro = setup
    batch = build_batch(ro, np.arange(len(ro.prompts), dtype=np.float32), MAX_PROMPT)
    S = MAX_PROMPT + MAX_NEW - 1
    assert batch["inputs"].shape == batch["targets"].shape == batch["mask"].shape == (len(ro.prompts), S)
    for i, prompt in enumerate(ro.prompts):
        p, n = len(prompt), int(ro.lengths[i])
        m = batch["mask"][i] > 0
        # mask covers exactly the generated tokens (incl. the stop token): target positions p-1 .. p-2+n
        assert np.flatnonzero(m).tolist() == list(range(p - 1, p - 1 + n))
        np.testing.assert_array_equal(batch["targets"][i][m], ro.tokens[i, :n])
        np.testing.assert_array_equal(batch["infer_logp"][i][m], ro.infer_logp[i, :n])   # bit-identical
        np.testing.assert_array_equal(batch["inputs"][i, :p], prompt)
        assert np.all(batch["infer_logp"][i][~m] == 0)
        if ro.tokens[i, n - 1] == VOCAB.newline_id:
            assert ro.texts[i].endswith("\n")
        # nothing but padding after the completion
        assert np.all(batch["targets"][i, p - 1 + n:] == 0)
        assert batch["advantages"][i] == i


def test_stop_token_included_in_mask():
    # a hand-made rollout: row 0 stops (newline) after 2 tokens, row 1 runs to the length limit
    nl = VOCAB.newline_id
    toks = np.array([[VOCAB.encode("7")[0], nl, 0, 0], VOCAB.encode("1234")], np.int32)
    ro = Rollout(prompts=[VOCAB.encode("3+4=", bos=True), VOCAB.encode("9*9=", bos=True)], tokens=toks,
                 infer_logp=np.array([[-0.5, -0.25, 0, 0], [-1, -2, -3, -4]], np.float32),
                 lengths=np.array([2, 4], np.int32), texts=["7\n", "1234"], rewards=np.array([1.0, 0.0], np.float32),
                 statuses=["correct", "truncated"])
    b = build_batch(ro, np.array([1.0, -1.0]), 6)
    assert b["mask"][0].tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0]
    assert b["targets"][0, 4:6].tolist() == [toks[0, 0], nl]
    assert b["mask"][1].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0]
    assert b["infer_logp"][1, 4:8].tolist() == [-1, -2, -3, -4]


def test_old_logp_matches_generate_logprobs(setup):
    cfg, params, _, ro = setup
    batch = build_batch(ro, np.zeros(len(ro.prompts)), MAX_PROMPT)
    old = np.asarray(token_logprobs(cfg, params, jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])))
    m = batch["mask"] > 0
    np.testing.assert_allclose(old[m], batch["infer_logp"][m], atol=1e-4, rtol=0)


def test_old_logp_at_the_sampling_temperature_matches_generate_logprobs(setup):
    """IcePop's ratio compares like with like: rollouts sampled at T=0.7 report log-probs of the
    T-scaled distribution, and the training engine's log-probs at policy_temperature(rl) equal them
    (at T=1 they would not)."""
    cfg, params, tasks, _ = setup
    rl = RLConfig(temperature=0.7)
    ro = collect_rollouts(cfg, params, tasks, VOCAB, group_size=2, max_new_tokens=MAX_NEW, seed=5, temperature=0.7)
    batch = build_batch(ro, np.zeros(len(ro.prompts)), MAX_PROMPT)
    inputs, targets = jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])
    m = batch["mask"] > 0
    at_t = np.asarray(token_logprobs(cfg, params, inputs, targets, temperature=policy_temperature(rl)))
    np.testing.assert_allclose(at_t[m], batch["infer_logp"][m], atol=1e-4, rtol=0)
    at_1 = np.asarray(token_logprobs(cfg, params, inputs, targets))
    assert np.abs(at_1[m] - batch["infer_logp"][m]).max() > 1e-3


def test_mismatch_switch_changes_infer_logp(setup):
    cfg, params, tasks, _ = setup
    for mode in ("bf16", "int8"):
        ro = collect_rollouts(cfg, params, tasks, VOCAB, group_size=2, max_new_tokens=MAX_NEW, seed=3,
                              mismatch=mode)
        batch = build_batch(ro, np.zeros(len(ro.prompts)), MAX_PROMPT)
        old = np.asarray(token_logprobs(cfg, params, jnp.asarray(batch["inputs"]), jnp.asarray(batch["targets"])))
        m = batch["mask"] > 0
        diff = np.abs(old[m] - batch["infer_logp"][m])
        assert diff.max() > 1e-3, (mode, diff.max())
    q = rollout_params(params, "int8")
    assert all(a.dtype == b.dtype for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(params)))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)
    y = fake_quant(x, 8, -1)
    assert float(jnp.max(jnp.abs(x - y))) <= float(jnp.max(jnp.abs(x))) / 127 / 2 + 1e-6
    assert len(np.unique(np.asarray(y[:, 0]))) <= 255


def _masked_seq_mean(lp, mask):
    return np.sum(lp * mask, -1) / np.maximum(mask.sum(-1), 1)


@pytest.mark.parametrize("loss", ["icepop"])
def test_update_raises_positive_advantage_logprob_and_freezes_indexer(setup, loss):
    cfg, params, _, ro = setup
    B = len(ro.prompts)
    adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
    batch = _dev(build_batch(ro, adv, MAX_PROMPT), cfg, params)
    rl = RLConfig(loss=loss, learning_rate=3e-3, mismatch="none")
    tx, labels = make_rl_optimizer(params, rl)
    frozen = [k for k, v in traverse_util.flatten_dict(labels).items() if v == "frozen"]
    assert frozen and all(any("indexer" in str(p) for p in k) for k in frozen)
    step = make_update_step(cfg, rl, tx)
    state, _ = init_train_state(cfg, rl_train_config(rl), tx=tx, params=params)
    before = _masked_seq_mean(np.asarray(batch["old_logp"]), np.asarray(batch["mask"]))
    for _ in range(2):
        state, metrics = step(state, batch)
    p = state["params"]
    after = _masked_seq_mean(np.asarray(token_logprobs(cfg, p, batch["inputs"], batch["targets"])),
                             np.asarray(batch["mask"]))
    pos = adv > 0
    assert after[pos].mean() > before[pos].mean() + 1e-3
    assert after[~pos].mean() < before[~pos].mean()
    assert float(metrics["pop_frac"]) == 0.0 and np.isfinite(float(metrics["loss"]))
    assert {"clip_frac", "mismatch_kl", "grad_norm", "update_norm"} <= set(metrics)
    flat0, flat1 = traverse_util.flatten_dict(params), traverse_util.flatten_dict(p)
    idx_keys = [k for k in flat0 if any("indexer" in str(x) for x in k)]
    assert idx_keys
    for k in idx_keys:
        np.testing.assert_array_equal(np.asarray(flat0[k]), np.asarray(flat1[k]))
    changed = [k for k in flat0 if k not in idx_keys and not np.array_equal(np.asarray(flat0[k]), np.asarray(flat1[k]))]
    assert len(changed) > len(flat0) // 2


def test_sgd_update_with_frozen_embedding_and_informative_norm(setup):
    """Momentum-free SGD (the grpo_icepop setting): positive-advantage log-probs rise, frozen leaves
    (indexer, embedding) get exactly zero update; adv_norm / optimizer / int5 are validated."""
    cfg, params, _, ro = setup
    B = len(ro.prompts)
    adv = np.where(np.arange(B) % 2 == 0, 1.0, -1.0).astype(np.float32)
    batch = _dev(build_batch(ro, adv, MAX_PROMPT), cfg, params)
    rl = RLConfig(loss="icepop", optimizer="sgd", momentum=0.0, learning_rate=0.05, mismatch="int5",
                  adv_norm="informative", frozen_patterns=("indexer", "embed"))
    tx, _ = make_rl_optimizer(params, rl)
    step = make_update_step(cfg, rl, tx)
    state, _ = init_train_state(cfg, rl_train_config(rl), tx=tx, params=params)
    before = _masked_seq_mean(np.asarray(batch["old_logp"]), np.asarray(batch["mask"]))
    for _ in range(2):
        state, _ = step(state, batch)
    p = state["params"]
    after = _masked_seq_mean(np.asarray(token_logprobs(cfg, p, batch["inputs"], batch["targets"])),
                             np.asarray(batch["mask"]))
    assert after[adv > 0].mean() > before[adv > 0].mean()
    flat0, flat1 = traverse_util.flatten_dict(params), traverse_util.flatten_dict(p)
    for k in flat0:
        if any(("indexer" in str(x)) or ("embed" in str(x)) for x in k):
            np.testing.assert_array_equal(np.asarray(flat0[k]), np.asarray(flat1[k]))
    for bad in ({"optimizer": "lion"}, {"adv_norm": "x"}, {"mismatch": "int9"}):
        with pytest.raises(ValueError):
            RLConfig(**bad)
