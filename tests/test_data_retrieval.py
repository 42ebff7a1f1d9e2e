import numpy as np
import pytest

from glm5_jax.data import retrieval_accuracy
from glm5_jax.data.retrieval import EVAL_TAG, KEY_LETTERS, key_token_ids

from tests.test_data_common import small_data

T = 160


def _records(task, window):
    """(start, key index, value ids) of every key token in the window, read back from the tokens alone."""
    keys = {int(k): j for j, k in enumerate(task.key_ids)}
    return [(s, keys[int(t)], window[s + 1:s + task.record_len].tolist())
            for s, t in enumerate(window) if int(t) in keys]


def test_key_tokens_are_single_letters_never_produced_by_text_and_not_digits():
    data = small_data()
    tok = data.tokenizer
    ids = key_token_ids(tok)
    assert len(ids) == len(set(ids)) == 52 and not set(ids) & set(tok.digit_ids())
    assert tok.decode(ids) == KEY_LETTERS
    # sentencepiece byte pieces: encoding text never yields them, so filler cannot contain a key
    stream = data.train_stream.stream
    assert not np.isin(stream, ids).any()
    assert not set(tok.encode("A key, a value: Zz 42")) & set(ids)


def test_layout_queries_far_from_records_and_answer_recoverable():
    data = small_data(retrieval_pairs=8, retrieval_key_digits=2, retrieval_value_digits=2)
    task = data.retrieval_task("eval", T)
    digits = data.tokenizer.digit_ids()
    assert task.record_len == 3 and task.n_queries == 8
    for i in range(20):
        ex, info = task.example(0, EVAL_TAG, i)
        window = np.concatenate([ex["tokens"], ex["targets"][-1:]])
        recs = _records(task, window)
        # 8 planted records + 8 restated ones, each key exactly twice with the same value
        assert len(recs) == 16
        planted, queries = recs[:8], recs[8:]
        assert len({k for _, k, _ in planted}) == 8 and sorted(k for _, k, _ in queries) == sorted(k for _, k, _ in planted)
        # the planted block is contiguous, the queries end the window
        assert [s for s, _, _ in planted] == list(range(planted[0][0], planted[0][0] + 24, 3))
        assert [s for s, _, _ in queries] == list(range(T + 1 - 24, T + 1, 3))
        for s, k, v in queries:
            ps, _, pv = next(r for r in planted if r[1] == k)
            assert v == pv and s - (ps + 3) > task.min_distance == T // 2
        # the last query is the probe: info, answer positions and loss mask agree with the tokens
        ps, k, v = next(r for r in planted if r[1] == queries[-1][1])
        assert (info.pair_start, info.pair_end, info.value_start, info.query_start) == (ps, ps + 3, ps + 1, T - 2)
        assert info.key == KEY_LETTERS[k] and [digits[int(c)] for c in info.value] == v
        assert ex["targets"][list(info.answer_positions)].tolist() == v
        assert np.nonzero(ex["loss_mask"])[0].tolist() == [T - 2, T - 1]
        assert info.distance > task.min_distance
        assert (ex["segment_ids"] == 1).all() and ex["positions"].tolist() == list(range(T))


def test_query_count_limited_by_min_distance():
    # L = 161 tokens: 16 records x 2 tokens = 32, more than 100 tokens of filler b -> 28 left for queries
    data = small_data(retrieval_pairs=16, retrieval_key_digits=2, retrieval_value_digits=1,
                      retrieval_min_distance=100)
    task = data.retrieval_task("train", T)
    assert task.n_queries == (T + 1 - 32 - 100 - 1) // 2 == 14
    ex, info = task.example(0, 1, 3, mode="train")
    window = np.concatenate([ex["tokens"], ex["targets"][-1:]])
    recs = _records(task, window)
    assert len(recs) == 16 + 14 and len({k for _, k, _ in recs[16:]}) == 14
    assert recs[16][0] - (recs[15][0] + 2) > 100
    assert (ex["loss_mask"] == 1).all()


def test_eval_batches_deterministic_and_accuracy():
    data = small_data()
    a = list(data.retrieval_eval_batches(4, T, num_batches=2))
    b = list(data.retrieval_eval_batches(4, T, num_batches=2))
    assert len(a) == 2 and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    batch = a[0]
    assert batch["tokens"].shape == (4, T) and batch["loss_mask"].sum() == 4 * 3
    # Perfect predictions -> 1.0; logits path works too.
    assert retrieval_accuracy(batch["targets"], batch) == 1.0
    logits = np.zeros(batch["targets"].shape + (data.tokenizer.vocab_size,), np.float32)
    np.put_along_axis(logits, batch["targets"][..., None], 1.0, axis=-1)
    assert retrieval_accuracy(logits, batch) == 1.0
    # One wrong digit in one row -> that row fails (exact match), others still count.
    preds = batch["targets"].copy()
    preds[1, -2] = (preds[1, -2] + 1) % data.tokenizer.vocab_size
    preds[2, 5] = 0  # errors outside the answer are ignored
    assert retrieval_accuracy(preds, batch) == 0.75


def test_mixer_fraction_and_determinism():
    data = small_data(retrieval_fraction=0.25)
    it = data.train_iter(1, T, seed=0)
    assert abs(it.num_retrieval / (it.num_retrieval + it.num_corpus_windows) - 0.25) < 0.01
    keys = set(data.retrieval_task("train", T).key_ids.tolist())

    def is_retrieval(b):   # key tokens never occur in text, so a key token marks a retrieval sequence
        return bool(keys & set(b["tokens"][0].tolist())) and b["loss_mask"][0].all()

    n = 200
    flags = [is_retrieval(next(it)) for _ in range(n)]
    assert 0.12 < sum(flags) / n < 0.4
    it2 = data.train_iter(1, T, seed=0)
    assert flags == [is_retrieval(next(it2)) for _ in range(n)]


def test_bad_settings_rejected():
    data = small_data()
    with pytest.raises(ValueError, match="too short"):
        data.retrieval_task("eval", 30)   # 16-token block + 15 + one 4-token query > 31
    from glm5_jax.data import RetrievalTask
    with pytest.raises(ValueError, match="n_pairs=11 exceeds the 10 distinct keys"):
        RetrievalTask(data.tokenizer, data.train_stream.stream, T, n_pairs=11, key_digits=1)
    with pytest.raises(ValueError, match="mode"):
        data.retrieval_task("eval", T).example(0, EVAL_TAG, 0, mode="test")


def test_probe_batches_carry_infos_and_test_tag_differs():
    from glm5_jax.data.retrieval import TEST_TAG, retrieval_correct, retrieval_probe_batches
    task = small_data().retrieval_task("eval", T)
    (dev, dinfo), = retrieval_probe_batches(task, 3, 1, 0, EVAL_TAG)
    (test, tinfo), = retrieval_probe_batches(task, 3, 1, 0, TEST_TAG)
    assert len(dinfo) == len(tinfo) == 3 and not np.array_equal(dev["tokens"], test["tokens"])
    assert all(i.distance > task.min_distance for i in dinfo + tinfo)
    preds = test["targets"].copy()
    preds[0, -1] += 1
    assert retrieval_correct(preds, test).tolist() == [False, True, True]
    with pytest.raises(ValueError, match="tag"):
        next(retrieval_probe_batches(task, 1, 1, 0, 7))


def test_min_pairs_varies_train_record_count_and_leaves_probes_unchanged():
    """retrieval_min_pairs: train windows hold every record count in [min, max] (read back from the tokens),
    each with a contiguous block, every query restating a planted record > min_distance later and the
    window ending on a query; eval probes are the same windows as without the option."""
    base = dict(retrieval_pairs=8, retrieval_key_digits=2, retrieval_value_digits=1, retrieval_min_distance=40)
    task = small_data(retrieval_min_pairs=2, **base).retrieval_task("train", T)
    plain = small_data(**base).retrieval_task("train", T)
    counts = set()
    for i in range(60):
        ex, _ = task.example(0, 1, i, mode="train")
        window = np.concatenate([ex["tokens"], ex["targets"][-1:]])
        recs = _records(task, window)
        n = next(j for j in range(1, len(recs) + 1) if j == len(recs) or recs[j][1] in {k for _, k, _ in recs[:j]})
        planted, queries = recs[:n], recs[n:]
        counts.add(n)
        assert [s for s, _, _ in planted] == list(range(planted[0][0], planted[0][0] + 2 * n, 2))
        assert len(queries) == min(n, (T + 1 - 2 * n - 40 - 1) // 2) and queries[-1][0] == T - 1
        for s, k, v in queries:
            ps, _, pv = next(r for r in planted if r[1] == k)
            assert v == pv and s - (ps + 2) > 40
        assert (ex["loss_mask"] == 1).all()
    assert counts == set(range(2, 9))
    for i in range(5):
        a, ia = task.example(0, EVAL_TAG, i)
        b, ib = plain.example(0, EVAL_TAG, i)
        assert ia == ib and all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="retrieval_min_pairs"):
        small_data(retrieval_min_pairs=9, **base)
