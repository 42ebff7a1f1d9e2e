"""Transparent huge pages for the host allocator: the CPU runs' largest single cost outside the math.

XLA:CPU takes each executable's temp buffer from glibc malloc on every call, and glibc serves
allocations that large with a fresh mmap, so every train step page-faults its whole temp buffer in
4 KiB pages. glibc >= 2.35 can madvise those mappings as transparent huge pages (tunable
`glibc.malloc.hugetlb=1`, used where the kernel's THP mode is `madvise` or `always`); measured
faults and step times: docs/training.md, "Against Hugging Face". The dynamic loader reads
GLIBC_TUNABLES once, at process start, so a running process cannot switch it on for itself:
`ensure()` re-executes the command once with it set; `env_with_hugepages()` /
`env_without_hugepages()` give a child process's environment. No effect on accelerators' device
memory; the host side of a TPU/GPU run gets the same allocator behaviour.

Set GLM5_HUGEPAGES=0 to keep the process as started (no re-exec, no tunable added).
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
_OFF = "GLM5_HUGEPAGES"


def supported() -> bool:
    """True on Linux with glibc >= 2.35 and the kernel's THP mode `always` or `madvise`."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        name, ver = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = (int(x) for x in ver.split(".")[:2])
    except (ValueError, OSError, AttributeError):
        return False
    if name != "glibc" or (major, minor) < (2, 35):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def enabled(env=None) -> bool:
    """Whether `env` (default this process's environment) already carries the tunable."""
    env = os.environ if env is None else env
    return TUNABLE in env.get("GLIBC_TUNABLES", "").split(":")


def _other_tunables(env) -> list[str]:
    return [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t != TUNABLE]


def env_with_hugepages(env=None) -> dict:
    """A copy of `env` (default os.environ) with the tunable added to GLIBC_TUNABLES (kept as is
    where unsupported or switched off by GLM5_HUGEPAGES=0)."""
    env = dict(os.environ if env is None else env)
    if env.get(_OFF, "1") == "0" or not supported() or enabled(env):
        return env
    env["GLIBC_TUNABLES"] = ":".join(_other_tunables(env) + [TUNABLE])
    return env


def env_without_hugepages(env=None) -> dict:
    """A copy of `env` without the tunable and with GLM5_HUGEPAGES=0 (its commands do not re-exec)."""
    env = dict(os.environ if env is None else env, **{_OFF: "0"})
    env["GLIBC_TUNABLES"] = ":".join(_other_tunables(env))
    return env


def ensure() -> None:
    """Re-execute this command (same interpreter, same argv) with the tunable set, once; a no-op
    where it is set already, unsupported, or switched off. Call it first thing in a `__main__`."""
    env = env_with_hugepages()
    if enabled(env) and not enabled():
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)
