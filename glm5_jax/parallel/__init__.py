"""Scale-out: multi-process start-up and global meshes (distributed), expert-parallel MoE dispatch (ep)
and the memory planner (plan, tools/plan.py). The sharded train state and the one step factory live in
glm5_jax.train.state / glm5_jax.train.step. See docs/scaleout.md."""
