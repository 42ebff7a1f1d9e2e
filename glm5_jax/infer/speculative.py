"""MTP self-speculative decoding: greedy, and sampled with rejection-sampling verification.

Draft: the MTP block (mtp_0 at every depth when config.mtp_share, else mtp_{k-1} for depth k)
proposes `num_draft` tokens. Depth k at position s follows GLM5.__call__'s MTP branch exactly:
    h_k[s] = MTPBlock(h_{k-1}[s], embed(token[s + k]))     (h_0 = main trunk output before final_norm)
and its head(final-normed h_k[e]) at the last verified position e proposes token e + k + 1. Each
depth owns a latent/KV (and DSA indexer-key) cache, because the MTP block holds a full decoder layer.

Per round (a step of the paged runtime, `glm5_jax.infer.programs.Programs.paged_step`; this module holds
its device pieces): the MTP pass (`mtp_window`) recomputes a window of the last 2 * num_draft positions
ending at e at every depth (rows of the window are the only cache entries that may have been computed
from drafts rejected since; everything before it was computed from committed tokens), using committed
tokens where known and this round's drafts beyond; then the main model verifies [next token,
draft_1..draft_n] at positions e+1..e+n+1 in one pass over its cache (`verify`). The batch driver is
`glm5_jax.infer.generation.speculative_generate`.

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

import jax
import jax.numpy as jnp

from glm5_jax.fields import require
from glm5_jax.infer import sampling
from glm5_jax.infer.decode import head, mtp_block


def mtp_window(config, n, params, mtp_caches, h, seqw, base, win_pos, wpos, e, draw=None, heads: bool = True):
    """The MTP depths over positions win_pos [B, W] (slots wpos, -1 = don't write), the one MTP pass of
    the speculative step (`mtp_caches`: the depths' buffers, or `LayerCache`s over their pages).

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


def check_num_draft(config, num_draft):
    """Raise ValueError unless `config` can draft `num_draft` tokens with its MTP blocks."""
    if config.mtp_depth < 1:
        raise ValueError("speculative decoding needs MTP weights: config.mtp_depth must be >= 1")
    require("num_draft", num_draft, ValueError, integer=True, min=1)
    if not config.mtp_share and num_draft > config.mtp_depth:
        raise ValueError(f"num_draft={num_draft} > mtp_depth={config.mtp_depth} with unshared MTP blocks "
                         "(each depth needs its own block); lower num_draft")
