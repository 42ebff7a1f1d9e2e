"""async_vs_sync micro run (slow: a Ray cluster, two fleets, several compiles): report.json holds
arms.{sync,async}.{tokens_per_s, final_reward} and staleness_histogram; the killed worker loses and
duplicates no trajectory id."""

import json

import pytest

pytest.importorskip("ray")

MICRO = {"model.d_model": "32", "model.num_heads": "2", "model.ffn_dim": "64", "train.steps": "4", "sft_steps": "4",
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
    # matched wall-clock comparison: the sync policy kept is its last step finished by the async arm's end
    m = rep["matched_wall"]
    assert m["wall_s"] == rep["arms"]["async"]["wall_s"] and m["async_step"] == 4
    assert m["sync_step"] == sum(w <= m["wall_s"] for w, _ in rep["arms"]["sync"]["curve"])
    lo, hi = m["async_minus_sync"]["lo"], m["async_minus_sync"]["hi"]
    assert lo <= m["async"]["test_reward"] - m["sync"]["test_reward"] <= hi
    # the windows cover the time both arms ran and hold every step of it exactly once
    t_common = min(rep["arms"][a]["wall_s"] for a in ("sync", "async"))
    assert rep["reward_windows"][-1]["wall_s"][1] == t_common
    for a in ("sync", "async"):
        n = sum(0 < w <= t_common for w, _ in rep["arms"][a]["curve"])
        assert sum(w[a]["n"] for w in rep["reward_windows"] if w[a]) == n == rep["train_reward_time_avg"][a]["n"]
    assert (tmp_path / "report.md").exists() and (tmp_path / "reward_vs_wall.png").exists()
    # every phase's TensorBoard events and what the run printed (issue 67)
    from glm5_jax.train.observe import has_events
    for phase in ("sft/tensorboard", "tensorboard/rl_sync", "tensorboard/rl_async"):
        assert has_events(str(tmp_path / phase)), phase
    assert "[sft] TEST sampled reward" in (tmp_path / "run.log").read_text()
