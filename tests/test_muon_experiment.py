"""Attention-logit monitor (sown max |q.k|*scale == brute force from the module's own q and k) and an
end-to-end micro run of the muon_split experiment."""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from glm5_jax.attention.mha import GQAttention
from glm5_jax.attention.mla import MLAttention
from glm5_jax.config import ModelConfig
from glm5_jax.layers.rope import rope_angles
from glm5_jax.model import GLM5, init_params
from glm5_jax.train import TrainConfig
from glm5_jax.train.step import make_monitor_fn

B, T = 2, 12


def _cfg(attention):
    return ModelConfig(attention=attention, num_layers=2, num_heads=4, num_kv_heads=2 if attention == "gqa" else 4,
                       num_experts=0, mtp_depth=0, attn_chunk=4, initializer_range=0.2)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, T, 64)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    seg = jnp.asarray(np.array([[1] * 5 + [2] * 7, [3] * 12]), jnp.int32)   # two documents in row 0
    return x, pos, seg


def _brute(q, k, scale, seg):
    """max over (b, h, t, s) of |q_t . k_s| * scale over s <= t in the same segment (python loops)."""
    q, k, seg = np.asarray(q, np.float64), np.asarray(k, np.float64), np.asarray(seg)
    h, hk = q.shape[2], k.shape[2]
    best = 0.0
    for b in range(q.shape[0]):
        for head in range(h):
            kh = head // (h // hk)
            for t in range(q.shape[1]):
                for s in range(t + 1):
                    if seg[b, t] == seg[b, s]:
                        best = max(best, abs(float(q[b, t, head] @ k[b, s, kh])) * scale)
    return best


class _Capture:
    """Grabs the q and k the module passes to causal_attention (exactly what the attention sees)."""

    def __init__(self, module, monkeypatch):
        self.seen = {}
        real = module.causal_attention

        def spy(q, k, v, *, scale, segment_ids=None, chunk=256, **kw):
            self.seen.update(q=q, k=k, scale=scale)
            return real(q, k, v, scale=scale, segment_ids=segment_ids, chunk=chunk, **kw)

        monkeypatch.setattr(module, "causal_attention", spy)


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_monitor_matches_brute_force(attention, monkeypatch):
    import glm5_jax.attention.mha as mha_mod
    import glm5_jax.attention.mla as mla_mod
    c = _cfg(attention)
    x, pos, seg = _inputs()
    cap = _Capture(mla_mod if attention == "mla" else mha_mod, monkeypatch)
    cos, sin = rope_angles(pos, c.qk_rope_head_dim if c.is_mla else c.head_dim, c.rope_theta)
    mod = MLAttention(c) if attention == "mla" else GQAttention(c)
    params = mod.init(jax.random.PRNGKey(0), x, cos, sin, seg)["params"]
    _, st = mod.apply({"params": params}, x, cos, sin, seg, monitor_logits=True, mutable=["intermediates"])
    got = float(st["intermediates"]["max_attn_logit"][0])
    want = _brute(cap.seen["q"], cap.seen["k"], cap.seen["scale"], seg)
    assert want > 0.5          # large init: not a trivially tiny number
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # segment masking matters here: without it the max would be taken over more pairs
    assert want <= _brute(cap.seen["q"], cap.seen["k"], cap.seen["scale"], np.zeros_like(seg)) + 1e-9
    # off by default: nothing sown
    _, st = mod.apply({"params": params}, x, cos, sin, seg, mutable=["intermediates"])
    assert "max_attn_logit" not in st.get("intermediates", {})


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_model_monitor_fn_per_layer(attention):
    c = _cfg(attention)
    params = init_params(c, jax.random.PRNGKey(1))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (B, T), 0, c.vocab_size)
    _, pos, seg = _inputs()
    batch = {"tokens": tokens, "positions": pos, "segment_ids": seg}
    out = {k: float(v) for k, v in make_monitor_fn(c)(params, batch).items()}
    assert set(out) == {"max_attn_logit", "max_attn_logit/layer_0", "max_attn_logit/layer_1"}
    assert out["max_attn_logit"] == max(out["max_attn_logit/layer_0"], out["max_attn_logit/layer_1"])
    # the model-level sow agrees with the monitor fn and leaves the logits unchanged
    plain = GLM5(c).apply({"params": params}, tokens, pos, seg)["logits"]
    mon, st = GLM5(c).apply({"params": params}, tokens, pos, seg, monitor_logits=True, mutable=["intermediates"])
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(mon["logits"]))
    flat = traverse_util.flatten_dict(st["intermediates"])
    # scanned layout: both dense layers are one stack, layer 1 = index 1 of its leading axis
    stacked = flat[("dense_layers", "layer_0", "attn", "max_attn_logit")][0]
    assert stacked.shape == (2,)
    assert float(stacked[1]) == pytest.approx(out["max_attn_logit/layer_1"])


def test_monitor_every_validation():
    assert TrainConfig(monitor_every=0).monitor_every == 0
    with pytest.raises(ValueError, match="monitor_every"):
        TrainConfig(monitor_every=-1)


@pytest.mark.slow   # ~2 min of compiles on 2 cores; the full experiment run is in BUILD_NOTES
def test_muon_split_micro_run(tmp_path):
    from experiments.run import run_experiment
    from tests.test_experiments import MICRO
    micro = {**MICRO["muon_split"], "muon_lr_sweep": "0.001,0.003", "sweep_steps": "2", "seeds": "0,1"}
    report = run_experiment("muon_split", str(tmp_path), "tiny", micro)
    on_disk = json.load(open(tmp_path / "report.json"))
    # the regime search ran both LRs and the headline Muon arms use the one with the largest final logit
    sweep = on_disk["sweep"]
    assert [r["learning_rate"] for r in sweep] == [0.001, 0.003]
    best = max(sweep, key=lambda r: r["max_attn_logit"])["learning_rate"]
    assert on_disk["chosen_muon_learning_rate"] == best == on_disk["arms"]["mla_muon"]["learning_rate"]
    # two seeds: a t interval around the mean of the per-seed values
    for arm, v in on_disk["arms"].items():
        per = [on_disk["per_seed"][arm][s]["max_attn_logit"] for s in ("0", "1")]
        assert v["max_attn_logit"] == pytest.approx(sum(per) / 2)
        assert v["max_attn_logit_interval"]["lo"] <= v["max_attn_logit"] <= v["max_attn_logit_interval"]["hi"]
    assert os.path.exists(tmp_path / "seed_1" / "gqa_muon" / "metrics.jsonl")
    md = open(tmp_path / "report.md").read()
    assert "Regime search" in md and "Per seed" in md
    assert set(on_disk["arms"]) == {"mla_adamw", "mla_muon", "mla_muon_split", "gqa_muon"}
    for arm, v in on_disk["arms"].items():
        assert math.isfinite(v["final_eval_loss"]) and math.isfinite(v["max_attn_logit"]), arm
        assert v["max_attn_logit"] > 0
    assert report["arms"].keys() == on_disk["arms"].keys()
    for f in ("report.md", "eval_loss.png", "max_attn_logit.png"):
        assert os.path.exists(tmp_path / f)
    rows = [json.loads(l) for l in open(tmp_path / "mla_muon_split" / "metrics.jsonl")]
    assert all("max_attn_logit/layer_0" in r for r in rows)


def test_loss_spike_count_against_hand_count():
    """count_loss_spikes: a step after warm-up more than `nats` above the median of the previous window."""
    from experiments.muon_split import count_loss_spikes
    losses = [5.0, 4.0, 3.0, 3.4, 3.9, 2.9, 2.8, float("nan"), 2.7]
    # after warm-up 2: idx 3: 3.4 - median(5, 4, 3) = -0.6; idx 4: 3.9 - median(5, 4, 3, 3.4) = 3.9 - 3.7 = 0.2;
    # idx 7 nan: spike
    assert count_loss_spikes(losses, warmup=2, nats=0.5, window=20) == 1
    # window 1: idx 4 compares with 3.4 only: 0.5 is not > 0.5; with nats 0.4 it is a spike
    assert count_loss_spikes(losses, warmup=2, nats=0.4, window=1) == 2
    # the warm-up is not counted: a spike inside it is ignored
    assert count_loss_spikes([1.0, 9.0, 1.0], warmup=2, nats=0.5, window=5) == 0
    assert count_loss_spikes([1.0, 1.2, 1.1, 2.5], warmup=1, nats=1.0, window=5) == 1     # 2.5 - 1.15 > 1


def test_paired_difference_and_verdict_closed_form():
    """Per-seed differences split - plain with a t interval (t(2) = 4.303); the verdict follows its sign."""
    from experiments.muon_split import paired_difference, verdict
    from glm5_jax.intervals import trajectory_bands
    per = {"mla_muon": {"0": {"max_attn_logit": 10.0}, "1": {"max_attn_logit": 20.0}, "2": {"max_attn_logit": 30.0}},
           "mla_muon_split": {"0": {"max_attn_logit": 9.0}, "1": {"max_attn_logit": 18.0},
                              "2": {"max_attn_logit": 27.0}}}
    d = paired_difference(per, "mla_muon_split", "mla_muon", "max_attn_logit")
    assert d["per_seed"] == [-1.0, -2.0, -3.0] and d["mean"] == pytest.approx(-2.0) and d["n"] == 3
    assert d["hi"] - d["mean"] == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=2e-4)   # sd 1; t(2) to 3 decimals
    assert "not separated" in verdict(d)                                          # [-4.48, +0.48] holds 0
    assert "lowers" in verdict({"mean": -2.0, "lo": -3.0, "hi": -1.0, "n": 3})
    assert "not separated" in verdict({"mean": 0.1, "lo": -1.0, "hi": 1.2, "n": 3})
    assert "RAISES" in verdict({"mean": 2.0, "lo": 1.0, "hi": 3.0, "n": 3})
    assert "one seed" in verdict({"mean": 2.0, "lo": None, "hi": None, "n": 1})
    assert paired_difference(per, "mla_muon_split", "gqa_muon", "max_attn_logit") is None
    # a diverged (nan) seed is left out of the pairing
    per["mla_muon"]["2"]["max_attn_logit"] = float("nan")
    assert paired_difference(per, "mla_muon_split", "mla_muon", "max_attn_logit")["n"] == 2
    # trajectory bands: mean over runs at the shared monitor steps
    h1 = [{"step": 10, "max_attn_logit": 1.0}, {"step": 20, "max_attn_logit": 3.0}, {"step": 25, "loss": 1.0}]
    h2 = [{"step": 10, "max_attn_logit": 3.0}, {"step": 20, "max_attn_logit": 5.0}]
    b = trajectory_bands([h1, h2], "max_attn_logit")
    assert b["steps"] == [10, 20] and b["mean"] == [2.0, 4.0] and b["lo"][0] < 2.0 < b["hi"][0]
    b = trajectory_bands([h1], "max_attn_logit")
    assert b["lo"] == b["mean"] == b["hi"] == [1.0, 3.0]
