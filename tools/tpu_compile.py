"""The TPU compiler without a TPU: topologies, the compile of a lowered program, its memory report.

Shared by tools.aot (the train step) and tools.aot_serve (the serving engine's programs). libtpu (the
`.[tpu]` extra) compiles for a topology's devices (`jax.experimental.topologies`); nothing runs.
"""

from __future__ import annotations

import re
import time

from glm5_jax.chips import TPU_CHIPS
from glm5_jax.errors import Glm5Error

# chip kind -> (HBM bytes per chip, chips per host bounds of the kind's hosts): glm5_jax.chips, the one table
CHIPS = {k: (c.hbm_bytes, c.host_bounds) for k, c in TPU_CHIPS.items()}

class AotError(Glm5Error):
    """A bad topology, mesh, preset or override: raised before anything is compiled."""



def parse_topology(topology: str) -> tuple[str, tuple[int, ...]]:
    """'v5p:4x4x8' -> ('v5p', (4, 4, 8)); AotError naming the allowed kinds otherwise."""
    if ":" not in topology:
        raise AotError(f"--topology={topology!r} must look like KIND:AxBxC (e.g. v5p:4x4x8); "
                       f"kinds: {', '.join(CHIPS)}")
    kind, dims = topology.split(":", 1)
    if kind not in CHIPS:
        raise AotError(f"--topology={topology!r}: unknown chip kind {kind!r}; allowed: {', '.join(CHIPS)}")
    try:
        shape = tuple(int(d) for d in dims.split("x"))
    except ValueError:
        raise AotError(f"--topology={topology!r}: dims {dims!r} must be integers joined by 'x' (e.g. 4x4x8)") from None
    if not 2 <= len(shape) <= 3 or any(d < 1 for d in shape):
        raise AotError(f"--topology={topology!r}: needs 2 or 3 positive dims (e.g. v5p:4x4x8, v5e:4x4)")
    return kind, shape


def topology_devices(topology: str):
    """The devices of a TPU topology (compile-only: no TPU needed, libtpu must be importable)."""
    kind, shape = parse_topology(topology)
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover
        raise AotError(f"jax.experimental.topologies is unavailable: {e}") from e
    host = CHIPS[kind][1][:len(shape)]
    # a topology smaller than one host needs its host bounds clipped to it (e.g. v5p:1x1x1)
    bounds = [min(s, h) for s, h in zip(shape, host)] + [1] * (3 - len(shape))
    kw = {} if all(s >= h for s, h in zip(shape, host)) else {"chips_per_host_bounds": bounds}
    try:
        desc = topologies.get_topology_desc(topology, "tpu", **kw)
    except Exception as e:
        raise AotError(f"--topology={topology!r}: the TPU compiler cannot build it ({type(e).__name__}: {e}). "
                       "Is libtpu installed (pip install '.[tpu]')? A second process needs "
                       "ALLOW_MULTIPLE_LIBTPU_LOAD=1.") from e
    return list(desc.devices)


HEARTBEAT_S = 30.0     # compile_lowered's progress line while lowering / compiling (at least one a minute)


class DoesNotFit(Exception):
    """The TPU compiler refused the program: its buffers exceed the chip's HBM (RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, compile_s: float, lower_s: float):
        super().__init__(message)
        self.compile_s, self.lower_s = compile_s, lower_s
        m = re.search(r"temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)", message)
        unit = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        # XLA prints binary units (v5p's 95.74G is the 95 GiB HBM plus reserved space)
        self.temporaries = int(float(m.group(1)) * unit[m.group(2)]) if m else None
        self.available = int(float(m.group(3)) * unit[m.group(4)]) if m else None


def compile_lowered(lower, *, log=None, save_hlo: str | None = None):
    """lower() -> (compiled, lower seconds, compile seconds) by the TPU compiler; DoesNotFit when it refuses
    the program for memory. save_hlo: the compiled module's text, for tools.budget to re-read. With a `log`,
    a heartbeat line every 30 s while lowering and compiling (the compile of a glm5 step takes minutes)."""
    from glm5_jax.progress import heartbeat
    quiet = log is None
    log = log or (lambda msg: None)
    t = time.time()
    with heartbeat("lowering", every=HEARTBEAT_S, say=log, quiet=quiet, bookends=False):
        lowered = lower()
    lower_s = time.time() - t
    log(f"lowered in {lower_s:.1f}s; compiling with the TPU compiler")
    t = time.time()
    try:
        with heartbeat("compiling", every=HEARTBEAT_S, say=log, quiet=quiet, bookends=False):
            compiled = lowered.compile()
    except Exception as e:          # jax.errors.JaxRuntimeError; only the compiler's out-of-memory is a result
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise DoesNotFit(str(e), time.time() - t, lower_s) from None
    compile_s = time.time() - t
    log(f"compiled in {compile_s:.1f}s")
    if save_hlo:
        import gzip
        with (gzip.open if save_hlo.endswith(".gz") else open)(save_hlo, "wt") as f:
            f.write(compiled.as_text())
        log(f"compiled HLO written to {save_hlo}")
    return compiled, lower_s, compile_s


def memory_report(compiled) -> dict:
    """compiled.memory_analysis() per device: total = arguments + outputs + temporaries - aliased."""
    ma = compiled.memory_analysis()
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    tmp, alias = int(ma.temp_size_in_bytes), int(getattr(ma, "alias_size_in_bytes", 0) or 0)
    peak = getattr(ma, "peak_memory_in_bytes", None)
    host = int(getattr(ma, "host_temp_size_in_bytes", 0) or 0)   # remat="offload": layer inputs on the host
    return {"per_device_bytes": {"arguments": arg, "outputs": out, "temporaries": tmp, "aliased": alias,
                                 "total": arg + out + tmp - alias, **({"peak_memory": int(peak)} if peak else {}),
                                 **({"host_temporaries": host} if host else {})},
            "total_formula": "arguments + outputs + temporaries - aliased" if alias else
                             "arguments + outputs + temporaries (memory_analysis reports no aliasing)",
            "generated_code_bytes": int(getattr(ma, "generated_code_size_in_bytes", 0) or 0)}
