"""Names the planner (glm5_jax/parallel/plan.py, tools/plan.py) uses for the sharded train state.

There is one implementation: the train state lives in glm5_jax.train.state and the one step factory in
glm5_jax.train.step (both build on a mesh; one device is the trivial mesh). These are aliases.
"""

from glm5_jax.sharding import MESH_AXES, batch_spec
from glm5_jax.train.state import (BATCH_KEYS, abstract_batch, abstract_state, init_train_state, opt_state_specs,
                                  param_specs, per_device_bytes, state_shardings, state_specs)
from glm5_jax.train.step import make_train_step

init_sharded_state = init_train_state          # (model_cfg, tcfg, mesh, tx=None, params=None, seed=None)
make_sharded_train_step = make_train_step      # (model_cfg, tcfg, tx, mesh)

__all__ = ["BATCH_KEYS", "MESH_AXES", "abstract_state", "abstract_batch", "batch_spec", "init_sharded_state",
           "make_sharded_train_step", "opt_state_specs", "param_specs", "per_device_bytes", "state_shardings",
           "state_specs"]
