"""One generation path (issue 65): the paged runtime (glm5_jax/infer) is the only code that runs the model to
generate. Everything outside glm5_jax/infer (the package, tools, experiments) reaches generation through
its public names (`infer.generate`, `PagedRuntime`, the serving engine, `RolloutEngine`), so:

* no module outside glm5_jax/infer imports a private name of glm5_jax.infer (``from glm5_jax.infer.x
  import _y``, or ``module._y`` on an imported glm5_jax.infer module);
* no module outside glm5_jax/infer imports the per-token pieces a generation loop is built of (the dense
  decode step, the trunk step, the MTP block, the samplers, the speculative step);
* infer.decode has no decode loop left (``_decode_loop``), and ``infer.generate`` is the runtime's driver;
* ``sampling.batch_row_keys`` draws each row of a batch draw exactly; greedy ``infer.generate`` equals the
  runtime run as the server runs it.

The first three are static (ast); the last two compile a tiny model (~15 s together).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
STEP_PIECES = {"decode_step", "_decode_step", "model_step", "mtp_block", "sample", "sample_rows", "filter_logits",
               "speculative_step", "_decode_loop", "paged_step"}


def _modules():
    for top in ("glm5_jax", "tools", "experiments"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith("glm5_jax/infer/"):
                yield rel, ast.parse(path.read_text(), filename=rel)


def _infer_imports(tree):
    """(imported names from glm5_jax.infer*, local names bound to glm5_jax.infer* modules)."""
    names, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("glm5_jax.infer"):
            for a in node.names:
                names.append((node.lineno, node.module, a.name))
                if node.module == "glm5_jax.infer" or a.name[:1].islower():
                    modules.add(a.asname or a.name)        # possibly a submodule (from glm5_jax.infer import decode)
        elif isinstance(node, ast.ImportFrom) and node.module == "glm5_jax":
            modules.update(a.asname or a.name for a in node.names if a.name == "infer")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("glm5_jax.infer"):
                    modules.add(a.asname or a.name)
    return names, modules


def test_no_private_name_of_infer_is_used_outside_it():
    bad = []
    for rel, tree in _modules():
        names, modules = _infer_imports(tree)
        bad += [f"{rel}:{line}: from {mod} import {name}" for line, mod, name in names if name.startswith("_")]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                bad.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, "private names of glm5_jax.infer used outside it:\n" + "\n".join(bad)


def test_no_generation_loop_pieces_outside_infer():
    bad = []
    for rel, tree in _modules():
        names, modules = _infer_imports(tree)
        bad += [f"{rel}:{line}: from {mod} import {name}" for line, mod, name in names if name in STEP_PIECES]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in STEP_PIECES and isinstance(node.value, ast.Name)
                    and node.value.id in modules):
                bad.append(f"{rel}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not bad, ("generation outside the runtime (use infer.generate, PagedRuntime, the serving engine or "
                     "RolloutEngine):\n" + "\n".join(bad))


def test_infer_generate_is_the_runtime_driver():
    import glm5_jax.infer as infer
    from glm5_jax.infer import decode, generation

    assert infer.generate is generation.generate
    assert not hasattr(decode, "_decode_loop") and not hasattr(decode, "generate")
    src = (ROOT / "glm5_jax/infer/generation.py").read_text()
    assert "PagedRuntime" in src and "while_loop" not in src


def test_batch_row_keys_draw_each_row_of_the_batch_draw():
    """Row b with batch_row_keys(key, b) samples what one key samples over the whole batch (sample), top-k /
    top-p included; a row < 0 samples with the key itself (the serving engine's per-request draw)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from glm5_jax.infer import sampling
    b, v = 7, 53
    for seed in range(3):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), seed + 2)
        x = jax.random.normal(jax.random.PRNGKey(10 + seed), (b, v)) * 3
        want, want_lp = sampling.sample(key, x, greedy=False, temperature=0.7, top_k=9, use_top_p=True, top_p=0.9)
        keys = jnp.broadcast_to(key, (b, 2))
        got, got_lp, _ = sampling.sample_rows(sampling.batch_row_keys(keys, jnp.arange(b), v), x, jnp.full(b, 0.7),
                                              jnp.full(b, 9), jnp.full(b, 0.9))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got_lp, want_lp)
        own = sampling.sample_rows(keys, x, jnp.ones(b), jnp.zeros(b, int), jnp.ones(b))[0]
        neg = sampling.sample_rows(sampling.batch_row_keys(keys, -jnp.ones(b, int), v), x, jnp.ones(b),
                                   jnp.zeros(b, int), jnp.ones(b))[0]
        np.testing.assert_array_equal(neg, own)


def test_greedy_generate_equals_the_serving_runtime():
    """infer.generate (the batch driver) and the runtime as the server runs it (per-request Seqs, radix
    prefixes, small pages and budget) give the same greedy tokens for the same prompts."""
    import jax
    import numpy as np

    from glm5_jax.config import ModelConfig
    from glm5_jax.infer import generate
    from glm5_jax.infer.runtime import PagedRuntime, Seq
    from glm5_jax.model import init_params
    cfg = ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, q_lora_rank=16, kv_lora_rank=16,
                      qk_nope_head_dim=16, qk_rope_head_dim=4, v_head_dim=16, ffn_dim=64, attention="dsa",
                      index_topk=4, index_n_heads=2, index_head_dim=8, num_experts=0, mtp_depth=0, attn_chunk=16,
                      initializer_range=0.1)
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompts = [[1, 5, 7, 9, 11, 3, 2, 8, 4], [1, 3], [1, 5, 7, 9, 11, 3, 2, 8, 6, 6], [1, 9, 9]]
    got = generate(cfg, params, prompts, max_new_tokens=6, temperature=0.0, stop_tokens=(7,))
    rt = PagedRuntime(cfg, params, max_running=4, max_model_len=32, page_size=4, max_num_batched_tokens=8)
    seqs = rt.run([Seq(prompt=p, max_tokens=6, stop_ids=(7,)) for p in prompts])
    for i, s in enumerate(seqs):
        assert got.tokens[i, :got.lengths[i]].tolist() == s.tokens
        np.testing.assert_allclose(got.logprobs[i, :got.lengths[i]], s.logprobs, atol=1e-5)
