"""Inference: KV caches (absorbed MLA latent cache, DSA indexer-key cache, plain K/V for mha/gqa), the paged
generation runtime (`runtime.PagedRuntime`, the one generation path), batch sampling on it (`generate`) and
MTP speculative decoding (`speculative_generate`)."""

from glm5_jax.infer.cache import init_cache
from glm5_jax.infer.decode import PAD_ID, GenerateResult, decode_step, prefill
from glm5_jax.infer.generation import SpeculativeResult, acceptance_length, generate, speculative_generate

__all__ = ["PAD_ID", "GenerateResult", "SpeculativeResult", "acceptance_length", "decode_step", "generate",
           "init_cache", "prefill", "speculative_generate"]
