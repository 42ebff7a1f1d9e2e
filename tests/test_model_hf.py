"""Golden logits against HF transformers GlmMoeDsaForCausalLM fixtures, and HF checkpoint I/O.

Every load runs with the scanned layer stacks (scan_layers=True, the default) and unrolled
(scan_layers=False): the parameter tree is the same, only the forward differs.
"""

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
SCAN = pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])


@SCAN
@pytest.mark.parametrize("name", NAMES)
def test_golden_logits_match_transformers(name, scan):
    d = os.path.join(FIXTURES, name)
    cfg, params = hf.load_checkpoint(d, scan_layers=scan)
    assert cfg.scan_layers is scan
    ids = np.load(os.path.join(d, "input_ids.npy"))
    want = np.load(os.path.join(d, "logits.npy"))
    got = np.asarray(jax.jit(lambda p, t: model.forward(cfg, p, t))(params, ids))
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("name", ["hf_sparse", "hf_shared"])
def test_golden_logits_match_transformers_with_the_mqa_gather(name):
    """DSA's sparse stage has two forms: at these short T the CPU default runs top-k-masked dense
    attention (what test_golden_logits_match_transformers checks), and dsa_short_dense=0 forces
    the MQA row gather (GLM-5's form at long T and on accelerators): the same HF logits."""
    import dataclasses
    from glm5_jax.attention.mla import short_sequence_dense
    d = os.path.join(FIXTURES, name)
    cfg, params = hf.load_checkpoint(d)
    ids = np.load(os.path.join(d, "input_ids.npy"))
    want = np.load(os.path.join(d, "logits.npy"))
    assert short_sequence_dense(cfg, ids.shape[1])
    cfg = dataclasses.replace(cfg, dsa_short_dense=0)
    assert not short_sequence_dense(cfg, ids.shape[1])
    got = np.asarray(jax.jit(lambda p, t: model.forward(cfg, p, t))(params, ids))
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
    cfg3, params3 = hf.load_checkpoint(tmp_path, scan_layers=False)     # one tree for both forwards
    assert cfg3 == cfg.replace(scan_layers=False)
    _assert_same_tree(params, params3)


def test_stacked_leaves_hold_hf_layers_in_order():
    """Slice r of `<stack>/layer_<j>` is HF layer stack.layer_index(r, j), read straight from the file;
    shared-indexer sub-layers have no indexer (and HF has none for those layers)."""
    from safetensors.numpy import load_file
    d = os.path.join(FIXTURES, "hf_shared")
    cfg, params = hf.load_checkpoint(d)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    assert {s.name for s in cfg.layer_stacks} | {"embed", "final_norm", "lm_head"} >= set(params)
    seen = set()
    for stack in cfg.layer_stacks:
        for j in range(stack.period):
            sub = params[stack.name][f"layer_{j}"]
            assert sub["input_norm"]["scale"].shape[0] == stack.repeats
            has_indexer = "indexer" in sub["attn"]
            assert has_indexer == (stack.indexer_types[j] == "full")
            for r in range(stack.repeats):
                i = stack.layer_index(r, j)
                seen.add(i)
                base = f"model.layers.{i}"
                np.testing.assert_array_equal(sub["attn"]["q_b_proj"]["kernel"][r],
                                              tensors[f"{base}.self_attn.q_b_proj.weight"].T)
                if stack.moe:
                    np.testing.assert_array_equal(sub["moe"]["experts"]["down_proj"][r, 1],
                                                  tensors[f"{base}.mlp.experts.1.down_proj.weight"].T)
                else:
                    np.testing.assert_array_equal(sub["mlp"]["up_proj"]["kernel"][r],
                                                  tensors[f"{base}.mlp.up_proj.weight"].T)
                assert (f"{base}.self_attn.indexer.wk.weight" in tensors) == has_indexer
    assert seen == set(range(cfg.num_layers))


@pytest.mark.parametrize("variant", [pytest.param(dict(attention="gqa", num_kv_heads=2, indexer_types=None, mtp_depth=2,
                                                       mtp_share=False), marks=pytest.mark.slow),
                                     dict(attention="dsa", mtp_depth=3, mtp_share=True, n_group=2, topk_group=1,
                                          num_layers=6,     # MoE stack: a repeated (full, shared) block + a tail
                                          indexer_types=("full", "full", "shared", "full", "shared", "full"))])
def test_round_trip_of_own_variants_with_mtp(tmp_path, variant):
    cfg = ModelConfig(**variant)
    params = jax.jit(lambda r: model.init_params(cfg, r))(jax.random.PRNGKey(0))   # jit: eager init is slow
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
