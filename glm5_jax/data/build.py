"""The data entry points: `build_lm_data` (a DataConfig -> one LMData, glm5_jax.data.pipeline, or a
MixtureData of several sources, glm5_jax.data.mixture) and `make_train_iterator`. Above both modules
it builds from, so neither imports the other's caller."""

from __future__ import annotations

import time
from typing import Optional

from glm5_jax.data.config import DataConfig
from glm5_jax.data.corpus import load_corpus
from glm5_jax.data.mixture import MixtureData, build_mixture
from glm5_jax.data.pipeline import LMData, TrainIterator, is_prepared_dir, prepared_data, tokenized
from glm5_jax.data.tokenizer import resolve_tokenizer


def build_lm_data(cfg: DataConfig, log=None) -> LMData | MixtureData:
    """Corpus -> (cached) tokenizer -> (cached) token arrays, or a prepared directory. Cheap on a warm
    cache. `log`: where the tokenization summary goes (progress goes to stderr). With `cfg.sources`: a
    MixtureData (glm5_jax.data.mixture) of one LMData per source."""
    if not isinstance(cfg, DataConfig):
        raise TypeError(f"cfg must be a DataConfig, got {type(cfg).__name__}")
    if cfg.sources:
        return build_mixture(cfg, log=log)
    if is_prepared_dir(cfg.path):
        return prepared_data(cfg)
    t0 = time.perf_counter()
    corpus = load_corpus(cfg)
    t1 = time.perf_counter()
    tok = resolve_tokenizer(cfg, corpus)
    return tokenized(cfg, corpus, tok, log, {"corpus_s": round(t1 - t0, 3),
                                             "tokenizer_s": round(time.perf_counter() - t1, 3)})


def make_train_iterator(data: LMData | MixtureData | DataConfig, batch_size: int,
                        seq_len: Optional[int] = None, seed: Optional[int] = None,
                        num_threads: int = 0, mix=None) -> TrainIterator:
    """`TrainIterator` over `data` (an LMData or MixtureData, or a DataConfig that is built first)."""
    if isinstance(data, DataConfig):
        data = build_lm_data(data)
    return data.train_iter(batch_size, seq_len, seed, num_threads, mix)


def dev_test_batches(data, batch_size: int, seq_len: int, n_dev: int, n_test: int) -> dict:
    """{"dev": the first n_dev held-out batches (watched in training), "test": up to n_test after them (the
    reported figures)}; ConfigError when the held-out split cannot give dev plus at least one test batch."""
    from glm5_jax.errors import ConfigError
    lm_all = list(data.eval_batches(batch_size, seq_len, max_batches=n_dev + n_test))
    if len(lm_all) < n_dev + 1:
        raise ConfigError(f"the eval split gives {len(lm_all)} batches of {batch_size}x{seq_len}; need > "
                          f"train.eval_batches={n_dev} for dev + test (more held-out text: data.eval_fraction / "
                          "data.max_files)")
    return {"dev": lm_all[:n_dev], "test": lm_all[n_dev:]}


__all__ = ["build_lm_data", "dev_test_batches", "make_train_iterator"]
