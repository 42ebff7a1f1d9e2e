"""Side by side with Hugging Face: the same tiny GLM-5, same weights, timed in glm5_jax and in the
transformers reference (`GlmMoeDsaForCausalLM`, eager attention, float32) on the same threads.

Usage::

    python -m tools.bench_vs_hf [--threads=1,2] [--seq=1024,2048,4096] [--train=4x1024,1x4096] [--reps=3]
                                [--hugepages=off|on] [--json]

Needs the `.[fixtures]` extra (torch, transformers). One run:

* builds the model config below (vocab 8192, d 256, 4 layers: 1 dense + 3 MoE with 8 routed experts
  top-2 and 1 shared expert, DSA top-128, no MTP), initialises glm5_jax parameters, writes them as
  an HF checkpoint (glm5_jax.hf.save_checkpoint) and loads that one folder on both sides
  (glm5_jax.hf.load_checkpoint / `from_pretrained`), so both run the same weights;
* per thread count n starts two worker processes, one per side, each pinned to the first n cores
  (sched_setaffinity) and limited to n compute threads (torch.set_num_threads; XLA's CPU client
  sizes its pools from the affinity mask, and n=1 also turns Eigen's intra-op pool off). Each
  timing reports cpu_util = process CPU seconds / wall seconds, which shows whether the pin holds;
* checks the two sides compute the same thing: logits on a fixed [1, 256] batch (DSA selects
  128 of up to 256 keys there, so the sparse path is exercised) and the first train step's loss;
* times forward (B=1, T in --seq) and one AdamW train step per --train shape (default B=4 T=1024
  and B=1 T=4096: the same tokens per step, at the issue's long-context length where DSA's T*K
  attention meets HF's T^2 masked dense one; loss + backward + update), alternating the two sides
  rep by rep so that both see the same machine load, and keeps the best of --reps (after one
  warm-up call that also compiles the JAX side).

Prints one line per measurement and the ratios HF time / glm5_jax time, beside the FLOP limit of that
ratio: the model FLOPs (glm5_jax.flops) at the rate of a 1024^3 float32 matmul measured in the JAX
worker in the same run (floor_s), and HF time / floor_s (speedup_limit: what a step running every
FLOP at matmul peak would show). --json makes the last line
{"results": [{"threads", "what", "seq_len", "batch", "hf_s", "jax_s", "speedup", "floor_s",
"speedup_limit", ...}], "check": {...}}.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import flags

from glm5_jax.cli import run as run_cli

MODEL = dict(vocab_size=8192, d_model=256, num_layers=4, ffn_dim=512, attention="dsa", num_heads=4,
             q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
             index_topk=128, index_n_heads=8, index_head_dim=32, num_experts=8, num_shared_experts=1,
             experts_per_tok=2, moe_ffn_dim=128, first_k_dense=1, mtp_depth=0)
TRAIN_SHAPES = ((4, 1024), (1, 4096))   # default (batch, seq_len) of the timed train steps (--train)
CHECK_T = 256
LR, B1, B2, WD, EPS = 1e-3, 0.9, 0.95, 0.1, 1e-8


def _tokens(b, t, vocab, seed):
    import numpy as np
    return np.random.default_rng(seed).integers(0, vocab, (b, t), dtype=np.int32)


PEAK_FLOPS = 2 * 1024 ** 3   # one matmul_call()


def matmul_call():
    """A compiled 1024^3 float32 matmul, as a timed callable: the rate a perfectly matmul-bound step
    could reach here (PEAK_FLOPS per call)."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((1024, 1024), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(a))
    return lambda: jax.block_until_ready(f(a))


# ----------------------------------------------------------------------------- workers
class _JaxSide:
    def __init__(self, ckpt, train_shapes):
        import jax
        import jax.numpy as jnp

        from glm5_jax.hf import load_checkpoint
        from glm5_jax.model import forward
        from glm5_jax.optim import make_optimizer
        from glm5_jax.train.config import TrainConfig
        from glm5_jax.train.state import init_train_state
        from glm5_jax.train.step import make_train_step

        self.jax, self.jnp = jax, jnp
        self.cfg, params = load_checkpoint(ckpt)
        self.params = jax.device_put(params)
        self.fwd = jax.jit(lambda p, t: forward(self.cfg, p, t))
        # AdamW as HF users run it (torch.optim.AdamW): constant lr, no clipping, the same betas
        b0, t0 = train_shapes[0]   # the step retraces per batch shape; the config's shape is nominal
        tcfg = TrainConfig(batch_size=b0, seq_len=t0, optimizer="adamw", learning_rate=LR,
                           weight_decay=WD, grad_clip=0.0, mtp_weight=0.0, indexer_loss=None)
        tx, _ = make_optimizer("adamw", params, learning_rate=LR, weight_decay=WD, b1=B1, b2=B2, eps=EPS,
                               grad_clip=None)
        self.state, _ = init_train_state(self.cfg, tcfg, None, tx, params=params)
        self.step = make_train_step(self.cfg, tcfg, tx)

    def batch(self, b, t):
        jnp = self.jnp
        tok = _tokens(b, t + 1, self.cfg.vocab_size, 7)
        return {"tokens": jnp.asarray(tok[:, :-1]), "targets": jnp.asarray(tok[:, 1:]),
                "loss_mask": jnp.ones((b, t), jnp.float32),
                "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                "segment_ids": jnp.ones((b, t), jnp.int32)}

    def logits(self, t):
        import numpy as np
        return np.asarray(self.fwd(self.params, self.jnp.asarray(_tokens(1, t, self.cfg.vocab_size, 3))))

    def forward(self, t):
        x = self.jnp.asarray(_tokens(1, t, self.cfg.vocab_size, 5))
        return lambda: self.jax.block_until_ready(self.fwd(self.params, x))

    def peak(self):
        return matmul_call()

    def train(self, b, t):
        batch = self.batch(b, t)

        def run():
            self.state, metrics = self.step(self.state, batch)
            return float(metrics["loss"])
        return run


class _HFSide:
    def __init__(self, ckpt):
        import torch
        from transformers import GlmMoeDsaForCausalLM

        self.torch = torch
        self.model = GlmMoeDsaForCausalLM.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float32)
        self.vocab = self.model.config.vocab_size
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)

    def _run(self, tokens):
        self.model.eval()
        with self.torch.no_grad():
            return self.model(input_ids=self.torch.from_numpy(tokens).long(), use_cache=False).logits

    def logits(self, t):
        return self._run(_tokens(1, t, self.vocab, 3)).float().numpy()

    def forward(self, t):
        x = _tokens(1, t, self.vocab, 5)
        return lambda: self._run(x)

    def train(self, b, t):
        torch = self.torch
        tok = torch.from_numpy(_tokens(b, t + 1, self.vocab, 7)).long()
        x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()

        def run():
            self.model.train()
            logits = self.model(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, self.vocab), y.reshape(-1))
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return float(loss.detach())
        return run


def _timed(fn):
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    return wall, (time.process_time() - c0) / max(wall, 1e-9), out


def worker(side: str, ckpt: str, threads: int, train_shapes=TRAIN_SHAPES) -> None:
    """Line protocol on stdin/stdout: {"op": "logits"|"forward"|"train", ...} -> one JSON reply.
    Pins itself to the first `threads` cores before torch / jax start their thread pools."""
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    if side == "hf":
        import torch
        torch.set_num_threads(threads)
        impl = _HFSide(ckpt)
    else:
        impl = _JaxSide(ckpt, train_shapes)
    out = sys.stdout
    sys.stdout = sys.stderr   # library prints must not break the protocol
    fns = {}
    from glm5_jax.hugepages import enabled
    out.write(json.dumps({"ready": True, "affinity": sorted(os.sched_getaffinity(0)), "hugepages": enabled()}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "logits":
            import numpy as np
            path = os.path.join(req["dir"], f"{side}_logits.npy")
            np.save(path, impl.logits(req["seq"]))
            reply = {"path": path}
        else:
            key = (req["op"], req.get("seq"), req.get("batch"))
            if key not in fns:
                fns[key] = (impl.forward(req["seq"]) if req["op"] == "forward" else
                            impl.train(req["batch"], req["seq"]) if req["op"] == "train" else impl.peak())
            wall, util, val = _timed(fns[key])
            reply = {"s": wall, "cpu_util": util, "value": val if isinstance(val, float) else None}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# ----------------------------------------------------------------------------- orchestration
class _Proc:
    def __init__(self, side, ckpt, threads, train_shapes, hugepages_on: bool):
        from glm5_jax import hugepages
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), JAX_PLATFORMS="cpu")
        # both sides in the same host-allocator environment (glm5_jax.hugepages): the machine's
        # default, or glibc's large allocations as transparent huge pages
        env = (hugepages.env_with_hugepages(dict(env, GLM5_HUGEPAGES="1")) if hugepages_on
               else hugepages.env_without_hugepages(env))
        if threads == 1:   # XLA CPU: no Eigen intra-op pool at all on one thread
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false "
                                "intra_op_parallelism_threads=1").strip()
        self.p = subprocess.Popen([sys.executable, "-m", "tools.bench_vs_hf", "--worker", side, "--ckpt", ckpt,
                                   "--threads", str(threads), "--train", _shapes_arg(train_shapes)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=env, text=True)
        self.hello = self._read()

    def _read(self):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with code {self.p.wait()}")
        return json.loads(line)

    def ask(self, **req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def make_checkpoint(path: str):
    import jax

    from glm5_jax.config import ModelConfig
    from glm5_jax.hf import save_checkpoint
    from glm5_jax.model import init_params

    cfg = ModelConfig(**MODEL)
    params = init_params(cfg, jax.random.PRNGKey(0))
    save_checkpoint(cfg, params, path)
    return cfg


def model_flops(what: str, seq_len: int, batch: int) -> float:
    """Model FLOPs of one call as glm5_jax.flops counts them (matmuls with the active parameters,
    attention over the top-k keys, the indexer's scores over the causal half): the train step is
    forward + backward (the indexer forward only), the forward 2 x params + attention + indexer."""
    from glm5_jax.config import ModelConfig
    from glm5_jax.flops import estimate

    cfg = ModelConfig(**MODEL)
    est = estimate(cfg, seq_len)
    if what == "train":
        per_token = est["train_flops_per_token"]
    else:
        per_token = (2 * (est["active_params"] - cfg.vocab_size * cfg.d_model) + est["attention_flops_per_token_fwd"]
                     + est["indexer_flops_per_token_fwd"])
    return per_token * seq_len * batch


def _shapes_arg(shapes):
    return ",".join(f"{b}x{t}" for b, t in shapes)


def _parse_shapes(arg):
    """'4x1024,1x4096' -> ((4, 1024), (1, 4096)); ValueError naming the bad item."""
    shapes = []
    for item in arg.split(","):
        parts = item.lower().split("x") if item else []
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"each shape must be BATCHxSEQ_LEN with positive integers, got {item!r}")
        shapes.append((int(parts[0]), int(parts[1])))
    return tuple(shapes)


def _valid(parse):
    """A flag validator from a parser that raises ValueError: the parser's message is the flag's error."""
    def check(value):
        try:
            parse(value)
        except ValueError as e:
            raise flags.ValidationError(str(e)) from None
        return True
    return check


def _parse_threads(arg):
    avail = len(os.sched_getaffinity(0))
    threads = [int(x) if x.isdigit() else 0 for x in arg.split(",") if x]
    if not threads or any(n < 1 or n > avail for n in threads):
        raise ValueError(f"each count must be in 1..{avail} (cores available)")
    return threads


def _best(results):
    return min(results, key=lambda r: r["s"])


def run(threads_list, seqs, reps, log, train_shapes=TRAIN_SHAPES, hugepages_on: bool = False):
    import numpy as np

    results, check = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        make_checkpoint(ckpt)
        for n in threads_list:
            hf, jx = (_Proc(side, ckpt, n, train_shapes, hugepages_on) for side in ("hf", "jax"))
            try:
                if not check:
                    check["hugepages"] = [bool(jx.hello.get("hugepages")), bool(hf.hello.get("hugepages"))]
                    log(f"host allocator, transparent huge pages (glm5_jax.hugepages): jax "
                        f"{'on' if check['hugepages'][0] else 'off'}, hf {'on' if check['hugepages'][1] else 'off'}")
                    lj = np.load(jx.ask(op="logits", seq=CHECK_T, dir=tmp)["path"])
                    lh = np.load(hf.ask(op="logits", seq=CHECK_T, dir=tmp)["path"])
                    check["logits_max_abs_diff"] = float(np.max(np.abs(lj - lh)))
                    check["logits_std"] = float(np.std(lh))
                    check["argmax_agree"] = float(np.mean(lj.argmax(-1) == lh.argmax(-1)))
                    # a discrete choice (indexer / router top-k) on a near-tie may flip between the
                    # two float32 implementations: that moves a few positions, not all of them
                    check["positions_within_1e-4"] = float(np.mean(np.max(np.abs(lj - lh), -1) < 1e-4))
                    log(f"check T={CHECK_T}: logits max |jax - hf| = {check['logits_max_abs_diff']:.2e} "
                        f"(logit std {check['logits_std']:.3f}), positions within 1e-4 {check['positions_within_1e-4']:.3f}, "
                        f"argmax agreement {check['argmax_agree']:.3f}")
                # the FLOP limit: model FLOPs at the best matmul rate these cores give right now,
                # measured between the timed calls so that it sees the same load
                peak_s = min(jx.ask(op="peak")["s"] for _ in range(reps + 1))
                peak = PEAK_FLOPS / peak_s
                log(f"threads={n}: 1024^3 float32 matmul {peak / 1e9:.1f} GFLOP/s (XLA, best of {reps + 1})")
                jobs = [dict(op="forward", seq=t) for t in seqs] + [dict(op="train", batch=b, seq=t)
                                                                    for b, t in train_shapes]
                for job in jobs:
                    runs = {"hf": [], "jax": []}
                    for r in range(reps + 1):          # rep 0 warms up (and compiles the JAX side)
                        for name, proc in (("hf", hf), ("jax", jx)) if r % 2 else (("jax", jx), ("hf", hf)):
                            ans = proc.ask(**job)
                            if r:
                                runs[name].append(ans)
                            elif job is jobs[len(seqs)]:
                                # the first train step of all starts from the shared weights on both sides
                                check.setdefault("first_loss", {})[name] = ans["value"]
                    bh, bj = _best(runs["hf"]), _best(runs["jax"])
                    row = dict(threads=n, what=job["op"], seq_len=job["seq"], batch=job.get("batch", 1),
                               hf_s=bh["s"], jax_s=bj["s"],
                               speedup=bh["s"] / bj["s"], hf_cpu_util=bh["cpu_util"], jax_cpu_util=bj["cpu_util"],
                               hf_all_s=[a["s"] for a in runs["hf"]], jax_all_s=[a["s"] for a in runs["jax"]])
                    flops = model_flops(row["what"], row["seq_len"], row["batch"])
                    row.update(model_gflop=flops / 1e9, matmul_gflops=peak / 1e9, floor_s=flops / peak,
                               speedup_limit=bh["s"] / (flops / peak), jax_fraction_of_peak=flops / peak / bj["s"])
                    results.append(row)
                    log(f"threads={n} {row['what']:7s} B={row['batch']} T={row['seq_len']:5d}: hf {bh['s']:.3f}s "
                        f"(cpu {bh['cpu_util']:.2f}) jax {bj['s']:.3f}s (cpu {bj['cpu_util']:.2f}) -> "
                        f"{row['speedup']:.2f}x; {row['model_gflop']:.1f} GFLOP, floor {row['floor_s']:.3f}s "
                        f"(limit {row['speedup_limit']:.2f}x, jax at {100 * row['jax_fraction_of_peak']:.0f}% of peak)")
                    if job["op"] == "train" and "first_loss" in check and "loss_abs_diff" not in check:
                        fl = check["first_loss"]
                        check["loss_abs_diff"] = abs(fl["hf"] - fl["jax"])
                        log(f"check: first train-step loss hf {fl['hf']:.6f} jax {fl['jax']:.6f}")
            finally:
                hf.close()
                jx.close()
    return results, check


FLAGS = flags.FLAGS


def define_flags() -> None:
    """This CLI's flags (defined only when run as a program, so importing the module has no side effect)."""
    flags.DEFINE_string("threads", "1,2", "comma-separated thread counts (each pinned to that many cores)")
    flags.DEFINE_string("seq", "1024,2048,4096", "forward sequence lengths")
    flags.DEFINE_integer("reps", 3, "timed repetitions per side (best kept)", lower_bound=1)
    flags.DEFINE_string("train", _shapes_arg(TRAIN_SHAPES),
                        "comma-separated train step shapes BATCHxSEQ_LEN (e.g. 4x1024,1x4096)")
    flags.DEFINE_enum("hugepages", "off", ["off", "on"],
                      "host allocator of BOTH workers: off = the machine's default environment; on = glibc's "
                      "large allocations as transparent huge pages (glm5_jax.hugepages; what experiments.run "
                      "sets for itself). HF eager gains more from it than glm5_jax (docs/training.md)")
    flags.DEFINE_bool("json", False, "last line: one JSON object with the results")
    flags.DEFINE_enum("worker", None, ["hf", "jax"], "(internal) run as the timing worker of one side")
    flags.DEFINE_string("ckpt", None, "(internal) the worker's checkpoint")
    flags.register_validator("threads", _valid(_parse_threads))
    flags.register_validator("seq", lambda v: all(x.isdigit() and int(x) > 0 for x in v.split(",")),
                             "must be a comma list of positive integers")
    flags.register_validator("train", _valid(_parse_shapes))
    flags.register_validator("hugepages", lambda v: v == "off" or _hugepages_supported(),
                             "on needs Linux, glibc >= 2.35 and transparent huge pages not 'never'")


def _hugepages_supported() -> bool:
    from glm5_jax.hugepages import supported
    return supported()


def main(argv):
    del argv
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    train_shapes = _parse_shapes(FLAGS.train)
    hugepages_on = FLAGS.hugepages == "on"
    if FLAGS.worker:
        worker(FLAGS.worker, FLAGS.ckpt, int(FLAGS.threads), train_shapes)
        return 0
    threads = _parse_threads(FLAGS.threads)
    seqs = [int(x) for x in FLAGS.seq.split(",") if x]
    results, check = run(threads, seqs, FLAGS.reps, lambda s: print(s, flush=True), train_shapes, hugepages_on)
    if check.get("positions_within_1e-4", 1.0) < 0.9 or check.get("loss_abs_diff", 0.0) > 1e-3:
        print("WARNING: the two sides disagree beyond float32 round-off at most positions: not the same "
              "computation", flush=True)
    if FLAGS.json:
        print(json.dumps({"results": results, "check": check, "model": MODEL}))
    return 0


if __name__ == "__main__":
    run_cli(main, define_flags)
