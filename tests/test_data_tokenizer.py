import os

from glm5_jax.data.tokenizer import EOS_PIECE, GLM_SPECIAL_TOKENS

from tests.test_data_common import small_data


def test_round_trip_real_stdlib_sources():
    data = small_data()
    tok = data.tokenizer
    # held-out documents and a few train ones
    files_text = [d.text for _, d in data.corpus.documents("eval")]
    files_text += [d.text for _, d in data.corpus.documents("train")][:3]
    # Include a file outside the (capped) corpus too: unseen text must still round trip.
    with open(os.path.join(data.corpus.root, "textwrap.py"), encoding="utf-8") as fh:
        files_text.append(fh.read())
    for text in files_text:
        assert "\n    " in text  # real indentation is exercised
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    tricky = "\tx = 'é€😀'  \n\n\n        return  1234567890\r\n  trailing   "
    assert tok.decode(tok.encode(tricky)) == tricky
    assert tok.unk_id not in tok.encode(tricky)  # byte fallback instead of <unk>


def test_special_ids_and_layout():
    tok = small_data().tokenizer
    assert tok.vocab_size == 512
    assert tok.pad_id == 0 and tok.eos_id == 2
    assert tok.special_id(EOS_PIECE) == tok.eos_id
    assert GLM_SPECIAL_TOKENS[0] == EOS_PIECE and len(GLM_SPECIAL_TOKENS) == 22
    ids = [tok.special_id(n) for n in GLM_SPECIAL_TOKENS]
    assert ids == [2] + list(range(3, 3 + len(GLM_SPECIAL_TOKENS) - 1))
    # Special-token text is NOT parsed (templates insert ids explicitly) and still round trips.
    text = "<|user|>hi<|assistant|>"
    enc = tok.encode(text)
    assert not set(enc) & set(ids) and tok.decode(enc) == text
    # decode renders special ids by name
    assert tok.decode([tok.special_id("<|user|>")] + tok.encode("hi") + [tok.eos_id]) == "<|user|>hi<|endoftext|>"
    # Digits are always single tokens (retrieval relies on it).
    digits = tok.digit_ids()
    assert tok.encode("9081726354") == [digits[int(c)] for c in "9081726354"]
    # Indentation runs are learned pieces rather than one token per space.
    assert len(tok.encode("        ")) < 8
    try:
        tok.special_id("<nope>")
        raise AssertionError("expected KeyError")
    except KeyError as e:
        assert "<nope>" in str(e) and "<|user|>" in str(e)
