"""Mixed precision as production trains (issue 31 item 2): ModelConfig(param_dtype="float32", dtype="bfloat16")
keeps float32 master weights and float32 optimizer state (AdamW moments follow the params' dtype, Muon's
momentum is float32), computes the step's matmuls in bf16, a checkpoint restores the float32 values bit-exactly,
and the HF export writes bf16 (each value the float32 master rounded to nearest even)."""

import json

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm5_jax import hf
from glm5_jax.config import ModelConfig
from glm5_jax.train.checkpoint import Checkpointer
from glm5_jax.train.config import TrainConfig
from glm5_jax.train.state import init_train_state
from glm5_jax.train.step import make_train_step

CFG = ModelConfig(num_layers=2, first_k_dense=1, mtp_depth=1, param_dtype="float32", dtype="bfloat16")


def _batch(tc):
    r = np.random.default_rng(0)
    tok = jnp.asarray(r.integers(0, CFG.vocab_size, (tc.batch_size, tc.seq_len)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(tc.seq_len, dtype=jnp.int32), tok.shape)
    return {"tokens": tok, "targets": jnp.roll(tok, -1, 1), "positions": pos,
            "segment_ids": jnp.ones_like(tok), "loss_mask": jnp.ones(tok.shape, jnp.float32)}


@pytest.mark.slow   # ~35 s: trains, checkpoints and resumes; test_muon_momentum_float32_and_hf_export_bf16 is the fast check
def test_float32_master_state_bf16_compute_and_exact_checkpoint(tmp_path):
    """AdamW: params and moments float32 after a step, the step's dots run in bf16, a checkpoint round trip is exact."""
    tc = TrainConfig(batch_size=2, seq_len=16, steps=2, optimizer="adamw")
    state, tx = init_train_state(CFG, tc)
    step = make_train_step(CFG, tc, tx)
    batch = _batch(tc)
    hlo = step.lower(state, batch).as_text()
    assert "bf16" in hlo, "no bf16 compute in the step"
    state, _ = step(state, batch)
    for leaf in jax.tree.leaves(state["params"]) + [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]:
        assert leaf.dtype == jnp.float32, leaf.dtype
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    ck.save(1, state)
    ck.wait()
    back, _ = ck.restore(1, state)
    ck.close()
    chex.assert_trees_all_equal_dtypes(state, back)
    chex.assert_trees_all_equal(state, back)


def test_muon_momentum_float32_and_hf_export_bf16(tmp_path):
    """muon_split's momentum is float32; save_checkpoint of float32 masters writes bf16 = the masters rounded."""
    tc = TrainConfig(batch_size=2, seq_len=16, steps=2, optimizer="muon_split")
    state, _ = init_train_state(CFG, tc)
    mom = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
    assert mom and all(x.dtype == jnp.float32 for x in mom)
    hf.save_checkpoint(CFG, state["params"], tmp_path)
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
    with open(tmp_path / "model.safetensors", "rb") as f:      # every tensor stored as BF16
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    cfg2, params2 = hf.load_checkpoint(str(tmp_path))
    assert cfg2.param_dtype == "bfloat16"
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(params2)):
        want = np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(b).astype(np.float32), want)
    # explicit float32 keeps the masters bit-exact
    hf.save_checkpoint(CFG, state["params"], tmp_path / "f32", dtype="float32")
    _, params3 = hf.load_checkpoint(str(tmp_path / "f32"))
    chex.assert_trees_all_equal(params3, state["params"])
