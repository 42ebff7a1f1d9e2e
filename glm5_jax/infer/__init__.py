"""Inference: KV caches (absorbed MLA latent cache, DSA indexer-key cache, plain K/V for mha/gqa),
cached sampling (`generate`) and MTP speculative decoding (`speculative_generate`)."""

from glm5_jax.infer.cache import init_cache
from glm5_jax.infer.decode import PAD_ID, GenerateResult, decode_step, generate, prefill

__all__ = ["PAD_ID", "GenerateResult", "decode_step", "generate", "init_cache", "prefill"]
