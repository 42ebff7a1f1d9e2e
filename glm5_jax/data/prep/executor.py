"""Where the per-shard stage functions run: in this process (`--workers=1`, no Ray) or as Ray tasks on
a local Ray cluster of `--workers` CPUs, or on an existing cluster (`--ray_address=HOST:PORT`, or
"auto"). A stage is `executor.map(fn, [args, ...])`: results come back in the order of the arguments
whatever order the tasks finish in, so nothing downstream depends on scheduling. Each task reports its
process id and that process's peak resident memory, so tools.bench_data reads the peak per worker.

Tasks read and write files under the output directory: on a cluster it must be a filesystem every node
mounts (as datatrove's Ray / Slurm executors need)."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable, Sequence
from typing import Any

from glm5_jax.errors import Glm5Error


class ExecutorError(Glm5Error):
    """A setting of the executor (workers, Ray address) that cannot be used."""


def _peak_rss_mb() -> float:
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss       # KiB on Linux, bytes on macOS
    return round(kb / (1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0), 1)


def run_task(fn: Callable, args: tuple) -> tuple:
    """(fn(*args), pid, peak RSS MiB of this process)."""
    out = fn(*args)
    return out, os.getpid(), _peak_rss_mb()


class Executor:
    """Runs tasks; `peak_rss_mb` maps each worker process id to its largest peak seen."""

    workers: int = 1

    def __init__(self):
        self.peak_rss_mb: dict[int, float] = {}

    def _record(self, results: list[tuple]) -> list[Any]:
        for _, pid, rss in results:
            self.peak_rss_mb[pid] = max(rss, self.peak_rss_mb.get(pid, 0.0))
        return [r for r, _, _ in results]

    def map(self, fn: Callable, args: Sequence[tuple], on_done: Callable[[int], None] | None = None) -> list[Any]:
        """fn(*a) for each a in args, results in args' order; on_done(i) as task i finishes (progress)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class SerialExecutor(Executor):
    """Every task in this process, in order."""

    def map(self, fn, args, on_done=None):
        results = []
        for i, a in enumerate(args):
            results.append(run_task(fn, a))
            if on_done:
                on_done(i)
        return self._record(results)


class RayExecutor(Executor):
    """Ray tasks, at most `workers` in flight (1 CPU each). Starts a local cluster of `workers` CPUs unless
    Ray is already initialised in this process or `address` names a cluster to join; shuts down only a
    cluster it started."""

    def __init__(self, workers: int, address: str | None = None):
        super().__init__()
        import ray
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            kw = dict(include_dashboard=False, log_to_driver=False)
            if address:
                ray.init(address=address, **kw)
            else:
                ray.init(num_cpus=workers, **kw)
                self._started = True
        self.workers = workers
        self._remote = ray.remote(num_cpus=1, max_retries=0)(run_task)

    def map(self, fn, args, on_done=None):
        ray = self._ray
        fn_ref = ray.put(fn)
        pending, results = {}, [None] * len(args)
        todo = list(enumerate(args))
        while todo or pending:
            while todo and len(pending) < self.workers:
                i, a = todo.pop(0)
                pending[self._remote.remote(fn_ref, a)] = i
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                i = pending.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:     # a bad input in a task: its own one-line error
                    if isinstance(e.cause, Glm5Error):
                        raise e.cause from None
                    raise
                if on_done:
                    on_done(i)
        return self._record(results)

    def close(self) -> None:
        if self._started:
            self._ray.shutdown()


def make_executor(workers: int, ray_address: str | None = None) -> Executor:
    if workers < 1:
        raise ExecutorError(f"--workers={workers} is invalid: must be an integer >= 1")
    if workers == 1 and not ray_address:
        return SerialExecutor()
    return RayExecutor(workers, ray_address)
