"""Shared small data setup for the tests/test_data_*.py files (no tests here)."""

import atexit
import functools
import shutil
import tempfile

from glm5_jax.data import DataConfig, build_lm_data

SMALL = dict(vocab_size=512, seq_len=128, max_files=30, tokenizer_train_bytes=2_000_000)


@functools.lru_cache(maxsize=None)
def small_cache_dir() -> str:
    d = tempfile.mkdtemp(prefix="glm5_data_test_")
    atexit.register(shutil.rmtree, d, True)
    return d


def small_cfg(**overrides) -> DataConfig:
    return DataConfig(**{**SMALL, "cache_dir": small_cache_dir(), **overrides})


@functools.lru_cache(maxsize=None)
def small_data(**overrides):
    return build_lm_data(small_cfg(**overrides))
