"""glm5_jax.hugepages: the GLIBC_TUNABLES environment it builds, and the page faults it saves."""

import os
import subprocess
import sys

import pytest

from glm5_jax import hugepages

needs_thp = pytest.mark.skipif(not hugepages.supported(), reason="needs Linux, glibc >= 2.35 and THP not 'never'")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return ""


@needs_thp
def test_env_adds_the_tunable_once_and_keeps_other_tunables():
    env = hugepages.env_with_hugepages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert env["GLIBC_TUNABLES"].split(":") == ["glibc.malloc.arena_max=2", hugepages.TUNABLE]
    assert env["PATH"] == "/bin"
    assert hugepages.env_with_hugepages(env) == env          # already there: unchanged
    assert hugepages.enabled(env) and not hugepages.enabled({"PATH": "/bin"})


def test_env_without_removes_only_the_tunable_and_stops_the_re_exec():
    env = hugepages.env_without_hugepages({"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{hugepages.TUNABLE}"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "GLM5_HUGEPAGES": "0"}
    assert not hugepages.enabled(env) and hugepages.env_with_hugepages(env) == env


def test_switched_off_leaves_the_environment_as_is():
    env = {"GLM5_HUGEPAGES": "0", "PATH": "/bin"}
    assert hugepages.env_with_hugepages(env) == env


_CHILD = """
import resource, jax, jax.numpy as jnp
def g(x):
    z = x @ x.T                       # [8192, 8192] float32: a 256 MiB temp buffer per call
    return jnp.sum(jnp.max(z, 0)) + jnp.sum(jnp.max(z, 1))
f = jax.jit(g)
x = jnp.ones((8192, 8))
f(x).block_until_ready()
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    f(x).block_until_ready()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


def _faults(env):
    env = dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@needs_thp
@pytest.mark.skipif(_thp_mode() != "madvise", reason="the tunable only matters in THP mode 'madvise' "
                    "('always' gives every large mapping huge pages already)")
def test_huge_pages_cut_the_page_faults_of_xla_temp_buffers():
    """Three calls of a jitted function with a 256 MiB temp buffer: 4 KiB pages fault ~65,000
    times per call; with the tunable the same calls fault at least 20x less."""
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "GLM5_HUGEPAGES")}
    plain, huge = _faults(base), _faults(hugepages.env_with_hugepages(base))
    assert plain > 3 * 30_000, plain
    assert huge * 20 < plain, (huge, plain)
