"""Serving: a continuous-batching engine on the model's own modules and caches (``engine``), Prometheus
metrics (``metrics``), model loading (``loading``) and the OpenAI-compatible HTTP server (``openai_api``,
``python -m tools.serve``)."""

from glm5_jax.serve.engine import Engine, EngineError, QueueFull, RequestHandle, SamplingParams

__all__ = ["Engine", "EngineError", "QueueFull", "RequestHandle", "SamplingParams"]
