"""DSA benchmark (not a test): dense causal flash attention vs DSA (XLA reference path) vs DSA
(Pallas kernels; interpret mode on CPU), forward and forward+backward, time and peak temp memory.

    python -m tools.bench_dsa [--seq 4096,8192,16384,32768] [--topk 512]

Widths keep GLM-5's proportion: indexer multiply-adds per (query, key) pair = Hi*Di = 1/8 of
attention's H*(Dq+Dv). Default: the issue's example, attention H=16 heads x 128 (MQA, Hk=1, as
DSA's absorbed MLA) and indexer Hi=4 x 128, batch 1 (`--heads 4 --head_dim 64 --idx_heads 1
--idx_dim 64` is the narrow variant, where per-pair overheads -- selection, gathers -- weigh more;
BUILD_NOTES reports both).

"DSA fwd" = indexer top-k + sparse attention forward; "DSA fwd+bwd" = indexer top-k (no grad, as the
indexer is trained by its own loss) + sparse attention forward and backward (grads of q, k, v).
Memory = compiled.memory_analysis().temp_size_in_bytes of the jitted function (XLA's temp buffer
for that program; arguments and outputs excluded). FLOP limit = dense FLOPs / DSA FLOPs with
the causal halves counted (dense fwd T^2/2 pairs, bwd 2.5x fwd; indexer T^2/2 pairs at 1/8 width;
sparse T*K pairs), i.e. the best possible speed-up.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels import dsa
from pallas_kernels import reference as ref
from pallas_kernels.dense import flash_attention


def _timeit(fn, args, reps):
    lowered = jax.jit(fn).lower(*args)
    t0 = time.perf_counter()
    compiled = lowered.compile()
    t_compile = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    temp = getattr(mem, "temp_size_in_bytes", float("nan")) if mem is not None else float("nan")
    jax.block_until_ready(compiled(*args))  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - t0)
    return best, temp, t_compile


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", default="4096,8192,16384,32768")
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--idx_heads", type=int, default=4)
    ap.add_argument("--idx_dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--skip", default=None,
                    help="comma list of: dense,xla,pallas (default: pallas on CPU, where the "
                         "kernels run in interpret mode and their time means nothing; none elsewhere)")
    ap.add_argument("--recall", action="store_true", help="also measure approx-mode recall")
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seq.split(",")]
    h, d, hi, di, kk = args.heads, args.head_dim, args.idx_heads, args.idx_dim, args.topk
    if args.skip is None:
        args.skip = "pallas" if jax.default_backend() == "cpu" else ""
    skip = set(filter(None, args.skip.split(",")))
    bad = skip - {"dense", "xla", "pallas"}
    if bad:
        ap.error(f"--skip: unknown {sorted(bad)}; allowed: dense, xla, pallas")
    print(f"backend={jax.default_backend()} devices={jax.device_count()} B=1 H={h} Hk=1 "
          f"Dq=Dv={d} Hi={hi} Di={di} K={kk}; indexer/attention MAC ratio = "
          f"{hi * di}/{h * 2 * d} = {hi * di / (h * 2 * d):.4f}", flush=True)
    scale = d ** -0.5
    rows = []
    for t in seqs:
        rng = np.random.default_rng(t)
        q = jnp.asarray(rng.normal(size=(1, t, h, d)), jnp.float32)
        k = jnp.asarray(rng.normal(size=(1, t, 1, d)), jnp.float32)
        v = jnp.asarray(rng.normal(size=(1, t, 1, d)), jnp.float32)
        qi = jnp.asarray(rng.normal(size=(1, t, hi, di)) * di ** -0.5, jnp.float32)
        ki = jnp.asarray(rng.normal(size=(1, t, di)), jnp.float32)
        wi = jnp.asarray(rng.normal(size=(1, t, hi)) * hi ** -0.5, jnp.float32)
        args_all = (q, k, v, qi, ki, wi)

        def dense_f(q, k, v, qi, ki, wi):
            return flash_attention(q, k, v, scale=scale)

        def make_dsa(topk_fn, attn_fn):
            def fwd(q, k, v, qi, ki, wi):
                idx = topk_fn(qi, ki, wi)
                return attn_fn(q, k, v, idx)
            return fwd

        xla = make_dsa(lambda a, b_, c: ref.indexer_topk(a, b_, c, kk),
                       lambda q, k, v, i: ref.sparse_attention(q, k, v, i, scale=scale))
        pal = make_dsa(lambda a, b_, c: dsa.indexer_topk(a, b_, c, kk),
                       lambda q, k, v, i: dsa.sparse_attention(q, k, v, i, scale=scale))

        def fb(fn):
            def loss(q, k, v, qi, ki, wi):
                return jnp.sum(fn(q, k, v, qi, ki, wi))
            return jax.grad(loss, argnums=(0, 1, 2))

        # FLOP model (multiply-adds x 2), causal halves counted
        a_pair = 2 * h * 2 * d
        dense_fwd = 0.5 * t * t * a_pair
        idx_cost = 0.5 * t * t * 2 * hi * di
        sparse_fwd = t * min(kk, t) * a_pair
        lim_f = dense_fwd / (idx_cost + sparse_fwd)
        lim_fb = 3.5 * dense_fwd / (idx_cost + 3.5 * sparse_fwd)
        res = {}
        for name, fn in (("dense", dense_f), ("xla", xla), ("pallas", pal)):
            if name in skip:
                continue
            for kind, f in (("fwd", fn), ("fwd+bwd", fb(fn))):
                try:
                    sec, temp, tc = _timeit(f, args_all, args.reps)
                except Exception as e:  # noqa: BLE001
                    print(f"T={t} {name} {kind}: FAILED {type(e).__name__}: {e}", flush=True)
                    continue
                res[(name, kind)] = (sec, temp)
                print(f"T={t:6d} {name:6s} {kind:8s} {sec:9.3f} s  temp {temp / 2**20:9.1f} MiB"
                      f"  (compile {tc:.1f} s)", flush=True)
        for kind, lim in (("fwd", lim_f), ("fwd+bwd", lim_fb)):
            dn = res.get(("dense", kind))
            for name in ("xla", "pallas"):
                r = res.get((name, kind))
                if dn and r:
                    rows.append((t, kind, name, dn[0], r[0], dn[0] / r[0], lim, dn[1], r[1]))
        if args.recall:
            exact = np.asarray(jax.jit(lambda a, b_, c: dsa.indexer_topk(a, b_, c, kk))(qi, ki, wi))
            for nb in (2 * -(-kk // 128), 4 * -(-kk // 128)):
                appr = np.asarray(jax.jit(lambda a, b_, c: dsa.indexer_topk(
                    a, b_, c, kk, mode="approx", approx_blocks=nb))(qi, ki, wi))
                hit = tot = 0
                for ti in range(0, t, max(1, t // 512)):
                    e = set(exact[0, ti][exact[0, ti] >= 0].tolist())
                    hit += len(e & set(appr[0, ti].tolist()))
                    tot += len(e)
                print(f"T={t} approx recall (blocks={nb}, bk=128): {hit / max(tot, 1):.4f}",
                      flush=True)
        ub = np.asarray(jax.jit(lambda a, b_, c: dsa.indexer_block_stats(a, b_, c, kk))(qi, ki, wi))
        print(f"T={t} visible key blocks (per query block) = {np.isfinite(ub).mean():.3f} of all",
              flush=True)

    print("\n| T | pass | DSA path | dense s | DSA s | speed-up | FLOP limit | dense temp MiB "
          "| DSA temp MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for t, kind, name, dn, ds, ratio, lim, dm, dsm in rows:
        print(f"| {t} | {kind} | {name} | {dn:.2f} | {ds:.2f} | {ratio:.2f}x | {lim:.1f}x "
              f"| {dm / 2**20:.0f} | {dsm / 2**20:.0f} |")


if __name__ == "__main__":
    main()
