"""The decode cache's compiled behaviour (glm5_jax.infer.cache, glm5_jax.model.Block, attention.core.LayerCache):
the donated cache comes back in its own buffers, no copy of the cache or of a layer's "kv" rows exists in a
DSA decode step, a batch-sharded cache is written and read without communicating it (8 CPU devices, and the
TPU compiler for v5p), and DSA's page-level selection (ModelConfig.dsa_decode_pages) against a reference.

The compiles run in subprocesses (8 fake CPU devices; libtpu for the TPU compile): SCRIPT prints one JSON
summary of a compiled decode step read off its HLO text and memory analysis."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from glm5_jax.attention.indexer import select_topk_cached
from glm5_jax.config import ConfigError, ModelConfig
from glm5_jax.utils import NEG_INF
from pallas_kernels.dsa_xla import index_scores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
S = 4096    # cache slots: no other dimension of the tiny model has this size

SCRIPT = textwrap.dedent("""
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from glm5_jax import model
    from glm5_jax.config import ModelConfig
    from glm5_jax.infer import cache as kv
    from glm5_jax.infer.decode import _decode_step

    # index_head_dim 128: a multiple of the TPU's 128-lane tile, as GLM-5's (infer/cache.py: why the kv row is padded);
    # kv rows 200 + 8 -> 256 wide (told apart from the index keys); both stacks hold several layers
    cfg = ModelConfig(attention=ATT, num_layers=5, first_k_dense=2, mtp_depth=0, index_topk=16, index_head_dim=128,
                      kv_lora_rank=200)
    if PLATFORM == "tpu":
        from tools.aot import topology_devices
        devices = topology_devices("v5p:2x2x1")
    else:
        devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))
    b = 2 * n
    shard = lambda spec: NamedSharding(mesh, spec)
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.PRNGKey(0)))
    cache = jax.eval_shape(lambda: kv.init_cache(cfg, b, S))
    cache_sh = {"layers": jax.tree.map(lambda a: shard(P(None, "data")), cache["layers"]), "mtp": []}
    tok = jax.ShapeDtypeStruct((b,), jnp.int32)
    step = jax.jit(lambda p, c, t, q: _decode_step(cfg, p, c, t, q),
                   in_shardings=(jax.tree.map(lambda a: shard(P()), params), cache_sh, shard(P("data")), shard(P("data"))),
                   out_shardings=(shard(P("data")), cache_sh), donate_argnums=1)
    compiled = step.lower(params, cache, tok, tok).compile()
    text, mem = compiled.as_text(), compiled.memory_analysis()
    leaves = jax.tree.leaves(cache["layers"])
    local = lambda shape: (shape[0], shape[1] // n) + tuple(shape[2:])      # per-device shape of a stacked buffer
    stacked = {local(a.shape) for a in leaves}
    layer_rows = {s[1:] for s in stacked} | {(1,) + s[1:] for s in stacked}
    kv_rows = {local(a.shape)[1:] for a in leaves if a.shape[-1] == kv.kv_width(cfg)}
    values = []
    for m in re.finditer(r"= (\\w+)\\[([\\d,]*)\\]\\S* ([\\w-]+)\\(", text):
        dims = tuple(int(x) for x in m.group(2).split(",") if x)
        values.append((m.group(3), dims, int(np.prod(dims)) * (2 if m.group(1) in ("bf16", "f16") else 4)))
    coll = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")
    print(json.dumps({
        "devices": n, "cache_bytes": sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in leaves) // n,
        "smallest_layer_buffer_bytes": min(int(np.prod(s[1:])) * 4 for s in stacked),
        "largest_layer_buffer_bytes": max(int(np.prod(s[1:])) * 4 for s in stacked),
        "aliased": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
        "collectives": [v for v in values if v[0].replace("-start", "").replace("-done", "") in coll],
        "cache_copies": [v for v in values if v[0] in ("copy", "transpose", "copy-start") and (v[1] in stacked or v[1] in layer_rows)],
        "kv_layer_values": [v for v in values if v[1] in kv_rows or v[1][1:] in kv_rows and v[1][0] == 1],
    }))
""")


def _compiled_summary(platform: str, attention: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    if platform == "cpu":
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    else:                                    # the TPU plugin must load (compile-only client)
        for k in ("JAX_PLATFORMS", "XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):
            env.pop(k, None)
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    code = f"PLATFORM, ATT, S = {platform!r}, {attention!r}, {S}\n" + SCRIPT
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _check_in_place_and_local(r: dict, attention: str, tpu: bool):
    # every cache buffer comes back in the donated input's buffer (per device)
    assert r["aliased"] == r["cache_bytes"], r
    # no second cache (a scan over per-layer cache slices, the former layout, held one more cache-sized output
    # and copied every layer's cache each step): at most the views of one layer's rows that XLA:CPU
    # materialises (DSA: the layer's index keys for the indexer; MLA: its kv rows); on TPU not even those
    limit = r["smallest_layer_buffer_bytes"] if tpu else 2 * r["largest_layer_buffer_bytes"]
    assert r["temp"] < limit < r["cache_bytes"], r
    assert not r["cache_copies"], r["cache_copies"]
    # the batch-sharded cache is never communicated: no collective of a layer buffer's bytes; on TPU none carries
    # the slot axis either (XLA:CPU's partitioner all-gathers DSA's [B, 1, S] index scores, 1/128 of the keys)
    big = [c for c in r["collectives"] if c[2] >= r["smallest_layer_buffer_bytes"] or (tpu and S in c[1])]
    assert not big, big
    if attention == "dsa":   # sparse decode gathers the selected rows: no [B, S, W] view of a layer's kv exists
        assert not r["kv_layer_values"], r["kv_layer_values"]


@pytest.mark.parametrize("attention", ["dsa", "mla"])
def test_decode_step_on_8_cpu_devices_updates_the_batch_sharded_cache_in_place_without_communicating_it(attention):
    """The engine's decode step (infer.decode._decode_step) compiled for a cache sharded over 8 CPU devices on its
    batch axis, donated: aliased bytes == the per-device cache, temporaries under two layer buffers, no copy of a
    cache buffer, no collective of a layer buffer's size; DSA decode never forms a layer's [B, S, W] kv rows."""
    _check_in_place_and_local(_compiled_summary("cpu", attention), attention, tpu=False)


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable: install the '.[tpu]' extra to compile "
                                            "for TPU topologies without a TPU")
@pytest.mark.parametrize("attention", ["dsa", "mla"])
def test_decode_step_compiled_for_v5p_updates_the_sharded_cache_in_place_without_communicating_it(attention):
    """The same checks, stricter, on the TPU compiler's program (v5p:2x2x1, batch over 4 chips): temporaries below
    one layer buffer (dense MLA reads the layer's rows without copying them out), no collective over the slot
    axis. There a cache row width that is not 128-lane aligned, or a vmap batching dim at the stacked buffer's
    axis 1, made the compiler copy or transpose the whole cache every step; dense MLA's two score matmuls over
    column slices of the rows made it copy each layer's rows out (docs/inference.md, "Cache layout and DSA
    decode")."""
    _check_in_place_and_local(_compiled_summary("tpu", attention), attention, tpu=True)


# ----------------------------------------------------------------------------- page-level selection
def _page_reference(scores, positions, topk, page):
    """numpy: pages of `page` slots scored by their best visible slot, the topk // page best (ties to the lower
    page), their visible slots in page order -> [B, T, topk] with -1."""
    b, t, s = scores.shape
    out = np.full((b, t, topk), -1, np.int64)
    for i in range(b):
        for j in range(t):
            vis = np.where(np.arange(s) <= positions[i, j], scores[i, j], -np.inf)
            n_pages = -(-s // page)
            best = [vis[p * page:(p + 1) * page].max() for p in range(n_pages)]
            order = sorted(range(n_pages), key=lambda p: (-best[p], p))[:topk // page]
            for r, p in enumerate(order):
                if best[p] == -np.inf:
                    continue
                for u in range(page):
                    slot = p * page + u
                    if slot < s and slot <= positions[i, j]:
                        out[i, j, r * page + u] = slot
    return out


def _indexer_inputs(s=37, t=3, hi=2, di=8, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (2, t, hi, di))
    k = jax.random.normal(ks[1], (2, s, di))
    w = jax.random.normal(ks[2], (2, t, hi))
    pos = jnp.array([[s - 3, s - 2, s - 1], [5, 20, 30]])[:, :t]
    return q, k, w, pos


@pytest.mark.parametrize("page", [2, 4, 8])
def test_page_selection_matches_a_numpy_reference(page):
    """select_topk_cached(page=P): the best topk / P pages by their best visible score, their visible slots."""
    q, k, w, pos = _indexer_inputs()
    topk = 16
    got = np.asarray(select_topk_cached(q, k, w, topk, pos, page=page))
    scores = np.asarray(index_scores(q, k, w))
    want = _page_reference(scores, np.asarray(pos), topk, page)
    np.testing.assert_array_equal(got, want)


def test_exact_selection_is_the_default_and_pages_of_one_slot_are_the_exact_top_k():
    """The default (dsa_decode_pages=0) is the exact top-k (lax.top_k over the visible scores, ties to the lower
    slot), and page-level selection with pages of one slot gives exactly the same slots in the same order."""
    assert ModelConfig().dsa_decode_pages == 0
    q, k, w, pos = _indexer_inputs()
    exact = np.asarray(select_topk_cached(q, k, w, 16, pos))
    scores = np.where(np.arange(k.shape[1]) <= np.asarray(pos)[..., None], np.asarray(index_scores(q, k, w)), NEG_INF)
    want = np.argsort(-scores, axis=-1, kind="stable")[..., :16]
    want = np.where(np.take_along_axis(scores, want, -1) == NEG_INF, -1, want)
    np.testing.assert_array_equal(exact, want)
    np.testing.assert_array_equal(np.asarray(select_topk_cached(q, k, w, 16, pos, page=1)), exact)


def test_dsa_decode_pages_is_validated():
    with pytest.raises(ConfigError, match=r"dsa_decode_pages=3 is invalid: must divide index_topk=16"):
        ModelConfig(index_topk=16, dsa_decode_pages=3)
    with pytest.raises(ConfigError, match=r"dsa_decode_pages=-1 is invalid: must be an integer >= 0"):
        ModelConfig(dsa_decode_pages=-1)
    assert ModelConfig(index_topk=16, dsa_decode_pages=4).dsa_decode_pages == 4


def test_page_recall_tool_measures_the_share_of_the_exact_top_k_the_pages_hold():
    """tools.dsa_page_recall.page_recall: pages of one slot hold all of the exact top-k (recall and mass 1); keys
    whose best scores fill one page give recall 1 with that page size; with one good key every 4 slots, the
    16 // 8 = 2 best 8-slot pages hold 4 of the 16 exact top-k slots (recall 4 / 16)."""
    from tools.dsa_page_recall import RecallError, page_recall, run
    ks = jax.random.split(jax.random.PRNGKey(0), 3)    # the tool's layout: queries and keys of one 64-token sequence
    q, k, w = (jax.random.normal(ks[0], (2, 64, 2, 8)), jax.random.normal(ks[1], (2, 64, 8)),
               jax.random.normal(ks[2], (2, 64, 2)))
    assert page_recall(q, k, w, 16, 1, 4) == (1.0, 1.0)
    # one direction scores high: keys 16..31 (one 16-slot page) along it, the rest against it
    d = k.shape[-1]
    qq = jnp.ones_like(q)
    ww = jnp.ones_like(w)
    good = jnp.zeros((64,), bool).at[16:32].set(True)
    kk = jnp.where(good[None, :, None], 1.0 + 0.01 * jnp.arange(64)[None, :, None], -1.0) * jnp.ones((2, 64, d))
    assert page_recall(qq, kk, ww, 16, 16, 4)[0] == 1.0
    spread = jnp.zeros((64,), bool).at[jnp.arange(0, 64, 4)].set(True)       # one good key in every 4-slot run
    kk = jnp.where(spread[None, :, None], 1.0 + 0.01 * jnp.arange(64)[None, :, None], -1.0) * jnp.ones((2, 64, d))
    assert page_recall(qq, kk, ww, 16, 8, 4)[0] == pytest.approx(4 / 16)
    with pytest.raises(RecallError, match="divide index_topk"):
        run(index_topk=64, pages=(3,))
