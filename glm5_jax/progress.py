"""Progress of long commands, on stderr (stdout stays for results: a command's --json stays parseable).

Three shapes, one library (tqdm, pinned in requirements.txt: a counted loop gets done/total, rate and ETA
without code of ours; BUILD_NOTES.md says why tqdm):

    bar = progress.bar(total=n, desc="shards", unit="shard")   # tqdm on stderr: done/total, rate, ETA
    bar.update(1); bar.close()

    with progress.heartbeat("compiling train_step"):          # one line every `every` s with the elapsed time
        compiled = lowered.compile()                           # (a call that reports nothing itself)

    progress.note("loading weights")                           # one line, with the time since the first note

    with progress.run_log(workdir):                            # what the block prints also goes to WORKDIR/run.log
        ...

`quiet=True` (or GLM5_QUIET=1 in the environment) turns all three off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

from tqdm import tqdm

_T0 = time.monotonic()


def _quiet(quiet: bool) -> bool:
    return quiet or os.environ.get("GLM5_QUIET", "") not in ("", "0")


def elapsed(seconds: float) -> str:
    """`7s`, `2m05s`, `1h02m`."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def note(msg: str, *, quiet: bool = False) -> None:
    """One progress line on stderr, prefixed with the time since this process imported the module."""
    if not _quiet(quiet):
        print(f"[{elapsed(time.monotonic() - _T0):>6}] {msg}", file=sys.stderr, flush=True)


def bar(total: int | float | None = None, *, desc: str = "", unit: str = "it", quiet: bool = False,
        unit_scale: bool = False, **kw) -> tqdm:
    """A tqdm progress bar on stderr (done/total, rate, ETA); a no-op bar when quiet. When stderr is not a
    terminal (a log file) it writes a line at most every 30 s instead of redrawing."""
    tty = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                disable=_quiet(quiet), mininterval=0.5 if tty else 30.0, dynamic_ncols=tty, **kw)


@contextlib.contextmanager
def heartbeat(what: str, *, every: float = 30.0, quiet: bool = False, say=None, bookends: bool = True):
    """While the block runs, print `WHAT: still running, ELAPSED` every `every` seconds; then one line with
    the total time. For calls that report nothing themselves (an XLA compile, a warm-up). `say`: the
    function that prints a line (default `note`); bookends=False: no start and end lines, only the beats."""
    say = say or note
    if _quiet(quiet):
        yield
        return
    t0 = time.monotonic()
    done = threading.Event()

    def beat():
        while not done.wait(every):
            say(f"{what}: still running, {elapsed(time.monotonic() - t0)} elapsed")

    if bookends:
        say(f"{what} ...")
    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if bookends:
        say(f"{what}: done in {elapsed(time.monotonic() - t0)}")


class _Tee:
    """A text stream that writes to `stream` and to `copy` (run.log); asks `stream` whether it is a terminal."""

    def __init__(self, stream, copy):
        self.stream, self.copy = stream, copy

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.copy.flush()
        self.stream.flush()

    def __getattr__(self, name):          # isatty, fileno, encoding, ...: the real stream's
        return getattr(self.stream, name)


@contextlib.contextmanager
def run_log(workdir: str, primary: bool = True):
    """While the block runs, what this process prints (sys.stdout and sys.stderr: progress, tables, errors)
    also goes to WORKDIR/run.log, appended (a resumed run adds to it). Local workdirs, primary process
    (experiments.run). Output written below Python (XLA's C++ logging) does not pass through it."""
    if not primary or "://" in workdir:
        yield None
        return
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "run.log")
    with open(path, "a", buffering=1) as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {' '.join(sys.argv)}\n")
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(old[0], f), _Tee(old[1], f)
        try:
            yield path
        finally:
            sys.stdout, sys.stderr = old


__all__ = ["bar", "elapsed", "heartbeat", "note", "run_log"]
