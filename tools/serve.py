"""OpenAI-compatible server for a checkpoint (glm5_jax.serve).

    python -m tools.serve --model=PATH [--tokenizer=PATH] [--host=127.0.0.1] [--port=8000]
        [--served_model_name=NAME] [--max_running=8] [--max_model_len=2048] [--speculative=none|mtp]
        [--kv_cache_tokens=N] [--memory_fraction=0.9] [--page_size=16] [--max_num_batched_tokens=K]
        [--prefix_cache=radix|none]
        [--dtype=auto|float32|bfloat16] [--mesh=AXIS:N,...]

--mesh serves on a device mesh (a pod slice, or 8 fake CPU devices with
XLA_FLAGS=--xla_force_host_platform_device_count=8): the weights are read straight into the serving layout
(glm5_jax.sharding.SERVE_RULES), the cache slots are split over data x fsdp x expert (max_batch must divide),
the MoE runs expert-parallel (docs/inference.md, "Sharding for serving"). Over several processes (a multi-host
slice) start the same command on every host with GLM5_COORDINATOR_ADDRESS / GLM5_NUM_PROCESSES / GLM5_PROCESS_ID
(or GLM5_DISTRIBUTED=auto on a TPU VM): process 0 serves HTTP and schedules, the others follow its steps.

PATH: a Hugging Face folder (config.json + safetensors [+ tokenizer.json]), an experiments.run workdir
or a params checkpoint (tools.convert_hf's config.json + params/); give --tokenizer when PATH has no
tokenizer.json / *.model. Endpoints: GET /health, /v1/models, /metrics; POST /v1/completions,
/v1/chat/completions (docs/inference.md, "Serving").

Progress (loading the tokenizer and weights, building the engine, the warm-up's compiles with a heartbeat)
goes to stderr; then one line on stdout, `serving MODEL on http://HOST:PORT`, with the port the server
bound (the free one it was given with --port=0), once it accepts connections.
"""

from __future__ import annotations

import asyncio
import os
import signal

import jax
from absl import app, flags, logging

from glm5_jax import progress
from glm5_jax.cli import main_wrapper, run

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("model", None, "Checkpoint: HF folder, experiments.run workdir or params checkpoint.")
    flags.DEFINE_string("tokenizer", None, "tokenizer.json / sentencepiece .model (default: the one in --model).")
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
    flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port).")
    flags.DEFINE_string("served_model_name", None, "Model name in the API (default: the folder's name).")
    flags.DEFINE_integer("max_batch", 8, "Requests running at once (alias of --max_running).")
    flags.DEFINE_integer("max_running", None, "Requests running at once (default --max_batch).")
    flags.DEFINE_integer("kv_cache_tokens", None, "Positions of the paged KV cache (default: what fits in "
                         "--memory_fraction of device memory after the weights; on CPU max_running x max_model_len).")
    flags.DEFINE_float("memory_fraction", 0.9, "Share of device memory the weights and the page pool may take.")
    flags.DEFINE_integer("page_size", 16, "Tokens a KV page.")
    flags.DEFINE_integer("max_num_batched_tokens", None, "Token rows a step runs: decodes first, then prefill "
                         "chunks (default max_running + one prefill chunk).")
    flags.DEFINE_enum("prefix_cache", "radix", ["radix", "none"], "Share cached prompt prefixes by reference.")
    flags.DEFINE_integer("max_model_len", 2048, "Context length (prompt + generated) per request.")
    flags.DEFINE_integer("max_queue", 256, "Requests waiting for a slot before 429.")
    flags.DEFINE_enum("speculative", "none", ["none", "mtp"], "MTP self-speculative decoding.")
    flags.DEFINE_integer("num_draft", 2, "Draft tokens per verification with --speculative=mtp.")
    flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], "auto: the checkpoint's own dtype.")
    flags.DEFINE_string("mesh", None, "Serving mesh AXIS:N,... over data, fsdp, expert, tensor (default: one device): "
                        "cache slots split over data x fsdp x expert, experts over expert, heads over tensor.")
    flags.DEFINE_enum("chat_mode", "interleaved", ["interleaved", "preserved", "turn"], "Chat template thinking mode.")
    flags.DEFINE_bool("warmup", True, "Compile every prefill bucket before listening.")


def build(model: str, *, tokenizer=None, served_model_name=None, max_batch=8, max_model_len=2048, max_queue=256,
          speculative="none", num_draft=2, dtype="auto", mesh=None, chat_mode="interleaved", warmup=False,
          page_size=16, kv_cache_tokens=None, memory_fraction=0.9, max_num_batched_tokens=None, prefix_cache="radix"):
    """-> OpenAIServer (engine started) for a checkpoint path."""
    from glm5_jax.data.chat import ChatFormatError, ChatTemplate
    from glm5_jax.serve.engine import Engine
    from glm5_jax.serve.loading import load_model, load_serving_tokenizer
    from glm5_jax.serve.metrics import EngineMetrics
    from glm5_jax.serve.openai_api import OpenAIServer
    from glm5_jax.sharding import make_mesh

    progress.note(f"loading the tokenizer of {model}")
    tok = load_serving_tokenizer(model, tokenizer)
    mesh = make_mesh(mesh) if isinstance(mesh, str) else mesh
    with progress.heartbeat(f"loading the weights of {model}"):
        config, params = load_model(model, dtype=dtype, mesh=mesh)
    if tok.vocab_size > config.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary is {config.vocab_size}")
    try:
        stop = ChatTemplate(tok).stop_ids
    except ChatFormatError:
        stop = (tok.eos_id,)
    name = served_model_name or os.path.basename(os.path.normpath(model))
    from glm5_jax.infer.runtime import cache_tokens_that_fit
    if kv_cache_tokens is None:
        kv_cache_tokens = cache_tokens_that_fit(config, mesh, memory_fraction,
                                                int(num_draft) if speculative == "mtp" else 0)
    kw = dict(page_size=page_size, kv_cache_tokens=kv_cache_tokens, max_num_batched_tokens=max_num_batched_tokens,
              prefix_reuse=prefix_cache == "radix")
    if speculative == "mtp":
        kw["speculative"] = int(num_draft)
    progress.note(f"starting the engine (max_batch {max_batch}, max_model_len {max_model_len})")
    engine = Engine(config, params, max_batch=max_batch, max_model_len=max_model_len, tokenizer=tok,
                    stop_token_ids=stop, max_queue=max_queue, metrics=EngineMetrics(name), mesh=mesh, **kw)
    if warmup and engine.programs.mesh.devices.flat[0].process_index == jax.process_index():
        with progress.heartbeat("warm-up: compiling every prefill bucket and the decode step"):
            engine.warmup()       # on process 0 only: the other processes of the mesh follow its operations
    return OpenAIServer(engine, tok, model_name=name, chat_mode=chat_mode)


@main_wrapper      # a Glm5Error (bad checkpoint, mesh, setting): one line on stderr, exit 2
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.model:
        raise app.UsageError("--model is required")
    # several processes (a multi-host slice: GLM5_COORDINATOR_ADDRESS / GLM5_NUM_PROCESSES / GLM5_PROCESS_ID,
    # or auto on a TPU VM): process 0 serves HTTP and schedules, the others run its device operations
    from glm5_jax.parallel.distributed import maybe_initialize
    maybe_initialize()
    server = build(FLAGS.model, tokenizer=FLAGS.tokenizer, served_model_name=FLAGS.served_model_name,
                   max_batch=FLAGS.max_running or FLAGS.max_batch, max_model_len=FLAGS.max_model_len,
                   max_queue=FLAGS.max_queue, page_size=FLAGS.page_size, kv_cache_tokens=FLAGS.kv_cache_tokens,
                   memory_fraction=FLAGS.memory_fraction, max_num_batched_tokens=FLAGS.max_num_batched_tokens,
                   prefix_cache=FLAGS.prefix_cache,
                   speculative=FLAGS.speculative, num_draft=FLAGS.num_draft, dtype=FLAGS.dtype, mesh=FLAGS.mesh,
                   chat_mode=FLAGS.chat_mode, warmup=FLAGS.warmup)
    if jax.process_index() > 0:
        server.engine.follow()
        return
    try:
        asyncio.run(serve_forever(server, FLAGS.host, FLAGS.port,
                                  f"(max_batch {FLAGS.max_batch}, max_model_len {FLAGS.max_model_len})"))
    finally:
        server.engine.shutdown()


async def serve_forever(server, host: str, port: int, extra: str = "") -> None:
    """Listen on host:port, print `serving MODEL on http://HOST:PORT` with the bound port (--port=0 asks the
    OS for a free one), then serve until SIGINT / SIGTERM."""
    from aiohttp import web
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_host, bound_port = runner.addresses[0][:2]
    print(f"serving {server.model_name} on http://{bound_host}:{bound_port} {extra}".rstrip(), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    run(main, define_flags)
