"""tools.prepare_data's pipeline on an executor (in-process, or Ray tasks locally or on a cluster):
shard plan, scan (filters, digests, MinHash bands), the dedup stages (near, exact, semantic), per-shard
token caches. The driver is `glm5_jax.data.prep.driver.prepare`."""
