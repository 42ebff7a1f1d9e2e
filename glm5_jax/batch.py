"""The train batch's names, at the bottom of the import graph (this module imports nothing of the project).

BATCH_KEYS: the leaves of a token-level batch, each [B, T] (int32, loss_mask float32 on the device): what
the data pipeline builds (glm5_jax.data), the train step reads (glm5_jax.train) and the abstract batch of
an AOT compile describes (glm5_jax.train.state.abstract_batch).
BATCH_AXES: the mesh axes the batch dimension is split over (logical "activation_batch"); the sequence
dimension goes over `context` (glm5_jax.attention.context).
"""

BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")
BATCH_AXES = ("data", "fsdp", "expert")

__all__ = ["BATCH_AXES", "BATCH_KEYS"]
