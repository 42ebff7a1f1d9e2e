"""tools.budget (the compiled step's budget in tools.aot --json): the HLO walk against closed forms.

- a hand-written HLO module: collective bytes, dot, (dilated) convolution and ragged-dot kernel FLOPs, each while body
  times the trip count its condition states;
- a jitted matmul and a scanned matmul compiled for CPU: 2*M*N*K (x layers), and XLA's own
  cost_analysis, which agrees without loops and counts a while body once (why the walk exists);
- model_flops per device = glm5_jax.flops.train_flops_per_token x tokens / devices.
The TPU budget fields of a real train step are checked in tests/test_aot.py's tiny v5p:2x2x1 compile.
"""

import jax
import jax.numpy as jnp
import pytest

from tools.budget import CHIP_PEAKS, hlo_budget, model_flops_per_device, shape_bytes, step_budget

# a 5-step while loop (trip count in its condition, as the TPU compiler leaves it) around an async
# all-gather, an all-reduce and a dot; in the entry a collective-permute and a batched dot the TPU
# compiler wrote as a dilated convolution (4 heads of [64,24] x [64,24]^T) and its ragged_dot kernel
# (40 rows of 24, each against one of 8 groups' [24, 32])
HLO = """HloModule m, entry_computation_layout={()->f32[8,16]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (p: (s32[], f32[8,16], f32[16,16], bf16[1,16,16])) -> pred[] {
  %n = s32[]{:T(128)} constant(5)
  %p = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}, bf16[1,16,16]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p.1: (s32[], f32[8,16], f32[16,16], bf16[1,16,16])) -> (s32[], f32[8,16], f32[16,16], bf16[1,16,16]) {
  %p.1 = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}, bf16[1,16,16]{2,1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %x = f32[8,16]{1,0:T(8,128)} get-tuple-element(%p.1), index=1
  %w = f32[16,16]{1,0} get-tuple-element(%p.1), index=2
  %y = bf16[1,16,16]{2,1,0} get-tuple-element(%p.1), index=3
  %ag-start = (bf16[1,16,16]{2,1,0}, bf16[4,16,16]{2,1,0}) all-gather-start(%y), dimensions={0}, replica_groups={{0,1,2,3}}
  %ag-done = bf16[4,16,16]{2,1,0} all-gather-done(%ag-start)
  %ar = f32[8,16]{1,0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %d = f32[8,16]{1,0} dot(%ar, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/while/body/layer/mlp/dot_general"}
  %one = s32[] constant(1)
  %i.2 = s32[] add(%i.1, %one)
  ROOT %t = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}, bf16[1,16,16]{2,1,0}) tuple(%i.2, %d, %w, %y)
}

ENTRY %main (x.0: f32[8,16], w.0: f32[16,16], y.0: bf16[1,16,16], q: f32[4,64,24], k: f32[4,64,24], c: bf16[2,8], g: s32[9], rows: bf16[40,24], experts: bf16[8,24,32]) -> f32[8,16] {
  %x.0 = f32[8,16]{1,0} parameter(0)
  %w.0 = f32[16,16]{1,0} parameter(1)
  %y.0 = bf16[1,16,16]{2,1,0} parameter(2)
  %q = f32[4,64,24]{2,1,0} parameter(3)
  %k = f32[4,64,24]{2,1,0} parameter(4)
  %c = bf16[2,8]{1,0} parameter(5)
  %cp = bf16[2,8]{1,0} collective-permute(%c), source_target_pairs={{0,1},{1,0}}
  %scores = f32[4,64,64]{2,1,0} convolution(%q, %k), window={size=4 stride=3 lhs_dilate=4}, dim_labels=0bf_0oi->0bf
  %g = s32[9]{0} parameter(6)
  %rows = bf16[40,24]{1,0} parameter(7)
  %experts = bf16[8,24,32]{2,1,0} parameter(8)
  %ragged-dot-none.3 = bf16[40,32]{1,0} custom-call(%g, %rows, %experts), custom_call_target="tpu_custom_call"
  %zero = s32[] constant(0)
  %init = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}, bf16[1,16,16]{2,1,0}) tuple(%zero, %x.0, %w.0, %y.0)
  %loop = (s32[], f32[8,16]{1,0}, f32[16,16]{1,0}, bf16[1,16,16]{2,1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_hlo_walk_counts_collectives_and_flops_times_trip_counts():
    h = hlo_budget(HLO)
    assert h["while_trip_counts"] == {"loop": 5} and h["unknown_trip_loops"] == []
    assert shape_bytes("(bf16[1,16,16]{2,1,0}, f32[8,16]{1,0:T(8,128)})") == 16 * 16 * 2 + 8 * 16 * 4
    ag, ar, cp = 4 * 16 * 16 * 2, 8 * 16 * 4, 2 * 8 * 2       # output bytes; the async start is not counted
    assert h["collective_bytes_by_op"] == {"all-gather": 5 * ag, "all-reduce": 5 * ar, "collective-permute": cp}
    assert h["collective_bytes"] == 5 * (ag + ar) + cp
    # the loop's dot 5 x 2*8*16*16; the convolution: per head 2*64*64*24 (one real tap in each window)
    assert h["flops"] == 5 * 2 * 8 * 16 * 16 + 4 * 2 * 64 * 64 * 24 + 2 * 40 * 24 * 32
    assert h["flops_by_source"]["f/layer/mlp"] == 5 * 2 * 8 * 16 * 16


def test_a_data_dependent_loop_counts_once_and_is_listed():
    h = hlo_budget(HLO.replace("direction=LT", "direction=NE"))
    assert h["unknown_trip_loops"] == ["loop"]
    assert h["flops"] == 2 * 8 * 16 * 16 + 4 * 2 * 64 * 64 * 24 + 2 * 40 * 24 * 32


def _compile(f, *shapes):
    return jax.jit(f).lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile()


@pytest.mark.parametrize("m,k,n", [(64, 128, 32), (48, 80, 24)])
def test_matmul_compiled_flops_is_2mnk_on_cpu(m, k, n):
    c = _compile(lambda a, b: a @ b, (m, k), (k, n))
    b = step_budget(c, "v5p", model_flops=2 * m * n * k)
    assert b["compiled_flops"] == 2 * m * n * k
    assert b["xla_cost_analysis"]["flops"] == 2 * m * n * k           # no loop: XLA's own count agrees
    assert b["useful_flops_fraction"] == 1.0
    assert b["bytes_accessed"] == 4 * (m * k + k * n + m * n) == b["xla_cost_analysis"]["bytes_accessed"]
    assert b["collective_bytes"] == 0 and "not measurements" in b["budget_note"]
    p = CHIP_PEAKS["v5p"]
    t = max(2 * m * n * k / p["peak_flops"], b["bytes_accessed"] / p["hbm_bytes_per_s"])
    assert b["estimated_step_seconds"] == pytest.approx(t) and b["bound"] == "hbm"
    assert b["estimated_mfu"] == pytest.approx(2 * m * n * k / (t * p["peak_flops"]), abs=1e-4)


def test_scanned_matmul_counts_every_layer():
    layers, m, k = 6, 64, 128

    def f(x, ws):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)[0]

    b = step_budget(_compile(f, (m, k), (layers, k, k)), "v5p", model_flops=layers * 2 * m * k * k)
    assert b["compiled_flops"] == layers * 2 * m * k * k and b["useful_flops_fraction"] == 1.0
    assert list(b["while_trip_counts"].values()) == [layers]
    # XLA's cost analysis counts the while body once (jax 0.10.2): the reason tools.budget walks the HLO
    assert b["xla_cost_analysis"]["flops"] < b["compiled_flops"]


def test_model_flops_per_device_is_train_flops_per_token_times_tokens_over_devices():
    from glm5_jax.config import preset
    from glm5_jax.flops import train_flops_per_token
    cfg = preset("tiny")
    assert model_flops_per_device(cfg, 8, 64, 4) == train_flops_per_token(cfg, 64) * 8 * 64 / 4
    assert model_flops_per_device(cfg, 8, 64, 1) == 4 * model_flops_per_device(cfg, 8, 64, 4)


# two Pallas TPU kernels (tpu_custom_call): one with the cost estimate pallas_call writes in its backend
# config (megablox gmm: flops 2 M K N), one without (counted 0 and listed)
MOSAIC = """HloModule k, entry_computation_layout={()->f32[1024,256]{1,0}}

ENTRY %main (a: bf16[1024,512], b: bf16[8,512,256], g: s32[8]) -> f32[1024,256] {
  %a = bf16[1024,512]{1,0} parameter(0)
  %b = bf16[8,512,256]{2,1,0} parameter(1)
  %g = s32[8]{0} parameter(2)
  %gmm.1 = f32[1024,256]{1,0} custom-call(%g, %a, %b), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body":"TUxJ","cost_estimate":{"flops":"268435456","transcendentals":"0","bytes_accessed":"7077888","remote_bytes_transferred":"0"},"needs_layout_passes":true}}, metadata={op_name="jit(f)/moe/experts/gmm"}
  ROOT %mystery.2 = f32[1024,256]{1,0} custom-call(%gmm.1), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body":"TUxJ","needs_layout_passes":true}}
}
"""


def test_pallas_kernels_count_their_cost_estimate_and_unknown_ones_are_listed():
    """A tpu_custom_call counts the FLOPs and bytes of its cost estimate; one without an estimate counts
    no FLOPs and is named in unknown_cost_kernels (so a budget with an empty list counted every kernel)."""
    h = hlo_budget(MOSAIC)
    assert h["flops"] == 2 * 1024 * 512 * 256
    assert h["flops_by_source"] == {"f/moe/experts/gmm": 2 * 1024 * 512 * 256}
    assert h["unknown_cost_kernels"] == ["mystery.2"]
    assert h["bytes_accessed"] == 7077888 + 2 * 1024 * 256 * 4          # estimate + the unknown's operand/output
    assert hlo_budget(HLO)["unknown_cost_kernels"] == []


def test_a_kernel_written_over_two_lines_with_sorted_cost_keys_is_counted():
    """The --xla_dump_to form of the same module (MaxText's HLO dumps, jax 0.12): the custom call's
    attributes continue on a line of their own and the cost estimate's keys come sorted; the budget
    equals the one-line form's."""
    two_lines = MOSAIC.replace(
        'custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body":"TUxJ","cost_estimate":'
        '{"flops":"268435456","transcendentals":"0","bytes_accessed":"7077888","remote_bytes_transferred":"0"}',
        'custom_call_target="tpu_custom_call",\n}}, backend_config={"custom_call_config": {"body":"TUxJ","cost_estimate":'
        '{"bytes_accessed":"7077888","flops":"268435456","remote_bytes_transferred":"0","transcendentals":"0"}')
    assert two_lines != MOSAIC and "\n}}, backend_config" in two_lines
    a, b = hlo_budget(MOSAIC), hlo_budget(two_lines)
    assert b["flops"] == a["flops"] == 2 * 1024 * 512 * 256
    assert b["bytes_accessed"] == a["bytes_accessed"] and b["unknown_cost_kernels"] == ["mystery.2"]


# the TPU compiler's own ragged_dot kernels as libtpu 0.0.42 writes them (tests/test_aot.py's tiny step): a
# `ragged-dot-metadata` Mosaic kernel turns the 4 group sizes into tile offsets in scalar memory (no pallas_call, so
# no cost estimate), and the grouped matmul `ragged-dot-none` reads them: 512 rows of 16 x 4 groups' [16, 32]
RAGGED = """HloModule r, entry_computation_layout={()->f32[512,32]{1,0}}

ENTRY %main (g: s32[4], rows: f32[512,16], w: f32[4,16,32]) -> f32[512,32] {
  %g = s32[4]{0} parameter(0)
  %rows = f32[512,16]{1,0} parameter(1)
  %w = f32[4,16,32]{2,1,0} parameter(2)
  %ragged-dot-metadata.1 = (s32[5]{0:T(128)}, s32[7]{0:T(128)}, s32[7]{0:T(128)}, s32[1]{0:T(128)}) custom-call(%g), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[4]{0}}, metadata={op_name="ragged-dot-metadata"}, backend_config={"custom_call_config":{"body":"TUxJ"}}
  %n = s32[1]{0} get-tuple-element(%ragged-dot-metadata.1), index=3
  %o = s32[5]{0} get-tuple-element(%ragged-dot-metadata.1), index=0
  %t = s32[7]{0} get-tuple-element(%ragged-dot-metadata.1), index=1
  %e = s32[7]{0} get-tuple-element(%ragged-dot-metadata.1), index=2
  ROOT %ragged-dot-none.7 = f32[512,32]{1,0:T(8,128)} custom-call(%n, %o, %t, %e, %n, %rows, %w), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/moe/experts/ragged_dot_general"}
}
"""


def test_the_compilers_ragged_dot_metadata_kernel_is_not_an_unknown_cost_kernel():
    """The ragged-dot metadata kernel is the compiler's own (it multiplies nothing): 0 FLOPs and not listed in
    unknown_cost_kernels, which names pallas_calls without a cost estimate; the grouped matmul after it counts
    2 M K N. (Listed as unknown, it failed test_aot's Pallas DSA step, whose tiny MoE runs ragged_dot.)"""
    h = hlo_budget(RAGGED)
    assert h["unknown_cost_kernels"] == []
    assert h["flops"] == 2 * 512 * 16 * 32
    assert hlo_budget(RAGGED.replace("ragged-dot-metadata.1", "my-kernel.1"))["unknown_cost_kernels"] == ["my-kernel.1"]


def _tpu_devices():
    pytest.importorskip("libtpu", reason="the TPU compiler (jax[tpu] / libtpu) is not installed")
    from jax.experimental import topologies
    return topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices


def test_megablox_experts_fwd_bwd_compiled_flops_are_the_grouped_closed_form():
    """The routed experts' SwiGLU through pallas_kernels.gmm (megablox on TPU), forward + gradient compiled
    by the TPU compiler: compiled FLOPs = 3 projections x (forward, dX, dW) x 2 M D F, exactly (every
    kernel carries its cost estimate; nothing else contracts), and no dot / convolution is left whose
    output is an expert weight's shape (the dense dW form of ragged_dot)."""
    from pallas_kernels.gmm import grouped_matmul
    from tools.budget import parse_hlo
    devs = _tpu_devices()
    mesh = jax.sharding.Mesh(devs[:1], ("x",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    m, d, f, g = 1024, 256, 128, 8

    def loss(x, gate, up, down, sizes):
        dot = lambda a, w: grouped_matmul(a, w, sizes, impl="auto")
        return jnp.sum(dot(jax.nn.silu(dot(x, gate)) * dot(x, up), down).astype(jnp.float32) ** 2)

    sds = lambda s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=rep)
    c = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(
        sds((m, d)), sds((g, d, f)), sds((g, d, f)), sds((g, f, d)), sds((g,), jnp.int32)).compile()
    b = step_budget(c, "v5p", model_flops=9 * 2 * m * d * f)
    assert b["unknown_cost_kernels"] == []
    assert b["compiled_flops"] == 9 * 2 * m * d * f and b["useful_flops_fraction"] == 1.0
    weight_shapes = {f"[{g},{d},{f}]", f"[{g},{f},{d}]"}
    for instrs in parse_hlo(c.as_text())["computations"].values():
        for ins in instrs:
            if ins["op"] in ("dot", "convolution"):
                assert not any(ws in ins["shape"] for ws in weight_shapes), ins["name"]


# a 100-step loop reading one row of a [1000, 64] f32 buffer per step: through a gather inside a fusion,
# through a dynamic-slice inside a nested fusion, and scattering one row back in place
LOOP_ROWS = """HloModule rows, entry_computation_layout={()->f32[1000,64]{1,0}}

%nested (a: f32[1000,64], i: s32[]) -> f32[1,64] {
  %a = f32[1000,64]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,64]{1,0} dynamic-slice(%a, %i, %z), dynamic_slice_sizes={1,64}
}

%gathers (buf: f32[1000,64], idx: s32[1,1], i.1: s32[]) -> f32[1,64] {
  %buf = f32[1000,64]{1,0} parameter(0)
  %idx = s32[1,1]{1,0} parameter(1)
  %i.1 = s32[] parameter(2)
  %g = f32[1,64]{1,0} gather(%buf, %idx), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
  %n = f32[1,64]{1,0} fusion(%buf, %i.1), kind=kLoop, calls=%nested
  ROOT %s = f32[1,64]{1,0} add(%g, %n)
}

%add2 (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %r = f32[] add(%x, %y)
}

%scatters (t: f32[1000,64], sidx: s32[1,1], upd: f32[1,64]) -> f32[1000,64] {
  %t = f32[1000,64]{1,0} parameter(0)
  %sidx = s32[1,1]{1,0} parameter(1)
  %upd = f32[1,64]{1,0} parameter(2)
  ROOT %sc = f32[1000,64]{1,0} scatter(%t, %sidx, %upd), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add2
}

%cond (p: (s32[], f32[1000,64], s32[1,1])) -> pred[] {
  %p = (s32[], f32[1000,64]{1,0}, s32[1,1]{1,0}) parameter(0)
  %c = s32[] get-tuple-element(%p), index=0
  %lim = s32[] constant(100)
  ROOT %lt = pred[] compare(%c, %lim), direction=LT
}

%body (q: (s32[], f32[1000,64], s32[1,1])) -> (s32[], f32[1000,64], s32[1,1]) {
  %q = (s32[], f32[1000,64]{1,0}, s32[1,1]{1,0}) parameter(0)
  %c.1 = s32[] get-tuple-element(%q), index=0
  %b = f32[1000,64]{1,0} get-tuple-element(%q), index=1
  %ix = s32[1,1]{1,0} get-tuple-element(%q), index=2
  %row = f32[1,64]{1,0} fusion(%b, %ix, %c.1), kind=kLoop, calls=%gathers
  %b2 = f32[1000,64]{1,0} fusion(%b, %ix, %row), kind=kLoop, calls=%scatters
  %one = s32[] constant(1)
  %c.2 = s32[] add(%c.1, %one)
  ROOT %t.1 = (s32[], f32[1000,64]{1,0}, s32[1,1]{1,0}) tuple(%c.2, %b2, %ix)
}

ENTRY %main (buf.0: f32[1000,64], ix.0: s32[1,1]) -> f32[1000,64] {
  %buf.0 = f32[1000,64]{1,0} parameter(0)
  %ix.0 = s32[1,1]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1000,64]{1,0}, s32[1,1]{1,0}) tuple(%zero, %buf.0, %ix.0)
  %loop = (s32[], f32[1000,64]{1,0}, s32[1,1]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1000,64]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_a_loop_that_indexes_rows_counts_the_rows_not_the_buffer():
    """Per step: the gather fusion reads 2 rows (gathered, dynamic-sliced in a nested fusion) + its
    indices + counter and writes one row; the scatter fusion reads / writes one row in place and reads its
    update + indices. The 256 KB buffer itself never counts (it did before: 100 x 2 x 256 KB)."""
    row, ix = 64 * 4, 4
    h = hlo_budget(LOOP_ROWS)
    assert h["while_trip_counts"] == {"loop": 100}
    gather_fusion = 2 * row + ix + 4 + row
    scatter_fusion = 2 * row + ix + row
    assert h["bytes_by_source"]["? [fusion]"] == 100 * (gather_fusion + scatter_fusion)
    assert h["bytes_accessed"] < 100 * (gather_fusion + scatter_fusion) + 100 * 64   # + the loop counter's ops


def test_match_sums_the_flops_of_every_matching_source(tmp_path, capsys):
    # `python -m tools.budget FILE --match=REGEX` sums the dot FLOPs whose source (the op_name's module
    # path) matches REGEX: here the two scopes named attn_* (2 m k n each) and not the mlp scope's dot
    m, k = 32, 64

    def f(x, w):
        with jax.named_scope("attn_q"):
            a = x @ w
        with jax.named_scope("attn_o"):
            a = a @ w
        with jax.named_scope("mlp"):
            return jnp.tanh(a) @ w

    compiled = _compile(f, (m, k), (k, k))
    path = tmp_path / "step.hlo.txt"
    path.write_text(compiled.as_text())
    from tools.budget import main
    assert main([str(path), "--match=attn", "--json"]) == 0
    import json
    b = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert b["compiled_flops"] == 3 * 2 * m * k * k
    assert b["flops_matching"]["flops"] == 2 * 2 * m * k * k
    assert all("attn" in s for s in b["flops_matching"]["sources"]) and len(b["flops_matching"]["sources"]) == 2
    assert main([str(path), "--match=("]) == 2 and "not a regular expression" in capsys.readouterr().err
    # --top lists that many sources; bad flags and input exit 2 with one "error:" line (absl flags)
    assert main([str(path), "--top=1", "--json"]) == 0
    b = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(b["flops_by_source"]) == 1 and len(b["bytes_by_source"]) == 1
    assert main([str(path), "--chip=v9"]) == 2 and "--chip=v9" in capsys.readouterr().err
    assert main([str(path), "--top=0"]) == 2 and "error:" in capsys.readouterr().err
    assert main([]) == 2 and "exactly one compiled HLO" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.txt")]) == 2 and "missing.txt" in capsys.readouterr().err
    assert main(["--help"]) == 0 and "--model_flops" in capsys.readouterr().out
