import json

import numpy as np
import pytest

from glm5_jax.data import BATCH_KEYS, DataConfig, build_lm_data, make_train_iterator
from glm5_jax.data import token_cache as token_cache_mod
from glm5_jax.data import tokenizer as tokenizer_mod

from tests.test_data_common import small_cfg, small_data


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(
        all(np.array_equal(x[k], y[k]) for k in BATCH_KEYS) for x, y in zip(a, b))


def test_batch_shapes_and_dtypes():
    it = small_data().train_iter(batch_size=3, seq_len=64)
    b = next(it)
    assert set(b) == set(BATCH_KEYS)
    for k in BATCH_KEYS:
        assert b[k].dtype == np.int32 and b[k].shape == (3, 64), k
    np.testing.assert_array_equal(b["tokens"][:, 1:], b["targets"][:, :-1])


def test_same_seed_same_batches_different_seed_different_order():
    data = small_data()
    a = _take(data.train_iter(4, 64, seed=1), 5)
    b = _take(make_train_iterator(data, 4, 64, seed=1), 5)
    c = _take(data.train_iter(4, 64, seed=2), 5)
    assert _same(a, b)
    assert not np.array_equal(a[0]["tokens"], c[0]["tokens"])
    # Different order of the same windows: the multiset of first epochs matches.
    it1, it2 = data.train_iter(1, 512, seed=1), data.train_iter(1, 512, seed=2)
    n = it1.epoch_batches
    e1 = sorted(next(it1)["tokens"].tobytes() for _ in range(n))
    e2 = sorted(next(it2)["tokens"].tobytes() for _ in range(n))
    assert e1 == e2


def test_epochs_reshuffle_and_are_infinite():
    data = small_data()
    it = data.train_iter(1, 1024, seed=0)
    n = it.epoch_batches
    ep1 = [next(it)["tokens"].tobytes() for _ in range(n)]
    ep2 = [next(it)["tokens"].tobytes() for _ in range(n)]
    assert sorted(ep1) == sorted(ep2) and ep1 != ep2


def test_iterator_state_round_trip_json():
    data = small_data()
    it = data.train_iter(4, 64, seed=3)
    _take(it, 7)
    state = json.loads(json.dumps(it.get_state()))
    more = _take(it, 5)
    fresh = data.train_iter(4, 64, seed=3)
    fresh.set_state(state)
    assert _same(_take(fresh, 5), more)
    # A state from a different pipeline is rejected with a clear message.
    other = data.train_iter(4, 64, seed=4)
    with pytest.raises(ValueError, match="fingerprint"):
        other.set_state(state)


def test_iterator_state_round_trip_with_retrieval_mix():
    data = small_data(retrieval_fraction=0.25)
    it = data.train_iter(4, 128, seed=5)
    _take(it, 3)
    state = it.get_state()
    more = _take(it, 6)
    fresh = data.train_iter(4, 128, seed=5)
    fresh.set_state(json.loads(json.dumps(state)))
    assert _same(_take(fresh, 6), more)


def test_eval_batches_finite_deterministic_padded():
    data = small_data()
    a = list(data.eval_batches(4, 64))
    b = list(data.eval_batches(4, 64))
    assert _same(a, b)
    n_win = data.eval_stream.num_windows(64)
    assert len(a) == -(-n_win // 4)
    real = sum(int((x["segment_ids"].max(-1) > 0).sum()) for x in a)
    assert real == n_win
    assert sum(x["loss_mask"].sum() for x in a) > 0
    assert len(list(data.eval_batches(4, 64, max_batches=2))) == 2
    for x in a:
        pad = x["segment_ids"] == 0
        assert (x["loss_mask"][pad] == 0).all()


def test_cache_is_reused_without_tokenizing(monkeypatch, tmp_path):
    cache = str(tmp_path / "cache")
    cfg = small_cfg(cache_dir=cache, max_files=8)
    calls = {"encode": 0, "train": 0}
    real_encode = tokenizer_mod.SentencePieceTokenizer.encode_batch
    real_train = tokenizer_mod._train_spm

    def counting_encode(self, texts):
        calls["encode"] += 1
        return real_encode(self, texts)

    def counting_train(*a, **k):
        calls["train"] += 1
        return real_train(*a, **k)

    monkeypatch.setattr(tokenizer_mod.SentencePieceTokenizer, "encode_batch", counting_encode)
    monkeypatch.setattr(tokenizer_mod, "_train_spm", counting_train)
    first = build_lm_data(cfg)
    assert calls["train"] == 1 and calls["encode"] >= 1
    calls.update(encode=0, train=0)
    second = build_lm_data(cfg)
    assert calls == {"encode": 0, "train": 0}
    assert first.token_cache_dir == second.token_cache_dir
    assert second.token_cache_dir.startswith(cache)
    for s in ("train", "eval"):
        np.testing.assert_array_equal(first.splits[s].tokens, second.splits[s].tokens)
        np.testing.assert_array_equal(first.splits[s].offsets, second.splits[s].offsets)
    # Different tokenizer settings -> different cache entries.
    third = build_lm_data(small_cfg(cache_dir=cache, max_files=8, vocab_size=400))
    assert third.token_cache_dir != first.token_cache_dir and calls["train"] == 1
    assert token_cache_mod.SPLITS == ("train", "eval")


def test_corpus_split_and_caps():
    data = small_data()
    c = data.corpus
    rel = [f.relpath for f in c.files]
    assert len(rel) == 30 and len(set(rel)) == 30 and c.num_docs == (1,) * 30   # one document per .py file
    from glm5_jax.data import load_corpus
    from glm5_jax.data.corpus import key_hash_fraction
    again = load_corpus(small_cfg())
    assert again == c  # deterministic
    assert all(not any(p in ("test", "tests", "idle_test", "site-packages")
                       for p in r.split("/")[:-1]) for r in rel)
    assert rel == sorted(rel)
    # the held-out documents are those whose key hash is below eval_fraction (or the smallest one)
    fr = {r: key_hash_fraction(r) for r in rel}
    ev = [f.relpath for f, e in zip(c.files, c.eval_docs) if e]
    expect = [r for r in rel if fr[r] < small_cfg().eval_fraction] or [min(rel, key=fr.get)]
    assert ev == expect and c.num_documents("eval") == len(ev) == data.splits["eval"].num_docs
    assert [d.key for _, d in c.documents("eval")] == ev
    capped = load_corpus(small_cfg(max_files=None, max_bytes=100_000))
    sizes = [f.size for f in capped.files]
    assert sum(sizes) < 100_000 + max(sizes)


@pytest.mark.parametrize("field,value", [
    ("vocab_size", 100), ("vocab_size", 2.5), ("seq_len", 1), ("max_files", 1),
    ("max_bytes", 0), ("eval_fraction", 0.0), ("eval_fraction", 0.7), ("seed", -1),
    ("retrieval_fraction", 1.0), ("retrieval_pairs", 0), ("retrieval_min_distance", -3),
    ("retrieval_value_digits", 9), ("tokenizer_train_bytes", 5), ("stdlib_root", "/nonexistent"),
    ("exclude_dirs", ["test"]), ("cache_dir", ""),
])
def test_bad_config_names_field(field, value):
    with pytest.raises(ValueError) as e:
        DataConfig(**{field: value})
    msg = str(e.value)      # the one form (glm5_jax.fields): field, value, then what is allowed
    head, _, rule = msg.partition(" is invalid: ")
    assert head == f"DataConfig.{field}={value!r}" and rule, msg


def test_bad_iterator_args():
    data = small_data()
    with pytest.raises(ValueError, match="batch_size"):
        data.train_iter(0)
    with pytest.raises(ValueError, match="seq_len"):
        data.train_iter(2, seq_len=1)


def test_process_rows_partition_the_global_stream_and_state_is_portable():
    """Two 'processes' reading rows (0, 1) and (2, 3) of each global batch together read exactly the
    batches one full iterator reads (retrieval items included: they depend on the global element index);
    a state saved by one of them resumes a full iterator (and a different split) at the same global batch."""
    data = small_data(retrieval_fraction=0.25)
    full = _take(data.train_iter(4, 128, seed=2), 6)
    parts = []
    for rows in ((0, 1), (2, 3)):
        it = data.train_iter(4, 128, seed=2)
        it.select_rows(rows)
        parts.append(_take(it, 3))
        state = it.get_state()
        it.select_rows([1, 3])          # re-targeting keeps the position
        parts[-1] += _take(it, 3)
    for i, b in enumerate(full):
        lo, hi = parts[0][i], parts[1][i]
        for k in BATCH_KEYS:
            if i < 3:
                np.testing.assert_array_equal(np.concatenate([lo[k], hi[k]]), b[k])
            else:
                np.testing.assert_array_equal(lo[k], b[k][[1, 3]])
                np.testing.assert_array_equal(hi[k], b[k][[1, 3]])
    resumed = data.train_iter(4, 128, seed=2)
    resumed.set_state(json.loads(json.dumps(state)))
    assert _same(_take(resumed, 3), full[3:])
    with pytest.raises(ValueError, match="rows="):
        resumed.select_rows([2, 1])
    with pytest.raises(ValueError, match="rows="):
        resumed.select_rows([4])
