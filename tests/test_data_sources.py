"""Bring-your-own-data: text / jsonl(.gz) / parquet / ArrayRecord files through one pipeline, with a
tokenizer.json or sentencepiece tokenizer; every bad input gives one error naming the file and problem.

The reference for every tokenized document is the source text itself: decode(tokens) == text."""

import functools
import gzip
import json

import numpy as np
import pytest

from glm5_jax.config import ConfigError
from glm5_jax.data import DataConfig, DataError, build_lm_data, load_corpus
from glm5_jax.data.sources import DOC_CHUNK_BYTES, count_documents, iter_documents, resolve_files
from glm5_jax.data.stdlib_text import stdlib_docs
from glm5_jax.data.token_cache import load_tokens, token_dtype, write_tokens
from glm5_jax.data.tokenizer_base import Tokenizer
from tests.test_data_common import small_cache_dir


@functools.lru_cache(maxsize=None)
def docs():
    """Real text nobody here wrote: docstrings of the first stdlib modules."""
    return tuple(d["text"] for d in stdlib_docs(max_files=60))


def _write_jsonl(path, records, gz=False):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return str(path)


def _cfg(path, **kw):
    base = dict(path=str(path), vocab_size=600, seq_len=64, tokenizer="hf", eval_fraction=0.2,
                cache_dir=small_cache_dir(), tokenizer_train_bytes=200_000)
    return DataConfig(**{**base, **kw})


def _decoded_docs(data, split):
    s = data.splits[split]
    return [data.tokenizer.decode(s.doc(d)) for d in range(s.num_docs)]


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "array_record", "txt"])
def test_every_format_round_trips_documents_and_splits_them(tmp_path, fmt):
    texts = list(docs()[:30])
    if fmt.startswith("jsonl"):
        # blank lines are skipped; other fields are ignored
        records = [{"text": t, "id": i} for i, t in enumerate(texts)]
        path = _write_jsonl(tmp_path / f"d.{fmt}", records, gz=fmt.endswith("gz"))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        path = str(tmp_path / "d.parquet")
        pq.write_table(pa.table({"text": texts, "n": list(range(len(texts)))}), path, row_group_size=7)
    elif fmt == "array_record":
        from array_record.python.array_record_module import ArrayRecordWriter
        path = str(tmp_path / "d.array_record")
        w = ArrayRecordWriter(path, "group_size:1")
        for i, t in enumerate(texts):   # JSON records and plain-text records both work
            w.write((json.dumps({"text": t}) if i % 2 else t).encode())
        w.close()
    else:
        for i, t in enumerate(texts):
            (tmp_path / f"doc{i:02d}.txt").write_text(t, encoding="utf-8")
        path = str(tmp_path / "*.txt")
    data = build_lm_data(_cfg(path))
    got = _decoded_docs(data, "train") + _decoded_docs(data, "eval")
    assert sorted(got) == sorted(texts)                 # every document once, exactly
    assert 1 <= len(_decoded_docs(data, "eval")) < len(texts)
    assert not set(_decoded_docs(data, "eval")) & set(_decoded_docs(data, "train"))
    keys = [d.key for _, d in data.corpus.documents("eval")]
    assert len(keys) == data.splits["eval"].num_docs


def test_paths_globs_lists_and_directories(tmp_path):
    (tmp_path / "a").mkdir()
    _write_jsonl(tmp_path / "a" / "x.jsonl", [{"text": "one"}, {"text": "two"}])
    b = _write_jsonl(tmp_path / "b.jsonl.gz", [{"text": "three"}], gz=True)
    (tmp_path / "a" / "notes.bin").write_bytes(b"\0")           # unknown extension: skipped in a directory walk
    root, files = resolve_files(f"{tmp_path}/a/*.jsonl, {b}")
    assert root == str(tmp_path) and [f.relpath for f in files] == ["a/x.jsonl", "b.jsonl.gz"]
    assert [f.relpath for f in resolve_files(str(tmp_path))[1]] == ["a/x.jsonl", "b.jsonl.gz"]
    assert [count_documents(f) for f in files] == [2, 1]
    assert [d.key for d in iter_documents(files[0])] == ["a/x.jsonl#0", "a/x.jsonl#1"]
    with pytest.raises(DataError, match="matches no file"):
        resolve_files(f"{tmp_path}/*.parquet")
    with pytest.raises(DataError, match="unknown format"):
        resolve_files(str(tmp_path / "a" / "notes.bin"))


def test_large_text_file_is_cut_at_lines_into_documents(tmp_path):
    line = "a line of a long book, " * 3 + "\n"
    text = line * (2 * DOC_CHUNK_BYTES // len(line) + 5)
    p = tmp_path / "book.txt"
    p.write_text(text)
    f = resolve_files(str(p))[1][0]
    chunks = [d.text for d in iter_documents(f)]
    assert count_documents(f) == len(chunks) == 3 and "".join(chunks) == text
    assert all(len(c.encode()) <= DOC_CHUNK_BYTES and c.endswith("\n") for c in chunks)


def test_chat_messages_are_rendered_by_the_chat_template(tmp_path):
    msgs = [[{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": f"It is {2 * i}."}]
            for i in range(12)]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in msgs] + [{"text": t} for t in docs()[:20]])
    data = build_lm_data(_cfg(path, eval_fraction=0.1))
    from glm5_jax.data.chat import ChatTemplate
    tpl = ChatTemplate(data.tokenizer)
    expect = [tpl.render(m).ids for m in msgs] + [data.tokenizer.encode(t) for t in docs()[:20]]
    got = [data.splits[s].doc(d).tolist() for s, d in _doc_order(data)]
    assert got == expect


def _doc_order(data):
    """(split, index in split) of each corpus document, in corpus order."""
    seen = {"train": 0, "eval": 0}
    out = []
    for s, _ in data.corpus.documents():
        out.append((s, seen[s]))
        seen[s] += 1
    return out


class _WideTokenizer(Tokenizer):
    """A character tokenizer with GLM-5's vocabulary size: ids above 2**16 exercise the uint32 storage."""
    kind = "test"

    def __init__(self, path):
        super().__init__(path)
        self.eos_id, self.pad_id, self.unk_id = 0, 0, None

    @property
    def vocab_size(self):
        return 154880

    def encode(self, text):
        return [100_000 + (ord(c) % 50_000) for c in text]


def test_ids_above_uint16_are_stored_exactly(tmp_path):
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs()[:6]])
    tok_file = tmp_path / "fake.model"
    tok_file.write_bytes(b"x")
    tok = _WideTokenizer(str(tok_file))
    corpus = load_corpus(_cfg(path))
    out = tmp_path / "out"
    out.mkdir()
    index = write_tokens(tok, corpus, str(out), quiet=True)
    splits, _ = load_tokens(str(out))
    assert index["dtype"] == "uint32" and splits["train"].tokens.dtype == np.uint32
    expect = {"train": [], "eval": []}
    nbytes = {"train": 0, "eval": 0}
    for s, d in corpus.documents():
        expect[s].append(tok.encode(d.text))
        nbytes[s] += len(d.text.encode())
    for s in ("train", "eval"):
        got = [splits[s].doc(i).tolist() for i in range(splits[s].num_docs)]
        assert got == expect[s]
        assert index[s]["bytes_per_token"] == pytest.approx(nbytes[s] / sum(map(len, expect[s])), rel=1e-3)


# ----------------------------------------------------------------------------- one clear error each
def test_missing_field_names_file_line_and_fields(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"body": "no text here", "id": 3}])
    with pytest.raises(DataError, match=r"line 2 has no 'text' field .*fields present: \['body', 'id'\]"):
        build_lm_data(_cfg(path))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x", "y"]}), str(tmp_path / "d.parquet"))
    with pytest.raises(DataError, match=r"no 'text' column .*columns: \['body'\]"):
        build_lm_data(_cfg(tmp_path / "d.parquet"))


def test_empty_and_malformed_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="empty.jsonl' is empty"):
        build_lm_data(_cfg(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        build_lm_data(_cfg(tmp_path / "bad.jsonl"))
    (tmp_path / "wrong.jsonl").write_text('{"text": 5}\n{"text": "b"}\n')
    with pytest.raises(DataError, match="'text' is a int; it must be a string"):
        build_lm_data(_cfg(tmp_path / "wrong.jsonl"))
    with pytest.raises(DataError, match="does not exist"):
        build_lm_data(_cfg(tmp_path / "missing.jsonl"))


def test_wrong_tokenizer_path_and_too_large_vocab(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs()[:10]])
    with pytest.raises(DataError, match=r"DataConfig.tokenizer='/nonexistent/tokenizer.json'.*does not exist"):
        build_lm_data(_cfg(path, tokenizer="/nonexistent/tokenizer.json"))
    big = build_lm_data(_cfg(path, vocab_size=700)).tokenizer     # a tokenizer.json trained here, vocab 700
    assert big.vocab_size == 700
    with pytest.raises(ConfigError, match=r"vocab_size 700 > DataConfig.vocab_size=600 .*data.vocab_size=700"):
        build_lm_data(_cfg(path, tokenizer=big.model_path, vocab_size=600))
    assert isinstance(DataError("x"), ConfigError)      # experiments.run reports it as one line, exit 2
