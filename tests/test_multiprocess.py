"""Multi-process training on one machine: two CPU processes (2 fake devices each, jax.distributed on
127.0.0.1, gloo collectives) form one 4-device mesh and train like one process with 4 devices; killed
with SIGKILL mid-run, they resume exactly.

Every run is tests/mp_worker.py: experiments.run's start-up and mesh, the real data pipeline (each
process reads only its rows of every global batch), the train loop with per-process iterator state in
the orbax checkpoint, and a final multi-process evaluation.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESH = "data:2,fsdp:2"
STEPS = 8          # the worker checkpoints every 4 steps


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices, tmp_path):
    return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
                XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}",
                # the killed and the resumed run compile the same programs: compile them once
                JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
                JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _launch(workdir, delay, cache, n, tmp_path):
    """Start n processes; their stdout/stderr go to files (a full pipe would stall a process)."""
    port = _port()
    procs = []
    for i in range(n):
        log = open(tmp_path / f"{workdir.name}_{i}_{len(list(tmp_path.glob('*.log')))}.log", "w+")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "mp_worker.py"), str(workdir), str(STEPS), str(delay),
             str(cache), str(n), str(i), str(port), MESH],
            env=_env(4 // n, tmp_path), stdout=log, stderr=subprocess.STDOUT, text=True))
        procs[-1].log = log
    return procs


def _tail(p) -> str:
    p.log.seek(0)
    return p.log.read()[-3000:]


def _finish(procs, timeout=600):
    outs = []
    for p in procs:
        p.wait(timeout=timeout)
        assert p.returncode == 0, _tail(p)
        p.log.seek(0)
        outs.append(json.loads([line for line in p.log.read().splitlines() if line.startswith("{")][-1]))
    return outs


def _rows(workdir):
    return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]


def _close(a: dict, b: dict, rel=1e-5):
    return a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=rel, abs=1e-6) for k in a)


@pytest.mark.slow   # 4 launches, each compiling the step: 240-404 s on 2 busy cores
def test_multiprocess_two_processes_match_one_and_resume_exactly(tmp_path):
    cache, one, two = tmp_path / "data_cache", tmp_path / "one", tmp_path / "two"
    # 1 process x 4 devices (also builds the data cache the later processes share)
    ref_out = _finish(_launch(one, 0.0, cache, 1, tmp_path))[0]
    ref = _rows(one)
    assert [r["step"] for r in ref] == list(range(1, STEPS + 1)) and ref[-1]["loss"] < ref[0]["loss"]

    # 2 processes x 2 devices, slowed down, killed (SIGKILL, both) after step 6: checkpoint 4 is on disk
    procs = _launch(two, 0.5, cache, 2, tmp_path)
    deadline = time.time() + 600
    while time.time() < deadline and all(p.poll() is None for p in procs):
        path = two / "metrics.jsonl"
        if path.exists() and len(_rows(two)) >= 6:
            break
        time.sleep(0.1)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    killed = _rows(two)
    assert 6 <= len(killed) < STEPS, [_tail(p) for p in procs]
    ckpt = two / "checkpoints" / "4"
    # every process saved its own iterator state beside the sharded train state
    assert {"process_0-of-2.json", "process_1-of-2.json"} <= set(os.listdir(ckpt / "data"))

    # resume: the same two processes' command again
    outs = _finish(_launch(two, 0.0, cache, 2, tmp_path))
    resumed = _rows(two)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    # exact resume: the steps after checkpoint 4 recomputed from it are bitwise those the killed run logged
    after = [r["step"] for r in killed if r["step"] > 4]
    assert after and resumed[:len(killed)] == killed
    # 2 processes x 2 devices == 1 process x 4 devices: the same global batches, the same trajectory
    # (float32 sums in another order: every metric within 1e-5)
    for a, b in zip(resumed, ref):
        assert _close(a, b), (a, b)
    # both processes evaluated the same params to the same figures
    assert outs[0]["final"] == outs[1]["final"] and _close(outs[0]["final"], ref_out["final"])
    # the resumed run started at step 5 (process 0 read steps 1-4 back from metrics.jsonl)
    assert outs[0]["rows"] == list(range(1, STEPS + 1)) and outs[1]["rows"] == list(range(5, STEPS + 1))
