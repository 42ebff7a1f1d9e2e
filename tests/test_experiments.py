"""The main job end to end at a micro scale: every phase runs and the report has the promised shape."""

import json
import os

from experiments.run import run_experiment

MICRO = ["pretrain_steps=2", "steps=2", "indexer_warmup_steps=2", "eval_every=2", "seq_len=128", "index_topk=16",
         "batch_size=2", "bench_seq_len=256", "max_files=20", "eval_batches=1", "retrieval_batches=1",
         "vocab_size=512", "d_model=32", "ffn_dim=64", "moe_ffn_dim=32"]


def test_dsa_vs_mla_micro_run_writes_complete_report(tmp_path):
    report = run_experiment("dsa_vs_mla", str(tmp_path), "tiny", MICRO)
    with open(tmp_path / "report.json") as f:
        saved = json.load(f)
    assert saved["arms"].keys() == {"mla", "dsa", "mha"}
    for arm in saved["arms"].values():
        assert isinstance(arm["final_eval_loss"], float) and 0 < arm["final_eval_loss"] < 20
        assert 0.0 <= arm["retrieval_accuracy"] <= 1.0
    assert isinstance(saved["dsa_vs_mla_gap_pct"], float)
    assert report["dsa_vs_mla_gap_pct"] == saved["dsa_vs_mla_gap_pct"]
    for f in ("report.md", "eval_loss.png", "indexer_warmup.png", "settings.json"):
        assert os.path.getsize(tmp_path / f) > 0
    for phase in ("base", "mla", "dsa_warmup", "dsa", "mha"):
        assert os.path.exists(tmp_path / phase / "metrics.jsonl")
    assert "DSA vs MLA gap" in open(tmp_path / "report.md").read()
