"""glm5_jax.attention.monitor.max_attention_logit against a brute-force numpy max over allowed pairs."""
import jax.numpy as jnp
import numpy as np

from glm5_jax.attention.monitor import max_attention_logit


def test_max_attention_logit_matches_bruteforce():
    rng = np.random.default_rng(6)
    b, t, s, h, hk, d = 2, 7, 11, 4, 2, 5
    q = rng.standard_normal((b, t, h, d)).astype(np.float32)
    k = rng.standard_normal((b, s, hk, d)).astype(np.float32)
    qseg = np.array([[0] * 3 + [1] * 4, [0] * 7])
    kseg = np.array([[0] * 7 + [1] * 4, [0] * 5 + [2] * 6])
    kr = np.repeat(k, h // hk, axis=2)
    logits = np.abs(np.einsum("bthd,bshd->bhts", q, kr)) * 0.3
    qpos = np.arange(t) + (s - t)
    causal = np.arange(s)[None, :] <= qpos[:, None]
    seg = qseg[:, :, None] == kseg[:, None, :]
    for is_causal in (False, True):
        mask = seg & causal[None] if is_causal else seg
        ref = np.where(mask[:, None], logits, 0).max(axis=(0, 2, 3))
        got = max_attention_logit(jnp.asarray(q), jnp.asarray(k), 0.3, causal=is_causal,
                                  q_segment_ids=jnp.asarray(qseg),
                                  kv_segment_ids=jnp.asarray(kseg), per_head=True,
                                  q_chunk=3, kv_chunk=4)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)
    full = max_attention_logit(jnp.asarray(q), jnp.asarray(kr), 0.3)
    np.testing.assert_allclose(float(full), logits.max(), rtol=1e-5)
