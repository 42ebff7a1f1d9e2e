"""Parameter counts and training FLOPs per token of a preset, from the real parameter tree.

    python -m tools.estimate --preset=glm5 [--seq_len=4096] [--json]

The counting lives in glm5_jax.flops (the training loop's MFU uses the same FLOPs per token); see
its docstring for what is counted.
"""

from __future__ import annotations

import json

from absl import flags

from glm5_jax.cli import main_wrapper, run as run_cli
from glm5_jax.config import preset
from glm5_jax.flops import estimate

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("preset", "tiny", "Model preset: tiny | small | glm5.")
    flags.DEFINE_integer("seq_len", 4096, "Training sequence length for the attention FLOPs.")
    flags.DEFINE_bool("json", False, "Print JSON instead of a table.")


@main_wrapper      # a Glm5Error (bad checkpoint, mesh, setting): one line on stderr, exit 2
def main(argv):
    del argv
    r = estimate(preset(FLAGS.preset), FLAGS.seq_len)
    r["preset"] = FLAGS.preset
    if FLAGS.json:
        print(json.dumps(r))
        return
    print(f"preset {FLAGS.preset}: total {r['total_params']:,} ({r['total_params'] / 1e9:.2f}B) parameters without MTP, "
          f"active {r['active_params']:,} ({r['active_params'] / 1e9:.2f}B) per token")
    print(f"  MTP layer(s): {r['mtp_params']:,} ({r['mtp_params'] / 1e9:.2f}B), reported apart")
    print(f"  training FLOPs per token at seq_len {r['seq_len']}: {r['train_flops_per_token']:.3e} "
          f"(of which MTP blocks {r['mtp_train_flops_per_token']:.3e}; attention fwd "
          f"{r['attention_flops_per_token_fwd']:.3e}, indexer fwd {r['indexer_flops_per_token_fwd']:.3e})")


if __name__ == "__main__":
    run_cli(main, define_flags)
