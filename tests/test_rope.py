"""RoPE scaling (default / linear / yarn): closed-form frequencies, the YaRN attention factors, the
rope_scaling config rules and HF config.json interop, and golden logits of a yarn model at 3x its
original context against HF transformers (tests/fixtures/hf_yarn, made by tools.make_hf_fixtures).

The closed forms here are written from YaRN's definition in terms of rotations (pair i turns
L / (2 pi theta^(2i/d)) times over the original context L), not from the reference's code."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import hf, model
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.layers.rope import inv_frequencies, rope_angles, rope_attention_factor, softmax_scale

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "hf_yarn")
DSV3 = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}                        # DeepSeek-V3's published rope_scaling
FIX = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0, "beta_slow": 0.5,
       "mscale": 1.0, "mscale_all_dim": 0.8}                         # the hf_yarn fixture's


def _yarn_closed_form(d, theta, s):
    """YaRN per pair i (numpy float64): base frequency w_i = theta^(-2i/d); pair i makes
    r_i = L w_i / (2 pi) turns over L tokens. The blend weight of the interpolated w_i / s is a
    linear ramp in i between i(beta_fast) and i(beta_slow), i(beta) being where r_i = beta (rounded
    outwards to whole pairs unless truncate=False), clipped to [0, d - 1]."""
    L = s["original_max_position_embeddings"]
    i = np.arange(d // 2, dtype=np.float64)
    w = theta ** (-2 * i / d)
    at = lambda beta: (d / 2) * math.log(L / (2 * math.pi * beta), theta)   # solves L w_i / 2pi = beta
    lo, hi = at(s.get("beta_fast", 32)), at(s.get("beta_slow", 1))
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    gamma = np.clip((i - lo) / ((hi - lo) or 0.001), 0, 1)                   # 0: keep w_i, 1: w_i / s
    return w * (1 - gamma) + (w / s["factor"]) * gamma, w, L * w / (2 * math.pi)


@pytest.mark.parametrize("dim,theta", [(8, 10000.0), (64, 10000.0), (64, 1e6), (16, 50000.0)])
def test_default_frequencies_any_theta(dim, theta):
    want = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    np.testing.assert_allclose(np.asarray(inv_frequencies(dim, theta)), want, rtol=2e-6)
    pos = np.array([[0, 1, 77, 4095]])
    cos, sin = rope_angles(jnp.asarray(pos), dim, theta)
    np.testing.assert_allclose(np.asarray(cos), np.cos(pos[..., None] * want), atol=2e-3)
    assert rope_attention_factor(None) == 1.0 and softmax_scale(dim, None) == dim ** -0.5


def test_linear_divides_every_frequency():
    s = {"type": "linear", "factor": 4.0}
    np.testing.assert_allclose(np.asarray(inv_frequencies(16, 1e4, s)), np.asarray(inv_frequencies(16, 1e4)) / 4,
                               rtol=1e-6)
    pos = jnp.asarray([[0, 4, 8, 400]])
    for a, b in zip(rope_angles(pos, 16, 1e4, s), rope_angles(pos // 4, 16, 1e4)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert rope_attention_factor(s) == 1.0 and softmax_scale(16, s) == 16 ** -0.5


@pytest.mark.parametrize("dim,theta,s", [
    (64, 10000.0, DSV3), (16, 10000.0, FIX), (16, 500.0, {**FIX, "truncate": False}),
    (64, 1e6, {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}),
    (8, 10000.0, {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64, "truncate": False})],
    ids=["deepseek_v3", "fixture", "no_truncate", "theta1e6_defaults", "dim8"])
def test_yarn_frequencies_match_closed_form(dim, theta, s):
    want, base, turns = _yarn_closed_form(dim, theta, s)
    got = np.asarray(inv_frequencies(dim, theta, s), np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    # YaRN's regimes: pairs that turn more than beta_fast times over L keep their frequency, pairs
    # that turn less than beta_slow times are interpolated by the factor (up to the whole-pair rounding)
    fast, slow = turns > s.get("beta_fast", 32), turns < s.get("beta_slow", 1)
    if not s.get("truncate", True):
        np.testing.assert_allclose(got[fast], base[fast], rtol=2e-6)
        np.testing.assert_allclose(got[slow], base[slow] / s["factor"], rtol=2e-6)
    assert np.all(got <= base * (1 + 1e-6)) and np.all(got >= base / s["factor"] * (1 - 1e-6))


def test_yarn_attention_factor_and_softmax_scale_closed_form():
    m = lambda f, k: 0.1 * k * math.log(f) + 1.0                 # YaRN's sqrt(1/t) = 0.1 ln(s) + 1
    # DeepSeek-V3: mscale == mscale_all_dim -> cos/sin unscaled, softmax scale x (0.1 ln 40 + 1)^2
    assert rope_attention_factor(DSV3) == pytest.approx(1.0)
    assert softmax_scale(192, DSV3) == pytest.approx(192 ** -0.5 * m(40, 1) ** 2)
    assert softmax_scale(192, DSV3) == pytest.approx(0.1 * 1.3689 ** 2 / 1.3856, rel=1e-3)
    # the fixture's: both effects
    assert rope_attention_factor(FIX) == pytest.approx(m(4, 1.0) / m(4, 0.8))
    assert softmax_scale(32, FIX) == pytest.approx(32 ** -0.5 * m(4, 0.8) ** 2)
    # no mscale keys: the paper's factor on cos/sin, softmax scale unchanged
    plain = {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 128}
    assert rope_attention_factor(plain) == pytest.approx(m(16, 1)) and softmax_scale(32, plain) == 32 ** -0.5
    assert rope_attention_factor({**plain, "attention_factor": 0.5}) == 0.5
    assert rope_attention_factor({**plain, "factor": 1.0}) == 1.0
    cos, sin = rope_angles(jnp.asarray([[0, 5, 100]]), 16, 1e4, FIX)
    np.testing.assert_allclose(np.asarray(cos ** 2 + sin ** 2), rope_attention_factor(FIX) ** 2, rtol=1e-5)


def test_rope_pieces_match_transformers():
    """The same numbers straight from transformers (optional: needs the .[fixtures] extra)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaAttention, GlmMoeDsaRotaryEmbedding
    for theta, s in [(1e4, DSV3), (1e4, FIX), (500.0, {**FIX, "truncate": False}), (5e4, {"type": "linear", "factor": 3.0}),
                     (1e6, {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}), (2e5, None)]:
        c = ModelConfig(qk_rope_head_dim=16, index_head_dim=16, rope_theta=theta, rope_scaling=s)
        cfg = GlmMoeDsaConfig(**{k: v for k, v in c.to_hf().items() if k not in ("architectures", "torch_dtype")})
        rot = GlmMoeDsaRotaryEmbedding(cfg)
        np.testing.assert_allclose(np.asarray(inv_frequencies(16, theta, c.rope_scaling_dict or None)),
                                   rot.inv_freq.numpy(), rtol=1e-6)
        assert rope_attention_factor(c.rope_scaling_dict or None) == pytest.approx(rot.attention_scaling, rel=1e-12)
        dn, dr = c.qk_nope_head_dim, c.qk_rope_head_dim
        assert softmax_scale(dn + dr, c.rope_scaling_dict) == pytest.approx(GlmMoeDsaAttention(cfg, 0).scaling, rel=1e-12)


# ----------------------------------------------------------------------------- config
BAD = [
    ({"type": "yarn", "factor": 4.0}, "needs keys"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fats": 8}, "unknown key"),
    ({"type": "linear", "factor": 4.0, "mscale_all_dim": 1.0}, "unknown key"),
    ({"type": "yarn", "factor": 0.0, "original_max_position_embeddings": 32}, "'factor' must be"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32.5}, "integer >= 1"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 1, "beta_slow": 2}, "beta_fast"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": -1}, "'mscale' must be"),
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "truncate": "yes"}, "'truncate'"),
    ({"type": "dynamic", "factor": 2.0}, "'type' must be one of ('default', 'linear', 'yarn')"),
    ({"type": "default", "factor": 2.0}, "'type' must be one of"),
    ({"type": "yarn", "rope_type": "linear", "factor": 2.0}, "disagree"),
]


@pytest.mark.parametrize("rs,rule", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_rope_scaling_names_the_rule(rs, rule):
    with pytest.raises(ConfigError) as err:
        ModelConfig(rope_scaling=rs)
    assert "ModelConfig.rope_scaling=" in str(err.value) and rule in str(err.value)


def test_rope_scaling_spellings_are_one_config():
    a = ModelConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": None})
    b = ModelConfig(rope_scaling=(("type", "yarn"), ("original_max_position_embeddings", 32), ("factor", 4.0)))
    assert a == b and hash(a) == hash(b)
    assert ModelConfig(rope_scaling={"type": "default"}).rope_scaling is None


@pytest.mark.parametrize("s", [None, {"type": "linear", "factor": 2.5}, DSV3, {**FIX, "truncate": False, "attention_factor": 1.1}])
def test_rope_config_round_trips_through_hf_config_json(tmp_path, s):
    c = ModelConfig(rope_theta=5e5, rope_scaling=s)
    (tmp_path / "config.json").write_text(json.dumps(c.to_hf()))
    assert ModelConfig.from_hf(tmp_path) == c
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["rope_parameters"]["rope_type"] == (s or {}).get("type", "default")
    assert raw["rope_parameters"]["rope_theta"] == 5e5


def test_older_rope_scaling_spelling_reads_as_transformers_does():
    base = {k: v for k, v in ModelConfig().to_hf().items() if k != "rope_parameters"}
    old = {**base, "rope_theta": 5e5, "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                                                     "beta_fast": 8, "mscale_all_dim": 0.8}}
    c = ModelConfig.from_hf(old)
    assert c.rope_theta == 5e5
    assert c.rope_scaling_dict == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                   "beta_fast": 8, "mscale_all_dim": 0.8}
    # no original_max_position_embeddings: transformers takes max_position_embeddings; a null factor
    # is max_position_embeddings / original_max_position_embeddings
    c = ModelConfig.from_hf({**base, "max_position_embeddings": 256,
                             "rope_parameters": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 64}})
    assert c.rope_scaling_dict["factor"] == 4.0
    c = ModelConfig.from_hf({**base, "max_position_embeddings": 256, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    assert c.rope_scaling_dict["original_max_position_embeddings"] == 256
    for bad, rule in [({"rope_type": "longrope", "factor": 2.0}, "allowed: default, linear, yarn"),
                      ({"rope_type": "default", "partial_rotary_factor": 0.5}, "partial_rotary_factor")]:
        with pytest.raises(ConfigError, match=rule):
            ModelConfig.from_hf({**base, "rope_parameters": bad})
    try:
        from transformers import GlmMoeDsaConfig
    except ImportError:
        return
    hf_cfg = GlmMoeDsaConfig(**{k: v for k, v in old.items() if k not in ("architectures", "torch_dtype")})
    assert hf_cfg.rope_parameters["rope_theta"] == 5e5 and hf_cfg.rope_parameters["rope_type"] == "yarn"


# ----------------------------------------------------------------------------- golden logits
def _fixture():
    cfg, params = hf.load_checkpoint(FIXTURE)
    return cfg, params, np.load(os.path.join(FIXTURE, "input_ids.npy")), np.load(os.path.join(FIXTURE, "logits.npy"))


def test_yarn_fixture_is_beyond_the_original_context_and_round_trips(tmp_path):
    cfg, params, ids, _ = _fixture()
    rs = cfg.rope_scaling_dict
    assert rs["type"] == "yarn" and ids.shape[1] >= 3 * rs["original_max_position_embeddings"]
    assert cfg.attention == "dsa" and ids.shape[1] > 4 * cfg.index_topk
    hf.save_checkpoint(cfg, params, tmp_path)
    assert hf.load_checkpoint(tmp_path)[0] == cfg


def _run(cfg, params, ids):
    return np.asarray(jax.jit(lambda p, t: model.forward(cfg, p, t))(params, ids))


def test_yarn_golden_logits_match_transformers():
    """Our logits equal HF's at T = 96 = 3x original_max_position_embeddings (max |diff| 1.8e-6 measured)."""
    cfg, params, ids, want = _fixture()
    diff = np.abs(_run(cfg, params, ids) - want).max()
    assert diff <= 1e-4, diff


@pytest.mark.slow
def test_each_yarn_piece_moves_the_logits():
    """Dropping any one of the YaRN pieces (the ramped frequencies, the cos/sin attention factor,
    the softmax mscale) moves the logits far from HF's: the fixture checks each of them."""
    cfg, params, ids, want = _fixture()
    rs = cfg.rope_scaling_dict
    att = rope_attention_factor(rs)
    ablations = {
        "plain_rope": None,
        "no_softmax_mscale": {**{k: v for k, v in rs.items() if k != "mscale_all_dim"}, "attention_factor": att},
        "no_cos_sin_factor": {**rs, "attention_factor": 1.0},
        # both ramp bounds past the last pair: every frequency kept, both attention factors as before
        "default_frequencies": {**rs, "beta_fast": 1e-6, "beta_slow": 1e-6},
    }
    for name, s in ablations.items():
        assert np.abs(_run(cfg.replace(rope_scaling=s), params, ids) - want).max() > 1e-2, name


@pytest.mark.slow
def test_yarn_cached_prefill_matches_transformers():
    """The decode path (chunked prefill through the KV cache) under yarn: the next-token
    distribution after 90 tokens equals HF's log-softmax at position 89."""
    from glm5_jax.infer import generate
    cfg, params, ids, want = _fixture()
    res = generate(cfg, params, ids[:, :90], max_new_tokens=1, temperature=0.0, prefill_chunk=32)
    lsm = jax.nn.log_softmax(jnp.asarray(want[:, 89]), axis=-1)
    np.testing.assert_array_equal(res.tokens[:, 0], np.asarray(lsm).argmax(-1))
    np.testing.assert_allclose(res.logprobs[:, 0], np.asarray(lsm).max(-1), atol=1e-4)
