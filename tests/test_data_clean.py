"""glm5_jax.data.clean through tools.prepare_data: on a corpus with planted byte-exact copies and
near-duplicates (3% of words replaced), every exact copy is counted, the near-duplicates are found
within 10%, at most 1% of distinct documents are removed; each quality filter rejects the document
built to fail it (closed forms) and keeps ordinary text."""

import json

import numpy as np
import pytest

from glm5_jax.data.clean import CleanConfig, CleanConfigError, digest, filter_reason
from tests.test_data_common import small_cache_dir
from tools import prepare_data

N_DISTINCT, N_EXACT, N_NEAR, CHANGED = 400, 40, 40, 0.03


def planted_corpus(rng):
    """(texts in file order, {index: kind}) : distinct pseudo-word documents, then byte-exact copies and
    near-duplicates (CHANGED of the words replaced) of earlier ones, shuffled into the stream after them."""
    vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(3, 10))) for _ in range(5000)]

    def doc(n):
        words = list(rng.choice(vocab, n))
        return "\n".join(" ".join(words[i:i + 12]) for i in range(0, n, 12)), words

    distinct = [doc(int(rng.integers(150, 400))) for _ in range(N_DISTINCT)]
    texts = [t for t, _ in distinct]
    kinds = {}
    for j, src in enumerate(rng.choice(N_DISTINCT, N_EXACT + N_NEAR, replace=False)):
        if j < N_EXACT:
            texts.append(distinct[src][0])
            kinds[len(texts) - 1] = "exact_duplicate"
        else:
            words = list(distinct[src][1])
            for i in rng.choice(len(words), max(1, round(CHANGED * len(words))), replace=False):
                words[i] = str(rng.choice(vocab))
            texts.append("\n".join(" ".join(words[i:i + 12]) for i in range(0, len(words), 12)))
            kinds[len(texts) - 1] = "near_duplicate"
    return texts, kinds


def test_prepare_data_dedup_counts_planted_copies(tmp_path, capsys):
    texts, kinds = planted_corpus(np.random.default_rng(0))
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "prepared"
    rc = prepare_data.main([f"--input={path}", "--tokenizer=spm", "--vocab_size=400", f"--out={out}",
                            f"--cache_dir={small_cache_dir()}", "--dedup=exact,near", "--json", "--workers=1",
                            "--shard_docs=100"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["documents_in"] == len(texts)
    assert s["exact_duplicates"] == N_EXACT                                 # every byte-exact copy
    dropped = [json.loads(ln) for ln in open(out / "dropped.jsonl")]
    index_of = lambda key: int(key.rsplit("#", 1)[1])                       # (relpath#i)
    near_found = sum(kinds.get(index_of(d["key"])) == "near_duplicate" for d in dropped)
    assert abs(near_found - N_NEAR) <= 0.1 * N_NEAR and s["near_duplicates"] <= N_NEAR * 1.1
    distinct_removed = sum(index_of(d["key"]) < N_DISTINCT for d in dropped)
    assert distinct_removed <= 0.01 * N_DISTINCT                             # the first of a cluster is kept
    assert s["documents_out"] == len(texts) - len(dropped) == s["train"]["documents"] + s["eval"]["documents"]
    assert s["tokens_out"] == s["train"]["tokens"] + s["eval"]["tokens"] and s["documents_per_second"] > 0
    assert json.load(open(out / "cleaning.json"))["exact_duplicates"] == N_EXACT


PROSE = " ".join(f"the {w} of a river runs past {n} old stones and quiet fields" for w, n in
                 zip(["water", "light", "sound", "colour", "memory"], ["three", "nine", "twelve", "forty", "many"]))


@pytest.mark.parametrize("name, text", [
    ("length", "too short to keep"),
    ("alpha", " ".join(str(i) for i in range(200))),                          # no word has a letter
    ("dup_lines", PROSE + "\n" + "\n".join(["buy now"] * 10)),               # 10 of 11 lines repeat
    ("top_ngram", " ".join(["click here"] * 60) + " " + PROSE),               # 'click here' covers > 20% of chars
    ("dup_ngram", " ".join([PROSE] * 3)),                                      # the prose three times over
])
def test_each_filter_rejects_what_it_targets_and_keeps_prose(name, text):
    cfg = CleanConfig(filters=("gopher",), min_words=20)
    assert cfg.filters == ("length", "alpha", "dup_lines", "top_ngram", "dup_ngram")
    assert filter_reason(text, cfg) == name
    assert filter_reason(PROSE, cfg) is None


def test_exact_digest_normalises_whitespace_and_compatibility_forms_only():
    assert digest("x  y\n z") == digest(" x y z ") == digest("\uff58 y z")      # full-width x (NFKC)
    assert digest("x y Z") != digest("x y z")


def test_bad_settings_name_the_flag():
    with pytest.raises(CleanConfigError, match="--dedup has 'fuzzy'"):
        CleanConfig(dedup=("fuzzy",))
    with pytest.raises(CleanConfigError, match="--filters has 'perplexity'"):
        CleanConfig(filters=("perplexity",))
    with pytest.raises(CleanConfigError, match="--near_threshold"):
        CleanConfig(near_threshold=1.5)


def test_semantic_dedup_needs_an_embedding_model_and_stages_are_named_once():
    with pytest.raises(CleanConfigError, match="--dedup=semantic needs --embed_model"):
        CleanConfig(dedup=("near", "exact", "semantic"))
    with pytest.raises(CleanConfigError, match="names a stage twice"):
        CleanConfig(dedup=("near", "near"))
    assert CleanConfig(dedup=("near", "exact", "semantic"), embed_model="ckpt").dedup == ("near", "exact", "semantic")
