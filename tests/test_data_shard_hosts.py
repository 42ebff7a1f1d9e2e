"""A 2-process training run (jax.distributed on one machine, 2 fake CPU devices each, one data:4 mesh) on
one directory prepared by tools.prepare_data: each process loads the train documents of its own shards
only (shard i on process i % 2), the two sets are disjoint and together are every shard, and every row a
process feeds the train loop is a packed window of its own shards' documents, none of the other's."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from glm5_jax.data.packing import PackedStream
from glm5_jax.data.stdlib_text import write_stdlib_docs
from glm5_jax.data.token_cache import load_tokens
from glm5_jax.data.tokenizer import load_tokenizer
from tests.test_data_common import small_cache_dir
from tools import prepare_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow     # two processes each compiling the train step: ~60 s on 2 cores
def test_two_processes_train_on_disjoint_shards_that_cover_the_directory(tmp_path):
    docs = str(tmp_path / "docs.parquet")
    write_stdlib_docs(docs, max_files=40)
    out = tmp_path / "prep"
    assert prepare_data.main([f"--input={docs}", "--tokenizer=spm", "--vocab_size=500", f"--out={out}",
                              f"--cache_dir={small_cache_dir()}", "--workers=1", "--shard_docs=6",
                              "--eval_fraction=0.1"]) == 0
    index = json.load(open(out / "index.json"))
    n_shards = len(index["shards"])
    assert n_shards >= 4
    port = _port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    logs = [open(tmp_path / f"p{i}.log", "w+") for i in range(2)]
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "shard_host_worker.py"), str(out),
                               str(tmp_path / "run"), "2", str(i), str(port), str(STEPS)],
                              env=env, stdout=logs[i], stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    for p, log in zip(procs, logs):
        p.wait(timeout=600)
        log.seek(0)
        text = log.read()
        assert p.returncode == 0, text[-3000:]
        outs.append(json.loads([line for line in text.splitlines() if line.startswith("{")][-1]))
    shards = [set(o["shards"]) for o in outs]
    assert shards[0] == set(range(0, n_shards, 2)) and shards[1] == set(range(1, n_shards, 2))
    assert not shards[0] & shards[1] and shards[0] | shards[1] == set(range(n_shards))
    assert sum(o["train_documents"] for o in outs) == index["train"]["documents"]
    tok = load_tokenizer(str(out / index["tokenizer_file"]))
    windows = []
    for s in shards:
        stream = PackedStream(load_tokens(str(out), train_shards=sorted(s))[0]["train"], tok.eos_id, tok.pad_id)
        windows.append({tuple(stream.window(w, 32)["tokens"].tolist()) for w in range(stream.num_windows(32))})
    for o, own, other in ((outs[0], windows[0], windows[1]), (outs[1], windows[1], windows[0])):
        rows = [tuple(r) for r in o["rows"]]
        assert len(rows) == STEPS * 4                                 # its 4 rows of every global batch of 8
        assert all(r in own and r not in other for r in rows)
    assert len(outs[0]["losses"]) == STEPS and np.all(np.isfinite(outs[0]["losses"]))
