"""tools.aot: the tiny model's train step compiled by the TPU compiler (no TPU) for v5p:2x2x1, and
clear errors for bad topologies / meshes / presets before anything compiles.

The compile runs in a subprocess: libtpu stays out of this test process (whose other tests use CPU
devices), and ALLOW_MULTIPLE_LIBTPU_LOAD=1 lets parallel workers each load it.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tools.aot import AotError, CHIPS, parse_topology, resolve

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable: install the '.[tpu]' extra to compile "
                                            "for TPU topologies without a TPU")
def test_tiny_train_step_compiles_for_v5p_2x2x1():
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
    env.pop("JAX_PLATFORMS", None)           # the TPU plugin must load (compile-only client)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)   # TPU compiles: not through the test cache
    res = subprocess.run([sys.executable, "-m", "tools.aot", "--preset=tiny", "--topology=v5p:2x2x1",
                          "--mesh=data:2,expert:2", "--batch_size=4", "--seq_len=64", "--json"],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "compiling with the TPU compiler" in res.stderr        # progress goes to stderr
    r = json.loads(res.stdout.strip().splitlines()[-1])
    pd = r["per_device_bytes"]
    assert set(pd) >= {"arguments", "outputs", "temporaries", "total"}
    assert pd["total"] == pd["arguments"] + pd["outputs"] + pd["temporaries"] - pd["aliased"]
    assert pd["temporaries"] > 0 and r["compile_seconds"] > 0
    # the donated state comes back in its own buffers: aliased bytes are (at least) the params + optimizer
    state = r["state_bytes"]["params"] + r["state_bytes"]["optimizer"]
    assert pd["arguments"] >= state and pd["aliased"] >= state
    # tiny is float32 and, on data:2 x expert:2, only the experts are split: >= num_params * 4 / 2 bytes
    assert r["state_bytes"]["params"] >= r["num_params"] * 4 // 2
    assert r["hbm_bytes"] == 95 * 2**30 and r["fits"] is True and r["devices"] == 4
    assert r["mesh"] == {"data": 2, "fsdp": 1, "expert": 2, "context": 1, "tensor": 1}
    assert r["config"]["model"]["num_layers"] == 3 and r["tokens_per_step"] == 4 * 64
    assert r["plan_estimate"]["per_device_bytes"]["total"] > 0
    # the step budget (estimates read off the compiled HLO: tools/budget.py, tests/test_aot_budget.py)
    b = r["budget"]
    from glm5_jax.config import preset
    from glm5_jax.flops import train_flops_per_token
    assert b["model_flops"] == pytest.approx(train_flops_per_token(preset("tiny"), 64) * 4 * 64 / 4)
    assert b["compiled_flops"] > 0 and b["bytes_accessed"] > 0 and b["collective_bytes"] > 0
    assert b["useful_flops_fraction"] == pytest.approx(b["model_flops"] / b["compiled_flops"], rel=1e-3)
    # the MTP blocks are model FLOPs (glm5_jax.flops); the figure without them is reported beside
    from glm5_jax.flops import estimate
    main = estimate(preset("tiny"), 64)["main_train_flops_per_token"] * 4 * 64 / 4
    assert b["model_flops_without_mtp"] == pytest.approx(main) and main < b["model_flops"]
    assert b["useful_flops_fraction_without_mtp"] == pytest.approx(main / b["compiled_flops"], rel=1e-3)
    assert 0 < b["useful_flops_fraction"] <= 1.5 and 0 < b["estimated_mfu"] <= 1
    assert b["estimated_step_seconds"] == max(b["seconds_by_bound"].values()) > 0
    assert 2 in b["while_trip_counts"].values()      # the scanned stack of 2 MoE layers, counted twice
    assert "not measurements" in b["budget_note"]


def _aot_json(*flags):
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)   # TPU compiles: not through the test cache
    res = subprocess.run([sys.executable, "-m", "tools.aot", "--preset=tiny", "--topology=v5p:2x2x1", "--json",
                          "--no_plan", *flags], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow   # two TPU compiles (~1.5 min on 2 cores)
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_offload_remat_moves_each_scanned_layer_input_to_host_memory(tmp_path):
    """remat="offload": the TPU compiler places the saved input of every scan step in host memory,
    exactly layers * b * T * D * 4 bytes (one MoE stack of 4 layers, float32, D = 128 so that TPU
    tiling adds no padding): in the compiled program the stack of saved inputs [layers, b, T, D] lives
    only in host memory (`S(5)`), where remat="full" keeps it in device memory. (Not compared: the
    device temporaries. The stack is 256 KB here, and the TPU compiler peels one step of the offload
    program's backward scan, its recompute and backward, out of the loop (3 trips instead of 4): that
    step's own buffers, +11.8 MB of temporaries at this size, outweigh the 256 KB moved.)"""
    import gzip
    import re
    flags = ("--mesh=data:4", "--batch_size=8", "--seq_len=64", "--set", "model.num_layers=4",
             "--set", "model.first_k_dense=0", "--set", "model.d_model=128")
    full = _aot_json(*flags, "--remat=full", f"--save_hlo={tmp_path / 'full.hlo.gz'}")
    off = _aot_json(*flags, "--remat=offload", f"--save_hlo={tmp_path / 'off.hlo.gz'}")
    assert full["per_device_bytes"].get("host_temporaries", 0) == 0
    assert off["per_device_bytes"]["host_temporaries"] == 4 * (8 // 4) * 64 * 128 * 4, off["per_device_bytes"]

    def stack_spaces(name):       # memory space of every value shaped like the saved-input stack (0: device HBM)
        text = gzip.open(tmp_path / name, "rt").read()
        layouts = re.findall(r"f32\[4,2,64,128\]\{([^}]*)\}", text)
        assert layouts, f"no [layers, b, T, D] stack in {name}"
        return {int(m.group(1)) if (m := re.search(r"S\((\d+)\)", lay)) else 0 for lay in layouts}
    assert stack_spaces("off.hlo.gz") == {5}          # pinned host only
    assert 0 in stack_spaces("full.hlo.gz") and 5 not in stack_spaces("full.hlo.gz")


def test_bad_topology_mesh_and_preset_fail_before_compiling():
    with pytest.raises(AotError, match="allowed: " + ", ".join(CHIPS)):
        parse_topology("v9:2x2x2")
    with pytest.raises(AotError, match="KIND:AxBxC"):
        parse_topology("v5p")
    with pytest.raises(AotError, match="integers"):
        parse_topology("v5p:2xax1")
    assert parse_topology("v5p:4x4x8") == ("v5p", (4, 4, 8))
    with pytest.raises(AotError, match="allowed: tiny, small, glm5"):
        resolve("huge", "v5p:2x2x1")
    with pytest.raises(AotError, match="needs 8 devices but 4"):
        resolve("tiny", "v5p:2x2x1", mesh="data:8")
    with pytest.raises(AotError, match="unknown mesh axis"):
        resolve("tiny", "v5p:2x2x1", mesh="pipe:4")
    with pytest.raises(AotError, match="remat"):
        resolve("tiny", "v5p:2x2x1", remat="some")
    with pytest.raises(AotError, match="moe_impl"):
        resolve("tiny", "v5p:2x2x1", overrides=("model.moe_impl=magic",))
    with pytest.raises(AotError, match="grad_accum"):
        resolve("tiny", "v5p:2x2x1", batch_size=8, grad_accum=3)
    from glm5_jax.sharding import MeshError
    with pytest.raises(MeshError, match="batch size 2 is not divisible by data\\*fsdp\\*expert = 4"):
        resolve("tiny", "v5p:2x2x1", batch_size=8, grad_accum=4)      # micro-batches of 2 rows on 4 shards
    assert resolve("tiny", "v5p:2x2x1", batch_size=8, grad_accum=2)["train"].grad_accum == 2
    d = resolve("glm5", "v5p:4x4x8")                 # the measured pod defaults (docs/scaleout.md)
    assert d["model"].num_layers == 78 and d["train"].batch_size * d["train"].seq_len >= 128 * 4096
    r = resolve("tiny", "v5p:2x2x1", mesh="fsdp:-1", overrides=("model.num_layers=2", "train.optimizer=muon"))
    assert r["mesh"]["fsdp"] == 4 and r["model"].num_layers == 2 and r["train"].optimizer == "muon"
    assert r["train"].batch_size == 4 and r["hbm_bytes"] == 95 * 2**30


def test_cli_error_exit_code_names_allowed_values():
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-m", "tools.aot", "--preset=tiny", "--topology=tpu:2x2"],
                         env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "allowed: v5p, v4, v6e, v5e" in res.stderr, res.stderr[-2000:]


def test_compiler_out_of_memory_is_a_report_with_fits_false_and_exit_1(monkeypatch, capsys):
    """When the TPU compiler refuses the program for memory, tools.aot prints a report (fits false, the
    compiler's line, the temporaries it asked for parsed from that line) and exits 1, not a traceback.
    The message is the compiler's own, from glm5 float32 masters + muon_split on v5p:4x4x8 (docs/scaleout.md)."""
    import tools.aot as aot
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
           "(98.29G) exceeds available HBM (95.74G).")
    e = aot.DoesNotFit(msg, 30.0, 10.0)
    assert e.temporaries == int(98.29 * 2**30) and e.available == int(95.74 * 2**30)
    assert aot.DoesNotFit("RESOURCE_EXHAUSTED: something else", 1.0, 1.0).temporaries is None

    def refuse(r, log=None, save_hlo=None):
        raise aot.DoesNotFit(msg, 30.0, 10.0)
    monkeypatch.setattr(aot, "compile_step", refuse)
    assert aot.main(["--preset=tiny", "--topology=v5p:2x2x1", "--json"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "the TPU compiler refused it" in out
    r = json.loads(out.strip().splitlines()[-1])
    assert r["fits"] is False and "RESOURCE_EXHAUSTED" in r["compile_error"]
    assert r["per_device_bytes"]["temporaries"] == int(98.29 * 2**30) and "compiled_over_plan" not in r
    assert r["plan_estimate"]["per_device_bytes"]["total"] > 0


@pytest.mark.slow   # one TPU compile (~1 min on 2 cores)
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_muon_split_compiles_with_distributed_newton_schulz():
    """--optimizer=muon_split on a 4-chip mesh compiles for TPU with Newton-Schulz where each matrix's shards
    live (glm5_jax.optim.distributed: all_to_all of matrix shards inside a shard_map), reported as
    muon_distributed."""
    r = _aot_json("--mesh=fsdp:2,expert:2", "--batch_size=4", "--seq_len=64", "--optimizer=muon_split")
    assert r["muon_distributed"] is True and r["config"]["train"]["optimizer"] == "muon_split"
    assert r["per_device_bytes"]["temporaries"] > 0 and r["budget"]["collective_bytes"] > 0


@pytest.mark.slow   # two TPU compiles of the tiny step (~2 min on 2 cores)
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_a2a_step_with_megablox_leaves_no_dense_expert_weight_gradient(tmp_path):
    """The tiny train step with moe_impl=a2a on v5p:2x2x1 (expert:4, 2 local experts a chip): with
    moe_kernel=auto (megablox on TPU) no dot / convolution in the compiled step produces an expert weight's
    shape [E_local, D, F] / [E_local, F, D] (the dense dW of ragged_dot's transpose), every Pallas kernel
    has a cost estimate, and compiled FLOPs drop against moe_kernel=ragged_dot, which keeps the dense form."""
    from tools.budget import parse_hlo
    flags = ("--mesh=expert:4", "--batch_size=4", "--seq_len=64", "--set", "model.moe_impl=a2a",
             "--set", "model.num_experts=8")

    def dense_dw(path):
        import gzip
        from glm5_jax.config import preset
        c = preset("tiny")
        shapes = {f"[2,{c.d_model},{c.moe_ffn_dim}]", f"[2,{c.moe_ffn_dim},{c.d_model}]"}
        text = gzip.open(path, "rt").read()
        return [i["name"] for instrs in parse_hlo(text)["computations"].values() for i in instrs
                if i["op"] in ("dot", "convolution") and any(s in i["shape"] for s in shapes)]

    mb = _aot_json(*flags, f"--save_hlo={tmp_path / 'mb.hlo.gz'}")
    rd = _aot_json(*flags, "--set", "model.moe_kernel=ragged_dot", f"--save_hlo={tmp_path / 'rd.hlo.gz'}")
    assert dense_dw(tmp_path / "mb.hlo.gz") == []
    assert dense_dw(tmp_path / "rd.hlo.gz"), "the ragged_dot step should keep the dense dW (the test's control)"
    assert mb["budget"]["unknown_cost_kernels"] == []
    assert mb["budget"]["compiled_flops"] < rd["budget"]["compiled_flops"]


@pytest.mark.slow   # one TPU compile of the tiny step (~1.5 min on 2 cores)
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_pallas_dsa_step_lowers_for_tpu_under_a_mesh():
    """attention_impl=pallas on a 4-chip mesh: the Mosaic kernels (indexer top-k, sparse attention) lower
    for TPU only inside a shard_map manual over every mesh axis (the lowering refuses a partly automatic
    region, which CPU interpret mode never sees); every kernel carries a cost estimate."""
    r = _aot_json("--mesh=fsdp:4", "--batch_size=4", "--seq_len=64", "--set", "model.attention_impl=pallas")
    assert r["fits"] is True
    assert r["budget"]["unknown_cost_kernels"] == []
    assert r["budget"]["compiled_flops"] > 0


# ---------------------------------------------------------------- serving programs (--program=decode|prefill)

def _serve_json(*flags):
    env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", PYTHONPATH=ROOT)
    env.pop("JAX_PLATFORMS", None)
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-m", "tools.aot", "--preset=tiny", "--topology=v5p:2x2x1", "--json", *flags],
                         env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _tiny_decode_floor(batch, chips, context):
    """min_bytes_per_step of the tiny preset's decode step on expert:`chips`, by hand from the config and
    glm5_jax.flops's parameter counts (float32: 4 bytes a number): every non-routed, non-MTP parameter once
    (the chip holds them whole), the embedding's `batch` rows, each local expert's weights with probability
    1 - (1 - k / E)^batch, and per sequence of the chip in each of the 3 layers (all full-indexer DSA) the
    `context` indexer keys, the index_topk selected [latent | k_rope] rows and the new token's row written."""
    from glm5_jax.config import preset
    from glm5_jax.flops import estimate
    c, e = preset("tiny"), estimate(preset("tiny"))
    embed = c.vocab_size * c.d_model
    hit = 1 - (1 - c.experts_per_tok / c.num_experts) ** batch
    weights = 4 * (e["total_params"] - e["routed_expert_params"] - embed + batch * c.d_model
                   + e["routed_expert_params"] / chips * hit)
    row, idx = c.kv_lora_rank + c.qk_rope_head_dim, c.index_head_dim
    cache = 4 * (batch // chips) * c.num_layers * (context * idx + min(context, c.index_topk) * row + row + idx)
    return weights, cache


def test_decode_floor_is_the_closed_form_by_hand():
    """tools.aot_serve.min_step_bytes on the engine's own abstract arguments (infer.programs on an abstract
    expert:4 mesh: the shardings' shard shapes, nothing allocated) equals the hand-derived floor of
    docs/inference.md, and its parts add up."""
    from glm5_jax.config import preset
    from glm5_jax.parallel.plan import abstract_mesh
    from glm5_jax.infer.programs import Programs
    from tools.aot_serve import min_step_bytes

    mesh = abstract_mesh({"data": 1, "fsdp": 1, "expert": 4, "context": 1, "tensor": 1})
    pr = Programs(preset("tiny"), mesh, max_batch=8, size=64)
    args = pr.abstract_args("decode")
    f = min_step_bytes(pr.config, args[0], tokens=8, queries=1, rows=2, context=64)
    weights, cache = _tiny_decode_floor(8, 4, 64)
    assert f["min_bytes_by_part"]["cache_rows"] == pytest.approx(cache)
    assert f["min_bytes_per_step"] == pytest.approx(weights + cache)
    assert f["min_bytes_per_step"] == pytest.approx(sum(f["min_bytes_by_part"].values()))
    assert f["cache_share"] == pytest.approx(cache / (weights + cache))
    # dense MLA reads every cached row instead of the indexer keys + the selected rows
    mla = Programs(preset("tiny").replace(attention="mla"), mesh, max_batch=8, size=64)
    g = min_step_bytes(mla.config, mla.abstract_args("decode")[0], tokens=8, queries=1, rows=2, context=64)
    c = mla.config
    assert g["min_bytes_by_part"]["cache_rows"] == 4 * 2 * c.num_layers * 65 * (c.kv_lora_rank + c.qk_rope_head_dim)


@pytest.mark.slow   # ~23 s: two TPU compiles (the scanned-weights decode compile below stays in the default run)
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_tiny_decode_and_prefill_compile_for_v5p_with_the_serving_budget():
    """--program=decode and --program=prefill compile the engine's programs for v5p:2x2x1 on the default
    serving mesh (expert over the 4 chips): the report splits weights / cache per chip (the cache by hand:
    2 sequences x 3 layers x 256 positions x the stored row, float32), the floor is the closed form above,
    and TPOT / tokens a second / the HBM roofline follow from the estimated step and the floor."""
    from glm5_jax.config import preset
    from glm5_jax.infer.cache import cache_numbers_per_token
    d = _serve_json("--program=decode", "--batch=8", "--max_model_len=256")
    assert d["program"] == d["program_name"] == "decode" and d["fits"] is True and d["mesh"]["expert"] == 4
    pd, b = d["per_device_bytes"], d["budget"]
    c = preset("tiny")
    import jax
    from glm5_jax.infer.cache import init_cache
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(lambda: init_cache(c, 8, 256)["layers"])))
    assert pd["cache"] == full // 4                       # each chip holds its 2 of the 8 slots
    assert pd["cache"] >= 4 * 2 * 256 * cache_numbers_per_token(c)          # >=: the kv row may be padded
    assert pd["aliased"] >= pd["cache"]                   # the donated cache comes back in place
    assert pd["engine_total"] == pd["weights"] + pd["cache"] + pd["temporaries"] <= d["hbm_bytes"]
    assert pd["total"] == pd["arguments"] + pd["outputs"] + pd["temporaries"] - pd["aliased"]
    weights, cache = _tiny_decode_floor(8, 4, 256)
    assert b["min_bytes_per_step"] == pytest.approx(weights + cache)
    assert b["bytes_over_min"] == pytest.approx(b["bytes_accessed"] / b["min_bytes_per_step"], rel=1e-3)
    hbm = b["chip_peaks"]["hbm_bytes_per_s"]
    assert b["hbm_roofline_step_seconds"] == pytest.approx(b["min_bytes_per_step"] / hbm)
    assert b["tpot_s"] == b["estimated_step_seconds"] > 0
    assert b["output_tokens_per_s_per_chip"] == pytest.approx(8 / 4 / b["tpot_s"])
    assert b["roofline_output_tokens_per_s_per_chip"] == pytest.approx(8 / 4 / b["hbm_roofline_step_seconds"])
    assert b["compiled_flops"] > 0 and b["collective_bytes"] > 0          # the experts' all-to-all
    p = _serve_json("--program=prefill", "--batch=8", "--max_model_len=256", "--prefill_chunk=64")
    assert p["program"] == "prefill" and p["fits"] is True and p["prefill_width"] == 64
    assert p["budget"]["prefill_tokens_per_s_per_chip"] > 0 and p["budget"]["tokens_per_step_per_chip"] == 64
    assert p["per_device_bytes"]["cache"] == pd["cache"]


@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_tiny_decode_for_v5p_reads_the_scanned_layer_weights_in_place(tmp_path):
    """The decode step compiled for v5p (tiny preset, expert:4, 2 sequences a chip) copies no layer's weights
    out of the scanned stacks into another layout: the routed experts run as dense matmuls (the unsorted
    dropless round, parallel.ep._token_round) that read the stack in place, the q_b / indexer wq_b outputs are
    pinned row-major (attention.core.row_major) and kv_b is held kv_lora-minor (Programs.param_formats). The
    one weight slice that may still be materialised is kv_b's, into on-chip memory (layout S(1)), one a
    scanned stack.
    At d1fab0b..281de10 q_b, wq_b, kv_b and the experts' weights were each sliced and copied every layer."""
    import re
    from glm5_jax.config import preset
    hlo = tmp_path / "decode.hlo"
    _serve_json("--program=decode", "--batch=8", "--max_model_len=256", f"--save_hlo={hlo}")
    text = hlo.read_text()
    assert not re.findall(r"= \S+ copy\(%\S*dynamic.slice\S*\)", text)        # no relaid layer slice
    slices = re.findall(r"%\S*dynamic.slice\S* = (\w+)\[([\d,]+)\](\{[^}]*\}) fusion\(", text)
    c = preset("tiny")
    kv_b = f"1,{c.kv_lora_rank},{c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)}"
    assert all(dims == kv_b and "S(1)" in lay for _, dims, lay in slices), slices
    assert len(slices) <= sum(s.repeats > 1 for s in c.layer_stacks)


def test_serving_flags_are_checked_before_compiling(capsys):
    import tools.aot as aot
    assert aot.main(["--program=decode", "--preset=tiny", "--topology=v5p:2x2x1", "--seq_len=64"]) == 2
    assert "--seq_len does not apply to --program=decode" in capsys.readouterr().err
    assert aot.main(["--preset=tiny", "--topology=v5p:2x2x1", "--max_model_len=64"]) == 2
    assert "use --batch_size / --seq_len" in capsys.readouterr().err
    assert aot.main(["--program=serve", "--preset=tiny", "--topology=v5p:2x2x1"]) == 2
    assert "train|decode|prefill" in capsys.readouterr().err
    assert aot.main(["--program=decode", "--preset=tiny", "--topology=v5p:2x2x1", "--batch=6"]) == 2
    assert "max_batch=6 is not divisible" in capsys.readouterr().err
    assert aot.main(["--program=decode", "--preset=tiny", "--topology=v5p:2x2x1", "--mesh=context:4"]) == 2
    assert "not supported for serving" in capsys.readouterr().err
    assert aot.main(["--program=decode", "--preset=tiny", "--topology=v5p:2x2x1", "--set", "train.lr=1"]) == 2
    assert "train" in capsys.readouterr().err


def test_serving_program_the_compiler_refuses_is_a_report_with_fits_false(monkeypatch, capsys):
    """A serving program over HBM (e.g. glm5 decode at 192 x 131072 on v5p:4x4x4: docs/inference.md) is a
    report with fits false and the compiler's line, exit 1, as for the train step."""
    import tools.aot as aot
    import tools.aot_serve as aot_serve
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
           "(101.23G) exceeds available HBM (95.74G).")

    def refuse(r, log=None, save_hlo=None):
        raise aot.DoesNotFit(msg, 9.0, 1.0)
    monkeypatch.setattr(aot_serve, "compile_serving", refuse)
    assert aot.main(["--program=decode", "--preset=tiny", "--topology=v5p:2x2x1", "--batch=8", "--json"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "the TPU compiler refused it" in out
    r = json.loads(out.strip().splitlines()[-1])
    assert r["fits"] is False and r["program"] == "decode" and r["batch"] == 8
    assert "decode of preset tiny" in out
    assert r["per_device_bytes"]["temporaries"] == int(101.23 * 2**30)


def test_help_lists_the_flags_and_exits_0(capsys):
    import tools.aot as aot
    assert aot.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--max_model_len" in out and "--batch_size" in out and "--program" in out
    assert aot.main(["--preset=tiny", "--topology=v5p:2x2x1", "stray"]) == 2
    assert "unexpected arguments ['stray']" in capsys.readouterr().err


# ---------------------------------------------------------------- the paged runtime's step (--kv_cache=paged)

def test_paged_batch_auto_is_the_largest_pool_that_fits_beside_the_weights():
    """--kv_cache=paged --batch=auto (no compiler): the largest multiple of the batch shards whose pool of
    HEADROOM x batch x mean context positions fits a chip's HBM beside the weights and the reserve; the table
    is the runtime's width for HEADROOM x mean context; one batch shard more would not fit."""
    from tools.aot_serve import HEADROOM, RESERVE_GIB, resolve_serving
    r = resolve_serving("decode", "tiny", "v5p:2x2x1", batch="auto", max_model_len=4096, kv_cache="paged",
                        mean_context=1000, page_size=16)
    g, shards = r["paged"], r["shards"]
    assert shards == 4 and r["batch"] % shards == 0 and g["width"] == r["batch"] and g["batch_auto"]
    free = r["hbm_bytes"] - g["weights_bytes_planned"] - RESERVE_GIB * 2**30
    per_seq = HEADROOM * 1000 * g["pool_bytes_per_token"]
    assert r["batch"] // shards * per_seq <= free < (r["batch"] // shards + 1) * per_seq
    assert g["num_pages"] * 16 >= HEADROOM * r["batch"] * 1000 and g["num_pages"] % shards == 0
    assert g["table_pages"] == -(-1250 // 16) and r["cache_size"] == g["table_pages"] * 16
    s = resolve_serving("step", "tiny", "v5p:2x2x1", batch=8, max_model_len=4096, kv_cache="paged",
                        mean_context=1000, page_size=16, prefill_chunk=32)
    assert s["paged"]["width"] == 4 * (2 + 32)               # each shard: its 2 decodes + one 32-token chunk


@pytest.mark.slow   # ~25 s: two TPU compiles
@pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not importable (the '.[tpu]' extra)")
def test_tiny_paged_decode_and_mixed_step_compile_for_v5p_with_the_floor():
    """--kv_cache=paged compiles Programs.paged_step for v5p:2x2x1: the decode (one row a sequence) with the
    floor of the slot decode at the mean context, TPOT and tokens/s from the compiled estimate; the mixed
    step (decodes + a prefill chunk a shard) fits and adds the chunk's cache reads to the floor."""
    d = _serve_json("--program=decode", "--kv_cache=paged", "--batch=8", "--max_model_len=512",
                    "--mean_context=200", "--page_size=16")
    assert d["program_name"] == "paged_decode" and d["fits"] is True and d["kv_cache"] == "paged"
    b, g = d["budget"], d["paged"]
    weights, cache = _tiny_decode_floor(8, 4, 200)
    assert b["min_bytes_per_step"] == pytest.approx(weights + cache)
    assert b["output_tokens_per_s_per_chip"] == pytest.approx(8 / 4 / b["tpot_s"])
    assert d["per_device_bytes"]["cache"] * 4 >= g["num_pages"] * 16 * g["pool_bytes_per_token"]   # the pool
    s = _serve_json("--program=step", "--kv_cache=paged", "--batch=8", "--max_model_len=512",
                    "--mean_context=200", "--page_size=16", "--prefill_chunk=32")
    assert s["program_name"] == "paged_step" and s["fits"] is True and s["paged"]["width"] == 4 * (2 + 32)
    assert s["budget"]["min_bytes_per_step"] > b["min_bytes_per_step"]
    assert s["budget"]["prefill_tokens_per_s_per_chip"] > 0
