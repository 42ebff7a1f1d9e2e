"""Subprocess of test_multiprocess: one process of a (possibly multi-process) training run.

    python tests/mp_worker.py WORKDIR STEPS DELAY CACHE NUM_PROCESSES PROCESS_ID PORT MESH

Joins the run through experiments.run's start-up (jax.distributed on 127.0.0.1:PORT when
NUM_PROCESSES > 1), builds the mesh over every process's devices with experiments.run.make_mesh, and
trains a tiny model with the real data pipeline through the train loop (each process reads its rows of
every global batch); evaluates at the end. XLA_FLAGS sets the fake CPU devices per process.
"""

import json
import sys
import time
import types

from absl import logging


class Slow:
    """Sleeps before each batch (so the test can kill the run mid-way); forwards everything else."""

    def __init__(self, it, delay):
        self.it, self.delay = it, delay

    def __next__(self):
        time.sleep(self.delay)
        return next(self.it)

    def __getattr__(self, name):          # get_state, set_state, select_rows, batch_size
        return getattr(self.it, name)


def main():
    logging.set_verbosity(logging.WARNING)
    workdir, steps, delay, cache = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    num_processes, process_id, port, mesh_spec = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
    from experiments.run import make_mesh, start_distributed
    joined = start_distributed(f"127.0.0.1:{port}", num_processes, process_id)   # before any device use
    import jax
    assert joined == (num_processes > 1) and jax.process_count() == num_processes
    from glm5_jax.config import ModelConfig
    from glm5_jax.data import DataConfig, build_lm_data
    from glm5_jax.train import TrainConfig, evaluate, train
    data = build_lm_data(DataConfig(vocab_size=512, seq_len=32, max_files=20, cache_dir=cache,
                                    tokenizer_train_bytes=200_000, retrieval_fraction=0.25,
                                    retrieval_min_distance=8, retrieval_pairs=1))
    mc = ModelConfig(vocab_size=data.tokenizer.vocab_size, d_model=32, num_layers=2, index_topk=8, mtp_depth=1)
    tc = TrainConfig(steps=steps, batch_size=8, seq_len=32, ckpt_every=4, eval_every=1000, log_every=1,
                     warmup_steps=2, learning_rate=1e-2)
    mesh = make_mesh(mesh_spec, types.SimpleNamespace(model=mc, train=tc))
    assert mesh.devices.size == 4 and len(jax.local_devices()) == 4 // num_processes
    eval_batches = list(data.eval_batches(8, 32, max_batches=2))
    out = train(mc, tc, Slow(data.train_iter(8, 32, seed=3), delay), workdir,
                log=lambda m: print(m, flush=True) if "preempted" in m else None, mesh=mesh,
                eval_fn=lambda p: evaluate(mc, p, eval_batches))
    print(json.dumps({"process": jax.process_index(), "final": out["final"],
                      "rows": [r["step"] for r in out["history"]]}), flush=True)


if __name__ == "__main__":
    main()
