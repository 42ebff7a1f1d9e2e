"""Continuous-batching generation engine on the model's own modules and KV cache.

One cache of ``max_batch`` rows ("slots") x ``max_model_len`` positions (``glm5_jax.infer.cache``);
every decode step runs the slots of a decode bucket (below) through ``glm5_jax.infer.decode.model_step``
(the model's forward with ``cache=`` and ``write_positions=``), one token per slot at that slot's own
position. A request takes a free slot between two decode steps (its prompt is prefilled into that row
alone) and gives it back when it ends, so requests join and leave a running batch; idle slots write
nothing (write position -1).

Per request: temperature (0 = greedy), top_p, top_k, seed, stop strings and ids, max_tokens. Each
request samples with its own PRNG key, ``fold_in(PRNGKey(seed), i)`` for its i-th token, and its rows
never mix with other rows (cache slot == position, per-row visibility; the MoE is dropless), so its
output does not depend on its batch-mates or its slot.

Shapes are fixed: a prefill pads its new tokens to the smallest of ``prefill_buckets`` (default powers of
two from 16 up to max_model_len); a decode step runs over the first R slots, R the smallest of
``decode_buckets`` (default just max_batch: every step runs all slots) that covers the highest busy slot.
So after ``warmup()`` (every prefill and decode bucket) nothing compiles again.

Decode buckets (on CPU a step's cost grows with its rows, so a draining batch should not pay for
``max_batch``): a new request takes a free slot that keeps R smallest (lowest rows first; least recently
used among those), and before each step requests in slots at or past the bucket their count needs are
moved into free lower slots (a row copy), so the long tail of a batch decodes over few rows.

Prefix reuse: each slot remembers which token ids its cache row holds (the prompt and every generated
token fed back). A new request whose prompt starts with the tokens of some slot (a later turn of the same
rollout, or a shared system prompt) reuses that prefix: when that slot is free it is taken as it is,
otherwise its row is copied into a free slot inside the prefill program; only the rest of the prompt is
prefilled, at positions after the prefix. Free slots keep their rows until a new request needs them
(least recently used first).

Weights: ``update_weights(params, version)`` swaps them between two steps; every token carries the
version of the weights that produced it. Requests in flight continue on the new weights (over the keys
already cached); cached rows written before a swap are never reused as a prefix afterwards, so a new
request's context is always prefilled by the weights that sample it. ``pause()`` / ``resume()`` hold
the loop between steps (an RL update), new requests queue meanwhile.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import queue as queue_mod
import threading
import time
import uuid
from typing import Callable, Dict, List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from glm5_jax.errors import Glm5Error
from glm5_jax.infer import cache as kv
from glm5_jax.infer.decode import final_norm, head, model_step, prefill_chunks
from glm5_jax.infer.sampling import sample_rows
from glm5_jax.infer.speculative import _check as _check_speculative
from glm5_jax.infer.speculative import mtp_pass, speculative_step
from glm5_jax.layers.common import dtype_of

__all__ = ["Engine", "EngineError", "QueueFull", "RequestHandle", "SamplingParams", "TOP_LOGPROBS"]

TOP_LOGPROBS = 20           # alternatives computed per position (OpenAI allows at most 20 top_logprobs)


class EngineError(Glm5Error):
    """A request the engine cannot serve (bad parameters, too long, bad token ids); ``param`` names the field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The bounded request queue is full; retry later."""


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: Optional[int] = None        # None: drawn from the engine's generator
    stop: Sequence[str] = ()          # stop strings (need a tokenizer); the text is cut before them
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False          # False: the engine's default stop ids end the request too
    prompt_logprobs: bool = False     # log-probs of the prompt tokens (echo): prefills the whole prompt

    def validate(self, vocab_size: int) -> "SamplingParams":
        def bad(field, msg):
            raise EngineError(f"{field}={getattr(self, field)!r} is invalid: {msg}", field)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature <= 100:
            bad("temperature", "a number in [0, 100]")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2 ** 63 <= self.seed < 2 ** 64):
            bad("seed", "an integer")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
            bad("stop", "a list of at most 16 non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids in [0, {vocab_size})")
        return self


@dataclasses.dataclass
class TokenEvent:
    token: int
    logprob: float                    # the model's log-softmax (temperature 1) of the chosen token
    sample_logprob: float             # log-prob under the distribution it was drawn from (RL's)
    top: List[tuple]                  # [(token, logprob)] * TOP_LOGPROBS, best first
    text: str                         # text delta released with this token ("" without a tokenizer)
    version: int


class RequestHandle:
    """A submitted request: its outputs grow as the engine produces them. Iterate ``events()`` (blocking)
    or pass ``on_event`` to ``Engine.submit`` (called from the engine thread). ``result()`` waits for the end."""

    def __init__(self, rid: str, prompt: List[int], params: SamplingParams, on_event: Optional[Callable]):
        self.id, self.prompt, self.params = rid, prompt, params
        self.tokens: List[int] = []
        self.logprobs: List[float] = []
        self.sample_logprobs: List[float] = []
        self.top_logprobs: List[list] = []
        self.versions: List[int] = []
        self.prompt_logprobs: Optional[List[Optional[float]]] = None   # [None, lp(t1 | t0), ...] with echo
        self.prompt_top_logprobs: Optional[List[Optional[list]]] = None
        self.text = ""
        self.finish_reason: Optional[str] = None     # stop | length | cancelled | error
        self.error: Optional[str] = None
        self.reused_tokens = 0
        self.submitted = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.token_times: List[float] = []
        self._on_event = on_event
        self._q: "queue_mod.Queue" = queue_mod.Queue()
        self._done = threading.Event()
        self._cancel = False
        self._detok_ids: List[int] = []
        self._text_full = ""          # decoded so far (stop strings cut it)
        self._released = 0            # characters of _text_full released as deltas

    # ---------------------------------------------------------------- consumer side
    def cancel(self) -> None:
        """Stop generating (e.g. the client went away); the slot frees at the next step."""
        self._cancel = True

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> "RequestHandle":
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self

    def events(self):
        """Yield TokenEvent per token, then the finish reason (a str) last."""
        while True:
            ev = self._q.get()
            yield ev
            if isinstance(ev, str):
                return

    # ---------------------------------------------------------------- engine side
    def _emit(self, ev):
        self._q.put(ev)
        if self._on_event is not None:
            self._on_event(self, ev)

    def _finish(self, reason: str, error: Optional[str] = None):
        if self.finish_reason is not None:
            return
        self.finish_reason, self.error = reason, error
        self.finished_at = time.perf_counter()
        self._emit(reason)
        self._done.set()


@dataclasses.dataclass
class _Slot:
    index: int
    cached: np.ndarray                          # token ids whose keys sit in this row at positions 0..len-1
    handle: Optional[RequestHandle] = None
    pos: int = 0                                # position of the next token to feed
    next_token: int = 0
    seed: int = 0
    last_used: float = 0.0
    epoch: int = 0                              # the weights (push count) its row's keys were computed with


# ----------------------------------------------------------------------------- sampling (per row)
def _row_keys(seeds, counts):
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seeds, counts)


def _top(model_lp, n):
    v, i = jax.lax.top_k(model_lp, min(n, model_lp.shape[-1]))
    return i.astype(jnp.int32), v


# ----------------------------------------------------------------------------- jitted programs
def _row_of(layers, slot):
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=1), layers)


def _put_row(layers, row, slot):
    return jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=1), layers, row)


def _trunk_prefill(config, width, chunk, params, row, tokens, start, length):
    """The trunk over tokens [width] (the first `length` real) at positions start.. of one cache row, in
    chunks (each writes its keys, then attends slots 0..p) -> (row, pre-final-norm hidden [width, D])."""
    n, c = prefill_chunks(width, chunk)
    toks = jnp.pad(tokens, (0, n * c - width))

    def one_chunk(r, i):
        j = i * c + jnp.arange(c, dtype=jnp.int32)
        pos = (start + j)[None]
        x, r = model_step(config, params, r, jax.lax.dynamic_slice_in_dim(toks, i * c, c)[None], pos,
                          jnp.where(j < length, start + j, -1)[None])
        return r, x[0]

    row, xs = jax.lax.scan(one_chunk, row, jnp.arange(n, dtype=jnp.int32))
    return row, xs.reshape(n * c, -1)[:width]


def _first_token(config, params, xs, length, temp, top_k, top_p, seed):
    x_last = jax.lax.dynamic_index_in_dim(xs, length - 1, keepdims=True)
    logits = head(config, params, final_norm(config, params, x_last))
    tok, lp_s, model_lp = sample_rows(_row_keys(seed[None], jnp.zeros((1,), jnp.int32)), logits, temp[None],
                                      top_k[None], top_p[None])
    ti, tv = _top(model_lp, TOP_LOGPROBS)
    return tok[0], lp_s[0], model_lp[0, tok[0]], ti[0], tv[0]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5,))
def _prefill_slot(config, width, chunk, echo, params, layers, slot, src, tokens, start, length, temp, top_k, top_p,
                  seed):
    """Prefill tokens [width] (the first `length` real) at positions start.. into row `slot`, starting from
    row `src`'s cache (== slot, or another slot whose first `start` positions this prompt shares).
    -> (first token, its sampling log-prob, its model log-prob, top ids/lps, echo (lp [width], top ids,
    top lps) or None, layers)."""
    row, xs = _trunk_prefill(config, width, chunk, params, _row_of(layers, src), tokens, start, length)
    first = _first_token(config, params, xs, length, temp, top_k, top_p, seed)
    ech = None
    if echo:
        all_lp = jax.nn.log_softmax(head(config, params, final_norm(config, params, xs)), axis=-1)   # [W, V]
        nxt = jnp.concatenate([tokens[1:], tokens[:1]])
        ech = (jnp.take_along_axis(all_lp, nxt[:, None], axis=-1)[:, 0],) + _top(all_lp, TOP_LOGPROBS)
    return (*first, ech, _put_row(layers, row, slot))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3), donate_argnums=(5, 6, 7))
def _spec_prefill_slot(config, n, width, chunk, params, cache, hbuf, seq, slot, src, tokens, start, length, temp,
                       top_k, top_p, seed):
    """`_prefill_slot` for MTP speculation: also the row's trunk hidden states (hbuf), committed tokens
    (seq) and every MTP depth's cache, recomputed from position start - 2n (entries there depend on tokens
    of the new suffix) through the prompt's end, in chunks, as `speculative._spec_prefill` does."""
    lay, xs = _trunk_prefill(config, width, chunk, params, _row_of(cache["layers"], src), tokens, start, length)
    tok, lp_s, lp_m, ti, tv = _first_token(config, params, xs, length, temp, top_k, top_p, seed)
    j = jnp.arange(width, dtype=jnp.int32)
    wp = jnp.where(j < length, start + j, -1)[None]
    hrow = kv.write(jax.lax.dynamic_slice_in_dim(hbuf, src, 1, axis=0), wp, xs[None])
    srow = kv.write(jax.lax.dynamic_slice_in_dim(seq, src, 1, axis=0), wp, tokens[None])
    e = start + length - 1
    srow = kv.write(srow, jnp.reshape(e + 1, (1, 1)), jnp.reshape(tok, (1, 1)))
    mtp = [jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, src, 1, axis=0), m) for m in cache["mtp"]]
    lo = jnp.maximum(start - 2 * n, 0)
    nc, c = prefill_chunks(width + 2 * n, chunk)
    ev = jnp.reshape(e, (1,))

    def one_chunk(m, i):
        pos = (lo + i * c + jnp.arange(c, dtype=jnp.int32))[None]
        _, m, _ = mtp_pass(config, n, params, m, hrow, srow, jnp.minimum(pos, e), jnp.where(pos <= e, pos, -1), ev)
        return m, None

    mtp, _ = jax.lax.scan(one_chunk, mtp, jnp.arange(nc, dtype=jnp.int32))
    put0 = lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, slot, axis=0)
    cache = {"layers": _put_row(cache["layers"], lay, slot),
             "mtp": [jax.tree.map(put0, full, m) for full, m in zip(cache["mtp"], mtp)]}
    return tok, lp_s, lp_m, ti, tv, None, cache, put0(hbuf, hrow), put0(seq, srow)


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4, 5, 6))
def _spec_decode(config, n, greedy, params, cache, hbuf, seq, e, active, temp, top_k, top_p, seeds, counts):
    """One speculative round over all slots (`speculative.speculative_step`) -> (cache, hbuf, seq,
    tokens [B, n+1], sampling lps [B, n+1], accepted [B])."""
    cache, hbuf, seq, _, g, lp, a = speculative_step(config, n, params, cache, hbuf, seq, e, active,
                                                     _row_keys(seeds, counts), temp, top_k, top_p, greedy=greedy)
    return cache, hbuf, seq, g, lp, a


@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=(3,))
def _decode(config, rows, params, layers, tok, pos, active, temp, top_k, top_p, seeds, counts):
    """One token per slot of the first ``rows`` slots (a decode bucket) at its position (idle slots write
    nothing) -> (next tokens, sampling lps, model lps, top ids, top lps, layers). With ``rows`` below the
    cache's slots, those rows are sliced out (axis 1 of every layer buffer, as `_row_of`) and written back
    in place (the cache is donated); the other slots are untouched."""
    full = rows == jax.tree.leaves(layers)[0].shape[1]
    sub = layers if full else jax.tree.map(lambda a: jax.lax.slice_in_dim(a, 0, rows, axis=1), layers)
    x, sub = model_step(config, params, sub, tok[:, None], pos[:, None], jnp.where(active, pos, -1)[:, None])
    layers = sub if full else jax.tree.map(lambda a, r: jax.lax.dynamic_update_slice_in_dim(a, r, 0, axis=1),
                                           layers, sub)
    logits = head(config, params, final_norm(config, params, x[:, 0]))
    nxt, lp_s, model_lp = sample_rows(_row_keys(seeds, counts), logits, temp, top_k, top_p)
    ti, tv = _top(model_lp, TOP_LOGPROBS)
    return nxt, lp_s, jnp.take_along_axis(model_lp, nxt[:, None], axis=-1)[:, 0], ti, tv, layers


@functools.partial(jax.jit, donate_argnums=(0,))
def _move_row(layers, dst, src):
    """Copy slot ``src``'s cache row into slot ``dst`` (compaction below a smaller decode bucket)."""
    return _put_row(layers, _row_of(layers, src), dst)


# ----------------------------------------------------------------------------- engine
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
    ``max_model_len - 1``): the longest prompt accepted; ``prefill_buckets`` must reach it."""

    def __init__(self, config, params, *, max_batch: int = 8, max_model_len: int = 256, tokenizer=None,
                 stop_token_ids: Sequence[int] = (), max_queue: int = 256, prefill_chunk: int = 512,
                 prefill_buckets: Optional[Sequence[int]] = None, prefix_reuse: bool = True,
                 min_reuse: int = 4, batching: str = "continuous", version: int = 0, seed: int = 0,
                 metrics=None, start: bool = True, speculative: int = 0,
                 decode_buckets: Optional[Sequence[int]] = None, max_prompt_len: Optional[int] = None):
        if batching not in ("continuous", "static"):
            raise ValueError(f"batching={batching!r}: continuous | static")
        if max_batch < 1 or max_model_len < 2:
            raise ValueError(f"max_batch={max_batch} must be >= 1 and max_model_len={max_model_len} >= 2")
        self.config, self.tokenizer = config, tokenizer
        self.max_batch, self.max_len = int(max_batch), int(max_model_len)
        self.max_prompt_len = self.max_len - 1 if max_prompt_len is None else int(max_prompt_len)
        if not 1 <= self.max_prompt_len < self.max_len:
            raise ValueError(f"max_prompt_len={max_prompt_len} must be in [1, max_model_len - 1 = {self.max_len - 1}]")
        self.buckets = tuple(sorted({int(b) for b in (prefill_buckets or _buckets(self.max_len))}))
        if self.buckets[-1] < self.max_prompt_len or self.buckets[0] < 1:
            raise ValueError(f"prefill_buckets={self.buckets} must be >= 1 and reach "
                             + (f"max_model_len={self.max_len}" if max_prompt_len is None
                                else f"max_prompt_len={self.max_prompt_len}"))
        self.decode_buckets = tuple(sorted({int(b) for b in (decode_buckets or (self.max_batch,))}))
        if self.decode_buckets[0] < 1 or self.decode_buckets[-1] != self.max_batch:
            raise ValueError(f"decode_buckets={tuple(decode_buckets)} must be >= 1 and end at max_batch={self.max_batch}")
        if len(self.decode_buckets) > 1 and speculative:
            raise ValueError(f"decode_buckets={self.decode_buckets}: row buckets are not supported with speculative "
                             "decoding (speculative steps run over all max_batch slots)")
        self.prefill_chunk = int(prefill_chunk)
        self.stop_token_ids = tuple(int(t) for t in stop_token_ids)
        self.max_queue, self.prefix_reuse, self.min_reuse = int(max_queue), bool(prefix_reuse), int(min_reuse)
        self.batching = batching
        self.params, self.version = params, int(version)
        self._pending_weights = None
        self._epoch = 0                       # weight swaps so far: rows of older epochs are never reused
        self.num_draft = int(speculative)
        if self.num_draft:
            _check_speculative(config, self.num_draft)
        self._reset_cache()
        self.acceptance = {"length": 1.0, "per_depth": [], "steps": 0}
        self._acc = np.zeros((2 + self.num_draft,), np.int64)
        self.slots = [_Slot(i, np.zeros((0,), np.int32)) for i in range(self.max_batch)]
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._paused = False
        self._idle = threading.Event()
        self._stop = False
        self._rng = np.random.default_rng(seed)
        self.metrics = metrics
        self.stats = collections.Counter()
        self._thread: Optional[threading.Thread] = None
        if start:
            self.start()

    def _reset_cache(self):
        b, n = self.max_batch, self.num_draft
        if not n:
            self.layers = kv.init_cache(self.config, b, self.max_len)["layers"]
            return
        size = self.max_len + n + 2          # the last verification writes up to n + 1 slots past the context
        self.cache = kv.init_cache(self.config, b, size, mtp_depths=n)
        self.hbuf = jnp.zeros((b, size, self.config.d_model), dtype_of(self.config.dtype))
        self.seq = jnp.zeros((b, size + 1), jnp.int32)

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
            self._pending_weights = (params, int(version))
            self._cv.notify_all()

    def warmup(self, echo: bool = False) -> list:
        """Compile every prefill bucket and every decode bucket's step now. Returns the compiled prefill
        (bucket, echo) pairs (the decode programs are one per ``decode_buckets`` entry)."""
        p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        done = []
        for b in self.buckets:
            for e in ((False, True) if echo else (False,)):
                n = min(b, self.max_prompt_len)
                self.submit([1] * n, dataclasses.replace(p, prompt_logprobs=e, max_tokens=2),
                            prefix=False).result()
                done.append((b, e))
        if self.num_draft:                    # the sampled speculative round (greedy-only batches use another)
            self.submit([1, 2], dataclasses.replace(p, temperature=1.0, max_tokens=3), prefix=False).result()
        else:                                 # every decode bucket (and the compaction copy), the loop held
            self.pause()
            try:
                for r in self.decode_buckets:
                    z, f = np.zeros((r,), np.int32), np.zeros((r,), np.float32)
                    *_, self.layers = _decode(self.config, r, self.params, self.layers, z, z, np.zeros((r,), bool),
                                              f, z, f + 1, np.zeros((r,), np.uint32), z)   # idle rows: no writes
                if len(self.decode_buckets) > 1:
                    self.layers = _move_row(self.layers, np.int32(0), np.int32(0))
                jax.block_until_ready(self.layers)
            finally:
                self.resume()
        return done

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
        return len(self._queue)

    @property
    def active(self) -> int:
        return sum(s.handle is not None for s in self.slots)

    def compiled_programs(self) -> int:
        """Programs compiled so far (prefill and decode buckets): constant after warmup within the buckets."""
        return sum(f._cache_size() for f in (_prefill_slot, _decode, _move_row, _spec_prefill_slot, _spec_decode))

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
                    return
                if self._pending_weights is not None:
                    self.params, self.version = self._pending_weights
                    self._pending_weights = None
                    self._epoch += 1
            try:
                self._admit()
                if self.active:
                    self._step()
            except Exception as e:            # a failing step fails its requests, never the engine
                import traceback
                msg = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                for s in self.slots:
                    if s.handle is not None:
                        s.handle._finish("error", msg)
                    s.handle, s.cached = None, np.zeros((0,), np.int32)     # the rows are zeroed below
                self._reset_cache()
            if self.metrics is not None:
                self.metrics.observe_engine(self)

    def _free_slots(self):
        return [s for s in self.slots if s.handle is None]

    def _admit(self):
        if self.batching == "static" and self.active:
            return
        while True:
            free = self._free_slots()
            with self._cv:
                if not free or not self._queue:
                    return
                h = self._queue.popleft()
            if h._cancel:
                h._finish("cancelled")
                continue
            self._start(h, free)

    def _keep(self, s: _Slot) -> tuple:
        """Sort key of free slots to overwrite first: no reusable row, then least recently used."""
        return len(s.cached) > 0 and s.epoch == self._epoch, s.last_used

    def _rows(self, n: int) -> int:
        """The decode bucket that covers slots 0..n-1."""
        return next(b for b in self.decode_buckets if b >= n)

    def _choose(self, h, free):
        """(slot, source slot, reused prefix length) for a new request. With several decode buckets only
        the free slots that keep the decode bucket smallest are candidates (lowest rows first)."""
        if len(self.decode_buckets) > 1:
            top = max((s.index + 1 for s in self.slots if s.handle is not None), default=0)
            cost = {s.index: self._rows(max(top, s.index + 1)) for s in free}
            free = [s for s in free if cost[s.index] == min(cost.values())]
        p = np.asarray(h.prompt, np.int32)
        best, best_n = None, 0
        if h._prefix_ok:
            for s in self.slots:
                if s.epoch != self._epoch:            # keys computed by older weights: not this policy's
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
                return best, best, best_n
            target = min(free, key=lambda s: s.last_used)
            return target, best, best_n
        return min(free, key=self._keep), None, 0

    def _start(self, h: RequestHandle, free):
        slot, src, start = self._choose(h, free)
        src = slot if src is None else src
        rest = h.prompt[start:]
        width = next(b for b in self.buckets if b >= len(rest))
        toks = np.zeros((width,), np.int32)
        toks[:len(rest)] = rest
        sp = h.params
        t0 = time.perf_counter()
        chunk = min(self.prefill_chunk, width)
        args = (np.int32(slot.index), np.int32(src.index), jnp.asarray(toks), np.int32(start), np.int32(len(rest)),
                np.float32(sp.temperature), np.int32(sp.top_k), np.float32(sp.top_p), np.uint32(h._seed))
        if not self.num_draft:
            tok, lp_s, lp_m, ti, tv, ech, self.layers = _prefill_slot(
                self.config, width, chunk, bool(sp.prompt_logprobs), self.params, self.layers, *args)
        else:
            ech = None
            if sp.prompt_logprobs:      # the trunk's log-probs of the prompt; the speculative prefill then redoes the row
                *_, ech, lay = _prefill_slot(self.config, width, chunk, True, self.params, self.cache["layers"], *args)
                self.cache = dict(self.cache, layers=lay)
            tok, lp_s, lp_m, ti, tv, _, self.cache, self.hbuf, self.seq = _spec_prefill_slot(
                self.config, self.num_draft, width, chunk, self.params, self.cache, self.hbuf, self.seq, *args)
        tok, lp_s, lp_m, ti, tv = jax.device_get((tok, lp_s, lp_m, ti, tv))
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += len(rest)
        self.stats["reused_tokens"] += start
        self.stats["prefill_s"] += time.perf_counter() - t0
        h.reused_tokens = start
        if ech is not None:
            lps, eti, etv = jax.device_get(ech)
            n = len(h.prompt)
            h.prompt_logprobs = [None] + [float(x) for x in lps[:n - 1]]
            h.prompt_top_logprobs = [None] + [list(zip(eti[i].tolist(), etv[i].tolist())) for i in range(n - 1)]
        slot.handle, slot.pos, slot.seed, slot.epoch = h, len(h.prompt), h._seed, self._epoch
        slot.cached = np.asarray(h.prompt, np.int32)
        slot.last_used = time.perf_counter()
        self._deliver(slot, int(tok), float(lp_m), float(lp_s), ti, tv)

    def _compact(self):
        """Move the requests of slots past the decode bucket their count needs into free lower slots (a
        row copy each), so a draining batch decodes over fewer rows. Outputs do not depend on the slot."""
        act = [s for s in self.slots if s.handle is not None]
        need = self._rows(len(act)) if act else 0
        high = [s for s in act if s.index >= need]
        if not high:
            return
        holes = sorted((s for s in self.slots[:need] if s.handle is None), key=self._keep)
        for src, dst in zip(high, holes):
            self.layers = _move_row(self.layers, np.int32(dst.index), np.int32(src.index))
            dst.handle, dst.pos, dst.next_token, dst.seed = src.handle, src.pos, src.next_token, src.seed
            dst.cached, dst.last_used, dst.epoch = src.cached, src.last_used, src.epoch   # src's row still holds them
            src.handle = None
            self.stats["moves"] += 1

    def _step(self):
        for s in self.slots:
            if s.handle is not None and s.handle._cancel:
                self._release(s, "cancelled")
        if len(self.decode_buckets) > 1:
            self._compact()
        top = max((s.index + 1 for s in self.slots if s.handle is not None), default=0)
        if not top:
            return
        b = self.max_batch if self.num_draft else self._rows(top)
        tok, pos = np.zeros((b,), np.int32), np.zeros((b,), np.int32)
        active = np.zeros((b,), bool)
        temp, top_p = np.zeros((b,), np.float32), np.ones((b,), np.float32)
        top_k, seeds, counts = np.zeros((b,), np.int32), np.zeros((b,), np.uint32), np.zeros((b,), np.int32)
        for s in self.slots[:b]:
            h = s.handle
            if h is None:
                continue
            i = s.index
            tok[i], pos[i], active[i] = s.next_token, s.pos, True
            temp[i], top_p[i], top_k[i] = h.params.temperature, h.params.top_p, h.params.top_k
            seeds[i], counts[i] = s.seed, len(h.tokens)
        if not active.any():
            return
        if self.num_draft:
            return self._spec_step(tok, pos, active, temp, top_k, top_p, seeds, counts)
        t0 = time.perf_counter()
        nxt, lp_s, lp_m, ti, tv, self.layers = _decode(self.config, b, self.params, self.layers, tok, pos, active,
                                                       temp, top_k, top_p, seeds, counts)
        nxt, lp_s, lp_m, ti, tv = jax.device_get((nxt, lp_s, lp_m, ti, tv))
        self.stats["steps"] += 1
        self.stats["slot_steps"] += int(active.sum())
        self.stats["decode_rows"] += b
        self.stats["decode_s"] += time.perf_counter() - t0
        for s in self.slots[:b]:
            if s.handle is not None and active[s.index]:
                s.cached = np.append(s.cached, np.int32(s.next_token))
                s.pos += 1
                self._deliver(s, int(nxt[s.index]), float(lp_m[s.index]), float(lp_s[s.index]), ti[s.index],
                              tv[s.index])

    def _spec_step(self, tok, pos, active, temp, top_k, top_p, seeds, counts):
        n = self.num_draft
        greedy = bool(np.all(temp[active] <= 0))
        e = np.where(active, pos - 1, 0).astype(np.int32)
        t0 = time.perf_counter()
        self.cache, self.hbuf, self.seq, g, lp, a = _spec_decode(
            self.config, n, greedy, self.params, self.cache, self.hbuf, self.seq, e, active, temp, top_k, top_p,
            seeds, counts)
        g, lp, a = jax.device_get((g, lp, a))
        self.stats["steps"] += 1
        self.stats["slot_steps"] += int(active.sum())
        self.stats["decode_rows"] += len(tok)
        self.stats["decode_s"] += time.perf_counter() - t0
        acc = self._acc
        acc[0] += int((a[active] + 1).sum())
        acc[1] += int(active.sum())
        for k in range(1, n + 1):
            acc[1 + k] += int((a[active] >= k).sum())
        self.acceptance = {"length": float(acc[0] / max(acc[1], 1)), "per_depth": (acc[2:] / max(acc[1], 1)).tolist(),
                           "steps": int(acc[1])}
        empty = np.zeros((0,), np.int32)
        for s in self.slots:
            if s.handle is None or not active[s.index]:
                continue
            i = s.index
            for j in range(int(a[i]) + 1):
                s.cached = np.append(s.cached, np.int32(s.next_token))
                s.pos += 1
                self._deliver(s, int(g[i, j]), float(lp[i, j]), float(lp[i, j]), empty, empty)
                if s.handle is None:
                    break

    # ---------------------------------------------------------------- outputs
    def _deliver(self, s: _Slot, tok: int, lp_m: float, lp_s: float, ti, tv):
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
        if self.tokenizer is not None:
            if reason == "stop":          # a stop id's text is not part of the output text
                delta = self._flush(h)
            else:
                delta, hit = self._text(h)
                reason = "stop" if hit else None
        if reason is None and (len(h.tokens) >= sp.max_tokens or s.pos >= self.max_len):
            reason = "length"
            if self.tokenizer is not None:
                delta += self._flush(h)
        h._emit(TokenEvent(tok, lp_m, lp_s, h.top_logprobs[-1], delta, self.version))
        if self.metrics is not None:
            self.metrics.observe_token(h, now)
        if reason is not None:
            self._release(s, reason)
        else:
            s.next_token = tok

    def _text(self, h: RequestHandle):
        """Decode the new token; -> (text delta to release, whether a stop string ended the text)."""
        h._detok_ids.append(h.tokens[-1])
        full = self.tokenizer.decode(h._detok_ids)
        hit = False
        for st in h.params.stop:
            j = full.find(st, max(0, len(h._text_full) - len(st)))
            if j >= 0:
                full, hit = full[:j], True
        h._text_full = full
        if hit:
            return self._flush(h), hit
        hold = max((len(x) for x in h.params.stop), default=1) - 1
        safe = len(full) - hold
        while safe > h._released and full[safe - 1] == "\ufffd":      # an incomplete UTF-8 sequence
            safe -= 1
        if safe <= h._released:
            return "", False
        d = full[h._released:safe]
        h._released = safe
        return d, False

    def _flush(self, h: RequestHandle) -> str:
        d = h._text_full[h._released:]
        h._released = len(h._text_full)
        h.text = h._text_full
        return d

    def _release(self, s: _Slot, reason: str):
        h = s.handle
        if self.tokenizer is not None:
            h.text = h._text_full
        s.handle = None
        s.last_used = time.perf_counter()
        self.stats["finished"] += 1
        h._finish(reason)
        if self.metrics is not None:
            self.metrics.observe_finish(h)
