"""Evaluation: one mesh-aware evaluator (glm5_jax.eval.evaluator) with pluggable metrics (LM loss, loss by
position bucket, per-token outputs, retrieval accuracy, DSA top-k indices and indexer recall, MTP acceptance,
raw logits), the probes built on it (retrieval, passkey), DSA oracle / attention-mass helpers, MTP acceptance,
host statistics (bootstrap intervals over windows). Task success (greedy generation on verifiable tasks) is
glm5_jax.rl.program.evaluate_accuracy: it generates, so it sits above the evaluator, in rl."""

from glm5_jax.eval.evaluator import LMLoss, Metric, evaluate
from glm5_jax.eval.metrics import (IndexerRecall, Logits, MTPAcceptance, PositionLoss, RetrievalAccuracy, TokenOutputs,
                                   TopKIndices)
from glm5_jax.eval.placement import global_batch, local_rows, place_batch

__all__ = ["IndexerRecall", "LMLoss", "Logits", "MTPAcceptance", "Metric", "PositionLoss", "RetrievalAccuracy",
           "TokenOutputs", "TopKIndices", "evaluate", "global_batch", "local_rows", "place_batch"]
