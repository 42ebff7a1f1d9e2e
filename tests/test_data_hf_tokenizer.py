"""The tokenizer contract on both back ends: a tokenizer.json trained here with `tokenizers`, and
load_tokenizer's format detection and errors."""

import functools
import glob
import os
import sysconfig

import pytest

from glm5_jax.data import GLM_SPECIAL_TOKENS, HFTokenizer, SentencePieceTokenizer, load_tokenizer, train_hf_tokenizer
from tests.test_data_common import small_cache_dir


def _stdlib_texts(n=25):
    root = sysconfig.get_paths()["stdlib"]
    return [open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(root, "*.py")))[:n]]


@functools.lru_cache(maxsize=None)
def hf_tok() -> HFTokenizer:
    return train_hf_tokenizer(_stdlib_texts(), 600, os.path.join(small_cache_dir(), "hf_tok"))


def test_hf_specials_by_name_in_order():
    tok = hf_tok()
    ids = [tok.special_id(n) for n in GLM_SPECIAL_TOKENS]
    assert ids == list(range(len(GLM_SPECIAL_TOKENS)))  # trainer puts them first, in the given order
    assert tok.eos_id == tok.special_id("<|endoftext|>") and tok.pad_id == tok.eos_id
    assert tok.vocab_size == 600
    with pytest.raises(KeyError, match="<nope>"):
        tok.special_id("<nope>")


def test_hf_round_trip_and_specials_not_parsed():
    tok = hf_tok()
    for text in _stdlib_texts(30)[25:] + ["\tx = 'é€😀'  \n\n\n   return  1234567890\r\n  trailing   "]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    specials = {tok.special_id(n) for n in GLM_SPECIAL_TOKENS}
    text = "<|user|>hi<think>x</think><|endoftext|>"
    enc = tok.encode(text)
    assert not set(enc) & specials and tok.decode(enc) == text
    assert tok.decode([tok.special_id("<|user|>")] + tok.encode("hi") + [tok.eos_id]) == "<|user|>hi<|endoftext|>"
    digits = tok.digit_ids()
    assert tok.encode("9081726354") == [digits[int(c)] for c in "9081726354"]
    assert tok.encode_batch(["ab", "c d"]) == [tok.encode("ab"), tok.encode("c d")]


def test_load_tokenizer_detects_format(tmp_path):
    tok = hf_tok()
    for p in (tok.model_path, os.path.dirname(tok.model_path)):
        t = load_tokenizer(p)
        assert isinstance(t, HFTokenizer) and t.fingerprint == tok.fingerprint
    from tests.test_data_common import small_data
    spm_path = small_data().tokenizer.model_path
    assert isinstance(load_tokenizer(spm_path), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(os.path.dirname(spm_path)), SentencePieceTokenizer)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_tokenizer(str(tmp_path / "does-not-exist.json"))
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a readable Hugging Face tokenizer.json"):
        load_tokenizer(str(bad))
    bad_spm = tmp_path / "x.model"
    bad_spm.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable sentencepiece model"):
        load_tokenizer(str(bad_spm))
    other = tmp_path / "vocab.txt"
    other.write_text("a")
    with pytest.raises(ValueError, match="unknown format"):
        load_tokenizer(str(other))
    with pytest.raises(ValueError, match="vocab_size"):
        train_hf_tokenizer(["abc"], 100, str(tmp_path / "small.json"))


def test_encode_rendered_matches_control_tokens_that_encode_keeps_as_text():
    """encode never turns "<|user|>" into the special id (user text cannot forge one); encode_rendered, for
    a checkpoint's own rendered chat template, does, and encodes the rest exactly as encode."""
    tok = hf_tok()
    text = "def f():<|user|>\n    return 1<think>"
    assert tok.special_id("<|user|>") not in tok.encode(text)
    ids = tok.encode_rendered(text)
    assert ids == (tok.encode("def f():") + [tok.special_id("<|user|>")] + tok.encode("\n    return 1")
                   + [tok.special_id("<think>")])
    assert set(GLM_SPECIAL_TOKENS) <= set(tok.added_tokens())
