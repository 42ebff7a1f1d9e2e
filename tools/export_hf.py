"""Write an orbax params checkpoint back to a Hugging Face folder (config.json + safetensors).

    python -m tools.export_hf --checkpoint=ORBAX_DIR --out=DIR [--max_shard_bytes=5000000000] [--mesh=fsdp:8]

ORBAX_DIR is a params checkpoint (config.json + params/, as tools.convert_hf writes it) or a training
run (its workdir, WORKDIR/checkpoints or one step folder: the latest step's params, the model from
WORKDIR/model_config.json; glm5_jax.train.checkpoint.load_params). The params are restored onto the mesh
(default one device) and written one HF tensor at a time
(glm5_jax.hf.save_checkpoint: layer stacks sliced back into `model.layers.<i>.*`, experts per expert,
the MTP layer as `model.layers.<num_layers + k>.*`), so HF -> convert_hf -> export_hf -> HF is
bit-exact. Weights keep the checkpoint's dtype (no FP8 re-quantisation).
"""

from __future__ import annotations

import os

from absl import app, flags, logging

from glm5_jax.cli import main_wrapper, run as run_cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("checkpoint", None, "Params checkpoint (config.json + params/) or a training run's "
                        "workdir / checkpoints folder.")
    flags.DEFINE_string("out", None, "Output folder for config.json + safetensors.")
    flags.DEFINE_integer("max_shard_bytes", 5 * 10**9, "Split the safetensors into files of at most this many "
                         "bytes (+ model.safetensors.index.json); 0 = one model.safetensors.")
    flags.DEFINE_string("mesh", None, "Device mesh AXIS:N,... to restore onto (default: one device).")


def export(checkpoint: str, out: str, max_shard_bytes: int | None = 5 * 10**9, mesh=None, progress: bool = False) -> str:
    """progress: a heartbeat while orbax restores, then bytes and tensors written (rate, ETA) on stderr."""
    from glm5_jax import hf
    from glm5_jax.sharding import make_mesh
    from tools.convert_hf import restore

    out = os.path.abspath(out)
    if os.path.exists(os.path.join(out, "config.json")):
        raise FileExistsError(f"{out} already holds a checkpoint (config.json); choose another --out")
    from glm5_jax.progress import heartbeat
    with heartbeat(f"restoring {checkpoint}", quiet=not progress):
        config, params = restore(checkpoint, make_mesh(mesh) if isinstance(mesh, str) else mesh)
    hf.save_checkpoint(config, params, out, max_shard_bytes=max_shard_bytes or None, progress=progress)
    return out


@main_wrapper      # a Glm5Error (bad checkpoint, mesh, setting): one line on stderr, exit 2
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.checkpoint or not FLAGS.out:
        raise app.UsageError("--checkpoint and --out are required")
    print(f"wrote {export(FLAGS.checkpoint, FLAGS.out, FLAGS.max_shard_bytes, FLAGS.mesh, progress=True)}")


if __name__ == "__main__":
    run_cli(main, define_flags)
