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
from tests.test_data_dedup_stages import planted_dir
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
    path, _, tok, embedder = planted_dir(tmp_path_factory.mktemp("engine"), 1, 512)
    return path, tok, embedder


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


@pytest.mark.slow   # ~25 s on a Ray cluster (the killed-run test below also runs the Ray workers against the one-process output)
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


def test_components_keep_the_lowest_id_of_each_connected_group():
    """dedup.components against a breadth-first search of the same random graph."""
    from glm5_jax.data.prep.dedup import components
    rng = np.random.default_rng(0)
    edges = rng.integers(0, 60, size=(40, 2))
    adj = {}
    for a, b in edges.tolist():
        adj.setdefault(a, set()).add(b)
        adj.setdefault(b, set()).add(a)
    expect, seen = {}, set()
    for start in sorted(adj):
        if start in seen:
            continue
        group, todo = {start}, [start]
        while todo:
            for y in adj[todo.pop()] - group:
                group.add(y)
                todo.append(y)
        seen |= group
        expect.update({x: min(group) for x in group if x != min(group)})
    assert {a: b for a, b in components(edges).tolist()} == expect


def test_shards_cover_the_corpus_in_order_across_files(tmp_path):
    """plan_shards: at most shard_docs documents each, contiguous global ids, every document once, the held-out
    split as the corpus has it, files cut mid-way and joined."""
    from glm5_jax.data import DataConfig
    from glm5_jax.data.corpus import load_corpus
    from glm5_jax.data.prep.plan import plan_shards
    for name, n in (("a.jsonl", 7), ("b.jsonl", 2), ("c.jsonl", 9)):
        (tmp_path / name).write_text("".join(json.dumps({"text": f"{name} {i}"}) + "\n" for i in range(n)))
    corpus = load_corpus(DataConfig(path=str(tmp_path), eval_fraction=0.3))
    shards = plan_shards(corpus, 4)
    got = [(g, split, doc.text) for s in shards for g, split, doc in s.documents()]
    want = list(corpus.documents())
    assert [s.num_docs for s in shards] == [4, 4, 4, 4, 2] and [s.first for s in shards] == [0, 4, 8, 12, 16]
    assert [g for g, _, _ in got] == list(range(18)) and [(sp, t) for _, sp, t in got] == [(sp, d.text) for sp, d in want]
