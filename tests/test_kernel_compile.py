"""The DSA kernels and the TPU dense attention compiled by the real TPU compiler (libtpu, no TPU):
tools.compile_kernels in a subprocess (libtpu stays out of this process, whose other tests use CPU
devices; ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets parallel workers each load it). Small shapes in the
default run; GLM-5's shapes (T = 32768, 64 heads, top-2048, bfloat16) as a slow test."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not importable: install the '.[tpu]' extra")


def _compile(*flags):
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
    env.pop("JAX_PLATFORMS", None)           # the TPU plugin must load (compile-only client)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)   # TPU compiles: not through the test cache
    res = subprocess.run([sys.executable, "-m", "tools.compile_kernels", "--json", *flags], env=env,
                         capture_output=True, text=True, timeout=3000, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return {r["name"]: r for r in json.loads(res.stdout.strip().splitlines()[-1])["results"]}


@needs_libtpu
def test_sparse_attention_compiles_for_tpu_small_bf16():
    """The bfloat16 row gather (Mosaic rejected single-row copies into a tiled bf16 dimension), and MLA's MQA
    form with the fused backward (its per-row float32 dK read-modify-write DMAs and aliased dK)."""
    r = _compile("--seq=256", "--heads=8", "--topk=128", "--which=sparse,mqa_grad")
    for name in ("sparse", "mqa_grad"):
        assert r[name]["dtype"] == "bfloat16" and r[name]["argument_bytes"] > 0


@pytest.mark.slow  # ~1 min of compiling
@needs_libtpu
def test_kernels_compile_for_tpu_small_bf16():
    r = _compile("--seq=256", "--heads=8", "--topk=128", "--which=sparse_grad,indexer,dense_grad")
    assert set(r) == {"sparse_grad", "indexer", "dense_grad"}
    for x in r.values():
        assert x["dtype"] == "bfloat16" and x["temp_bytes"] >= 0 and x["argument_bytes"] > 0


@pytest.mark.slow  # ~5 min of compiling on 2 loaded cores
@needs_libtpu
def test_kernels_compile_for_tpu_at_glm5_shapes():
    r = _compile()  # defaults: GLM-5 shapes, bfloat16, forward and gradient
    assert set(r) == {"sparse", "sparse_grad", "mqa_grad", "indexer", "dense_grad"}
    # the sparse backward holds no [T, H, K] float32 array (that alone would be 16 GiB): its temp
    # memory is a small multiple of its inputs
    g = r["sparse_grad"]
    assert g["temp_bytes"] < 4 * g["input_bytes"], g
    assert 32768 * 64 * 2048 * 4 > 1.5 * g["temp_bytes"]
