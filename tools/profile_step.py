"""Where one train step's time goes: a jax.profiler trace of the project's train step, per HLO op,
summed by the op's source scope (its `op_name` metadata) and split into forward (F) and backward (B).

    python -m tools.profile_step [--shape=4x1024] [--threads=1] [--depth=4] [--top=30] [--set model.FIELD=value ...]

Model: tools.bench_vs_hf's tiny GLM-5 (vocab 8192, d 256, 4 layers, DSA top-128, 8 experts top-2) with
its AdamW step, so the shares explain that benchmark's train-step ratio; `--set` overrides model
config fields (e.g. `--set model.dsa_short_dense=0`, the `section.field=value` of every `--set`). The process is pinned to the first `--threads`
cores. Prints the untraced step time, then the `--top` scopes (op_name cut to `--depth` levels
after the jit / jvp / while wrappers, digits folded to #) with seconds and share of the traced XLA
op time, then the same time by HLO op kind (dot fusions with their dot FLOPs and GFLOP/s beside a
1024^3 float32 matmul measured in the same process; elementwise / reduce fusions, TopK, sort,
gather, scatter, copies), then the single most expensive ops.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
import time

from absl import flags

from glm5_jax import hugepages
from glm5_jax.cli import main_wrapper, run as run_cli

_WRAPPERS = ("while", "body", "closed_call")


def _scope(op_name: str, depth: int) -> str:
    parts = [p for p in op_name.split("/") if p not in _WRAPPERS
             and not p.startswith(("jit(train", "jvp(", "transpose(jvp("))]
    pre = "B " if "transpose(" in op_name else "F "
    return pre + re.sub(r"\d+", "#", "/".join(parts[:depth]))


def _op_names(hlo_text: str) -> dict:
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]+)\"", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


_INSTR = re.compile(r"\s*(?:ROOT )?%([\w.\-]+) = (\(.*?\)|\S+) ([a-z][\w\-]*)\((.*)$")
_COMP = re.compile(r"(?:ENTRY )?%([\w.\-]+) .*\{$")


def _dims(shape: str) -> list:
    m = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def _dot_flops(out_shape: str, operands: str, shape: dict) -> int:
    """2 * |output| * |lhs contracting dims| of one HLO dot."""
    lhs = _dims(shape.get(re.match(r"%([\w.\-]+)", operands).group(1), ""))
    cd = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", operands)
    n = 2
    for d in _dims(out_shape) + [lhs[int(c)] for c in (cd.group(1).split(",") if cd and cd.group(1) else [])]:
        n *= d
    return n


def op_kinds(hlo_text: str) -> dict:
    """instruction name -> (kind, dot FLOPs per execution), for the ops a profile names. A fusion's
    kind says whether its fused computation holds a dot ("dot fusion", FLOPs summed over its dots)
    or else its fusion kind; a custom call is named by its target (TopK, ...)."""
    shape, instr, comp_flops = {}, [], {}
    comp = None
    for line in hlo_text.splitlines():
        if not line.startswith(" "):
            m = _COMP.match(line)
            comp = m.group(1) if m else comp
        elif m := _INSTR.match(line):
            shape[m.group(1)] = m.group(2)
            instr.append((comp,) + m.groups())
    for comp, _, shp, opcode, rest in instr:
        if opcode == "dot":
            comp_flops[comp] = comp_flops.get(comp, 0) + _dot_flops(shp, rest, shape)
    kinds = {}
    for _, name, shp, opcode, rest in instr:
        if opcode == "fusion":
            f = comp_flops.get(re.search(r"calls=%([\w.\-]+)", rest).group(1), 0)
            kinds[name] = ("dot fusion" if f else "fusion " + re.search(r"kind=(\w+)", rest).group(1), f)
        elif opcode == "custom-call":
            kinds[name] = ("custom-call " + re.search(r'custom_call_target="([^"]+)"', rest).group(1), 0)
        else:
            kinds[name] = (opcode, _dot_flops(shp, rest, shape) if opcode == "dot" else 0)
    return kinds


def trace_ops(fn):
    """Run fn() once under jax.profiler -> (ns per HLO op name, executions per op name): the XLA
    CPU threads' op events; loops and calls span their bodies' ops and are not counted."""
    import jax
    tdir = tempfile.mkdtemp()
    with jax.profiler.trace(tdir):
        fn()
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{tdir}/**/*.xplane.pb", recursive=True)[0])
    per_op, runs = collections.Counter(), collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:     # the XLA CPU client's / Eigen pool's threads
                continue
            for ev in line.events:
                if not ev.name.startswith(("while", "conditional", "call", "ThunkExecutor", "end:", "Threadpool")):
                    per_op[ev.name] += ev.duration_ns
                    runs[ev.name] += 1
    return per_op, runs


def kind_table(per_op, runs, kinds) -> dict:
    """kind -> [ns, executions, dot FLOPs executed] over the traced ops (`op_kinds` names them)."""
    by_kind = collections.defaultdict(lambda: [0, 0, 0])
    for op, ns in per_op.items():
        kind, flops = kinds.get(op, ("?", 0))
        by_kind[kind][0] += ns
        by_kind[kind][1] += runs[op]
        by_kind[kind][2] += flops * runs[op]
    return dict(by_kind)


FLAGS = flags.FLAGS


def _shape(arg: str) -> tuple[int, int] | None:
    """'4x1024' -> (4, 1024); None when it is not BxT with positive integers."""
    parts = arg.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_string("shape", "4x1024", "BxT of the train batch")
    flags.DEFINE_integer("threads", 1, "pin to this many cores", lower_bound=1, upper_bound=os.cpu_count())
    flags.DEFINE_integer("depth", 4, "op_name levels per scope", lower_bound=1)
    flags.DEFINE_integer("top", 30, "scopes printed", lower_bound=1)
    flags.DEFINE_multi_string("set", [], "model config override model.FIELD=VALUE (repeatable; glm5_jax.overrides)")
    flags.register_validator("shape", lambda v: _shape(v) is not None, "expected BxT, e.g. 4x1024")


def model_config(sets=()):
    """tools.bench_vs_hf's model with `--set model.FIELD=V` overrides (the one `section.field=value` syntax)."""
    import dataclasses

    from glm5_jax.config import ModelConfig
    from glm5_jax.overrides import apply_overrides
    from tools import bench_vs_hf as bv

    @dataclasses.dataclass(frozen=True)
    class Settable:
        model: ModelConfig

    return apply_overrides(Settable(ModelConfig(**bv.MODEL)), sets).model


@main_wrapper      # a bad --set (OverrideError, ConfigError): one line on stderr, exit 2
def main(argv):
    del argv
    args = FLAGS
    b, t = _shape(args.shape)
    os.sched_setaffinity(0, set(range(args.threads)))

    import jax
    import jax.numpy as jnp

    from glm5_jax.model import init_params
    from glm5_jax.optim import make_optimizer
    from glm5_jax.train.config import TrainConfig
    from glm5_jax.train.state import init_train_state
    from glm5_jax.train.step import make_train_step
    from tools import bench_vs_hf as bv

    cfg = model_config(args.set)
    over = " ".join(args.set)
    tcfg = TrainConfig(batch_size=b, seq_len=t, optimizer="adamw", learning_rate=bv.LR, weight_decay=bv.WD,
                       grad_clip=0.0, mtp_weight=0.0, indexer_loss=None)
    params = init_params(cfg, jax.random.PRNGKey(0))
    tx, _ = make_optimizer("adamw", params, learning_rate=bv.LR, weight_decay=bv.WD, b1=bv.B1, b2=bv.B2,
                           eps=bv.EPS, grad_clip=None)
    state, _ = init_train_state(cfg, tcfg, None, tx, params=params)
    step = make_train_step(cfg, tcfg, tx)
    tok = bv._tokens(b, t + 1, cfg.vocab_size, 7)
    batch = {"tokens": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:]),
             "loss_mask": jnp.ones((b, t), jnp.float32),
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
             "segment_ids": jnp.ones((b, t), jnp.int32)}
    step = step.lower(state, batch).compile()   # one compile: its HLO text names the ops, it runs the steps
    hlo = step.as_text()
    names, kinds = _op_names(hlo), op_kinds(hlo)
    for _ in range(2):
        state, m = step(state, batch)
        jax.block_until_ready(m)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    print(f"# train step B={b} T={t} threads={args.threads} {over or ''}: {time.perf_counter() - t0:.3f} s "
          f"(untraced)", flush=True)

    def run():
        nonlocal state
        state, m = step(state, batch)
        jax.block_until_ready(m)
    per_op, runs = trace_ops(run)
    total = sum(per_op.values())
    scopes = collections.Counter()
    for op, ns in per_op.items():
        scopes[_scope(names.get(op, "?" + re.sub(r"[.\d]+$", "", op)), args.depth)] += ns
    print(f"# traced XLA op time {total / 1e9:.3f} s (summed over threads)")
    for k, ns in scopes.most_common(args.top):
        print(f"{ns / 1e9:8.3f} s {100 * ns / total:5.1f}%  {k}")
    by_kind = kind_table(per_op, runs, kinds)
    mm = bv.matmul_call()
    peak = bv.PEAK_FLOPS / min(bv._timed(mm)[0] for _ in range(3)) / 1e9
    print(f"# by HLO op kind (1024^3 float32 matmul here: {peak:.1f} GFLOP/s)")
    for kind, (ns, n, flops) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])[:args.top]:
        rate = f"  {flops / 1e9:7.2f} GFLOP at {flops / ns:5.1f} GFLOP/s ({100 * flops / ns / peak:3.0f}% of the matmul)" \
            if flops else ""
        print(f"{ns / 1e9:8.3f} s {100 * ns / total:5.1f}%  {kind:24s} x{n:<6d}{rate}")
    dot_ns = sum(v[0] for v in by_kind.values() if v[2])
    dot_flops = sum(v[2] for v in by_kind.values())
    print(f"# ops holding dots: {dot_ns / 1e9:.3f} s for {dot_flops / 1e9:.1f} GFLOP "
          f"({dot_flops / max(dot_ns, 1):.1f} GFLOP/s); all other ops: {(total - dot_ns) / 1e9:.3f} s")
    print("# most expensive single ops")
    for op, ns in per_op.most_common(10):
        print(f"{ns / 1e9:8.3f} s  {op:28s} {names.get(op, '?')[:140]}")


if __name__ == "__main__":
    hugepages.ensure()   # as experiments.run does (glm5_jax.hugepages)
    run_cli(main, define_flags)
