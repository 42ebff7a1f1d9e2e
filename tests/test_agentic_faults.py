"""Agentic RL stage faults (issue 44): run_agentic checkpoints inside the stage; SIGTERM checkpoints the
step reached (Preempted, 143); a rerun resumes at the next step from those params, version, history and
prompt stream (slow: Ray actors + compiles)."""

import os
import random
import signal

import jax
import numpy as np
import pytest

ray = pytest.importorskip("ray")

from glm5_jax.agentic.agent import make_calc_task      # noqa: E402
from glm5_jax.agentic.trainer import AgenticConfig, run_agentic   # noqa: E402
from glm5_jax.model import init_params                 # noqa: E402
from glm5_jax.rl.sft import CharVocab                  # noqa: E402
from glm5_jax.train.preempt import PREEMPTED_EXIT_CODE, Preempted   # noqa: E402
from tests.test_agentic_ray import _cfg                # noqa: E402


@pytest.mark.slow
def test_killed_agentic_stage_resumes_from_its_checkpoint(tmp_path):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        vocab = CharVocab()
        cfg = _cfg(vocab)
        acfg = AgenticConfig(mode="sync", steps=3, groups_per_step=2, group_size=2, in_flight_groups=2, servers=2,
                             agent_threads=8, max_batch=8, max_len=40, max_new_tokens=6, seed=1)
        draws = []

        def sample(rng, kill_at=None):
            draws.append(hash(rng.getstate()))
            if kill_at is not None and len(draws) == kill_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return make_calc_task(rng)

        # warm-up draws `servers` groups, step 1 draws groups_per_step: the 5th draw is step 2's first
        ck = str(tmp_path / "ck")
        lines = []
        with pytest.raises(Preempted) as info:
            run_agentic(cfg, init_params(cfg, jax.random.PRNGKey(0)), acfg, vocab, lambda r: sample(r, 5),
                        log=lines.append, ckpt_dir=ck, ckpt_every=10)
        cut = info.value.step         # 2, or 1 when step 1 replaced a dropped (flat) group
        assert info.value.code == PREEMPTED_EXIT_CODE and cut in (1, 2)
        assert sum("preempted" in l for l in lines) == 1 and sorted(os.listdir(ck)) == [str(cut)]
        first = draws[:]
        draws.clear()
        lines = []
        r = run_agentic(cfg, init_params(cfg, jax.random.PRNGKey(0)), acfg, vocab, sample, log=lines.append,
                        ckpt_dir=ck, ckpt_every=10)
        assert any(f"resumed from step {cut}" in l for l in lines)
        assert [h["step"] for h in r["history"]] == [1, 2, 3]
        # the prompt stream continues: after its own warm-up, the resumed run draws the seed's stream from
        # where the killed run stopped
        ref = random.Random(acfg.seed * 1_000_003 + 17)
        states = []
        for _ in range(len(first) + len(draws)):
            states.append(hash(ref.getstate()))
            make_calc_task(ref)
        rest = draws[acfg.servers:]
        assert first == states[:len(first)] and rest and rest == states[len(first):len(first) + len(rest)]
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(jax.device_get(r["params"])))
        assert r["history"][-1]["skipped_updates"] == 0
    finally:
        ray.shutdown()
