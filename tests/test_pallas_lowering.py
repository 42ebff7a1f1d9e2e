"""Lowering (not execution) of the Pallas sparse-attention kernels for TPU (Mosaic) and CUDA (Triton).

Runs on a CPU-only machine: `jax.export(jax.jit(f), platforms=[...])` traces, lowers every Pallas
kernel to the platform's kernel IR (Mosaic TPU MLIR / Triton MLIR) and serialises the module.
What this does NOT check: the device-side compilers (Mosaic's layout passes inside libtpu, Triton
-> PTX), nor numerics on a device. The Triton custom call has no export-compatibility guarantee, so
its serialisation check is disabled (DisabledSafetyCheck.custom_call); the Triton modules are also
explicitly MLIR-verified here.
"""

import pytest

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as triton_lowering

from pallas_kernels import dsa

_TRITON_TARGET = "__gpu$xla.gpu.triton"

# (name, B, T, S, H, Hk, Dq, Dv, K, dtype)
CASES = [
    ("mqa_bf16", 1, 16, 256, 8, 1, 128, 128, 256, jnp.bfloat16),
    ("mla_like_bf16", 1, 8, 512, 16, 1, 576, 512, 384, jnp.bfloat16),  # K not a chunk multiple
    ("mha_odd_f32", 1, 19, 20, 2, 2, 8, 4, 7, jnp.float32),  # Hk == H, odd T/K/D, tiny blocks
]


def _args(b, t, s, h, hk, dq, dv, kk, dtype):
    sd = jax.ShapeDtypeStruct
    return (sd((b, t, h, dq), dtype), sd((b, s, hk, dq), dtype), sd((b, s, hk, dv), dtype),
            sd((b, t, kk), jnp.int32))


def _fns(block_q, block_k):
    def fwd(q, k, v, i):
        return dsa.sparse_attention(q, k, v, i, scale=0.1, interpret=False, block_q=block_q,
                                    block_k=block_k)

    def fwd_bwd(q, k, v, i):
        return jax.grad(lambda a, b, c: jnp.sum(fwd(a, b, c, i).astype(jnp.float32)),
                        (0, 1, 2))(q, k, v)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


@pytest.fixture
def verified_triton(monkeypatch):
    """Verify every Triton module Pallas builds; returns the list of verify() results."""
    results = []
    orig = triton_lowering.lower_jaxpr_to_triton_module

    def wrapped(*a, **kw):
        res = orig(*a, **kw)
        results.append(res.module.operation.verify())
        return res

    monkeypatch.setattr(triton_lowering, "lower_jaxpr_to_triton_module", wrapped)
    return results


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_sparse_attention_lowers_tpu(case, mode):
    _, *shape = case
    f = _fns(64, 128 if case[0] != "mha_odd_f32" else 4)[mode]
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(*_args(*shape))
    text = exp.mlir_module()
    # fwd: one Mosaic kernel; fwd+bwd: forward + backward dq/P/dS kernel
    assert text.count("tpu_custom_call") == (1 if mode == "fwd" else 2)
    assert "__gpu$xla.gpu.triton" not in text


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_sparse_attention_lowers_cuda_triton(case, mode, verified_triton):
    _, *shape = case
    f = _fns(64, 128 if case[0] != "mha_odd_f32" else 4)[mode]
    exp = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_TARGET)],
    )(*_args(*shape))
    text = exp.mlir_module()
    n = 1 if mode == "fwd" else 2
    assert text.count(f"@{_TRITON_TARGET}") == n
    assert "tpu_custom_call" not in text
    assert len(verified_triton) == n and all(verified_triton)


def _indexer_fn(segments):
    def f(q, k, w, seg):
        return dsa.indexer_topk(q, k, w, 256, interpret=False, segment_ids=seg if segments else None)
    sd = jax.ShapeDtypeStruct
    t = 512  # GLM-5's indexer widths (32 heads x 128), blocks of 128: 4 key blocks
    return f, (sd((1, t, 32, 128), jnp.bfloat16), sd((1, t, 128), jnp.bfloat16),
               sd((1, t, 32), jnp.bfloat16), sd((1, t), jnp.int32))


@pytest.mark.parametrize("segments", [False, True])
def test_indexer_topk_lowers_cuda_triton(segments, verified_triton):
    """The GPU indexer kernels (pallas_kernels.indexer_triton): block bound, threshold probe and
    token rounds lower to verified Triton modules, no Mosaic kernel."""
    f, args = _indexer_fn(segments)
    exp = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_TARGET)],
    )(*args)
    text = exp.mlir_module()
    assert text.count(f"@{_TRITON_TARGET}") == 3       # bound, probe round, token round
    assert "tpu_custom_call" not in text
    assert len(verified_triton) == 3 and all(verified_triton)


def test_indexer_topk_lowers_tpu():
    f, args = _indexer_fn(True)
    text = jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    assert text.count("tpu_custom_call") == 3
    assert _TRITON_TARGET not in text


def test_dense_attention_gpu_lowers_cuda_triton(verified_triton):
    """core.causal_attention's GPU kernel (Pallas Triton flash attention with segment ids), forward
    and gradient, lowers to verified Triton modules."""
    from glm5_jax.attention.core import causal_attention
    sd = jax.ShapeDtypeStruct
    q = sd((1, 256, 4, 64), jnp.bfloat16)
    kv = sd((1, 256, 2, 64), jnp.bfloat16)

    def f(q, k, v, seg):
        fn = lambda a, b, c: causal_attention(a, b, c, scale=0.125, segment_ids=seg, platform="gpu")
        return jax.grad(lambda a, b, c: jnp.sum(fn(a, b, c).astype(jnp.float32)), (0, 1, 2))(q, k, v)

    exp = jax.export.export(
        jax.jit(f), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON_TARGET)],
    )(q, kv, kv, sd((1, 256), jnp.int32))
    text = exp.mlir_module()
    assert text.count(f"@{_TRITON_TARGET}") >= 2        # forward + backward kernel(s)
    assert verified_triton and all(verified_triton)


def test_cpu_without_interpret_is_rejected():
    """Documented behaviour: CPU has no compiled Pallas path; interpret=False there fails."""
    f = _fns(8, 4)["fwd"]
    with pytest.raises(ValueError, match="Only interpret mode"):
        jax.jit(f).lower(*_args(1, 8, 16, 2, 1, 8, 8, 4, jnp.float32)).compile()
