"""Serving: a continuous-batching engine on the model's own modules and caches (``engine``), Prometheus
metrics (``metrics``), model loading (``loading``), the OpenAI-compatible HTTP server (``openai_api``, its
request schemas ``schemas``, ``python -m tools.serve``) and the project's one HTTP stack (``http``, also
used by glm5_jax.agentic's chat endpoint and env services).

The engine's names are loaded when first asked for (``glm5_jax.serve.Engine``), not when the package is
imported: ``serve.http`` and ``serve.schemas`` must stay importable without jax and the model (the env
services run on rollout hosts)."""

__all__ = ["Engine", "EngineError", "QueueFull", "RequestHandle", "SamplingParams"]


def __getattr__(name):
    if name in __all__:
        from glm5_jax.serve import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'glm5_jax.serve' has no attribute {name!r}")
