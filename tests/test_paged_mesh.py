"""The paged runtime on a mesh (glm5_jax.infer.runtime, Programs.paged_step, attention.core.LayerCache pages):
on 8 CPU devices (batch over data x expert) every sequence runs on one batch shard, its pages from that shard's
part of the pool and its token rows in the shard's block, and the step's pool reads / writes, row gathers and
sampling run per shard. The same greedy and seeded tokens (and log-probs) as on one device, prefixes shared
within a shard, no page leaked; the compiled step moves no pool-sized buffer between devices.

The mesh runs in a subprocess (8 fake CPU devices must be set before jax starts): SCRIPT prints one JSON line."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import json, re
    import jax, numpy as np
    from glm5_jax import model, sharding
    from glm5_jax.config import ModelConfig
    from glm5_jax.infer.runtime import PagedRuntime, Seq

    cfg = ModelConfig(num_layers=3, mtp_depth=0, index_topk=8)         # DSA, dense prefix 1 + MoE body 2
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(3)
    base = rng.integers(1, cfg.vocab_size, 30).tolist()
    prompts = [base, base, base[:13], base + [5, 6], base[:22] + [9] * 4, rng.integers(1, cfg.vocab_size, 9).tolist(),
               base[:5], rng.integers(1, cfg.vocab_size, 17).tolist()]
    mesh = sharding.make_mesh("data:2,expert:4")

    def runtime(mesh, tokens=8 * 64):
        return PagedRuntime(cfg, params, max_running=8, max_model_len=64, page_size=4, max_num_batched_tokens=32,
                            kv_cache_tokens=tokens, mesh=mesh)

    out = {}
    for temp in (0.0, 1.0):
        res = {}
        for name, m in (("one", None), ("mesh", mesh)):
            rt = runtime(m)
            seqs = rt.run([Seq(list(p), temperature=temp, seed=7 + i, max_tokens=6) for i, p in enumerate(prompts)])
            use = rt.pages_in_use()
            res[name] = {"tokens": [s.tokens for s in seqs], "lps": [s.logprobs for s in seqs],
                         "shards": [s.shard for s in seqs], "reused": rt.stats["reused_tokens"],
                         "leak": use["running"] != 0 or use["free"] + use["cached"] != rt.num_pages,
                         "pages_on_own_shard": all(p // (rt.num_pages // rt.pages.shards) == s.shard
                                                   for s in seqs for p in s.pages)}
        out[str(temp)] = res

    # the compiled step on the mesh: collectives and the pool's per-device layer buffer
    rt = runtime(mesh, tokens=64 * 64)
    w = rt.widths[-1]
    prog = rt.programs.paged_step(rt.num_pages, rt.page_size, w, False)
    text = rt.programs.call(prog.lower, rt.params, rt.pool, *rt.idle_args(w)).compile().as_text()
    coll = []
    for m in re.finditer(r"= (\\w+)\\[([\\d,]*)\\]\\S* (all-gather|all-to-all|all-reduce|collective-permute|"
                         r"reduce-scatter)[-\\w]*\\(", text):
        dims = [int(x) for x in m.group(2).split(",") if x]
        coll.append((m.group(3), dims, int(np.prod(dims)) * (2 if m.group(1) in ("bf16", "f16") else 4)))
    shards = rt.programs.shards
    layer = min(int(np.prod(a.shape[1:])) * a.dtype.itemsize // shards for a in jax.tree.leaves(rt.pool))
    out["hlo"] = {"collectives": coll, "pool_layer_bytes_per_device": layer, "pages": rt.num_pages, "shards": shards}
    print(json.dumps(out))
""")


@pytest.mark.slow   # ~75 s: 4 runtimes and a compile on 8 fake devices (tests/test_serve_mesh.py's fast test runs the
#                    engine, i.e. this runtime, on a mesh by default)
def test_paged_runtime_on_8_devices_equals_one_device_and_moves_no_pool():
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for temp in ("0.0", "1.0"):
        one, mesh = out[temp]["one"], out[temp]["mesh"]
        assert mesh["tokens"] == one["tokens"], temp
        for a, b in zip(mesh["lps"], one["lps"]):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, temp
        assert len(set(mesh["shards"])) > 1 and set(one["shards"]) == {0}       # spread over the 8 shards
        assert mesh["pages_on_own_shard"] is True and not mesh["leak"] and not one["leak"]
        assert mesh["reused"] > 0                                              # prefixes shared within a shard
    h = out["hlo"]
    assert h["shards"] == 8
    # no collective moves a buffer the size of one layer's pool on a device (the pool stays put); what XLA:CPU's
    # partitioner does all-gather is small: DSA's [rows, 1, S] top-k scores and the MoE's tokens
    big = [c for c in h["collectives"] if c[2] >= h["pool_layer_bytes_per_device"]]
    assert not big, (big, h["pool_layer_bytes_per_device"])
