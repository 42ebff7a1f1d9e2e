"""Disaggregated agentic RL with meshes (slow; a subprocess: the driver's device count is fixed at JAX start-up).

The trainer's update runs on a data:2,fsdp:4 mesh of the driver's 8 forced CPU devices; each rollout
server is a Ray actor whose engine owns a data:2 mesh of its own process's 2 devices. Asynchronous
run with a worker killed after step 1: the run finishes, every issued trajectory id ends exactly once
(trained / dropped / unused / warm-up: 0 lost, 0 duplicated), the trained samples' staleness (trainer
version - the oldest token's version, per-token versions from the servers) stays within tau, and every
step reports the bytes of its weight push (the policy's float32 bytes), pulled by each server from the
trainer's 8 devices over the JAX transfer server (the default ``weight_transport``).
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import collections
    import jax, ray
    from glm5_jax.agentic.agent import make_calc_task
    from glm5_jax.agentic.trainer import AgenticConfig, run_agentic
    from glm5_jax.config import ModelConfig
    from glm5_jax.model import init_params
    from glm5_jax.parallel.distributed import build_mesh
    from glm5_jax.rl.sft import CharVocab
    assert len(jax.devices()) == 8
    vocab = CharVocab()
    cfg = ModelConfig(vocab_size=vocab.padded_size(), d_model=32, num_layers=1, ffn_dim=64, attention="dsa",
                      num_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=4,
                      v_head_dim=16, index_topk=16, index_n_heads=2, index_head_dim=16, num_experts=0,
                      mtp_depth=0, attn_chunk=64)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    acfg = AgenticConfig(mode="async", steps=3, groups_per_step=4, group_size=2, in_flight_groups=4, tau=1,
                         servers=2, agent_threads=8, max_batch=8, max_len=40, max_new_tokens=6,
                         kill_worker_at_step=1, seed=1, server_mesh="data:2")
    params = init_params(cfg, jax.random.PRNGKey(0))
    r = run_agentic(cfg, params, acfg, vocab, make_calc_task, log=lambda s: None, mesh=build_mesh("data:2,fsdp:4"))
    assert len(r["history"]) == acfg.steps and len(r["dead"]) == 1
    assert {len(s.device_set) for s in jax.tree.leaves(jax.tree.map(lambda a: a.sharding, r["params"]))} == {8}
    acc = r["accounting"]
    ends = acc["trained"] + acc["dropped"] + acc["unused"] + acc["warmup"]
    assert collections.Counter(ends) == collections.Counter(acc["issued"])
    assert len(set(acc["issued"])) == len(acc["issued"]) and acc["open"] == []
    assert r["staleness"] and all(0 <= s <= acfg.tau for s in r["staleness"]), r["staleness"]
    full = sum(a.size * 4 for a in jax.tree.leaves(params))
    assert all(h["push_bytes"] == full for h in r["history"] if not h.get("skipped")), [h["push_bytes"] for h in r["history"]]
    # the pushes went trainer devices -> server devices over the JAX transfer server (no object store)
    assert all(h["push_transport"] == "transfer" for h in r["history"] if h["push_bytes"]), r["history"]
    ray.shutdown()
    print("OK")
""")


@pytest.mark.slow
def test_disaggregated_agentic_rl_on_meshes_loses_and_duplicates_no_trajectory():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
                       check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
