"""Data pipeline: documents from text / jsonl(.gz) / parquet / ArrayRecord files (default: the stdlib
sources), sentencepiece or Hugging Face tokenizers, a token cache, packed grain pipelines with
checkpointable iterators, and synthetic long-range retrieval data."""

from glm5_jax.data.config import DataConfig, default_cache_dir
from glm5_jax.data.corpus import Corpus, load_corpus
from glm5_jax.batch import BATCH_KEYS
from glm5_jax.data.packing import PackedStream
from glm5_jax.data.build import build_lm_data, make_train_iterator
from glm5_jax.data.pipeline import LMData, TrainIterator
from glm5_jax.data.sources import DataError, Document, SourceFile
from glm5_jax.data.retrieval import (
    RetrievalInfo,
    RetrievalTask,
    retrieval_accuracy,
    retrieval_eval_batches,
)
from glm5_jax.data.tokenizer import (
    GLM_SPECIAL_TOKENS,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_or_train_tokenizer,
    load_tokenizer,
    train_hf_tokenizer,
)

__all__ = [
    "BATCH_KEYS", "Corpus", "DataConfig", "DataError", "Document", "GLM_SPECIAL_TOKENS", "HFTokenizer", "LMData",
    "PackedStream", "RetrievalInfo", "RetrievalTask", "SentencePieceTokenizer", "SourceFile", "Tokenizer",
    "TrainIterator",
    "build_lm_data", "default_cache_dir", "load_corpus", "load_or_train_tokenizer", "load_tokenizer",
    "make_train_iterator", "retrieval_accuracy", "retrieval_eval_batches", "train_hf_tokenizer",
]
