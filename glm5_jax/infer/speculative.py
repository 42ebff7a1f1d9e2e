"""MTP self-speculative decoding: greedy, and sampled with rejection-sampling verification.

Draft: the MTP block (mtp_0 at every depth when config.mtp_share, else mtp_{k-1} for depth k)
proposes `num_draft` tokens. Depth k at position s follows GLM5.__call__'s MTP branch exactly:
    h_k[s] = MTPBlock(h_{k-1}[s], embed(token[s + k]))     (h_0 = main trunk output before final_norm)
and its head(final-normed h_k[e]) at the last verified position e proposes token e + k + 1. Each
depth owns a latent/KV (and DSA indexer-key) cache, because the MTP block holds a full decoder layer.

Per round (`speculative_step`, one jitted program with the rest of the loop): the MTP pass recomputes
a window of the last 2 * num_draft positions ending at e at every depth (rows of the window are the
only cache entries that may have been computed from drafts rejected since; everything before it was
computed from committed tokens), using committed tokens where known and this round's drafts beyond;
then the main model verifies [next token, draft_1..draft_n] at positions e+1..e+n+1 in one pass over
its cache.

Greedy (temperature 0): drafts are the MTP argmax; the longest prefix of drafts equal to the main
model's argmax is accepted, plus one bonus token (its argmax after that prefix). The output is
identical to plain greedy decoding (up to float ties).

Sampled (temperature > 0, per-row temperature / top_k / top_p / key): draft k is drawn from q_k, the
MTP head's distribution under the row's filters (`sampling.probs_rows`); the target p_j is the main
model's distribution under the same filters at verify position j. `rejection_sample` accepts draft j
with probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection it draws from
normalize(max(p_j - q_j, 0)); when all n are accepted the bonus token is drawn from p_n. Each emitted
token is then distributed exactly as plain sampling's (Leviathan et al. 2023; Chen et al. 2023), and
the probability that draft j is accepted, given the prefix, is sum_x min(p_j(x), q_j(x)) (tested by
counting). Greedy rows are the temperature -> 0 limit: p and q one-hot, so acceptance is "draft ==
argmax" and the residual is the target's argmax.

Acceptance length = mean over (row, verification step) of 1 + accepted drafts; per-depth acceptance
(stats["acceptance_per_depth"][k-1] = P(draft k accepted) over active (row, step) pairs, i.e. the
fraction of steps accepting at least k drafts) shows where acceptance collapses.
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
    (drafts [B, n] int32, the MTP argmax for positions e+2..e+n+1; new MTP caches;
    per-depth final-normed hidden [n, B, W, D]).
    """
    h = jnp.take_along_axis(hbuf, jnp.maximum(win_pos, 0)[..., None], axis=1)
    drafts, caches, normed, _ = mtp_window(config, n, params, mtp_caches, h, seq, jnp.zeros_like(e), win_pos, wpos, e)
    return drafts, caches, normed


def mtp_window(config, n, params, mtp_caches, h, seqw, base, win_pos, wpos, e, draw=None, heads: bool = True):
    """The MTP depths over positions win_pos [B, W] (slots wpos, -1 = don't write), the one MTP pass of
    every speculative program (slot or paged cache: `mtp_caches` are the depths' buffers or `LayerCache`s).

    h [B, W, D]: the trunk's pre-norm hidden at win_pos; seqw [B, L]: committed tokens at positions
    base[b] .. base[b] + L - 1 (valid up to e + 1); e [B]: last position the trunk has processed. Depth k
    at position s reads the token at s + k: committed up to e + 1, this pass's drafts beyond. heads: depth
    k's head at the column holding e proposes draft k (the argmax, or draw(k, logits [B, V]) -> (tokens
    [B], distribution [B, V])); heads=False only writes the caches (a prefill's rows, whose tokens are
    all committed). Returns (drafts [B, n], caches, final-normed hidden [n, B, W, D], distributions [B, n, V]
    or None)."""
    c = config
    b, w = win_pos.shape
    qpos = jnp.maximum(win_pos, 0)
    col = jnp.clip(e - win_pos[:, 0], 0, w - 1)                 # window column holding position e
    drafts = jnp.zeros((b, n), jnp.int32)
    caches, normed, qs = [], [], []
    for k in range(1, n + 1):
        tp = qpos + k
        from_seq = tp <= (e[:, None] + 1)
        t_seq = jnp.take_along_axis(seqw, jnp.clip(tp - base[:, None], 0, seqw.shape[1] - 1), axis=1)
        t_draft = jnp.take_along_axis(drafts, jnp.clip(tp - e[:, None] - 2, 0, n - 1), axis=1)
        tok = jnp.where(from_seq, t_seq, t_draft)
        h, hn, lc = mtp_block(c, params, k, h, tok, qpos, wpos, mtp_caches[k - 1])
        caches.append(lc)
        normed.append(hn)
        if not heads:
            continue
        logits = head(c, params, hn[jnp.arange(b), col])
        if draw is None:
            d = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            d, q = draw(k, logits)
            qs.append(q)
        drafts = drafts.at[:, k - 1].set(d)
    return drafts, caches, jnp.stack(normed), (jnp.stack(qs, axis=1) if qs else None)


def draft_sampler(ks, temperature, top_k, top_p):
    """draw(k, logits) for `mtp_window`: depth k's draft drawn with key ks[:, k - 1] from the row's filtered
    distribution (`sampling.probs_rows`), returned with that distribution."""
    def draw(k, logits):
        q, lq = sampling.probs_rows(logits, temperature, top_k, top_p)
        return jax.vmap(jax.random.categorical)(ks[:, k - 1], lq).astype(jnp.int32), q
    return draw


def verify(logits, drafts, q, key, temperature, top_k, top_p, *, greedy: bool):
    """The target's verification of n drafts: logits [B, n+1, V] at the verify positions (after the
    committed next token and after each draft), drafts [B, n], q [B, n, V] the drafts' distributions
    (None when greedy), key [B] (sampled rows' verification draws) -> (tokens [B, n+1], their log-probs
    [B, n+1], accepted [B]): greedy, the longest prefix of drafts equal to the argmax plus the argmax after
    it; sampled, `rejection_sample`. Log-probs: greedy rows the temperature-1 log-softmax, sampled rows the
    filtered target's."""
    b, n1, _ = logits.shape
    n = n1 - 1
    model_lp = jax.nn.log_softmax(logits, axis=-1)
    if greedy:
        g = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        a = jnp.sum(jnp.cumprod((drafts == g[:, :n]).astype(jnp.int32), axis=1), axis=1)   # accepted drafts
        return g, jnp.take_along_axis(model_lp, g[..., None], axis=-1)[..., 0], a
    rep = lambda t: jnp.repeat(t, n + 1)
    p, lpp = sampling.probs_rows(logits.reshape(b * (n + 1), -1), rep(temperature), rep(top_k), rep(top_p))
    g, a = rejection_sample(key, p.reshape(b, n + 1, -1), q, drafts)
    lpp = lpp.reshape(b, n + 1, -1)
    pick = lambda t: jnp.take_along_axis(t, g[..., None], axis=-1)[..., 0]
    return g, jnp.where((temperature <= 0)[:, None], pick(model_lp), pick(lpp)), a


def _split_rows(keys, num: int):
    """keys [B] (raw uint32 [B, 2] or typed) -> [B, num] independent keys per row."""
    return jax.vmap(lambda k: jax.random.split(k, num))(keys)


def rejection_sample(keys, target_probs, draft_probs, drafts):
    """Speculative verification by rejection sampling (a pure function; any vocabulary size).

    keys [B]: one PRNG key per row. target_probs [B, n+1, V]: p_j, the target's distribution at verify
    position j given the context and drafts[:, :j] (p_n: after all n drafts). draft_probs [B, n, V]: q_j,
    the distribution drafts[:, j] was drawn from. drafts [B, n] int.

    Returns (tokens int32 [B, n+1], accepted int32 [B]): with a = accepted, tokens[:, :a] = drafts[:, :a]
    (draft j kept with probability min(1, p_j(x_j) / q_j(x_j)), in order, up to the first rejection) and
    tokens[:, a] the token after them: drawn from normalize(max(p_a - q_a, 0)) after a rejection
    (from p_a where that residual is all zero, i.e. p_a == q_a), from p_n when all n were accepted. So the
    row's a + 1 new tokens are distributed exactly as sampling them one by one from the target;
    tokens[:, a + 1:] are meaningless. With one-hot p and q (greedy) this is "accept while draft ==
    argmax p, then argmax p".
    """
    p = jnp.asarray(target_probs, jnp.float32)
    q = jnp.asarray(draft_probs, jnp.float32)
    b, n1, v = p.shape
    n = n1 - 1
    if q.shape != (b, n, v) or drafts.shape != (b, n):
        raise ValueError(f"rejection_sample: target_probs {p.shape} needs draft_probs [B, n, V] = {(b, n, v)} and "
                         f"drafts [B, n] = {(b, n)}; got {q.shape} and {drafts.shape}")
    drafts = drafts.astype(jnp.int32)
    ks = _split_rows(keys, 2)
    u = jax.vmap(lambda k: jax.random.uniform(k, (n,)))(ks[:, 0])               # [B, n]
    px = jnp.take_along_axis(p[:, :n], drafts[..., None], axis=-1)[..., 0]
    qx = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ok = u * qx < px                                                             # P = min(1, p / q)
    accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    resid = jnp.maximum(p - jnp.concatenate([q, jnp.zeros((b, 1, v), q.dtype)], axis=1), 0.0)
    resid = jnp.where(jnp.sum(resid, axis=-1, keepdims=True) > 0, resid, p)
    logr = jnp.where(resid > 0, jnp.log(jnp.where(resid > 0, resid, 1.0)), -jnp.inf)
    fix = jax.vmap(lambda k, lr: jax.random.categorical(k, lr, axis=-1))(ks[:, 1], logr).astype(jnp.int32)
    j = jnp.arange(n + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    return jnp.where(j < accepted[:, None], padded, fix), accepted.astype(jnp.int32)


def speculative_step(config, num_draft: int, params, cache, hbuf, seq, e, active, keys, temperature, top_k, top_p,
                     *, greedy: bool = False):
    """One round of MTP speculative decoding for a batch of rows (requests); jittable, config /
    num_draft / greedy static. The engine calls it once per decode step.

    State (row b = one request; allocate with kv.init_cache(config, B, S, mtp_depths=num_draft), S >= the
    longest sequence + num_draft + 2; fill it with a prefill as `_spec_prefill` does):
      cache   {"layers", "mtp"}: the trunk's and each MTP depth's caches, slot == position
      hbuf    [B, S, D]: the trunk's pre-final-norm hidden state at every processed position 0..e_b
      seq     [B, S + 1] int32: committed tokens at positions 0..e_b + 1 (seq[b, e_b + 1] is the row's latest
              token, chosen but not yet run through the trunk)
      e       [B] int32: the last position the trunk has processed
    Per row: active [B] bool (inactive rows write nothing and keep their state: free or finished slots),
    keys [B] (this step's PRNG key, e.g. fold_in(PRNGKey(seed), tokens generated so far)), temperature
    [B] (0 = greedy row), top_k [B] (0 = off), top_p [B].
    greedy=True (static): every row greedy, no filtering or random draws (the cheaper program).

    Returns (cache, hbuf, seq, e, tokens [B, n+1] int32, logprobs [B, n+1] float32, accepted [B] int32):
    row b's new tokens are tokens[b, :accepted_b + 1], in order (the last is at seq[b, e_b + 1] for the
    returned e); logprobs as `sampling.sample` reports them (greedy rows: temperature-1 log-softmax;
    sampled rows: log-prob under the filtered target distribution). Inactive rows: accepted 0, e unchanged.
    The caller applies stop tokens and max_tokens (tokens past a stop are discarded; the row's cache
    beyond its end is never read). accepted_b >= k counts as "draft k accepted" for per-depth acceptance.
    """
    c, n = config, num_draft
    b = e.shape[0]
    w = 2 * n
    active = jnp.asarray(active, bool)
    win = e[:, None] - w + 1 + jnp.arange(w, dtype=jnp.int32)
    wwin = jnp.where((win >= 0) & active[:, None], win, -1)
    h = jnp.take_along_axis(hbuf, jnp.maximum(win, 0)[..., None], axis=1)
    ks = draw = None
    if not greedy:
        temperature, top_k, top_p = (jnp.broadcast_to(jnp.asarray(a), (b,)) for a in (temperature, top_k, top_p))
        ks = _split_rows(keys, n + 1)
        draw = draft_sampler(ks, temperature, top_k, top_p)
    drafts, mtp, _, q = mtp_window(c, n, params, cache["mtp"], h, seq, jnp.zeros_like(e), win, wwin, e, draw)
    # verify [committed next token, drafts] at positions e+1 .. e+n+1
    vpos = e[:, None] + 1 + jnp.arange(n + 1, dtype=jnp.int32)
    wpos = jnp.where(active[:, None], vpos, -1)
    vtok = jnp.concatenate([jnp.take_along_axis(seq, e[:, None] + 1, axis=1), drafts], axis=1)
    x, layers = model_step(c, params, cache["layers"], vtok, vpos, wpos)
    hbuf = kv.write(hbuf, wpos, x)
    logits = head(c, params, final_norm(c, params, x))                       # [B, n+1, V]
    g, lp, a = verify(logits, drafts, q, None if greedy else ks[:, n], temperature, top_k, top_p, greedy=greedy)
    seq = kv.write(seq, jnp.where(active[:, None], vpos + 1, -1), g)   # g_j is the token at e+2+j (committed for j <= a)
    a = jnp.where(active, a, 0).astype(jnp.int32)
    e = jnp.where(active, e + a + 1, e)
    return dict(cache, layers=layers, mtp=mtp), hbuf, seq, e, g, lp, a


@functools.partial(jax.jit, static_argnums=(0, 1, 8), static_argnames=("greedy",))
def _spec_prefill(config, n, params, cache, hbuf, seq, tokens, lens, chunk, keys=None, temperature=None, top_k=None,
                  top_p=None, *, greedy=True):
    """The main trunk's chunked `prefill`, then the MTP depths over the prompt in the same chunks
    (chunk i's MTP caches are written before chunk i+1 attends them). Entries at the last
    num_draft positions before e depend on this pass's drafts: the first round's window rewrites them.
    The first token: the argmax (greedy), else drawn per row (`sampling.sample_rows` with keys [B])."""
    b, p = tokens.shape
    logits0, cache, x = prefill(config, params, cache, tokens, lens, True, chunk)
    hbuf = hbuf.at[:, :p].set(x.astype(hbuf.dtype))
    if greedy:
        g0 = jnp.argmax(logits0, axis=-1).astype(jnp.int32)
        lp0 = jnp.take_along_axis(jax.nn.log_softmax(logits0, axis=-1), g0[:, None], axis=-1)[:, 0]
    else:
        g0, lp0, _ = sampling.sample_rows(keys, logits0, temperature, top_k, top_p)
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


def _row_step_keys(row_keys, count):
    """Per row: fold_in(row key, tokens generated so far): a fresh key each step, independent of the batch."""
    return jax.vmap(jax.random.fold_in)(row_keys, count)


def _spec_round(config, n, n_new, greedy, params, samp, cache, hbuf, seq, e, out, out_lp, count, stopped, stops, acc):
    active = ~stopped & (count < n_new)
    row_keys, temperature, top_k, top_p = samp
    keys = _row_step_keys(row_keys, count)
    cache, hbuf, seq, e, g, lp, a = speculative_step(config, n, params, cache, hbuf, seq, e, active, keys,
                                                     temperature, top_k, top_p, greedy=greedy)
    # outputs, truncated at the first stop token
    j = jnp.arange(n + 1)[None, :]
    is_stop = jnp.isin(g, stops) & (j <= a[:, None])
    any_stop = jnp.any(is_stop, axis=1)
    take = jnp.where(any_stop, jnp.argmax(is_stop, axis=1) + 1, a + 1)
    opos = jnp.where(active[:, None] & (j < take[:, None]), count[:, None] + j, -1)
    out = kv.write(out, opos, g)
    out_lp = kv.write(out_lp, opos, lp)
    count = count + jnp.where(active, take, 0)
    stopped = stopped | (active & any_stop)
    depth = jnp.sum(active[:, None] & (a[:, None] >= jnp.arange(1, n + 1)[None, :]), axis=0)   # [n]
    acc = acc + jnp.concatenate([jnp.stack([jnp.sum(jnp.where(active, a + 1, 0)), jnp.sum(active)]),
                                 depth]).astype(acc.dtype)
    return cache, hbuf, seq, e, out, out_lp, count, stopped, acc, jnp.any(~stopped & (count < n_new))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _spec_loop(config, n, n_new, greedy, params, samp, cache, hbuf, seq, e, out, out_lp, count, stopped, stops):
    """All rounds inside one lax.while_loop (no host round trip per verification step). acc: [sum over
    active (row, step) of 1 + accepted, active (row, step) pairs, then per depth k the pairs accepting >= k]."""
    def cond(st):
        return st[-1]

    def body(st):
        rounds, *rest = st[:-1]
        new = _spec_round(config, n, n_new, greedy, params, samp, *rest[:-1], stops, rest[-1])
        return (rounds + 1, *new)

    acc = jnp.zeros((2 + n,), jnp.int32)
    going = jnp.any(~stopped & (count < n_new))
    st = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, hbuf, seq, e, out, out_lp, count, stopped, acc, going))
    rounds, _, _, _, _, out, out_lp, count, stopped, acc, _ = st
    return out, out_lp, count, stopped, acc, rounds


def check_num_draft(config, num_draft):
    """Raise ValueError unless `config` can draft `num_draft` tokens with its MTP blocks."""
    if config.mtp_depth < 1:
        raise ValueError("speculative decoding needs MTP weights: config.mtp_depth must be >= 1")
    require("num_draft", num_draft, ValueError, integer=True, min=1)
    if not config.mtp_share and num_draft > config.mtp_depth:
        raise ValueError(f"num_draft={num_draft} > mtp_depth={config.mtp_depth} with unshared MTP blocks "
                         "(each depth needs its own block); lower num_draft")


def speculative_generate(config, params, prompts, *, max_new_tokens: int, num_draft: int = 4,
                         stop_tokens: Sequence[int] = (), max_len: int | None = None,
                         temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
                         prefill_chunk: int = PREFILL_CHUNK) -> SpeculativeResult:
    """MTP speculative decoding. temperature 0 (default): greedy, the same outputs as
    generate(..., temperature=0). temperature > 0: sampled with rejection-sampling verification, the same
    output distribution as generate(..., temperature, top_p, top_k) (not the same samples: the random
    draws differ); row b's randomness comes from fold_in(PRNGKey(seed), b) alone.

    Internally the caches hold max_len + num_draft + 1 slots so the last verification pass never runs
    off the end. prefill_chunk: prompt tokens per prefill chunk, as in generate.
    stats: also accepted_per_depth (active (row, step) pairs accepting >= k drafts, k = 1..num_draft),
    acceptance_per_depth (the same / all active pairs) and verify_rows (active (row, step) pairs).
    """
    sampling.validate(temperature, top_p, top_k)
    check_num_draft(config, num_draft)
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
    greedy = temperature == 0
    row_keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(b))
    samp = (row_keys, jnp.full((b,), temperature, jnp.float32), jnp.full((b,), top_k, jnp.int32),
            jnp.full((b,), top_p, jnp.float32))
    cache, hbuf, seq, g0, lp0 = _spec_prefill(config, n, params, cache, hbuf, seq, jnp.asarray(tokens),
                                              jnp.asarray(lens), int(prefill_chunk),
                                              *((None,) * 4 if greedy else
                                                (_row_step_keys(row_keys, jnp.zeros((b,), jnp.int32)),) + samp[1:]),
                                              greedy=greedy)
    out = jnp.full((b, n_new + n + 1), PAD_ID, jnp.int32).at[:, 0].set(g0)
    out_lp = jnp.zeros((b, n_new + n + 1), jnp.float32).at[:, 0].set(lp0)
    count = jnp.ones((b,), jnp.int32)
    stopped = jnp.isin(g0, stops)
    e = jnp.asarray(lens - 1)
    g0.block_until_ready()
    t1 = time.perf_counter()
    out, out_lp, count, stopped, acc, rounds = _spec_loop(config, n, n_new, greedy, params, samp, cache, hbuf, seq,
                                                          e, out, out_lp, count, stopped, stops)
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
        stats={"prefill_s": t1 - t0, "decode_s": t2 - t1, "prompt_tokens": int(lens.sum()), "generated_tokens": gen,
               "verify_rows": int(acc[1]), "accepted_per_depth": [int(x) for x in acc[2:]],
               "acceptance_per_depth": [float(x / acc[1]) if acc[1] else 0.0 for x in acc[2:]]},
        acceptance_length=acc_len, verify_steps=rounds, tokens_per_s=gen / max(t2 - t1, 1e-9))


def acceptance_length(config, params, prompts, num_draft: int = 4, max_new_tokens: int = 64) -> float:
    """Mean tokens accepted per verification step (1 + accepted drafts) of greedy MTP speculation."""
    return speculative_generate(config, params, prompts, max_new_tokens=max_new_tokens,
                                num_draft=num_draft).acceptance_length
