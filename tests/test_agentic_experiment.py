"""async_vs_sync micro run (slow: a Ray cluster, two fleets, several compiles): report.json holds
arms.{sync,async}.{tokens_per_s, final_reward} and staleness_histogram; the killed worker loses and
duplicates no trajectory id."""

import json

import pytest

pytest.importorskip("ray")

MICRO = {"model.d_model": "32", "model.num_heads": "2", "model.ffn_dim": "64", "train.steps": "4",
         "train.batch_size": "4", "agentic.steps": "4", "agentic.groups_per_step": "2", "agentic.group_size": "2",
         "agentic.in_flight_groups": "4", "agentic.agent_threads": "8", "agentic.max_batch": "8", "agentic.row_buckets": "8", "test_tasks": "8"}


@pytest.mark.slow
def test_async_vs_sync_micro_run_writes_complete_report(tmp_path):
    import ray
    import experiments.async_vs_sync  # noqa: F401  (registers)
    from experiments.run import run_experiment
    try:
        run_experiment("async_vs_sync", str(tmp_path), "tiny", [f"{k}={v}" for k, v in MICRO.items()])
    finally:
        ray.shutdown()
    rep = json.loads((tmp_path / "report.json").read_text())
    for arm in ("sync", "async"):
        a = rep["arms"][arm]
        assert a["tokens_per_s"] > 0 and 0.0 <= a["final_reward"] <= 1.0
        assert a["ids_lost"] == 0 and a["ids_duplicated"] == 0 and a["ids_accounted"] == a["ids_issued"]
        assert a["steps"] == 4
    assert rep["arms"]["async"]["dead_workers"] and not rep["arms"]["sync"]["dead_workers"]
    assert sum(rep["staleness_histogram"].values()) > 0
    assert (tmp_path / "report.md").exists() and (tmp_path / "reward_vs_wall.png").exists()
