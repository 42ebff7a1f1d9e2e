"""Multi-process start-up and mesh construction from local or global devices.

    from glm5_jax.parallel import distributed
    distributed.maybe_initialize()                     # reads GLM5_* (tools/gpu_launch.sh exports them)
    mesh = distributed.build_mesh("fsdp:-1,expert:8", model_cfg=cfg, batch_size=256)

`maybe_initialize` calls `jax.distributed.initialize` only when more than one process is configured
(flags first, then GLM5_COORDINATOR_ADDRESS / GLM5_NUM_PROCESSES / GLM5_PROCESS_ID); with one process
it does nothing, so the same entry point runs on a laptop and on a cluster. On a multi-host TPU slice
set GLM5_DISTRIBUTED=auto (or pass auto=True): JAX then finds its peers from the TPU metadata server.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Callable, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils

from glm5_jax.config import ModelConfig
from glm5_jax.errors import Glm5Error
from glm5_jax.sharding import MeshError, check_model_fits_mesh, make_mesh, parse_mesh_spec, resolve_mesh_shape

ENV_COORDINATOR = "GLM5_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "GLM5_NUM_PROCESSES"
ENV_PROCESS_ID = "GLM5_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "GLM5_LOCAL_DEVICE_IDS"   # optional, comma-separated (gpu_launch --local_device_ids)
ENV_AUTO = "GLM5_DISTRIBUTED"
ENV_INIT_TIMEOUT = "GLM5_INIT_TIMEOUT_S"             # start-up: seconds to wait for every process to join
ENV_HEARTBEAT_TIMEOUT = "GLM5_HEARTBEAT_TIMEOUT_S"   # mid-run: seconds without a peer's heartbeat -> end
DEFAULT_INIT_TIMEOUT_S = 300                         # jax's own defaults
DEFAULT_HEARTBEAT_TIMEOUT_S = 100
START_FAILED_EXIT_CODE = 2


class DistributedConfigError(Glm5Error):
    """The multi-process settings are incomplete or inconsistent."""


def _int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise DistributedConfigError(f"{name}={value!r} is not an integer") from None


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            env: Mapping[str, str] | None = None) -> dict | None:
    """The (coordinator_address, num_processes, process_id) to initialise with, or None for one process."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    if num_processes is None and env.get(ENV_NUM_PROCESSES):
        num_processes = _int(ENV_NUM_PROCESSES, env[ENV_NUM_PROCESSES])
    if process_id is None and env.get(ENV_PROCESS_ID) not in (None, ""):
        process_id = _int(ENV_PROCESS_ID, env[ENV_PROCESS_ID])
    if num_processes is None or num_processes == 1:
        return None
    if num_processes < 1:
        raise DistributedConfigError(f"num_processes={num_processes} must be >= 1 (flag or {ENV_NUM_PROCESSES})")
    if not coordinator:
        raise DistributedConfigError(
            f"num_processes={num_processes} needs a coordinator address host:port (flag or {ENV_COORDINATOR})")
    if ":" not in coordinator:
        raise DistributedConfigError(f"coordinator address {coordinator!r} must look like host:port")
    if process_id is None:
        raise DistributedConfigError(f"num_processes={num_processes} needs a process id (flag or {ENV_PROCESS_ID})")
    if not 0 <= process_id < num_processes:
        raise DistributedConfigError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    out = {"coordinator_address": coordinator, "num_processes": num_processes, "process_id": process_id}
    if env.get(ENV_LOCAL_DEVICE_IDS):
        out["local_device_ids"] = [_int(ENV_LOCAL_DEVICE_IDS, i) for i in env[ENV_LOCAL_DEVICE_IDS].split(",")]
    return out


def _timeout(name: str, value, env, default) -> float | None:
    if value is None and env.get(name) not in (None, ""):
        value = env[name]
    if value is None:
        return None if default is None else float(default)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise DistributedConfigError(f"{name}={value!r} is not a number of seconds") from None
    if not value > 0:
        raise DistributedConfigError(f"{name}={value!r} must be > 0 seconds")
    return value


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, auto: bool | None = None,
                     env: Mapping[str, str] | None = None, initialize: Callable | None = None,
                     init_timeout_s: float | None = None, heartbeat_timeout_s: float | None = None) -> bool:
    """Call jax.distributed.initialize when more than one process is configured. Returns whether it did.

    Must run before anything touches a device (jax.devices(), the first array). `initialize` is for tests.
    init_timeout_s (else GLM5_INIT_TIMEOUT_S, default 300): when not every process has joined by then
    (a host missing, a wrong address), this process prints ONE line (`error: ...`) and exits with
    status 2 (START_FAILED_EXIT_CODE) instead of jax's abort with a stack trace. heartbeat_timeout_s
    (else GLM5_HEARTBEAT_TIMEOUT_S, default 100): a peer that dies mid-run ends the others after that
    long (jax's coordination service terminates them, naming the failure), not a hang.
    """
    env = os.environ if env is None else env
    real = initialize is None
    initialize = initialize or jax.distributed.initialize
    if jax.distributed.is_initialized():
        return False
    kwargs = resolve(coordinator, num_processes, process_id, env)
    if kwargs is None and not (auto if auto is not None else env.get(ENV_AUTO, "").lower() == "auto"):
        return False
    init_s = _timeout(ENV_INIT_TIMEOUT, init_timeout_s, env, DEFAULT_INIT_TIMEOUT_S if real else None)
    beat_s = _timeout(ENV_HEARTBEAT_TIMEOUT, heartbeat_timeout_s, env, DEFAULT_HEARTBEAT_TIMEOUT_S if real else None)
    kwargs = dict(kwargs or {})
    if init_s is not None:    # jax's own deadline a little later: the watchdog's one line comes first
        kwargs["initialization_timeout"] = int(init_s) + 30
    if beat_s is not None:
        kwargs["heartbeat_timeout_seconds"] = max(int(beat_s), 1)
    _cpu_collectives()
    watchdog = None
    if init_s is not None:
        where = (f"process {kwargs['process_id']} of {kwargs['num_processes']} waiting for coordinator "
                 f"{kwargs['coordinator_address']}" if "process_id" in kwargs else "auto-detected peers")
        msg = (f"error: jax.distributed did not start within {init_s:g} s ({where}): a host is missing or "
               f"cannot reach the coordinator; start every process with the same coordinator address and "
               f"num_processes ({ENV_INIT_TIMEOUT} sets this timeout)")
        watchdog = threading.Timer(init_s, _fail_start, args=(msg,))
        watchdog.daemon = True
        watchdog.start()
    try:
        initialize(**kwargs)              # no address: TPU pods find their peers from the metadata server
    finally:
        if watchdog is not None:
            watchdog.cancel()
    return True


def _fail_start(msg: str) -> None:
    """The start-up watchdog: jax's connect blocks in C++ (it releases the GIL), so end the process here."""
    print(msg, file=sys.stderr, flush=True)
    os._exit(START_FAILED_EXIT_CODE)


_PROBES: collections.Counter = collections.Counter()


class WorkdirNotShared(DistributedConfigError):
    """The processes of a run do not see one workdir (each host has its own disk)."""


def check_shared_workdir(workdir, *, client=None, process_index: int | None = None,
                         process_count: int | None = None, timeout_s: float = 300.0) -> None:
    """Every process must see the files of one workdir (checkpoints are written together, metrics by
    process 0). Process 0 writes a probe file with a fresh nonce; every other process reads it back;
    WorkdirNotShared on every process (naming those that could not) otherwise. One process: nothing.
    client / process_index / process_count: the coordination-service client and this process's place
    (default: jax's); for tests."""
    import secrets
    from etils import epath
    if client is None:
        from jax._src import distributed
        client = distributed.global_state.client
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if client is None or process_count == 1:
        return
    ms = int(timeout_s * 1000)
    workdir = epath.Path(workdir)
    # the same key on every process: the folder's name and how many probes of it this process made
    # (each process probes the same workdirs in the same order)
    _PROBES[(workdir.name, process_index)] += 1
    tag = f"glm5_workdir_probe/{workdir.name}/{_PROBES[(workdir.name, process_index)]}"
    if process_index == 0:
        nonce = secrets.token_hex(8)
        (workdir / f".probe_{nonce}").write_text(nonce)
        client.key_value_set(f"{tag}/nonce", nonce)
    nonce = client.blocking_key_value_get(f"{tag}/nonce", ms)
    probe = workdir / f".probe_{nonce}"
    seen = probe.exists() and probe.read_text() == nonce
    client.key_value_set(f"{tag}/{nonce}/{process_index}", "1" if seen else "0")
    blind = [i for i in range(process_count) if client.blocking_key_value_get(f"{tag}/{nonce}/{i}", ms) != "1"]
    if process_index == 0:
        client.key_value_set(f"{tag}/{nonce}/done", "1")
    client.blocking_key_value_get(f"{tag}/{nonce}/done", ms)
    if process_index == 0:
        try:
            probe.unlink()
        except OSError:
            pass
    if blind:
        raise WorkdirNotShared(f"workdir {workdir} is not shared between the run's processes: process(es) "
                               f"{blind} cannot see the file process 0 wrote there; use a folder every host "
                               "mounts (NFS, a shared disk) or an object store URL (gs://...)")


def _cpu_collectives() -> None:
    """CPU devices of several processes need a cross-process collectives library (gloo) for their
    all-reduces; without one the first collective fails. It only concerns the CPU backend, so it is
    harmless on TPU/GPU hosts; an explicit choice (e.g. mpi) is kept."""
    if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def build_mesh(spec: str | Mapping[str, int] | None = None, *, scope: str = "global",
               model_cfg: ModelConfig | None = None, batch_size: int | None = None):
    """A (data, fsdp, expert, tensor) mesh over all processes' devices (scope="global", the default for
    training) or this process's devices only (scope="local"), checked against the model and batch."""
    if scope not in ("global", "local"):
        raise MeshError(f"scope={scope!r}: allowed global, local")
    devices = jax.devices() if scope == "global" else jax.local_devices()
    sizes = resolve_mesh_shape(parse_mesh_spec(spec), len(devices))
    if model_cfg is not None:
        check_model_fits_mesh(model_cfg, sizes, batch_size)
    return make_mesh(sizes, devices)


# ----------------------------------------------------------------------------- values across processes
def multi_process(mesh=None) -> bool:
    """Whether `mesh` (default: every device) spans several processes."""
    if mesh is None:
        return jax.process_count() > 1
    return len({d.process_index for d in mesh.devices.flat}) > 1


def to_global(value, sharding):
    """A host value that every process holds identically -> a global array with `sharding`; a global jax
    array is resharded on the devices (device to device)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def to_host(tree):
    """Device outputs -> numpy on this process (all-gathered where other processes hold shards)."""
    def get(a):
        if isinstance(a, jax.Array) and not a.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(a, tiled=True))
        return np.asarray(a)
    return jax.tree.map(get, tree)
