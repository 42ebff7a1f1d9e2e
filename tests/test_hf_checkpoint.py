"""GLM-5 checkpoints at scale: streamed sharded loads (peak host memory), FP8 block-scaled weights,
HF's indexer pattern fields, HF -> orbax -> HF round trips and starting a run from a checkpoint.

References are independent of glm5_jax.hf's reader/writer: FP8 and bf16 files are written by torch +
safetensors, expected FP8 values are dequantised here with np.kron, indexer patterns come from
transformers' GlmMoeDsaConfig (and hand-written lists), and memory is the kernel's VmHWM.
"""

import dataclasses
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
    # a shard's read (what a device's callback asks for): rows and columns off the block grid, read in
    # row chunks (a tiny chunk size forces several)
    monkey = pytest.MonkeyPatch()
    monkey.setattr(hf, "_READ_CHUNK", 100)
    reader = hf._Reader(str(tmp_path / "fp8"), (block, block))
    try:
        for key in ("model.layers.1.self_attn.q_b_proj.weight", "model.layers.2.mlp.experts.3.down_proj.weight"):
            o, i = deq[key].shape
            for idx in ((slice(5, o - 3), slice(3, i - 1)), (slice(o // 2, o), slice(0, i // 2)), (slice(0, o), slice(0, i))):
                np.testing.assert_array_equal(reader.read(key, idx), deq[key][idx])
        k = "model.embed_tokens.weight"
        np.testing.assert_array_equal(reader.read(k, (slice(7, 50), slice(4, 20))), tensors[k][7:50, 4:20])
    finally:
        reader.close()
        monkey.undo()
    # a weight stored FP8 without its scales is refused by name
    del fp8["model.layers.1.mlp.experts.0.up_proj.weight_scale_inv"]
    torch_save(fp8, str(tmp_path / "fp8" / "model.safetensors"))
    with pytest.raises(hf.CheckpointError, match=r"experts\.0\.up_proj\.weight.*no block scales"):
        hf.load_checkpoint(tmp_path / "fp8")


# ----------------------------------------------------------------------------- streamed sharded load
def _stream_load(tmp_path, size: str, timeout: int):
    pytest.importorskip("torch")                          # the checkpoint is written by torch's safetensors writer
    out = tmp_path / "result.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
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
    assert cfg2 == cfg
    _tree_equal(params, hf.load_checkpoint(src)[1])                 # bf16 leaves stay bf16
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


@pytest.mark.slow  # minutes on 2 cores (the default suite stays under 15 min); run with -m slow
def test_init_from_starts_from_the_checkpoint_exactly(tmp_path, bf16_mtp_checkpoint):
    from glm5_jax.train.checkpoint import InitFromError
    from glm5_jax.train.config import TrainConfig
    from glm5_jax.train.state import init_train_state
    from tools.convert_hf import convert
    cfg, src = bf16_mtp_checkpoint
    _, ref = hf.load_checkpoint(src)
    tokens = np.arange(16, dtype=np.int32).reshape(2, 8) % cfg.vocab_size
    logits = jax.jit(lambda p: model.forward(cfg, p, tokens))
    want = np.asarray(logits(ref))
    tcfg = TrainConfig(steps=1)
    orbax_dir = convert(str(src), str(tmp_path / "orbax"))
    for path in (src, orbax_dir):
        state, _ = init_train_state(cfg, tcfg.replace(init_from=str(path)))
        np.testing.assert_array_equal(np.asarray(logits(state["params"])), want)
    fresh, _ = init_train_state(cfg, tcfg)                  # no init_from: the seed again
    assert not np.array_equal(np.asarray(logits(fresh["params"])), want)
    with pytest.raises(InitFromError, match=r"num_layers=3 \(checkpoint: 4\).*--set model\.num_layers=4"):
        init_train_state(cfg.replace(num_layers=3, indexer_types=None), tcfg.replace(init_from=str(src)))
    with pytest.raises(InitFromError, match="no config.json"):
        init_train_state(cfg, tcfg.replace(init_from=str(tmp_path)))


def test_check_compatible_ignores_runtime_fields_and_names_model_fields():
    # how a run executes (chunking, remat, dispatch, dense-vs-gather DSA) may differ from the checkpoint's
    # run; what shapes or computes the model (num_layers) may not, and the error names the --set to add
    from glm5_jax.config import ModelConfig
    from glm5_jax.train.checkpoint import InitFromError, check_compatible
    ckpt = ModelConfig(num_layers=2, first_k_dense=1, num_experts=4, mtp_depth=0)
    check_compatible(ckpt.replace(moe_token_chunk=64, dsa_short_dense=0, remat="full", attn_chunk=64,
                                  moe_impl="dense"), ckpt, "ckpt")
    with pytest.raises(InitFromError, match=r"num_layers=3 \(checkpoint: 2\).*--set model\.num_layers=2"):
        check_compatible(ckpt.replace(num_layers=3), ckpt, "ckpt")


class _RandomBatches:
    def __init__(self, cfg, b=2, t=16):
        self.cfg, self.b, self.t, self.i = cfg, b, t, 0

    def __next__(self):
        self.i += 1
        rng = np.random.default_rng(self.i)
        toks = rng.integers(0, self.cfg.vocab_size, (self.b, self.t + 1)).astype(np.int32)
        return {"tokens": toks[:, :-1], "targets": toks[:, 1:], "positions": np.tile(np.arange(self.t), (self.b, 1)),
                "segment_ids": np.ones((self.b, self.t), np.int32), "loss_mask": np.ones((self.b, self.t), np.float32)}

    def get_state(self):
        return {"i": self.i}

    def set_state(self, s):
        self.i = s["i"]


@pytest.mark.slow
def test_training_run_is_a_source_for_init_from_and_export(tmp_path):
    """A run's workdir (its last checkpoint's params, its model from model_config.json) starts another
    run exactly and exports to HF with the MTP layer; run.py's --init_from reaches the experiment's train()."""
    from experiments import registry
    from experiments.run import run_experiment
    from glm5_jax.train.config import TrainConfig
    from glm5_jax.train.loop import train
    from glm5_jax.train.state import init_train_state
    from tools.export_hf import export
    cfg = ModelConfig(index_topk=4, mtp_depth=1, num_layers=2)
    tc = TrainConfig(steps=1, batch_size=2, seq_len=16, async_checkpoints=False, log_every=1)
    first = train(cfg, tc, _RandomBatches(cfg), str(tmp_path / "run"), log=lambda m: None)
    want = jax.tree_util.tree_map(np.asarray, first["params"])
    state, _ = init_train_state(cfg, tc.replace(init_from=str(tmp_path / "run")))
    _tree_equal(state["params"], want)
    out = export(str(tmp_path / "run"), str(tmp_path / "hf"), max_shard_bytes=0)
    cfg2, params2 = hf.load_checkpoint(out)
    assert cfg2 == cfg and "mtp_0" in params2
    _tree_equal(params2, want)

    # the experiment CLI's path: run_experiment(init_from=...) sets it on the config's TrainConfigs ->
    # every fresh train() of them starts from it
    seen = {}

    @dataclasses.dataclass(frozen=True)
    class Probe:
        model: ModelConfig = cfg
        train: TrainConfig = tc

    def probe(c, workdir, log, mesh=None):
        train(c.model, c.train.replace(steps=1), _RandomBatches(c.model), os.path.join(workdir, "arm"), log=log)
        seen["arm"] = os.path.join(workdir, "arm")
        return {"arms": {}}

    registry.register("h5_init_probe", "test probe", {"tiny": Probe()})(probe)
    try:
        report = run_experiment("h5_init_probe", str(tmp_path / "exp"), init_from=str(tmp_path / "hf"))
    finally:
        registry.REGISTRY.pop("h5_init_probe")
    assert report["init_from"] == str(tmp_path / "hf")
    # one step from the exported weights on the same batch == the first run's second step would differ;
    # what must hold is that step 1 started from `want`: the same update from the same start and batch
    # as a run initialised from those params directly
    direct = train(cfg, tc.replace(steps=1), _RandomBatches(cfg), str(tmp_path / "direct"), init_params=want,
                   log=lambda m: None)
    via_cli, _ = init_train_state(cfg, tc.replace(init_from=seen["arm"]))
    _tree_equal(via_cli["params"], jax.tree_util.tree_map(np.asarray, direct["params"]))


def test_init_from_cli_errors_exit_2(tmp_path, bf16_mtp_checkpoint):
    _, src = bf16_mtp_checkpoint
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    for path, msg in ((src, r"differs from the checkpoint.*--set model\."),):   # before anything compiles
        proc = subprocess.run([sys.executable, "-m", "experiments.run", "--config=muon_split", f"--init_from={path}",
                               f"--workdir={tmp_path / 'w'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert __import__("re").search(msg, proc.stderr), proc.stderr[-2000:]
