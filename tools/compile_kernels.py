"""Compile the DSA kernels with the real TPU compiler (libtpu, no TPU needed) and report memory.

    python -m tools.compile_kernels [--seq=32768] [--heads=64] [--topk=2048] [--dtype=bfloat16]
                                    [--which=sparse,sparse_grad,mqa_grad,indexer,dense_grad] [--topology=v5p:1x1x1] [--json]

Defaults are GLM-5's shapes: sparse attention in MLA's MQA form, q [1, T, 64, 576] (512 latent +
64 rope), one shared key row k [1, T, 1, 576], values v [1, T, 1, 512], indices [1, T, 2048];
the lightning indexer q [1, T, 32, 128], k [1, T, 128], weights [1, T, 32], top-2048; the dense
attention of the warm-up stage (`core.causal_attention(..., platform="tpu")`: splash attention,
packed segment ids) with per-head q/k 256 (192 + 64 rope) and v 256, forward + gradient; mqa_grad: the
model's sparse call (`dsa.sparse_mqa_uv`: the same attention with W_UV [512, 64, 256] and the fused TPU
backward), its gradient in q, k and W_UV.
Each function is called as the model calls it (`dsa.sparse_attention(..., interpret=False)`,
`dsa.indexer_topk(..., interpret=False)`), lowered for one chip of `--topology` and compiled;
`compiled.memory_analysis()` gives argument / output / temp bytes. Progress goes to stderr; with
--json the last stdout line is {"results": [{"name", "compile_seconds", "argument_bytes",
"output_bytes", "temp_bytes"}]}. Needs libtpu (the '.[tpu]' extra); a second process that loads
libtpu needs ALLOW_MULTIPLE_LIBTPU_LOAD=1.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from absl import flags

from glm5_jax.cli import run

KERNELS = ("sparse", "sparse_grad", "mqa_grad", "indexer", "dense_grad")   # cases()'s names


def _one_chip(topology: str):
    import jax
    from tools.aot import topology_devices
    dev = topology_devices(topology)[0]
    return jax.sharding.Mesh(np.array([dev]), ("x",))


def cases(seq: int, heads: int, topk: int, dtype: str, idx_heads: int = 32, idx_dim: int = 128,
          latent: int = 512, rope: int = 64, qk_head: int = 256, v_head: int = 256):
    """name -> (function, argument shapes/dtypes) at the given shapes."""
    import jax
    import jax.numpy as jnp
    from pallas_kernels import dsa

    dt = jnp.dtype(dtype)
    dq = latent + rope
    scale = float(dq) ** -0.5  # GLM-5 scales by the per-head qk dim; any constant compiles the same
    sd = jax.ShapeDtypeStruct
    q, k, v = sd((1, seq, heads, dq), dt), sd((1, seq, 1, dq), dt), sd((1, seq, 1, latent), dt)
    idx = sd((1, seq, topk), jnp.int32)

    def sparse(q, k, v, idx):
        return dsa.sparse_attention(q, k, v, idx, scale=scale, interpret=False)

    def sparse_grad(q, k, v, idx, do):
        out, vjp = jax.vjp(lambda a, b, c: sparse(a, b, c, idx), q, k, v)
        return vjp(do)

    def mqa_grad(q, k, w_uv, idx, dout):
        f = lambda a, b, c: dsa.sparse_mqa_uv(a, b, c, idx, scale=scale, interpret=False)
        return jax.vjp(f, q, k, w_uv)[1](dout)

    def indexer(qi, ki, wi):
        return dsa.indexer_topk(qi, ki, wi, topk, interpret=False)

    def dense_grad(q, k, v, seg, do):
        from glm5_jax.attention.core import causal_attention
        f = lambda a, b, c: causal_attention(a, b, c, scale=scale, segment_ids=seg, platform="tpu")
        return jax.vjp(f, q, k, v)[1](do)

    iq, ik, iw = sd((1, seq, idx_heads, idx_dim), dt), sd((1, seq, idx_dim), dt), sd((1, seq, idx_heads), dt)
    # the dense warm-up stage / plain MLA: per-head keys (qk 192 + 64 rope, v 256 at GLM-5)
    dh = sd((1, seq, heads, qk_head), dt)
    return {
        "dense_grad": (dense_grad, (dh, dh, sd((1, seq, heads, v_head), dt), sd((1, seq), jnp.int32),
                                    sd((1, seq, heads, v_head), dt))),
        "sparse": (sparse, (q, k, v, idx)),
        "sparse_grad": (sparse_grad, (q, k, v, idx, sd((1, seq, heads, latent), dt))),
        "mqa_grad": (mqa_grad, (q, k, sd((latent, heads, v_head), dt), idx, sd((1, seq, heads, v_head), dt))),
        "indexer": (indexer, (iq, ik, iw)),
    }


def compile_one(fn, args, mesh):
    """-> dict of compile seconds and memory_analysis bytes for one chip."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    rep = NamedSharding(mesh, P())
    shaped = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep) for a in args]
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*shaped).compile()
    secs = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    return {"compile_seconds": round(secs, 2),
            "argument_bytes": int(ma.argument_size_in_bytes),
            "output_bytes": int(ma.output_size_in_bytes),
            "temp_bytes": int(ma.temp_size_in_bytes)}


FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_integer("seq", 32768, "sequence length T", lower_bound=1)
    flags.DEFINE_integer("heads", 64, "attention heads", lower_bound=1)
    flags.DEFINE_integer("topk", 2048, "keys each query attends to", lower_bound=1)
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "activation dtype")
    flags.DEFINE_list("which", list(KERNELS), f"comma list of kernels to compile: {', '.join(KERNELS)}")
    flags.DEFINE_string("topology", "v5p:1x1x1", "TPU topology whose one chip is compiled for")
    flags.DEFINE_bool("json", False, "last stdout line: one JSON object with the results")
    flags.register_validator("which", lambda v: bool(v) and set(v) <= set(KERNELS),
                             f"allowed: a comma list of {', '.join(KERNELS)}")


def main(argv) -> int:
    del argv
    a = FLAGS
    table = cases(a.seq, a.heads, a.topk, a.dtype)
    assert set(table) == set(KERNELS), (sorted(table), KERNELS)
    names = a.which
    print(f"compiling with the TPU compiler for one chip of {a.topology}", file=sys.stderr)
    mesh = _one_chip(a.topology)
    results = []
    for n in names:
        fn, args = table[n]
        r = {"name": n, "seq_len": a.seq, "dtype": a.dtype, **compile_one(fn, args, mesh)}
        r["input_bytes"] = int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in args))
        print(f"{n:12s} compile {r['compile_seconds']:7.1f} s  args {r['argument_bytes'] / 2**20:9.1f} MiB  "
              f"out {r['output_bytes'] / 2**20:9.1f} MiB  temp {r['temp_bytes'] / 2**20:9.1f} MiB",
              file=sys.stderr)
        results.append(r)
    if a.json:
        print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    run(main, define_flags)
