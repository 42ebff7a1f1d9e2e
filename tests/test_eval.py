"""glm5_jax.eval: the evaluator's LM loss equals the train step's eval figures exactly, its attention mass equals
glm5_jax.eval.selection's, and on a data:2 mesh of fake CPU devices every metric (LM loss, the
position-bucket loss, a retrieval probe) matches the unsharded evaluation to float32 rounding."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.config import ModelConfig
from glm5_jax.eval import LMLoss, PositionLoss, TokenOutputs, evaluate
from glm5_jax.eval.placement import local_rows, place_batch
from glm5_jax.model import init_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig(vocab_size=128, d_model=32, num_layers=2, num_heads=2, q_lora_rank=16, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, ffn_dim=64, num_experts=0, attention="dsa",
                  index_topk=8, index_n_heads=2, index_head_dim=8, mtp_depth=0, attn_chunk=32)


def batches(n=2, B=4, T=32, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        pos = np.stack([np.r_[np.arange(T // 2), np.arange(T - T // 2)]] * B).astype(np.int32)
        out.append({"tokens": rng.integers(0, 128, (B, T)).astype(np.int32),
                    "targets": rng.integers(0, 128, (B, T)).astype(np.int32), "positions": pos,
                    "segment_ids": (1 + (np.arange(T) >= T // 2)).astype(np.int32)[None].repeat(B, 0),
                    "loss_mask": (rng.random((B, T)) > 0.3).astype(np.int32)})
    out[0]["loss_mask"][1] = 0                           # a row without answers (the probe skips it)
    return out


def test_lm_loss_is_the_eval_step_s_and_outputs_agree():
    from glm5_jax.train.step import make_eval_step
    params = init_params(CFG, jax.random.PRNGKey(0))
    bs = batches()
    step = make_eval_step(CFG)
    tot = n = hit = 0.0
    for b in bs:
        jb = {k: jnp.asarray(v) for k, v in b.items()}
        s, c, pred = step(params, jb)
        tot, n = tot + float(s), n + float(c)
        hit += float(jnp.sum((pred == jb["targets"]) * jb["loss_mask"]))
    r = evaluate(CFG, params, bs, [LMLoss(), TokenOutputs(), PositionLoss(((0, 8), (8, 16)))])
    assert r["eval_loss"] == tot / n and r["eval_accuracy"] == hit / n          # bit for bit
    assert r["token_nll"].shape == (8, 32) and r["predictions"].shape == (8, 32)
    np.testing.assert_allclose(r["position_loss_sums"].sum(), tot, rtol=1e-5)  # every position in a bucket
    assert r["position_loss_counts"].sum() == n


def test_attention_mass_matches_the_selection_module():
    from glm5_jax.eval.selection import attention_mass as reference
    from glm5_jax.eval.metrics import attention_mass
    params = init_params(CFG, jax.random.PRNGKey(1))
    bk = ((0, 8), (8, 32))
    assert attention_mass(CFG, params, batches(), bk) == reference(CFG, params, batches(), bk)


def test_place_batch_replicates_rows_that_do_not_split():
    from glm5_jax.sharding import single_device_mesh
    b = place_batch(single_device_mesh(), batches(1, B=3)[0])
    assert b["tokens"].shape == (3, 32)
    assert local_rows(b["tokens"].sharding, 3) == [0, 1, 2]


def test_same_metrics_on_a_data_mesh():
    """data:2 on 2 of 8 fake CPU devices: the params on the mesh, every batch split over `data` (rows 4: even;
    a 3-row batch is replicated) -> the same figures as with no mesh."""
    code = textwrap.dedent("""
        import json, sys
        import jax, numpy as np
        sys.path.insert(0, %r)
        from tests.test_eval import CFG, batches
        from glm5_jax.eval import LMLoss, PositionLoss, RetrievalAccuracy, evaluate
        from glm5_jax.model import init_params
        from glm5_jax.sharding import make_mesh, param_shardings, shard_params
        assert len(jax.devices()) == 8
        params = init_params(CFG, jax.random.PRNGKey(0))
        mesh = make_mesh("data:2", jax.devices()[:2])
        sharded = shard_params(params, param_shardings(CFG, mesh))
        bs = batches(2) + batches(1, B=3, seed=5)
        metrics = [LMLoss(), PositionLoss(((0, 4), (4, 16))), RetrievalAccuracy()]
        ref = evaluate(CFG, params, bs, metrics, mesh=None)
        out = evaluate(CFG, sharded, bs, metrics)
        assert out["position_loss_sums"].shape == (11, 2)
        for k in ("eval_loss", "eval_accuracy", "retrieval_accuracy"):
            np.testing.assert_allclose(out[k], ref[k], rtol=2e-6, err_msg=k)
        np.testing.assert_allclose(out["position_loss_sums"], ref["position_loss_sums"], rtol=2e-6, atol=1e-5)
        np.testing.assert_array_equal(out["position_loss_counts"], ref["position_loss_counts"])
        np.testing.assert_array_equal(out["retrieval_accuracy_correct"], ref["retrieval_accuracy_correct"])
        print("OK", json.dumps({k: float(out[k]) for k in ("eval_loss", "retrieval_accuracy")}))
    """ % ROOT)
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
