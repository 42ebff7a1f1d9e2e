"""mtp_sharing experiment: arm configs, held-out prompts, the inference-model layer reuse for unshared
blocks, and a micro end-to-end run (slow: several jit compiles per arm)."""

from __future__ import annotations

import json
import math
import os

import jax
import numpy as np
import pytest

from experiments import registry
from experiments.mtp_sharing import ARMS, TINY, arm_configs, primary_differences
from glm5_jax.eval.mtp import inference_model, speculative_accepts
from glm5_jax.overrides import OverrideError
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.model import init_params
from tests.test_experiments import MICRO


def test_registered_with_both_scales_and_overrides():
    exp = registry.get("mtp_sharing")
    assert set(exp.scales) == {"tiny", "small"}
    c = registry.resolve_config(exp, "tiny", ["num_prompts=3", "draft_sweep=1,2", "arms=shared3,depth1"], steps=7)
    assert (c.train.steps, c.num_prompts, c.draft_sweep, c.arms) == (7, 3, (1, 2), ("shared3", "depth1"))
    assert c.num_draft == 4
    with pytest.raises(OverrideError, match="no field 'no_such_setting'"):
        registry.resolve_config(exp, "tiny", ["no_such_setting=1"])
    with pytest.raises(ConfigError, match="arms=.*allowed|subset of shared3, indep3, depth1"):
        registry.resolve_config(exp, "tiny", ["arms=shared3,bogus"])
    with pytest.raises(OverrideError, match="derives it from the arm"):
        registry.resolve_config(exp, "tiny", ["model.mtp_depth=2"])


def test_arm_configs_differ_only_in_mtp():
    cfgs = arm_configs(TINY.model.replace(d_model=32, num_layers=1, vocab_size=300))
    assert set(cfgs) == set(ARMS)
    assert (cfgs["shared3"].mtp_depth, cfgs["shared3"].mtp_share) == (3, True)
    assert (cfgs["indep3"].mtp_depth, cfgs["indep3"].mtp_share) == (3, False)
    assert cfgs["depth1"].mtp_depth == 1
    for c in cfgs.values():
        assert c.replace(mtp_depth=1, mtp_share=True) == cfgs["depth1"]


def test_inference_model_reuses_last_unshared_block():
    c = ModelConfig(num_layers=1, num_experts=0, mtp_depth=3, mtp_share=False, attention="mla")
    p = init_params(c, jax.random.PRNGKey(0))
    assert {k for k in p if k.startswith("mtp_")} == {"mtp_0", "mtp_1", "mtp_2"}
    ic, ip = inference_model(c, p, 4)
    assert ic.mtp_depth == 4 and not ic.mtp_share
    assert ip["mtp_3"] is p["mtp_2"] and ip["mtp_0"] is p["mtp_0"]
    # within the trained depth, or shared: unchanged
    assert inference_model(c, p, 3) == (c, p)
    cs = c.replace(mtp_share=True)
    assert inference_model(cs, p, 4)[0] is cs


def test_speculative_accepts_matches_closed_form():
    """One draft d ~ q is accepted with probability sum_x min(p(x), q(x)) = 1 - TV(p, q) (Leviathan et al.,
    Thm 3.5); a chain stops at its first rejection; q == p accepts everything."""
    rng = np.random.default_rng(0)
    p, q = np.array([0.5, 0.3, 0.1, 0.1, 0.0]), np.array([0.2, 0.2, 0.2, 0.2, 0.2])
    n = 200_000
    d = rng.choice(5, size=(n, 1), p=q)
    acc = speculative_accepts(p[d], q[d], rng.random((n, 1)))
    want = float(np.minimum(p, q).sum())                       # 0.2 + 0.2 + 0.1 + 0.1 + 0 = 0.6
    assert abs(acc.mean() - want) < 4 * np.sqrt(want * (1 - want) / n)
    # chained: rejected at depth 2 (u >= p/q) => depth 3 is not accepted even though its own test passes
    got = speculative_accepts(np.array([[0.5, 0.1, 0.9]]), np.array([[0.5, 0.5, 0.1]]), np.array([[0.9, 0.5, 0.0]]))
    np.testing.assert_array_equal(got, [[1.0, 0.0, 0.0]])
    same = rng.random((8, 4))
    assert speculative_accepts(same, same, rng.random((8, 4))).all()


def test_primary_differences_paired_over_contexts():
    """shared3 minus the other arm, context by context: a constant per-context gap gives exactly that gap
    with a zero-width interval even when the contexts themselves vary a lot; absent arms are skipped."""
    base = np.array([1.0, 3.0, 1.5, 4.0, 2.0])
    got = primary_differences({"shared3": base + 0.25, "depth1": base})
    assert set(got) == {"shared3 - depth1"}
    assert got["shared3 - depth1"] == pytest.approx({"diff": 0.25, "lo": 0.25, "hi": 0.25})
    assert primary_differences({"depth1": base}) == {}


@pytest.mark.slow
def test_mtp_sharing_micro_run(tmp_path):
    from experiments.run import run_experiment
    report = run_experiment("mtp_sharing", str(tmp_path), "tiny", MICRO["mtp_sharing"])
    on_disk = json.load(open(tmp_path / "report.json"))
    assert set(on_disk["arms"]) == {"shared3", "indep3", "depth1"}
    for arm, v in on_disk["arms"].items():
        assert 1.0 <= v["acceptance_length"] <= 5.0, arm
        assert math.isfinite(v["final_eval_loss"]), arm
        assert 1.0 <= v["oracle_acceptance_length"] <= 5.0, arm
        assert len(v["draft_accuracy_by_depth"]) == 4 and all(0.0 <= a <= 1.0 for a in v["draft_accuracy_by_depth"])
        # sampled (T=1) acceptance: 1 + sum over depths of P(drafts 1..k accepted), non-increasing in k
        by = v["sampled_acceptance_by_depth"]
        assert v["sampled_acceptance_length"] == pytest.approx(1.0 + sum(by)) and 1.0 <= 1.0 + sum(by) <= 5.0
        assert all(a >= b for a, b in zip(by, by[1:]))
        ob = v["oracle_acceptance_by_depth"]
        assert v["oracle_acceptance_length"] == pytest.approx(1.0 + sum(ob), rel=1e-5)
        assert v["greedy_prompts_repetitive"] + v["greedy_prompts_non_repetitive"] == on_disk["num_prompts"]
    assert on_disk["arms"]["indep3"]["mtp_layers_trained"] == 3
    d = on_disk["primary_difference"]["shared3 - depth1"]
    assert d["lo"] <= d["diff"] <= d["hi"]
    assert report["arms"].keys() == on_disk["arms"].keys()
    for f in ("report.md", "eval_loss.png", "acceptance_length.png"):
        assert os.path.exists(tmp_path / f)
    md = open(tmp_path / "report.md").read()
    assert "2.76" in md and "2.55" in md and "Primary metric" in md and "sampled acceptance" in md
    rows = [json.loads(l) for l in open(tmp_path / "shared3" / "metrics.jsonl")]
    assert any("mtp_loss" in r for r in rows)


def test_distinct_fraction_and_unigram_cross_entropy_closed_forms():
    """distinct / generated per row (cut at its length); unigram cross-entropy = -mean log of add-one
    smoothed training frequencies at the scored targets."""
    from glm5_jax.eval.mtp import distinct_fraction, unigram_cross_entropy
    toks = np.array([[1, 1, 1, 1], [1, 2, 3, 4], [5, 6, 5, 9]])
    np.testing.assert_allclose(distinct_fraction(toks, [4, 4, 3]), [0.25, 1.0, 2 / 3])
    train = np.array([0, 0, 0, 1])                     # counts+1 over vocab 3: [4, 2, 1] / 7
    batch = {"targets": np.array([[0, 1, 2]]), "loss_mask": np.array([[1, 1, 0]])}
    want = -(np.log(4 / 7) + np.log(2 / 7)) / 2
    assert unigram_cross_entropy(train, [batch], 3) == pytest.approx(want)


def test_aggregate_arm_intervals_and_nondegeneracy():
    """Intervals over items use the seed-averaged per-item values, over seeds the per-seed means; the
    non-degeneracy flag needs both the distinct fraction and the loss threshold."""
    from experiments.mtp_sharing import aggregate_arm, over_items_and_seeds
    m, items, seeds = over_items_and_seeds([np.array([1.0, 2.0, 3.0]), np.array([3.0, 4.0, np.nan])])
    # items: [2, 3, 3] (nan left out of the item mean); seeds: [2, 3.5]
    assert m == pytest.approx(8 / 3) and items["n"] == 3 and seeds["n"] == 2
    assert seeds["mean"] == pytest.approx(2.75)

    def row(sam, dist, loss):
        return {"sampled_per_context": np.array(sam), "oracle_per_sequence": np.array([1.2, 1.4]),
                "sampled_distinct_per_prompt": np.array(dist), "greedy_distinct_per_prompt": np.array([0.1, 0.3]),
                "oracle_acceptance_length": 1.3, "acceptance_length": 2.0, "test_eval_loss": loss,
                "test_eval_accuracy": 0.3, "draft_accuracy_by_depth": [0.2, 0.1], "oracle_acceptance_by_depth": [0.2, 0.1],
                "sampled_acceptance_by_depth": [0.5, 0.2], "greedy_prompts_repetitive": 1,
                "greedy_prompts_non_repetitive": 1, "greedy_acceptance_repetitive": 3.0,
                "greedy_acceptance_non_repetitive": None, "acceptance_by_num_draft": {"4": 2.0}}
    rows = [row([1.0, 2.0], [0.8, 0.6], 3.0), row([2.0, 3.0], [0.7, 0.5], 3.2)]
    a = aggregate_arm(rows, min_distinct=0.5, max_loss=3.5)
    assert a["sampled_acceptance_length"] == pytest.approx(2.0)
    assert a["sampled_acceptance_length_interval_seeds"]["mean"] == pytest.approx(2.0)
    assert a["sampled_acceptance_length_interval"]["n"] == 2
    assert a["distinct_token_fraction"] == pytest.approx(0.65) and a["nondegenerate"]
    assert a["oracle_acceptance_length"] == pytest.approx(1.3) and a["greedy_distinct_token_fraction"] == pytest.approx(0.2)
    assert a["greedy_prompts_repetitive"] == 2 and a["greedy_acceptance_non_repetitive"] is None
    assert not aggregate_arm(rows, min_distinct=0.7, max_loss=3.5)["nondegenerate"]     # distinct too low
    assert not aggregate_arm(rows, min_distinct=0.5, max_loss=3.0)["nondegenerate"]     # loss 3.1 > 3.0
