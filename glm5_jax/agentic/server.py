"""Rollout servers: the policy served by the project's continuous-batching engine (``glm5_jax.serve.Engine``).

``RolloutServer`` is a plain class; ``start_servers`` wraps it as Ray actors (``ray.remote``). It is an
asyncio actor: each ``generate`` request (token ids in, token ids + log-probs out) is submitted to the
server's ``Engine`` and awaited without blocking the event loop (the engine thread hands the finish to the
loop with ``call_soon_threadsafe``). The engine batches continuously: a request joins the running batch at
the next decode step and leaves it when it ends (up to ``max_batch`` slots), so a long episode never holds
short ones back, and prefix reuse keeps each episode's KV cache across its turns (the coordinator routes
every turn of a trajectory to the same server; a later turn prefills only the tokens after the cached
context: the last generated token and the observation).

Shapes come from a fixed set so nothing compiles after ``warmup``: a step of the engine's paged runtime
runs one token row per decoding request plus at most one prefill piece, padded to the smallest step
width that holds them: ``row_buckets`` (default: powers of two from 4 up to ``max_batch``) for decode-only
steps, ``max_batch`` + each of ``width_buckets`` (default: powers of two from 32 below ``max_len -
max_new_tokens``, then that) for steps with a prompt piece, because on CPU a step's cost grows with its
rows and the straggling tail of a synchronous step should not pay for rows nobody asked for.

Sampling: the server's temperature, its ``stop_tokens`` (a request ends after emitting one, included),
``max_new_tokens`` per request, and a per-request seed derived from the server's seed and a request
counter. The returned ``logprobs`` are float32 log-probs under the distribution each token was drawn from
(the temperature-scaled one; greedy: the temperature-1 log-softmax), RL's behaviour log-probs.

Weights arrive by version (``load_weights(version, params)``): the engine uses them from its next decode
step, so one request may span a push. Every token carries the version that produced it (``versions``);
``version`` is the OLDEST of them, so staleness measured from it is never under-counted. ``pause()`` /
``resume()`` hold the engine between two steps. The server keeps the outputs it returned (``served``,
``keep_outputs``) so tests can check the gateway bit for bit.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import Dict, Optional, Sequence

import numpy as np

__all__ = ["RolloutServer", "start_servers", "stop_servers", "ray_init", "worker_env", "pin_process"]


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
    """One rollout server: an ``Engine`` of ``max_batch`` slots x ``max_len`` positions (module doc).
    ``batch_wait_s`` is accepted for compatibility and unused: the engine admits requests between decode
    steps, so there is no gathering window."""

    def __init__(self, config, params, *, name: str = "server", version: int = 0, max_batch: int = 16,
                 max_len: int = 64, max_new_tokens: int = 8, temperature: float = 1.0,
                 stop_tokens: Sequence[int] = (), batch_wait_s: float = 0.005, seed: int = 0,
                 keep_outputs: bool = False, row_buckets: Optional[Sequence[int]] = None,
                 cpus: Optional[Sequence[int]] = None, width_buckets: Optional[Sequence[int]] = None,
                 mesh: Optional[str] = None):
        pin_process(cpus)      # before JAX starts its thread pool in this process
        if max_new_tokens >= max_len:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be < max_len={max_len}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
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
        from glm5_jax.serve.engine import Engine, SamplingParams
        self.config, self.name = config, name
        self.version = int(version)
        self.max_batch, self.max_len, self.max_new = int(max_batch), int(max_len), int(max_new_tokens)
        self.temperature, self.stop_tokens = float(temperature), tuple(int(t) for t in stop_tokens)
        self.batch_wait_s, self.seed = float(batch_wait_s), int(seed)
        # the sampling every request shares, checked now (temperature range, stop ids in the vocabulary)
        self._sampling = SamplingParams(max_tokens=self.max_new, temperature=self.temperature,
                                        stop_token_ids=self.stop_tokens, ignore_eos=True).validate(config.vocab_size)
        self.keep_outputs = keep_outputs
        self.served: Dict[str, dict] = {}
        self._counter = itertools.count()
        self._requests = 0
        self._generated = 0
        # mesh: this server's engine on a mesh of its own process's devices ("data:2,expert:2"; the
        # engine's layout, docs/inference.md); weights then go from the object store straight into their
        # serving shards, never whole onto one device first
        self.mesh = None
        if mesh:
            from glm5_jax.parallel.distributed import build_mesh
            self.mesh = build_mesh(mesh, scope="local")
        # a step runs a decode row per running request and a prefill piece: decode-only steps pad to a row
        # bucket, steps with a piece of w prompt tokens to max_batch + a width bucket
        widths = self.row_buckets + [self.max_batch + w for w in self.width_buckets]
        self.engine = Engine(config, self._device(params), max_batch=self.max_batch, max_model_len=self.max_len,
                             max_prompt_len=wmax, prefill_chunk=wmax, step_widths=widths, version=self.version,
                             seed=self.seed, max_queue=1 << 16, mesh=self.mesh)

    def _device(self, params):
        import jax
        import jax.numpy as jnp
        if self.mesh is not None:        # host arrays -> each device's serving shard (Engine.place_params)
            return params
        return jax.tree.map(jnp.asarray, params)

    # ------------------------------------------------------------------ API
    @property
    def stats(self) -> dict:
        """requests / generated_tokens (served by ``generate``); busy_s (the engine's prefill + decode
        seconds, warm-up included); the engine's decode ``steps``, ``slot_steps`` (busy slots summed over
        steps: > steps when concurrent requests shared decode steps), ``decode_rows`` (rows computed, the
        decode bucket summed over steps), ``prefills``, ``prefill_tokens``, ``reused_tokens`` (prefix
        reuse across turns) and ``moves`` (compaction copies)."""
        e = self.engine.stats
        return {"requests": self._requests, "generated_tokens": self._generated,
                "busy_s": float(e["prefill_s"] + e["decode_s"]),
                **{k: int(e[k]) for k in ("steps", "slot_steps", "decode_rows", "prefills", "prefill_tokens",
                                          "reused_tokens", "moves")}}

    def ping(self) -> dict:
        return {"name": self.name, "version": self.version, "pid": os.getpid(), "active": self.engine.active,
                "queued": self.engine.queue_length, **self.stats}

    def load_weights(self, version: int, params) -> int:
        """New weights from the engine's next decode step (requests in flight continue with them)."""
        self.engine.update_weights(self._device(params), int(version))
        self.version = int(version)
        return self.version

    def pull_weights(self, version: int, ticket: dict) -> int:
        """``load_weights`` for a transfer ticket (glm5_jax.agentic.weights): the arrays come from the trainer's
        devices into this process's over the JAX transfer server (no object store, no pickled arrays)."""
        import jax

        from glm5_jax.agentic.weights import receive
        params = receive(ticket, jax.tree.structure(self.engine.params))
        self.engine.update_weights(params, int(version))
        self.version = int(version)
        return self.version

    def pause(self) -> None:
        """Hold the engine at a step boundary (requests in flight wait; new ones queue)."""
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def warmup(self) -> dict:
        """Compile every prefill (width) and decode (rows) bucket now, outside any timed region.
        Returns them: {"widths": [...], "rows": [...]}."""
        self.engine.warmup()
        return {"widths": list(self.engine.buckets), "rows": list(self.row_buckets)}

    def outputs(self) -> Dict[str, dict]:
        return dict(self.served)

    def close(self) -> None:
        self.engine.shutdown()

    async def generate(self, request_id: str, prompt_ids: Sequence[int], max_new_tokens: Optional[int] = None) -> dict:
        """Token ids in -> {"request_id", "tokens" (int32), "logprobs" (float32), "version" (the oldest
        that produced a token), "versions" (per token), "finish_reason" (stop | length), "server"}."""
        import dataclasses
        n = self.max_new if max_new_tokens is None else int(max_new_tokens)
        if not 1 <= n <= self.max_new:
            raise ValueError(f"max_new_tokens={n} must be in [1, {self.max_new}] (the server's max_new_tokens)")
        if not prompt_ids or len(prompt_ids) + self.max_new > self.max_len:
            raise ValueError(f"request {request_id}: prompt of {len(prompt_ids)} tokens; it must be non-empty and "
                             f"fit max_len={self.max_len} - max_new_tokens={self.max_new}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle():
            if not fut.done():
                fut.set_result(None)

        def on_event(handle, ev):        # engine thread; a str is the finish reason (the last event)
            if isinstance(ev, str):
                try:
                    loop.call_soon_threadsafe(settle)
                except RuntimeError:     # the caller's loop is closed: nobody waits for this request
                    pass

        k = next(self._counter)
        sp = dataclasses.replace(self._sampling, max_tokens=n, seed=(self.seed * 1_000_003 + k) % (2 ** 32))
        h = self.engine.submit([int(t) for t in prompt_ids], sp, request_id=request_id, on_event=on_event)
        try:
            await fut
        except asyncio.CancelledError:
            h.cancel()
            raise
        if h.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"request {request_id} on {self.name}: {h.finish_reason}"
                               + (f" ({h.error})" if h.error else ""))
        out = {"request_id": request_id, "tokens": np.asarray(h.tokens, np.int32),
               "logprobs": np.asarray(h.sample_logprobs, np.float32), "version": int(min(h.versions)),
               "versions": [int(v) for v in h.versions], "finish_reason": h.finish_reason, "server": self.name}
        self._requests += 1
        self._generated += len(h.tokens)
        if self.keep_outputs:
            self.served[request_id] = out
        return out


def worker_env(threads: int = 1, devices: int = 1) -> dict:
    """Ray runtime_env for rollout actors: the repo on PYTHONPATH, JAX on CPU with ``threads`` compute
    threads (so servers and the trainer do not all fight over the same cores) and ``devices`` CPU devices
    (a server whose engine owns a mesh)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'} intra_op_parallelism_threads={threads}"
    if devices > 1:         # first: XLA stops reading flags at the bare intra_op_parallelism_threads token
        flags = f"--xla_force_host_platform_device_count={devices} {flags}"
    return {"env_vars": {"PYTHONPATH": root, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags,
                         "OMP_NUM_THREADS": str(threads), "TF_CPP_MIN_LOG_LEVEL": "3"}}


def start_servers(n: int, config, params, *, threads: int = 1, **kw) -> dict:
    """Start ``n`` RolloutServer Ray actors named server-0..n-1 -> {name: handle}. ``params`` are sent
    once (numpy); ``kw`` goes to RolloutServer (``mesh="data:2,expert:2"``: each actor's engine on a mesh
    of that many CPU devices of its own). Ray must be initialised."""
    import math

    import jax
    import ray

    from glm5_jax.sharding import MeshError, parse_mesh_spec
    devices = math.prod(parse_mesh_spec(kw["mesh"]).values()) if kw.get("mesh") else 1
    if devices < 1:
        raise MeshError(f"start_servers: mesh={kw['mesh']!r}: a server's mesh names every axis size (no -1): "
                        "it fixes how many CPU devices each actor's process starts with")
    actor = ray.remote(RolloutServer).options(num_cpus=0, max_concurrency=1000,
                                              runtime_env=worker_env(threads, devices))
    ref = ray.put(jax.device_get(params))
    seed = kw.pop("seed", 0)
    return {f"server-{i}": actor.remote(config, ref, name=f"server-{i}", seed=seed + i, **kw)
            for i in range(n)}


def ray_init(cpus: int) -> None:
    """Start a local Ray cluster of ``cpus`` CPUs for the rollout fleet (no dashboard, workers' logs not
    forwarded to the driver), unless one is already initialised in this process."""
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)


def stop_servers(servers: dict) -> None:
    """Kill the rollout actors of start_servers ({name: handle}) for good (no restart)."""
    import ray
    for h in servers.values():
        ray.kill(h, no_restart=True)
