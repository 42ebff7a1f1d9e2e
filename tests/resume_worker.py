"""Subprocess used by test_train_resume: trains a tiny model in WORKDIR for STEPS steps (slowly)."""

import json
import sys
import time

from absl import logging


class Slow:
    def __init__(self, it, delay):
        self.it, self.delay = it, delay

    def __next__(self):
        time.sleep(self.delay)
        return next(self.it)

    def get_state(self):
        return self.it.get_state()

    def set_state(self, s):
        self.it.set_state(s)


def main():
    logging.set_verbosity(logging.WARNING)
    workdir, steps, delay, cache = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    from glm5_jax.config import ModelConfig
    from glm5_jax.data import DataConfig, build_lm_data
    from glm5_jax.train import TrainConfig, train
    data = build_lm_data(DataConfig(vocab_size=512, seq_len=32, max_files=20, cache_dir=cache,
                                    tokenizer_train_bytes=200_000, retrieval_fraction=0.25,
                                    retrieval_min_distance=8, retrieval_pairs=1))
    mc = ModelConfig(vocab_size=data.tokenizer.vocab_size, d_model=32, num_layers=2, index_topk=8, mtp_depth=1)
    tc = TrainConfig(steps=steps, batch_size=4, seq_len=32, ckpt_every=3, eval_every=100, log_every=1,
                     warmup_steps=2, learning_rate=1e-2)
    out = train(mc, tc, Slow(data.train_iter(4, 32, seed=3), delay), workdir, log=lambda m: None)
    print(json.dumps({"final_loss": out["history"][-1]["loss"]}))


if __name__ == "__main__":
    main()
