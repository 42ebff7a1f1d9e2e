"""The serving engine: continuous batching on the paged generation runtime, on one device or a mesh.

The engine is the runtime's (glm5_jax.infer.runtime.PagedRuntime) driver for concurrent requests: a
thread takes queued requests into the runtime as far as ``max_batch`` sequences may run, runs one
runtime step after another (the running sequences' decode tokens first, then prefill chunks of waiting
prompts, in one program: a long prompt delays the running requests by at most one chunk), and delivers
each step's tokens to their requests (text deltas, stop strings, streaming callbacks, metrics). The cache
is a pool of pages (``kv_cache_tokens`` positions, pages of ``page_size``) with cached prefixes shared
by reference (``prefix_reuse``: a later turn of the same rollout, a shared system prompt, the n samples
of one prompt); ``kv_cache="slots"`` is the one-row-per-slot policy (page_size = max_model_len, no
sharing) kept for comparison. ``speculative=n``: MTP self-speculation with n drafts a step, on the same
pages.

Per request: temperature (0 = greedy), top_p, top_k, seed, stop strings and ids, max_tokens. Each
request samples with its own PRNG key, ``fold_in(PRNGKey(seed), i)`` for its i-th token, and its rows
never mix with other rows (per-row positions and page tables; the MoE is dropless), so its output does
not depend on its batch-mates, its pages, the mesh or whether its prefix came from the cache.

Shapes are fixed: a step pads its token rows to the smallest of the runtime's widths and its page tables
to the smallest of its table widths, so after ``warmup()`` nothing compiles again.

Weights: ``update_weights(params, version)`` swaps them between two steps (resharded device to device
into the serving layout); every token carries the version of the weights that produced it. Requests in
flight continue on the new weights (over the keys already cached); cached prefixes of older weights are
never reused, so a new request's context is always prefilled by the weights that sample it. ``pause()``
/ ``resume()`` hold the loop between steps (an RL update), new requests queue meanwhile.

Several processes (a multi-host slice): process 0 schedules and broadcasts each device operation, every
other process runs the same (``follow``; glm5_jax.serve.multihost).
"""

from __future__ import annotations

import collections
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
from glm5_jax.infer.programs import TOP_LOGPROBS
from glm5_jax.serve.request import EngineError, QueueFull, RequestHandle, SamplingParams, TokenEvent
from glm5_jax.infer.runtime import PagedRuntime, Seq
from glm5_jax.sharding import SERVE_RULES

__all__ = ["Engine", "EngineError", "QueueFull", "RequestHandle", "SamplingParams", "TOP_LOGPROBS", "TokenEvent"]


class Engine:
    """Continuous batching of up to ``max_batch`` sequences of up to ``max_model_len`` positions.

    ``submit(prompt_ids, SamplingParams) -> RequestHandle`` (thread-safe; raises EngineError for a bad
    request, QueueFull past ``max_queue`` waiting requests). ``generate(prompts, params)`` is the blocking
    convenience. ``batching="static"`` admits requests only into an empty batch (the batch runs to its
    longest row): the policy of the old rollout servers, kept for comparison (tools.bench_serve).
    ``tokenizer`` (optional): decodes text deltas and enables stop strings. ``max_prompt_len`` (default
    ``max_model_len - 1``): the longest prompt accepted. ``prefill_chunk``: the most prompt tokens a
    sequence prefills per step. ``kv_cache_tokens`` (default max_batch x max_model_len), ``page_size``,
    ``max_num_batched_tokens`` (default max_batch x (1 + speculative) + the chunk): the runtime's pool and
    token budget; ``step_widths`` the token-row counts below it a step compiles for (default powers of two).
    ``mesh`` (default one device): a ``jax.sharding.Mesh`` over the serving axes (data,
    fsdp, expert, tensor); ``rules`` the logical sharding rules (default ``SERVE_RULES``)."""

    def __init__(self, config, params, *, max_batch: int = 8, max_model_len: int = 256, tokenizer=None,
                 stop_token_ids: Sequence[int] = (), max_queue: int = 256, prefill_chunk: int = 512,
                 prefix_reuse: bool = True, batching: str = "continuous", version: int = 0, seed: int = 0,
                 metrics=None, start: bool = True, speculative: int = 0, max_prompt_len: Optional[int] = None,
                 mesh=None, rules=SERVE_RULES, kv_cache: str = "paged", page_size: int = 16,
                 kv_cache_tokens: Optional[int] = None, max_num_batched_tokens: Optional[int] = None,
                 step_widths: Optional[Sequence[int]] = None):
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching={batching!r}: continuous | static")
        if kv_cache not in ("paged", "slots"):
            raise ValueError(f"kv_cache={kv_cache!r}: paged | slots")
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
        self.piece = min(self.prefill_chunk, self.max_prompt_len)     # the most tokens a sequence prefills a step
        self.num_draft = int(speculative)
        if self.num_draft:
            check_num_draft(config, self.num_draft)
        if kv_cache == "slots":           # one row of max_model_len positions per sequence, nothing shared
            page_size, prefix_reuse = self.max_len, False
        budget = max_num_batched_tokens or self.max_batch * (1 + self.num_draft) + self.piece
        self.runtime = PagedRuntime(config, params, max_running=self.max_batch, max_model_len=self.max_len,
                                    page_size=page_size, kv_cache_tokens=kv_cache_tokens,
                                    max_num_batched_tokens=budget, prefill_chunk=self.piece,
                                    prefix_cache="radix" if prefix_reuse else "none", mesh=mesh, rules=rules,
                                    num_draft=self.num_draft, widths=step_widths)
        self.programs = self.runtime.programs
        self.buckets = self.runtime.widths
        self.config = self.programs.config
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.max_queue, self.prefix_reuse = int(max_queue), bool(prefix_reuse)
        self.batching = batching
        self.params = self.runtime.params
        self.version = int(version)
        self._pending_weights = None          # a version waiting to be swapped in (its params in self._weights)
        self._weights: dict = {}              # version -> params handed to update_weights, not yet swapped in
        self._bcast = Broadcast() if multi_process(self.programs.mesh) else None
        self._epoch = 0                       # weight swaps so far: cached prefixes of older epochs are never reused
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._paused = False
        self._idle = threading.Event()
        self._stop = False
        self._rng = np.random.default_rng(seed)
        self.metrics = metrics
        self.stats = collections.Counter()
        self._step_done: Optional[float] = None     # when the last step's outputs reached the host
        self._inflight: collections.deque = collections.deque()     # (plan, launch time, decodes) launched
        self._outs: collections.deque = collections.deque()         # their device outputs (every process)
        self._thread: Optional[threading.Thread] = None
        if start and (self._bcast is None or is_leader()):     # other processes of a multi-process mesh run follow()
            self.start()

    @property
    def mesh(self):
        return self.programs.mesh

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
        for seq in self.runtime.running + self.runtime.waiting:
            seq.handle._finish("cancelled")

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
        """Compile every step program now (every width and page-table width; with speculation its greedy
        and sampled variants; `echo`: the prompt log-prob variants too) on steps that write nothing, the
        loop held. Returns the compiled (width, echo) pairs."""
        rt, done = self.runtime, []
        self.pause()
        try:
            for w in self.buckets:
                for e in ((False, True) if echo else (False,)):
                    for tw in rt.table_widths:
                        for greedy in ((True, False) if self.num_draft else (False,)):
                            self._op("launch", w, e, rt.idle_args(w, tw), greedy, False, None)
                            self._op("fetch")
                    done.append((w, e))
            jax.block_until_ready(rt.pool)
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
        if op == "launch":               # dispatched; its outputs stay on the device until "fetch"
            self._outs.append(self.runtime.run_program(*args))
            return None
        if op == "fetch":
            return to_host(self._outs.popleft())
        if op == "reset":
            self._outs.clear()
            self.runtime.reset()
            return None
        if op == "weights":
            self.runtime.new_weights(self._take_weights(args[0]))
            self.params = self.runtime.params
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
        return len(self._queue) + len(self.runtime.waiting)

    @property
    def active(self) -> int:
        return len(self.runtime.running)

    @property
    def acceptance(self) -> dict:
        """MTP speculation: {"length", "per_depth", "steps"} (`PagedRuntime.acceptance`)."""
        return self.runtime.acceptance()

    def compiled_programs(self) -> int:
        """Programs compiled so far (one per step shape): constant after warmup."""
        return self.programs.compiled_count()

    # ---------------------------------------------------------------- loop
    def _loop(self):
        while True:
            if self._inflight and (self._paused or self._stop or self._pending_weights is not None):
                try:                             # a step boundary: nothing in flight
                    self._drain()
                except Exception as e:
                    self._fail(e)
            with self._cv:
                while not self._stop and (self._paused or (not self._queue and not self.active
                                                           and not self.runtime.waiting
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
                self._step()
            except Exception as e:            # a failing step fails its requests, never the engine
                self._fail(e)
            if self.metrics is not None:
                self.metrics.observe_engine(self)

    def _fail(self, e: Exception) -> None:
        msg = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        for seq in self.runtime.running + self.runtime.waiting:
            seq.handle._finish("error", msg)
        self._inflight.clear()
        self._op("reset")

    def _cancel_requests(self):
        for seq in self.runtime.running + self.runtime.waiting:
            if seq.handle._cancel:
                self._release(seq, "cancelled")

    # ---------------------------------------------------------------- one step
    def _step(self):
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
        if not self._inflight and not self._launch():
            self._step_done = None
            return
        if not self.num_draft and len(self._inflight) < 2:
            self._launch()           # step N + 1 dispatched before step N's tokens reach the host
        self._collect()

    def _launch(self) -> bool:
        """Plan and dispatch one runtime step (decodes and prefill chunks in one program); False if nothing
        can run now. Without MTP speculation the runtime then counts the step's tokens as pending
        (`PagedRuntime.advance`), so the next step is planned, and fed those tokens on the device, before
        this one's outputs reach the host."""
        rt = self.runtime
        plan = rt.plan()
        if plan is None:
            return False
        for seq, *_ in plan.rows:
            if not seq.tokens:
                seq.handle.reused_tokens = seq.reused
        t0 = time.perf_counter()
        if self._step_done is not None and not self._inflight:   # back to back: the device waited on the host
            gap = t0 - self._step_done
            self.stats["host_gap_s"] += gap
            self.stats["host_gaps"] += 1
            hook = getattr(self.metrics, "observe_host_gap", None)      # optional in a metrics object
            if hook is not None:
                hook(gap)
        self._op("launch", plan.width, plan.echo, plan.args, plan.greedy, plan.row_keys, plan.from_prev)
        decodes = sum(len(seq.context) - seq.cached == 1 for seq, *_ in plan.rows)
        rt.advance(plan)
        self.stats["overlapped_steps"] += int(bool(self._inflight))
        self._inflight.append((plan, t0, decodes))
        return True

    def _collect(self) -> None:
        """The oldest launched step's outputs to the host, committed, and its tokens delivered."""
        rt = self.runtime
        plan, t0, decodes = self._inflight.popleft()
        out = self._op("fetch")
        self._step_done = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["slot_steps"] += decodes
        self.stats["decode_rows"] += plan.width
        self.stats["prefill_tokens"] += plan.tokens - decodes
        self.stats["decode_s"] += self._step_done - t0
        events = rt.commit(plan, out)
        self.stats["reused_tokens"] = rt.stats["reused_tokens"]
        for seq, tok, lp_m, lp_s, ti, tv in events:
            h = seq.handle
            if not h.tokens:                         # its first token
                self.stats["prefills"] += int(seq.reused < len(seq.prompt))
                if seq.echo is not None:
                    h.prompt_logprobs = [None] + [lp for lp, _, _ in seq.echo]
                    h.prompt_top_logprobs = [None] + [list(zip(np.asarray(i).tolist(), np.asarray(v).tolist()))
                                                      for _, i, v in seq.echo]
            self._deliver(seq, tok, lp_m, lp_s, ti, tv)

    def _drain(self) -> None:
        while self._inflight:
            self._collect()

    # ---------------------------------------------------------------- outputs
    def _deliver(self, s: Seq, tok: int, lp_m: float, lp_s: float, ti, tv):
        h = s.handle
        if h.finish_reason is not None:          # ended at an earlier token of this step (a stop string)
            return
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
        if reason is None and (len(h.tokens) >= sp.max_tokens or len(h.prompt) + len(h.tokens) > self.max_len):
            reason = "length"
            if h._stream is not None:
                delta += h._stream.flush()
        h._emit(TokenEvent(tok, lp_m, lp_s, h.top_logprobs[-1], delta, self.version))
        if self.metrics is not None:
            self.metrics.observe_token(h, now)
        if reason is not None:
            self._release(s, reason)

    def _release(self, s: Seq, reason: str):
        h = s.handle
        if h._stream is not None:
            h.text = h._stream.text
        self.runtime.finish(s, reason)
        self.stats["finished"] += 1
        h._finish(reason)
        if self.metrics is not None:
            self.metrics.observe_finish(h)
