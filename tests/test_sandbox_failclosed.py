"""Issue 66: the sandbox isolates wherever Python is installed, and fails closed.

* The escape probes (a spawned process writing outside, a file read and a file written outside, a
  detached process, a frame walk forging the verdict, a search for the tests) and the reward hacks, run
  through ``run_sandboxed`` and the task scorer by an interpreter in a virtual environment under a /tmp
  directory (the mount plan used to collide with the scratch /tmp there and run the code un-isolated).
* With isolation unavailable on purpose: ``run_sandboxed`` is ``sandbox_error`` (never ``passed``), the
  scorer gives 0, a run's start refuses with one line naming the fix, ``experiments.run`` exits 2;
  only the explicit opt-out (``rl.sandbox_isolation=off``) runs code un-isolated, with a warning.
"""

import json
import logging
import os
import subprocess
import sys
import tempfile
import time

import pytest

from glm5_jax.errors import Glm5Error
from glm5_jax.rl import sandbox, sandbox_isolation
from glm5_jax.rl.sandbox import POLICY_ENV, require_isolation, require_isolation_for, run_sandboxed
from glm5_jax.rl.sandbox_isolation import Mount, mount_plan, runtime_dest
from glm5_jax.rl.tasks import score_function
from tests.test_sandbox import backend_fixture  # noqa: F401  (registers the fixture "backend")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"

# run by the venv's interpreter: each probe through run_sandboxed (the scorer's defaults) or the scorer;
# prints one JSON object {probe: [status, passed, stdout + stderr]}
PROBES = r'''
import json, os, sys
from glm5_jax.rl.sandbox import run_sandboxed, isolation_available
from glm5_jax.rl.tasks import score_function
from tests.test_sandbox import backend_fixture  # noqa: F401  (registers the fixture "backend")
secret, outside, marker = sys.argv[1:4]
SPAWN = (
    "import _posixsubprocess, os\n"
    "def spawn(argv, setsid=False):\n"
    "    r, w = os.pipe()\n"
    "    pid = _posixsubprocess.fork_exec([a.encode() for a in argv], [argv[0].encode()], True, (), None,\n"
    "        None, -1, -1, -1, -1, -1, -1, r, w, False, setsid, -1, None, None, None, -1, None, False)\n"
    "    os.close(w)\n"
    "    os.read(r, 100)\n"
    "    os.close(r)\n"
    "    return pid\n")
ADD = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n# secret-marker\n"
probes = {
    "spawned_write": SPAWN + f"os.waitpid(spawn(['/bin/sh', '-c', 'echo x > {outside}.spawn; cat {secret}']), 0)\n" + ADD,
    "file_read": f"print(open({secret!r}).read())\n" + ADD,
    "file_write": f"open({outside + '.py'!r}, 'w').write('x')\n" + ADD,
    "detached": SPAWN + f"spawn(['/bin/sleep', {marker!r}], setsid=True)\n" + ADD,
    "frame_walk": ("def add(a, b):\n    import sys\n    f = sys._getframe(1)\n    for k in ('finish', 'verdict'):\n"
                   "        if k in f.f_locals:\n            f.f_locals[k](0)\n    return a - b\n"),
    "exit_zero": "def add(a, b):\n    return a - b\nimport os\nos._exit(0)\n",
    "find_tests": ("import os\nfor d, ds, fs in os.walk('/'):\n    for f in fs:\n        try:\n"
                   "            if 'secret-marker' in open(os.path.join(d, f)).read():\n                print('FOUND', d, f)\n"
                   "        except Exception:\n            pass\n" + ADD),
}
out = {"isolation": isolation_available()}
for name, code in probes.items():
    r = run_sandboxed(code, TESTS, timeout_s=5.0)
    out[name] = [r.status, r.passed, r.stdout + r.stderr, r.backend]
out["score_hack"] = score_function("    return a - b\nimport os\nos._exit(0)\n" + "\n", "def add(a, b):\n", TESTS)
out["score_ok"] = score_function("    return a + b\n\n", "def add(a, b):\n", TESTS)
print(json.dumps(out))
'''


def _tmp_venv(where: str) -> str:
    """A venv under ``where`` whose interpreter is a copy there (its real path is under /tmp too)."""
    env = os.path.join(where, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--copies", "--system-site-packages", "--without-pip", env],
                   check=True, timeout=120)
    return os.path.join(env, "bin", "python")


def test_escape_probes_are_contained_with_the_interpreter_in_a_venv_under_tmp(backend):
    """On each backend (forced; skipped where its probe fails)."""
    work = tempfile.mkdtemp(prefix="glm5_failclosed_", dir="/tmp")
    try:
        py = _tmp_venv(work)
        assert os.path.realpath(py).startswith("/tmp/")
        secret = os.path.join(work, "host_secret.txt")
        with open(secret, "w") as f:
            f.write("host-secret-value")
        outside = os.path.join(work, "written_from_sandbox")
        marker = f"{os.getpid() % 1000}.{time.monotonic_ns() % 100000:05d}"
        script = os.path.join(work, "probes.py")
        with open(script, "w") as f:
            f.write(PROBES)
        env = dict(os.environ, PYTHONPATH=ROOT)
        r = subprocess.run([py, script, secret, outside, marker], capture_output=True, text=True, timeout=300,
                           env=env, cwd=work)
        assert r.returncode == 0, r.stderr[-3000:]
        res = json.loads(r.stdout.strip().splitlines()[-1])
        assert res["isolation"] == "on", res           # the /tmp interpreter gets namespaces (it did not before)
        for name in ("spawned_write", "file_read", "file_write", "detached", "find_tests"):
            out = res[name][2]
            assert res[name][3] == backend, (name, res[name])
            assert "host-secret-value" not in out and "FOUND" not in out, (name, out)
        assert not [f for f in os.listdir(work) if f.startswith("written_from_sandbox")]
        for name in ("frame_walk", "exit_zero"):
            assert not res[name][1] and res[name][0] in ("failed", "error"), (name, res[name])
        assert res["score_hack"] == [0.0, "wrong"] and res["score_ok"] == [1.0, "correct"], res
        time.sleep(0.2)
        alive = []
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    alive += [p] if marker.encode() in f.read() else []
            except OSError:
                pass
        assert not alive, f"a detached sandbox process outlived the run: {alive}"
    finally:
        subprocess.run(["rm", "-rf", work], check=False)


def test_mount_plan_places_a_prefix_under_tmp_or_work_on_top_of_the_scratch(monkeypatch):
    monkeypatch.setattr(sandbox_isolation, "ro_paths", lambda: ["/tmp/env", "/work/proj/.venv", "/opt/conda"])
    plan = mount_plan("/host/box", 4)
    dests = [m.dest for m in plan]
    assert Mount("ro", "/tmp/env", "/work/env") in plan          # /tmp is a symlink to /work there
    assert Mount("ro", "/work/proj/.venv", "/work/proj/.venv") in plan
    assert Mount("ro", "/opt/conda", "/opt/conda") in plan
    assert dests.index("/work") < dests.index("/work/env") and dests.index("/work") < dests.index("/work/proj/.venv")
    assert runtime_dest("/tmp/a/b") == "/work/a/b" and runtime_dest("/home/u/.pyenv") == "/home/u/.pyenv"
    for bad in ("/tmp", "/work", "/box/x", "/dev/shm/py"):
        with pytest.raises(Glm5Error, match="cannot be bound into the sandbox"):
            runtime_dest(bad)


@pytest.fixture
def no_isolation(monkeypatch):
    """Isolation made unavailable on purpose; the policy left at its default (required)."""
    monkeypatch.setattr(sandbox, "isolation_available", lambda: "unavailable: made unavailable by the test")
    monkeypatch.delenv(POLICY_ENV, raising=False)


def test_without_isolation_run_sandboxed_is_sandbox_error_and_the_scorer_gives_zero(no_isolation, monkeypatch):
    for kw in ({}, {"isolate": None}, {"isolate": True}):
        r = run_sandboxed(ADD, ADD_TESTS, **kw)
        assert r.status == "sandbox_error" and not r.passed, r
        assert "made unavailable by the test" in r.stderr and "CAP_SYS_ADMIN" in r.stderr, r.stderr
    assert score_function("    return a + b\n\n", "def add(a, b):\n", ADD_TESTS) == (0.0, "wrong")
    # the explicit opt-outs: the run goes ahead un-isolated and says so
    r = run_sandboxed(ADD, ADD_TESTS, isolate=False)
    assert r.passed and not r.isolated and r.isolation["namespaces"] == "off", r
    monkeypatch.setenv(POLICY_ENV, "off")
    r = run_sandboxed(ADD, ADD_TESTS)
    assert r.passed and r.isolation["namespaces"] == "unavailable: made unavailable by the test", r


def test_run_start_refuses_without_isolation_in_one_line_naming_the_fix(no_isolation, caplog):
    with pytest.raises(Glm5Error) as e:
        require_isolation("required")
    msg = str(e.value)
    assert "\n" not in msg and "made unavailable by the test" in msg, msg
    for fix in ("root", "CAP_SYS_ADMIN", "unshare", "bubblewrap", "rl.sandbox_isolation=off"):
        assert fix in msg, (fix, msg)
    with pytest.raises(Glm5Error, match="rl.sandbox_isolation='maybe' is invalid"):
        require_isolation("maybe")
    with caplog.at_level(logging.WARNING):
        assert require_isolation("off").startswith("unavailable")
    assert os.environ[POLICY_ENV] == "off" and "WITHOUT ISOLATION" in caplog.text
    assert require_isolation("required").startswith("unavailable")    # the process's policy is off now


def test_experiment_configs_with_rl_are_checked(no_isolation):
    from experiments import registry
    exp = registry.get("grpo_icepop")
    cfg = registry.resolve_config(exp, "tiny", [], None)
    with pytest.raises(Glm5Error, match="rl.sandbox_isolation=off"):
        require_isolation_for(cfg)
    cfg = registry.resolve_config(exp, "tiny", ["rl.sandbox_isolation=off"], None)
    assert require_isolation_for(cfg) == ["rl.sandbox_isolation"] and os.environ[POLICY_ENV] == "off"


def test_experiments_run_refuses_to_start_without_isolation(tmp_path):
    if sandbox_isolation.tool("bwrap") is not None:
        pytest.skip("bubblewrap is installed: forcing it does not make isolation unavailable")
    env = dict(os.environ, **{sandbox_isolation.BACKEND_ENV: "bwrap"})   # not installed: no backend
    env.pop(POLICY_ENV, None)
    r = subprocess.run([sys.executable, "-m", "experiments.run", "--config=grpo_icepop", f"--workdir={tmp_path}"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "bwrap not found" in lines[0] and "rl.sandbox_isolation=off" in lines[0], r.stderr
    assert not (tmp_path / "settings.json").exists()
