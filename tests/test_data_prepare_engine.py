"""tools.prepare_data on its engine: the same input gives the same kept documents and the same tokens run
in this process (--workers=1) and as Ray tasks (--workers=2, one local Ray cluster for the module), and
after a kill mid-run and a re-run (finished shards kept as they were, a half-written one discarded)."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from glm5_jax.data.token_cache import load_tokens
from tests.test_data_common import small_cache_dir
from tests.test_data_dedup_stages import planted, write_embedder
from tools import prepare_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARD_DOCS = 8


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A planted corpus (near copies, width variants, paraphrases), its spm tokenizer file and a tiny
    embedding checkpoint."""
    d = tmp_path_factory.mktemp("engine")
    texts, _ = planted(np.random.default_rng(1))
    path = d / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = d / "plain"
    assert prepare_data.main([f"--input={path}", "--tokenizer=spm", "--vocab_size=512", f"--out={out}",
                              f"--cache_dir={small_cache_dir()}", "--workers=1"]) == 0
    tok = str(out / json.load(open(out / "index.json"))["tokenizer_file"])
    return str(path), tok, write_embedder(str(d / "embedder"), tok, 512)


def _flags(corpus, out, workers):
    path, tok, embedder = corpus
    return [f"--input={path}", f"--tokenizer={tok}", f"--out={out}", f"--workers={workers}",
            f"--shard_docs={SHARD_DOCS}", "--dedup=near,exact,semantic", f"--embed_model={embedder}",
            "--semantic_threshold=0.5", "--embed_max_tokens=1024", "--filters=length", "--min_words=20",
            "--eval_fraction=0.1"]


def _result(out):
    """What a run produced: dropped documents with reasons, and every split's tokens and offsets."""
    splits, index = load_tokens(str(out))
    return {"dropped": open(os.path.join(out, "dropped.jsonl")).read(),
            "tokens": {s: (np.asarray(splits[s].tokens).tolist(), splits[s].offsets.tolist()) for s in splits},
            "shards": index["shards"], "documents_out": index["documents_out"]}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "w1"
    assert prepare_data.main(_flags(corpus, out, 1)) == 0
    return _result(out)


def test_ray_workers_give_what_one_process_gives(corpus, reference, ray_cluster, tmp_path):
    out = tmp_path / "w2"
    assert prepare_data.main(_flags(corpus, out, 2) + ["--json"]) == 0
    assert _result(out) == reference
    index = json.load(open(out / "index.json"))
    assert index["run"]["workers"] == 2 and len(index["shards"]) > 4
    reasons = {json.loads(line)["reason"] for line in reference["dropped"].splitlines()}
    assert {"near_duplicate", "exact_duplicate", "semantic_duplicate"} <= reasons      # every stage had work


def test_killed_run_resumes_to_the_same_output(corpus, reference, ray_cluster, tmp_path):
    out = tmp_path / "killed"
    log = open(tmp_path / "worker.log", "w+")
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "prep_kill_worker.py"), "0.5",
                          *_flags(corpus, out, 1)], env=dict(os.environ, PYTHONPATH=ROOT), stdout=log,
                         stderr=subprocess.STDOUT)
    shards = out / "shards"
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if shards.is_dir() and len([n for n in os.listdir(shards) if not n.startswith(".")]) >= 2:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    log.seek(0)
    finished = sorted(n for n in os.listdir(shards) if not n.startswith("."))
    assert 2 <= len(finished) < len(reference["shards"]) and not (out / "index.json").exists(), log.read()[-2000:]
    before = {n: os.stat(shards / n / "train.tokens.bin").st_mtime_ns for n in finished}
    # a half-written shard as a killed task leaves it: a temporary folder, never read
    half = shards / ".tmp-99999-x"
    half.mkdir()
    (half / "train.tokens.bin").write_bytes(b"\xff" * 7)
    assert prepare_data.main(_flags(corpus, out, 2)) == 0           # the same command (here on Ray) resumes
    assert _result(out) == reference
    assert {n: os.stat(shards / n / "train.tokens.bin").st_mtime_ns for n in finished} == before   # not redone
    assert not half.exists() and not (out / "_work").exists()


def test_other_settings_do_not_resume_an_unfinished_run(corpus, tmp_path):
    out = tmp_path / "x"
    (out / "_work").mkdir(parents=True)
    (out / "_work" / "plan.json").write_text(json.dumps({"key": "another"}))
    assert prepare_data.main(_flags(corpus, out, 1)) == 2
