"""Preemption: SIGTERM (TPU VM maintenance, spot / SLURM preemption) ends a training loop cleanly.

Every training loop (glm5_jax.train.loop.train, which also runs SFT, the reward model and staged
training; glm5_jax.rl.program.run_grpo, which also runs distillation) asks `PreemptionWatch.reached(step)`
once per step, after the step is dispatched. When it says yes the loop finishes that step, writes a
checkpoint of it (waiting for the write to end), logs one line and raises `Preempted`, a SystemExit with
exit code PREEMPTED_EXIT_CODE (143 = 128 + SIGTERM, what a shell reports for a process SIGTERM ended),
so an uncaught one ends the program without a traceback. Re-running the same command resumes from that
checkpoint and continues exactly as an uninterrupted run.

* One process: a Python SIGTERM handler (installed while the watch is open, the previous one restored
  on close) sets a flag; the next step's check sees it.
* Several processes (jax.distributed): jax installs its own SIGTERM notifier and a preemption sync
  service; a notice on any host makes every host agree on one step (max step reached + 1), which
  `jax.experimental.multihost_utils.reached_preemption_sync_point(step)` returns True at, on every host.
  So a SIGTERM to one host (or all) checkpoints every host at the same step. No Python handler is
  installed there (it would replace jax's notifier).

Bounded time: after the notice the loop runs at most the step in flight (+ one step, multi-process,
for the hosts to agree) and one synchronous checkpoint write; `Preempted` then propagates.

`agree(tag, step, value)`: the primary's value of a per-step host decision (e.g. "the time-based
checkpoint is due"), the same on every process, through the coordination service's key-value store
(no device work); with one process it is `value`.
"""

from __future__ import annotations

import signal
import threading

import jax

PREEMPTED_EXIT_CODE = 143


class Preempted(SystemExit):
    """Raised by a training loop after it checkpointed the step it reached on a preemption notice."""

    def __init__(self, message: str, step: int):
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message, self.step = message, step

    def __str__(self) -> str:
        return self.message


def _client():
    from jax._src import distributed
    return distributed.global_state.client


class PreemptionWatch:
    """with PreemptionWatch() as watch: ... if watch.reached(step): checkpoint, raise Preempted."""

    def __init__(self):
        self.notified = False
        self.signal_name = "SIGTERM"
        self._previous = None
        from jax._src import distributed
        # several processes with jax's preemption service: its notifier owns SIGTERM and the sync point
        # makes every host stop at one step; otherwise (one process, or the service disabled) a handler
        self.multi = _client() is not None and distributed.global_state.preemption_sync_manager is not None

    def _handler(self, signum, frame):
        self.notified = True

    def __enter__(self):
        if not self.multi and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def reached(self, step: int) -> bool:
        """True at the step to checkpoint and stop at (every process the same step). Call once per step."""
        if self.multi:
            from jax.experimental import multihost_utils
            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        return self.notified


def agree(tag: str, step: int, value: bool, timeout_s: float = 600.0) -> bool:
    """The primary process's `value` for (tag, step) on every process (one process: `value` itself)."""
    client = _client()
    if client is None or jax.process_count() == 1:
        return bool(value)
    key = f"glm5_agree/{tag}/{int(step)}"
    if jax.process_index() == 0:
        client.key_value_set(key, "1" if value else "0")
        return bool(value)
    return client.blocking_key_value_get(key, int(timeout_s * 1000)) == "1"


__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "PreemptionWatch", "agree"]
