"""Evaluation: one mesh-aware evaluator (glm5_jax.eval.evaluator) with pluggable metrics (LM loss, loss by
position bucket, per-token outputs, retrieval accuracy, DSA top-k indices and indexer recall, MTP acceptance,
raw logits), the probes built on it (retrieval, passkey), DSA oracle / attention-mass helpers, MTP acceptance,
host statistics (bootstrap intervals over windows) and task success (greedy generation on verifiable tasks)."""

from glm5_jax.eval.evaluator import LMLoss, Metric, evaluate
from glm5_jax.eval.metrics import (IndexerRecall, Logits, MTPAcceptance, PositionLoss, RetrievalAccuracy, TokenOutputs,
                                   TopKIndices)
from glm5_jax.eval.placement import global_batch, local_rows, place_batch


def task_success(model_cfg, params, tasks, vocab, *, max_new_tokens: int, greedy: bool = True) -> float:
    """Exact-match success of greedy (or sampled) generation on verifiable tasks (glm5_jax.rl.program)."""
    from glm5_jax.rl.program import evaluate_accuracy
    return evaluate_accuracy(model_cfg, params, tasks, vocab, max_new_tokens=max_new_tokens, greedy=greedy)["accuracy"]


__all__ = ["IndexerRecall", "LMLoss", "Logits", "MTPAcceptance", "Metric", "PositionLoss", "RetrievalAccuracy",
           "TokenOutputs", "TopKIndices", "evaluate", "global_batch", "local_rows", "place_batch", "task_success"]
