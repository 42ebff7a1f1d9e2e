"""Compile-time benchmark (not a test): does jit time stop growing with depth once layers are scanned?

    python -m tools.bench_compile [--layers 4,32] [--seq 64] [--modes scanned,unrolled] [--json]

For each layer count N, `glm5_jax.model.forward` is jit-compiled for `config.preset("tiny",
num_layers=N)` twice in this one process: with the model's default stacking (`scan_layers=True`,
one `nn.scan` per layer stack) and unrolled (`scan_layers=False`, the same stacks traced layer by
layer). Lowering (trace + StableHLO) and XLA compilation are timed separately; inputs are
`jax.ShapeDtypeStruct`s and the parameters come from `model.abstract_params` (eval_shape), so
nothing model-sized is allocated and nothing runs. A throw-away 2-layer compile (one dense and one
MoE layer) first takes the one-time start-up costs (backend, first traces of each module) out of
the first row.

Printed: a table (layers, lower / compile / total seconds per mode) and, per mode, the ratio of
the deepest to the shallowest total (issue 12's target: scanned 32-layer / 4-layer <= 2x; the
unrolled model measured 72.8 s against 18.9 s, 3.9x, before layers were scanned).
"""

from __future__ import annotations

import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
from absl import flags

from glm5_jax import model
from glm5_jax.cli import run as run_cli
from glm5_jax.config import preset

MODES = {"scanned": True, "unrolled": False}


def compile_seconds(num_layers: int, scan_layers: bool, seq: int = 64, batch: int = 1) -> dict:
    """{"lower_s", "compile_s", "total_s"} of jit(model.forward) for the tiny preset at this depth."""
    cfg = preset("tiny", num_layers=num_layers, scan_layers=scan_layers)
    params = nn.unbox(model.abstract_params(cfg))            # ShapeDtypeStructs, nothing allocated
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    fn = jax.jit(lambda p, t: model.forward(cfg, p, t))     # a fresh function: no trace cache hit
    t0 = time.perf_counter()
    lowered = fn.lower(params, tokens)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def run(layers: list[int], modes: list[str], seq: int = 64) -> dict:
    compile_seconds(2, True, seq)                            # start-up costs, not measured
    rows = []
    for n in layers:
        row = {"layers": n}
        for m in modes:
            row[m] = compile_seconds(n, MODES[m], seq)
        rows.append(row)
    lo, hi = min(layers), max(layers)
    by_n = {r["layers"]: r for r in rows}
    ratios = {m: by_n[hi][m]["total_s"] / by_n[lo][m]["total_s"] for m in modes} if hi != lo else {}
    return {"preset": "tiny", "seq": seq, "backend": jax.default_backend(), "rows": rows,
            "ratio_layers": [hi, lo], "ratios": ratios}


def format_table(r: dict) -> str:
    modes = [m for m in MODES if m in r["rows"][0]]
    head = "| layers | " + " | ".join(f"{m} lower s | {m} compile s | {m} total s" for m in modes) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * len(modes))]
    for row in r["rows"]:
        cells = [f"{row[m]['lower_s']:.1f} | {row[m]['compile_s']:.1f} | {row[m]['total_s']:.1f}" for m in modes]
        lines.append(f"| {row['layers']} | " + " | ".join(cells) + " |")
    hi, lo = r["ratio_layers"]
    for m, v in r["ratios"].items():
        lines.append(f"{m}: {hi}-layer / {lo}-layer total compile time = {v:.2f}x")
    return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_list("layers", "4,32", "comma-separated layer counts")
    flags.DEFINE_list("modes", "scanned,unrolled", f"comma-separated subset of {','.join(MODES)}")
    flags.DEFINE_integer("seq", 64, "sequence length of the abstract input (batch 1)", lower_bound=1)
    flags.DEFINE_bool("json", False, "print JSON instead of a table")
    flags.register_validator("layers", lambda v: all(x.isdigit() and int(x) >= 1 for x in v),
                             "must be a comma list of positive integers")
    flags.register_validator("modes", lambda v: set(v) <= set(MODES), f"allowed: a comma list of {', '.join(MODES)}")


def main(argv):
    del argv
    r = run([int(x) for x in FLAGS.layers], FLAGS.modes, FLAGS.seq)
    print(json.dumps(r) if FLAGS.json else format_table(r))


if __name__ == "__main__":
    run_cli(main, define_flags)
