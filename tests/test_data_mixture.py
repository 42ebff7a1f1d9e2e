"""Weighted source mixtures (glm5_jax.data.mixture, DataConfig.sources).

Two sources whose text share no letter case (lower-case words / upper-case words) let each packed window be
assigned to its source from its tokens alone, independently of the mixture code: over 10,000 sequences the
observed shares are within 2 points of the weights (data.sources' and a stage's mix), and the iterator's
own per-source counts equal the counts read from the tokens. A run killed and resumed (state through JSON,
a freshly built pipeline, any split of the rows over processes; and the training loop itself) yields the
same sequence order and counts as an uninterrupted one. Bad mixtures fail with errors naming the problem."""

import json
import random

import numpy as np
import pytest

from glm5_jax.overrides import apply_overrides
from glm5_jax.config import ConfigError
from glm5_jax.data import DataConfig, DataError, build_lm_data
from glm5_jax.data.config import MixSource, parse_mix

LOWER = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "rho"]
UPPER = ["ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX", "SEVEN", "EIGHT", "NINE", "TEN"]
T = 16


def _write(path, words, n_docs, seed):
    rng = random.Random(seed)
    with open(path, "w") as fh:
        for _ in range(n_docs):
            fh.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    return {"low": _write(d / "low.jsonl", LOWER, 60, 0), "up": _write(d / "up.jsonl", UPPER, 40, 1),
            "empty": _write(d / "empty.jsonl", LOWER, 0, 2), "cache": str(d / "cache")}


def _cfg(paths, sources, **kw):
    return DataConfig(vocab_size=320, seq_len=T, tokenizer="hf", tokenizer_train_bytes=10_000,
                      cache_dir=paths["cache"], sources=sources, **kw)


@pytest.fixture(scope="module")
def data(paths):
    return build_lm_data(_cfg(paths, f"low={paths['low']}:0.7,up={paths['up']}:0.3"))


def _classes(data):
    """Per token id: 1 if its text has a lower-case letter, 2 upper-case, 0 neither (specials, spaces)."""
    tok = data.tokenizer
    out = np.zeros(tok.vocab_size, np.int64)
    for i in range(tok.vocab_size):
        if i in (tok.eos_id, tok.pad_id):
            continue
        s = tok.decode([i])
        out[i] = 1 if any(c.islower() for c in s) else 2 if any(c.isupper() for c in s) else 0
    return out


def _sources_of(batches, cls):
    """Source of each row read from its tokens (0 = low, 1 = up), and its real (non-padding) tokens."""
    src, real = [], []
    for b in batches:
        for row, seg in zip(b["tokens"], b["segment_ids"]):
            c = cls[row[seg > 0]]
            assert not ((c == 1).any() and (c == 2).any()), "a window mixes two sources"
            src.append(0 if (c == 1).any() else 1)
            real.append(int((seg > 0).sum()))
    return np.array(src), np.array(real)


@pytest.mark.parametrize("mix,shares", [(None, (0.7, 0.3)), ("low:1,up:4", (0.2, 0.8))])
def test_observed_shares_within_two_points_over_10000_sequences(data, mix, shares):
    B, n = 10, 1000                                   # 10,000 sequences
    it = data.train_iter(B, T, seed=3, mix=mix)
    src, real = _sources_of([next(it) for _ in range(n)], _classes(data))
    observed = [float(np.mean(src == j)) for j in (0, 1)]
    assert all(abs(o - w) <= 0.02 for o, w in zip(observed, shares)), (observed, shares)
    # the iterator's own counts are the ones read from the tokens
    m = it.data_metrics()
    assert [m["data_sequences/low"], m["data_sequences/up"]] == [int((src == j).sum()) for j in (0, 1)]
    assert [m["data_tokens/low"], m["data_tokens/up"]] == [int(real[src == j].sum()) for j in (0, 1)]


def _take(it, n):
    return [{k: v.copy() for k, v in next(it).items()} for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_killed_and_resumed_iterator_continues_the_same_interleaving(paths, data):
    B = 4
    full_it = data.train_iter(B, T, seed=5)
    full = _take(full_it, 30)
    first = data.train_iter(B, T, seed=5)
    head = _take(first, 12)
    state = json.loads(json.dumps(first.get_state()))        # what the checkpoint holds
    again = build_lm_data(_cfg(paths, f"low={paths['low']}:0.7,up={paths['up']}:0.3"))   # a new process
    resumed = again.train_iter(B, T, seed=5)
    resumed.set_state(state)
    assert _same(head + _take(resumed, 18), full)
    assert resumed.data_metrics() == full_it.data_metrics()
    # two processes reading rows {0, 1} and {2, 3} of every global batch, resumed from the same state
    parts = []
    for rows in ([0, 1], [2, 3]):
        it = again.train_iter(B, T, seed=5)
        it.set_state(state)
        it.select_rows(rows)
        parts.append(_take(it, 18))
        assert it.data_metrics() == full_it.data_metrics()    # every process counts the global batch
    joined = [{k: np.concatenate([a[k], b[k]]) for k in a} for a, b in zip(*parts)]
    assert _same(joined, full[12:])
    # another mix is another stream: its state is refused by name
    other = data.train_iter(B, T, seed=5, mix="low:1,up:1")
    with pytest.raises(ValueError, match="fingerprint"):
        other.set_state(state)


def test_a_source_keeps_its_own_order_whatever_it_is_mixed_with(paths, data):
    """Each source is shuffled by a seed of its own (seed, name): the low windows drawn from the 0.7/0.3
    mix, in order, are the windows of the low-only stream."""
    alone = build_lm_data(DataConfig(vocab_size=320, seq_len=T, tokenizer=data.tokenizer.model_path,
                                     cache_dir=paths["cache"], sources=f"low={paths['low']}:1"))
    a = np.concatenate([b["tokens"] for b in _take(alone.train_iter(5, T, seed=2), 20)])
    mixed = _take(data.train_iter(5, T, seed=2), 30)
    src, _ = _sources_of(mixed, _classes(data))
    low = np.concatenate([b["tokens"] for b in mixed])[src == 0]
    n = min(len(low), len(a))
    assert n >= 90 and np.array_equal(low[:n], a[:n])


def test_eval_batches_and_summary_per_source(data):
    low = list(data.eval_batches(2, T, source="low"))
    both = list(data.eval_batches(2, T))
    assert _same(low, both[:len(low)]) and len(both) > len(low)
    s = data.summary()
    assert set(s["sources"]) == {"low", "up"} and s["sources"]["low"]["weight"] == 0.7
    assert s["train_tokens"] == sum(p["train_tokens"] for p in s["sources"].values())


def test_sources_parse_from_the_command_line(paths):
    cfg = DataConfig()
    text = apply_overrides(cfg, [f"sources=low={paths['low']}:0.6,{paths['up']}:0.4"])
    assert text.sources == (MixSource("low", paths["low"], 0.6), MixSource("up", paths["up"], 0.4))
    js = apply_overrides(cfg, ["sources=" + json.dumps([{"name": "a", "path": "x.jsonl,y.jsonl", "weight": 2}])])
    assert js.sources == (MixSource("a", "x.jsonl,y.jsonl", 2.0),)
    assert apply_overrides(text, ["sources=none"]).sources == ()
    # NAME= only when it is a name ("=" and ":" may be in a path); the weight only when it is a number
    assert DataConfig(sources="/d/lang=en/web.jsonl:2,gs://b/c:d").sources == (
        MixSource("web", "/d/lang=en/web.jsonl", 2.0), MixSource("c_d", "gs://b/c:d", 1.0))
    assert parse_mix("up:3, low:1", ["low", "up"]) == (("low", 1.0), ("up", 3.0))


@pytest.mark.parametrize("sources,match", [
    ("a=x.jsonl:0", r"source 0 \(a\): weight '0' is invalid; allowed: a finite number > 0"),
    ("a=x.jsonl:-0.5,b=y.jsonl:1", r"weight '-0.5' is invalid"),
    ("a=x.jsonl:nan", r"weight 'nan' is invalid"),
    ("a=x.jsonl:1,a=y.jsonl:1", r"distinct source names; \['a'\] repeat"),
    ("a=:1", r"the path is empty"),
    ('[{"path": "x", "wieght": 1}]', r"unknown keys \['wieght'\]"),
])
def test_bad_sources_are_refused_by_name(sources, match):
    with pytest.raises(ConfigError, match=match):
        DataConfig(sources=sources)


def test_bad_mixtures_and_empty_sources(paths, data):
    with pytest.raises(ConfigError, match=r"'web' is not a source \(sources: low, up\)"):
        data.train_iter(2, T, mix="web:1")
    with pytest.raises(ConfigError, match=r"weight '0' is invalid"):
        data.train_iter(2, T, mix="low:1,up:0")
    with pytest.raises(ConfigError, match="DataConfig.path=.*None when data.sources is set"):
        DataConfig(path=paths["low"], sources=f"up={paths['up']}")
    with pytest.raises(ConfigError, match="DataConfig.retrieval_fraction=0.1 is invalid: allowed: 0 when data.sources is set"):
        DataConfig(retrieval_fraction=0.1, sources=f"up={paths['up']}")
    with pytest.raises(DataError, match=r"data.sources 'empty' .*empty.jsonl.* is empty \(no documents\)"):
        build_lm_data(_cfg(paths, f"low={paths['low']}:1,empty={paths['empty']}:1"))
    single = build_lm_data(DataConfig(vocab_size=320, seq_len=T, tokenizer="hf", tokenizer_train_bytes=10_000,
                                      cache_dir=paths["cache"], path=paths["low"]))
    with pytest.raises(ConfigError, match="needs a mixture"):
        single.train_iter(2, T, mix="low:1")


class _Recording:
    """The pipeline iterator, recording the tokens of each batch served; raises after `fail_after` batches
    (a killed run)."""

    def __init__(self, it, seen, fail_after=None):
        self.it, self.seen, self.fail_after = it, seen, fail_after

    def __next__(self):
        if self.fail_after is not None and len(self.seen) >= self.fail_after:
            raise KeyboardInterrupt("killed")
        b = next(self.it)
        self.seen.append(b["tokens"].copy())
        return b

    def __getattr__(self, name):           # get_state / set_state / select_rows / data_metrics
        return getattr(self.it, name)


def test_training_loop_killed_and_resumed_reads_the_same_sequences_and_counts(tmp_path, data):
    """The loop checkpoints the mixture's state; a run killed after step 3 resumes from its step-2 checkpoint
    and reads the same batches as an uninterrupted run; metrics.jsonl's per-source counts are the same."""
    from glm5_jax.config import ModelConfig
    from glm5_jax.train import TrainConfig, train
    model = ModelConfig(vocab_size=320, d_model=16, num_layers=1, num_heads=2, num_kv_heads=2, attention="mha",
                        num_experts=0, mtp_depth=0, ffn_dim=32)
    tc = TrainConfig(steps=6, batch_size=2, seq_len=T, ckpt_every=2, log_every=1, eval_every=1000, warmup_steps=1,
                     async_checkpoints=False, keep_checkpoints=1)
    quiet = lambda msg: None
    full_seen, killed_seen, resumed_seen = [], [], []
    train(model, tc, _Recording(data.train_iter(2, T, seed=9), full_seen), tmp_path / "full", log=quiet)
    with pytest.raises(KeyboardInterrupt):
        train(model, tc, _Recording(data.train_iter(2, T, seed=9), killed_seen, fail_after=3), tmp_path / "killed",
              log=quiet)
    train(model, tc, _Recording(data.train_iter(2, T, seed=9), resumed_seen), tmp_path / "killed", log=quiet)
    assert len(full_seen) == 6 and len(resumed_seen) == 4          # resumed after step 2's checkpoint
    assert all(np.array_equal(a, b) for a, b in zip(killed_seen[:2] + resumed_seen, full_seen))

    def counts(wd):
        rows = [json.loads(line) for line in open(wd / "metrics.jsonl") if line.strip()]
        return [(r["step"], {k: v for k, v in r.items() if k.startswith("data_")}) for r in rows]
    full, resumed = counts(tmp_path / "full"), counts(tmp_path / "killed")
    assert full == resumed and [s for s, _ in full] == list(range(1, 7))
    last = full[-1][1]
    assert last["data_sequences/low"] + last["data_sequences/up"] == 12
    src, real = _sources_of([{"tokens": t, "segment_ids": np.where(t == data.tokenizer.pad_id, 0, 1)}
                             for t in full_seen], _classes(data))
    assert [last["data_sequences/low"], last["data_sequences/up"]] == [int((src == j).sum()) for j in (0, 1)]
