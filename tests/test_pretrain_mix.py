"""pretrain's default two-source mixture with an annealing stage (experiments/pretrain.py): the code source
holds no docstring (so the held-out docstrings are not trained on as code), the settings resolve and bad
ones are refused by name, and (slow) a micro run trains `main` then `anneal` with each stage drawing its
mix and its LR schedule (held at the peak, then decaying)."""

import ast
import json
import os

import pytest

from experiments import registry
from glm5_jax.data.stdlib_code import strip_docstrings, write_stdlib_code
from glm5_jax.config import ConfigError
from tests.test_data_common import small_cache_dir


def test_code_source_has_no_docstrings(tmp_path):
    out = tmp_path / "code.jsonl"
    info = write_stdlib_code(str(out), max_bytes=60_000)
    docs = [json.loads(line) for line in open(out)]
    assert info["documents"] == len(docs) >= 2 and info["bytes"] >= 60_000
    for d in docs:
        tree = ast.parse(d["text"])
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                assert ast.get_docstring(node) is None, d["source"]
    assert strip_docstrings('"""m"""\ndef f():\n    """d"""\n') == "def f():\n    pass"


def test_defaults_and_bad_settings():
    exp = registry.get("pretrain")
    cfg = registry.resolve_config(exp, "tiny", {})
    assert cfg.default_data == "docs+code" and cfg.source_names() == ("docs", "code")
    assert cfg.anneal_steps == 120 and cfg.train.steps == 600
    assert registry.resolve_config(exp, "tiny", {"data.path": "x.jsonl"}).anneal_steps == 0   # one corpus
    assert registry.resolve_config(exp, "tiny", {"anneal_mix": "none"}).anneal_steps == 0
    mine = registry.resolve_config(exp, "tiny", {"data.sources": "web=/a:3,math=/b:1", "anneal_mix": "math:1"})
    assert mine.source_names() == ("web", "math") and mine.anneal_steps == 120
    for over, msg in (({"data.sources": "web=/a:1"}, r"anneal_mix='docs:0.9,code:0.1' is invalid.*'docs' is not a "
                                                     r"source \(sources: web\)"),
                      ({"anneal_mix": "docs:-1"}, r"weight '-1' is invalid"),
                      ({"anneal_fraction": "1"}, r"anneal_fraction=1.0 is invalid"),
                      ({"default_data": "web"}, r"default_data='web' is invalid")):
        with pytest.raises(ConfigError, match=msg):
            registry.resolve_config(exp, "tiny", over)


MICRO = {"model.d_model": "32", "model.ffn_dim": "64", "model.moe_ffn_dim": "32", "model.q_lora_rank": "16",
         "model.kv_lora_rank": "16", "model.qk_nope_head_dim": "8", "model.qk_rope_head_dim": "8",
         "model.v_head_dim": "8", "model.index_topk": "8", "model.index_head_dim": "8", "model.attn_chunk": "32",
         "train.steps": "10", "train.batch_size": "4", "train.seq_len": "32", "train.eval_every": "5",
         "train.eval_batches": "2", "train.warmup_steps": "1", "train.learning_rate": "1e-2", "train.log_every": "1",
         "data.vocab_size": "400", "data.tokenizer_train_bytes": "200000", "anneal_fraction": "0.4",
         "anneal_warmup_steps": "1", "anneal_mix": "docs:3,code:1"}


@pytest.mark.slow   # tokenizer training on 4 MB of stdlib text and three jit compiles (initial eval, two stages)
def test_micro_pretrain_mixture_with_annealing_stage(tmp_path):
    from experiments.run import run_experiment
    report = run_experiment("pretrain", str(tmp_path), "tiny", {**MICRO, "data.cache_dir": small_cache_dir()})
    assert set(report["per_source"]) == {"docs", "code"}
    main, anneal = report["stages"]
    assert (main["stage"], main["steps"], anneal["stage"], anneal["steps"]) == ("main", 6, "anneal", 4)
    assert main["mix"] == {"docs": 0.5, "code": 0.5} and anneal["mix"] == {"docs": 0.75, "code": 0.25}
    # each stage drew its mix: 24 / 16 sequences, split exactly by the interleaving's shares
    assert (main["data_sequences/docs"], main["data_sequences/code"]) == (12, 12)
    assert (anneal["data_sequences/docs"], anneal["data_sequences/code"]) == (12, 4)
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    assert set(report["after_main_eval"]) >= {"eval_loss", "eval_loss/docs", "eval_loss/code"}
    rows = {}
    for stage in ("stage_0_main", "stage_1_anneal"):
        rows[stage] = [json.loads(line) for line in open(os.path.join(tmp_path, "train", stage, "metrics.jsonl"))]
    assert all("data_tokens/docs" in r and "data_tokens/code" in r for r in rows["stage_0_main"])
    assert "eval_loss/docs" in rows["stage_1_anneal"][-1]
