"""Multi-host start-up faults (issue 44): a missing host ends start-up with one line and exit 2 within the
timeout; a workdir the processes do not share is refused on every process; bad timeout settings."""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from glm5_jax.parallel import distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("process_id", [0, 1])     # 0 hosts the coordinator; 1 finds no coordinator at all
def test_missing_host_one_line_exit_2_within_the_timeout(process_id):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", GLM5_INIT_TIMEOUT_S="4")
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "experiments.run", "--config=dsa_vs_mla", "--num_processes=2",
                        f"--process_id={process_id}", f"--coordinator_address=127.0.0.1:{_port()}"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    took = time.time() - t0
    errors = [l for l in r.stderr.splitlines() if "error" in l.lower() or "Check failure" in l]
    assert r.returncode == dist.START_FAILED_EXIT_CODE == 2, r.stderr[-2000:]
    assert len(errors) == 1 and "did not start within 4 s" in errors[0] and f"process {process_id} of 2" in errors[0], r.stderr
    assert "GLM5_INIT_TIMEOUT_S" in errors[0] and "Traceback" not in r.stderr
    assert took < 4 + 30, took           # start-up of python + jax, then the 4 s timeout


def test_timeouts_reach_initialize_and_bad_ones_are_refused():
    env = {"GLM5_COORDINATOR_ADDRESS": "h:1", "GLM5_NUM_PROCESSES": "2", "GLM5_PROCESS_ID": "1",
           "GLM5_HEARTBEAT_TIMEOUT_S": "7"}
    calls = []
    dist.maybe_initialize(env={**env, "GLM5_INIT_TIMEOUT_S": "9"}, initialize=lambda **kw: calls.append(kw))
    assert calls[-1]["initialization_timeout"] == 39 and calls[-1]["heartbeat_timeout_seconds"] == 7
    dist.maybe_initialize(env=env, initialize=lambda **kw: calls.append(kw), init_timeout_s=2.5)
    assert calls[-1]["initialization_timeout"] == 32
    for bad in ("0", "-3", "soon"):
        with pytest.raises(dist.DistributedConfigError, match="GLM5_INIT_TIMEOUT_S"):
            dist.maybe_initialize(env={**env, "GLM5_INIT_TIMEOUT_S": bad}, initialize=print)


class _KV:
    """The coordination service's key-value store, in memory, for threads playing processes."""

    def __init__(self):
        self.d, self.cv = {}, threading.Condition()

    def key_value_set(self, k, v):
        with self.cv:
            self.d[k] = v
            self.cv.notify_all()

    def blocking_key_value_get(self, k, ms):
        with self.cv:
            if not self.cv.wait_for(lambda: k in self.d, ms / 1000):
                raise TimeoutError(k)
            return self.d[k]


def _probe(dirs):
    kv, out = _KV(), {}

    def run(i):
        try:
            dist.check_shared_workdir(dirs[i], client=kv, process_index=i, process_count=len(dirs), timeout_s=20)
            out[i] = None
        except dist.WorkdirNotShared as e:
            out[i] = str(e)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(dirs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def test_workdir_probe(tmp_path):
    """Three threads play three processes; one folder name, seen through one shared folder or through
    each host's own disk (host0/run, host2/run)."""
    shared = tmp_path / "shared" / "run"
    shared.mkdir(parents=True)
    assert _probe([shared, shared, shared]) == {0: None, 1: None, 2: None}
    assert not [p for p in os.listdir(shared) if p.startswith(".probe")]     # the probe file is removed
    assert _probe([shared, shared, shared]) == {0: None, 1: None, 2: None}    # a second probe of it
    own = [tmp_path / f"host{i}" / "run" for i in range(3)]
    for d in own:
        d.mkdir(parents=True)
    out = _probe([own[0], shared, own[2]])
    assert set(out) == {0, 1, 2} and all(out[i] and "process(es) [1, 2] cannot see" in out[i] for i in out), out
