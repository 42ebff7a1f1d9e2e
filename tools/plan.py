"""Per-device memory of the train step on a mesh, without the devices.

    python -m tools.plan --preset=glm5 --mesh=fsdp:64,expert:4 [--batch_size N] [--seq_len N]
        [--remat=none|full|offload|dots|dots_no_batch] [--json]
    python -m tools.plan --preset=glm5 --mesh=expert:16,context:8 --batch_size=16 --seq_len=131072 \
        --remat=offload --logits_chunk=1024 --moe_impl=a2a --moe_token_chunk=2048     # tools.aot's 128K row

The mesh has five axes, data, fsdp, expert, context, tensor (glm5_jax.sharding.MESH_AXES): the batch is
split over data*fsdp*expert, each sequence over `context` (seq_len must divide by 2*context), weights'
embed / latent dims over fsdp*expert*context, heads / ffn / vocab over tensor.

`--remat` alone means `--remat=full` (each decoder layer recomputed in the backward pass).

Params and optimizer state are exact (sharded abstract shapes); activations are measured from the
compiled step when the mesh's devices exist (on CPU this tool forces that many host devices for
meshes up to --max_fake_devices and models under 5e9 parameters) and estimated otherwise. See
glm5_jax/parallel/plan.py.
"""

from __future__ import annotations

import json
import math
import os
import sys

from absl import flags

from glm5_jax.cli import main_wrapper, run as run_cli
from glm5_jax.config import REMAT_POLICIES

FLAGS = flags.FLAGS


def define_flags() -> None:
    """Define this CLI's flags (only when run as a program, so modules import side-effect free)."""
    flags.DEFINE_string("preset", "tiny", "Model preset: tiny | small | glm5.")
    flags.DEFINE_string("mesh", "data:1", "Mesh sizes AXIS:N,... over data, fsdp, expert, context, tensor.")
    flags.DEFINE_integer("batch_size", None, "Global batch (sequences); default one per data*fsdp*expert shard.")
    flags.DEFINE_integer("logits_chunk", 0, "TrainConfig.logits_chunk: LM head + CE per chunk of this many tokens "
                         "(0 = whole logits).")
    flags.DEFINE_integer("seq_len", 4096, "Sequence length (split over the context axis: divisible by 2*context).")
    flags.DEFINE_string("optimizer", "adamw", "adamw | muon | muon_split.")
    flags.DEFINE_enum("activations", "auto", ["auto", "measure", "estimate"], "Measure (compile) or estimate.")
    flags.DEFINE_enum("remat", "none", REMAT_POLICIES, "ModelConfig.remat policy to plan with (see glm5_jax.model).")
    flags.DEFINE_string("moe_impl", None, "ModelConfig.moe_impl (default: the preset's).")
    flags.DEFINE_integer("moe_token_chunk", 0, "ModelConfig.moe_token_chunk: a2a MoE dispatch per chunk of this many "
                         "tokens (0 = all at once).")
    flags.DEFINE_integer("max_fake_devices", 64, "Force up to this many CPU devices to measure activations.")
    flags.DEFINE_bool("json", False, "Print JSON.")


def _force_cpu_devices(argv) -> None:
    """Before jax is imported: on CPU, ask for as many host devices as the mesh needs (if few enough)."""
    mesh, preset, acts, cap = "data:1", "tiny", "auto", 64
    for a in argv:
        for name in ("mesh", "preset", "activations", "max_fake_devices"):
            if a.startswith(f"--{name}="):
                val = a.split("=", 1)[1]
                if name == "mesh":
                    mesh = val
                elif name == "preset":
                    preset = val
                elif name == "activations":
                    acts = val
                else:
                    cap = int(val)
    try:
        n = math.prod(int(p.split(":")[1]) for p in mesh.split(",") if ":" in p)
    except ValueError:
        return
    if acts == "estimate" or preset == "glm5" or n < 2 or n > cap or "jax" in sys.modules:
        return
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()


@main_wrapper      # a bad preset, mesh or setting (Glm5Error): one line on stderr, exit 2
def main(argv):
    del argv
    from glm5_jax.config import preset
    from glm5_jax.parallel.plan import format_plan, plan
    cfg = preset(FLAGS.preset, remat=FLAGS.remat, moe_token_chunk=FLAGS.moe_token_chunk,
                 **({"moe_impl": FLAGS.moe_impl} if FLAGS.moe_impl else {}))
    p = plan(cfg, FLAGS.mesh, batch_size=FLAGS.batch_size, seq_len=FLAGS.seq_len, optimizer=FLAGS.optimizer,
             logits_chunk=FLAGS.logits_chunk,
             activations=FLAGS.activations, preset_name=FLAGS.preset)
    print(json.dumps(p, indent=1) if FLAGS.json else format_plan(p))


def _remat_alias(argv: list[str]) -> list[str]:
    """The former boolean flag: `--remat` -> `--remat=full`, `--noremat` -> `--remat=none`
    (`--remat dots`, a value as the next argument, is left to absl)."""
    out = []
    for i, a in enumerate(argv):
        if a == "--remat" and (i + 1 == len(argv) or argv[i + 1] not in REMAT_POLICIES):
            a = "--remat=full"
        out.append("--remat=none" if a == "--noremat" else a)
    return out


if __name__ == "__main__":
    sys.argv = _remat_alias(sys.argv)
    _force_cpu_devices(sys.argv[1:])
    run_cli(main, define_flags)
