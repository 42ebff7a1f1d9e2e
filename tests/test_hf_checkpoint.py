"""GLM-5 checkpoints at scale: streamed sharded loads (peak host memory), FP8 block-scaled weights,
HF's indexer pattern fields, HF -> orbax -> HF round trips and starting a run from a checkpoint.

References are independent of glm5_jax.hf's reader/writer: FP8 and bf16 files are written by torch +
safetensors, expected FP8 values are dequantised here with np.kron, indexer patterns come from
transformers' GlmMoeDsaConfig (and hand-written lists), and memory is the kernel's VmHWM.
"""

import json
import os
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest

from glm5_jax import hf, model
from glm5_jax.config import ModelConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree_equal(a, b):
    fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), jax.tree_util.keystr(p)


# ----------------------------------------------------------------------------- indexer pattern fields
PATTERNS = [({"index_topk_pattern": "FSSF"}, ["full", "shared", "shared", "full"]),
            ({"index_topk_pattern": ["full", "full", "shared", "shared"]}, ["full", "full", "shared", "shared"]),
            ({"index_topk_freq": 2}, ["full", "full", "shared", "full"]),          # offset 2 (HF default)
            ({"index_topk_freq": 3, "index_skip_topk_offset": 1}, ["full", "shared", "shared", "full"]),
            ({}, ["full"] * 4)]


@pytest.mark.parametrize("fields,want", PATTERNS)
def test_indexer_types_follow_hf_pattern_fields(tmp_path, fields, want):
    with open(os.path.join(FIXTURES, "hf_sparse", "config.json")) as f:
        raw = json.load(f)
    del raw["indexer_types"]
    raw.update(fields)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = hf.read_hf_config(tmp_path)["indexer_types"]
    assert got == want
    try:                                                  # the definition these fields have in transformers
        from transformers import GlmMoeDsaConfig
    except ImportError:
        return
    assert GlmMoeDsaConfig(num_hidden_layers=4, **fields).indexer_types == want


def test_bad_indexer_pattern_is_named(tmp_path):
    with open(os.path.join(FIXTURES, "hf_sparse", "config.json")) as f:
        raw = json.load(f)
    del raw["indexer_types"]
    raw["index_topk_pattern"] = "FX"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(hf.CheckpointError, match="index_topk_pattern.*F \\(full\\) or S \\(shared\\)"):
        hf.read_hf_config(tmp_path)


# ----------------------------------------------------------------------------- FP8
def _quantize(w: np.ndarray, block: int):
    """DeepSeek-V3-style e4m3 block quantisation: per block scale = amax / 448."""
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    pad = np.zeros((bo * block, bi * block), np.float32)
    pad[:o, :i] = w
    amax = np.abs(pad.reshape(bo, block, bi, block)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    q = (w / np.kron(scale, np.ones((block, block), np.float32))[:o, :i]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _dequantize(q, scale, block):
    o, i = q.shape
    return q.astype(np.float32) * np.kron(scale, np.ones((block, block), np.float32))[:o, :i]


def test_fp8_checkpoint_loads_as_its_dequantised_values(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import save_file as torch_save
    src = os.path.join(FIXTURES, "hf_sparse")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        raw = json.load(f)
    block = 16                                           # several blocks and ragged edges at these sizes
    fp8, deq, n_q = {}, {}, 0
    for k, w in tensors.items():
        quantize = w.ndim == 2 and ".layers." in k and "norm" not in k and not k.endswith("mlp.gate.weight")
        if quantize:
            q, s = _quantize(w, block)
            fp8[k] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            fp8[k + "_scale_inv"] = torch.from_numpy(s)
            deq[k] = _dequantize(q, s, block)
            n_q += w.shape[0] % block != 0 or w.shape[1] % block != 0
        else:
            fp8[k], deq[k] = torch.from_numpy(w), w
    assert n_q > 0                                       # ragged blocks exercised
    (tmp_path / "fp8").mkdir()
    (tmp_path / "ref").mkdir()
    torch_save(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    save_file(deq, str(tmp_path / "ref" / "model.safetensors"))
    (tmp_path / "ref" / "config.json").write_text(json.dumps(raw))
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
                                  "activation_scheme": "dynamic"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(raw))
    for dtype in ("float32", "bfloat16"):
        cfg, got = hf.load_checkpoint(tmp_path / "fp8", dtype=dtype)
        cfg_ref, want = hf.load_checkpoint(tmp_path / "ref", dtype=dtype)
        assert cfg == cfg_ref and cfg.param_dtype == dtype
        _tree_equal(got, want)
    # a weight stored FP8 without its scales is refused by name
    del fp8["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"]
    torch_save(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(hf.CheckpointError, match=r"experts\.0\.up_proj\.weight.*no block scales"):
        hf.load_checkpoint(tmp_path / "fp8")


# ----------------------------------------------------------------------------- streamed sharded load
def _stream_load(tmp_path, size: str, timeout: int):
    out = tmp_path / "result.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "tests.stream_load_worker", size, str(tmp_path / "ckpt"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check_stream(r):
    # a load that held the whole model on the host (as the old loader did) could not pass this bound
    assert 2 * r["largest_tensor_bytes"] < r["checkpoint_bytes"]
    assert r["files"] >= 3
    assert r["overhead_bytes"] < 2 * r["largest_tensor_bytes"], r
    assert "bfloat16" in r["param_dtypes"] and r["param_dtypes"] == r["model_dtypes"]   # kept, not widened
    assert r["sharded_leaves"] > 0
    assert r["max_abs_logit_err"] <= r["tolerance"], r


def test_streamed_sharded_load_small(tmp_path):
    """A ~25 MB bfloat16 checkpoint in several files onto 8 CPU devices (the >= 200 MB run is slow)."""
    _check_stream(_stream_load(tmp_path, "small", 600))


@pytest.mark.slow
def test_streamed_sharded_load_200mb(tmp_path):
    r = _stream_load(tmp_path, "large", 1800)
    assert r["checkpoint_bytes"] >= 200e6
    _check_stream(r)


# ----------------------------------------------------------------------------- round trips and --init_from
def _hf_bytes(path):
    """{key: (dtype, shape, raw bytes)} read with safetensors' own reader."""
    from safetensors import safe_open
    out = {}
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                out[k] = (str(t.dtype), tuple(t.shape), t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def bf16_mtp_checkpoint(tmp_path_factory):
    """A bfloat16 HF checkpoint with an MTP layer and a (full, shared) indexer pattern, in 3+ files."""
    cfg = ModelConfig(num_layers=4, indexer_types=("full", "shared", "full", "shared"), mtp_depth=1,
                      param_dtype="bfloat16")
    params = jax.jit(lambda r: model.init_params(cfg, r))(jax.random.PRNGKey(3))
    d = tmp_path_factory.mktemp("hf_bf16")
    hf.save_checkpoint(cfg, params, d, max_shard_bytes=60_000)
    return cfg, d


def test_hf_orbax_hf_round_trip_is_bit_exact_with_mtp(tmp_path, bf16_mtp_checkpoint):
    pytest.importorskip("torch")
    from tools.convert_hf import convert, restore
    from tools.export_hf import export
    cfg, src = bf16_mtp_checkpoint
    ckpt = convert(str(src), str(tmp_path / "orbax"))
    cfg2, params = restore(ckpt)
    assert cfg2 == cfg and {np.asarray(x).dtype for x in jax.tree_util.tree_leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
    out = export(ckpt, str(tmp_path / "hf"), max_shard_bytes=100_000)
    want, got = _hf_bytes(src), _hf_bytes(out)
    assert any(k.startswith(f"model.layers.{cfg.num_layers}.eh_proj") for k in got)      # MTP layer written
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k] == want[k], k
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(out, "config.json")) as g:
        assert json.load(f) == json.load(g)
    with pytest.raises(FileExistsError, match="already holds"):
        export(ckpt, out)


def test_init_from_starts_from_the_checkpoint_exactly(tmp_path, bf16_mtp_checkpoint):
    from glm5_jax.train.checkpoint import InitFromError
    from glm5_jax.train.config import TrainConfig
    from glm5_jax.train.state import init_from, init_train_state
    from tools.convert_hf import convert
    cfg, src = bf16_mtp_checkpoint
    _, ref = hf.load_checkpoint(src)
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) % cfg.vocab_size
    logits = jax.jit(lambda p: model.forward(cfg, p, tokens))
    want = np.asarray(logits(ref))
    tcfg = TrainConfig(steps=1)
    orbax_dir = convert(str(src), str(tmp_path / "orbax"))
    for path in (src, orbax_dir):
        with init_from(path) as source:
            state, _ = init_train_state(cfg, tcfg)
        assert source.used == 1
        np.testing.assert_array_equal(np.asarray(logits(state["params"])), want)
    fresh, _ = init_train_state(cfg, tcfg)                  # outside the block: the seed again
    assert not np.array_equal(np.asarray(logits(fresh["params"])), want)
    with init_from(src), pytest.raises(InitFromError, match=r"num_layers=3 \(checkpoint: 4\).*--set model\.num_layers=4"):
        init_train_state(cfg.replace(num_layers=3, indexer_types=None), tcfg)
    with pytest.raises(InitFromError, match="no config.json"):
        with init_from(tmp_path):
            init_train_state(cfg, tcfg)
