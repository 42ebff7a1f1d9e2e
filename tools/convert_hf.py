"""Convert a Hugging Face GLM-5 checkpoint (config.json + safetensors) to an orbax checkpoint.

    python -m tools.convert_hf --hf_dir=PATH --out=DIR [--dtype=bfloat16]

DIR gets `params/` (an orbax StandardCheckpointer tree) and `config.json` (ModelConfig.to_hf()).
`restore(DIR)` reads it back as (ModelConfig, params).
"""

from __future__ import annotations

import json
import os

from absl import app, flags, logging

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("hf_dir", None, "Folder with config.json and model.safetensors (or an index).")
    flags.DEFINE_string("out", None, "Output folder for the orbax checkpoint.")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Cast parameters (default: keep).")


def convert(hf_dir: str, out: str, dtype: str | None = None) -> str:
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from glm5_jax import hf

    config, params = hf.load_checkpoint(hf_dir)
    if dtype:
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)) if x.ndim > 1 else x, params)
        config = config.replace(param_dtype=dtype)
    out = os.path.abspath(out)
    if os.path.exists(os.path.join(out, "params")):
        raise FileExistsError(f"{out}/params already exists; choose another --out (nothing was overwritten)")
    os.makedirs(out, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(out, "params"), jax.tree_util.tree_map(jnp.asarray, params))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config.to_hf(), f, indent=2)
    return out


def restore(path: str):
    import orbax.checkpoint as ocp

    from glm5_jax.config import ModelConfig

    config = ModelConfig.from_hf(os.path.join(path, "config.json"))
    with ocp.StandardCheckpointer() as ckptr:
        params = ckptr.restore(os.path.join(os.path.abspath(path), "params"))
    return config, params


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.hf_dir or not FLAGS.out:
        raise app.UsageError("--hf_dir and --out are required")
    out = convert(FLAGS.hf_dir, FLAGS.out, FLAGS.dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
