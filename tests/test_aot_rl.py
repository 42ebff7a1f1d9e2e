"""tools.aot --program=rl (tools/aot_rl.py): the colocated RL step's phases compiled for a TPU topology.

Fast: the response-length model against a Monte Carlo draw, the flags checked before anything compiles.
Slow: the tiny model's four phases compiled by the TPU compiler for v5p:2x2x1 (a subprocess, as
tests/test_aot.py: libtpu stays out of this process), the report's fields and their arithmetic.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tools.aot_rl import resolve_rl, response_length_stats
from tools.tpu_compile import AotError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


def test_response_lengths_match_a_monte_carlo_draw_of_capped_lognormals():
    rows, cap, median, sigma = 64, 300, 100.0, 0.8
    s = response_length_stats(rows, cap, median, sigma)
    draw = np.minimum(np.ceil(np.random.default_rng(0).lognormal(np.log(median), sigma, (4000, rows))), cap)
    assert s["mean_tokens"] == pytest.approx(draw.mean(), rel=0.02)
    assert s["expected_decode_steps"] == pytest.approx(draw.max(axis=1).mean(), rel=0.02)
    # one row decodes its own length; the longest of many rows reaches the cap
    assert response_length_stats(1, cap, median, sigma)["expected_decode_steps"] == pytest.approx(s["mean_tokens"])
    assert response_length_stats(4096, cap, median, sigma)["expected_decode_steps"] == pytest.approx(cap, rel=1e-3)


def test_rl_flags_are_checked_before_compiling():
    with pytest.raises(AotError, match="do not split over the rollout mesh's 4 batch shards"):
        resolve_rl("tiny", "v5p:2x2x1", prompts_per_step=3, group_size=2)
    with pytest.raises(AotError, match="--minibatches=3 does not divide"):
        resolve_rl("tiny", "v5p:2x2x1", prompts_per_step=2, group_size=4, minibatches=3)
    with pytest.raises(AotError, match="--mismatch='int9'; allowed: none"):
        resolve_rl("tiny", "v5p:2x2x1", mismatch="int9")
    with pytest.raises(AotError, match="--rollout_mesh='expert:3'"):
        resolve_rl("tiny", "v5p:2x2x1", rollout_mesh="expert:3")
    r = resolve_rl("tiny", "v5p:2x2x1", prompt_len=16, max_new_tokens=8, minibatches=2)
    # one group per batch shard by default; the update's rows are build_batch's (prompt + response - 1)
    assert r["rollouts_per_step"] == 8 and r["train"].batch_size == 4 and r["update_seq_len"] == 23


def test_cli_rejects_train_flags_for_rl_and_rl_flags_elsewhere(capsys):
    from tools.aot import main
    assert main(["--program=rl", "--preset=tiny", "--topology=v5p:2x2x1", "--batch_size=8"]) == 2
    assert "does not apply to --program=rl" in capsys.readouterr().err
    assert main(["--preset=tiny", "--topology=v5p:2x2x1", "--group_size=8"]) == 2
    assert "--group_size applies to --program=rl only" in capsys.readouterr().err


@pytest.mark.slow     # four TPU compiles of the tiny model (~50 s on 2 cores)
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_tiny_rl_step_phases_compile_for_v5p_with_memory_reshard_bytes_and_step_estimate():
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
    for k in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(k, None)
    res = subprocess.run([sys.executable, "-m", "tools.aot", "--program=rl", "--preset=tiny", "--topology=v5p:2x2x1",
                          "--prompt_len=16", "--max_new_tokens=8", "--minibatches=2", "--json"],
                         env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(r["phases"]) == {"update", "reshard", "rollout_prefill", "rollout"}
    for name, ph in r["phases"].items():
        pd = ph["per_device_bytes"]
        assert pd["total"] == pd["program_total"] + pd["resident"], name
        assert pd["program_total"] == pd["arguments"] + pd["outputs"] + pd["temporaries"] - pd["aliased"], name
        assert 0 < pd["total"] <= r["hbm_bytes"] and ph["budget"]["estimated_step_seconds"] > 0, name
    ph = r["phases"]
    # resident beside each phase: nothing beside the update; the optimizer state beside the reshard (the
    # params are its argument); params + optimizer state beside the rollout programs
    assert ph["update"]["per_device_bytes"]["resident"] == 0
    assert ph["reshard"]["per_device_bytes"]["resident"] == r["optimizer_bytes_per_chip"]
    assert ph["rollout"]["per_device_bytes"]["resident"] == r["params_bytes_per_chip"] + r["optimizer_bytes_per_chip"]
    # the runtime's step donates its page pool: it comes back in the same buffers
    assert ph["rollout"]["per_device_bytes"]["aliased"] > 0
    pre = ph["rollout_prefill"]
    assert pre["prefill_steps"] * pre["prefill_step_tokens"] >= r["rollouts_per_step"] * 16
    # fsdp:4 training shards -> the expert:4 serving copy: a chip receives its copy minus what it holds
    copy, held = r["rollout_copy_bytes_per_chip"], r["params_bytes_per_chip"]
    assert copy - held <= r["reshard_bytes_per_chip"] <= copy
    parts = r["seconds_by_part"]
    assert r["estimated_rl_step_seconds"] == pytest.approx(sum(parts.values()))
    assert parts["update"] == pytest.approx(2 * ph["update"]["budget"]["estimated_step_seconds"])
    assert parts["rollout"] == pytest.approx(pre["prefill_steps"] * pre["budget"]["estimated_step_seconds"]
                                             + r["decode_steps"] * ph["rollout"]["budget"]["estimated_step_seconds"])
    assert r["rollouts_per_step"] == 8 and r["update_seq_len"] == 23 and r["fits"] is True
