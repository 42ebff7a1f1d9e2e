"""Dropless expert-parallel MoE benchmark (not a test): the cost of sending every routed token in
bounded all-to-all buffers (issue 34) against capacity 1.25, on 8 CPU devices.

    python -m tools.bench_moe_dropless [--mesh=expert:8] [--tokens=256] [--d_model=256] [--ffn=128]
        [--experts=16] [--k=8] [--skew=0.5] [--reps=5] [--json]

ONE routed-expert layer as the model runs it with `moe_impl="a2a"` (`glm5_jax.parallel.ep.a2a_moe`
under a mesh of 8 forced host devices; `--tokens` per device, k choices each), forward+backward (the
gradients w.r.t. tokens, router weights and the three expert matrices), jit-compiled once per
program; the routing is an input, so each program is compiled once and timed on both routings:

- balanced: every device sends exactly tokens*k/ep slots to every device (each expert-axis peer);
- skewed: each slot goes with probability `--skew` to an expert of device 0, otherwise to a uniformly
  random expert (device 0 receives skew + (1 - skew)/ep of every device's slots).

Programs (columns): `dropless` = moe_capacity_factor 0 with rounds of C = `--round_factor` (1.25) x
the mean pair load (the new path: ceil(max pair load / C) rounds), `capacity` = moe_capacity_factor
`--capacity` (1.25: slots beyond C dropped), `worst_case` = moe_capacity_factor 0 with
moe_round_capacity_factor 0 (one round of C = tokens*k slots per pair, the old dropless form).
Printed per routing: best wall seconds of `--reps` timed runs (after `--warmup`), the process CPU
seconds of that run, the rounds, the dropped fraction, compiled temp bytes, and dropless / capacity.
`--json`: the last line is {"config": {...}, "results": [...]}.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):   # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from absl import flags

from glm5_jax import hugepages, sharding
from glm5_jax.cli import main_wrapper, run as run_cli
from glm5_jax.parallel.ep import TOKEN_AXES, a2a_moe
from tools.bench_dsa import _time  # best wall seconds, CPU seconds of that run


def programs(capacity: float, round_factor: float) -> dict:
    """name -> (moe_capacity_factor, moe_round_capacity_factor)."""
    return {"dropless": (0.0, round_factor), "capacity": (capacity, round_factor), "worst_case": (0.0, 0.0)}


def routings(n_dev: int, tokens: int, k: int, experts: int, ep: int, skew: float, seed: int = 0) -> dict:
    """name -> ids [n_dev * tokens, k] (devices hold consecutive blocks of `tokens` tokens)."""
    el = experts // ep
    n = n_dev * tokens
    slot = (np.arange(n)[:, None] * k + np.arange(k)[None, :]) % (tokens * k)       # slot index on its device
    dev = np.arange(n)[:, None] // tokens
    balanced = (slot % ep) * el + (slot // ep + dev) % el                           # exactly tokens*k/ep a pair
    r = np.random.default_rng(seed)
    skewed = np.where(r.random((n, k)) < skew, r.integers(0, el, (n, k)), r.integers(0, experts, (n, k)))
    return {"balanced": balanced.astype(np.int32), "skewed": skewed.astype(np.int32)}


def run(args) -> tuple[dict, list]:
    mesh = sharding.make_mesh(args.mesh)
    sizes = dict(mesh.shape)
    ep, n_dev = sizes["expert"], mesh.size
    if args.experts % ep:
        raise sharding.MeshError(f"--experts={args.experts} must be divisible by the mesh's expert={ep}")
    tok_axes = tuple(a for a in TOKEN_AXES if a in sizes)
    n, d, f, e, k = n_dev * args.tokens, args.d_model, args.ffn, args.experts, args.k
    r = np.random.default_rng(1)
    put = lambda a, spec: jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, spec))
    x = put(r.normal(size=(n, d)), P(tok_axes, None))
    w = put(r.uniform(0.1, 0.5, size=(n, k)), P(tok_axes, None))
    ct = put(r.normal(size=(n, d)), P(tok_axes, None))
    gate, up = (put(r.normal(size=(e, d, f)) * d ** -0.5, P("expert")) for _ in range(2))
    down = put(r.normal(size=(e, f, d)) * f ** -0.5, P("expert"))
    ids = {name: jax.device_put(v, NamedSharding(mesh, P(tok_axes, None)))
           for name, v in routings(n_dev, args.tokens, k, e, ep, args.skew).items()}
    cfg = dict(mesh=sizes, devices=n_dev, tokens_per_device=args.tokens, d_model=d, ffn=f, experts=e, k=k,
               skew=args.skew, capacity=args.capacity, round_factor=args.round_factor, reps=args.reps,
               load_average=os.getloadavg()[0], cpus=os.cpu_count())
    print(f"# one a2a MoE layer fwd+bwd on {n_dev} CPU devices: {cfg}", flush=True)
    results = []
    for name, (cf, rf) in programs(args.capacity, args.round_factor).items():
        def loss(x, w, gate, up, down, ids, ct, cf=cf, rf=rf):
            out, dropped, rounds = a2a_moe(x, w, ids, gate, up, down, num_experts=e, capacity_factor=cf,
                                           round_factor=rf)
            return jnp.sum(out * ct), (dropped, rounds)
        fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True)
        operands = (x, w, gate, up, down, ids["balanced"], ct)
        t0 = time.perf_counter()
        with sharding.use_mesh(mesh):
            compiled = jax.jit(fn).lower(*operands).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
        for routing, rid in ids.items():
            a = (x, w, gate, up, down, rid, ct)
            (_, (dropped, rounds)), _ = compiled(*a)
            wall, cpu = _time(compiled, a, args.reps, args.warmup)
            results.append({"program": name, "routing": routing, "capacity_factor": cf, "round_factor": rf,
                            "wall_s": wall, "cpu_s": cpu, "rounds": float(rounds), "dropped": float(dropped),
                            "temp_bytes": temp, "compile_s": compile_s})
            print(f"  {name:<10} {routing:<8} {wall * 1e3:8.1f} ms (cpu {cpu * 1e3:7.1f} ms)  rounds "
                  f"{float(rounds):.0f}  dropped {float(dropped):.3f}  temp {temp / 2**20:.1f} MiB", flush=True)
    return cfg, results


def format_table(results: list) -> str:
    by = {(r["program"], r["routing"]): r for r in results}
    lines = ["| routing | dropless ms (rounds) | capacity ms (dropped) | worst case ms | dropless / capacity "
             "(wall, cpu) | temp MiB dropless / capacity / worst case |", "|---|---|---|---|---|---|"]
    for routing in ("balanced", "skewed"):
        dl, cp, wc = (by[p, routing] for p in ("dropless", "capacity", "worst_case"))
        lines.append(f"| {routing} | {dl['wall_s'] * 1e3:.1f} ({dl['rounds']:.0f}) | {cp['wall_s'] * 1e3:.1f} "
                     f"({cp['dropped']:.1%}) | {wc['wall_s'] * 1e3:.1f} | {dl['wall_s'] / cp['wall_s']:.2f}x, "
                     f"{dl['cpu_s'] / cp['cpu_s']:.2f}x | {dl['temp_bytes'] / 2**20:.1f} / "
                     f"{cp['temp_bytes'] / 2**20:.1f} / {wc['temp_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_string("mesh", "expert:8", "AXIS:N,... over the 8 devices (expert >= 2)")
    flags.DEFINE_integer("tokens", 256, "tokens per device", lower_bound=1)
    flags.DEFINE_integer("d_model", 256, "model width", lower_bound=1)
    flags.DEFINE_integer("ffn", 128, "expert hidden width (moe_ffn_dim)", lower_bound=1)
    flags.DEFINE_integer("experts", 16, "routed experts", lower_bound=1)
    flags.DEFINE_integer("k", 8, "experts per token", lower_bound=1)
    flags.DEFINE_float("skew", 0.5, "skewed routing: share of slots sent to device 0", lower_bound=0.0, upper_bound=1.0)
    flags.DEFINE_float("capacity", 1.25, "moe_capacity_factor of the dropping program (> 0)")
    flags.DEFINE_float("round_factor", 1.25, "moe_round_capacity_factor of the dropless one (> 0)")
    flags.DEFINE_integer("reps", 5, "timed runs (the best is kept)", lower_bound=1)
    flags.DEFINE_integer("warmup", 1, "untimed runs first", lower_bound=0)
    flags.DEFINE_bool("json", False, "last line: one JSON object with every result")
    for name in ("capacity", "round_factor"):
        flags.register_validator(name, lambda v: v > 0, "must be > 0")


@main_wrapper    # a bad --mesh or --experts for it (MeshError): one line, exit 2
def main(argv):
    del argv
    args = FLAGS
    cfg, results = run(args)
    print()
    print(format_table(results))
    if args.json:
        print(json.dumps({"config": cfg, "results": results}))


if __name__ == "__main__":
    hugepages.ensure()   # as experiments.run does (glm5_jax.hugepages)
    run_cli(main, define_flags)
