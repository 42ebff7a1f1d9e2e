"""The three dedup stages of tools.prepare_data in GLM-5's order (--dedup=near,exact,semantic) on a corpus
with planted duplicates of three kinds, each built so that only its own stage can catch it:
* near copies: 3% of the words replaced (MinHash Jaccard ~0.89 >= 0.8: the near stage);
* width variants: a copy with every other word in full-width letters (NFKC maps them back, so the exact
  stage's normalised digest matches; MinHash's word shingles differ: Jaccard ~0.1);
* paraphrases: the lines reordered and 25% of the words replaced (Jaccard ~0.4, another digest): only
  the semantic stage (SemDeDup on a tiny model's mean-pooled trunk states) can catch them.
Each stage removes its own kind and nothing distinct; dropped.jsonl names the original each duplicates."""

import json
import os
import shutil

import numpy as np
import pytest

from tests.test_data_common import small_cache_dir
from tools import prepare_data

N_DISTINCT, N_EACH = 60, 6
FULL_WIDTH = {c: chr(0xFF41 + i) for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}


def planted(rng):
    """(texts, {index: (kind, index of the original)})."""
    vocab = ["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(3, 9))) for _ in range(400)]

    def lines(words):
        return ["".join(" ".join(words[i:i + 12])) for i in range(0, len(words), 12)]

    distinct = [list(rng.choice(vocab, int(rng.integers(80, 140)))) for _ in range(N_DISTINCT)]
    texts = ["\n".join(lines(w)) for w in distinct]
    kinds = {}
    sources = rng.choice(N_DISTINCT, 3 * N_EACH, replace=False)
    for j, src in enumerate(sources):
        words = list(distinct[src])
        if j < N_EACH:
            kind = "near_duplicate"
            for i in rng.choice(len(words), max(1, round(0.03 * len(words))), replace=False):
                words[i] = str(rng.choice(vocab))
            text = "\n".join(lines(words))
        elif j < 2 * N_EACH:
            kind = "exact_duplicate"
            words = ["".join(FULL_WIDTH[c] for c in w) if i % 2 else w for i, w in enumerate(words)]
            text = "\n".join(lines(words))
        else:
            kind = "semantic_duplicate"
            for i in rng.choice(len(words), round(0.25 * len(words)), replace=False):
                words[i] = str(rng.choice(vocab))
            ls = lines(words)
            text = "\n".join(ls[k] for k in rng.permutation(len(ls)))
        texts.append(text)
        kinds[len(texts) - 1] = (kind, int(src))
    return texts, kinds


def write_embedder(path, tokenizer_file, vocab_size):
    """A tiny GLM-5 (2 layers, d_model 256, seed 0) saved as a Hugging Face folder with its tokenizer beside
    it. Its token embeddings are scaled x16: a trained trunk's states carry its tokens' identity, while a
    random-init trunk's blocks scramble it (measured on this corpus at x1: distinct pairs up to cosine 0.59,
    paraphrases from -0.09); at x16 the blocks perturb the embeddings instead (distinct <= 0.39, paraphrases
    >= 0.64: the test's threshold 0.5 lies between)."""
    import jax

    from glm5_jax.config import ModelConfig
    from glm5_jax.hf import save_checkpoint
    from glm5_jax.model import init_params
    cfg = ModelConfig(vocab_size=vocab_size, d_model=256, num_layers=2, mtp_depth=0)
    params = init_params(cfg, jax.random.PRNGKey(0))
    params = {**params, "embed": {"embedding": params["embed"]["embedding"] * 16.0}}
    save_checkpoint(cfg, params, path, dtype=None)
    shutil.copyfile(tokenizer_file, os.path.join(path, "tokenizer.model"))
    return path


def planted_dir(d, seed: int, vocab_size: int):
    """(jsonl path, kinds, tokenizer file, embedding checkpoint) of planted(seed) written into folder d: the
    tokenizer is trained on the corpus by a plain prepare_data run (vocab 1024: the pseudo-words are single
    pieces)."""
    texts, kinds = planted(np.random.default_rng(seed))
    path = d / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = d / "plain"
    assert prepare_data.main([f"--input={path}", "--tokenizer=spm", f"--vocab_size={vocab_size}", f"--out={out}",
                              f"--cache_dir={small_cache_dir()}", "--workers=1"]) == 0
    tok = str(out / json.load(open(out / "index.json"))["tokenizer_file"])
    return str(path), kinds, tok, write_embedder(str(d / "embedder"), tok, vocab_size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return planted_dir(tmp_path_factory.mktemp("planted"), 0, 1024)


def test_each_dedup_stage_removes_its_own_kind_in_glm5_order(corpus, tmp_path, capsys):
    path, kinds, tok, embedder = corpus
    out = tmp_path / "prep"
    rc = prepare_data.main([f"--input={path}", f"--tokenizer={tok}", f"--out={out}", "--workers=1",
                            "--shard_docs=20", "--dedup=near,exact,semantic", f"--embed_model={embedder}",
                            "--semantic_threshold=0.5", "--semantic_clusters=3", "--embed_max_tokens=1024",
                            "--json"])
    assert rc == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    dropped = [json.loads(line) for line in open(out / "dropped.jsonl")]
    index_of = lambda key: int(key.rsplit("#", 1)[1])
    found = {index_of(d["key"]): (d["reason"], index_of(d["duplicate_of"])) for d in dropped}
    assert found == kinds                          # each planted copy by its own stage, as a copy of its original
    assert (s["near_duplicates"], s["exact_duplicates"], s["semantic_duplicates"]) == (N_EACH, N_EACH, N_EACH)
    assert s["documents_out"] == N_DISTINCT == s["train"]["documents"] + s["eval"]["documents"]
    assert len(s["shards"]) == -(-(N_DISTINCT + 3 * N_EACH) // 20)


def test_embeddings_are_the_same_from_an_orbax_params_checkpoint(corpus, tmp_path):
    """--embed_model reads whatever --init_from reads: the HF folder and the same weights saved as an orbax
    params checkpoint (tools.convert_hf's layout, tokenizer beside it) embed the documents alike."""
    from glm5_jax.data.clean import CleanConfig
    from glm5_jax.data.prep.semantic import embed_texts
    from glm5_jax.train.checkpoint import checkpoint_config, load_params, save_params
    path, _, _, embedder = corpus
    texts = [json.loads(line)["text"] for line in open(path)][:6]
    orbax = str(tmp_path / "orbax")
    save_params(orbax, checkpoint_config(embedder), load_params(embedder, checkpoint_config(embedder)))
    shutil.copyfile(os.path.join(embedder, "tokenizer.model"), os.path.join(orbax, "tokenizer.model"))
    got = [embed_texts(texts, CleanConfig(dedup=("semantic",), embed_model=p)) for p in (embedder, orbax)]
    assert got[0].shape == (6, 256)
    np.testing.assert_allclose(got[0], got[1], rtol=1e-6, atol=1e-6)
