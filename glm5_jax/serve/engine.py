"""Continuous-batching generation engine on the model's own modules and KV cache, on one device or a mesh.

One cache of ``max_batch`` rows ("slots") x ``max_model_len`` positions (``glm5_jax.infer.cache``), laid
out by ``glm5_jax.infer.programs.Programs``: on a mesh the slots are split evenly over the batch shards
(data x fsdp x expert; attention data-parallel, experts expert-parallel, docs/inference.md "Sharding for
serving") and a slot's cache row never leaves its shard. Every decode step runs all slots (or, on one
batch shard, a decode bucket, below) through the model's forward with ``cache=``, one token per slot at
that slot's own position; idle slots write nothing (write position -1).

Admission and prefill: a queued request takes a free slot; its prompt is prefilled in pieces of at most
``prefill_chunk`` tokens, one piece per shard per loop iteration (one program call prefills one row on
every shard at once, each shard its oldest admitted prompt), and every iteration then runs one decode
step, so a long prompt stalls the running requests by at most one chunk. After its last
piece the request samples its first token and joins the decode batch; it leaves when it ends.

Per request: temperature (0 = greedy), top_p, top_k, seed, stop strings and ids, max_tokens. Each
request samples with its own PRNG key, ``fold_in(PRNGKey(seed), i)`` for its i-th token, and its rows
never mix with other rows (cache slot == position, per-row visibility; the MoE is dropless), so its
output does not depend on its batch-mates, its slot or the mesh.

Shapes are fixed: a prefill piece pads to the smallest of ``prefill_buckets`` (default powers of two from
16 up to min(prefill_chunk, max_prompt_len)); a decode step runs over the first R slots, R the smallest
of ``decode_buckets`` (default just max_batch; several buckets need a single batch shard) that covers the
highest decoding slot. So after ``warmup()`` nothing compiles again.

Decode buckets (on CPU a step's cost grows with its rows, so a draining batch should not pay for
``max_batch``): a new request takes a free slot that keeps R smallest (lowest rows first; least recently
used among those), and before each step requests in slots at or past the bucket their count needs are
moved into free lower slots (a row copy), so the long tail of a batch decodes over few rows.

Prefix reuse: each slot remembers which token ids its cache row holds (the prompt and every generated
token fed back). A new request whose prompt starts with the tokens of some slot (a later turn of the same
rollout, or a shared system prompt) reuses that prefix: when that slot is free it is taken as it is,
otherwise its row is copied into a free slot of the same shard inside the first prefill piece; only the
rest of the prompt is prefilled, at positions after the prefix. Free slots keep their rows until a new
request needs them (least recently used first).

Weights: ``update_weights(params, version)`` swaps them between two steps (resharded device to device
into the serving layout); every token carries the version of the weights that produced it. Requests in
flight continue on the new weights (over the keys already cached); cached rows written before a swap
are never reused as a prefix afterwards, so a new request's context is always prefilled by the weights
that sample it. ``pause()`` / ``resume()`` hold the loop between steps (an RL update), new requests
queue meanwhile.

Text: a tokenizer makes each token's text delta incrementally (``glm5_jax.serve.detok``) and enables
stop strings. One process drives the engine (multi-host serving, one scheduling decision broadcast to
every process, is a known gap: docs/inference.md).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
import uuid
from typing import Callable, List, Optional, Sequence

import jax
import numpy as np

from glm5_jax.infer.speculative import check_num_draft
from glm5_jax.serve.detok import TextStream
from glm5_jax.parallel.distributed import multi_process, to_host
from glm5_jax.serve.multihost import Broadcast, is_leader
from glm5_jax.infer.programs import TOP_LOGPROBS, Programs
from glm5_jax.serve.request import EngineError, QueueFull, RequestHandle, SamplingParams, TokenEvent
from glm5_jax.infer.runtime import PagedRuntime, Seq
from glm5_jax.sharding import SERVE_RULES

__all__ = ["Engine", "EngineError", "QueueFull", "RequestHandle", "SamplingParams", "TOP_LOGPROBS", "TokenEvent"]


@dataclasses.dataclass
class _Fill:
    """A prompt being prefilled into its slot, piece by piece."""
    done: int                                   # prompt tokens whose keys are in the row (reused prefix included)
    src: int                                    # local slot the first piece reads (a prefix source), then the slot itself
    order: int = 0                              # admission order: each shard prefills its oldest prompt first
    echo: Optional[list] = None                 # per piece (lps, top ids, top lps) with prompt_logprobs


@dataclasses.dataclass
class _Slot:
    index: int                                  # global slot
    shard: int                                  # batch shard holding its row
    local: int                                  # slot within the shard
    cached: np.ndarray                          # token ids whose keys sit in this row at positions 0..len-1
    handle: Optional[RequestHandle] = None
    fill: Optional[_Fill] = None                # set while the prompt is being prefilled
    pos: int = 0                                # position of the next token to feed
    next_token: int = 0
    seed: int = 0
    last_used: float = 0.0
    epoch: int = 0                              # the weights (push count) its row's keys were computed with


def _buckets(max_len: int, smallest: int = 16) -> tuple:
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_len,)


class Engine:
    """Continuous batching over ``max_batch`` cache slots of ``max_model_len`` positions.

    ``submit(prompt_ids, SamplingParams) -> RequestHandle`` (thread-safe; raises EngineError for a bad
    request, QueueFull past ``max_queue`` waiting requests). ``generate(prompts, params)`` is the blocking
    convenience. ``batching="static"`` admits requests only into an empty batch (the batch runs to its
    longest row): the policy of the old rollout servers, kept for comparison (tools.bench_serve).
    ``tokenizer`` (optional): decodes text deltas and enables stop strings. ``decode_buckets`` (default
    ``(max_batch,)``): the row counts a decode step may run over (module doc). ``max_prompt_len`` (default
    ``max_model_len - 1``): the longest prompt accepted. ``prefill_chunk``: prompt tokens per row per prefill
    call. ``mesh`` (default one device): a ``jax.sharding.Mesh`` over the serving axes (data, fsdp, expert,
    tensor); ``rules`` the logical sharding rules (default ``SERVE_RULES``)."""

    def __init__(self, config, params, *, max_batch: int = 8, max_model_len: int = 256, tokenizer=None,
                 stop_token_ids: Sequence[int] = (), max_queue: int = 256, prefill_chunk: int = 512,
                 prefill_buckets: Optional[Sequence[int]] = None, prefix_reuse: bool = True,
                 min_reuse: int = 4, batching: str = "continuous", version: int = 0, seed: int = 0,
                 metrics=None, start: bool = True, speculative: int = 0,
                 decode_buckets: Optional[Sequence[int]] = None, max_prompt_len: Optional[int] = None,
                 mesh=None, rules=SERVE_RULES, kv_cache: str = "paged", page_size: int = 16,
                 kv_cache_tokens: Optional[int] = None, max_num_batched_tokens: Optional[int] = None):
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching={batching!r}: continuous | static")
        if kv_cache not in ("paged", "slots"):
            raise ValueError(f"kv_cache={kv_cache!r}: paged | slots")
        if speculative:
            kv_cache = "slots"            # MTP speculation runs on the slot cache until it moves onto pages
        if max_batch < 1 or max_model_len < 2:
            raise ValueError(f"max_batch={max_batch} must be >= 1 and max_model_len={max_model_len} >= 2")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
        self.tokenizer = tokenizer
        self.max_batch, self.max_len = int(max_batch), int(max_model_len)
        self.max_prompt_len = self.max_len - 1 if max_prompt_len is None else int(max_prompt_len)
        if not 1 <= self.max_prompt_len < self.max_len:
            raise ValueError(f"max_prompt_len={max_prompt_len} must be in [1, max_model_len - 1 = {self.max_len - 1}]")
        self.prefill_chunk = int(prefill_chunk)
        self.piece = min(self.prefill_chunk, self.max_prompt_len)     # the most tokens a row prefills per call
        self.buckets = tuple(sorted({int(b) for b in (prefill_buckets or _buckets(self.piece))}))
        if self.buckets[-1] < self.piece or self.buckets[0] < 1:
            raise ValueError(f"prefill_buckets={self.buckets} must be >= 1 and reach min(prefill_chunk, max_prompt_len)"
                             f" = {self.piece}")
        self.decode_buckets = tuple(sorted({int(b) for b in (decode_buckets or (self.max_batch,))}))
        if self.decode_buckets[0] < 1 or self.decode_buckets[-1] != self.max_batch:
            raise ValueError(f"decode_buckets={tuple(decode_buckets)} must be >= 1 and end at max_batch={self.max_batch}")
        if len(self.decode_buckets) > 1 and speculative:
            raise ValueError(f"decode_buckets={self.decode_buckets}: row buckets are not supported with speculative "
                             "decoding (speculative steps run over all max_batch slots)")
        self.num_draft = int(speculative)
        if self.num_draft:
            check_num_draft(config, self.num_draft)
        self.runtime = None
        if kv_cache == "paged":
            if len(self.decode_buckets) > 1:
                self.decode_buckets = (self.max_batch,)    # a paged step runs as many rows as it has tokens
            budget = max_num_batched_tokens or self.max_batch + self.piece
            self.runtime = PagedRuntime(config, params, max_running=self.max_batch, max_model_len=self.max_len,
                                        page_size=page_size, kv_cache_tokens=kv_cache_tokens,
                                        max_num_batched_tokens=budget, prefill_chunk=self.piece,
                                        prefix_cache="radix" if prefix_reuse else "none", mesh=mesh, rules=rules)
            self.programs = self.runtime.programs
            self.buckets = self.runtime.widths
        else:
            # the last verification writes up to n + 1 slots past the context
            size = self.max_len + (self.num_draft + 2 if self.num_draft else 0)
            self.programs = Programs(config, mesh, max_batch=self.max_batch, size=size, num_draft=self.num_draft,
                                     rules=rules)
        self.config = self.programs.config
        if len(self.decode_buckets) > 1 and self.programs.shards > 1:
            raise ValueError(f"decode_buckets={self.decode_buckets}: row buckets need a single batch shard; this "
                             f"mesh has {self.programs.shards} (every decode step runs all max_batch slots)")
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.max_queue, self.prefix_reuse, self.min_reuse = int(max_queue), bool(prefix_reuse), int(min_reuse)
        self.batching = batching
        self.params = self.runtime.params if self.runtime else self.programs.place_params(params)
        self.version = int(version)
        self._pending_weights = None          # a version waiting to be swapped in (its params in self._weights)
        self._weights: dict = {}              # version -> params handed to update_weights, not yet swapped in
        self._bcast = Broadcast() if multi_process(self.programs.mesh) else None
        self._epoch = 0                       # weight swaps so far: rows of older epochs are never reused
        if self.runtime is None:
            self._reset_cache()
        else:
            self.state = None                 # the runtime holds the page pool
        self.acceptance = {"length": 1.0, "per_depth": [], "steps": 0}
        self._acc = np.zeros((2 + self.num_draft,), np.int64)
        per = self.programs.per_shard
        self.slots = [_Slot(i, i // per, i % per, np.zeros((0,), np.int32)) for i in range(self.max_batch)]
        self._queue: collections.deque = collections.deque()
        self._order = 0
        self._cv = threading.Condition()
        self._paused = False
        self._idle = threading.Event()
        self._stop = False
        self._rng = np.random.default_rng(seed)
        self.metrics = metrics
        self.stats = collections.Counter()
        self._step_done: Optional[float] = None     # when the last paged step's outputs reached the host
        self._thread: Optional[threading.Thread] = None
        if start and (self._bcast is None or is_leader()):     # other processes of a multi-process mesh run follow()
            self.start()

    @property
    def mesh(self):
        return self.programs.mesh

    def _reset_cache(self):
        if self.runtime is not None:
            self.runtime.reset()
            self.state = None
        else:
            self.state = self.programs.alloc()

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True, name="glm5-engine")
            self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        elif self._bcast is not None and is_leader():     # no loop thread to tell the followers
            self._bcast.exchange(("stop", ()))
            self._bcast = None
        for h in list(self._queue):
            h._finish("cancelled")
        for s in self.slots:
            if s.handle is not None:
                s.handle._finish("cancelled")

    def pause(self, timeout: float = 600.0) -> None:
        """Hold the loop between two steps (requests in flight wait; new ones queue). Returns once held."""
        with self._cv:
            self._paused = True
            self._idle.clear()
            self._cv.notify_all()
        if self._thread is not None and not self._idle.wait(timeout):
            raise TimeoutError("the engine did not reach a step boundary")

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def update_weights(self, params, version: int) -> None:
        """New weights from the next step on (tokens report the version that produced them)."""
        with self._cv:
            self._weights[int(version)] = params
            self._pending_weights = int(version)
            self._cv.notify_all()

    def warmup(self, echo: bool = False) -> list:
        """Compile every prefill bucket and every decode program now (rows that write nothing), the loop
        held. Returns the compiled prefill (bucket, echo) pairs."""
        n, r = self.programs.shards, self.max_batch
        done = []
        self.pause()
        if self.runtime is not None:
            try:
                for w in self.buckets:
                    for e in ((False, True) if echo else (False,)):
                        for tw in self.runtime.table_widths:
                            self._op("paged_step", w, e, self.runtime.idle_args(w, tw))
                        done.append((w, e))
                jax.block_until_ready(self.runtime.pool)
            finally:
                self.resume()
            return done
        try:
            z, zf, zu = np.zeros((n,), np.int32), np.zeros((n,), np.float32), np.zeros((n,), np.uint32)
            for b in self.buckets:
                for e in ((False, True) if echo else (False,)):
                    zt = np.zeros((n, b), np.int32)
                    self._op("prefill", b, e, z, z, zt, zt, z, z, zf, z, zf + 1, zu)
                    done.append((b, e))
            if self.num_draft:
                idle = (np.zeros((r,), np.int32), np.zeros((r,), bool), np.zeros((r,), np.float32),
                        np.zeros((r,), np.int32), np.ones((r,), np.float32), np.zeros((r,), np.uint32),
                        np.zeros((r,), np.int32))
                for greedy in (True, False):
                    self._op("spec_decode", greedy, *idle)
            else:
                for rows in self.decode_buckets:
                    zi, zf = np.zeros((rows,), np.int32), np.zeros((rows,), np.float32)
                    self._op("decode", rows, zi, zi, np.zeros((rows,), bool), zf, zi, zf + 1,
                             np.zeros((rows,), np.uint32), zi)
                if len(self.decode_buckets) > 1:
                    self._op("move", np.int32(0), np.int32(0))
            jax.block_until_ready(self.state)
        finally:
            self.resume()
        return done

    # ---------------------------------------------------------------- device operations
    def _op(self, op: str, *args):
        """Run one device operation; over several processes process 0 broadcasts it first and every other
        process runs the same (`follow`), so all issue the same programs in the same order."""
        if self._bcast is not None:
            self._bcast.exchange((op, args))
        return self._run(op, args)

    def _run(self, op: str, args):
        pr = self.programs
        if op == "paged_step":
            return to_host(self.runtime.run_program(*args))
        if op == "prefill":
            return to_host(self._prefill_call(*args))
        if op == "decode":
            rows, *a = args
            *out, lay = pr.call(pr.decode_rows(rows), self.params, self.state["cache"]["layers"], *a)
            self._set_layers(lay)
            return to_host(tuple(out))
        if op == "spec_decode":
            greedy, *a = args
            self.state, *out = pr.call(pr.spec_decode(greedy), self.params, self.state, *a)
            return to_host(tuple(out))
        if op == "move":
            self._set_layers(pr.call(pr.move_row(), self.state["cache"]["layers"], *args))
            return None
        if op == "reset":
            self._reset_cache()
            return None
        if op == "weights":
            if self.runtime is not None:
                self.runtime.new_weights(self._take_weights(args[0]))
                self.params = self.runtime.params
            else:
                self.params = pr.place_params(self._take_weights(args[0]))
            return None
        raise ValueError(f"unknown engine operation {op!r}")

    def _take_weights(self, version: int):
        """The params handed to update_weights for `version` (on a follower, wait for that call)."""
        with self._cv:
            while version not in self._weights:
                self._cv.wait()
            params = self._weights.pop(version)
            for v in [v for v in self._weights if v < version]:
                del self._weights[v]
            return params

    def follow(self) -> None:
        """Processes other than 0: run process 0's device operations until it shuts down. Weight pushes
        need `update_weights(params, version)` on every process (each passes its handles of the same
        global arrays); the swap happens when process 0 makes it."""
        if self._bcast is None:
            raise RuntimeError("follow() is for processes other than 0 of a multi-process engine")
        while True:
            op, args = self._bcast.exchange()
            if op == "stop":
                return
            try:
                self._run(op, args)
            except Exception:           # process 0 saw the same failure: it fails its requests and resets
                traceback.print_exc()

    def _set_layers(self, layers):
        self.state = dict(self.state, cache=dict(self.state["cache"], layers=layers))

    # ---------------------------------------------------------------- requests
    def submit(self, prompt_ids: Sequence[int], params: Optional[SamplingParams] = None, *,
               request_id: Optional[str] = None, on_event: Optional[Callable] = None,
               prefix: bool = True) -> RequestHandle:
        params = (params or SamplingParams()).validate(self.config.vocab_size)
        if params.stop and self.tokenizer is None:
            raise EngineError("stop strings need the engine's tokenizer", "stop")
        ids = list(prompt_ids)
        if not ids:
            raise EngineError("the prompt is empty: at least one token is needed", "prompt")
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= int(t) < self.config.vocab_size:
                raise EngineError(f"prompt token id {t!r} is outside the vocabulary [0, {self.config.vocab_size})",
                                  "prompt")
        ids = [int(t) for t in ids]
        if len(ids) >= self.max_len:
            raise EngineError(f"the prompt has {len(ids)} tokens; this model's context is {self.max_len} tokens "
                              f"(max_model_len), leaving room for at least one generated token", "prompt")
        if len(ids) > self.max_prompt_len:
            raise EngineError(f"the prompt has {len(ids)} tokens; this engine takes at most {self.max_prompt_len} "
                              f"(max_prompt_len)", "prompt")
        h = RequestHandle(request_id or uuid.uuid4().hex, ids, params, on_event)
        h._prefix_ok = prefix and self.prefix_reuse and not params.prompt_logprobs
        if self.tokenizer is not None:
            h._stream = TextStream(self.tokenizer, params.stop)
        h._seed = int(params.seed if params.seed is not None else self._rng.integers(0, 2 ** 31)) % (2 ** 32)
        with self._cv:
            if self._stop:
                raise RuntimeError("the engine is shut down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are waiting (max_queue={self.max_queue}); retry later")
            self._queue.append(h)
            self._cv.notify_all()
        return h

    def generate(self, prompts: Sequence[Sequence[int]], params: Optional[SamplingParams] = None,
                 timeout: Optional[float] = None) -> List[RequestHandle]:
        hs = [self.submit(p, params) for p in prompts]
        return [h.result(timeout) for h in hs]

    @property
    def queue_length(self) -> int:
        return len(self._queue) + (len(self.runtime.waiting) if self.runtime is not None else 0)

    @property
    def active(self) -> int:
        if self.runtime is not None:
            return len(self.runtime.running)
        return sum(s.handle is not None for s in self.slots)

    def compiled_programs(self) -> int:
        """Programs compiled so far (prefill and decode buckets): constant after warmup within the buckets."""
        return self.programs.compiled_count()

    # ---------------------------------------------------------------- loop
    def _loop(self):
        while True:
            with self._cv:
                while not self._stop and (self._paused or (not self._queue and not self.active
                                                           and self._pending_weights is None)):
                    if self._paused:
                        self._idle.set()
                    self._cv.wait()
                if self._stop:
                    if self._bcast is not None:
                        self._bcast.exchange(("stop", ()))
                        self._bcast = None
                    return
                swap, self._pending_weights = self._pending_weights, None
            try:
                if swap is not None:
                    self._op("weights", swap)
                    self.version = swap
                    self._epoch += 1
                self._cancel_requests()
                if self.runtime is not None:
                    self._paged_step()
                else:
                    self._admit()
                    if any(s.fill is not None for s in self.slots):
                        self._prefill_step()
                    filling = any(s.fill is not None for s in self.slots)
                    if not (filling and self.batching == "static"):     # static: the whole batch is prefilled first
                        self._step()
            except Exception as e:            # a failing step fails its requests, never the engine
                msg = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                if self.runtime is not None:
                    for seq in self.runtime.running + self.runtime.waiting:
                        seq.handle._finish("error", msg)
                for s in self.slots:
                    if s.handle is not None:
                        s.handle._finish("error", msg)
                    s.handle, s.fill, s.cached = None, None, np.zeros((0,), np.int32)   # the rows are zeroed below
                self._op("reset")
            if self.metrics is not None:
                self.metrics.observe_engine(self)

    def _cancel_requests(self):
        if self.runtime is not None:
            for seq in self.runtime.running + self.runtime.waiting:
                if seq.handle._cancel:
                    self._release(seq, "cancelled")
            return
        for s in self.slots:
            if s.handle is not None and s.handle._cancel:
                self._release(s, "cancelled")

    def _admit(self):
        """Queued requests into free slots (their prompts are prefilled piece by piece, `_prefill_step`).
        A slot that a waiting prompt will copy its prefix from is not free until that copy ran."""
        if self.batching == "static" and any(s.handle is not None and s.fill is None for s in self.slots):
            return
        while True:
            pinned = {(s.shard, s.fill.src) for s in self.slots if s.fill is not None and s.fill.src != s.local}
            free = [s for s in self.slots if s.handle is None and (s.shard, s.local) not in pinned]
            with self._cv:
                if not free or not self._queue:
                    return
                h = self._queue.popleft()
            if h._cancel:
                h._finish("cancelled")
                continue
            slot, src, start = self._choose(h, free)
            slot.handle, slot.seed, slot.epoch = h, h._seed, self._epoch
            self._order += 1
            slot.fill = _Fill(done=start, src=(slot if src is None else src).local, order=self._order,
                              echo=[] if h.params.prompt_logprobs else None)
            slot.cached = np.asarray(h.prompt[:start], np.int32)
            h.reused_tokens = start
            self.stats["reused_tokens"] += start

    def _keep(self, s: _Slot) -> tuple:
        """Sort key of free slots to overwrite first: no reusable row, then least recently used."""
        return len(s.cached) > 0 and s.epoch == self._epoch, s.last_used

    def _rows(self, n: int) -> int:
        """The decode bucket that covers slots 0..n-1."""
        return next(b for b in self.decode_buckets if b >= n)

    def _choose(self, h, free):
        """(slot, source slot or None, reused prefix length) for a new request. The source holds the longest
        cached prefix of the prompt on a shard with a free slot; with several decode buckets only the free
        slots that keep the decode bucket smallest are candidates (lowest rows first)."""
        if len(self.decode_buckets) > 1:
            top = max((s.index + 1 for s in self.slots if s.handle is not None), default=0)
            cost = {s.index: self._rows(max(top, s.index + 1)) for s in free}
            free = [s for s in free if cost[s.index] == min(cost.values())]
        p = np.asarray(h.prompt, np.int32)
        shards = {s.shard for s in free}
        best, best_n = None, 0
        if h._prefix_ok:
            for s in self.slots:
                if s.epoch != self._epoch or s.shard not in shards:   # older weights' keys, or no room beside it
                    continue
                m = min(len(s.cached), len(p) - 1)
                if m <= best_n:
                    continue
                eq = s.cached[:m] == p[:m]
                n = m if eq.all() else int(np.argmin(eq))
                if n > best_n or (n == best_n and best is not None and best.handle is not None and s.handle is None):
                    best, best_n = s, n
        if best is not None and best_n >= self.min_reuse:
            if any(s is best for s in free):          # a free candidate: taken as it is
                return best, None, best_n
            target = min((s for s in free if s.shard == best.shard), key=lambda s: s.last_used)
            return target, best, best_n
        return min(free, key=self._keep), None, 0

    # ---------------------------------------------------------------- prefill
    def _prefill_call(self, width, echo, lslot, lsrc, toks, targets, start, length, temp, top_k, top_p, seed):
        pr = self.programs
        chunk = min(self.prefill_chunk, width)
        if not self.num_draft:
            out = pr.call(pr.prefill(width, chunk, echo), self.params, self.state["cache"]["layers"], lslot, lsrc,
                          toks, targets, start, length, temp, top_k, top_p, seed)
            self._set_layers(out[-1])
            return out[:-1]
        ech = None
        if echo:         # the trunk's log-probs of the prompt; the speculative prefill then redoes the rows
            *_, ech, lay = pr.call(pr.prefill(width, chunk, True), self.params, self.state["cache"]["layers"], lslot,
                                   lsrc, toks, targets, start, length, temp, top_k, top_p, seed)
            self._set_layers(lay)
        *first, self.state = pr.call(pr.spec_prefill(width, chunk), self.params, self.state, lslot, lsrc, toks, start,
                                     length, temp, top_k, top_p, seed)
        return (*first, ech)

    def _prefill_step(self):
        """One piece (<= prefill_chunk tokens) of every shard's prompt in one program call."""
        n = self.programs.shards
        rows = {}
        for s in sorted((s for s in self.slots if s.fill is not None), key=lambda s: s.fill.order):
            rows.setdefault(s.shard, s)
        pieces = {k: min(len(s.handle.prompt) - s.fill.done, self.piece) for k, s in rows.items()}
        width = next(b for b in self.buckets if b >= max(pieces.values()))
        lslot, lsrc, start, length = (np.zeros((n,), np.int32) for _ in range(4))
        toks, targets = np.zeros((n, width), np.int32), np.zeros((n, width), np.int32)
        temp, top_p = np.zeros((n,), np.float32), np.ones((n,), np.float32)
        top_k, seed = np.zeros((n,), np.int32), np.zeros((n,), np.uint32)
        for k, s in rows.items():
            h, f, m = s.handle, s.fill, pieces[k]
            lslot[k], lsrc[k], start[k], length[k] = s.local, f.src, f.done, m
            toks[k, :m] = h.prompt[f.done:f.done + m]
            nxt = h.prompt[f.done + 1:f.done + m + 1]
            targets[k, :len(nxt)] = nxt
            temp[k], top_k[k], top_p[k], seed[k] = h.params.temperature, h.params.top_k, h.params.top_p, s.seed
        t0 = time.perf_counter()
        tok, lp_s, lp_m, ti, tv, ech = self._op("prefill", width, any(s.fill.echo is not None for s in rows.values()),
                                                lslot, lsrc, toks, targets, start, length, temp, top_k, top_p, seed)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["prefill_calls"] += 1
        for k, s in rows.items():
            h, f, m = s.handle, s.fill, pieces[k]
            if f.echo is not None:
                f.echo.append(tuple(a[k, :m] for a in ech))
            f.done += m
            f.src = s.local
            s.cached = np.asarray(h.prompt[:f.done], np.int32)
            self.stats["prefill_tokens"] += m
            if f.done < len(h.prompt):
                continue
            self.stats["prefills"] += 1
            if f.echo is not None:
                lps, eti, etv = (np.concatenate(a) for a in zip(*f.echo))
                p = len(h.prompt) - h.reused_tokens
                h.prompt_logprobs = [None] + [float(x) for x in lps[:p - 1]]
                h.prompt_top_logprobs = [None] + [list(zip(eti[i].tolist(), etv[i].tolist())) for i in range(p - 1)]
            s.fill, s.pos = None, len(h.prompt)
            s.last_used = time.perf_counter()
            self._deliver(s, int(tok[k]), float(lp_m[k]), float(lp_s[k]), ti[k], tv[k])

    # ---------------------------------------------------------------- decode
    def _compact(self):
        """Move the requests of slots past the decode bucket their count needs into free lower slots (a
        row copy each), so a draining batch decodes over fewer rows. Outputs do not depend on the slot."""
        act = [s for s in self.slots if s.handle is not None]
        need = self._rows(len(act)) if act else 0
        high = [s for s in act if s.index >= need and s.fill is None]
        if not high:
            return
        holes = sorted((s for s in self.slots[:need] if s.handle is None), key=self._keep)
        for src, dst in zip(high, holes):
            self._op("move", np.int32(dst.index), np.int32(src.index))
            dst.handle, dst.pos, dst.next_token, dst.seed = src.handle, src.pos, src.next_token, src.seed
            dst.cached, dst.last_used, dst.epoch = src.cached, src.last_used, src.epoch   # src's row still holds them
            src.handle = None
            self.stats["moves"] += 1

    def _step(self):
        if len(self.decode_buckets) > 1:
            self._compact()
        dec = [s for s in self.slots if s.handle is not None and s.fill is None]
        if not dec:
            return
        b = self.max_batch if self.num_draft else self._rows(max(s.index + 1 for s in dec))
        tok, pos = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        active = np.zeros((b,), bool)
        temp, top_p = np.zeros((b,), np.float32), np.ones((b,), np.float32)
        top_k, seeds, counts = np.zeros((b,), np.int32), np.zeros((b,), np.uint32), np.zeros((b,), np.int32)
        for s in dec:
            h, i = s.handle, s.index
            tok[i], pos[i], active[i] = s.next_token, s.pos, True
            temp[i], top_p[i], top_k[i] = h.params.temperature, h.params.top_p, h.params.top_k
            seeds[i], counts[i] = s.seed, len(h.tokens)
        if self.num_draft:
            return self._spec_step(dec, pos, active, temp, top_k, top_p, seeds, counts)
        t0 = time.perf_counter()
        nxt, lp_s, lp_m, ti, tv = self._op("decode", b, tok, pos, active, temp, top_k, top_p, seeds, counts)
        self.stats["steps"] += 1
        self.stats["slot_steps"] += len(dec)
        self.stats["decode_rows"] += b
        self.stats["decode_s"] += time.perf_counter() - t0
        for s in dec:
            i = s.index
            s.cached = np.append(s.cached, np.int32(s.next_token))
            s.pos += 1
            self._deliver(s, int(nxt[i]), float(lp_m[i]), float(lp_s[i]), ti[i], tv[i])

    def _spec_step(self, dec, pos, active, temp, top_k, top_p, seeds, counts):
        n = self.num_draft
        greedy = bool(np.all(temp[active] <= 0))
        e = np.where(active, pos - 1, 0).astype(np.int32)
        t0 = time.perf_counter()
        g, lp, a = self._op("spec_decode", greedy, e, active, temp, top_k, top_p, seeds, counts)
        self.stats["steps"] += 1
        self.stats["slot_steps"] += len(dec)
        self.stats["decode_rows"] += len(pos)
        self.stats["decode_s"] += time.perf_counter() - t0
        acc = self._acc
        acc[0] += int((a[active] + 1).sum())
        acc[1] += int(active.sum())
        for k in range(1, n + 1):
            acc[1 + k] += int((a[active] >= k).sum())
        self.acceptance = {"length": float(acc[0] / max(acc[1], 1)), "per_depth": (acc[2:] / max(acc[1], 1)).tolist(),
                           "steps": int(acc[1])}
        empty = np.zeros((0,), np.int32)
        for s in dec:
            i = s.index
            for j in range(int(a[i]) + 1):
                s.cached = np.append(s.cached, np.int32(s.next_token))
                s.pos += 1
                self._deliver(s, int(g[i, j]), float(lp[i, j]), float(lp[i, j]), empty, empty)
                if s.handle is None:
                    break

    # ---------------------------------------------------------------- the paged runtime
    def _paged_step(self):
        """Queued requests into the runtime (as many as may run; static: only into an empty batch), then one
        runtime step (decodes and prefill chunks in one program) and its tokens delivered."""
        rt = self.runtime
        with self._cv:
            room = self.max_batch - len(rt.running) - len(rt.waiting)
            if self.batching == "static" and (rt.running or rt.waiting):
                room = 0
            new = [self._queue.popleft() for _ in range(max(0, min(room, len(self._queue))))]
        for h in new:
            if h._cancel:
                h._finish("cancelled")
                continue
            sp = h.params
            stops = tuple(sp.stop_token_ids) + (() if sp.ignore_eos else self.stop_token_ids)
            rt.add(Seq(list(h.prompt), sp.temperature, sp.top_k, sp.top_p, h._seed, sp.max_tokens, stops,
                       prefix=h._prefix_ok, echo=[] if sp.prompt_logprobs else None, handle=h))
        plan = rt.plan()
        if plan is None:
            self._step_done = None
            return
        for seq, *_ in plan.rows:
            if not seq.tokens:
                seq.handle.reused_tokens = seq.reused
        t0 = time.perf_counter()
        if self._step_done is not None:      # back to back: the host's time between two steps (not overlapped)
            gap = t0 - self._step_done
            self.stats["host_gap_s"] += gap
            self.stats["host_gaps"] += 1
            hook = getattr(self.metrics, "observe_host_gap", None)      # optional in a metrics object
            if hook is not None:
                hook(gap)
        out = self._op("paged_step", plan.width, plan.echo, plan.args)
        self._step_done = time.perf_counter()
        dt = self._step_done - t0
        decodes = sum(len(seq.context) - seq.cached == 1 for seq, *_ in plan.rows)
        self.stats["steps"] += 1
        self.stats["slot_steps"] += decodes
        self.stats["decode_rows"] += plan.width
        self.stats["prefill_tokens"] += plan.tokens - decodes
        self.stats["decode_s"] += dt
        before = {seq: seq.cached for seq, *_ in plan.rows}
        events = rt.commit(plan, out)
        self.stats["reused_tokens"] = rt.stats["reused_tokens"]
        for seq, tok, lp_m, lp_s, ti, tv in events:
            h = seq.handle
            if len(seq.tokens) == 1:
                self.stats["prefills"] += int(before[seq] < len(seq.prompt))
                if seq.echo is not None:
                    h.prompt_logprobs = [None] + [lp for lp, _, _ in seq.echo]
                    h.prompt_top_logprobs = [None] + [list(zip(np.asarray(i).tolist(), np.asarray(v).tolist()))
                                                      for _, i, v in seq.echo]
            self._deliver(seq, tok, lp_m, lp_s, ti, tv)

    # ---------------------------------------------------------------- outputs
    def _deliver(self, s, tok: int, lp_m: float, lp_s: float, ti, tv):
        h = s.handle
        now = time.perf_counter()
        if h.first_token_at is None:
            h.first_token_at = now
        h.token_times.append(now)
        h.tokens.append(tok)
        h.logprobs.append(lp_m)
        h.sample_logprobs.append(lp_s)
        h.top_logprobs.append(list(zip(np.asarray(ti).tolist(), np.asarray(tv).tolist())))
        h.versions.append(self.version)
        self.stats["generated_tokens"] += 1
        sp = h.params
        reason = None
        if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.stop_token_ids):
            reason = "stop"
        delta = ""
        if h._stream is not None:
            if reason == "stop":          # a stop id's text is not part of the output text
                delta = h._stream.flush()
            else:
                delta, hit = h._stream.push(tok)
                reason = "stop" if hit else None
        if reason is None and (len(h.tokens) >= sp.max_tokens or s.pos >= self.max_len):
            reason = "length"
            if h._stream is not None:
                delta += h._stream.flush()
        h._emit(TokenEvent(tok, lp_m, lp_s, h.top_logprobs[-1], delta, self.version))
        if self.metrics is not None:
            self.metrics.observe_token(h, now)
        if reason is not None:
            self._release(s, reason)
        else:
            s.next_token = tok

    def _release(self, s, reason: str):
        h = s.handle
        if h._stream is not None:
            h.text = h._stream.text
        if isinstance(s, Seq):
            self.runtime.finish(s, reason)
        else:
            s.handle, s.fill = None, None
            s.last_used = time.perf_counter()
        self.stats["finished"] += 1
        h._finish(reason)
        if self.metrics is not None:
            self.metrics.observe_finish(h)
