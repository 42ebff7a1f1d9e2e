"""Issue 66: a multi-process server that loses a host says so and stops (glm5_jax.serve.multihost.PeerWatch).

Fast: the watch over an in-memory key-value store names the process whose heartbeat stopped (either
side) and stays quiet after a normal stop; a server whose mesh is lost answers /health, an in-flight
request and a new one with 503 and an error body. Slow: two `tools.serve` processes on CPU, one killed
with SIGKILL: process 0 answers 503 naming process 1 and exits non-zero within 60 s; with process 0
killed, process 1 exits within 60 s; no process is left either way.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from glm5_jax.serve import multihost
from glm5_jax.serve.multihost import PeerWatch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _KV:
    """The coordination service's key-value calls PeerWatch uses, in memory."""

    def __init__(self):
        self.d, self.lock = {}, threading.Lock()

    def key_value_set(self, k, v, allow_overwrite=False):
        with self.lock:
            self.d[k] = v

    def key_value_try_get(self, k):
        with self.lock:
            if k not in self.d:
                raise KeyError(k)
            return self.d[k]


def _watches(kv, n=2):
    got = {p: [] for p in range(n)}
    ws = [PeerWatch(client=kv, process=p, count=n, timeout_s=1.5, beat_s=0.05, on_lost=got[p].append)
          for p in range(n)]
    time.sleep(0.3)
    return ws, got


def _wait(cond, s=10.0):
    t = time.monotonic() + s
    while not cond() and time.monotonic() < t:
        time.sleep(0.05)
    return cond()


def test_peer_watch_names_the_follower_whose_heartbeat_stops_and_followers_name_a_lost_leader():
    ws, got = _watches(_KV(), 3)
    ws[2]._stop.set()                              # process 2 stops beating (killed, hung), still armed
    assert _wait(lambda: got[0])
    assert got[0][0].startswith("lost process 2 (no heartbeat") and not got[1], got
    ws, got = _watches(_KV())
    ws[0]._stop.set()                              # the leader goes
    assert _wait(lambda: got[1]) and got[1][0].startswith("lost process 0 (the leader, no heartbeat"), got


def test_peer_watch_is_quiet_while_peers_beat_and_after_a_normal_stop():
    ws, got = _watches(_KV())
    time.sleep(2.0)                                # longer than the timeout: both still beating
    assert got == {0: [], 1: []}
    for w in ws:
        w.stand_down()                             # the engine's "stop": leaving is not a loss
    time.sleep(2.0)
    assert got == {0: [], 1: []}


def test_peer_timeout_setting_is_validated(monkeypatch):
    monkeypatch.setenv(multihost.PEER_TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match="GLM5_PEER_TIMEOUT_S='0' is invalid"):
        multihost.peer_timeout_s()
    monkeypatch.setenv(multihost.PEER_TIMEOUT_ENV, "2.5")
    assert multihost.peer_timeout_s() == 2.5


class _Handle:
    _n = 0

    def __init__(self):
        _Handle._n += 1
        self.id, self.cancelled = _Handle._n, False

    def cancel(self):
        self.cancelled = True


class _StuckEngine:
    """An engine whose requests never finish (its step hangs on a dead peer's collective)."""
    active, queue_length, version, max_len, metrics = 0, 0, 0, 64, None
    config = type("Config", (), {"vocab_size": 512})()

    def __init__(self):
        self.handles = []

    def submit(self, ids, sp, request_id=None, on_event=None):
        self.handles.append(_Handle())
        return self.handles[-1]


def _get(url, body=None):
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_lost_mesh_answers_health_in_flight_and_new_requests_with_503(tmp_path, monkeypatch):
    from glm5_jax.data.tokenizer import train_hf_tokenizer
    from glm5_jax.serve.openai_api import OpenAIServer, run_in_thread
    tok = train_hf_tokenizer(["hello world, a tiny tokenizer.\n"] * 20, 280, str(tmp_path / "tokenizer.json"))
    eng = _StuckEngine()
    url, stop = run_in_thread(OpenAIServer(eng, tok, model_name="tiny"))
    try:
        assert _get(url + "/health")[0] == 200
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        out = {}
        for name, extra in (("whole", {}), ("stream", {"stream": True})):
            threading.Thread(target=lambda n=name, e=extra: out.__setitem__(n, _get(url + "/v1/completions",
                                                                                    {**body, **e})),
                             daemon=True).start()
        assert _wait(lambda: len(eng.handles) == 2)            # both in flight, neither will finish
        reason = "lost process 1 (no heartbeat for 10 s, GLM5_PEER_TIMEOUT_S=10): the mesh is broken"
        monkeypatch.setattr(multihost, "_LOST", [reason])
        status, raw = _get(url + "/health")
        assert status == 503 and json.loads(raw)["error"] == reason
        assert _wait(lambda: len(out) == 2)
        status, raw = out["whole"]
        assert status == 503 and reason in json.loads(raw)["error"]["message"], raw
        status, raw = out["stream"]                             # the stream had started: 503 as its last event
        assert status == 200 and b'"code": "host_lost"' in raw and reason.encode() in raw, raw
        assert all(h.cancelled for h in eng.handles)
        status, raw = _get(url + "/v1/completions", body)
        assert status == 503 and json.loads(raw)["error"]["code"] == "host_lost" and len(eng.handles) == 2
    finally:
        stop()


# ----------------------------------------------------------------------------- two real processes


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_pair(d, tmp_path):
    """Two tools.serve processes over one data:2,expert:2 mesh; returns (procs, url, logs) once /health is 200."""
    coord, http = _free_port(), _free_port()
    procs, logs = [], []
    for i in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, GLM5_HUGEPAGES="0", GLM5_PEER_TIMEOUT_S="10",
                   XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
                   GLM5_COORDINATOR_ADDRESS=f"127.0.0.1:{coord}", GLM5_NUM_PROCESSES="2", GLM5_PROCESS_ID=str(i))
        logs.append(open(tmp_path / f"p{i}.log", "w+"))      # noqa: SIM115  (closed by the caller)
        procs.append(subprocess.Popen([sys.executable, "-m", "tools.serve", f"--model={d}", f"--port={http}",
                                       "--mesh=data:2,expert:2", "--max_batch=4", "--max_model_len=64",
                                       "--served_model_name=tiny", "--nowarmup"], cwd=ROOT, env=env,
                                      stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True))
    url = f"http://127.0.0.1:{http}"
    for _ in range(1200):
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            # one request end to end, so every program is compiled before a process is killed
            assert _get(url + "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 2})[0] == 200
            return procs, url, logs
        except (urllib.error.URLError, ConnectionError, OSError):
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.5)
    raise AssertionError("the pair did not start: " + " | ".join(open(f.name).read()[-2000:] for f in logs))


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    import jax

    from glm5_jax import hf, model
    from glm5_jax.config import ModelConfig
    from glm5_jax.data.tokenizer import train_hf_tokenizer
    d = str(tmp_path_factory.mktemp("lost_host_model"))
    tok = train_hf_tokenizer(["Hello world, this is a tiny model answering questions.\n"] * 40, 300,
                             os.path.join(d, "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=2, num_experts=4, experts_per_tok=2, mtp_depth=0)
    hf.save_checkpoint(cfg, model.init_params(cfg, jax.random.PRNGKey(0)), d)
    return d


def _gone(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.slow      # ~60-90 s: two tools.serve processes start jax.distributed and compile, then one is killed
def test_killed_follower_makes_the_leader_answer_503_and_exit_naming_it(tiny_checkpoint, tmp_path):
    procs, url, logs = _start_pair(tiny_checkpoint, tmp_path)
    try:
        out = {}
        long = {"model": "tiny", "prompt": "Hello", "max_tokens": 50, "ignore_eos": True}
        threading.Thread(target=lambda: out.__setitem__("inflight", _get(url + "/v1/completions", long)),
                         daemon=True).start()
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(procs[1].pid, signal.SIGKILL)
        statuses = []
        while procs[0].poll() is None and time.monotonic() - t0 < 90:
            try:
                statuses.append(_get(url + "/health")[0])
            except (urllib.error.URLError, ConnectionError, OSError):
                statuses.append("down")
            time.sleep(0.2)
        took = time.monotonic() - t0
        rc = procs[0].wait(5)
        log = open(logs[0].name).read()
        assert rc == multihost.LOST_EXIT_CODE and took < 60, (rc, took, log[-3000:])
        assert 503 in statuses, statuses
        assert "lost process 1" in log, log[-3000:]
        status, raw = out.get("inflight", (None, b""))
        assert status in (200, 503), (status, raw)          # finished before the kill, or 503 with a body
        if status == 503:
            assert json.loads(raw)["error"]["code"] == "host_lost", raw
    finally:
        _gone(procs)
        for f in logs:
            f.close()
    assert all(p.poll() is not None for p in procs)


@pytest.mark.slow      # ~60 s: as above, the leader killed
def test_killed_leader_makes_the_follower_exit(tiny_checkpoint, tmp_path):
    procs, url, logs = _start_pair(tiny_checkpoint, tmp_path)
    try:
        t0 = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        rc = procs[1].wait(90)
        took = time.monotonic() - t0
        log = open(logs[1].name).read()
        assert rc != 0 and took < 60, (rc, took, log[-3000:])
    finally:
        _gone(procs)
        for f in logs:
            f.close()
    assert all(p.poll() is not None for p in procs)
