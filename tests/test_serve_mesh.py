"""The serving engine on 8 forced CPU devices (a subprocess: the device count is fixed at JAX start-up).

Against the unsharded engine (one device, the reference): on meshes with the batch over data x expert
(and tensor splitting heads / MLP / vocab), greedy tokens are equal and log-probs agree within 1e-5
(float32) for plain decoding, a prefix-reusing second turn, and MTP-speculative decoding; every cache
array's bytes on one device are its total / batch shards (the cache is sharded, never replicated); the
experts are split over `expert`; weights handed over in the training layout are resharded into the
serving layout (and decode the same); the mesh engine's MoE is the dropless all-to-all; bad meshes are
refused with the axis named.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys
    import jax, numpy as np
    from flax import traverse_util
    from glm5_jax import model, sharding
    from glm5_jax.config import ModelConfig
    from glm5_jax.serve.engine import Engine, SamplingParams
    assert len(jax.devices()) == 8
    cfg = ModelConfig(attention="dsa", num_layers=3, first_k_dense=1, index_topk=4,
                      indexer_types=("full", "full", "shared"), num_experts=8, experts_per_tok=2, num_heads=4,
                      mtp_depth=1)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    G = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    S = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [9] * 13, [1, 2, 3, 4, 5], [7, 7, 8], [11, 12, 13, 14],
               [2] * 9, [6, 5, 4]]
    kw = dict(max_batch=8, max_model_len=48, prefill_chunk=8)

    def run(mesh, spec=0):
        e = Engine(cfg, params, mesh=mesh, speculative=spec, **kw)
        try:
            a = e.generate(prompts, G)
            b = e.generate(prompts[:4], S)
            turn2 = prompts[0] + a[0].tokens + [3, 4, 5]           # extends the first request's cached row
            c = e.generate([turn2], G)[0]
            return e, a, b, c
        finally:
            e.shutdown()

    def same(x, y, what):
        for i, (p, q) in enumerate(zip(x, y)):
            assert p.tokens == q.tokens, (what, i, p.tokens, q.tokens)
            err = float(np.abs(np.asarray(p.logprobs) - np.asarray(q.logprobs)).max())
            assert err <= 1e-5, (what, i, err)

    full = sys.argv[1] == "full"   # fast: plain decoding on data:2,expert:4; full: + tensor:2 and MTP drafts
    ref = {}
    for spec in ((0, 1) if full else (0,)):
        e1, a1, b1, c1 = run(None, spec)
        ref[spec] = a1
        assert e1.programs.shards == 1
        plain_meshes = ("data:2,expert:4", "expert:4,tensor:2") if full else ("data:2,expert:4",)
        for mesh_spec in (plain_meshes if not spec else ("expert:4,tensor:2",)):
            mesh = sharding.make_mesh(mesh_spec)
            e, a, b, c = run(mesh, spec)
            same(a, a1, (mesh_spec, spec, "greedy"))
            same(b, b1, (mesh_spec, spec, "sampled"))
            same([c], [c1], (mesh_spec, spec, "turn 2"))
            if not spec:
                assert c.reused_tokens >= len(prompts[0]), c.reused_tokens
            shards = e.programs.shards
            assert shards == (8 if mesh_spec.startswith("data") else 4)
            assert e.config.moe_impl == "a2a" and e.config.moe_capacity_factor <= 0
            pools = {"pool": e.runtime.pool, "spec": e.runtime.spec_pool}      # pages over the batch shards
            for path, (local, total) in e.programs.per_device_bytes(pools).items():
                assert local * shards == total, (path, local, total, shards)
            gp = next(v for k, v in traverse_util.flatten_dict(e.params).items() if k[-1] == "gate_proj")
            assert "expert" in tuple(gp.sharding.spec), gp.sharding.spec
            print("ok", mesh_spec, "spec" if spec else "plain", flush=True)
    # weights in the training layout (ZeRO-3 rules) are resharded device to device into the serving layout
    mesh = sharding.make_mesh("data:2,expert:4")
    e = Engine(cfg, sharding.shard_params(params, sharding.param_shardings(cfg, mesh)), mesh=mesh, **kw)
    try:
        same(e.generate(prompts, G), ref[0], "from the training layout")
        for got, want in zip(jax.tree.leaves(e.params), jax.tree.leaves(e.programs.params)):
            assert got.sharding.is_equivalent_to(want, got.ndim), (got.sharding, want)
    finally:
        e.shutdown()
    for bad, msg in [("context:2,expert:4", "'context' is not supported for serving"),
                     ("data:8", None)]:
        try:
            Engine(cfg, params, mesh=sharding.make_mesh(bad), max_batch=4, start=False)
        except sharding.MeshError as err:
            assert msg is None or msg in str(err), (bad, err)
            assert "max_batch=4" in str(err) or msg, err
        else:
            raise AssertionError(bad)
    print("ALL OK")
""")


def _run_engine_script(mode):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


def test_mesh_engine_equals_unsharded_engine_on_8_devices():
    """Plain decoding (greedy, sampled, a prefix-reusing second turn) on data:2,expert:4 equals the
    unsharded engine; cache bytes per device = total / 8; experts split; training-layout weights
    resharded; bad meshes refused."""
    _run_engine_script("fast")


@pytest.mark.slow   # ~60 s: adds expert:4,tensor:2 and MTP-speculative decoding to the fast check above
def test_mesh_engine_with_tensor_axis_and_mtp_drafts_equals_unsharded_engine_on_8_devices():
    """As the fast test, plus the tensor axis (heads / MLP / vocab split) and MTP-speculative decoding."""
    _run_engine_script("full")


SERVER_SCRIPT = textwrap.dedent("""
    import os, socket, subprocess, sys, time, urllib.request
    import jax, openai
    from glm5_jax import hf, model
    from glm5_jax.config import ModelConfig
    from glm5_jax.data.tokenizer import train_hf_tokenizer
    from glm5_jax.serve.openai_api import run_in_thread
    from tools.serve import build
    d = sys.argv[1]
    corpus = ["Hello world, this is a tiny model answering questions about the calculator.\\n"] * 40
    tok = train_hf_tokenizer(corpus, 300, os.path.join(d, "tokenizer.json"))
    cfg = ModelConfig(vocab_size=tok.vocab_size, attention="dsa", num_layers=2, index_topk=4, num_experts=8,
                      experts_per_tok=2, num_heads=4, mtp_depth=1)
    hf.save_checkpoint(cfg, model.init_params(cfg, jax.random.PRNGKey(0)), d)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    env = dict(os.environ)
    cli = subprocess.Popen([sys.executable, "-m", "tools.serve", f"--model={d}", f"--port={port}", "--max_batch=8",
                            "--max_model_len=64", "--mesh=expert:4,tensor:2", "--speculative=mtp", "--num_draft=1",
                            "--served_model_name=tiny", "--nowarmup"], env=env)
    ref = build(d, served_model_name="tiny", max_batch=2, max_model_len=64, speculative="mtp", num_draft=1)
    ref_url, stop = run_in_thread(ref)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=2); break
            except Exception:
                assert cli.poll() is None, "tools.serve --mesh exited"
                time.sleep(0.5)
        clients = [openai.OpenAI(base_url=u + "/v1", api_key="none", max_retries=0, timeout=300) for u in (url, ref_url)]
        outs = []
        for c in clients:
            comp = c.completions.create(model="tiny", prompt="Hello world, this", max_tokens=8, temperature=0,
                                        logprobs=2)
            chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello world"}],
                                             max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
            outs.append((comp, chat))
        (mc, mh), (rc, rh) = outs
        assert mc.choices[0].text == rc.choices[0].text, (mc.choices[0].text, rc.choices[0].text)
        for a, b in zip(mc.choices[0].logprobs.token_logprobs, rc.choices[0].logprobs.token_logprobs):
            assert abs(a - b) <= 1e-5, (a, b)
        assert mh.choices[0].message.content == rh.choices[0].message.content
        for a, b in zip(mh.choices[0].logprobs.content, rh.choices[0].logprobs.content):
            assert a.token == b.token and abs(a.logprob - b.logprob) <= 1e-5, (a, b)
        assert mc.usage.completion_tokens == rc.usage.completion_tokens == 8
        print("SERVER OK", repr(mc.choices[0].text))
    finally:
        cli.terminate(); cli.wait(60); stop(); ref.engine.shutdown()
""")


@pytest.mark.slow   # ~30-50 s: two tools.serve processes compile on 8 fake devices (the engine test above is the fast check)
def test_serve_cli_on_a_mesh_answers_the_openai_client_like_the_unsharded_server(tmp_path):
    """`python -m tools.serve --mesh=expert:4,tensor:2 --speculative=mtp` on 8 fake devices: the official
    openai client gets the unsharded server's completion text and log-probs (1e-5), plain and chat."""
    pytest.importorskip("openai")
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"),
               JAX_PLATFORMS="cpu", GLM5_HUGEPAGES="0")
    r = subprocess.run([sys.executable, "-c", SERVER_SCRIPT, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "SERVER OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
