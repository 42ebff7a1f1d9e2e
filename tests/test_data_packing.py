import numpy as np
import pytest

from glm5_jax.batch import BATCH_KEYS
from glm5_jax.data.packing import PackedStream, padding_example
from glm5_jax.data.token_cache import TokenizedSplit

EOS, PAD = 2, 0


def _split(lengths, seed=0):
    rng = np.random.default_rng(seed)
    docs = [rng.integers(11, 500, size=n).astype(np.uint16) for n in lengths]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return TokenizedSplit(np.concatenate(docs), offsets)


@pytest.mark.parametrize("seq_len", [4, 7, 16])
def test_packing_segments_positions_targets(seq_len):
    lengths = [1, 3, 9, 2, 20, 5, 1, 13]
    split = _split(lengths)
    ps = PackedStream(split, EOS, PAD)
    # Reference stream: each doc followed by eos; per-token document index.
    ref, ref_doc = [], []
    for d in range(split.num_docs):
        ref += list(split.doc(d)) + [EOS]
        ref_doc += [d] * (lengths[d] + 1)
    assert ps.stream.tolist() == ref
    n_win = ps.num_windows(seq_len)
    assert n_win == -(-(len(ref) - 1) // seq_len)
    seen_targets = []
    for i in range(n_win):
        w = ps.window(i, seq_len)
        assert set(w) == set(BATCH_KEYS)
        for k in BATCH_KEYS:
            assert w[k].dtype == np.int32 and w[k].shape == (seq_len,)
        start = i * seq_len
        for t in range(seq_len):
            p = start + t
            if p >= len(ref):  # padding
                assert w["tokens"][t] == PAD and w["segment_ids"][t] == 0
                assert w["loss_mask"][t] == 0 and w["positions"][t] == 0
                continue
            assert w["tokens"][t] == ref[p]
            d = ref_doc[p]
            assert w["segment_ids"][t] == d - ref_doc[start] + 1  # starts at 1
            doc_start = max(ref_doc.index(d), start)
            assert w["positions"][t] == p - doc_start  # restarts per document / window
            if p + 1 < len(ref):
                assert w["targets"][t] == ref[p + 1]
                same = ref_doc[p + 1] == d
                assert w["loss_mask"][t] == int(same)
                if not same:
                    assert w["tokens"][t] == EOS  # only a doc's eos precedes a boundary
                else:
                    seen_targets.append(p + 1)
            else:
                assert w["targets"][t] == PAD and w["loss_mask"][t] == 0
        # A segment change happens exactly where the document changes.
        seg, tok = w["segment_ids"], w["tokens"]
        valid = seg > 0
        changes = np.nonzero(np.diff(seg[valid]))[0]
        for c in changes:
            assert tok[valid][c] == EOS and w["positions"][valid][c + 1] == 0
    # Every in-document next-token target is trained exactly once over the epoch.
    expected = [p for p in range(1, len(ref)) if ref_doc[p] == ref_doc[p - 1]]
    assert sorted(seen_targets) == expected


def test_padding_example():
    e = padding_example(5, PAD)
    assert all(e[k].dtype == np.int32 and e[k].shape == (5,) for k in BATCH_KEYS)
    assert e["loss_mask"].sum() == 0 and e["segment_ids"].sum() == 0


def _reference_windows(docs, T):
    """A plain-Python packing by the documented contract: docs + eos back to back, windows of T tokens,
    a new segment at each document start or window start, positions counted from there."""
    stream = [(int(t), d) for d, doc in enumerate(docs) for t in list(doc) + [EOS]]
    out = []
    for start in range(0, len(stream) - 1, T):
        tokens, seg, pos, last, n, run = [], [], [], None, 0, 0
        for p in range(start, start + T):
            if p >= len(stream):
                tokens.append(PAD), seg.append(0), pos.append(0)
                continue
            tok, d = stream[p]
            if d != last:
                n, run, last = n + 1, 0, d
            else:
                run += 1
            tokens.append(tok), seg.append(n), pos.append(run)
        out.append((tokens, seg, pos))
    return out


@pytest.mark.parametrize("seq_len", [16, 32, 64])   # one corpus packed at each stage's length
def test_long_documents_split_per_stage_length(seq_len):
    lengths = [3, 70, 5, 150, 2]
    split = _split(lengths, seed=1)
    docs = [split.doc(d) for d in range(split.num_docs)]
    ps = PackedStream(split, EOS, PAD)
    ref = _reference_windows(docs, seq_len)
    assert ps.num_windows(seq_len) == len(ref)
    for i, (tokens, seg, pos) in enumerate(ref):
        w = ps.window(i, seq_len)
        assert w["tokens"].tolist() == tokens and w["segment_ids"].tolist() == seg and w["positions"].tolist() == pos
    # the 150-token document: pieces of <= T tokens, each starting at position 0, that rebuild the document
    start = sum(lengths[:3]) + 3
    pieces, p = [], start
    while p < start + 150:
        i, t = divmod(p, seq_len)
        w = ps.window(i, seq_len)
        n = min(seq_len - t, start + 150 - p)
        assert w["positions"][t:t + n].tolist() == list(range(n))
        pieces.append(w["tokens"][t:t + n])
        p += n
    assert len(pieces) >= 150 // seq_len and np.array_equal(np.concatenate(pieces), docs[3])
    # a longer stage sees longer pieces of the same stream: window i at 2T is windows 2i, 2i+1 at T
    for i in range(ps.num_windows(2 * seq_len)):
        long = ps.window(i, 2 * seq_len)["tokens"]
        short = np.concatenate([ps.window(j, seq_len)["tokens"] if j < ps.num_windows(seq_len)
                                else np.full([seq_len], PAD, np.int32) for j in (2 * i, 2 * i + 1)])
        assert np.array_equal(long, short)
