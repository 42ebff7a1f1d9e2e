"""long_context (experiments/long_context.py; its measurements in glm5_jax.eval): the position-bucket losses against a numpy reference, the
passkey probe's construction and packing, and (slow) a micro run end to end and the same losses with a
`context` mesh axis on 8 fake CPU devices."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from experiments.long_context import BUCKETS, TINY, LongContextConfig
from glm5_jax.eval.probes import passkey_offset, passkey_probes, passkey_scores
from glm5_jax.eval.stats import bucket_means_interval, bucket_sums, paired_difference
from experiments.registry import get, resolve_config
from glm5_jax.config import ConfigError
from glm5_jax.data.retrieval import KEY_LETTERS, RetrievalTask

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bucket_losses_match_a_numpy_reference():
    """Loss per position bucket from logits, against log-softmax by hand per token in plain loops; the
    bootstrap interval holds the point estimate; the paired difference of a sample with itself is 0."""
    import jax
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    B, T, V = 3, 40, 7
    logits = rng.normal(size=(B, T, V)) * 2
    targets = rng.integers(0, V, size=(B, T))
    mask = (rng.random((B, T)) > 0.2).astype(np.int32)
    positions = np.stack([np.r_[np.arange(25), np.arange(15)], np.arange(T), np.r_[np.arange(5), np.arange(35)]])
    buckets = ((0, 8), (8, 20), (20, 40))
    # the experiment's per-token loss: logsumexp - target logit, masked
    lg = jnp.asarray(logits, jnp.float32)
    nll = np.asarray((jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, jnp.asarray(targets)[..., None], -1)[..., 0])
                     * mask)
    sums, counts = bucket_sums(nll, mask, positions, buckets)
    ref_s, ref_c = np.zeros((B, 3)), np.zeros((B, 3))
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            p = np.exp(logits[b, t] - logits[b, t].max())
            loss = -np.log(p[targets[b, t]] / p.sum())
            j = next(j for j, (lo, hi) in enumerate(buckets) if lo <= positions[b, t] < hi)
            ref_s[b, j] += loss
            ref_c[b, j] += 1
    np.testing.assert_allclose(sums, ref_s, rtol=1e-5)
    np.testing.assert_array_equal(counts, ref_c)
    iv = bucket_means_interval(sums, counts, reps=300)
    np.testing.assert_allclose(iv["mean"], ref_s.sum(0) / ref_c.sum(0), rtol=1e-6)
    assert all(lo <= m <= hi for m, lo, hi in zip(iv["mean"], iv["lo"], iv["hi"]))
    assert iv["tokens"] == ref_c.sum(0).astype(int).tolist()
    d = paired_difference((sums[:, 1:2], counts[:, 1:2]), (sums[:, 1:2], counts[:, 1:2]), reps=100)
    assert d["diff"] == 0.0 and d["lo"] == 0.0 == d["hi"]
    # the default buckets cut at the last length
    assert TINY.buckets == BUCKETS and TINY.last_len == 4096


class _Tok:
    """A tokenizer stand-in: digits 0-9 are ids 10-19, key letters have byte pieces at 100+."""
    vocab_size, pad_id = 400, 0

    def digit_ids(self):
        return list(range(10, 20))

    def id_to_piece(self, i):
        return f"<0x{ord(KEY_LETTERS[i - 100]):02X}>" if 100 <= i < 100 + len(KEY_LETTERS) else f"t{i}"


def test_passkey_probes_plant_one_key_at_the_depth_and_pack_as_segments():
    cfg = resolve_config(get("long_context"), "tiny", {"passkey_lengths": "32,64,128", "passkey_depths": "0,0.5,1",
                                                       "passkey_per_cell": "2", "ext_seq_lens": "256,512",
                                                       "eval_batch": "2"})
    tok, filler = _Tok(), np.arange(200, 300, dtype=np.int32)   # filler never holds a key or a digit
    batches, placements = passkey_probes(tok, filler, lengths=cfg.passkey_lengths, depths=cfg.passkey_depths,
                                         per_cell=cfg.passkey_per_cell, window=cfg.last_len, batch_size=cfg.eval_batch,
                                         key_digits=2, value_digits=3, seed=3)
    assert len(placements) == 3 * 3 * 2
    keys = set(range(100, 100 + len(KEY_LETTERS)))
    for r, s, L, depth, info in placements:
        b, row = divmod(r, cfg.eval_batch)
        x = {k: v[row] for k, v in batches[b].items()}
        seg = x["segment_ids"][s:s + L]
        assert len(set(seg.tolist())) == 1 and seg[0] > 0                      # one segment per probe
        np.testing.assert_array_equal(x["positions"][s:s + L], np.arange(L))   # positions from 0
        toks = x["tokens"][s:s + L]
        planted = [i for i, t in enumerate(toks) if t in keys]
        assert len(planted) == 2 and planted[1] == L - 3                       # the key, and asked at the end
        task = RetrievalTask(tok, filler, L, n_pairs=1, key_digits=2, value_digits=3, min_distance=0)
        assert planted[0] == info.pair_start == passkey_offset(task, depth) == round(depth * task.max_offset)
        value = x["targets"][s:s + L][list(info.answer_positions)]
        np.testing.assert_array_equal(value, toks[planted[0] + 1:planted[0] + 4])   # the value, copied
        assert x["loss_mask"][s:s + L].sum() == 3
    # a perfect predictor is right on every probe; indices that select the value's tokens give recall 1
    preds = np.concatenate([b["targets"] for b in batches])
    targets = preds.copy()
    idx = np.full(preds.shape + (4,), -1, np.int32)
    for r, s, L, _, info in placements:
        for j in range(3):
            idx[r, s + L - 3 + j, 0] = s + info.value_start + j
    correct, recall = passkey_scores(placements, preds, targets, {"layer": idx}, 3)
    assert correct.all() and np.all(recall["layer"] == 1.0)
    wrong = preds.copy()
    r, s, L, _, info = placements[4]
    wrong[r, s + info.answer_positions[1]] += 1
    correct, _ = passkey_scores(placements, wrong, targets, None, 3)
    assert correct.sum() == len(placements) - 1 and not correct[4]
    with pytest.raises(ValueError, match="offset"):
        RetrievalTask(tok, filler, 32, n_pairs=1, key_digits=2, value_digits=3, min_distance=0).example(
            0, 3, 0, offset=10_000)


def test_config_refusals_name_the_field():
    exp = get("long_context")
    for items, field in (({"ext_seq_lens": "1024,512"}, "ext_seq_lens"), ({"ext_steps": "5"}, "ext_seq_lens"),
                         ({"model.attention": "dsa"}, "model"), ({"rope_adjust": "ntk"}, "rope_adjust"),
                         ({"passkey_lengths": "8192"}, "passkey_lengths"),
                         ({"data.retrieval_pairs": "2"}, "data")):
        with pytest.raises(ConfigError, match=field):
            resolve_config(exp, "tiny", items)
    assert isinstance(resolve_config(exp, "small", {}), LongContextConfig)


def test_stage_plans_raise_the_base_or_apply_yarn_and_add_dsa_last():
    from experiments.long_context import base_stage, dsa_stages, extension_stages
    from glm5_jax.train.stages import plan_stages
    exp = get("long_context")
    for adjust, want in (("theta", [(1e5, None), (1e6, None)]),
                         ("yarn", [(1e4, 8.0), (1e4, 32.0)])):
        cfg = resolve_config(exp, "tiny", {"rope_adjust": adjust})
        plan = plan_stages(cfg.model, cfg.train, [base_stage(cfg)] + extension_stages(cfg, True) + dsa_stages(cfg))
        got = [(m.rope_theta, m.rope_scaling_dict.get("factor")) for m, _ in plan[1:3]]
        assert got == want, adjust
        if adjust == "yarn":
            assert plan[2][0].rope_scaling_dict["original_max_position_embeddings"] == 128
        assert [(t.seq_len, t.batch_size) for _, t in plan] == [(128, 16), (1024, 2), (4096, 1), (4096, 1), (4096, 1)]
        assert [m.attention for m, _ in plan] == ["mla"] * 3 + ["dsa"] * 2
        assert plan[3][1].trainable_pattern == "indexer" and plan[3][1].indexer_loss == "dense"
        assert plan[4][1].trainable_pattern is None and plan[4][1].indexer_loss == "sparse"
        control = plan_stages(cfg.model, cfg.train, [base_stage(cfg)] + extension_stages(cfg, False))
        assert all(m.rope_theta == 1e4 and m.rope_scaling is None for m, _ in control)


def test_dsa_long_is_one_constant_rate_run_with_a_checkpoint_at_every_length():
    from experiments.long_context import dsa_long_stages, dsa_stages, extension_stages
    from glm5_jax.train.stages import plan_stages
    cfg = resolve_config(get("long_context"), "tiny", {})
    assert cfg.dsa_adaptation_lengths == (15, 60, 180)
    stages = extension_stages(cfg, True) + dsa_long_stages(cfg)
    assert stages[-2] == dsa_stages(cfg)[0]                 # the dsa arm's warm-up: its stage (and folder) is reused
    assert [s.name for s in stages[-2:]] == ["dsa_warmup", "dsa_long"]
    plan = plan_stages(cfg.model, cfg.train, stages)
    tc = plan[-1][1]
    assert tc.steps == 180 and tc.indexer_loss == "sparse" and tc.min_lr_ratio == 1.0
    assert tc.ckpt_every == 15 and tc.keep_period == 15     # every length is a multiple: its checkpoint is kept
    # constant after the warm-up: the state at step n is an n-step run (the prefix property)
    lr = np.asarray(tc.schedule()(np.arange(180)))
    np.testing.assert_allclose(lr[tc.warmup_steps:], cfg.dsa_learning_rate, rtol=1e-6)
    assert tc.warmup_steps == 5 and lr[:5].max() <= cfg.dsa_learning_rate * (1 + 1e-6)
    for bad in ("60,15", "0,5", ""):
        with pytest.raises(ConfigError, match="dsa_adaptation_lengths"):
            resolve_config(get("long_context"), "tiny", {"dsa_adaptation_lengths": bad})


# a micro run: T=32 -> 64 -> 128, a few steps per stage, little held-out data
MICRO = {"train.steps": "4", "train.batch_size": "4", "train.seq_len": "32", "ext_seq_lens": "64,128",
         "ext_steps": "2,2", "ext_batch_sizes": "4,4", "ext_warmup_steps": "1", "dsa_warmup_steps": "2", "dsa_steps": "2",
         "model.index_topk": "16", "eval_windows": "4", "passkey_lengths": "32,128", "passkey_depths": "0.2,0.8",
         "passkey_per_cell": "2", "bench_lengths": "64", "bootstrap_reps": "50", "data.max_files": "60",
         "data.vocab_size": "512", "data.eval_fraction": "0.2", "train.ckpt_every": "2", "train.log_every": "1",
         "dsa_adaptation_lengths": "1,2,4", "mass_windows": "2"}


@pytest.mark.slow   # ~20 compiles (7 stages, 4 evaluated models, attention timing): minutes on 2 cores
def test_micro_run_writes_the_report_fields(tmp_path):
    from experiments.run import run_experiment
    run_experiment("long_context", str(tmp_path), "tiny", MICRO)
    rep = json.load(open(tmp_path / "report.json"))
    assert rep["arms"].keys() == {"mla", "mla_no_adjust", "dsa"}
    buckets = [[0, 32], [32, 128]]            # BUCKETS cut at T=128, split at the base length 32
    for name, arm in rep["arms"].items():
        pl = arm["position_loss"]
        assert pl["buckets"] == buckets and len(pl["before"]) == len(pl["after"]) == 2, name
        assert arm["passkey"]["lengths"] == [32, 128] and np.shape(arm["passkey"]["accuracy"]) == (2, 2)
        assert all(0.0 <= a <= 1.0 for row in arm["passkey"]["accuracy"] for a in row)
        assert isinstance(arm["beyond_base_after_minus_before"]["diff"], float)
    assert "indexer_key_recall" in rep["arms"]["dsa"]["passkey"]
    assert [s["name"] for s in rep["arms"]["dsa"]["stages"]] == ["ext64", "ext128", "dsa_warmup", "dsa"]
    assert [s["rope_theta"] for s in rep["arms"]["mla"]["stages"]] == [1e5, 1e6]
    assert [s["rope_theta"] for s in rep["arms"]["mla_no_adjust"]["stages"]] == [1e4, 1e4]
    assert rep["attention_time_s"]["T=64"]["dense_mla"] > 0 and rep["wall_time_s"] > 0
    # issue 45: the gap against sparse-adaptation length from one run, with the oracle and the mass figures
    gva = rep["arms"]["dsa"]["gap_vs_adaptation"]
    assert [e["sparse_steps"] for e in gva] == [1, 2, 4]
    for e in gva:
        assert isinstance(e["gap"]["diff"], float) and isinstance(e["oracle_gap"]["diff"], float)
        assert 0.0 < e["indexer_mass"] <= e["oracle_mass"] + 1e-6 <= 1.0 + 1e-6
        assert 0.0 <= e["indexer_recall_of_oracle"] <= 1.0
        assert all(a <= b + 1e-6 for a, b in zip(e["mass_by_bucket"]["selected_mass"], e["mass_by_bucket"]["oracle_mass"]))
    assert 0.0 < rep["arms"]["dsa"]["mla_oracle_mass"] <= 1.0
    for f in ("report.md", "passkey.png", "passkey_indexer_recall.png", "position_loss_mla.png"):
        assert os.path.getsize(tmp_path / f) > 0


_CP_SCRIPT = """
import json, sys
import jax
from experiments.run import run_experiment
out, micro = sys.argv[1], json.loads(sys.argv[2])
assert len(jax.devices()) == 8, jax.devices()
run_experiment("long_context", out + "/one", "tiny", micro)
run_experiment("long_context", out + "/mesh", "tiny", micro, mesh="data:2,context:4")
"""


@pytest.mark.slow   # two micro runs in a subprocess on 8 fake devices
def test_same_losses_with_a_context_mesh(tmp_path):
    """The whole experiment on data:2 x context:4 (each sequence split in 8 chunks: every stage length
    divides by 2*context) gives each stage's per-step losses of the run without a mesh."""
    micro = {**MICRO, "ext_batch_sizes": "2,2", "train.batch_size": "2", "passkey_lengths": "32"}
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_CP_SCRIPT), str(tmp_path), json.dumps(micro)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    from tests.test_experiments import loss_trajectories
    one, mesh = loss_trajectories(str(tmp_path / "one")), loss_trajectories(str(tmp_path / "mesh"))
    assert len(one) == 8 and one.keys() == mesh.keys()     # base + 2 x 2 extension stages + 3 DSA stages (+ dsa_long)
    for phase in one:
        assert len(one[phase]) >= 2
        np.testing.assert_allclose(mesh[phase], one[phase], rtol=1e-5, err_msg=phase)
    assert json.load(open(tmp_path / "mesh" / "settings.json"))["mesh"] == "data:2,context:4"
