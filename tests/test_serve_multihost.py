"""The serving engine over two processes (jax.distributed on 127.0.0.1, gloo collectives, 2 fake CPU
devices each: one 4-device mesh): process 0 schedules and broadcasts each step, process 1 follows
(`Engine.follow`); the greedy tokens and log-probs equal the one-device engine's (1e-5), for a batch of
requests, a prefix-reusing second turn and a weight push (update_weights on both processes); process 1
returns when process 0 shuts the engine down."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import sys
    pid, port = int(sys.argv[1]), int(sys.argv[2])
    from glm5_jax.parallel.distributed import maybe_initialize
    assert maybe_initialize(f"127.0.0.1:{port}", 2, pid)
    import jax, numpy as np
    from glm5_jax import model, sharding
    from glm5_jax.config import ModelConfig
    from glm5_jax.serve.engine import Engine, SamplingParams
    assert jax.process_count() == 2 and len(jax.devices()) == 4
    cfg = ModelConfig(attention="dsa", num_layers=2, index_topk=4, num_experts=4, experts_per_tok=2, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    params2 = jax.tree.map(lambda a: a * 1.01, params)
    kw = dict(max_batch=4, max_model_len=40, prefill_chunk=8)
    eng = Engine(cfg, params, mesh=sharding.make_mesh("data:2,expert:2"), **kw)
    G = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10], [3, 4], [9] * 11, [1, 2, 3]]
    if pid == 1:
        eng.update_weights(params2, 1)      # every process hands over its copy; process 0 decides when
        eng.follow()
        print("FOLLOWER DONE", flush=True)
        sys.exit(0)
    ref = Engine(cfg, params, **kw)           # one device (process 0's first)
    def check(got, want, what):
        for p, q in zip(got, want):
            assert p.tokens == q.tokens, (what, p.tokens, q.tokens)
            assert np.abs(np.asarray(p.logprobs) - np.asarray(q.logprobs)).max() <= 1e-5, what
    a = eng.generate(prompts, G)
    check(a, ref.generate(prompts, G), "batch")
    turn2 = prompts[0] + a[0].tokens + [4, 4]
    b = eng.generate([turn2], G)[0]
    assert b.reused_tokens >= len(prompts[0]), b.reused_tokens
    check([b], ref.generate([turn2], G), "turn 2")
    eng.update_weights(params2, 1)
    ref.update_weights(params2, 1)
    c = eng.generate(prompts[:2], G)
    assert all(v == 1 for h in c for v in h.versions)
    check(c, ref.generate(prompts[:2], G), "pushed weights")
    ref.shutdown()
    eng.shutdown()
    print("LEADER OK", flush=True)
""")


@pytest.mark.slow      # ~40 s: two processes start jax.distributed and compile every engine program
def test_two_process_engine_equals_one_device_engine(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0 and "LEADER OK" in outs[0], outs[0][-5000:]
    assert procs[1].returncode == 0 and "FOLLOWER DONE" in outs[1], outs[1][-5000:]


@pytest.mark.slow      # ~35 s: two tools.serve processes start jax.distributed and compile
def test_serve_cli_over_two_processes_answers_like_the_one_device_model(tmp_path):
    """`python -m tools.serve --mesh=data:2,expert:2` started on two processes (GLM5_* environment): process 0
    answers the openai client with the greedy completion of the one-device model; process 1 follows and
    exits when process 0 is stopped."""
    import signal
    import time
    import urllib.request

    import jax
    import openai

    from glm5_jax import hf, model
    from glm5_jax.config import ModelConfig
    from glm5_jax.data.tokenizer import train_hf_tokenizer
    from glm5_jax.infer import generate

    d = str(tmp_path)
    tok = train_hf_tokenizer(["Hello world, this is a tiny model answering questions.\n"] * 40, 300,
                             os.path.join(d, "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=2, num_experts=4, experts_per_tok=2, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    hf.save_checkpoint(cfg, params, d)
    prompt = tok.encode("Hello world, this")
    want = tok.decode(generate(cfg, params, [prompt], max_new_tokens=6, temperature=0.0).tokens[0].tolist())
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    procs = []
    for i in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, GLM5_HUGEPAGES="0",
                   XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2",
                   GLM5_COORDINATOR_ADDRESS=f"127.0.0.1:{ports[0]}", GLM5_NUM_PROCESSES="2", GLM5_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, "-m", "tools.serve", f"--model={d}", f"--port={ports[1]}",
                                       "--mesh=data:2,expert:2", "--max_batch=4", "--max_model_len=32",
                                       "--served_model_name=tiny", "--nowarmup"], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    url = f"http://127.0.0.1:{ports[1]}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2)
                break
            except Exception:
                assert all(p.poll() is None for p in procs), [p.communicate()[0][-3000:] for p in procs]
                time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
        assert got.choices[0].text == want, (got.choices[0].text, want)
        procs[0].send_signal(signal.SIGINT)
        assert procs[1].wait(120) == 0, procs[1].communicate()[0][-3000:]
    finally:
        for p in procs:
            p.kill()
