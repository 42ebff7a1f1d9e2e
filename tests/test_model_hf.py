"""Golden logits against HF transformers GlmMoeDsaForCausalLM fixtures, and HF checkpoint I/O."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from glm5_jax import hf, model
from glm5_jax.config import ModelConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
NAMES = ["hf_sparse", "hf_shared", "hf_grouped", "hf_dense_equiv"]


@pytest.mark.parametrize("name", NAMES)
def test_golden_logits_match_transformers(name):
    d = os.path.join(FIXTURES, name)
    cfg, params = hf.load_checkpoint(d)
    ids = np.load(os.path.join(d, "input_ids.npy"))
    want = np.load(os.path.join(d, "logits.npy"))
    got = np.asarray(jax.jit(lambda p, t: model.forward(cfg, p, t))(params, ids))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4


def test_fixtures_cover_required_properties():
    cfgs = {n: ModelConfig.from_hf(os.path.join(FIXTURES, n)) for n in NAMES}
    seqs = {n: np.load(os.path.join(FIXTURES, n, "input_ids.npy")).shape[1] for n in NAMES}
    assert any(seqs[n] >= 3 * c.index_topk for n, c in cfgs.items())          # sparsity exercised
    assert any("shared" in c.layer_indexer_types for c in cfgs.values())
    assert any(c.n_group > 1 for c in cfgs.values())
    for c in cfgs.values():                                                    # dense + MoE mixed
        assert 0 < c.first_k_dense < c.num_layers and c.num_experts > 0


def _assert_same_tree(a, b):
    fa, fb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), p


@pytest.mark.parametrize("shard", [None, 40_000])
def test_hf_round_trip_is_exact(tmp_path, shard):
    cfg, params = hf.load_checkpoint(os.path.join(FIXTURES, "hf_shared"))
    hf.save_checkpoint(cfg, params, tmp_path, max_shard_bytes=shard)
    if shard:
        assert os.path.exists(tmp_path / "model.safetensors.index.json")
    cfg2, params2 = hf.load_checkpoint(tmp_path)
    assert cfg2 == cfg
    _assert_same_tree(params, params2)


@pytest.mark.parametrize("variant", [dict(attention="gqa", num_kv_heads=2, indexer_types=None, mtp_depth=2, mtp_share=False),
                                     dict(attention="dsa", mtp_depth=3, mtp_share=True, n_group=2, topk_group=1)])
def test_round_trip_of_own_variants_with_mtp(tmp_path, variant):
    cfg = ModelConfig(**variant)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    hf.save_checkpoint(cfg, params, tmp_path)
    cfg2, params2 = hf.load_checkpoint(tmp_path)
    assert cfg2 == cfg
    _assert_same_tree(jax.tree_util.tree_map(np.asarray, params), params2)


def test_bad_checkpoints_name_the_key_and_shape(tmp_path):
    src = os.path.join(FIXTURES, "hf_sparse")
    from safetensors.numpy import load_file, save_file
    tensors = load_file(os.path.join(src, "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), tmp_path / "config.json")
    missing = dict(tensors)
    del missing["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight.*\[16, 32\]"):
        hf.load_checkpoint(tmp_path)
    bad = dict(tensors)
    bad["model.norm.weight"] = np.zeros((7,), np.float32)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(hf.CheckpointError, match=r"model\.norm\.weight.*\[7\].*\[32\]"):
        hf.load_checkpoint(tmp_path)
    extra = dict(tensors)
    extra["model.layers.9.foo.weight"] = np.zeros((2,), np.float32)
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(hf.CheckpointError, match="does not use"):
        hf.load_checkpoint(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf.load_checkpoint(tmp_path)


def test_config_hf_round_trip():
    for n in NAMES:
        with open(os.path.join(FIXTURES, n, "config.json")) as f:
            raw = json.load(f)
        cfg = ModelConfig.from_hf(raw)
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
        assert cfg.index_topk == raw["index_topk"] and cfg.num_experts == raw["n_routed_experts"]


def test_convert_hf_to_orbax_round_trip(tmp_path):
    from tools.convert_hf import convert, restore
    src = os.path.join(FIXTURES, "hf_grouped")
    cfg, params = hf.load_checkpoint(src)
    out = convert(src, str(tmp_path / "ckpt"))
    cfg2, params2 = restore(out)
    assert cfg2 == cfg
    _assert_same_tree(params, jax.tree_util.tree_map(np.asarray, params2))
    with pytest.raises(FileExistsError, match="already exists"):
        convert(src, out)
