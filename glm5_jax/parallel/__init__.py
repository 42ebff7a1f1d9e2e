"""Scale-out: multi-process start-up, meshes, expert-parallel MoE dispatch, sharded train state,
resharding checkpoints and the memory planner (tools/plan.py). See README "## Scale-out"."""
