"""Cached autoregressive generation: prefill and decode as separate jitted programs.

Prefill and decode run the model's own modules (`GLM5.__call__` with a cache, `GLM5.mtp_depth`);
this module holds only the cache bookkeeping, the decode loop and sampling.

Batching: prompts are RIGHT-padded (pad id 0) to the longest prompt P. Row b's tokens sit at
positions 0..len_b-1 and cache slot == position, so each row's RoPE phases, visible keys and DSA
top-k ties are exactly those of running it alone. Prefill writes all P slots (garbage past len_b),
the first token is read from the logits at len_b - 1, and decode step i writes row b's token at
slot len_b + i - 1, overwriting the garbage before any query can see it (a query at position p
sees slots 0..p only). Long prompts are prefilled in chunks (`prefill`, generate's prefill_chunk):
one program scans the chunks, each writing its slots before attending slots 0..p.

Outputs: tokens past a row's end (after a stop token) are PAD_ID = 0 with log-prob 0.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.fields import require
from glm5_jax.infer import cache as kv
from glm5_jax.infer import sampling
from glm5_jax.model import GLM5

PAD_ID = 0


@dataclasses.dataclass
class GenerateResult:
    tokens: np.ndarray            # int32 [B, max_new_tokens], generated tokens only, PAD_ID after the end
    logprobs: np.ndarray          # float32 [B, max_new_tokens], 0 after the end
    lengths: np.ndarray           # int32 [B], generated tokens per row (a stop token counts)
    finish_reasons: list          # "stop" | "length" per row
    stats: dict = dataclasses.field(default_factory=dict)   # timings (seconds) and counts


# ----------------------------------------------------------------------------- model pieces
def _apply(config, params, *args, **kw):
    return GLM5(config).apply({"params": params}, *args, **kw)


def head(config, params, normed):
    """Final-normed hidden [.., D] -> float32 logits (lm_head or tied embedding)."""
    return _apply(config, params, normed, method=GLM5.head)


def final_norm(config, params, x):
    return _apply(config, params, x, method=lambda m, h: m.final_norm(h))


def model_step(config, params, layer_caches, tokens, pos, wpos=None, slots=None, pages=None):
    """Main trunk over new tokens [B, T] at positions pos [B, T] (written to slots wpos, default pos).
    slots [B]: the caches hold P rows per batch row ([repeats, B, P, S, ...]; GLM5's cache_slots).
    pages [B, n]: the caches are page pools, each row's page table (GLM5's cache_pages).
    Returns (pre-final-norm hidden [B, T, D], new layer caches)."""
    out = _apply(config, params, tokens, pos, cache=layer_caches, write_positions=wpos, return_hidden=True,
                 logits=False, cache_slots=slots, cache_pages=pages)
    return out["trunk"], out["cache"]


def mtp_block(config, params, k, h_prev, next_tokens, pos, wpos, lc):
    """MTP depth k over positions pos: -> (h [B,T,D], final-normed h, new cache)."""
    return _apply(config, params, k, h_prev, next_tokens, pos, cache=lc, write_positions=wpos,
                  method=GLM5.mtp_depth)


# ----------------------------------------------------------------------------- jitted programs
PREFILL_CHUNK = 2048   # default prompt tokens per prefill chunk (generate's prefill_chunk)


def prefill_chunks(prompt_len: int, prefill_chunk: int) -> tuple[int, int]:
    """(number of chunks n, chunk length c) for a P-token prompt: n = ceil(P / prefill_chunk) equal
    chunks of c = ceil(P / n) <= prefill_chunk tokens (the prompt is padded by fewer than n tokens)."""
    require("prefill_chunk", prefill_chunk, ValueError, integer=True, min=1, note="(prompt tokens per prefill chunk)")
    n = -(-int(prompt_len) // int(prefill_chunk))
    return n, -(-int(prompt_len) // n)


@functools.partial(jax.jit, static_argnums=(0, 5, 6))
def prefill(config, params, cache, tokens, lens, return_hidden: bool = False, chunk: int = PREFILL_CHUNK):
    """Right-padded prompts [B, P] -> (logits [B, V] at each row's last prompt token, cache[, hidden
    [B, P, D] before the final norm]).

    The prompt runs in n = ceil(P / chunk) chunks of c <= chunk tokens (`prefill_chunks`), one
    `model_step` per chunk inside a lax.scan: chunk i writes its keys at slots i*c .. i*c + c - 1 and
    its queries attend the cache (DSA: top-k over every slot written so far), so the largest
    attention temporaries are [B, c, heads, S] for S cache slots, never [P, P]. Slots >= P are not
    written (the padding of the last chunk)."""
    b, p = tokens.shape
    n, c = prefill_chunks(p, chunk)
    tokens = jnp.pad(tokens, ((0, 0), (0, n * c - p)))
    rows = jnp.arange(b)
    last = lens - 1

    def one_chunk(layers, i):
        start = i * c
        pos = jnp.broadcast_to(start + jnp.arange(c, dtype=jnp.int32), (b, c))
        x, layers = model_step(config, params, layers, jax.lax.dynamic_slice_in_dim(tokens, start, c, axis=1), pos,
                               jnp.where(pos < p, pos, -1))
        x_last = x[rows, jnp.clip(last - start, 0, c - 1)]          # [B, D]; kept for the chunk holding lens - 1
        return layers, (x_last, x if return_hidden else None)

    layers, (x_last, xs) = jax.lax.scan(one_chunk, cache["layers"], jnp.arange(n, dtype=jnp.int32))
    logits = head(config, params, final_norm(config, params, x_last[last // c, rows]))
    cache = dict(cache, layers=layers)
    if not return_hidden:
        return logits, cache
    return logits, cache, jnp.swapaxes(xs, 0, 1).reshape(b, n * c, -1)[:, :p]


def _decode_step(config, params, cache, tok, pos):
    x, layers = model_step(config, params, cache["layers"], tok[:, None], pos[:, None])
    return head(config, params, final_norm(config, params, x[:, 0])), dict(cache, layers=layers)


decode_step = jax.jit(_decode_step, static_argnums=0)
decode_step.__doc__ = "tok [B] at positions pos [B] -> (logits [B, V], cache). One token per row."


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), static_argnames="return_cache")
def _decode_loop(config, n_new, greedy, top_k, use_top_p, params, cache, logits0, lens, key, temperature,
                 top_p, stops, return_cache=False):
    """Sample the first token from logits0, then decode n_new - 1 more inside one lax.while_loop.
    return_cache: also return the final cache (a caller that donates the cache gets the loop in place)."""
    b = lens.shape[0]
    samp = functools.partial(sampling.sample, greedy=greedy, temperature=temperature, top_k=top_k,
                             use_top_p=use_top_p, top_p=top_p)
    tok0, lp0 = samp(jax.random.fold_in(key, 0), logits0)
    toks = jnp.full((b, n_new), PAD_ID, jnp.int32).at[:, 0].set(tok0)
    lps = jnp.zeros((b, n_new), jnp.float32).at[:, 0].set(lp0)
    stopped = jnp.isin(tok0, stops)
    state = (jnp.int32(1), cache, tok0, lens.astype(jnp.int32), toks, lps, stopped, jnp.ones((b,), jnp.int32))

    def cond(s):
        return (s[0] < n_new) & ~jnp.all(s[6])

    def body(s):
        i, cache, tok, pos, toks, lps, stopped, length = s
        logits, cache = _decode_step(config, params, cache, tok, pos)
        nxt, lp = samp(jax.random.fold_in(key, i), logits)
        active = ~stopped
        toks = toks.at[:, i].set(jnp.where(active, nxt, PAD_ID))
        lps = lps.at[:, i].set(jnp.where(active, lp, 0.0))
        length = length + active
        stopped = stopped | (active & jnp.isin(nxt, stops))
        return i + 1, cache, nxt, pos + 1, toks, lps, stopped, length

    s = jax.lax.while_loop(cond, body, state)
    return (s[4], s[5], s[7], s[6]) + ((s[1],) if return_cache else ())


# ----------------------------------------------------------------------------- host side
def prepare_prompts(config, prompts) -> tuple[np.ndarray, np.ndarray]:
    """int array [B, P] or ragged list of token lists -> (right-padded int32 [B, P], lengths [B])."""
    if isinstance(prompts, (np.ndarray, jax.Array)):
        arr = np.asarray(prompts)
        if arr.ndim != 2:
            raise ValueError(f"prompts array must be 2-D [batch, prompt_len], got shape {arr.shape}")
        rows = [list(r) for r in arr]
    else:
        rows = [list(np.asarray(r).reshape(-1)) for r in prompts]
    if not rows:
        raise ValueError("prompts is empty: need at least one prompt")
    for i, r in enumerate(rows):
        if len(r) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    lens = np.array([len(r) for r in rows], np.int32)
    out = np.full((len(rows), int(lens.max())), PAD_ID, np.int32)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    bad = (out < 0) | (out >= config.vocab_size)
    if bad.any():
        raise ValueError(f"prompt token ids must be in [0, vocab_size={config.vocab_size}); got {out[bad][:4].tolist()}")
    return out, lens


def resolve_max_len(prompt_len: int, max_new_tokens: int, max_len) -> int:
    require("max_new_tokens", max_new_tokens, ValueError, integer=True, min=1)
    need = int(prompt_len) + int(max_new_tokens)
    if max_len is None:
        return need
    if need > max_len:
        raise ValueError(f"prompt_len ({prompt_len}) + max_new_tokens ({max_new_tokens}) = {need} exceeds the "
                         f"cache size max_len={max_len}; raise max_len or shorten the request")
    return int(max_len)


def stop_array(stop_tokens) -> jax.Array:
    """Stop ids as int32 [max(8, n)] padded with -1 (never a token), so the jitted programs only
    recompile for more than 8 stop tokens."""
    ids = np.asarray(list(stop_tokens), np.int64).reshape(-1)
    out = np.full((max(8, ids.size),), -1, np.int32)
    out[:ids.size] = ids
    return jnp.asarray(out)


def _reasons(stopped) -> list:
    return ["stop" if s else "length" for s in np.asarray(stopped)]


def generate(config, params, prompts, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
             top_k: int = 0, seed: int = 0, stop_tokens: Sequence[int] = (), max_len: int | None = None,
             prefill_chunk: int = PREFILL_CHUNK) -> GenerateResult:
    """Sample up to max_new_tokens per prompt with the KV cache (temperature 0 = greedy).

    prompts: int array [B, P] or a list of token-id lists (ragged; right-padded internally).
    max_len: cache slots (default longest prompt + max_new_tokens); a request that needs more
    raises ValueError. stop_tokens: a row ends after emitting one (it is included in the output).
    prefill_chunk: prompt tokens per prefill chunk (`prefill`); a shorter prompt is one chunk.
    """
    sampling.validate(temperature, top_p, top_k)
    tokens, lens = prepare_prompts(config, prompts)
    size = resolve_max_len(tokens.shape[1], max_new_tokens, max_len)
    prefill_chunks(tokens.shape[1], prefill_chunk)     # a bad prefill_chunk fails before any compilation
    b = tokens.shape[0]
    cache = kv.init_cache(config, b, size)
    t0 = time.perf_counter()
    logits0, cache = prefill(config, params, cache, jnp.asarray(tokens), jnp.asarray(lens), False, int(prefill_chunk))
    logits0.block_until_ready()
    t1 = time.perf_counter()
    stops = stop_array(stop_tokens)
    toks, lps, length, stopped = _decode_loop(
        config, int(max_new_tokens), temperature == 0, int(top_k), top_p < 1.0, params, cache, logits0,
        jnp.asarray(lens), jax.random.PRNGKey(seed), jnp.float32(max(temperature, 1e-6)), jnp.float32(top_p), stops)
    toks = np.asarray(toks)
    t2 = time.perf_counter()
    length = np.asarray(length)
    return GenerateResult(tokens=toks, logprobs=np.asarray(lps), lengths=length.astype(np.int32),
                          finish_reasons=_reasons(stopped),
                          stats={"prefill_s": t1 - t0, "decode_s": t2 - t1, "prompt_tokens": int(lens.sum()),
                                 "generated_tokens": int(length.sum())})
