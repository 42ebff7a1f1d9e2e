"""The pretrain experiment at a micro scale: trains on a parquet / jsonl file of real text (stdlib
docstrings) with a tokenizer trained here, and reports held-out loss before and after training.
A bad data setting stops the CLI with one error line (exit status 2) before anything compiles."""

import json
import os
import subprocess
import sys

import pytest

from experiments import registry
from glm5_jax.data.stdlib_text import write_stdlib_docs
from tests.test_data_common import small_cache_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = {"model.d_model": "32", "model.ffn_dim": "64", "model.moe_ffn_dim": "32", "model.q_lora_rank": "16",
         "model.kv_lora_rank": "16", "model.qk_nope_head_dim": "8", "model.qk_rope_head_dim": "8",
         "model.v_head_dim": "8", "model.index_topk": "8", "model.index_head_dim": "8", "model.attn_chunk": "32",
         "train.steps": "4", "train.batch_size": "4", "train.seq_len": "32", "train.eval_every": "4",
         "train.eval_batches": "2", "train.warmup_steps": "1", "train.learning_rate": "1e-2",
         "data.vocab_size": "400", "data.eval_fraction": "0.1", "data.tokenizer_train_bytes": "200000"}


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    d = tmp_path_factory.mktemp("docs")
    out = {}
    for ext in ("parquet", "jsonl"):
        out[ext] = str(d / f"docs.{ext}")
        write_stdlib_docs(out[ext], max_files=40)
    return out


def _run(tmp_path, overrides):
    from experiments.run import run_experiment
    overrides = {**MICRO, "data.cache_dir": small_cache_dir(), **overrides}
    report = run_experiment("pretrain", str(tmp_path), "tiny", overrides)
    with open(tmp_path / "report.json") as fh:
        saved = json.load(fh)
    assert saved["final_eval_loss"] == report["final_eval_loss"]
    assert os.path.isfile(tmp_path / "report.md") and os.path.isfile(tmp_path / "eval_loss.png")
    return saved


@pytest.mark.slow   # jit compiles of the model, train step and eval: 519 s on 2 cores under load 20
def test_pretrain_parquet_sentencepiece_lowers_held_out_loss(tmp_path, docs):
    r = _run(tmp_path, {"data.path": docs["parquet"], "data.tokenizer": "spm"})
    assert r["tokenizer_kind"] == "sentencepiece" and r["data"]["eval_documents"] >= 1
    assert r["final_eval_loss"] < r["initial_eval_loss"]
    assert r["config"]["data"]["path"] == docs["parquet"] and r["config"]["model"]["vocab_size"] == 400


@pytest.mark.slow   # a second micro run (jit compiles dominate)
def test_pretrain_jsonl_tokenizer_json_lowers_held_out_loss(tmp_path, docs):
    r = _run(tmp_path, {"data.path": docs["jsonl"], "data.tokenizer": "hf"})
    assert r["tokenizer_kind"] == "hf" and r["final_eval_loss"] < r["initial_eval_loss"]


def test_registered_and_defaults_resolve():
    exp = registry.get("pretrain")
    cfg = registry.resolve_config(exp, "tiny", {"data.path": "x.jsonl", "data.tokenizer": "t.json"})
    assert cfg.data.path == "x.jsonl" and cfg.model.vocab_size == cfg.data.vocab_size
    assert registry.resolve_config(exp, "small", {}).model.d_model == 768


@pytest.mark.parametrize("setting,msg", [
    ("data.path={tmp}/missing.jsonl", "does not exist"),
    ("data.tokenizer={tmp}/nope/tokenizer.json", "does not exist"),
])
def test_bad_data_setting_is_one_error_line(tmp_path, docs, setting, msg):
    args = [sys.executable, "-m", "experiments.run", "--config=pretrain", f"--workdir={tmp_path}/run",
            f"--set=data.cache_dir={small_cache_dir()}", f"--set=data.path={docs['jsonl']}",
            "--set=" + setting.format(tmp=tmp_path)]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and msg in errors[0] and "Traceback" not in p.stderr
