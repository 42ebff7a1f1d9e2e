"""Convert a Hugging Face GLM-5 checkpoint (config.json + safetensors) to an orbax params checkpoint.

    python -m tools.convert_hf --hf_dir=PATH --out=DIR [--dtype=bfloat16] [--mesh=fsdp:8]

The safetensors are streamed onto the mesh (default: one device) shard by shard (glm5_jax.hf.
read_params; FP8 tensors are dequantised) and written by orbax, each device its own shards.
DIR gets `params/` (an orbax StandardCheckpointer tree) and `config.json` (ModelConfig.to_hf(), its
torch_dtype the params' dtype). `restore(DIR)` reads it back as (ModelConfig, params);
Progress (bytes and arrays read, rate, ETA) goes to stderr. `python -m tools.export_hf` writes it back
to safetensors; `experiments.run --init_from=DIR` trains from it.
"""

from __future__ import annotations

from absl import app, flags, logging

from glm5_jax.cli import main_wrapper, run as run_cli

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("hf_dir", None, "Folder with config.json and model.safetensors (or an index).")
    flags.DEFINE_string("out", None, "Output folder for the orbax checkpoint.")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Parameter dtype (default: the checkpoint's torch_dtype).")
    flags.DEFINE_string("mesh", None, "Device mesh AXIS:N,... to read onto (default: one device).")


def convert(hf_dir: str, out: str, dtype: str | None = None, mesh=None, progress: bool = False) -> str:
    """progress: bytes and arrays read (rate, ETA) on stderr, then a heartbeat while orbax writes."""
    from glm5_jax import hf
    from glm5_jax.sharding import make_mesh, single_device_mesh
    from glm5_jax.train.checkpoint import save_params

    mesh = make_mesh(mesh) if isinstance(mesh, str) else (mesh or single_device_mesh())
    config, params = hf.load_checkpoint(hf_dir, mesh=mesh, dtype=dtype, progress=progress)
    from glm5_jax.progress import heartbeat
    with heartbeat(f"writing the orbax checkpoint {out}", quiet=not progress):
        return save_params(out, config, params)


def restore(path: str, mesh=None):
    """(ModelConfig, params) of a params checkpoint, on `mesh` (default one device)."""
    from glm5_jax.train.checkpoint import checkpoint_config, load_params

    config = checkpoint_config(path)
    return config, load_params(path, config, mesh)


@main_wrapper      # a Glm5Error (bad checkpoint, mesh, setting): one line on stderr, exit 2
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.hf_dir or not FLAGS.out:
        raise app.UsageError("--hf_dir and --out are required")
    out = convert(FLAGS.hf_dir, FLAGS.out, FLAGS.dtype, FLAGS.mesh, progress=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_cli(main, define_flags)
