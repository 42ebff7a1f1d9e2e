"""MTP self-speculative decoding (greedy only).

Draft: the MTP block (mtp_0 at every depth when config.mtp_share, else mtp_{k-1} for depth k)
proposes `num_draft` tokens. Depth k at position s follows GLM5.__call__'s MTP branch exactly:
    h_k[s] = MTPBlock(h_{k-1}[s], embed(token[s + k]))     (h_0 = main trunk output before final_norm)
and its head(final-normed h_k[e]) at the last verified position e proposes token e + k + 1. Each
depth owns a latent/KV (and DSA indexer-key) cache, because the MTP block holds a full decoder layer.

Per round (one jitted program): the MTP pass recomputes a window of the last 2 * num_draft positions
ending at e at every depth (rows of the window are the only cache entries that may have been
computed from drafts rejected since; everything before it was computed from committed tokens), using
committed tokens where known and this round's drafts beyond; then the main model verifies
[next token, draft_1..draft_n] at positions e+1..e+n+1 in one pass over its cache, accepts the
longest prefix of drafts equal to its own argmax, plus one bonus token (its argmax after that
prefix). The output is therefore identical to plain greedy decoding (up to float ties).

Acceptance length = mean over (row, verification step) of 1 + accepted drafts.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.infer import cache as kv
from glm5_jax.infer.decode import (PAD_ID, PREFILL_CHUNK, GenerateResult, _reasons, final_norm, head, model_step,
                                   mtp_block, prefill, prefill_chunks, prepare_prompts, resolve_max_len, stop_array)
from glm5_jax.layers.common import dtype_of


@dataclasses.dataclass
class SpeculativeResult(GenerateResult):
    acceptance_length: float = 0.0   # mean 1 + accepted drafts per (row, verification step)
    verify_steps: int = 0            # verification passes (rounds)
    tokens_per_s: float = 0.0        # generated tokens / wall time after prefill


def mtp_pass(config, n: int, params, mtp_caches, hbuf, seq, win_pos, wpos, e):
    """Run MTP depths 1..n over window positions win_pos [B, W] (slots wpos, -1 = don't write).

    hbuf [B, S, D]: main pre-norm hidden per position; seq [B, S']: committed tokens per position
    (valid up to e + 1); e [B]: last position the main model has processed. Returns
    (drafts [B, n] int32, the token proposed for positions e+2..e+n+1; new MTP caches;
    per-depth final-normed hidden [n, B, W, D]).
    """
    c = config
    b, w = win_pos.shape
    qpos = jnp.maximum(win_pos, 0)
    h = jnp.take_along_axis(hbuf, qpos[..., None], axis=1)
    col = jnp.clip(e - win_pos[:, 0], 0, w - 1)                 # window column holding position e
    drafts = jnp.zeros((b, n), jnp.int32)
    caches, normed = [], []
    for k in range(1, n + 1):
        tp = qpos + k
        from_seq = tp <= (e[:, None] + 1)
        t_seq = jnp.take_along_axis(seq, jnp.clip(tp, 0, seq.shape[1] - 1), axis=1)
        t_draft = jnp.take_along_axis(drafts, jnp.clip(tp - e[:, None] - 2, 0, n - 1), axis=1)
        tok = jnp.where(from_seq, t_seq, t_draft)
        h, hn, lc = mtp_block(c, params, k, h, tok, qpos, wpos, mtp_caches[k - 1])
        logits = head(c, params, hn[jnp.arange(b), col])
        drafts = drafts.at[:, k - 1].set(jnp.argmax(logits, axis=-1).astype(jnp.int32))
        caches.append(lc)
        normed.append(hn)
    return drafts, caches, jnp.stack(normed)


@functools.partial(jax.jit, static_argnums=(0, 1, 8))
def _spec_prefill(config, n, params, cache, hbuf, seq, tokens, lens, chunk):
    """The main trunk's chunked `prefill`, then the MTP depths over the prompt in the same chunks
    (chunk i's MTP caches are written before chunk i+1 attends them). Entries at the last
    num_draft positions before e depend on this pass's drafts: the first round's window rewrites them."""
    b, p = tokens.shape
    logits0, cache, x = prefill(config, params, cache, tokens, lens, True, chunk)
    hbuf = hbuf.at[:, :p].set(x.astype(hbuf.dtype))
    g0 = jnp.argmax(logits0, axis=-1).astype(jnp.int32)
    lp0 = jnp.take_along_axis(jax.nn.log_softmax(logits0, axis=-1), g0[:, None], axis=-1)[:, 0]
    seq = seq.at[:, :p].set(tokens)
    seq = kv.write(seq, lens[:, None], g0[:, None])
    e = lens - 1
    nc, c = prefill_chunks(p, chunk)

    def one_chunk(mtp, i):
        pos = jnp.broadcast_to(i * c + jnp.arange(c, dtype=jnp.int32), (b, c))
        _, mtp, _ = mtp_pass(config, n, params, mtp, hbuf, seq, jnp.minimum(pos, p - 1),
                             jnp.where(pos <= e[:, None], pos, -1), e)
        return mtp, None

    mtp, _ = jax.lax.scan(one_chunk, cache["mtp"], jnp.arange(nc, dtype=jnp.int32))
    return dict(cache, mtp=mtp), hbuf, seq, g0, lp0


def _spec_round(config, n, n_new, params, cache, hbuf, seq, e, out, out_lp, count, stopped, stops, acc):
    c = config
    b = e.shape[0]
    w = 2 * n
    win = e[:, None] - w + 1 + jnp.arange(w, dtype=jnp.int32)
    drafts, mtp, _ = mtp_pass(c, n, params, cache["mtp"], hbuf, seq, win, jnp.where(win >= 0, win, -1), e)
    # verify [committed next token, drafts] at positions e+1 .. e+n+1
    vpos = e[:, None] + 1 + jnp.arange(n + 1, dtype=jnp.int32)
    vtok = jnp.concatenate([jnp.take_along_axis(seq, e[:, None] + 1, axis=1), drafts], axis=1)
    x, layers = model_step(c, params, cache["layers"], vtok, vpos)
    hbuf = kv.write(hbuf, vpos, x)
    logits = head(c, params, final_norm(c, params, x))                       # [B, n+1, V]
    g = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), g[..., None], axis=-1)[..., 0]
    a = jnp.sum(jnp.cumprod((drafts == g[:, :n]).astype(jnp.int32), axis=1), axis=1)   # accepted drafts
    seq = kv.write(seq, vpos + 1, g)             # g_j is the token at e+2+j (committed for j <= a)
    # outputs, truncated at the first stop token
    active = ~stopped & (count < n_new)
    j = jnp.arange(n + 1)[None, :]
    is_stop = jnp.isin(g, stops) & (j <= a[:, None])
    any_stop = jnp.any(is_stop, axis=1)
    take = jnp.where(any_stop, jnp.argmax(is_stop, axis=1) + 1, a + 1)
    opos = jnp.where(active[:, None] & (j < take[:, None]), count[:, None] + j, -1)
    out = kv.write(out, opos, g)
    out_lp = kv.write(out_lp, opos, lp)
    count = count + jnp.where(active, take, 0)
    stopped = stopped | (active & any_stop)
    e = jnp.where(active, e + a + 1, e)
    acc = acc + jnp.stack([jnp.sum(jnp.where(active, a + 1, 0)), jnp.sum(active)]).astype(acc.dtype)
    cache = dict(cache, layers=layers, mtp=mtp)
    return cache, hbuf, seq, e, out, out_lp, count, stopped, acc, jnp.any(~stopped & (count < n_new))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _spec_loop(config, n, n_new, params, cache, hbuf, seq, e, out, out_lp, count, stopped, stops):
    """All rounds inside one lax.while_loop (no host round trip per verification step)."""
    def cond(st):
        return st[-1]

    def body(st):
        rounds, *rest = st[:-1]
        new = _spec_round(config, n, n_new, params, *rest[:-1], stops, rest[-1])
        return (rounds + 1, *new)

    acc = jnp.zeros((2,), jnp.int32)
    going = jnp.any(~stopped & (count < n_new))
    st = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, hbuf, seq, e, out, out_lp, count, stopped, acc, going))
    rounds, _, _, _, _, out, out_lp, count, stopped, acc, _ = st
    return out, out_lp, count, stopped, acc, rounds


def _check(config, num_draft):
    if config.mtp_depth < 1:
        raise ValueError("speculative decoding needs MTP weights: config.mtp_depth must be >= 1")
    if not isinstance(num_draft, int) or num_draft < 1:
        raise ValueError(f"num_draft must be an integer >= 1, got {num_draft!r}")
    if not config.mtp_share and num_draft > config.mtp_depth:
        raise ValueError(f"num_draft={num_draft} > mtp_depth={config.mtp_depth} with unshared MTP blocks "
                         "(each depth needs its own block); lower num_draft")


def speculative_generate(config, params, prompts, *, max_new_tokens: int, num_draft: int = 4,
                         stop_tokens: Sequence[int] = (), max_len: int | None = None,
                         temperature: float = 0.0, prefill_chunk: int = PREFILL_CHUNK) -> SpeculativeResult:
    """Greedy MTP speculative decoding; same outputs as generate(..., temperature=0).

    Only greedy is implemented (temperature must be 0). Internally the caches hold
    max_len + num_draft + 1 slots so the last verification pass never runs off the end.
    prefill_chunk: prompt tokens per prefill chunk, as in generate.
    """
    if temperature != 0:
        raise ValueError("speculative_generate is greedy-only: use temperature=0 (or generate() to sample)")
    _check(config, num_draft)
    tokens, lens = prepare_prompts(config, prompts)
    size = resolve_max_len(tokens.shape[1], max_new_tokens, max_len) + num_draft + 1
    prefill_chunks(tokens.shape[1], prefill_chunk)     # a bad prefill_chunk fails before any compilation
    b, n, n_new = tokens.shape[0], num_draft, int(max_new_tokens)
    dt = dtype_of(config.dtype)
    cache = kv.init_cache(config, b, size, mtp_depths=n)
    hbuf = jnp.zeros((b, size, config.d_model), dt)
    seq = jnp.zeros((b, size + 1), jnp.int32)
    stops = stop_array(stop_tokens)
    t0 = time.perf_counter()
    cache, hbuf, seq, g0, lp0 = _spec_prefill(config, n, params, cache, hbuf, seq, jnp.asarray(tokens),
                                              jnp.asarray(lens), int(prefill_chunk))
    out = jnp.full((b, n_new + n + 1), PAD_ID, jnp.int32).at[:, 0].set(g0)
    out_lp = jnp.zeros((b, n_new + n + 1), jnp.float32).at[:, 0].set(lp0)
    count = jnp.ones((b,), jnp.int32)
    stopped = jnp.isin(g0, stops)
    e = jnp.asarray(lens - 1)
    g0.block_until_ready()
    t1 = time.perf_counter()
    out, out_lp, count, stopped, acc, rounds = _spec_loop(config, n, n_new, params, cache, hbuf, seq, e, out,
                                                          out_lp, count, stopped, stops)
    rounds = int(rounds)
    t2 = time.perf_counter()
    raw = np.asarray(count)
    count = np.minimum(raw, n_new)
    stopped = np.asarray(stopped) & (raw <= n_new)      # a stop token cut off by max_new_tokens is "length"
    toks = np.asarray(out)[:, :n_new].copy()
    lps = np.asarray(out_lp)[:, :n_new].copy()
    mask = np.arange(n_new)[None, :] >= count[:, None]
    toks[mask], lps[mask] = PAD_ID, 0.0
    acc = np.asarray(acc)
    acc_len = float(acc[0] / acc[1]) if acc[1] else 0.0
    gen = int(count.sum())
    return SpeculativeResult(
        tokens=toks, logprobs=lps, lengths=count.astype(np.int32), finish_reasons=_reasons(stopped),
        stats={"prefill_s": t1 - t0, "decode_s": t2 - t1, "prompt_tokens": int(lens.sum()), "generated_tokens": gen},
        acceptance_length=acc_len, verify_steps=rounds, tokens_per_s=gen / max(t2 - t1, 1e-9))


def acceptance_length(config, params, prompts, num_draft: int = 4, max_new_tokens: int = 64) -> float:
    """Mean tokens accepted per verification step (1 + accepted drafts) of greedy MTP speculation."""
    return speculative_generate(config, params, prompts, max_new_tokens=max_new_tokens,
                                num_draft=num_draft).acceptance_length
