"""Rollout servers: the policy served with the project's own cached decoding (``glm5_jax.infer.generate``).

``RolloutServer`` is a plain class; ``start_servers`` wraps it as Ray actors (``ray.remote``). It is an
asyncio actor: concurrent ``generate`` requests (token ids in, token ids + log-probs out) queue up and
a batcher runs them together in one ``generate`` call (up to ``max_batch`` rows, waiting
``batch_wait_s`` for more to arrive). Shapes come from a fixed set so the jitted prefill/decode
compile once per shape (``warmup`` compiles them all): the rows are padded to the smallest of
``row_buckets`` (default: powers of two from 4 up to ``max_batch``) that holds the batch (idle rows
decode a one-token filler prompt), plus a filler row whose length is the smallest of ``width_buckets``
(default: powers of two from 32 below ``max_len - max_new_tokens``, then that) that holds the longest
prompt, and the cache has ``max_len`` slots. The server prefills the whole context every turn (no
cache across turns), so the width matters as much as the rows: most turns of a multi-turn episode
are short. Why buckets rather than always ``max_batch`` rows: on CPU a
decode's cost grows with its rows (prefill of 4 vs 32 rows x 98 tokens: ~15 vs ~140 ms on the tiny
policy), so a half-empty batch at one fixed shape would charge the straggling tail of a synchronous
step for rows nobody asked for.

Weights arrive by version (``load_weights(version, params)``); a batch decodes with the parameters it
started with and reports that version, so every token carries the version that really produced it.
The server keeps the outputs it returned (``served``) so tests can check the gateway bit for bit.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

__all__ = ["RolloutServer", "start_servers", "worker_env", "pin_process"]


def pin_process(cpus: Optional[Sequence[int]], tids: Optional[Sequence[int]] = None) -> Optional[set]:
    """Restrict every thread of this process (XLA's pool, Ray's, the agents'), or only the threads with
    native ids ``tids``, to ``cpus``; threads created later inherit their creator's set. Returns the
    previous CPU set (to restore), or None when ``cpus`` is empty/None (no pinning). Used to give the
    rollout side and the trainer their own cores, as GLM-5 gives them their own accelerators."""
    if not cpus:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("CPU pinning (server_cpus / trainer_cpus) needs os.sched_setaffinity (Linux)")
    have = os.sched_getaffinity(0)
    want = {int(c) for c in cpus}
    if not want <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"cpus={sorted(want)}: this machine has CPUs 0..{(os.cpu_count() or 1) - 1}")
    for tid in (os.listdir("/proc/self/task") if tids is None else tids):
        try:
            os.sched_setaffinity(int(tid), want)
        except (ProcessLookupError, PermissionError):   # a thread that just exited
            pass
    return have


class RolloutServer:
    def __init__(self, config, params, *, name: str = "server", version: int = 0, max_batch: int = 16,
                 max_len: int = 64, max_new_tokens: int = 8, temperature: float = 1.0,
                 stop_tokens: Sequence[int] = (), batch_wait_s: float = 0.005, seed: int = 0,
                 keep_outputs: bool = False, row_buckets: Optional[Sequence[int]] = None,
                 cpus: Optional[Sequence[int]] = None, width_buckets: Optional[Sequence[int]] = None):
        pin_process(cpus)      # before JAX starts its thread pool in this process
        if max_new_tokens >= max_len:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be < max_len={max_len}")
        if row_buckets is None:
            row_buckets = [b for b in (4, 8, 16, 32, 64, 128, 256) if b < max_batch] + [max_batch]
        self.row_buckets = sorted({int(b) for b in row_buckets})
        if self.row_buckets[0] < 1 or self.row_buckets[-1] != int(max_batch):
            raise ValueError(f"row_buckets={list(row_buckets)} must be >= 1 and end at max_batch={max_batch}")
        wmax = int(max_len) - int(max_new_tokens)
        if width_buckets is None:
            width_buckets = [w for w in (32, 64, 128, 256, 512, 1024) if w < wmax] + [wmax]
        self.width_buckets = sorted({int(w) for w in width_buckets})
        if self.width_buckets[0] < 1 or self.width_buckets[-1] != wmax:
            raise ValueError(f"width_buckets={list(width_buckets)} must be >= 1 and end at max_len - max_new_tokens "
                             f"= {wmax}")
        self.config, self.name = config, name
        self._set_params(params)
        self.version = int(version)
        self.max_batch, self.max_len, self.max_new = int(max_batch), int(max_len), int(max_new_tokens)
        self.temperature, self.stop_tokens = float(temperature), tuple(int(t) for t in stop_tokens)
        self.batch_wait_s, self.seed = float(batch_wait_s), int(seed)
        self.keep_outputs = keep_outputs
        self.served: Dict[str, dict] = {}
        self._pending: List[tuple] = []
        self._batcher: Optional[asyncio.Task] = None
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0, "busy_s": 0.0, "rows": 0}

    def _set_params(self, params):
        import jax
        import jax.numpy as jnp
        self.params = jax.tree.map(jnp.asarray, params)

    # ------------------------------------------------------------------ API
    def ping(self) -> dict:
        return {"name": self.name, "version": self.version, "pid": os.getpid(), **self.stats}

    def load_weights(self, version: int, params) -> int:
        self._set_params(params)
        self.version = int(version)
        return self.version

    def warmup(self) -> list:
        """Compile every (rows, width) bucket's prefill/decode now (outside any timed region). Returns them."""
        for b in self.row_buckets:
            for w in self.width_buckets:
                self._decode([(f"warmup{b}x{w}", [1] * w, 1, None)] * b)
        return [(b, w) for b in self.row_buckets for w in self.width_buckets]

    def outputs(self) -> Dict[str, dict]:
        return dict(self.served)

    async def generate(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: Optional[int] = None) -> dict:
        """Token ids in -> {"tokens", "logprobs" (float32), "version", "finish_reason", "server"}."""
        n = self.max_new if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= n <= self.max_new:
            raise ValueError(f"max_new_tokens={n} must be in [1, {self.max_new}] (the server's max_new_tokens)")
        if not prompt_ids or len(prompt_ids) + self.max_new > self.max_len:
            raise ValueError(f"request {request_id}: prompt of {len(prompt_ids)} tokens; it must be non-empty and "
                             f"fit max_len={self.max_len} - max_new_tokens={self.max_new}")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((request_id, [int(t) for t in prompt_ids], n, fut))
        if self._batcher is None or self._batcher.done():
            self._batcher = asyncio.ensure_future(self._run_batches())
        return await fut

    # ------------------------------------------------------------------ batching
    async def _run_batches(self):
        loop = asyncio.get_running_loop()
        while self._pending:
            await asyncio.sleep(self.batch_wait_s)         # let concurrent requests join this batch
            batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
            try:
                outs = await loop.run_in_executor(None, self._decode, batch)
            except Exception as e:   # a failed batch fails its requests, never the server
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (rid, _, _, fut), out in zip(batch, outs):
                if self.keep_outputs:
                    self.served[rid] = out
                if not fut.done():
                    fut.set_result(out)

    def _decode(self, batch) -> List[dict]:
        from glm5_jax.infer import generate
        params, version = self.params, self.version        # one consistent (params, version) per batch
        t0 = time.perf_counter()
        prompts = [p for _, p, _, _ in batch]
        filler = [self.stop_tokens[0] if self.stop_tokens else 1]
        rows = next(b for b in self.row_buckets if b >= len(batch))
        prompts += [filler] * (rows - len(batch))
        width = next(w for w in self.width_buckets if w >= max(len(p) for p in prompts))
        prompts.append(filler * width)               # fixes the prompt width to a bucket: one compile each
        self.stats["batches"] += 1
        res = generate(self.config, params, prompts, max_new_tokens=self.max_new, temperature=self.temperature,
                       seed=self.seed * 1_000_003 + self.stats["batches"], stop_tokens=self.stop_tokens,
                       max_len=self.max_len)
        outs = []
        for i, (rid, _, n, _) in enumerate(batch):
            length = min(int(res.lengths[i]), n)
            stopped = res.finish_reasons[i] == "stop" and length == int(res.lengths[i])
            outs.append({"request_id": rid, "tokens": np.asarray(res.tokens[i, :length], np.int32),
                         "logprobs": np.asarray(res.logprobs[i, :length], np.float32), "version": version,
                         "finish_reason": "stop" if stopped else "length", "server": self.name})
            self.stats["generated_tokens"] += length
        self.stats["requests"] += len(batch)
        self.stats["rows"] += len(batch)
        self.stats["busy_s"] += time.perf_counter() - t0
        return outs


def worker_env(threads: int = 1) -> dict:
    """Ray runtime_env for rollout actors: the repo on PYTHONPATH, JAX on CPU with ``threads`` compute
    threads (so servers and the trainer do not all fight over the same cores)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} intra_op_parallelism_threads={threads}"
    return {"env_vars": {"PYTHONPATH": root, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
                         "OMP_NUM_THREADS": str(threads), "TF_CPP_MIN_LOG_LEVEL": "3"}}


def start_servers(n: int, config, params, *, threads: int = 1, **kw) -> dict:
    """Start ``n`` RolloutServer Ray actors named server-0..n-1 -> {name: handle}. ``params`` are sent
    once (numpy); ``kw`` goes to RolloutServer. Ray must be initialised."""
    import jax
    import ray
    actor = ray.remote(RolloutServer).options(num_cpus=0, max_concurrency=1000, runtime_env=worker_env(threads))
    ref = ray.put(jax.device_get(params))
    seed = kw.pop("seed", 0)
    return {f"server-{i}": actor.remote(config, ref, name=f"server-{i}", seed=seed + i, **kw)
            for i in range(n)}
