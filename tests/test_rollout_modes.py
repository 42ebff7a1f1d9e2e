"""The rollout engine's coarse mismatch modes (int3, int2): per output channel, at most 2 * qmax + 1
distinct values (qmax = 2**(bits-1) - 1: 7 levels for int3, ternary for int2), each a multiple of the
channel's scale max|w| / qmax; vectors untouched."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.rl.rollout import MISMATCH_MODES, rollout_params


@pytest.mark.parametrize("mode,qmax", [("int3", 3), ("int2", 1)])
def test_coarse_modes_quantise_per_output_channel(mode, qmax):
    assert mode in MISMATCH_MODES
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 5)).astype(np.float32)           # kernel [in, out]
    params = {"dense": {"kernel": jnp.asarray(w), "bias": jnp.asarray(rng.normal(size=5).astype(np.float32))}}
    q = jax.device_get(rollout_params(params, mode))
    np.testing.assert_array_equal(q["dense"]["bias"], params["dense"]["bias"])
    for c in range(5):
        scale = np.abs(w[:, c]).max() / qmax
        codes = q["dense"]["kernel"][:, c] / scale
        np.testing.assert_allclose(codes, np.round(codes), atol=1e-4)          # integer multiples of the scale
        assert np.abs(np.round(codes)).max() <= qmax
        assert len(np.unique(np.round(codes))) <= 2 * qmax + 1
        np.testing.assert_allclose(codes, np.clip(np.round(w[:, c] / scale), -qmax, qmax), atol=1e-4)
