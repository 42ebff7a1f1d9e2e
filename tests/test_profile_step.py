"""tools.profile_step's op-kind table: the dot FLOPs it attributes to a traced program equal the
closed form of that program's matmuls, whether XLA runs them as plain dots or inside fusions."""

import jax
import jax.numpy as jnp
import numpy as np

from tools.profile_step import kind_table, op_kinds, trace_ops


def test_kind_table_counts_the_programs_dot_flops_exactly():
    # (a @ b) -> relu -> @ c, and a batched product inside a 3-trip loop (loop-variant, so XLA cannot
    # hoist it): every executed dot counted
    # once per execution; elementwise work is not counted as FLOPs
    m, k, n, p, bt = 96, 64, 48, 32, 3
    def f(a, b, c, x, y):
        h = jax.nn.relu(a @ b) @ c
        z = jax.lax.fori_loop(0, bt, lambda i, z: z + jnp.einsum("bij,bjk->bik", x + i, y), jnp.zeros((2, 16, 8)))
        return h, z
    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32)
            for s in ((m, k), (k, n), (n, p), (2, 16, 24), (2, 24, 8))]
    comp = jax.jit(f).lower(*args).compile()
    kinds = op_kinds(comp.as_text())
    per_op, runs = trace_ops(lambda: jax.block_until_ready(comp(*args)))
    table = kind_table(per_op, runs, kinds)
    want = 2 * m * k * n + 2 * m * n * p + bt * 2 * 2 * 16 * 24 * 8
    assert sum(v[2] for v in table.values()) == want, table
    assert all(v[1] > 0 for v in table.values())
