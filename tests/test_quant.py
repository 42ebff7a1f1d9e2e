"""INT4 quantiser: numpy reference, packing round trip, straight-through gradient, export == QAT forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.config import ModelConfig
from glm5_jax.model import forward, init_params
from glm5_jax.quant import (QuantConfig, dequantize, export_int4, fake_quant, fake_quant_ste, load_int4, pack_int4,
                            ptq_params, qat_params, quantize, quantized_paths, unpack_int4)


def _np_fake_quant(w, g, qmax=7):
    """Independent numpy reference: per (group of g input rows, output column) symmetric rounding."""
    w = np.asarray(w, np.float64)
    out = np.empty_like(w)
    for j in range(w.shape[1]):
        for i0 in range(0, w.shape[0], g):
            blk = w[i0:i0 + g, j]
            s = np.abs(blk).max() / qmax if np.abs(blk).max() > 0 else 1.0
            out[i0:i0 + g, j] = np.clip(np.round(blk / s), -qmax, qmax) * s
    return out


def test_fake_quant_matches_numpy_reference_and_levels():
    w = np.random.default_rng(0).normal(size=(16, 5)).astype(np.float32)
    w[4:8, 2] = 0.0                                           # an all-zero group keeps zeros
    cfg = QuantConfig(group_size=4)
    got = np.asarray(fake_quant(jnp.asarray(w), cfg))
    np.testing.assert_allclose(got, _np_fake_quant(w, 4), rtol=1e-6, atol=1e-7)
    codes, scales = quantize(jnp.asarray(w), cfg)
    assert scales.shape == (4, 5) and codes.dtype == jnp.int8
    assert int(jnp.max(jnp.abs(codes))) == 7                  # the group max maps to +-qmax
    # per group at most 15 distinct levels
    assert all(len(np.unique(got[i:i + 4, j])) <= 15 for i in range(0, 16, 4) for j in range(5))
    # group_size 0 = one group over the whole input dimension
    np.testing.assert_allclose(np.asarray(fake_quant(jnp.asarray(w), QuantConfig(group_size=0))),
                               _np_fake_quant(w, 16), rtol=1e-6, atol=1e-7)


def test_pack_unpack_round_trip_two_codes_per_byte():
    codes = np.random.default_rng(1).integers(-8, 8, size=(3, 6, 4)).astype(np.int8)
    packed = pack_int4(codes)
    assert packed.dtype == np.uint8 and packed.shape == (3, 12)
    assert int(packed[0, 0]) == (int(codes[0, 0, 0]) + 8) | ((int(codes[0, 0, 1]) + 8) << 4)
    np.testing.assert_array_equal(unpack_int4(packed, codes.shape), codes)
    with pytest.raises(ValueError, match="int4 codes"):
        pack_int4(np.array([[9, 0]]))


def test_straight_through_gradient_is_identity_and_forward_exact():
    w = jax.random.normal(jax.random.PRNGKey(0), (8, 3))
    cfg = QuantConfig(group_size=4)
    y = fake_quant_ste(w, cfg)
    assert jnp.array_equal(y, fake_quant(w, cfg))             # bit-exact forward
    c = jax.random.normal(jax.random.PRNGKey(1), (8, 3))
    g = jax.grad(lambda v: jnp.sum(fake_quant_ste(v, cfg) * c))(w)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(c))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="group_size"):
        fake_quant(jnp.ones((6, 2)), QuantConfig(group_size=4))
    with pytest.raises(ValueError, match="bits"):
        QuantConfig(bits=1)
    with pytest.raises(ValueError, match="pattern"):
        QuantConfig(pattern="(")
    with pytest.raises(ValueError, match="selects no matrix"):
        qat_params({"a": {"kernel": jnp.ones((4, 4))}}, QuantConfig(pattern="experts"))


def _moe_cfg():
    return ModelConfig(vocab_size=32, d_model=32, num_layers=2, ffn_dim=64, attention="mla", num_heads=2,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       num_experts=4, num_shared_experts=1, experts_per_tok=2, moe_ffn_dim=16, n_group=1,
                       topk_group=1, first_k_dense=1, mtp_depth=0, moe_impl="dense")


@pytest.mark.slow  # among the slowest default tests (suite budget: 15 min on 2 cores)
def test_export_dequantised_logits_bit_identical_to_qat_forward():
    cfg = _moe_cfg()
    params = init_params(cfg, jax.random.PRNGKey(0))
    q = QuantConfig(group_size=8)
    paths = quantized_paths(params, q)
    assert paths and all("experts" in p for p in paths)
    assert any("shared_experts" in p for p in paths)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 8), 0, cfg.vocab_size)
    fwd = jax.jit(lambda p: forward(cfg, p, tokens))
    qat_logits = fwd(qat_params(params, q))
    exported = export_int4(params, q)
    assert set(exported) == set(paths)
    e = exported[paths[0]]
    assert e["packed"].dtype == np.uint8 and e["packed"].size * 2 == int(np.prod(e["shape"]))
    exp_logits = fwd(load_int4(params, exported))
    assert jnp.array_equal(qat_logits, exp_logits)
    assert jnp.array_equal(fwd(ptq_params(params, q)), exp_logits)
    # and quantisation changed something (so the equality is not vacuous)
    assert not jnp.array_equal(fwd(params), exp_logits)
    # unselected leaves are untouched
    loaded = load_int4(params, exported)
    np.testing.assert_array_equal(np.asarray(loaded["embed"]["embedding"]), np.asarray(params["embed"]["embedding"]))


def test_dequantize_inverts_codes_times_scale():
    codes = jnp.array([[1, -2], [3, 7], [-7, 0], [2, 2]], jnp.int8)
    scales = jnp.array([[0.5, 1.0], [2.0, 0.25]], jnp.float32)
    want = np.array([[0.5, -2.0], [1.5, 7.0], [-14.0, 0.0], [4.0, 0.5]], np.float32)
    np.testing.assert_array_equal(np.asarray(dequantize(codes, scales)), want)
