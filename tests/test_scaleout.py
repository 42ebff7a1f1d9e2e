"""Scale-out on 8 forced CPU devices: sharded train steps (GSPMD and the a2a expert-parallel dispatch)
follow the 1-device loss trajectory, checkpoints restore exactly onto other meshes, saves are async,
bad meshes / distributed settings fail clearly."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run8(script: str, timeout: int = 600) -> str:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                         timeout=timeout, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-6000:]
    assert "OK" in res.stdout, res.stdout
    return res.stdout


COMMON = """
    import time, jax, jax.numpy as jnp, numpy as np
    from glm5_jax.config import ModelConfig
    from glm5_jax.train import TrainConfig
    from flax import traverse_util
    from glm5_jax.train.state import abstract_state, init_train_state, state_shardings
    from glm5_jax.train.step import make_train_step
    from glm5_jax import sharding
    from glm5_jax.model import init_params
    assert len(jax.devices()) == 8
    # the tiny config with 8 experts (divisible by every expert axis below); one MoE layer, no MTP (CPU time)
    cfg = ModelConfig(num_experts=8, num_layers=1, first_k_dense=0, index_topk=8, mtp_depth=0)
    tc = TrainConfig(batch_size=8, seq_len=16, steps=5, warmup_steps=1, optimizer="adamw")
    params = init_params(cfg, jax.random.PRNGKey(1))
    rng = np.random.default_rng(0)
    batches = []
    for i in range(5):
        t = rng.integers(0, cfg.vocab_size, (8, 17))
        batches.append({"tokens": t[:, :-1].astype(np.int32), "targets": t[:, 1:].astype(np.int32),
                        "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1)),
                        "segment_ids": np.ones((8, 16), np.int32), "loss_mask": np.ones((8, 16), np.float32)})

    def leaf_spec(tree, name):
        # the mesh axes of each dim of the leaf called `name` (layout-agnostic: stacked or not)
        a = next(v for k, v in traverse_util.flatten_dict(tree).items() if k[-1] == name)
        spec = tuple(a.sharding.spec)
        return spec + (None,) * (a.ndim - len(spec))

    def trajectory(c, spec, n_dev=8):
        mesh = sharding.make_mesh(spec, jax.devices()[:n_dev])
        sharding.check_model_fits_mesh(c, sharding.parse_mesh_spec(spec), tc.batch_size)
        state, tx = init_train_state(c, tc, mesh, params=params)
        step = make_train_step(c, tc, tx, mesh)
        out = []
        for b in batches:
            state, m = step(state, jax.device_put(b, step.batch_sharding))
            out.append({k: float(v) for k, v in m.items()})
        return out, state
"""


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_sharded_train_steps_match_single_device():
    run8(COMMON + """
    ref, _ = trajectory(cfg, "data:1", 1)
    want = np.array([m["loss"] for m in ref])
    assert np.all(np.isfinite(want)) and want[-1] != want[0]
    # the a2a (shard_map) dispatch, dropless, on the fsdp x expert mesh
    cases = [(cfg, "data:2,expert:4"), (cfg.replace(moe_impl="a2a", moe_capacity_factor=0.0), "fsdp:2,expert:4"),
             (cfg, "tensor:2,expert:4"), (cfg, "data:2,fsdp:2,expert:2")]
    for c, spec in cases:
        t0 = time.time()
        got, state = trajectory(c, spec)
        loss = np.array([m["loss"] for m in got])
        rel = float(np.max(np.abs(loss - want) / np.abs(want)))
        assert rel <= 1e-5, (c.moe_impl, spec, loss, want)
        assert leaf_spec(state["params"], "gate_proj")[-3] == "expert"        # [..., E, D, F]
        if c.moe_impl == "a2a":
            assert all(m["moe_dropped_fraction"] == 0.0 for m in got), got   # dropless
            assert all(m["moe_a2a_rounds"] >= 1.0 for m in got), got
        print(c.moe_impl, spec, "rel", rel, f"{time.time() - t0:.1f}s")
    print("OK")
    """)


def test_a2a_capacity_drops_tokens_and_reports_fraction():
    run8("""
    import jax, jax.numpy as jnp, numpy as np
    from glm5_jax.parallel.ep import a2a_moe, capacity
    from glm5_jax import sharding
    assert capacity(64, 4, 1.0) == 16 and capacity(64, 4, 0.0) == 64 and capacity(64, 4, 8.0) == 64
    n, d, f, e, k = 64, 8, 16, 8, 2
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(ks[0], (n, d))
    ids = jnp.zeros((n, k), jnp.int32).at[:, 1].set(1)         # every token -> experts 0 and 1 (device 0)
    ids = ids.at[: n // 2].set(jax.random.randint(ks[1], (n // 2, k), 0, e))
    w = jnp.full((n, k), 0.5)
    gate, up = (jax.random.normal(kk, (e, d, f)) * 0.3 for kk in ks[2:])
    down = jax.random.normal(ks[3], (e, f, d)) * 0.3
    ref, drop0, _ = a2a_moe(x, w, ids, gate, up, down, num_experts=e, capacity_factor=0.0)
    assert float(drop0) == 0.0
    mesh = sharding.make_mesh("data:2,expert:4")
    with sharding.use_mesh(mesh):
        f_ = jax.jit(lambda *a, cf: a2a_moe(*a, num_experts=e, capacity_factor=cf), static_argnames="cf")
        full, dz, _ = f_(x, w, ids, gate, up, down, cf=0.0)
        part, dp, _ = f_(x, w, ids, gate, up, down, cf=1.0)
    np.testing.assert_allclose(np.asarray(full), np.asarray(ref), rtol=1e-5, atol=1e-5)
    assert float(dz) == 0.0 and 0.0 < float(dp) < 1.0, (dz, dp)
    # gradients through the all_to_all equal the single-device ones (dropless)
    loss = lambda x, g, dn: jnp.sum(a2a_moe(x, w, ids, g, up, dn, num_experts=e, capacity_factor=0.0)[0] ** 2)
    g_ref = jax.grad(loss, argnums=(0, 1, 2))(x, gate, down)
    with sharding.use_mesh(mesh):
        g_ep = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, gate, down)
    for a, b in zip(g_ep, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # kept tokens are exact, dropped slots contribute 0 (each row is a sum of its kept slots)
    diff = np.abs(np.asarray(part) - np.asarray(ref)).max(axis=1)
    assert (diff < 1e-5).sum() > 0 and (diff > 1e-5).sum() > 0
    print("dropped", float(dp))
    print("OK")
    """)


def test_checkpoint_restores_exactly_on_other_meshes_and_saves_async(tmp_path):
    out = run8(COMMON + f"""
    from glm5_jax.train.checkpoint import Checkpointer
    mesh0 = sharding.make_mesh("fsdp:2,expert:4")               # the (2, 4) mesh
    state, _ = init_train_state(cfg, tc, mesh0, params=params)
    # non-trivial optimizer moments (mu, nu) and step, keeping every leaf's sharding
    state = jax.tree_util.tree_map(lambda a: a * 0.5 + 0.25 if a.dtype == jnp.float32 else a, state)
    state["step"] = state["step"] + 5
    assert leaf_spec(state["params"], "gate_proj")[-3:-1] == ("expert", ("fsdp", "context"))   # context joins fsdp
    host = jax.tree_util.tree_map(np.asarray, state)
    ck = Checkpointer({str(tmp_path / 'ck')!r}, keep=3)
    ck.save(5, state); ck.wait()
    for spec, n_dev in [("fsdp:4,expert:2", 8), ("data:1", 1)]:
        mesh = sharding.make_mesh(spec, jax.devices()[:n_dev])
        restored, _ = ck.restore(5, abstract_state(cfg, tc, mesh)[0])
        want_sh = state_shardings(cfg, tc, mesh)
        for (path, a), b, s in zip(jax.tree_util.tree_flatten_with_path(restored)[0],
                                   jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(want_sh)):
            assert a.sharding.is_equivalent_to(s, a.ndim), (path, a.sharding, s)
            assert np.array_equal(np.asarray(a), b), path
        print("restored exactly on", spec)
    # async: save() returns while the write is still running
    big = {{"w": jax.device_put(jnp.ones((8, 2048, 1024), jnp.float32),
                               jax.sharding.NamedSharding(sharding.make_mesh("fsdp:8"), jax.sharding.PartitionSpec("fsdp")))}}
    t0 = time.perf_counter(); ck.save(6, big); t_ret = time.perf_counter() - t0
    busy = ck.is_saving()
    ck.wait(); t_all = time.perf_counter() - t0
    print(f"async save: save() returned after {{t_ret:.3f}}s, write finished after {{t_all:.3f}}s, busy={{busy}}")
    assert busy or t_ret < 0.5 * t_all, (t_ret, t_all)
    ck.close()
    print("OK")
    """)
    print(out)


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_train_loop_on_a_mesh_resumes_resharded_on_another(tmp_path):
    """The loop on data2 x fsdp2 x expert2 stops after step 2, resumes on fsdp4 x expert2 (the checkpoint
    is resharded on restore) and its 4-step loss trajectory equals the uninterrupted 1-device run."""
    run8(COMMON + f"""
    from glm5_jax.train import train

    class It:
        def __init__(self):
            self.i = 0
        def __next__(self):
            self.i += 1
            return batches[(self.i - 1) % len(batches)]
        def get_state(self):
            return {{"i": self.i}}
        def set_state(self, s):
            self.i = s["i"]

    t4 = tc.replace(steps=4, ckpt_every=2, async_checkpoints=False)
    quiet = lambda m: None
    ref = train(cfg, t4, It(), {str(tmp_path / 'one')!r}, init_params=params, log=quiet)
    a, b = sharding.make_mesh("data:2,fsdp:2,expert:2"), sharding.make_mesh("fsdp:4,expert:2")
    train(cfg, t4, It(), {str(tmp_path / 'two')!r}, init_params=params, log=quiet, mesh=a, stop_after=2)
    out = train(cfg, t4, It(), {str(tmp_path / 'two')!r}, init_params=params, log=quiet, mesh=b)
    assert [r["step"] for r in out["history"]] == [1, 2, 3, 4]
    want = np.array([r["loss"] for r in ref["history"]])
    got = np.array([r["loss"] for r in out["history"]])
    assert np.max(np.abs(got - want) / np.abs(want)) <= 1e-5, (got, want)
    assert leaf_spec(out["params"], "gate_proj")[-3:-1] == ("expert", ("fsdp", "context"))   # lives on mesh b
    assert dict(jax.tree_util.tree_leaves(out["params"])[0].sharding.mesh.shape)["fsdp"] == 4
    print("OK")
    """)


def test_bad_meshes_and_distributed_settings_fail_clearly():
    run8("""
    import jax
    from glm5_jax.config import ModelConfig
    from glm5_jax import sharding
    from glm5_jax.sharding import MeshError
    from glm5_jax.parallel import distributed as dist
    cfg = ModelConfig(num_experts=8)
    def fails(fn, *words):
        try:
            fn()
        except (MeshError, dist.DistributedConfigError, ValueError) as e:
            assert all(w in str(e) for w in words), (words, str(e))
        else:
            raise AssertionError(words)
    fails(lambda: dist.build_mesh("expert:3"), "needs 3 devices", "8 are available")
    fails(lambda: dist.build_mesh("fsdp:3,expert:-1"), "do not divide 8")
    fails(lambda: dist.build_mesh("expert:8", model_cfg=cfg.replace(num_experts=4)), "num_experts=4", "expert=8")
    fails(lambda: dist.build_mesh("tensor:8", model_cfg=cfg), "num_heads=4", "tensor=8")
    fails(lambda: dist.build_mesh("data:2,expert:4", model_cfg=cfg, batch_size=4), "batch size 4", "= 8")
    fails(lambda: dist.build_mesh("data:8", scope="nodes"), "scope")
    m = dist.build_mesh("data:2,expert:4", model_cfg=cfg, batch_size=8, scope="local")
    assert dict(m.shape) == {"data": 2, "fsdp": 1, "expert": 4, "context": 1, "tensor": 1}
    # context parallelism: d_model and the latent ranks over fsdp*expert*context, seq_len over 2*context
    fails(lambda: dist.build_mesh("fsdp:2,context:4", model_cfg=cfg.replace(d_model=36)), "d_model=36",
          "fsdp*expert*context=8")
    import types
    from experiments.run import make_mesh
    from glm5_jax.train import TrainConfig
    run_cfg = lambda t: types.SimpleNamespace(model=cfg, train=TrainConfig(batch_size=2, seq_len=t))
    fails(lambda: make_mesh("data:2,context:4", run_cfg(12)), "seq_len 12", "2*context = 8")
    assert dict(make_mesh("data:2,context:4", run_cfg(16)).shape)["context"] == 4
    calls = []
    assert dist.maybe_initialize(env={}, initialize=lambda **kw: calls.append(kw)) is False
    assert dist.maybe_initialize(env={"GLM5_NUM_PROCESSES": "1"}, initialize=lambda **kw: calls.append(kw)) is False
    env = {"GLM5_COORDINATOR_ADDRESS": "10.0.0.1:1234", "GLM5_NUM_PROCESSES": "4", "GLM5_PROCESS_ID": "3"}
    assert dist.maybe_initialize(env=env, initialize=lambda **kw: calls.append(kw)) is True
    assert calls == [{"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 3}], calls
    assert dist.maybe_initialize("h:1", 2, 0, env={}, initialize=lambda **kw: calls.append(kw))
    assert calls[-1]["num_processes"] == 2
    dist.maybe_initialize(env={**env, "GLM5_LOCAL_DEVICE_IDS": "0,1"}, initialize=lambda **kw: calls.append(kw))
    assert calls[-1]["local_device_ids"] == [0, 1]
    fails(lambda: dist.maybe_initialize(env={"GLM5_NUM_PROCESSES": "2", "GLM5_PROCESS_ID": "0"}, initialize=print),
          "coordinator")
    fails(lambda: dist.maybe_initialize(env={**env, "GLM5_PROCESS_ID": "4"}, initialize=print), "process_id=4")
    fails(lambda: dist.maybe_initialize(env={**env, "GLM5_NUM_PROCESSES": "x"}, initialize=print), "GLM5_NUM_PROCESSES")
    from glm5_jax.config import ConfigError
    fails(lambda: ModelConfig(moe_capacity_factor=float("nan")), "moe_capacity_factor")
    print("OK")
    """)


# ------------------------------------------------------------------------------------------ tools.plan
def _hand_count_tiny(sizes):
    """Per-device bytes of the tiny preset's params and AdamW state, by hand: each parameter dim is
    divided by the mesh axes its logical name is sharded over (experts -> expert; embed, q_lora,
    kv_lora -> fsdp x expert x context, or fsdp x context in a leaf that has an experts dim; vocab,
    heads, kv_heads, mlp, expert_mlp -> tensor; everything else whole; a mesh axis at most once per
    leaf), float32."""
    import flax.linen as nn
    import jax
    from glm5_jax.config import preset
    from glm5_jax.model import abstract_params
    tensor_names = ("vocab", "heads", "kv_heads", "mlp", "expert_mlp")
    params, opt = 0, 0
    boxed = abstract_params(preset("tiny"))
    for path, leaf in jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))[0]:
        shape, names = leaf.value.shape, leaf.names
        used, n = set(), 1
        if "experts" in names:
            used.add("expert")
        for dim, name in zip(shape, names):
            if name == "experts":
                axes = ("expert",)
            elif name in ("embed", "q_lora", "kv_lora"):
                axes = ("fsdp", "context") if "expert" in used else ("fsdp", "expert", "context")
            elif name in tensor_names:
                axes = ("tensor",)
            else:
                axes = ()
            if axes and not (set(axes) & (used - ({"expert"} if name == "experts" else set()))):
                used.update(axes)
                div = 1
                for a in axes:
                    div *= sizes.get(a, 1)
                assert dim % div == 0
                n *= dim // div
            else:
                n *= dim
        params += 4 * n
        if "e_score_correction_bias" not in jax.tree_util.keystr(path):   # zero-update leaf: no moments
            opt += 2 * 4 * n                                              # AdamW mu + nu
    return params, opt


@pytest.mark.slow  # one of the slowest default tests (suite budget: 15 min on 2 cores)
def test_plan_tiny_equals_hand_count():
    sizes = {"data": 1, "fsdp": 2, "expert": 2, "tensor": 2}
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)   # TPU compiles: not through the test cache
    res = subprocess.run([sys.executable, "-m", "tools.plan", "--preset=tiny", "--mesh=fsdp:2,expert:2,tensor:2",
                          "--batch_size=8", "--seq_len=16", "--json"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    import json
    p = json.loads(res.stdout)
    params, opt = _hand_count_tiny(sizes)
    pd = p["per_device_bytes"]
    assert pd["params"] == params, (pd, params)
    # + the optimizer's scalar step counts (int32, replicated), nothing else
    assert 0 <= pd["optimizer"] - opt <= 64 and (pd["optimizer"] - opt) % 4 == 0, (pd, opt)
    assert pd["total"] == pd["params"] + pd["optimizer"] + pd["activations"]
    # the mesh's 8 devices are forced on CPU, the step is compiled: activations are measured
    assert p["sources"]["activations"].startswith("measured") and p["devices"] == 8
    assert pd["activations"] == p["compiled_memory_analysis"]["temp_size_in_bytes"] > 0
    assert set(p["fits"]) == {"TPU v5p (95 GiB)", "H200 (140 GiB)"} and all(p["fits"].values())
    bad = subprocess.run([sys.executable, "-m", "tools.plan", "--preset=tiny", "--mesh=tensor:8"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert bad.returncode == 2 and "num_heads=4" in bad.stderr and "tensor=8" in bad.stderr, bad.stderr


def test_plan_glm5_pod_mesh():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "tools.plan", "--preset=glm5", "--mesh=fsdp:64,expert:4"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    out = res.stdout
    print(out)
    assert "256 devices" in out and "per-device memory" in out
    for key in ("params", "optimizer", "activations", "total"):
        assert any(line.strip().startswith(key) and "GB" in line for line in out.splitlines()), key
    assert "TPU v5p (95 GiB)" in out and "H200 (140 GiB)" in out
    assert ("fits:" in out) or ("does not fit:" in out)


# ------------------------------------------------------------------------------ the context axis in the plan
def test_plan_context_axis_shards_params_like_fsdp_and_checks_seq_len():
    """`context` joins fsdp for parameters: the same bytes as fsdp of that size (by hand, too), and
    a sequence length the 2*context chunks do not divide fails before anything is built."""
    from glm5_jax.config import preset
    from glm5_jax.parallel.plan import plan
    from glm5_jax.sharding import MeshError
    cfg = preset("tiny")
    with_context = plan(cfg, "fsdp:2,context:2,tensor:2", batch_size=2, seq_len=16, activations="estimate")
    with_fsdp = plan(cfg, "fsdp:4,tensor:2", batch_size=4, seq_len=16, activations="estimate")
    params, opt = _hand_count_tiny({"data": 1, "fsdp": 2, "expert": 1, "context": 2, "tensor": 2})
    pd = with_context["per_device_bytes"]
    assert pd["params"] == params == with_fsdp["per_device_bytes"]["params"]
    assert with_context["per_device_bytes"]["optimizer"] == with_fsdp["per_device_bytes"]["optimizer"]
    assert 0 <= pd["optimizer"] - opt <= 64
    # one sequence per device in both; context 2 holds half of its 16 tokens
    assert with_context["activation_estimates"]["layer"]["tokens_per_device"] == 8
    assert with_fsdp["activation_estimates"]["layer"]["tokens_per_device"] == 16
    with pytest.raises(MeshError, match=r"seq_len 12 is not divisible by 2\*context = 8"):
        plan(cfg, "context:4", batch_size=1, seq_len=12, activations="estimate")


def test_plan_cli_shows_the_context_axis():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "tools.plan", "--preset=glm5", "--mesh=expert:16,context:8",
                          "--batch_size=16", "--seq_len=131072", "--remat"],
                         env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "mesh data:1,fsdp:1,expert:16,context:8,tensor:1 (128 devices)" in res.stdout, res.stdout
    assert "batch 16 x seq 131072" in res.stdout
    bad = subprocess.run([sys.executable, "-m", "tools.plan", "--preset=glm5", "--mesh=expert:16,context:8",
                          "--batch_size=16", "--seq_len=4100"], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert bad.returncode == 2 and "seq_len 4100" in bad.stderr and "2*context = 16" in bad.stderr, bad.stderr


def _key_bytes(cfg, seqs, seq_len, context, layers):
    """The estimate's key-count terms by hand: the all-gathered keys of one layer (b sequences of
    seq_len keys, bf16) -- DSA / absorbed MLA: one [kv_latent | k_rope] row per key, kept as an
    attention residual with a same-sized gradient, plus one transient index_head_dim-wide indexer key;
    expanded MLA: per-head K and V. `layers` of them with no remat, one layer's (x2: values and
    gradients) with per-layer remat (layers=None). Nothing with context 1 (the keys are local)."""
    if context == 1:
        return 0
    if cfg.attention == "dsa":
        rows, index = 2 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim), 2 * cfg.index_head_dim
    else:
        rows, index = 2 * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim), 0
    per_layer = seqs * seq_len * rows
    return (2 * per_layer if layers is None else layers * per_layer) + seqs * seq_len * index


@pytest.mark.parametrize("attention", ["dsa", "mla"])
@pytest.mark.parametrize("remat", ["none", "layer"])
def test_activation_estimate_context_scaling(attention, remat):
    """At constant batch and seq_len, doubling `context` halves every per-token term (tokens per
    device seq/context) while the key-count terms follow the full sequence; at constant tokens per
    device, a longer sequence adds only its gathered keys and one transient score tile, no per-token
    x seq_len term (scores exist one query chunk at a time)."""
    from glm5_jax.config import preset
    from glm5_jax.parallel.plan import estimate_activation_bytes
    from glm5_jax.sharding import parse_mesh_spec
    cfg = preset("glm5").replace(attention=attention)
    layers = None if remat == "layer" else cfg.num_layers + cfg.mtp_depth
    batch, seq = 16, 131072

    def est(context, seq_len=seq):
        e = estimate_activation_bytes(cfg, batch, seq_len, parse_mesh_spec(f"expert:16,context:{context}"), remat)
        assert e["tokens_per_device"] == batch // 16 * seq_len // context
        return e["bytes"] - _key_bytes(cfg, batch // 16, seq_len, context, layers)

    b1, b2, b4, b8 = (est(cp) for cp in (1, 2, 4, 8))
    # bytes = per_token / context + constant (+ keys, removed): successive differences halve exactly
    assert b1 - b2 == 2 * (b2 - b4) == 4 * (b4 - b8) > 0
    assert b8 < b1 / 4
    # fixed tokens per device (16384): seq 65536 on context 4 -> seq 131072 on context 8
    grown = est(8) - est(4, seq // 2)
    assert 0 <= grown < 2 ** 30, grown        # at most one score tile; a per-token x seq term would be ~16 GiB
