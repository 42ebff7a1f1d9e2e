"""Every registered experiment at a micro scale through the one train loop: it completes and writes
its report with the resolved config, and on 8 fake CPU devices (mesh data 2 x fsdp 2 x expert 2) it
gives the same loss trajectory as on one device.

MICRO is each experiment's micro run (tiny config, very few steps, tiny seq/batch); a new experiment
must add its own. The other experiments' micro runs (with their specific checks) live in
test_mtp_experiment.py, test_muon_experiment.py and test_grpo_experiment.py. In the default suite:
muon_split (one arm) on 1 and on 8 devices; every other micro run is `-m slow`.
"""

import glob
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from experiments import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "data:2,fsdp:2,expert:2"

MICRO = {
    "dsa_vs_mla": {"pretrain_steps": "2", "train.steps": "2", "indexer_warmup_steps": "2", "train.eval_every": "2",
                   "train.seq_len": "128", "model.index_topk": "16", "train.batch_size": "2", "bench_seq_len": "256",
                   "data.max_files": "60", "train.eval_batches": "1", "dev_probe_batches": "1",
                   "test_probe_batches": "2", "mha_arm": "true", "data.vocab_size": "512", "model.d_model": "32",
                   "model.ffn_dim": "64", "model.moe_ffn_dim": "32", "data.retrieval_min_distance": "24",
                   "seeds": "0,1", "short_adaptation_steps": "1"},
    "muon_split": {"train.steps": "2", "train.batch_size": "2", "train.seq_len": "32", "train.eval_every": "2",
                   "train.eval_batches": "1", "train.monitor_every": "1", "model.num_layers": "1", "model.d_model": "32",
                   "model.ffn_dim": "64", "train.warmup_steps": "1", "muon_lr_sweep": "", "seeds": "0"},
    "mtp_sharing": {"train.steps": "2", "train.batch_size": "2", "train.seq_len": "32", "train.eval_every": "2",
                    "train.eval_batches": "1", "model.num_layers": "1", "model.d_model": "32", "model.ffn_dim": "64",
                    "train.warmup_steps": "1", "num_prompts": "2", "prompt_len": "8", "max_new_tokens": "8",
                    "model.q_lora_rank": "16", "model.kv_lora_rank": "16", "model.qk_nope_head_dim": "8",
                    "model.qk_rope_head_dim": "8", "model.v_head_dim": "8", "sampled_contexts": "2", "sampled_draws": "2"},
    "grpo_icepop": {"model.d_model": "32", "model.num_heads": "2", "model.ffn_dim": "64", "model.q_lora_rank": "16",
                    "model.kv_lora_rank": "16", "model.qk_nope_head_dim": "16", "model.v_head_dim": "16",
                    "train.steps": "4", "train.batch_size": "4", "train.seq_len": "32", "rl.steps": "2",
                    "rl.prompts_per_step": "4", "rl.group_size": "2", "eval_tasks": "8", "eval_every": "2",
                    "sampled_eval_samples": "1"},
}

# The mesh runs: batches split over data*fsdp*expert = 8 devices, and three steps for a trajectory.
MESH_MICRO = {
    "muon_split": {**MICRO["muon_split"], "arms": "mla_adamw", "train.batch_size": "8", "train.steps": "3",
                   "train.monitor_every": "0", "train.eval_every": "3"},
    "dsa_vs_mla": {**MICRO["dsa_vs_mla"], "train.batch_size": "8", "train.seq_len": "64", "model.index_topk": "8",
                   "bench_seq_len": "64", "data.retrieval_pairs": "2", "data.retrieval_min_distance": "8",
                   "seeds": "0", "topk_fractions": "0.125,0.25"},
    "mtp_sharing": {**MICRO["mtp_sharing"], "arms": "shared3", "train.batch_size": "8", "train.steps": "3",
                    "train.eval_every": "3"},
    "grpo_icepop": {**MICRO["grpo_icepop"], "train.batch_size": "8", "rl.prompts_per_step": "4",
                    "rl.group_size": "2"},
}


def test_every_registered_experiment_has_a_micro_run():
    # the four research experiments live here; pretrain / sft / qat / distill_recovery carry their
    # micro runs in their own test files
    names = set(MICRO)
    assert names <= set(registry.load_all()) and names == set(MESH_MICRO)
    for name in names:                                          # and the micro configs resolve
        registry.resolve_config(registry.get(name), "tiny", MICRO[name])
        registry.resolve_config(registry.get(name), "tiny", MESH_MICRO[name])


@pytest.mark.slow   # two seeds x 8 phases, evals, attention timing: ~400 s on 2 busy cores
def test_dsa_vs_mla_micro_run_writes_complete_report(tmp_path):
    from experiments.run import run_experiment
    report = run_experiment("dsa_vs_mla", str(tmp_path), "tiny", {**MICRO["dsa_vs_mla"], "model.index_topk": "24"})
    with open(tmp_path / "report.json") as f:
        saved = json.load(f)
    assert saved["arms"].keys() == {"mla", "dsa", "mha"}
    for arm in saved["arms"].values():
        assert isinstance(arm["final_eval_loss"], float) and 0 < arm["final_eval_loss"] < 20
        assert 0.0 <= arm["retrieval_accuracy"] <= 1.0
        lo, hi = saved["per_seed"]["mla"]["0"]["retrieval_wilson_95"]
        assert 0.0 <= lo <= saved["per_seed"]["mla"]["0"]["retrieval_accuracy"] <= hi <= 1.0
    # the indexer's answer-key recall for each DSA layer (2 layers: the dense stack and the MoE stack)
    recall = saved["arms"]["dsa"]["answer_key_recall"]
    assert len(recall) == 2 and all(0.0 <= v <= 1.0 for v in recall.values())
    assert saved["test_probes_per_seed"] == 2 * 2 and saved["probe_distance_range"][0] > 24
    assert saved["primary_metric"].startswith("test LM-loss gap")
    assert isinstance(saved["dsa_vs_mla_gap_pct"], float)
    assert report["dsa_vs_mla_gap_pct"] == saved["dsa_vs_mla_gap_pct"]
    # the primary gap is the mean over seeds of each seed's paired gap, recomputed from the arms' test losses
    per = saved["per_seed"]
    gaps = [100 * (per["dsa"][s]["final_eval_loss"] - per["mla"][s]["final_eval_loss"]) / per["mla"][s]["final_eval_loss"]
            for s in ("0", "1")]
    iv = saved["dsa_vs_mla_gap_pct_interval"]
    assert iv["n"] == 2 and iv["mean"] == pytest.approx(np.mean(gaps)) and iv["lo"] < iv["mean"] < iv["hi"]
    assert [r["topk_fraction"] for r in saved["gap_vs_topk"]] == [1 / 16, 1 / 8, 1 / 4, 1 / 2]
    assert [r["topk"] for r in saved["gap_vs_topk"]] == [8, 16, 32, 64]
    assert all(r["interval"]["n"] == 2 and r["adaptation_steps"] == 1 for r in saved["gap_vs_topk"])
    assert [r["adaptation_steps"] for r in saved["gap_vs_adaptation"]] == [1, 2]
    # the full adaptation's entry is the primary gap itself
    assert saved["gap_vs_adaptation"][-1]["gap_pct"] == pytest.approx(saved["dsa_vs_mla_gap_pct"])
    ret = saved["retrieval"]
    assert ret["chance_accuracy"] == 0.1 and ret["copy_accuracy"] == pytest.approx(1 / 16 + 15 / 16 * 0.1)
    assert saved["lossless"]["verdict"] in {"lossless", "worse", "better", "inconclusive"}
    # the override reached the model and both records carry the full resolved config
    assert saved["index_topk"] == 24 and saved["config"]["model"]["index_topk"] == 24
    settings = json.load(open(tmp_path / "settings.json"))
    assert settings["config"] == saved["config"] and settings["config"]["model"]["vocab_size"] == 512
    assert settings["config"]["train"]["steps"] == 2 and settings["config"]["data"]["max_files"] == 60
    for f in ("report.md", "eval_loss.png", "lr_schedule.png", "indexer_warmup.png", "retrieval_vs_distance.png",
              "gap_vs_topk.png", "gap_vs_adaptation.png", "settings.json"):
        assert os.path.getsize(tmp_path / f) > 0
    cvb = saved["continued_mla_vs_base_dev_loss"]
    assert isinstance(cvb["at_or_below"], bool) and cvb["at_or_below"] == (cvb["per_seed"]["0"]["continued_mla"]
                                                                           <= cvb["per_seed"]["0"]["base"])
    assert saved["phase_steps"] == {"base": 2, "mla": 2, "dsa_warmup": 2, "dsa": 2, "dsa_short": 1, "mha": 4}
    for phase in ("base", "mla", "dsa_warmup", "dsa", "mha", "dsa_topk8", "dsa_topk64"):
        assert os.path.exists(tmp_path / "seed_1" / phase / "metrics.jsonl")
    md = open(tmp_path / "report.md").read()
    assert "DSA - MLA test LM-loss gap" in md and "Primary metric" in md and "Answer-key recall" in md
    assert saved["lossless"]["sentence"] in md


_MESH_SCRIPT = """
import importlib, json, sys
import jax
from experiments.run import run_experiment
name, out, micro, mesh = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
assert len(jax.devices()) == 8, jax.devices()
# record how many devices each training call's parameters ended up on
module, devices = importlib.import_module("experiments." + name), []
real_train = module.train
def spy(*args, **kwargs):
    result = real_train(*args, **kwargs)
    devices.append(max(len(x.sharding.device_set) for x in jax.tree.leaves(result["params"])))
    return result
module.train = spy
run_experiment(name, out + "/one", "tiny", micro)
one = list(devices)
run_experiment(name, out + "/mesh", "tiny", micro, mesh=mesh)
print("DEVICES " + json.dumps({"one": one, "mesh": devices[len(one):]}))
"""


def loss_trajectories(workdir: str) -> dict[str, list[float]]:
    """{metrics file relative to workdir: [loss per step]} for every phase's metrics."""
    out = {}
    for path in sorted(glob.glob(os.path.join(workdir, "**", "*.jsonl"), recursive=True)):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        losses = [r["loss"] for r in rows if "loss" in r]
        if losses:
            out[os.path.relpath(path, workdir)] = losses
    return out


def run_on_one_and_eight_devices(name: str, tmp_path) -> tuple[dict, dict]:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_MESH_SCRIPT), name, str(tmp_path),
                          json.dumps(MESH_MICRO[name]), MESH], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=1500)
    assert res.returncode == 0, res.stderr[-4000:]
    used = json.loads(res.stdout.split("DEVICES ", 1)[1])
    assert used["one"] and set(used["one"]) == {1} and set(used["mesh"]) == {8}, used
    one, mesh = loss_trajectories(str(tmp_path / "one")), loss_trajectories(str(tmp_path / "mesh"))
    settings = json.load(open(tmp_path / "mesh" / "settings.json"))
    assert settings["mesh"] == MESH
    return one, mesh


def _assert_same_trajectories(one: dict, mesh: dict) -> None:
    assert one and one.keys() == mesh.keys()
    for phase in one:
        assert len(one[phase]) == len(mesh[phase]) >= 2, phase
        np.testing.assert_allclose(mesh[phase], one[phase], rtol=1e-4, err_msg=phase)


@pytest.mark.slow  # minutes on 2 cores (the default suite stays under 15 min); run with -m slow
def test_muon_split_same_losses_on_eight_devices(tmp_path):
    """The cheapest experiment (one arm, three steps) on data 2 x fsdp 2 x expert 2 vs one device."""
    one, mesh = run_on_one_and_eight_devices("muon_split", tmp_path)
    assert list(one) == ["mla_adamw/metrics.jsonl"]
    _assert_same_trajectories(one, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dsa_vs_mla", "mtp_sharing", "grpo_icepop"])
def test_experiment_same_losses_on_eight_devices(name, tmp_path):
    one, mesh = run_on_one_and_eight_devices(name, tmp_path)
    _assert_same_trajectories(one, mesh)


def test_interval_helpers_against_closed_forms():
    from glm5_jax.intervals import fmt_interval
    from glm5_jax.intervals import mean_interval, paired_bootstrap_interval, wilson_interval
    # Wilson 95%: 8/10 -> (0.4902, 0.9433) (closed form); 0/20 -> lower bound 0, upper z^2/(n+z^2)
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.49016, abs=1e-4) and hi == pytest.approx(0.94332, abs=1e-4)
    lo, hi = wilson_interval(0, 20)
    assert lo == 0.0 and hi == pytest.approx(1.96 ** 2 / (20 + 1.96 ** 2), rel=1e-9)
    # t interval: [1, 2, 3] -> mean 2, sd 1, t(2) = 4.3027 (4.303 in printed tables)
    iv = mean_interval([1.0, 2.0, 3.0])
    assert iv["mean"] == 2.0 and iv["hi"] - 2.0 == pytest.approx(4.30265 / 3 ** 0.5, rel=1e-5)
    assert mean_interval([0.5]) == {"mean": 0.5, "lo": None, "hi": None, "n": 1}
    # paired bootstrap: constant differences have a degenerate interval at the difference
    d, lo, hi = paired_bootstrap_interval([1, 1, 1, 0], [0, 0, 0, 0])
    assert d == 0.75 and 0.0 <= lo <= 0.75 <= hi <= 1.0
    assert paired_bootstrap_interval([1, 1], [0, 0]) == (1.0, 1.0, 1.0)
    assert fmt_interval(0.5, None, None) == "0.500 (n=1)" and fmt_interval(0.5, 0.25, 0.75, 2) == "0.50 [0.25, 0.75]"
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)


def test_answer_key_hits_hand_computed():
    from glm5_jax.eval.probes import answer_key_hits
    from glm5_jax.data.retrieval import RetrievalInfo
    T, K = 6, 2
    idx = np.full((2, T, K), -1, np.int32)
    idx[0, 4] = [1, 0]          # digit 0 of row 0 predicted at T - 2 = 4: key 1 selected
    idx[0, 5] = [3, 0]          # digit 1 at 5: wants key 2, not selected
    idx[1, 4] = [0, 3]
    idx[1, 5] = [4, 3]          # row 1 wants keys 3 and 4: both selected
    info = lambda v: RetrievalInfo("1", "00", 0, 3, 4, (4, 5), value_start=v)
    np.testing.assert_allclose(answer_key_hits(idx, [info(1), info(3)], value_digits=2), [0.5, 1.0])
