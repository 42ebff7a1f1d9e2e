"""tools.mqar_plateau's synthetic vocabulary: RetrievalTask finds its 52 letter keys as byte pieces,
keys / digits / filler are disjoint, and every probe's answer is the value planted with its key."""
import numpy as np

from glm5_jax.data.retrieval import EVAL_TAG, RetrievalTask
from tools.mqar_plateau import N_DIGITS, N_KEYS, VOCAB, SyntheticTokenizer


def test_synthetic_vocab_keys_digits_filler_disjoint_and_probe_answer_is_planted_value():
    tok = SyntheticTokenizer()
    filler = np.random.default_rng(0).integers(tok.pad_id + 1, VOCAB, 4096)
    task = RetrievalTask(tok, filler, 32, n_pairs=4, key_digits=2, value_digits=1, min_distance=0)
    assert task.key_ids.tolist() == list(range(N_DIGITS, N_DIGITS + N_KEYS))
    assert task.digits.tolist() == list(range(N_DIGITS))
    for i in range(20):
        ex, info = task.example(0, EVAL_TAG, i)
        window = np.concatenate([ex["tokens"], ex["targets"][-1:]])
        keys = [(s, int(t)) for s, t in enumerate(window) if int(t) in set(task.key_ids.tolist())]
        assert len(keys) == 8                                   # 4 planted, 4 restated: filler holds no key
        q_key = int(window[info.query_start])
        planted = next(s for s, k in keys[:4] if k == q_key)
        assert ex["targets"][np.nonzero(ex["loss_mask"])[0]].tolist() == [int(window[planted + 1])]
        assert int(window[planted + 1]) < N_DIGITS
