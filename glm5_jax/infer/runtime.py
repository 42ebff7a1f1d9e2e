"""The paged generation runtime: one jitted step over a pool of KV pages, scheduled by host Python.

Device side (`Programs.paged_step`): the cache is a pool of pages per layer ([repeats, num_pages,
page_size, ...], glm5_jax.infer.cache's buffers with pages for rows); each running sequence has a page
table. A step takes up to `max_num_batched_tokens` token rows: one per decoding sequence and the next
chunk of each sequence still prefilling, every row with its sequence's table and position, so prefill
and decode share one program and one read of the weights, and one compile per row-count bucket.

Host side (`PagedRuntime`, no device state but the pool it hands to the program): admission, page
accounting (glm5_jax.infer.pages: reference-counted pages, a radix tree of cached prefixes shared by
reference, copy-on-write of a partial last page, least-recently-used eviction), the token budget
(decodes first, then prefill chunks in admission order) and preemption by recompute when pages run out
(the newest running sequence gives its pages back and is prefilled again later over its prompt and
the tokens it has generated).

A sequence's context is its prompt followed by its generated tokens; the runtime feeds the context's
tokens whose keys are not cached yet, and the output of the last one is the sequence's next token,
sampled with `fold_in(PRNGKey(seed), i)` for its i-th token: a decode step is a prefill of one token, and
a request's tokens never depend on its batch-mates, its pages or whether its prefix came from the radix.

The serving engine (glm5_jax.serve.engine) runs on it by default; MTP speculation, the RL rollout engine,
the judge, the teacher and `infer.generate` do not yet (docs/inference.md, "Known gaps (serving)").
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from glm5_jax.infer.pages import PagePool, RadixCache
from glm5_jax.infer.programs import Programs
from glm5_jax.sharding import SERVE_RULES

__all__ = ["PagedRuntime", "Plan", "Seq"]


class Plan(NamedTuple):
    """One scheduled step: the program's width and echo variant, its host arguments, and per planned
    sequence (seq, its row in the tables, its first token row, context tokens fed)."""
    width: int
    echo: bool
    args: tuple
    rows: list
    cow_holds: list                      # partial pages retained until the step has copied them
    tokens: int
    greedy: bool = False                 # MTP speculation: every speculating sequence is greedy
    row_keys: bool = False               # a sequence samples as a row of a batch draw (Seq.key_row)
    from_prev: Any = None                # [width] int32: row k's token is the previous step's token of row
    #                                      from_prev[k] (>= 0; its sequence's token still in flight), or None
    starts: tuple = ()                   # per planned sequence: its cached positions when planned
    state: dict = {}                     # "advanced": launched (`advance`); "sampled": sequences sampling


PENDING = -1                             # a generated token whose step is still in flight (overlapped steps)


@dataclasses.dataclass(eq=False)
class Seq:
    """One sequence: its prompt and sampling settings, then the runtime's state of it."""
    prompt: list
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop_ids: tuple = ()
    prefix: bool = True                  # may take a cached prefix (and leave its own in the radix)
    key_row: Optional[int] = None        # b: its i-th token is row b of one draw over a batch with key
    #                                      fold_in(PRNGKey(seed), i) (infer.generate's scheme); None: its own
    tokens: list = dataclasses.field(default_factory=list)      # generated
    logprobs: list = dataclasses.field(default_factory=list)    # model log-prob of each generated token
    pages: list = dataclasses.field(default_factory=list)       # its page table (one reference each)
    shard: int = 0                       # the batch shard it runs on (its pages and token rows are that shard's)
    cached: int = 0                      # context tokens whose keys are in its pages
    reused: int = 0                      # prompt tokens taken from the radix at its last admission
    epoch: int = 0
    finish: Optional[str] = None         # "stop" | "length" | "aborted" once done
    echo: Optional[list] = None          # [] to collect (lp, top ids, top lps) of each prompt token after the first
    handle: Any = None                   # the serving engine's request
    pending_row: int = -1                # its row in the step in flight that samples its PENDING token

    @property
    def context(self) -> list:
        return self.prompt + self.tokens

    @property
    def pos(self) -> int:
        """Position of the next token to feed (its last token's): a sequence may feed up to max_model_len - 1."""
        return len(self.prompt) + len(self.tokens) - 1


def _widths(budget: int, multiple: int = 1, smallest: int = 8, extra=()) -> tuple:
    """Token-row counts a step compiles for: powers of two from `smallest` (or the `extra` counts given, those
    below the budget), then `budget`, each rounded up to a multiple of the batch shards (the rows are split
    over them)."""
    out, w = [x for x in extra if 0 < x < budget], smallest
    while w < budget and not extra:
        out.append(w)
        w *= 2
    return tuple(sorted({-(-x // multiple) * multiple for x in out + [budget]}))


def cache_tokens_that_fit(config, mesh, fraction: float, num_draft: int = 0) -> Optional[int]:
    """Cache positions (over the whole mesh) that fit in `fraction` of each device's memory after what is
    already held there (the weights), or None where the device reports no memory statistics (CPU). With
    MTP speculation (num_draft > 0) a position also holds each depth's keys and the trunk's hidden state."""
    from glm5_jax.infer import cache as kv
    from glm5_jax.layers.common import dtype_of
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
    out = -1
    if stats and all(st and st.get("bytes_limit") for st in stats):
        free = min(fraction * st["bytes_limit"] - st.get("bytes_in_use", 0) for st in stats)
        one = jax.eval_shape(lambda: kv.init_cache(config, 1, 1, num_draft))
        per_token = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(one))
        if num_draft:
            per_token += config.d_model * jax.numpy.dtype(dtype_of(config.dtype)).itemsize
        out = max(0, int(free // per_token)) * PagedRuntime.batch_shards(mesh)
    if jax.process_count() > 1:          # every process must build the same pool: process 0's figure
        from jax.experimental import multihost_utils
        out = int(multihost_utils.broadcast_one_to_all(np.int64(out)))
    return None if out < 0 else out


def page_table_widths(config, table_len: int, page_size: int, extra=()) -> tuple:
    """Page-table widths (pages) a step compiles for: x4 apart, the `extra` widths given (a deployment's mean
    context with its headroom: tools.aot --kv_cache=paged), then the whole table. A step reads the pages of
    the longest sequence it runs, not max_model_len for every row. A row's result must not depend on the width
    its batch-mates chose: with DSA every width holds index_topk positions, so each row attends the same
    index_topk selected keys (the top-k over more -inf-masked slots is the same selection); dense attention
    (mla / mha / gqa) reduces over every slot, so it keeps the whole table."""
    least = -(-config.index_topk // page_size) if config.attention == "dsa" else table_len
    least = min(least, table_len)
    return tuple(sorted({least, table_len} | {4 ** i for i in range(32) if least < 4 ** i and 2 * 4 ** i <= table_len}
                        | {min(max(int(w), least), table_len) for w in extra}))


class PagedRuntime:
    """Sequences over a pool of `kv_cache_tokens // page_size` pages; `step()` runs one scheduled step.

    max_running: sequences running at once (rows of the page-table array); max_model_len: positions a
    sequence may reach; max_num_batched_tokens: token rows a step runs (decodes first); prefill_chunk:
    the most prompt tokens one sequence feeds per step; prefix_cache: "radix" (share cached prefixes by
    reference) or "none". page_size = max_model_len with prefix_cache="none" is the one-row-per-slot
    policy (each sequence owns a whole row of the cache), for comparison. widths: the token-row counts
    below the budget a step may compile for (default powers of two from 8); table_widths: page-table widths
    (pages) to compile beside `page_table_widths`' defaults, or "full": the whole table only (a batch whose
    rows all run to the end: one compile a width; results do not depend on the width).

    num_draft = n > 0: MTP self-speculation (glm5_jax.infer.speculative). A decoding sequence then runs
    n + 1 token rows a step (its next token and n drafts, verified in the trunk pass, `Programs.paged_step`)
    and takes 1 + accepted tokens; the pool gains each MTP depth's pages and the trunk's hidden states
    (`spec_pool`). A prefix taken from the radix stops 2n tokens short of the match: MTP entries at a
    position read the tokens up to n ahead, and a sequence's own window (its last 2n positions) is
    rewritten every round, so those are always private pages."""

    @staticmethod
    def batch_shards(mesh) -> int:
        from glm5_jax.batch import BATCH_AXES
        return 1 if mesh is None else int(np.prod([dict(mesh.shape).get(a, 1) for a in BATCH_AXES]))

    def __init__(self, config, params, *, max_running: int = 8, max_model_len: int = 256, page_size: int = 16,
                 kv_cache_tokens: Optional[int] = None, max_num_batched_tokens: int = 256,
                 prefill_chunk: Optional[int] = None, prefix_cache: str = "radix", mesh=None, rules=SERVE_RULES,
                 num_draft: int = 0, widths=None, table_widths=()):
        if prefix_cache not in ("radix", "none"):
            raise ValueError(f"prefix_cache={prefix_cache!r}: radix | none")
        if min(max_running, page_size, max_num_batched_tokens) < 1 or max_model_len < 2:
            raise ValueError(f"max_running={max_running}, page_size={page_size}, max_num_batched_tokens="
                             f"{max_num_batched_tokens} must be >= 1 and max_model_len={max_model_len} >= 2")
        self.max_running, self.max_len, self.page_size = int(max_running), int(max_model_len), int(page_size)
        self.num_draft = int(num_draft)
        # a verification writes up to n positions past the context's last
        self.table_len = -(-(self.max_len + self.num_draft) // self.page_size)
        tokens = kv_cache_tokens if kv_cache_tokens is not None else self.max_running * self.table_len * self.page_size
        self.programs = Programs(config, mesh, max_batch=self.max_running, size=self.page_size, rules=rules,
                                 num_draft=self.num_draft)
        shards = self.programs.shards                       # the pool's pages are split over the batch shards
        self.num_pages = int(tokens) // self.page_size // shards * shards
        if self.num_pages < self.table_len:
            raise ValueError(f"kv_cache_tokens={tokens} holds {self.num_pages} pages of {self.page_size}; one "
                             f"sequence of max_model_len={self.max_len} needs {self.table_len}")
        self.budget = int(max_num_batched_tokens)
        if self.budget < self.max_running * (1 + self.num_draft):
            raise ValueError(f"max_num_batched_tokens={self.budget} must be >= max_running x (1 + num_draft) = "
                             f"{self.max_running * (1 + self.num_draft)} (every running sequence decodes a step)")
        self.chunk = int(prefill_chunk or self.budget)
        self.widths = _widths(self.budget, shards, extra=widths or ())
        self.table_widths = ((self.table_len,) if table_widths == "full" else
                             page_table_widths(config, self.table_len, self.page_size, table_widths))
        self.config = self.programs.config
        self.params = self.programs.place_params(params)
        self.pool, self.spec_pool = self._alloc_pools()
        self._prev = None                    # the last step's sampled tokens, on the device (overlapped steps)
        self.pages = PagePool(self.num_pages, self.page_size, self.programs.shards)
        self.radix = RadixCache(self.pages) if prefix_cache == "radix" else None
        self.waiting: list = []
        self.running: list = []
        self.epoch = 0
        self.stats = {"steps": 0, "tokens": 0, "prefill_tokens": 0, "decode_tokens": 0, "preempted": 0,
                      "reused_tokens": 0, "peak_running": 0, "verify_rows": 0, "accepted": 0,
                      "accepted_per_depth": [0] * self.num_draft}

    def _alloc_pools(self):
        out = self.programs.alloc_pool(self.num_pages, self.page_size)
        return out if self.num_draft else (out, None)

    # ------------------------------------------------------------------ requests
    def add(self, seq: Seq) -> Seq:
        if not seq.prompt or len(seq.prompt) >= self.max_len:
            raise ValueError(f"the prompt has {len(seq.prompt)} tokens; it needs 1 .. {self.max_len - 1} "
                             f"(max_model_len={self.max_len})")
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Seq) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self._free(seq, keep=False)
        seq.finish = seq.finish or "aborted"

    def new_weights(self, params) -> None:
        """Weights for the next steps; cached prefixes of older weights are never reused."""
        self.params = self.programs.place_params(params)
        self.epoch += 1
        if self.radix is not None:
            self.radix.clear()

    # ------------------------------------------------------------------ pages
    def _alloc(self, n: int, shard: int = 0):
        return self.radix.alloc(n, shard) if self.radix is not None else self.pages.alloc(n, shard)

    def _place(self, seq: Seq) -> Optional[int]:
        """The batch shard a new sequence runs on (its pages and rows live there): among the shards with a free
        row of the page tables (max_running / shards each), the one caching the longest prefix of its context
        (a GRPO group's samples land where the first one's prompt is), then the fewest running, then the most
        free pages; None when every shard is full."""
        per, shards = self.max_running // self.pages.shards, self.pages.shards
        running = np.bincount([r.shard for r in self.running], minlength=shards)
        ctx, best = seq.context, None
        for sh in range(shards):
            if running[sh] >= per:
                continue
            hit = self.radix.peek(ctx, len(ctx) - 1, sh) if self.radix is not None and seq.prefix else 0
            key = (hit, -running[sh], self.pages.free_in(sh))
            if best is None or key > best[0]:
                best = (key, sh)
        return None if best is None else best[1]

    def _free(self, seq: Seq, keep: bool) -> None:
        """seq leaves the running set; with keep its pages (a partial last one as a leaf) go into the radix
        (same weights only)."""
        if keep and self.radix is not None and seq.prefix and seq.epoch == self.epoch:
            ctx = seq.context
            n = ctx.index(PENDING) if PENDING in ctx[:seq.cached] else seq.cached     # known tokens only
            self.radix.insert(ctx[:n], seq.pages[:self.pages.pages_for(n)])
        self.pages.release(seq.pages)
        seq.pages, seq.cached = [], 0
        self.running.remove(seq)

    def _shares_unfilled(self, seq: Seq) -> bool:
        """Whether a running sequence is still prefilling a whole page that seq's context shares (seq then
        waits for those pages to reach the radix instead of computing them a second time)."""
        if self.radix is None or not seq.prefix:
            return False
        ctx, ps = seq.context, self.page_size
        for r in self.running:
            if not r.prefix or r.cached >= len(r.context) - 1:
                continue
            common = 0
            for a, b in zip(ctx, r.context):
                if a != b:
                    break
                common += 1
            if common - common % ps > r.cached - r.cached % ps and common >= ps:
                return True
        return False

    def _admit(self, cow: list) -> None:
        for seq in list(self.waiting):
            if len(self.running) >= self.max_running:
                return
            if self._shares_unfilled(seq):
                continue
            sh = self._place(seq)
            if sh is None:
                return
            ctx = seq.context
            pages, cached, partial = [], 0, None
            if self.radix is not None and seq.prefix:
                m = self.radix.match(ctx, limit=len(ctx) - 1, shard=sh)
                if self.num_draft and m.tokens:      # MTP entries near the match's end read tokens past it
                    self.pages.release(m.pages)
                    m = self.radix.match(ctx, limit=max(0, m.tokens - 2 * self.num_draft), shard=sh)
                pages, cached, partial = list(m.pages), m.tokens, m.partial
            if partial is not None:
                self.pages.retain([partial[0]])          # not evicted before the step copies it
                new = self._alloc(1, sh)
                if new is None:
                    self.pages.release([partial[0]])
                else:
                    cow.append((partial[0], new[0]))
                    pages, cached = pages + new, cached + partial[1]
            if len(pages) * self.page_size <= cached:    # room for its first token
                new = self._alloc(1, sh)
                if new is None:
                    self.pages.release(pages)
                    return
                pages += new
            self.waiting.remove(seq)
            seq.pages, seq.cached, seq.epoch, seq.shard = pages, cached, self.epoch, sh
            seq.reused = cached if not seq.tokens else seq.reused
            self.stats["reused_tokens"] += cached
            self.running.append(seq)

    def _grow(self, seq: Seq, upto: int) -> bool:
        """Pages for positions < upto; False if the pool cannot give them even after eviction."""
        need = self.pages.pages_for(upto) - len(seq.pages)
        if need <= 0:
            return True
        new = self._alloc(need, seq.shard)
        if new is None:
            return False
        seq.pages += new
        return True

    def _preempt(self, protect, newer_than: Optional[Seq] = None, shard: int = 0) -> bool:
        """The newest running sequence of `shard` (whose pages it needs) not in `protect` (and admitted after
        `newer_than`, if given: a prefill takes pages only from younger sequences, so the oldest always
        progresses) gives its pages back and waits to be recomputed."""
        order = self.running if newer_than is None else self.running[self.running.index(newer_than) + 1:]
        for seq in reversed(order):
            if seq not in protect and seq.shard == shard:
                self._free(seq, keep=True)          # its whole pages stay cached (evictable) for the recompute
                if seq.echo is not None:
                    seq.echo = []                   # its prompt's log-probs are computed again
                self.waiting.insert(0, seq)
                self.stats["preempted"] += 1
                return True
        return False

    # ------------------------------------------------------------------ one step
    def _schedule(self, cow: list) -> list:
        """[(seq, number of context tokens it feeds this step)]: decodes first, then prefill chunks."""
        # the budget is per batch shard: a step's rows are split evenly over the shards
        plan, left = [], [self.widths[-1] // self.pages.shards] * self.pages.shards
        for want_decode in (True, False):
            for seq in list(self.running):
                if seq not in self.running:                      # preempted meanwhile
                    continue
                rem, sh = len(seq.context) - seq.cached, seq.shard
                if (rem == 1) != want_decode or left[sh] <= 0:
                    continue
                if want_decode and seq.tokens[-1:] == [PENDING] and (
                        len(seq.tokens) >= seq.max_tokens or seq.pos >= self.max_len):
                    continue                     # its token in flight is its last: nothing more to feed
                extra = self.num_draft if want_decode else 0       # draft rows; their keys past the context
                if want_decode and left[sh] < 1 + extra:
                    continue
                take = min(rem, left[sh] - extra, self.chunk)
                while not self._grow(seq, seq.cached + take + extra):
                    if self._preempt({s for s, _ in plan} | {seq}, None if want_decode else seq, sh):
                        continue
                    take = len(seq.pages) * self.page_size - seq.cached     # what its pages hold already
                    break
                if take > 0:
                    plan.append((seq, take))
                    left[sh] -= take + extra
        return plan

    def plan(self) -> Optional["Plan"]:
        """Admit and schedule one step (host only) -> its program arguments, or None when nothing runs."""
        cow = []
        self._admit(cow)
        work = self._schedule(cow)
        if not work:
            if (self.running or self.waiting) and not any(s.tokens[-1:] == [PENDING] for s in self.running):
                raise RuntimeError("no sequence could be scheduled: the page pool is too small for one step")
            return None                  # nothing to run, or only sequences whose last token is in flight
        nd = self.num_draft
        decoding = {seq for seq, _ in work if len(seq.context) - seq.cached == 1} if nd else set()
        n = sum(t for _, t in work)
        shards = self.pages.shards                 # shard s's sequences and token rows: the s-th block of each
        load = np.bincount([seq.shard for seq, _ in work], [t + (nd if seq in decoding else 0) for seq, t in work],
                           minlength=shards)
        width = next(w for w in self.widths if w // shards >= load.max())
        need = max(-(-(seq.cached + take + (nd if seq in decoding else 0)) // self.page_size) for seq, take in work)
        r, tl = self.max_running, next(t for t in self.table_widths if t >= need)
        tok, pos, wpos, seqi, targets = (np.zeros((width,), np.int32) for _ in range(5))
        wpos[:] = -1
        tables = np.zeros((r, tl), np.int32)
        out_rows, counts, top_k = (np.zeros((r,), np.int32) for _ in range(3))
        temp, top_p, seeds = np.zeros((r,), np.float32), np.ones((r,), np.float32), np.zeros((r,), np.uint32)
        if nd:
            spec, e = np.zeros((r,), bool), np.zeros((r,), np.int32)
            wtok, vrows = np.zeros((r, 3 * nd), np.int32), np.zeros((r, nd + 1), np.int32)
            draft_of, mtp_wpos, mtp_tok = np.full((width,), -1, np.int32), np.full((width,), -1, np.int32), \
                np.zeros((width, nd), np.int32)
        slot, used = {}, [0] * shards
        for seq in self.running:
            slot[seq], used[seq.shard] = seq.shard * (r // shards) + used[seq.shard], used[seq.shard] + 1
        rows, k, cur = [], 0, [sh * (width // shards) for sh in range(shards)]
        for seq, take in sorted(work, key=lambda w: w[0].shard):
            i, ctx, k = slot[seq], seq.context, cur[seq.shard]
            tables[i, :min(len(seq.pages), tl)] = seq.pages[:tl]
            p = np.arange(seq.cached, seq.cached + take, dtype=np.int32)
            tok[k:k + take], pos[k:k + take], wpos[k:k + take], seqi[k:k + take] = ctx[seq.cached:seq.cached + take], p, p, i
            nxt = ctx[seq.cached + 1:seq.cached + take + 1]
            targets[k:k + len(nxt)] = nxt
            out_rows[i] = k + take - 1
            temp[i], top_k[i], top_p[i], seeds[i], counts[i] = (seq.temperature, seq.top_k, seq.top_p,
                                                                 seq.seed % 2 ** 32, len(seq.tokens))
            rows.append((seq, i, k, take))
            if seq in decoding:          # [next token, n drafts] at cached .. cached + n; the window before
                c0 = seq.cached
                q = np.arange(c0, c0 + nd + 1, dtype=np.int32)
                pos[k:k + nd + 1], wpos[k:k + nd + 1], seqi[k:k + nd + 1] = q, q, i
                draft_of[k + 1:k + nd + 1] = i * nd + np.arange(nd)
                vrows[i] = k + np.arange(nd + 1)
                spec[i], e[i] = True, c0 - 1
                lo = c0 - 2 * nd
                w = [ctx[j] if 0 <= j < len(ctx) else 0 for j in range(lo, lo + 3 * nd)]
                wtok[i] = w
                k += nd + 1
                cur[seq.shard] = k
                continue
            if nd:                       # a prefill's rows: its MTP entries, depth j reading the token at p + j
                mtp_wpos[k:k + take] = p
                for j in range(nd):
                    idx = p + j + 1
                    mtp_tok[k:k + take, j] = [ctx[t] if t < len(ctx) else 0 for t in idx]
            k += take
            cur[seq.shard] = k
        c = self.max_running
        cs, cd = np.zeros((c,), np.int32), np.full((c,), -1, np.int32)
        ncow = [sh * (c // shards) for sh in range(shards)]     # a copy runs on its pages' shard: its block
        for s_, d_ in cow:
            j = ncow[self.pages.shard_of(d_)]
            cs[j], cd[j], ncow[self.pages.shard_of(d_)] = s_, d_, j + 1
        echo = any(seq.echo is not None and seq.cached < len(seq.prompt) for seq, _ in work)
        args = (cs, cd, tok, pos, wpos, seqi, tables, out_rows, temp, top_k, top_p, seeds, counts, targets)
        greedy = False
        if nd:
            args += (spec, e, wtok, draft_of, vrows, mtp_tok, mtp_wpos)
            greedy = all(seq.temperature <= 0 for seq in decoding)
        row_keys = any(seq.key_row is not None for seq, _ in work)
        if row_keys:                     # the last argument (paged_step's row_keys variant)
            krow = np.full((r,), -1, np.int32)
            for seq, i, _, _ in rows:
                krow[i] = -1 if seq.key_row is None else seq.key_row
            args += (krow,)
        from_prev = None
        if (tok == PENDING).any():       # decodes whose token the step in flight samples: fed on the device
            from_prev = np.full((width,), -1, np.int32)
            for seq, i, k, take in rows:
                if tok[k] == PENDING:
                    from_prev[k], tok[k] = seq.pending_row, 0
        return Plan(width, echo, args, rows, [s_ for s_, _ in cow], n, greedy, row_keys, from_prev,
                    tuple(seq.cached for seq, *_ in rows), {"advanced": False, "sampled": []})

    def run_program(self, width: int, echo: bool, args, greedy: bool = False, row_keys: bool = False,
                    from_prev=None) -> tuple:
        """The step's device program over the pool (every process of a multi-process mesh runs it) -> its
        outputs, on the device (dispatched, not waited for). from_prev (Plan.from_prev): rows whose token is
        the previous step's sampled token, gathered on the device (the previous step may still run)."""
        prog = self.programs.paged_step(self.num_pages, self.page_size, width, echo, greedy, row_keys)
        if not self.num_draft:           # every step's tokens through the feed (one input kind: one compile)
            prev = self._prev if self._prev is not None else self.programs.call(self.programs.zero_tokens())
            src = from_prev if from_prev is not None else np.full((width,), -1, np.int32)
            args = args[:2] + (self.programs.call(self.programs.feed_tokens(width), prev, src, args[2]),) + args[3:]
        if not self.num_draft:
            *out, self.pool = self.programs.call(prog, self.params, self.pool, *args)
        else:
            *out, self.pool, spec, self.spec_pool = self.programs.call(prog, self.params, self.pool, self.spec_pool,
                                                                        *args)
            out.append(spec)
        self._prev = out[0]
        return tuple(out)

    def advance(self, plan: "Plan") -> None:
        """A launched step's effect on the host state, before its outputs are known (MTP speculation: at
        commit): each sequence's fed positions count as cached (the step writes them before any later step
        reads them: device order), its prefilled whole pages enter the radix, and a sequence whose context
        is all fed gets a PENDING token (its row in `pending_row`), so the next step can be planned, and fed
        that token on the device, while this one runs."""
        if plan.state["advanced"] or self.num_draft:
            return
        plan.state["advanced"] = True
        for seq, i, k, take in plan.rows:
            decode = len(seq.context) - seq.cached == 1
            self.stats["decode_tokens" if decode else "prefill_tokens"] += take
            seq.cached += take
            if not decode and self.radix is not None and seq.prefix and seq.epoch == self.epoch:
                # its prefilled whole pages are shared from now on (the n samples of one prompt)
                self.radix.insert(seq.context[:seq.cached], seq.pages[:seq.cached // self.page_size])
            if seq.cached == len(seq.context):
                seq.tokens.append(PENDING)
                seq.logprobs.append(0.0)
                seq.pending_row = i
                plan.state["sampled"].append((seq, i))

    def commit(self, plan: "Plan", out) -> list:
        """Apply a step's outputs (host numpy): -> [(seq, token, model lp, sampling lp, top ids, top lps)] for
        each token a sequence sampled (its PENDING token filled in; with speculation 1 + accepted tokens of a
        decoding sequence, without top alternatives). A sequence that reaches max_tokens, one of its stop
        ids or max_model_len is finished (its pages cached or freed; a token planned after its last is
        dropped); a sequence finished or aborted while the step ran is skipped."""
        nxt, lp_s, lp_m, ti, tv, ech, *spec = out
        if plan.cow_holds:
            self.pages.release(plan.cow_holds)
        self.stats["steps"] += 1
        self.stats["tokens"] += plan.tokens
        self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))
        events, none = [], np.zeros((0,), np.int32)
        for (seq, i, k, take), start in zip(plan.rows, plan.starts):
            if seq.echo is not None and start < len(seq.prompt):
                m = min(take, len(seq.prompt) - 1 - start)
                seq.echo += [(float(ech[0][k + j]), ech[1][k + j], ech[2][k + j]) for j in range(max(m, 0))]
        if spec:                         # MTP speculation: the host state moves here (`advance` does nothing)
            g, lp, acc = spec[0]
            for (seq, i, k, take), start in zip(plan.rows, plan.starts):
                if seq.finish is not None:
                    continue
                if len(seq.context) - start == 1:     # the next token and `accepted` drafts verified
                    self.stats["decode_tokens"] += take
                    a = int(acc[i])
                    self._count_accepted(a)
                    for j in range(a + 1):
                        seq.cached += 1
                        t = int(g[i, j])
                        seq.tokens.append(t)
                        seq.logprobs.append(float(lp[i, j]))
                        events.append((seq, t, float(lp[i, j]), float(lp[i, j]), none, none))
                        if self._ended(seq, t):
                            break
                    continue
                self.stats["prefill_tokens"] += take
                seq.cached += take
                if self.radix is not None and seq.prefix and seq.epoch == self.epoch:
                    self.radix.insert(seq.context[:seq.cached], seq.pages[:seq.cached // self.page_size])
                if seq.cached == len(seq.context):
                    t = int(nxt[i])
                    seq.tokens.append(t)
                    seq.logprobs.append(float(lp_m[i]))
                    events.append((seq, t, float(lp_m[i]), float(lp_s[i]), ti[i], tv[i]))
                    self._ended(seq, t)
            return events
        self.advance(plan)
        for seq, i in plan.state["sampled"]:
            if seq.finish is not None:               # cancelled, aborted or stopped while the step ran
                continue
            j = seq.tokens.index(PENDING)            # this step's token (a later step's may follow it)
            t = int(nxt[i])
            seq.tokens[j], seq.logprobs[j] = t, float(lp_m[i])
            events.append((seq, t, float(lp_m[i]), float(lp_s[i]), ti[i], tv[i]))
            reason = ("stop" if t in seq.stop_ids else
                      "length" if j + 1 >= seq.max_tokens or len(seq.prompt) + j >= self.max_len else None)
            if reason is not None:
                del seq.tokens[j + 1:], seq.logprobs[j + 1:]
                seq.cached = min(seq.cached, len(seq.context))      # a later step in flight fed its last token
                self.finish(seq, reason)
        return events

    def _ended(self, seq: Seq, t: int) -> bool:
        """Finish seq if its new token t stops it (a stop id, max_tokens, max_model_len)."""
        if t in seq.stop_ids:
            self.finish(seq, "stop")
        elif len(seq.tokens) >= seq.max_tokens or seq.pos >= self.max_len:
            self.finish(seq, "length")
        return seq.finish is not None

    def _count_accepted(self, a: int) -> None:
        st = self.stats
        st["verify_rows"] += 1
        st["accepted"] += a
        for d in range(a):
            st["accepted_per_depth"][d] += 1

    def acceptance(self) -> dict:
        """MTP speculation so far: {"length": mean 1 + accepted drafts per verification, "per_depth": the
        fraction of verifications accepting draft k, "steps": verifications}."""
        st, v = self.stats, max(self.stats["verify_rows"], 1)
        return {"length": 1.0 + st["accepted"] / v if st["verify_rows"] else 1.0,
                "per_depth": [x / v for x in st["accepted_per_depth"]], "steps": st["verify_rows"]}

    def launch(self, plan: "Plan") -> tuple:
        """run_program for `plan` (dispatched) and `advance`: the next step may be planned at once."""
        out = self.run_program(plan.width, plan.echo, plan.args, plan.greedy, plan.row_keys, plan.from_prev)
        self.advance(plan)
        return out

    def step(self) -> list:
        """plan + launch + commit on this process -> commit's events."""
        plan = self.plan()
        if plan is None:
            return []
        return self.commit(plan, jax.tree.map(np.asarray, self.launch(plan)))

    def finish(self, seq: Seq, reason: str) -> None:
        """seq is done (its pages go to the radix or back to the pool); a no-op for a finished sequence."""
        if seq.finish is None:
            seq.finish = reason
        if seq in self.running:
            self._free(seq, keep=True)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def idle_args(self, width: int, table: Optional[int] = None) -> tuple:
        """Program arguments of a step that writes and copies nothing (compiling a width: warm-up)."""
        r, c = self.max_running, self.max_running
        table = table or self.table_len
        z, zr, nd = np.zeros((width,), np.int32), np.zeros((r,), np.int32), self.num_draft
        args = (np.zeros((c,), np.int32), np.full((c,), -1, np.int32), z, z, z - 1, z, np.zeros((r, table), np.int32),
                zr, np.zeros((r,), np.float32), zr, np.ones((r,), np.float32), np.zeros((r,), np.uint32), zr, z)
        if nd:
            args += (np.zeros((r,), bool), zr, np.zeros((r, 3 * nd), np.int32), z - 1, np.zeros((r, nd + 1), np.int32),
                     np.zeros((width, nd), np.int32), z - 1)
        return args

    def reset(self) -> None:
        """Every sequence dropped, every page free, the pool zeroed (after a failed step)."""
        for seq in self.running + self.waiting:
            seq.finish = seq.finish or "aborted"
        self.running, self.waiting = [], []
        self.pages = PagePool(self.num_pages, self.page_size, self.programs.shards)
        self.radix = RadixCache(self.pages) if self.radix is not None else None
        self.pool, self.spec_pool = self._alloc_pools()
        self._prev = None

    def run(self, seqs, overlap: bool = False) -> list:
        """Add `seqs` and step until every one has finished (a blocking convenience for tests and tools).
        overlap: step N + 1 is planned and dispatched before step N's outputs reach the host (as the
        serving engine runs; without MTP speculation)."""
        for s in seqs:
            self.add(s)
        inflight = collections.deque()
        while not all(s.finish for s in seqs):
            plan = self.plan() if not inflight or (overlap and not self.num_draft and len(inflight) < 2) else None
            if plan is not None:
                inflight.append((plan, self.launch(plan)))
            if inflight and (plan is None or len(inflight) > 1 or not overlap):
                p, out = inflight.popleft()
                self.commit(p, jax.tree.map(np.asarray, out))
        return seqs

    def pages_in_use(self) -> dict[str, Any]:
        """{"free", "cached" (held by the radix only), "running"} pages: their sum is num_pages."""
        cached = self.radix.cached_pages if self.radix is not None else 0
        free = self.pages.free
        return {"free": free, "cached": cached, "total": self.num_pages,
                "running": self.num_pages - free - (self.radix.evictable_pages if self.radix is not None else 0)}
