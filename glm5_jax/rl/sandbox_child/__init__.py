"""The sandbox's child program (glm5_jax.rl.sandbox runs it twice per run, as two processes).

This package is copied into each run's box (read-only in namespaced runs) and executed as a directory,
``python -I -S -B <box>/sandbox_child '<json config>'`` (``__main__.py``): an isolated interpreter that
imports nothing but the standard library and these modules, never the project (the untrusted code
shares the solution process with it, so nothing it could reach there may matter to the verdict).
The parent imports only :class:`Exit` from here.

Roles (``config["role"]``):

* ``solution`` (``solution.py``): executes the solution, then only answers requests from the judge
  ("call this function of yours with these arguments", "give me this attribute"). Answers are plain
  data (``codec.py``: exact types, so a subclass of ``int`` is not an ``int``); anything else stays in
  the solution process as an opaque handle.
* ``judge`` (``judge.py``): executes the tests with every solution name bound to a proxy, so asserts
  compare values the judge built itself, and writes the verdict on a pipe only it holds.

Both first confine themselves (``limits.py``: seccomp filter, rlimits, cwd). The config carries the
limits, the box directory and the pipe ends: rfd / wfd (from / to the peer) and, for the judge, vfd
(the verdict, to the parent).
"""

import enum


class Exit(enum.IntEnum):
    """Exit statuses of the child processes (the parent decodes them in glm5_jax.rl.sandbox.classify)."""

    OK = 0              # the judge wrote its verdict; the solution was told "bye" without a network attempt
    LOAD_ERROR = 12     # the solution raised while loading, or raised SystemExit / KeyboardInterrupt mid-call
    LOAD_MEMORY = 13    # MemoryError while loading the solution
    NETWORK = 14        # the solution was told "bye" after a network attempt (blocked, perhaps caught)


__all__ = ["Exit"]
