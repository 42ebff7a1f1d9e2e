"""Subprocess of test_data_shard_hosts: one process of a 2-process training run (jax.distributed on
127.0.0.1, gloo) on a sharded directory written by tools.prepare_data.

    python tests/shard_host_worker.py PREPARED WORKDIR NUM_PROCESSES PROCESS_ID PORT STEPS

Trains a tiny model through the train loop on a data:4 mesh from `data.path=PREPARED` and prints one
JSON line: its shards, its train documents, and the token rows of every batch it fed the loop.
"""

import json
import sys
import types

from absl import logging


class Recorder:
    """Records the rows of each batch; forwards everything else (get_state, set_state, select_rows)."""

    def __init__(self, it):
        self.it, self.rows = it, []

    def __next__(self):
        b = next(self.it)
        self.rows += b["tokens"].tolist()
        return b

    def __getattr__(self, name):
        return getattr(self.it, name)


def main():
    logging.set_verbosity(logging.WARNING)
    prepared, workdir, n, i, port, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5]), int(sys.argv[6])
    from experiments.run import make_mesh, start_distributed
    assert start_distributed(f"127.0.0.1:{port}", n, i)
    import jax

    from glm5_jax.config import ModelConfig
    from glm5_jax.data import DataConfig, build_lm_data
    from glm5_jax.train import TrainConfig, train
    data = build_lm_data(DataConfig(path=prepared, vocab_size=512, seq_len=32))
    mc = ModelConfig(vocab_size=512, d_model=32, num_layers=1, index_topk=8, mtp_depth=0)
    tc = TrainConfig(steps=steps, batch_size=8, seq_len=32, ckpt_every=1000, eval_every=1000, log_every=1,
                     warmup_steps=1, learning_rate=1e-2, async_checkpoints=False)
    mesh = make_mesh("data:4", types.SimpleNamespace(model=mc, train=tc))
    it = Recorder(data.train_iter(8, 32, seed=0))
    out = train(mc, tc, it, workdir, mesh=mesh, log=lambda m: None)
    print(json.dumps({"process": jax.process_index(), "shards": list(data.host_shards),
                      "train_documents": data.splits["train"].num_docs, "rows": it.rows,
                      "losses": [r["loss"] for r in out["history"]] if jax.process_index() == 0 else []}), flush=True)


if __name__ == "__main__":
    main()
