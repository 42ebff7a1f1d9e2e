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
