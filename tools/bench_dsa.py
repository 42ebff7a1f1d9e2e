"""DSA benchmark (not a test): ONE DSA attention block as the model runs it against the best dense
attention for the same layer, forward and forward+backward, time and compiled temp memory.

    python -m tools.bench_dsa [--seq=4096,8192,16384,32768] [--scale=2] [--json] [--device]

Shapes: GLM-5's attention layer (64 heads; latent 512 + rope 64; per head q/k 192 + 64, v 256;
indexer 32 heads x 128; top-2048) with every width -- head counts and per-head / latent dims --
divided by ONE factor `--scale` (default 2: the smallest factor whose T=32K programs fit this
24 GiB, 2-core machine -- compiled temp at 32K: DSA 0.9 / 2.3 / 8.5 GiB at scale 8 / 4 / 2, dense
4.4 GiB at 2; the top-k and T are not widths). Dividing all widths by one factor leaves every FLOP
ratio below unchanged, but not the MQA form's intensity (H heads per gathered row, 32 at scale 2,
64 in GLM-5): on CPU the speed-up grows as the scale falls (at T=32K, CPU time: 0.80x at 8, 1.61x
at 4, 2.1-2.2x at 2; docs/model.md, "DSA benchmark"). The whole default sweep takes ~25 min.

DSA block = what `glm5_jax.attention.mla.MLAttention` runs in DSA's sparse stage: the lightning
indexer's exact top-k (`kernels.indexer_topk`, no gradient: the top-k is not differentiable, the
indexer trains on its own KL) and `mla.dsa_attention` (the value declared the key's prefix: each selected row
gathered once) -- W_UK absorbed into the queries, every head
attending the same gathered [latent | k_rope] rows (MQA, Hk = 1, 576/scale wide, value = the
latent), W_UV applied after attention. Gradients w.r.t. q_nope, q_rope, latent, k_rope and kv_b's
kernel. Dense = the expanded form the model runs for plain MLA / the dense warm-up (H heads of
256/scale q/k and 256/scale v; the cheaper dense form per pair), with the W_UK/W_UV expansion
(kv_b) included, by the fastest dense implementation here: `pallas_kernels.dense.flash_attention`
(custom VJP, linear memory) and `core.causal_attention` (the model's), `--dense` picks; a dense
program whose compiled temp memory exceeds --mem_cap GiB is skipped, not run.

FLOP limit = dense FLOPs / DSA FLOPs (multiply-adds), causal halves counted: dense T^2/2 pairs at
H*(dn+dr+dv) per pair; DSA: the indexer's T^2/2 pairs at Hi*Di plus T*K pairs at
H*((r+dr) + r) (MQA: 2.1x the dense per-pair cost at GLM-5 widths); backward = 2.5x forward
(both backwards recompute the scores: 5 matmuls against 2) for attention, none for the indexer.
About 3.3x fwd+bwd at T=32K. The linear-in-T projections (absorption, kv_b) are not counted.
Memory = compiled.memory_analysis().temp_size_in_bytes (XLA's temp buffer; inputs and outputs
excluded). `--json`: the last line is {"config": {...}, "results": [{"seq_len", "speedup_fwd",
"speedup_fwd_bwd", "flop_limit_fwd", "flop_limit", "dsa_temp_bytes", "dense_temp_bytes", ...}]}.
"""

from __future__ import annotations

import json
import time

import numpy as np

import jax
import jax.numpy as jnp
from absl import flags

from glm5_jax.attention import kernels
from glm5_jax.attention.core import causal_attention
from glm5_jax.attention.mla import dsa_attention
from pallas_kernels.dense import flash_attention
from glm5_jax import hugepages
from glm5_jax.cli import run as run_cli

# GLM-5's attention layer (config glm5): heads, indexer heads, latent, rope, nope, v, indexer dim
GLM5 = dict(h=64, hi=32, r=512, dr=64, dn=192, dv=256, di=128)


def widths(scale: int) -> dict:
    bad = {k: v for k, v in GLM5.items() if v % scale}
    if scale < 1 or bad:
        raise ValueError(f"--scale={scale} must divide every GLM-5 width {GLM5}; allowed: 1, 2, 4, 8, 16, 32")
    return {k: v // scale for k, v in GLM5.items()}


def flop_limits(t: int, k: int, w: dict) -> tuple[float, float]:
    """(fwd, fwd+bwd) upper bound on the DSA speed-up from multiply-add counts (see module doc)."""
    h, hi, r, dr, dn, dv, di = (w[n] for n in ("h", "hi", "r", "dr", "dn", "dv", "di"))
    dense = 0.5 * t * t * h * (dn + dr + dv)
    indexer = 0.5 * t * t * hi * di
    sparse = t * min(k, t) * h * ((r + dr) + r)
    return dense / (indexer + sparse), 3.5 * dense / (indexer + 3.5 * sparse)


def _compile(fn, args):
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    temp = int(getattr(mem, "temp_size_in_bytes", -1)) if mem is not None else -1
    return compiled, temp, time.perf_counter() - t0


def _time(compiled, args, reps, warmup):
    """-> (best wall seconds, CPU seconds of that run): on a shared, loaded machine the process CPU
    time (all threads) is the steadier measure of work; the wall time is what a user waits."""
    for _ in range(warmup):
        jax.block_until_ready(compiled(*args))
    best = (float("inf"), float("nan"))
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(compiled(*args))
        best = min(best, (time.perf_counter() - t0, time.process_time() - c0))
    return best


def make_inputs(t: int, w: dict, seed: int = 0):
    rng = np.random.default_rng(seed)
    h, hi, r, dr, dn, dv, di = (w[n] for n in ("h", "hi", "r", "dr", "dn", "dv", "di"))
    a = lambda *shape, s=1.0: jnp.asarray(rng.normal(size=shape) * s, jnp.float32)
    attn = (a(1, t, h, dn), a(1, t, h, dr), a(1, t, r), a(1, t, dr), a(r, h, dn + dv, s=r ** -0.5))
    index = (a(1, t, hi, di, s=di ** -0.5), a(1, t, di), a(1, t, hi, s=hi ** -0.5))
    return attn, index


def sparse_block(w: dict, impl: str):
    """The MQA sparse attention over given indices: `mla.dsa_attention` itself (W_UK absorbed, the
    value declared the key's prefix: each selected row gathered once, one dK scatter per slot)."""
    dn, scale = w["dn"], (w["dn"] + w["dr"]) ** -0.5

    def attn(q_nope, q_rope, latent, k_rope, kv_b, idx):
        return dsa_attention(q_nope, q_rope, latent, k_rope, kv_b[..., :dn], kv_b[..., dn:], idx,
                             scale=scale, impl=impl)
    return attn


def dsa_block(w: dict, topk: int, impl: str):
    attn = sparse_block(w, impl)

    def fwd(q_nope, q_rope, latent, k_rope, kv_b, q_idx, k_idx, wts):
        idx = kernels.indexer_topk(q_idx, k_idx, wts, topk, impl=impl)
        return attn(q_nope, q_rope, latent, k_rope, kv_b, idx)
    return fwd


def dsa_parts(w: dict, topk: int, impl: str):
    """The DSA block's two parts alone (--parts): the indexer top-k, and the MQA sparse attention over
    fixed indices (the top-k of the same inputs, computed once outside the timed program)."""
    attn = sparse_block(w, impl)

    def topk_only(q_nope, q_rope, latent, k_rope, kv_b, q_idx, k_idx, wts):
        return kernels.indexer_topk(q_idx, k_idx, wts, topk, impl=impl).astype(jnp.float32)

    def attn_only(q_nope, q_rope, latent, k_rope, kv_b, q_idx, k_idx, wts, indices):
        return attn(q_nope, q_rope, latent, k_rope, kv_b, indices)
    return topk_only, attn_only


def dense_block(w: dict, which: str):
    h, dn, dr = w["h"], w["dn"], w["dr"]
    scale = (dn + dr) ** -0.5

    def fwd(q_nope, q_rope, latent, k_rope, kv_b, q_idx, k_idx, wts):
        b, t = latent.shape[:2]
        kvb = jnp.einsum("btr,rhd->bthd", latent, kv_b)
        q = jnp.concatenate([q_nope, q_rope], -1)
        k = jnp.concatenate([kvb[..., :dn], jnp.broadcast_to(k_rope[:, :, None], (b, t, h, dr))], -1)
        v = kvb[..., dn:]
        if which == "flash":
            return flash_attention(q, k, v, scale=scale)
        return causal_attention(q, k, v, scale=scale)
    return fwd


def fwd_bwd(fn):
    def loss(*args):
        return jnp.sum(fn(*args))
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def run(args, w, seqs, impl, dense_impls):
    """Time and measure every program at every T -> one result row per T."""
    cap = args.mem_cap * 2 ** 30
    passes = args.passes.split(",")
    results = []
    for t in seqs:
        attn, index = make_inputs(t, w, seed=t)
        inputs = attn + index
        lim_f, lim_fb = flop_limits(t, args.topk, w)
        row = dict(seq_len=t, flop_limit_fwd=round(lim_f, 3), flop_limit=round(lim_fb, 3))
        progs = [("dsa", dsa_block(w, args.topk, impl))] + [(f"dense_{d}", dense_block(w, d)) for d in dense_impls]
        if args.parts:
            topk_only, attn_only = dsa_parts(w, args.topk, impl)
            progs += [("dsa_topk", topk_only), ("dsa_attn", attn_only)]
        progs = [(n, f) for n, f in progs if args.only is None or n in args.only.split(",")]
        for name, fn in progs:
            if name == "dsa_attn":   # over the top-k of these inputs, computed once, untimed
                inputs = inputs + (jax.block_until_ready(jax.jit(topk_only)(*inputs).astype(jnp.int32)),)
            for kind, f in (("fwd", fn), ("fwd_bwd", fwd_bwd(fn))):
                if kind not in passes or (name == "dsa_topk" and kind == "fwd_bwd"):
                    continue
                try:
                    compiled, temp, t_c = _compile(f, inputs)
                except Exception as e:  # noqa: BLE001 -- report and go on with the other programs
                    print(f"T={t} {name} {kind}: compile FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row[f"{name}_{kind}_temp_bytes"] = temp
                if temp > cap:
                    print(f"T={t:6d} {name:11s} {kind:7s} skipped: temp {temp / 2**30:.1f} GiB > --mem_cap",
                          flush=True)
                    continue
                sec, cpu = _time(compiled, inputs, args.reps, args.warmup)
                row[f"{name}_{kind}_s"] = round(sec, 4)
                row[f"{name}_{kind}_cpu_s"] = round(cpu, 4)
                print(f"T={t:6d} {name:11s} {kind:7s} {sec:9.3f} s (cpu {cpu:8.2f} s)  temp {temp / 2**20:9.1f} MiB"
                      f"  (compile {t_c:.1f} s)", flush=True)
        for kind, lim in (("fwd", lim_f), ("fwd_bwd", lim_fb)):
            if kind not in passes:
                continue
            timed = {d: row[f"dense_{d}_{kind}_s"] for d in dense_impls if f"dense_{d}_{kind}_s" in row}
            if timed and f"dsa_{kind}_s" in row:
                best = min(timed, key=timed.get)
                row[f"dense_impl_{kind}"] = best
                row[f"speedup_{kind}"] = round(timed[best] / row[f"dsa_{kind}_s"], 3)
                row[f"speedup_{kind}_cpu"] = round(row[f"dense_{best}_{kind}_cpu_s"] / row[f"dsa_{kind}_cpu_s"], 3)
                if kind == "fwd_bwd":
                    row["dsa_temp_bytes"] = row["dsa_fwd_bwd_temp_bytes"]
                    row["dense_temp_bytes"] = row[f"dense_{best}_fwd_bwd_temp_bytes"]
                print(f"T={t:6d} {kind:7s} speed-up {row[f'speedup_{kind}']:.2f}x wall, "
                      f"{row[f'speedup_{kind}_cpu']:.2f}x cpu (dense: {best})  "
                      f"FLOP limit {lim:.2f}x", flush=True)
        results.append(row)
    return results


FLAGS = flags.FLAGS
PASSES = ("fwd", "fwd_bwd")
DENSE = ("flash", "core")
PROGRAMS = ("dsa", "dense_flash", "dense_core", "dsa_topk", "dsa_attn")


def _comma_list_of(allowed):
    return lambda v: v is None or bool(v) and set(v.split(",")) <= set(allowed)


def _scale_ok(scale: int) -> bool:
    try:
        return bool(widths(scale))
    except ValueError:
        return False


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect);
    every bad value is refused by a validator when the flags are parsed (exit 2, glm5_jax.cli)."""
    flags.DEFINE_string("seq", "4096,8192,16384,32768", "comma list of sequence lengths T")
    flags.DEFINE_integer("scale", 2, "divide every GLM-5 width by this factor "
                         "(2: the smallest whose T=32K programs fit a 24 GiB machine)")
    flags.DEFINE_integer("topk", 2048, "keys each query attends to", lower_bound=1)
    flags.DEFINE_integer("reps", 1, "timed runs (the best is kept)", lower_bound=1)
    flags.DEFINE_integer("warmup", 1, "untimed runs first (programs are compiled ahead)", lower_bound=0)
    flags.DEFINE_string("passes", "fwd_bwd", "comma list of fwd, fwd_bwd (default: the "
                        "training pass only; fwd adds ~1/3 to the run)")
    flags.DEFINE_string("dense", "core", "dense implementations to try, comma list of flash, "
                        "core (default core: the model's dense attention; on CPU it IS dense.flash_attention, "
                        "at the model's block, so 'flash' only re-times it at block 512)")
    flags.DEFINE_float("mem_cap", 12.0, "GiB; skip a program whose temp exceeds it")
    flags.DEFINE_bool("device", False, "run on the default accelerator backend (DSA kernels: attention_impl='pallas')")
    flags.DEFINE_enum("impl", None, ["xla", "pallas"], "DSA kernels (default: xla on CPU, pallas with --device)")
    flags.DEFINE_bool("parts", False, "also time the indexer top-k and the sparse "
                      "attention alone (dsa_topk fwd, dsa_attn fwd / fwd_bwd)")
    flags.DEFINE_string("only", None, f"comma list of programs to run ({', '.join(PROGRAMS)}; default: all)")
    flags.DEFINE_bool("json", False, "last line: one JSON object with every result")
    flags.register_validator("seq", lambda v: all(x.isdigit() and int(x) >= 1 for x in v.split(",")),
                             "must be a comma list of positive integers")
    flags.register_validator("scale", _scale_ok, f"must divide every GLM-5 width {GLM5}; allowed: 1, 2, 4, 8, 16, 32")
    flags.register_validator("passes", _comma_list_of(PASSES), f"allowed: a comma list of {', '.join(PASSES)}")
    flags.register_validator("dense", _comma_list_of(DENSE), f"allowed: a comma list of {', '.join(DENSE)}")
    flags.register_validator("only", _comma_list_of(PROGRAMS), f"allowed: a comma list of {', '.join(PROGRAMS)}")
    flags.register_validator("device", lambda v: not v or jax.default_backend() != "cpu",
                             "no accelerator backend here (jax.default_backend() == 'cpu')")


def main(argv):
    del argv
    args = FLAGS
    backend = jax.default_backend() if args.device else "cpu"
    impl = args.impl or ("pallas" if args.device else "xla")
    dense_impls = args.dense.split(",")
    w = widths(args.scale)
    seqs = [int(s) for s in args.seq.split(",")]
    cfg = dict(backend=backend, devices=jax.device_count(), scale=args.scale, topk=args.topk, impl=impl,
               dtype="float32", batch=1, **w)
    print(f"# DSA block vs dense, GLM-5 widths / {args.scale}: {cfg}", flush=True)
    with jax.default_device(jax.devices(backend)[0]):
        results = run(args, w, seqs, impl, dense_impls)

    print("\n| T | pass | dense (impl) s | DSA s | speed-up (wall / cpu) | FLOP limit | dense temp MiB "
          "| DSA temp MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for kind, lim in (("fwd", "flop_limit_fwd"), ("fwd_bwd", "flop_limit")):
            if f"speedup_{kind}" not in r:
                continue
            best = r[f"dense_impl_{kind}"]
            print(f"| {r['seq_len']} | {kind.replace('_', '+')} | {r[f'dense_{best}_{kind}_s']:.2f} ({best}) "
                  f"| {r[f'dsa_{kind}_s']:.2f} | {r[f'speedup_{kind}']:.2f}x / {r[f'speedup_{kind}_cpu']:.2f}x "
                  f"| {r[lim]:.2f}x "
                  f"| {r[f'dense_{best}_{kind}_temp_bytes'] / 2**20:.0f} | {r[f'dsa_{kind}_temp_bytes'] / 2**20:.0f} |")
    if args.json:
        print(json.dumps({"config": cfg, "results": results}))


if __name__ == "__main__":
    hugepages.ensure()   # as experiments.run does (glm5_jax.hugepages)
    run_cli(main, define_flags)
