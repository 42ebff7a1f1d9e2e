"""Dry-run tests of tools/tpu_vm.sh and tools/gpu_launch.sh (no gcloud / SLURM needed): the exact
commands they print, that they start the real entry point and install the pinned extras."""

import configparser
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TPU = os.path.join(ROOT, "tools", "tpu_vm.sh")
GPU = os.path.join(ROOT, "tools", "gpu_launch.sh")
BASH = shutil.which("bash") or "/bin/bash"
Q = "'\\''"          # how a single quote inside a single-quoted shell word is written


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


def test_tpu_create_queued_resource(empty_path):
    r = run(TPU, "create", "--name", "glm5-q", "--zone", "us-east5-a", "--project", "my-proj",
            "--accelerator", "v5p-256", "--queued", "--spot", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "+ gcloud compute tpus queued-resources create glm5-q --node-id=glm5-q --zone=us-east5-a "
        "--project=my-proj --accelerator-type=v5p-256 --runtime-version=v2-alpha-tpuv5 --spot"
    ]


def test_tpu_status_and_delete_queued(empty_path):
    r = run(TPU, "status", "--name", "glm5-q", "--zone", "us-east5-a", "--queued", "--dry_run", path=empty_path)
    assert r.stdout.splitlines() == ["+ gcloud compute tpus queued-resources describe glm5-q --zone=us-east5-a"]
    r = run(TPU, "status", "--name", "glm5-q", "--zone", "us-east5-a", "--dry_run", path=empty_path)
    assert r.stdout.splitlines() == ["+ gcloud compute tpus tpu-vm describe glm5-q --zone=us-east5-a"]
    r = run(TPU, "delete", "--name", "glm5-q", "--zone", "us-east5-a", "--queued", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "+ gcloud compute tpus queued-resources delete glm5-q --zone=us-east5-a --force --quiet"]


def test_tpu_setup_installs_the_tpu_extra_on_every_worker(empty_path, tmp_path):
    src = tmp_path / "repo"
    src.mkdir()
    r = run(TPU, "setup", "--name", "glm5-a", "--zone", "us-east5-a", "--project", "p", "--src", str(src),
            "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"+ tar --exclude=.git --exclude=__pycache__ --exclude=.venv -czf /tmp/glm5-jax-src.tar.gz -C {src} .",
        "+ gcloud compute tpus tpu-vm scp /tmp/glm5-jax-src.tar.gz glm5-a:/tmp/glm5-jax-src.tar.gz "
        "--zone=us-east5-a --project=p --worker=all",
        "+ gcloud compute tpus tpu-vm ssh glm5-a --zone=us-east5-a --project=p --worker=all "
        "--command='mkdir -p ~/glm5-jax && tar -xzf /tmp/glm5-jax-src.tar.gz -C ~/glm5-jax'",
        "+ gcloud compute tpus tpu-vm ssh glm5-a --zone=us-east5-a --project=p --worker=all "
        """--command='cd ~/glm5-jax && python3 -m pip install -r requirements.txt -e ".[tpu]"'""",
    ]


def test_tpu_train_starts_the_entry_point_on_every_worker(empty_path):
    r = run(TPU, "train", "--name", "glm5-a", "--zone", "us-east5-a", "--config", "dsa_vs_mla",
            "--mesh", "fsdp:-1,expert:4", "--set", "train.batch_size=256", "--set=data.note=a b",
            "--dry_run", "--", "--steps", "10", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "+ gcloud compute tpus tpu-vm ssh glm5-a --zone=us-east5-a --worker=all "
        "--command='cd ~/glm5-jax && GLM5_DISTRIBUTED=auto python3 -m experiments.run --config=dsa_vs_mla "
        f"--mesh=fsdp:-1,expert:4 --set=train.batch_size=256 --set={Q}data.note=a b{Q} --steps 10'"
    ]
    r = run(TPU, "train", "--name", "glm5-a", "--zone", "us-east5-a", "--config", "mtp_sharing",
            "--python", "python", "--remote_dir", "w/g", "--dry_run", path=empty_path)
    assert r.stdout.splitlines() == [
        "+ gcloud compute tpus tpu-vm ssh glm5-a --zone=us-east5-a --worker=all "
        "--command='cd ~/w/g && GLM5_DISTRIBUTED=auto python -m experiments.run --config=mtp_sharing'"
    ]


def test_tpu_run_all_workers(empty_path):
    r = run(TPU, "run", "--name", "glm5-a", "--zone", "us-east5-a", "--project", "p", "--dry_run", "--",
            "python3", "-m", "experiments.run", "--list", "--note", "a b", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == (
        "+ gcloud compute tpus tpu-vm ssh glm5-a --zone=us-east5-a --project=p --worker=all "
        f"--command='cd ~/glm5-jax && python3 -m experiments.run --list --note {Q}a b{Q}'"
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


SUBS = "create status setup train copy run delete"


@pytest.mark.parametrize(
    "args, needle",
    [
        ([], f"missing subcommand; allowed: {SUBS}"),
        (["launch", "--name", "a", "--zone", "us-east5-a"], f"unknown subcommand 'launch'; allowed: {SUBS}"),
        (["create", "--name", "a", "--zone", "us-east5-a", "--bogus", "1", "--dry_run"], "unknown flag '--bogus'"),
        (["create", "--zone", "us-east5-a", "--dry_run"], "flag '--name' is required"),
        (["create", "--name", "a", "--dry_run"], "flag '--zone' is required"),
        (["create", "--name", "a", "--zone", "us-east5-a", "--accelerator", "v9-8", "--dry_run"],
         "bad --accelerator 'v9-8'; allowed: v4-N v5p-N v5litepod-N v6e-N"),
        (["run", "--name", "a", "--zone", "us-east5-a", "--dry_run"], "'run' needs a command after '--'"),
        (["delete", "--name", "a", "--zone", "us-east5-a", "--spot", "--dry_run"], "'--spot' is only valid for 'create'"),
        (["create", "--name", "a", "--zone", "us-east5-a", "--project"], "flag '--project' needs a value"),
        (["create", "--name", "Bad_Name", "--zone", "us-east5-a", "--dry_run"], "bad --name 'Bad_Name'"),
        (["copy", "--name", "a", "--zone", "us-east5-a", "--queued", "--dry_run"],
         "flag '--queued' is only valid for 'create', 'status', 'delete'"),
        (["train", "--name", "a", "--zone", "us-east5-a", "--dry_run"], "flag '--config' is required for 'train'"),
        (["create", "--name", "a", "--zone", "us-east5-a", "--config", "x", "--dry_run"],
         "flag '--config' is only valid for 'train'"),
        (["setup", "--name", "a", "--zone", "us-east5-a", "--set", "a.b=1", "--dry_run"],
         "flag '--set' is only valid for 'train'"),
        (["train", "--name", "a", "--zone", "us-east5-a", "--config", "x", "--mesh", "fsdp=4", "--dry_run"],
         "bad --mesh 'fsdp=4': AXIS:N,... over data, fsdp, expert, context, tensor"),
        (["train", "--name", "a", "--zone", "us-east5-a", "--config", "x", "--mesh", "fsdp:4,contxt:2", "--dry_run"],
         "bad --mesh 'fsdp:4,contxt:2': unknown axis 'contxt'; allowed: data, fsdp, expert, context, tensor"),
        (["train", "--name", "a", "--zone", "us-east5-a", "--config", "x", "--set", "lr", "--dry_run"],
         "bad --set 'lr': expected section.field=value"),
        (["train", "--name", "a", "--zone", "us-east5-a", "--config", "configs/x.py", "--dry_run"],
         "bad --config 'configs/x.py'"),
        (["delete", "--name", "a", "--zone", "us-east5-a", "--dry_run", "--", "x"],
         "'delete' takes no arguments after '--'"),
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
    r = run(GPU, "--dry_run", "--", "python", "-m", "experiments.run", "--tag", "x y", path=empty_path,
            SLURM_JOB_ID="77", SLURM_PROCID="3", SLURM_NTASKS="4", SLURM_JOB_NODELIST="gpu[017-020,031],cpu5")
    assert r.returncode == 0, r.stderr
    assert _exports(r.stdout) == [
        "export GLM5_COORDINATOR_ADDRESS=gpu017:12355",
        "export GLM5_NUM_PROCESSES=4",
        "export GLM5_PROCESS_ID=3",
    ]
    assert r.stdout.splitlines()[-1] == "+ python -m experiments.run --tag 'x y'"
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


def test_gpu_install_and_entry_point(empty_path):
    r = run(GPU, "--install", "--config", "dsa_vs_mla", "--mesh=fsdp:-1,expert:8", "--set", "train.batch_size=64",
            "--dry_run", "--", "--steps", "5", path=empty_path,
            SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_JOB_NODELIST="gpu[1-2]")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        "# tools/gpu_launch.sh: topology from slurm",
        "export GLM5_COORDINATOR_ADDRESS=gpu1:12355",
        "export GLM5_NUM_PROCESSES=2",
        "export GLM5_PROCESS_ID=1",
        f"+ cd {ROOT}",
        "+ python -m pip install -r requirements.txt -e '.[cuda12]'",
        "+ python -m experiments.run --config=dsa_vs_mla --mesh=fsdp:-1,expert:8 --set=train.batch_size=64 --steps 5",
    ]
    r = run(GPU, "--config", "mtp_sharing", "--python", "/opt/venv/bin/python", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-2:] == [f"+ cd {ROOT}",
                                          "+ /opt/venv/bin/python -m experiments.run --config=mtp_sharing"]


def test_gpu_exec_passes_env():
    r = run(GPU, "--coordinator", "h:1", "--num_processes", "2", "--process_id", "1", "--",
            BASH, "-c", 'echo "ENV $GLM5_COORDINATOR_ADDRESS $GLM5_NUM_PROCESSES $GLM5_PROCESS_ID"')
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "ENV h:1 2 1"


def test_gpu_exports_the_variables_distributed_reads():
    from glm5_jax.parallel import distributed
    text = open(GPU).read()
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID,
                 distributed.ENV_LOCAL_DEVICE_IDS):
        assert f"export {name}=" in text, name


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--bogus", "--", "true"], "unknown flag '--bogus'; allowed: --coordinator"),
        (["--dry_run"], "missing --config NAME or a command after '--'"),
        (["--mesh", "fsdp:2", "--", "true"], "flags '--mesh' and '--set' need --config"),
        (["--config", "a/b"], "bad --config 'a/b'"),
        (["--config", "x", "--mesh", "fsdp"], "bad --mesh 'fsdp'"),
        (["--config", "x", "--mesh", "context:2,seq:4"], "unknown axis 'seq'; allowed: data, fsdp, expert, context, tensor"),
        (["--config", "x", "--set", "noequals"], "bad --set 'noequals'"),
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


def test_scripts_know_the_mesh_axes_and_pass_context_through(empty_path):
    """Each script's axis list is glm5_jax.sharding.MESH_AXES, and a context-parallel mesh reaches
    experiments.run unchanged."""
    from glm5_jax.sharding import MESH_AXES
    for p in (TPU, GPU):        # both source the shared check
        assert 'source "${BASH_SOURCE[0]%/*}/launch_mesh.sh"' in open(p).read(), p
    m = re.search(r'^MESH_AXES="([^"]*)"$', open(os.path.join(os.path.dirname(TPU), "launch_mesh.sh")).read(), re.M)
    assert m and tuple(m.group(1).split()) == MESH_AXES
    r = run(TPU, "train", "--name", "a", "--zone", "us-east5-a", "--config", "x", "--mesh", "expert:16,context:8",
            "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert "experiments.run --config=x --mesh=expert:16,context:8'" in r.stdout
    r = run(GPU, "--config", "x", "--mesh=fsdp:-1,context:2", "--dry_run", path=empty_path)
    assert r.returncode == 0, r.stderr
    assert "+ python -m experiments.run --config=x --mesh=fsdp:-1,context:2" in r.stdout


def test_scripts_are_strict_and_executable():
    for p in (TPU, GPU):
        text = open(p).read()
        assert "set -euo pipefail" in text
        assert os.access(p, os.X_OK)


# ----------------------------------------------------------------------------- what the scripts name

def test_docs_and_scripts_name_only_the_real_entry_point():
    """Launch docs, scripts and README start `python -m experiments.run`; the old, nonexistent
    `python -m glm5_jax.train --config configs/...` is gone everywhere."""
    paths = glob.glob(os.path.join(ROOT, "tools", "*.sh")) + glob.glob(os.path.join(ROOT, "docs", "*.md"))
    paths.append(os.path.join(ROOT, "README.md"))
    for p in paths:
        text = open(p).read()
        assert "-m glm5_jax.train" not in text and "--config configs/" not in text, p
    for p in (TPU, GPU, os.path.join(ROOT, "docs", "launch.md")):
        assert "-m experiments.run --config=" in open(p).read(), p


def test_entry_point_has_the_flags_the_scripts_pass():
    out = subprocess.run([sys.executable, "-m", "experiments.run", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    for flag in ("--config", "--mesh", "--set"):
        assert re.search(rf"^\s+{flag}:", out.stdout + out.stderr, re.M), flag


def test_requirements_pin_exactly_what_setup_cfg_declares_as_ranges():
    """Packaging (issue 60): requirements.txt is the one list of exact pins; setup.cfg declares the package with
    compatible ranges, and every pin satisfies the range that declares it (core and extras); every declared
    dependency is pinned (except the large optional stacks requirements.txt names in a comment: the
    accelerator runtimes, whose extras follow jax's own, torch for the HF fixtures, the GCS client);
    Ray, aiohttp, prometheus, pyarrow and datasketch are extras, not the core install; the accelerator extras
    ask for the same jax range as the core."""
    from packaging.requirements import Requirement
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    parse = lambda text: [Requirement(ln) for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    core = parse(cfg["options"]["install_requires"])
    extras = {k: parse(v) for k, v in cfg["options.extras_require"].items()}
    pins = {}
    for ln in open(os.path.join(ROOT, "requirements.txt")):
        if ln.strip() and not ln.startswith("#"):
            r = Requirement(ln.strip())
            spec = list(r.specifier)
            assert len(spec) == 1 and spec[0].operator == "==", f"requirements.txt: {ln.strip()!r} is not an exact pin"
            pins[r.name.lower()] = spec[0].version
    accelerator = {"tpu", "cuda12"}
    unpinned = {"libtpu", "torch", "gcsfs", "google-cloud-storage"}       # named in requirements.txt's comment
    for where, reqs in [("install_requires", core)] + [(f"extra {k}", v) for k, v in extras.items()]:
        for r in reqs:
            assert not any(s.operator == "==" for s in r.specifier), f"setup.cfg {where}: {r} is a pin, not a range"
            name = r.name.lower()
            if (where.split()[-1] in accelerator and name != "jax") or name in unpinned:
                continue
            assert name in pins, f"setup.cfg {where}: {r} has no exact pin in requirements.txt"
            assert r.specifier.contains(pins[name]), f"setup.cfg {where}: {r} excludes the pinned {pins[name]}"
    names = {r.name.lower() for r in core}
    assert not names & {"ray", "aiohttp", "prometheus-client", "pyarrow", "datasketch"}, names
    assert {"serve", "rl", "data", "tpu", "cuda12", "test", "fixtures"} <= set(extras)
    jax_range = next(r.specifier for r in core if r.name == "jax")
    for extra in accelerator:
        assert any(r.name == "jax" and r.specifier == jax_range for r in extras[extra]), extra
    declared = names | {r.name.lower() for v in extras.values() for r in v}
    assert set(pins) <= declared, f"pinned but never declared in setup.cfg: {set(pins) - declared}"
