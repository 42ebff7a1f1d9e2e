"""Incremental detokenisation (glm5_jax.serve.detok.TextStream) against the full decode, for both tokenizer
kinds the engine serves (a byte-level BPE tokenizer.json and a sentencepiece model with byte fallback),
on real text (the standard library's own source, plus multi-byte characters split over byte tokens):
the concatenated deltas equal tokenizer.decode(all ids); a stop string cuts the text exactly where the
full text first holds it, and nothing past it is ever released."""

import inspect
import json

import pytest
import sentencepiece as spm

from glm5_jax.data.hf_tokenizer import train_hf_tokenizer
from glm5_jax.data.tokenizer import load_tokenizer
from glm5_jax.serve.detok import TextStream

TEXT = inspect.getsource(json) + "\nnaïve café — ✓ 日本語のテキスト; emoji 🙂 done.\n"


@pytest.fixture(scope="module", params=["hf", "sentencepiece"])
def tokenizer(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    lines = [line for line in TEXT.splitlines() if line.strip()]
    if request.param == "hf":
        return train_hf_tokenizer(lines, 400, str(d / "tokenizer.json"))
    with open(d / "corpus.txt", "w") as f:
        f.write("\n".join(lines))
    spm.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "spm"), vocab_size=400,
                                   byte_fallback=True, character_coverage=0.99, user_defined_symbols=["<|endoftext|>"],
                                   minloglevel=2)
    return load_tokenizer(str(d / "spm.model"))


def _stream(tok, ids, stop=()):
    s = TextStream(tok, stop)
    out, hit = [], False
    for t in ids:
        d, hit = s.push(t)
        out.append(d)
        if hit:
            break
    if not hit:
        out.append(s.flush())
    return "".join(out), hit, s


def test_concatenated_deltas_equal_the_full_decode(tokenizer):
    text = TEXT[:3000] + TEXT[-80:]
    ids = tokenizer.encode(text)
    got, hit, s = _stream(tokenizer, ids)
    assert not hit
    assert got == tokenizer.decode(ids)
    assert s.text == got
    assert s.prefix >= len(ids) - 8      # the window advanced: each push decoded a few tokens, not the whole text


def test_stop_string_cuts_where_the_full_text_first_holds_it(tokenizer):
    ids = tokenizer.encode(TEXT[:2000])
    full = tokenizer.decode(ids)
    stops = [st for st in ("def ", "import", "\n\n") if st in full]     # sentencepiece normalises newlines away
    assert len(stops) >= 2
    for stop in stops:
        got, hit, _ = _stream(tokenizer, ids, (stop, "never-there-xyz"))
        assert hit
        assert got == full[:full.find(stop)], stop


def test_multibyte_characters_never_release_a_replacement_char(tokenizer):
    ids = tokenizer.encode("日本語のテキスト 🙂 café")
    s = TextStream(tokenizer)
    for t in ids:
        d, _ = s.push(t)
        assert "\ufffd" not in d
    s.flush()
    assert s.text == tokenizer.decode(ids)

