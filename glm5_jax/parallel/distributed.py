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

import os
from typing import Callable, Mapping

import jax

from glm5_jax.config import ModelConfig
from glm5_jax.sharding import MeshError, check_model_fits_mesh, make_mesh, parse_mesh_spec, resolve_mesh_shape

ENV_COORDINATOR = "GLM5_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "GLM5_NUM_PROCESSES"
ENV_PROCESS_ID = "GLM5_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "GLM5_LOCAL_DEVICE_IDS"   # optional, comma-separated (gpu_launch --local_device_ids)
ENV_AUTO = "GLM5_DISTRIBUTED"


class DistributedConfigError(ValueError):
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


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, auto: bool | None = None,
                     env: Mapping[str, str] | None = None, initialize: Callable | None = None) -> bool:
    """Call jax.distributed.initialize when more than one process is configured. Returns whether it did.

    Must run before anything touches a device (jax.devices(), the first array). `initialize` is for tests.
    """
    env = os.environ if env is None else env
    initialize = initialize or jax.distributed.initialize
    if jax.distributed.is_initialized():
        return False
    kwargs = resolve(coordinator, num_processes, process_id, env)
    if kwargs is None and not (auto if auto is not None else env.get(ENV_AUTO, "").lower() == "auto"):
        return False
    _cpu_collectives()
    if kwargs is None:
        initialize()                      # TPU pods: peers from the metadata server
    else:
        initialize(**kwargs)
    return True


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
