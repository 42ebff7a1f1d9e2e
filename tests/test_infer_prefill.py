"""Chunked prefill (glm5_jax.infer.decode.prefill, generate(prefill_chunk=...)): an 8K-token prompt
prefilled chunk by chunk gives the full forward's logits, greedy generation after it equals
generation after a one-chunk prefill, and the chunked program holds no [T, T]-sized array.
Ragged rows in chunks: tests/test_infer_decode.py (dsa-prefill_chunk3); speculative decoding after
a chunked prefill: tests/test_infer_speculative.py (slow).

Reference: `model.forward` on the whole prompt (the training path: flash / sparse attention over
the sequence itself, no cache), against prefill's absorbed attention over the latent cache.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax import model
from glm5_jax.config import preset
from glm5_jax.infer import decode, generate
from glm5_jax.infer import cache as kv

T, CHUNK, NEW = 8192, 1024, 6
# float32 logits of magnitude <= ~1: the cached (absorbed) and training (expanded / MQA) forms of the
# same attention differ by summation order only, measured max |diff| 3e-7 on both kinds; 1e-5 is
# ~30x that and still far below any difference a wrong key set or a missed chunk would make.
TOL = dict(rtol=1e-5, atol=1e-5)


@functools.lru_cache(maxsize=None)
def _setup(kind):
    cfg = preset("tiny", attention=kind, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, T), 0, cfg.vocab_size, jnp.int32)
    return cfg, params, tokens


def _arrays_with_two_dims_at_least(hlo_text: str, t: int) -> set:
    """Shapes in an HLO module's text (f32[1,1024,4,8200] ...) with two or more dims >= t."""
    shapes = set(re.findall(r"[a-z][a-z0-9]*\[([0-9,]+)\]", hlo_text))
    return {s for s in shapes if sum(int(d) >= t for d in s.split(",")) >= 2}


# dsa in the default suite; mla and the greedy check are slow-marked (suite budget: 15 min on 2 cores)
@pytest.mark.parametrize("kind", ["dsa", pytest.param("mla", marks=pytest.mark.slow)])
def test_chunked_prefill_8k_equals_full_forward(kind):
    """8 chunks of 1024 over an 8192-token prompt == model.forward at every chunk boundary and the
    last positions; DSA's top-k (index_topk=16) then selects among all cached keys of earlier chunks."""
    cfg, params, tokens = _setup(kind)
    want = np.asarray(jax.jit(lambda p, t: model.forward(cfg, p, t))(params, tokens))[0]
    cache = kv.init_cache(cfg, 1, T + NEW)
    lens = jnp.asarray([T], jnp.int32)
    compiled = decode.prefill.lower(cfg, params, cache, tokens, lens, True, CHUNK).compile()
    one_chunk = decode.prefill.lower(cfg, params, cache, tokens, lens, True, T).compile()   # compiled, never run
    # no [T, T]-sized array anywhere in the optimised program (a chunk's scores are [1, CHUNK, heads, S]);
    # the check can fail: one chunk of T tokens builds [1, T, heads, S] scores
    assert _arrays_with_two_dims_at_least(compiled.as_text(), T) == set()
    assert _arrays_with_two_dims_at_least(one_chunk.as_text(), T)
    # temporaries scale with the chunk (measured: 270 vs 2126 MiB dsa, 396 vs 3142 MiB mla)
    temp = lambda c: c.memory_analysis().temp_size_in_bytes
    assert temp(compiled) < temp(one_chunk) / 4
    logits, _, hidden = compiled(params, cache, tokens, lens)
    at = sorted({0, T - 2, T - 1} | {j * CHUNK + d for j in range(1, T // CHUNK) for d in (-1, 0)})
    got = decode.head(cfg, params, decode.final_norm(cfg, params, hidden[0, np.array(at)]))
    np.testing.assert_allclose(np.asarray(got), want[at], **TOL)
    np.testing.assert_allclose(np.asarray(logits)[0], want[-1], **TOL)


@pytest.mark.slow
def test_greedy_after_chunked_prefill_equals_one_chunk_8k():
    cfg, params, tokens = _setup("dsa")
    chunked = generate(cfg, params, tokens, max_new_tokens=NEW, temperature=0.0, prefill_chunk=CHUNK)
    whole = generate(cfg, params, tokens, max_new_tokens=NEW, temperature=0.0, prefill_chunk=T)
    np.testing.assert_array_equal(chunked.tokens, whole.tokens)
    np.testing.assert_allclose(chunked.logprobs, whole.logprobs, **TOL)


def test_prefill_chunks_and_errors():
    assert decode.prefill_chunks(8192, 2048) == (4, 2048)
    assert decode.prefill_chunks(100, 2048) == (1, 100)           # a shorter prompt is one chunk
    assert decode.prefill_chunks(2049, 2048) == (2, 1025)         # equal chunks, padding < n tokens
    assert decode.prefill_chunks(7, 3) == (3, 3)
    cfg, params, _ = _setup("mla")
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="prefill_chunk=.* is invalid: must be an integer >= 1"):
            generate(cfg, params, [[1, 2]], max_new_tokens=2, prefill_chunk=bad)
