"""The one place that picks a DSA kernel: `ModelConfig.attention_impl` "xla" runs the jnp references
(pallas_kernels.reference), "pallas" the Pallas kernels (pallas_kernels.dsa: Mosaic on TPU, Triton on
GPU, interpret mode on CPU). Both have the same signatures; tests compare them."""

from __future__ import annotations

from pallas_kernels import reference as ref


def indexer_topk(q_idx, k_idx, weights, topk: int, *, segment_ids=None, impl: str = "xla", chunk: int = 256,
                 q_offset=None, kv_segment_ids=None):
    """Exact top-k key indices per query, int32 [B, T, topk], -1 where fewer keys are visible.
    q_offset / kv_segment_ids: the T queries at global positions q_offset.. of the S keys (context
    parallelism, glm5_jax.attention.context; the jnp reference only)."""
    if impl == "pallas":
        if q_offset is not None:
            raise NotImplementedError(
                "attention_impl='pallas' under a context-parallel mesh: the Pallas indexer top-k takes no "
                "query offset yet (docs/kernels.md, known gaps); use attention_impl='xla' with a context axis")
        from pallas_kernels import dsa
        return dsa.indexer_topk(q_idx, k_idx, weights, topk, segment_ids=segment_ids)
    if impl != "xla":
        raise ValueError(f"attention_impl must be 'xla' or 'pallas', got {impl!r}")
    return ref.indexer_topk(q_idx, k_idx, weights, topk, segment_ids=segment_ids, chunk=chunk, q_offset=q_offset,
                            kv_segment_ids=kv_segment_ids)


def sparse_attention(q, k, v, indices, *, scale, impl: str = "xla", chunk: int = 128, dv: int | None = None):
    """q [B, T, H, D] over the keys `indices` [B, T, K] (-1 = none) of k/v [B, S, Hk, D] -> [B, T, H, Dv].
    v=None with `dv`: the value is k[..., :dv] (MLA's MQA form); the xla path then gathers each row
    once and scatters one gradient row per slot (see reference.sparse_attention)."""
    if impl == "pallas":
        from pallas_kernels import dsa
        if v is None:
            if dv is None:
                raise ValueError("sparse_attention: v=None needs dv (value = k[..., :dv])")
            v = k[..., :dv]
        return dsa.sparse_attention(q, k, v, indices, scale=scale)
    if impl != "xla":
        raise ValueError(f"attention_impl must be 'xla' or 'pallas', got {impl!r}")
    return ref.sparse_attention(q, k, v, indices, scale=scale, chunk=chunk, dv=dv)
