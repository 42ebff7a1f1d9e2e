"""Every command line the docs show works as written, and every CLI answers --help the same way (issue 67).

The CLIs are found by reading the source tree (a module with a `__main__` block that uses absl flags), not
from a list kept by hand; their flags are collected in one child process (each CLI's define_flags run
on its own, its flags removed before the next), and the documented commands are read from README.md,
BUILD_NOTES.md and docs/*.md: every `python -m MODULE ...` names a module that exists, passes only
flags that module defines, and every `--set` / `--sweep` key resolves in that command's config.
"""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "BUILD_NOTES.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]
NOT_CLIS = {"pytest", "pip"}            # other programs' `python -m`

# Run in a child: import each CLI, define its flags alone, report them and its --help text.
_COLLECT = r"""
import contextlib, importlib, inspect, io, json, sys
from absl import flags
from glm5_jax import cli
out = {}
for name in sys.argv[1:]:
    mod = importlib.import_module(name)
    define = mod.define_flags
    printed = io.StringIO()
    if inspect.signature(define).parameters:          # tools.flagparse style: its own FlagValues
        fv = flags.FlagValues()
        define(fv)
        own = list(fv)
        with contextlib.redirect_stdout(printed):
            code = mod.main(["--help"])               # what `python -m NAME --help` returns
    else:                                             # cli.run style: the global registry, alone
        fv = flags.FLAGS
        before = set(fv)
        define()
        own = [n for n in fv if n not in before]
        try:
            with contextlib.redirect_stdout(printed):
                cli._parse_or_exit([name, "--help"])  # what cli.run does with `python -m NAME --help`
            code = None
        except SystemExit as e:
            code = e.code
    out[name] = {"flags": own, "bools": [n for n in own if fv[n].boolean], "help": printed.getvalue(),
                 "absl": [n for n in fv if n not in own], "help_exit": code}
    if fv is flags.FLAGS:
        for n in own:
            delattr(fv, n)
print(json.dumps(out))
"""


def cli_modules() -> list[str]:
    """Modules under tools/, experiments/ and glm5_jax/ with a `__main__` block that parses absl flags."""
    found = []
    for pattern in ("tools/*.py", "experiments/*.py", "glm5_jax/**/*.py"):
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            src = open(path).read()
            if re.search(r'^if __name__ == "__main__":', src, re.M) and "absl" in src:
                found.append(os.path.relpath(path, ROOT)[:-3].replace(os.sep, "."))
    return sorted(found)


@pytest.fixture(scope="module")
def clis():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", _COLLECT, *cli_modules()], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_every_cli_goes_through_glm5_jax_cli_and_has_define_flags():
    for name in cli_modules():
        src = open(os.path.join(ROOT, name.replace(".", os.sep) + ".py")).read()
        main_block = src[re.search(r'^if __name__ == "__main__":', src, re.M).start():]
        assert "app.run(" not in main_block, f"{name}: bare absl app.run (use glm5_jax.cli.run)"
        assert re.search(r"\brun(_cli)?\(main, define_flags\)|sys\.exit\(main\(\)\)", main_block), name
        assert "def define_flags(" in src, name
        if "sys.exit(main())" in main_block:          # its own FlagValues: parsed by tools.flagparse
            assert "flagparse" in src, name


def test_help_of_every_cli_exits_0_and_lists_every_flag_it_accepts(clis):
    assert len(clis) >= 25
    for name, c in clis.items():
        assert c["flags"], f"{name} defines no flags"
        assert c["help_exit"] == 0, f"{name} --help exits {c['help_exit']}"
        for f in c["flags"]:
            listed = f"--{f}:" in c["help"] or f"--[no]{f}:" in c["help"]
            assert listed, f"{name} --help does not list --{f}"


def test_sweep_help_lists_the_flags_it_borrows_from_run_and_exits_0():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run([sys.executable, "-m", "experiments.sweep", "--help"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    for f in ("sweep", "config", "workdir", "preset", "steps", "set", "mesh", "init_from"):
        assert f"--{f}:" in res.stdout, f
    bad = subprocess.run([sys.executable, "-m", "experiments.sweep", "--stpes=3"], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "stpes" in bad.stderr, bad.stderr[-2000:]


# ------------------------------------------------------------------------------------------ the docs

def _code_lines(text: str):
    """Command candidates: code lines (fenced or indented, `\\`-continued lines joined) and inline spans."""
    out, fenced, buf = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            buf += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                out.append(buf)
                buf = ""
    out += [m.replace("\n", " ") for m in re.findall(r"`([^`]+)`", text)]
    return out


def documented_commands():
    """(doc, module, tokens) for every `python -m MODULE ...` in the docs."""
    found = []
    for doc in DOCS:
        for cand in _code_lines(open(os.path.join(ROOT, doc)).read()):
            for m in re.finditer(r"python -m ([\w.]+)(.*?)(?=python -m |$)", cand):
                rest = re.split(r"\s#\s|\s#$|\s*[;|]\s|\s&&\s", m.group(2), maxsplit=1)[0]
                rest = rest.replace("[", " ").replace("]", " ")
                try:
                    tokens = shlex.split(rest)
                except ValueError:
                    tokens = rest.split()
                found.append((doc, m.group(1), tokens))
    return found


_KEY = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+$")


def _flag_args(tokens):
    """(name, value or None) of each --flag token; `--flag value` takes the next token as its value."""
    out = []
    for i, t in enumerate(tokens):
        if t.startswith("--") and len(t) > 2:
            name, eq, val = t[2:].partition("=")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                val = tokens[i + 1]
            out.append((name, val or None))
    return out


def _set_keys_of(module: str, config: str | None, preset: str):
    """Every key `--set` reaches in this command, or None where the command names no concrete config."""
    from glm5_jax.config import ModelConfig
    from glm5_jax.overrides import all_keys
    from glm5_jax.train.config import TrainConfig
    if module in ("experiments.run", "experiments.sweep"):
        from experiments import registry
        if not config or not re.fullmatch(r"[a-z_0-9]+", config):
            return None
        return set(all_keys(registry.get(config).scales[preset]))
    model = {f"model.{k}" for k in all_keys(ModelConfig())}
    if module == "tools.aot":
        return model | {f"train.{k}" for k in all_keys(TrainConfig())}
    if module == "tools.profile_step":
        return model
    return set()


def test_documented_commands_name_existing_modules_and_their_flags(clis):
    import importlib.util
    cmds = documented_commands()
    assert len(cmds) > 100
    problems = []
    for doc, module, tokens in cmds:
        if module in NOT_CLIS:
            continue
        if importlib.util.find_spec(module) is None:
            problems.append(f"{doc}: python -m {module}: no such module")
            continue
        if module not in clis:
            continue                                   # a worker script (tests.*) takes no flags
        c = clis[module]
        known = set(c["flags"]) | set(c["absl"])
        for name, _ in _flag_args(tokens):
            if name not in known and not (name.startswith("no") and name[2:] in c["bools"]):
                problems.append(f"{doc}: python -m {module} --{name}: not a flag of {module}")
    assert not problems, "\n".join(problems)


def test_documented_set_and_sweep_keys_resolve(clis):
    problems, checked = [], 0
    for doc, module, tokens in documented_commands():
        if module not in clis:
            continue
        args = _flag_args(tokens)
        config = next((v for n, v in args if n == "config"), None)
        preset = next((v for n, v in args if n == "preset"), "tiny")
        keys = [v.split("=", 1)[0] for n, v in args if n in ("set", "sweep") and v and "=" in v]
        keys = [k for k in keys if _KEY.match(k) and k != "section.field"]      # placeholders aside
        if not keys:
            continue
        reach = _set_keys_of(module, config, preset if preset in ("tiny", "small") else "tiny")
        if reach is None:
            continue
        for k in keys:
            checked += 1
            if k not in reach:
                problems.append(f"{doc}: python -m {module} ... --set {k}: no such key")
    assert checked >= 10 and not problems, "\n".join(problems)


def test_list_table_has_a_measured_row_for_every_experiment_and_only_those():
    from experiments import registry
    from experiments.run import list_table, measured
    got = measured()
    names = {n for n, e in registry.load_all().items() if e.run.__module__ in registry.MODULES}   # not tests' own
    assert len(names) >= 11 and set(got) == names
    table = list_table()
    for name, m in got.items():
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert m["wall"] in row and m["headline"] in row


# ------------------------------------------------------------------------------ progress and run logs

def test_heartbeat_beats_while_a_block_runs_and_is_silent_when_quiet():
    import time

    from glm5_jax.progress import heartbeat
    said = []
    with heartbeat("compiling", every=0.02, say=said.append):
        time.sleep(0.15)
    assert said[0] == "compiling ..." and said[-1].startswith("compiling: done in")
    assert sum("still running" in s for s in said) >= 2
    quiet = []
    with heartbeat("compiling", every=0.02, say=quiet.append, quiet=True):
        time.sleep(0.05)
    assert quiet == []


def test_aot_compile_beats_while_the_compiler_runs(monkeypatch):
    import time

    from tools import tpu_compile

    class Lowered:
        def compile(self):
            time.sleep(0.3)
            return "compiled"
    assert tpu_compile.HEARTBEAT_S <= 60                  # the bound: a line at least once a minute
    monkeypatch.setattr(tpu_compile, "HEARTBEAT_S", 0.05)
    said = []
    compiled, _, compile_s = tpu_compile.compile_lowered(Lowered, log=said.append)
    assert compiled == "compiled" and compile_s >= 0.3
    beats = [s for s in said if s.startswith("compiling: still running")]
    assert len(beats) >= 3 and "elapsed" in beats[0]


def test_run_log_keeps_what_the_run_printed(tmp_path, capsys):
    from glm5_jax.progress import run_log
    with run_log(str(tmp_path)) as path:
        print("to stdout")
        print("to stderr", file=sys.stderr)
    print("after")
    text = open(path).read()
    assert "to stdout\n" in text and "to stderr\n" in text and "after" not in text
    assert capsys.readouterr().out == "to stdout\nafter\n"


def test_export_phases_writes_events_for_step_rows_and_skips_other_jsonl(tmp_path):
    from glm5_jax.train.observe import export_phases, has_events, phase_logdir
    (tmp_path / "agentic_rl.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n"
                                                       for s in (1, 2, 3)))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "corpus.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    written = export_phases(str(tmp_path))
    assert written == [phase_logdir(str(tmp_path / "agentic_rl.jsonl"))] == [str(tmp_path / "tensorboard" / "agentic_rl")]
    assert has_events(written[0]) and not os.path.exists(tmp_path / "data" / "tensorboard")
    from tests.test_observe import read_events     # the event files parsed by hand
    rows = [(step, round(v, 3)) for tag, step, v in read_events(written[0]) if tag == "reward_mean"]
    assert rows == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert export_phases(str(tmp_path)) == []          # events there already: nothing written twice


@pytest.mark.slow      # ~60 s: an SFT, an RL and a distillation stage at smoke size
def test_distill_recovery_workdir_holds_run_log_and_events_of_every_phase(tmp_path):
    from experiments.run import run_experiment
    from glm5_jax.train.observe import has_events
    smoke = {"train.steps": 4, "train.batch_size": 8, "rl_b.steps": 2, "rl_b.prompts_per_step": 4,
             "rl_b.group_size": 2, "distill.steps": 2, "distill.prompts_per_step": 8, "eval_every": 1,
             "test_tasks": 16, "val_tasks": 16, "test_tasks_b": 16, "val_tasks_b": 16}
    run_experiment("distill_recovery", str(tmp_path), "tiny", [f"{k}={v}" for k, v in smoke.items()])
    for phase in ("sft_a/tensorboard", "tensorboard/rl_b", "tensorboard/distill"):
        assert has_events(str(tmp_path / phase)), phase
    log = (tmp_path / "run.log").read_text()
    assert "[distill] step 2/2" in log and "distill_recovery finished" in log


@pytest.mark.slow      # ~20 s: a tiny checkpoint served by the real command
def test_serve_prints_progress_then_the_bound_port_for_port_0(tmp_path):
    import signal
    import urllib.request

    import jax

    from glm5_jax import hf, model
    from glm5_jax.config import ModelConfig
    from glm5_jax.data.tokenizer import train_hf_tokenizer
    tok = train_hf_tokenizer(["Hello world, this is a tiny model answering questions.\n"] * 40, 320,
                             str(tmp_path / "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=2, mtp_depth=0)
    hf.save_checkpoint(cfg, model.init_params(cfg, jax.random.PRNGKey(0)), str(tmp_path))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-m", "tools.serve", f"--model={tmp_path}", "--port=0", "--max_batch=2",
                          "--max_model_len=64", "--served_model_name=tiny"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()                      # blocks until the server listens
        m = re.match(r"serving tiny on http://127\.0\.0\.1:(\d+) ", line)
        assert m and int(m.group(1)) > 0, line
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{m.group(1)}/health", timeout=30).read())
        assert health["model"] == "tiny"
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
        err = p.stderr.read()
        assert "loading the weights" in err and "warm-up" in err and "done in" in err, err[-2000:]
    finally:
        p.kill()


def test_progress_bar_reports_rate_and_eta_on_stderr_and_nothing_when_quiet(capsys):
    from glm5_jax.progress import bar
    b = bar(4, desc="shards", unit="shard")
    for _ in range(4):
        b.update(1)
    b.close()
    cap = capsys.readouterr()
    assert cap.out == "" and "shards" in cap.err and "4/4" in cap.err and "shard/s" in cap.err
    q = bar(4, desc="shards", quiet=True)
    q.update(4)
    q.close()
    assert capsys.readouterr().err == ""
