"""Dry-run tests of tools/tpu_vm.sh and tools/gpu_launch.sh (no gcloud / SLURM needed)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "tools", "tpu_vm.sh")
GPU = os.path.join(ROOT, "tools", "gpu_launch.sh")
BASH = shutil.which("bash") or "/bin/bash"

SLURM_VARS = [k for k in os.environ if k.startswith("SLURM_")]


def _env(path=None, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GLM5_"))}
    if path is not None:
        env["PATH"] = path
    env.update(extra)
    return env


def run(script, *args, path=None, **env):
    return subprocess.run(
        [BASH, script, *args], capture_output=True, text=True, env=_env(path, **env), timeout=60
    )


@pytest.fixture
def empty_path(tmp_path):
    """A PATH with nothing on it: proves the dry runs need neither gcloud nor scontrol."""
    d = tmp_path / "emptybin"
    d.mkdir()
    return str(d)


# ----------------------------------------------------------------------------- tpu_vm.sh

def test_tpu_create_dry_run_without_gcloud(empty_path):
    r = run(TPU, "create", "--name", "glm5-a", "--zone", "us-east5-a", "--project", "my-proj",
            "--accelerator", "v5p-128", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "+ gcloud compute tpus tpu-vm create glm5-a --zone=us-east5-a --project=my-proj "
        "--accelerator-type=v5p-128 --version=v2-alpha-tpuv5"
    ]


def test_tpu_create_equals_form_spot_and_explicit_version(empty_path):
    r = run(TPU, "create", "--name=glm5-b", "--zone=us-central2-b", "--accelerator=v4-32",
            "--version=tpu-vm-v4-base", "--spot", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        "+ gcloud compute tpus tpu-vm create glm5-b --zone=us-central2-b "
        "--accelerator-type=v4-32 --version=tpu-vm-v4-base --spot"
    )


def test_tpu_run_all_workers(empty_path):
    r = run(TPU, "run", "--name", "glm5-a", "--zone", "us-east5-a", "--project", "p", "--dry_run", "--",
            "python", "-m", "glm5_jax.train", "--steps", "10", "--note", "a b", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        "+ gcloud compute tpus tpu-vm ssh glm5-a --zone=us-east5-a --project=p --worker=all "
        "--command='cd ~/glm5-jax && python -m glm5_jax.train --steps 10 --note '\\''a b'\\'''"
    )


def test_tpu_copy(empty_path, tmp_path):
    src = tmp_path / "repo"
    src.mkdir()
    r = run(TPU, "copy", "--name", "glm5-a", "--zone", "us-east5-a", "--src", str(src),
            "--remote_dir", "work/glm5", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"+ tar --exclude=.git --exclude=__pycache__ --exclude=.venv -czf /tmp/glm5-jax-src.tar.gz -C {src} .",
        "+ gcloud compute tpus tpu-vm scp /tmp/glm5-jax-src.tar.gz glm5-a:/tmp/glm5-jax-src.tar.gz "
        "--zone=us-east5-a --worker=all",
        "+ gcloud compute tpus tpu-vm ssh glm5-a --zone=us-east5-a --worker=all "
        "--command='mkdir -p ~/work/glm5 && tar -xzf /tmp/glm5-jax-src.tar.gz -C ~/work/glm5'",
    ]


def test_tpu_copy_default_src_is_repo(empty_path):
    r = run(TPU, "copy", "--name", "glm5-a", "--zone", "us-east5-a", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert f"-C {ROOT} ." in r.stdout.splitlines()[0]


def test_tpu_delete(empty_path):
    r = run(TPU, "delete", "--name", "glm5-a", "--zone", "us-east5-a", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "+ gcloud compute tpus tpu-vm delete glm5-a --zone=us-east5-a --quiet"


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], "missing subcommand; allowed: create run copy delete"),
        (["launch", "--name", "a", "--zone", "us-east5-a"], "unknown subcommand 'launch'; allowed: create run copy delete"),
        (["create", "--name", "a", "--zone", "us-east5-a", "--bogus", "1", "--dry_run"], "unknown flag '--bogus'"),
        (["create", "--zone", "us-east5-a", "--dry_run"], "flag '--name' is required"),
        (["create", "--name", "a", "--dry_run"], "flag '--zone' is required"),
        (["create", "--name", "a", "--zone", "us-east5-a", "--accelerator", "v9-8", "--dry_run"],
         "bad --accelerator 'v9-8'; allowed: v4-N v5p-N v5litepod-N v6e-N"),
        (["run", "--name", "a", "--zone", "us-east5-a", "--dry_run"], "'run' needs a command after '--'"),
        (["delete", "--name", "a", "--zone", "us-east5-a", "--spot", "--dry_run"], "'--spot' is only valid for 'create'"),
        (["create", "--name", "a", "--zone", "us-east5-a", "--project"], "flag '--project' needs a value"),
        (["create", "--name", "Bad_Name", "--zone", "us-east5-a", "--dry_run"], "bad --name 'Bad_Name'"),
    ],
)
def test_tpu_bad_input(empty_path, args, needle):
    r = run(TPU, *args, path=empty_path)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "usage: tools/tpu_vm.sh" in r.stderr
    assert r.stdout == ""


def test_tpu_without_gcloud_fails_clearly(empty_path):
    r = run(TPU, "delete", "--name", "glm5-a", "--zone", "us-east5-a", path=empty_path)
    assert r.returncode == 127
    assert "gcloud not found" in r.stderr


def test_tpu_help():
    r = run(TPU, "--help")
    assert r.returncode == 0 and "usage:" in r.stdout


# ----------------------------------------------------------------------------- gpu_launch.sh

def _exports(stdout):
    return [ln for ln in stdout.splitlines() if ln.startswith("export ")]


def test_gpu_fake_slurm_builtin_nodelist_parser(empty_path):
    r = run(GPU, "--dry_run", "--", "python", "-m", "glm5_jax.train", "--tag", "x y", path=empty_path,
            SLURM_JOB_ID="77", SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_JOB_NODELIST="gpu[017-020,031],cpu5")
    assert r.returncode == 0, r.stderr
    assert _exports(r.stdout) == [
        "export GLM5_COORDINATOR_ADDRESS=gpu017:12355",
        "export GLM5_NUM_PROCESSES=4",
        "export GLM5_PROCESS_ID=3",
    ]
    assert r.stdout.splitlines()[-1] == "+ python -m glm5_jax.train --tag 'x y'"
    assert "from slurm" in r.stdout


def test_gpu_fake_slurm_uses_scontrol(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    sc = bindir / "scontrol"
    sc.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] || exit 1\necho node-a1\necho node-a2\n')
    sc.chmod(0o755)
    r = run(GPU, "--port", "2222", "--dry_run", "--", "true", path=f"{bindir}:{os.environ['PATH']}",
            SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_JOB_NODELIST="weird[a1-a2]")
    assert r.returncode == 0, r.stderr
    assert _exports(r.stdout) == [
        "export GLM5_COORDINATOR_ADDRESS=node-a1:2222",
        "export GLM5_NUM_PROCESSES=2",
        "export GLM5_PROCESS_ID=1",
    ]


def test_gpu_flags_override_slurm(empty_path):
    r = run(GPU, "--coordinator=10.0.0.1:1234", "--num_processes", "8", "--process_id", "5",
            "--local_device_ids", "0,1,2,3", "--dry_run", "--", "echo", "hi", path=empty_path,
            SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_JOB_NODELIST="n1,n2")
    assert r.returncode == 0, r.stderr
    assert _exports(r.stdout) == [
        "export GLM5_COORDINATOR_ADDRESS=10.0.0.1:1234",
        "export GLM5_NUM_PROCESSES=8",
        "export GLM5_PROCESS_ID=5",
        "export GLM5_LOCAL_DEVICE_IDS=0,1,2,3",
    ]


def test_gpu_single_process_default(empty_path):
    r = run(GPU, "--dry_run", "--", "python", "train.py", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert _exports(r.stdout) == [
        "export GLM5_COORDINATOR_ADDRESS=127.0.0.1:12355",
        "export GLM5_NUM_PROCESSES=1",
        "export GLM5_PROCESS_ID=0",
    ]


def test_gpu_exec_passes_env():
    r = run(GPU, "--coordinator", "h:1", "--num_processes", "2", "--process_id", "1", "--",
            BASH, "-c", 'echo "ENV $GLM5_COORDINATOR_ADDRESS $GLM5_NUM_PROCESSES $GLM5_PROCESS_ID"')
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "ENV h:1 2 1"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--bogus", "--", "true"], "unknown flag '--bogus'; allowed: --coordinator"),
        (["--dry_run"], "missing command after '--'"),
        (["--num_processes", "two", "--coordinator", "h:1", "--", "true"], "bad --num_processes 'two'"),
        (["--num_processes", "2", "--process_id", "2", "--coordinator", "h:1", "--", "true"],
         "bad --process_id '2': must be < num_processes (2)"),
        (["--num_processes", "2", "--", "true"], "flag '--coordinator' is required"),
        (["--coordinator", "nohostport", "--", "true"], "bad --coordinator 'nohostport'"),
        (["--port", "99999", "--", "true"], "bad --port '99999'"),
        (["--local_device_ids", "0;1", "--", "true"], "bad --local_device_ids"),
        (["--process_id"], "flag '--process_id' needs a value"),
    ],
)
def test_gpu_bad_input(empty_path, args, needle):
    r = run(GPU, *args, path=empty_path)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "usage: tools/gpu_launch.sh" in r.stderr


def test_scripts_are_strict_and_executable():
    for p in (TPU, GPU):
        text = open(p).read()
        assert "set -euo pipefail" in text
        assert os.access(p, os.X_OK)
