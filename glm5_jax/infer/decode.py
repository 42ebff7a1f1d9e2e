"""The model's cached pieces (trunk step, MTP block, head, chunked prefill) and the host-side helpers of
generation (prompt padding, cache size, stop ids, GenerateResult).

Generation itself runs on the paged runtime (glm5_jax.infer.runtime; `infer.generate` is
glm5_jax.infer.generation's driver of it); the runtime's programs and MTP speculation use the pieces here.
They run the model's own modules (`GLM5.__call__` with a cache, `GLM5.mtp_depth`).

`prefill` (MTP speculation's dense prefill): prompts are RIGHT-padded (pad id 0) to the longest prompt P.
Row b's tokens sit at positions 0..len_b-1 and cache slot == position, so each row's RoPE phases, visible
keys and DSA top-k ties are exactly those of running it alone. Prefill writes all P slots (garbage past
len_b), the first token is read from the logits at len_b - 1, and a decode step writes row b's token at
slot len_b + i - 1, overwriting the garbage before any query can see it (a query at position p sees slots
0..p only). Long prompts are prefilled in chunks: one program scans the chunks, each writing its slots
before attending slots 0..p.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.fields import require
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
