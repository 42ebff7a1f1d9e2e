"""tools.prepare_data: tokenize once into a directory that training memory-maps, with a summary."""

import json
import os

import numpy as np
import pytest

from glm5_jax.data import DataConfig, DataError, build_lm_data
from glm5_jax.data.stdlib_text import write_stdlib_docs
from tests.test_data_common import small_cache_dir
from tools import prepare_data


@pytest.fixture(scope="module")
def docs_parquet(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("docs") / "docs.parquet")
    write_stdlib_docs(path, max_files=60)
    return path


def test_prepare_then_train_from_the_directory(tmp_path, docs_parquet, capsys):
    out = str(tmp_path / "prepared")
    rc = prepare_data.main([f"--input={docs_parquet}", "--tokenizer=spm", "--vocab_size=500", f"--out={out}",
                            f"--cache_dir={small_cache_dir()}", "--eval_fraction=0.1", "--json", "--workers=1",
                            "--shard_docs=7"])
    assert rc == 0
    cap = capsys.readouterr()
    index = json.loads(cap.out.strip().splitlines()[-1])
    assert index["dtype"] == "uint16" and os.path.isfile(os.path.join(out, index["tokenizer_file"]))
    assert len(index["shards"]) > 3
    assert "prepare_data: tokenize" not in cap.err           # --json: no progress, stdout is the JSON
    # without --json: per-stage progress on stderr with documents and shards done, rate and ETA (issue 67)
    assert prepare_data.main([f"--input={docs_parquet}", "--tokenizer=spm", "--vocab_size=500",
                              f"--out={tmp_path / 'again'}", f"--cache_dir={small_cache_dir()}",
                              "--eval_fraction=0.1", "--workers=1", "--shard_docs=7"]) == 0
    err = capsys.readouterr().err
    n = len(index["shards"])
    assert "prepare_data: tokenize: 100%" in err and f"{n}/{n} shards" in err and "doc/s" in err, err[-2000:]
    assert "<" in err                                        # tqdm's elapsed<remaining: the ETA
    # the same corpus and tokenizer through the training pipeline's own cache gives the same tokens (the
    # shards read back to back in shard order are the corpus in order)
    raw = build_lm_data(DataConfig(path=docs_parquet, tokenizer="spm", vocab_size=500, eval_fraction=0.1,
                                   cache_dir=small_cache_dir()))
    prepared = build_lm_data(DataConfig(path=out, vocab_size=512))
    assert prepared.corpus is None and prepared.tokenizer.fingerprint == raw.tokenizer.fingerprint
    for s in ("train", "eval"):
        np.testing.assert_array_equal(prepared.splits[s].tokens, raw.splits[s].tokens)
        np.testing.assert_array_equal(prepared.splits[s].offsets, raw.splits[s].offsets)
        assert index[s]["documents"] == raw.splits[s].num_docs and index[s]["tokens"] == raw.splits[s].num_tokens
        assert index[s]["bytes_per_token"] > 1.0
    assert index["train"]["documents"] + index["eval"]["documents"] == raw.corpus.num_documents()
    b = next(prepared.train_iter(2, 32))
    assert b["tokens"].shape == (2, 32)
    # the prepared directory's tokenizer, named explicitly, is accepted; another one is refused
    assert build_lm_data(DataConfig(path=out, vocab_size=512,
                                    tokenizer=os.path.join(out, index["tokenizer_file"]))).splits
    with pytest.raises(DataError, match="not the tokenizer"):
        other = build_lm_data(DataConfig(path=docs_parquet, tokenizer="hf", vocab_size=500, eval_fraction=0.1,
                                         cache_dir=small_cache_dir(), tokenizer_train_bytes=100_000)).tokenizer
        build_lm_data(DataConfig(path=out, vocab_size=512, tokenizer=other.model_path))


@pytest.mark.parametrize("args,msg", [
    (["--input={tmp}/nothing*.jsonl", "--tokenizer=spm"], "matches no file"),
    (["--input={docs}", "--tokenizer={tmp}/missing/tokenizer.json"], "does not exist"),
    (["--input={docs}", "--tokenizer={tmp}/x.model"], "not a readable sentencepiece model"),
    (["--input={docs}", "--tokenizer=spm", "--text_field=body"], "no 'body' column"),
    (["--input={docs}", "--tokenizer=spm", "--dedup=near,semantic"], "needs --embed_model"),
    (["--input={docs}", "--tokenizer=spm", "--workers=0"], "--workers=0"),
    (["--input={docs}", "--tokenizer=spm", "--dedup=semantic", "--embed_model={tmp}"], "is not a checkpoint"),
])
def test_bad_input_is_one_error_line(tmp_path, docs_parquet, capsys, args, msg):
    (tmp_path / "x.model").write_bytes(b"not a model")
    argv = [a.format(tmp=tmp_path, docs=docs_parquet) for a in args] + [f"--out={tmp_path}/out",
                                                                        f"--cache_dir={small_cache_dir()}", "--workers=1"]
    assert prepare_data.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and msg in err[0]
