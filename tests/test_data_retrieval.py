import numpy as np
import pytest

from glm5_jax.data import retrieval_accuracy
from glm5_jax.data.retrieval import EVAL_TAG

from tests.test_data_common import small_data

T = 160


def test_query_far_from_pair_and_answer_recoverable():
    data = small_data()
    task = data.retrieval_task("eval", T)
    tok = data.tokenizer
    digits = tok.digit_ids()
    for i in range(20):
        ex, info = task.example(0, EVAL_TAG, i)
        assert info.distance > task.min_distance == T // 2
        window = np.concatenate([ex["tokens"], ex["targets"][-1:]])
        # The queried record is planted at pair_start and carries the answer.
        rec = window[info.pair_start:info.pair_end].tolist()
        val_ids = [digits[int(c)] for c in info.value]
        key_ids = [digits[int(c)] for c in info.key]
        assert rec == (task.key_ids.tolist() + key_ids + task.eq_ids.tolist() + val_ids
                       + task.end_ids.tolist())
        # The query (key + '=') ends the tokens, the answer is the last targets.
        q = window[info.query_start:].tolist()
        assert q == task.key_ids.tolist() + key_ids + task.eq_ids.tolist() + val_ids
        assert ex["targets"][list(info.answer_positions)].tolist() == val_ids
        assert np.nonzero(ex["loss_mask"])[0].tolist() == list(info.answer_positions)
        # Answer recoverable from the context alone: find the key's earlier record.
        text = tok.decode(ex["tokens"])
        assert f"key{info.key}={info.value};" in text
        assert text.endswith(f"key{info.key}=" + info.value[:-1])
        assert (ex["segment_ids"] == 1).all()
        assert ex["positions"].tolist() == list(range(T))


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
    key_ids = data.retrieval_task("train", T).key_ids.tolist()
    eq = data.retrieval_task("train", T).eq_ids.tolist()

    def is_retrieval(b):
        tail = b["tokens"][0, -(len(key_ids) + 3 + len(eq) + 2):].tolist()
        return tail[:len(key_ids)] == key_ids and (b["segment_ids"][0] == 1).all() and \
            b["loss_mask"][0].all()

    n = 200
    flags = [is_retrieval(next(it)) for _ in range(n)]
    assert 0.12 < sum(flags) / n < 0.4
    it2 = data.train_iter(1, T, seed=0)
    assert flags == [is_retrieval(next(it2)) for _ in range(n)]


def test_too_short_sequence_rejected():
    data = small_data()
    with pytest.raises(ValueError, match="too short"):
        data.retrieval_task("eval", 40)


def test_train_mode_restates_records_far_from_their_block():
    data = small_data()
    task = data.retrieval_task("train", T)
    assert 1 < task.train_queries <= task.n_pairs
    for i in range(10):
        ex, info = task.example(0, 1, i, mode="train")
        window = np.concatenate([ex["tokens"], ex["targets"][-1:]])
        # the queried record is still planted where info says, and the window ends with it restated
        rec = window[info.pair_start:info.pair_end].tolist()
        assert window[-task.query_len:].tolist() == rec[:task.query_len]
        # every restated record (split on the record separator) is one of the planted ones, no repeats
        n_sep = len(task.end_ids)
        tail = window[len(window) - task.train_queries * (task.query_len + n_sep) + n_sep:]
        pieces = [tail[j * (task.query_len + n_sep): j * (task.query_len + n_sep) + task.query_len].tolist()
                  for j in range(task.train_queries)]
        starts = [s for s in range(len(window) - task.query_len + 1)
                  if window[s:s + len(task.key_ids)].tolist() == task.key_ids.tolist()]
        recs = [window[s:s + task.query_len].tolist() for s in starts]
        assert len({tuple(p) for p in pieces}) == task.train_queries
        for p in pieces:
            assert recs.count(p) == 2          # once in the block, once restated at the end
            first, second = [s for s, r in zip(starts, recs) if r == p]
            assert second - (first + task.record_len) > task.min_distance
        assert (ex["loss_mask"] == 1).all()
        # the value's first digit is where info says
        assert window[info.value_start] == task.digits[int(info.value[0])]


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
