"""Subprocess for tests/test_hf_checkpoint.py: write a bfloat16 HF checkpoint (torch + safetensors, in
several files), then in a fresh process stream it onto 8 CPU devices and report peak host memory and
logits against the float32 reference.

    python -m tests.stream_load_worker small|large CKPT_DIR RESULT_JSON

Peak memory is the kernel's VmHWM (numpy / XLA allocations are invisible to tracemalloc); the
baseline is VmRSS after jax and the 8 devices are up. On CPU the loaded arrays themselves live in host
memory, so they are subtracted: overhead = VmHWM - baseline - bytes of every device's shards.
"""

import json
import os
import subprocess
import sys

SIZES = {   # small: ~25 MB (default test run); large: >= 200 MB (slow test)
    "small": dict(vocab_size=8192, d_model=384, num_layers=2, ffn_dim=1024, num_heads=4, q_lora_rank=128,
                  kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, index_n_heads=4,
                  index_head_dim=32, index_topk=8, num_experts=8, moe_ffn_dim=256, experts_per_tok=2,
                  first_k_dense=1, mtp_depth=1, param_dtype="bfloat16"),
    "large": dict(vocab_size=32768, d_model=1024, num_layers=4, ffn_dim=2048, num_heads=8, q_lora_rank=256,
                  kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=4,
                  index_head_dim=64, index_topk=8, num_experts=8, moe_ffn_dim=768, experts_per_tok=2,
                  first_k_dense=1, mtp_depth=1, param_dtype="bfloat16"),
}
MESH = "fsdp:4,expert:2"


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def make(size: str, path: str) -> None:
    """The checkpoint, written tensor by tensor with torch's safetensors writer into ~6 files."""
    import torch
    from flax import traverse_util
    from safetensors.torch import save_file

    from glm5_jax.config import ModelConfig
    from glm5_jax.hf import hf_entries
    from glm5_jax.model import abstract_params

    cfg = ModelConfig(**SIZES[size])
    keys = {}
    for p, leaf in traverse_util.flatten_dict(abstract_params(cfg)).items():
        leaf = leaf.unbox() if hasattr(leaf, "unbox") else leaf
        for key, shape, _, _ in hf_entries(p, tuple(leaf.shape), cfg):
            keys[key] = shape
    total = sum(2 * int(torch.tensor(s).prod()) if s else 2 for s in keys.values())
    per_file = total // 6 + 1
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    files, cur, size_ = [], {}, 0
    for key in sorted(keys):
        shape = keys[key]
        scale = 1.0 if "norm" in key else 0.05
        t = (torch.randn(shape, generator=gen) * scale + (1.0 if "norm" in key else 0.0)).to(torch.bfloat16)
        cur[key] = t
        size_ += t.numel() * 2
        if size_ >= per_file:
            files.append(cur)
            cur, size_ = {}, 0
    if cur:
        files.append(cur)
    weight_map = {}
    for i, shard in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(shard, os.path.join(path, name))
        weight_map.update({k: name for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    hf_cfg = cfg.to_hf()
    hf_cfg["torch_dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f)


def load(path: str, out: str) -> None:
    import jax
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from glm5_jax import hf, model
    from glm5_jax.sharding import make_mesh, use_mesh

    from glm5_jax.sharding import param_shardings

    mesh = make_mesh(MESH)
    assert len(jax.devices()) == 8
    # warm up what a load does whatever the checkpoint's size (trace the model for its parameter shapes
    # and shardings, the callback path) so the baseline holds it and the overhead is the tensors' own
    jax.block_until_ready(jax.make_array_from_callback((8, 8), NamedSharding(mesh, P("fsdp")),
                                                       lambda i: np.zeros((8, 8), np.float32)[i]))
    warm_cfg = hf.checkpoint_config(path)
    model.abstract_params(warm_cfg)
    param_shardings(warm_cfg, mesh)
    base = _kib("VmRSS")
    cfg, params = hf.load_checkpoint(path, mesh=mesh)
    jax.block_until_ready(params)
    peak = _kib("VmHWM")
    leaves = jax.tree_util.tree_leaves(params)
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    from safetensors import safe_open
    sizes, files = [], [f for f in os.listdir(path) if f.endswith(".safetensors")]
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            sizes += [f.get_slice(k).get_shape() for k in f.keys()]
    largest = max(2 * int(np.prod(s)) for s in sizes)
    ckpt_bytes = sum(2 * int(np.prod(s)) for s in sizes)

    # logits of the loaded bf16 params on the 8-device mesh against float32 params (the same values) on one
    # device, float32 compute in both: this checks every shard landed where it belongs (bf16 compute is
    # no parity check: DSA top-k and MoE routing are discrete, and bf16 rounding flips selections)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (8, 32)).astype(np.int32)
    with use_mesh(mesh):
        got = np.asarray(jax.jit(lambda p, t: model.forward(cfg.replace(dtype="float32"), p, t))(params, tokens))
    want_dtypes = {str(a.dtype) for a in jax.tree_util.tree_leaves(nn.unbox(model.abstract_params(cfg)))}
    del params
    ref_cfg, ref = hf.load_checkpoint(path, dtype="float32")
    want = np.asarray(jax.jit(lambda p, t: model.forward(ref_cfg.replace(dtype="float32"), p, t))(
        jax.tree_util.tree_map(jnp.asarray, ref), tokens))
    scale = float(np.abs(want).max())
    result = dict(baseline_bytes=base, peak_bytes=peak, held_bytes=held, overhead_bytes=peak - base - held,
                  largest_tensor_bytes=largest, checkpoint_bytes=ckpt_bytes, files=len(files),
                  param_dtypes=sorted({str(x.dtype) for x in leaves}), model_dtypes=sorted(want_dtypes),
                  sharded_leaves=sum(not x.sharding.is_fully_replicated for x in leaves),
                  max_abs_logit=scale, max_abs_logit_err=float(np.abs(got - want).max()),
                  tolerance=2 ** -6 * max(scale, 1.0))     # a few bf16 ulps of the logit scale
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def main(argv):
    size, path, out = argv[1:4]
    # the writer runs in its own process so its memory does not count towards the loader's peak
    subprocess.run([sys.executable, "-c", f"from tests.stream_load_worker import make; make({size!r}, {path!r})"],
                   check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    load(path, out)


if __name__ == "__main__":
    main(sys.argv)
