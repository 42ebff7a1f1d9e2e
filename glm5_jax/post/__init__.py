"""Post-training as GLM-5 does it (issue 16): the synthetic tool-use dataset (``tooldata``) and chat
evaluation with tool execution (``agent``). The chat template is glm5_jax.data.chat; SFT packing is
glm5_jax.rl.sft; the train step is glm5_jax.train's."""
