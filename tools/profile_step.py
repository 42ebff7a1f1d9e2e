"""Where one train step's time goes: a jax.profiler trace of the project's train step, per HLO op,
summed by the op's source scope (its `op_name` metadata) and split into forward (F) and backward (B).

    python -m tools.profile_step [--shape=4x1024] [--threads=1] [--depth=4] [--top=30] [--set field=value ...]

Model: tools.bench_vs_hf's tiny GLM-5 (vocab 8192, d 256, 4 layers, DSA top-128, 8 experts top-2) with
its AdamW step, so the shares explain that benchmark's train-step ratio; `--set` overrides model
config fields (e.g. `--set dsa_short_dense=0`). The process is pinned to the first `--threads`
cores. Prints the untraced step time, then the `--top` scopes (op_name cut to `--depth` levels
after the jit / jvp / while wrappers, digits folded to #) with seconds and share of the traced XLA
op time, then the single most expensive ops.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import os
import re
import tempfile
import time
from glm5_jax import hugepages

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4x1024", help="BxT of the train batch")
    ap.add_argument("--threads", type=int, default=1, help="pin to this many cores")
    ap.add_argument("--depth", type=int, default=4, help="op_name levels per scope")
    ap.add_argument("--top", type=int, default=30, help="scopes printed")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="model config override")
    args = ap.parse_args(argv)
    try:
        b, t = (int(x) for x in args.shape.lower().split("x"))
    except ValueError:
        ap.error(f"--shape={args.shape!r}; expected BxT, e.g. 4x1024")
    if not 1 <= args.threads <= os.cpu_count():
        ap.error(f"--threads={args.threads}; allowed: 1..{os.cpu_count()}")
    os.sched_setaffinity(0, set(range(args.threads)))

    import jax
    import jax.numpy as jnp

    from glm5_jax.config import ModelConfig
    from glm5_jax.model import init_params
    from glm5_jax.optim import make_optimizer
    from glm5_jax.train.config import TrainConfig
    from glm5_jax.train.state import init_train_state
    from glm5_jax.train.step import make_train_step
    from tools import bench_vs_hf as bv

    over = {}
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for item in args.set:
        k, _, v = item.partition("=")
        if k not in fields:
            ap.error(f"--set {item!r}: ModelConfig has no field {k!r}")
        over[k] = type(getattr(ModelConfig(), k))(v) if not isinstance(getattr(ModelConfig(), k), bool) \
            else v.lower() in ("1", "true", "yes")
    cfg = ModelConfig(**{**bv.MODEL, **over})
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
    names = _op_names(step.as_text())
    for _ in range(2):
        state, m = step(state, batch)
        jax.block_until_ready(m)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    print(f"# train step B={b} T={t} threads={args.threads} {over or ''}: {time.perf_counter() - t0:.3f} s "
          f"(untraced)", flush=True)

    tdir = tempfile.mkdtemp()
    with jax.profiler.trace(tdir):
        state, m = step(state, batch)
        jax.block_until_ready(m)
    data = jax.profiler.ProfileData.from_file(glob.glob(f"{tdir}/**/*.xplane.pb", recursive=True)[0])
    per_op = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:     # the XLA CPU client's / Eigen pool's threads
                continue
            for ev in line.events:         # loops and calls span their bodies' ops: not counted
                if not ev.name.startswith(("while", "conditional", "call", "ThunkExecutor", "end:", "Threadpool")):
                    per_op[ev.name] += ev.duration_ns
    total = sum(per_op.values())
    scopes = collections.Counter()
    for op, ns in per_op.items():
        scopes[_scope(names.get(op, "?" + re.sub(r"[.\d]+$", "", op)), args.depth)] += ns
    print(f"# traced XLA op time {total / 1e9:.3f} s (summed over threads)")
    for k, ns in scopes.most_common(args.top):
        print(f"{ns / 1e9:8.3f} s {100 * ns / total:5.1f}%  {k}")
    print("# most expensive single ops")
    for op, ns in per_op.most_common(10):
        print(f"{ns / 1e9:8.3f} s  {op:28s} {names.get(op, '?')[:140]}")


if __name__ == "__main__":
    hugepages.ensure()   # as experiments.run does (glm5_jax.hugepages)
    main()
