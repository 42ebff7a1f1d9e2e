"""The OpenAI-compatible server (glm5_jax.serve, tools.serve) through the official `openai` client on
127.0.0.1, on a tiny random checkpoint written as a Hugging Face folder (config.json + safetensors +
tokenizer.json): completions and chat, streamed and not, echo log-probs against the model's forward,
greedy outputs against the static decoder (glm5_jax.infer.generate), concurrent requests against each
alone, a tool-call round trip on a constructed bigram model, error mapping (and a small fuzz), a client
that disconnects mid-stream, /metrics; a checkpoint whose tokenizer_config.json carries a Jinja chat
template is served with it (prompt ids equal transformers' apply_chat_template)."""

import concurrent.futures
import json
import os
import random
import shutil
import socket
import time
import urllib.error
import urllib.request

import jax
import jax.numpy as jnp
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from glm5_jax import hf, model  # noqa: E402
from glm5_jax.config import ModelConfig  # noqa: E402
from glm5_jax.data.chat import ChatTemplate  # noqa: E402
from glm5_jax.data.tokenizer import train_hf_tokenizer  # noqa: E402
from glm5_jax.serve.openai_api import run_in_thread  # noqa: E402

CORPUS = ["What is 2+3? Use the calculator. It says 5. The calculator expression 5*2 gives 10. "
          "Hello world, this is a tiny model answering questions.\n"] * 40
MAX_LEN = 96


def _write_model(d, tok, cfg, params):
    hf.save_checkpoint(cfg, params, d)
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    tok = train_hf_tokenizer(CORPUS, 320, str(d / "tokenizer.json"))
    # 3 layers: a dense prefix of 1 and an MoE body of 2, stacks of unequal depth (a prefix copy once
    # copied only the first layer of each stack)
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=3, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(0))
    _write_model(str(d), tok, cfg, params)
    return str(d), tok, cfg, params


@pytest.fixture(scope="module")
def server(tiny):
    from tools.serve import build
    path, tok, cfg, params = tiny
    srv = build(path, served_model_name="tiny", max_batch=4, max_model_len=MAX_LEN)
    url, stop = run_in_thread(srv)
    yield srv, url, openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    stop()
    srv.engine.shutdown()


def _greedy_ref(cfg, params, ids, n):
    from glm5_jax.infer import generate
    return generate(cfg, params, [ids], max_new_tokens=n, temperature=0.0)


# ----------------------------------------------------------------------------- completions
def test_completions_greedy_equals_static_decoder_and_stream_equals_whole(server, tiny):
    srv, url, client = server
    path, tok, cfg, params = tiny
    prompt = "Hello world, this is"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    ch = r.choices[0]
    ids = tok.encode(prompt)
    ref = _greedy_ref(cfg, params, ids, 10)
    assert ch.glm5["token_ids"] == ref.tokens[0].tolist()
    np.testing.assert_allclose(ch.glm5["logprobs"], ref.logprobs[0], atol=1e-5)
    assert ch.text == tok.decode(ref.tokens[0].tolist())
    assert ch.finish_reason == "length" and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10
    parts = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                           logprobs=2, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == ch.text
    assert parts[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0].logprobs
    streamed = [p.choices[0].logprobs for p in parts if p.choices[0].logprobs]
    assert [t for x in streamed for t in x.tokens] == whole.tokens
    assert [o for x in streamed for o in x.text_offset] == whole.text_offset
    assert whole.text_offset[0] == len(prompt)
    np.testing.assert_allclose([v for x in streamed for v in x.token_logprobs], whole.token_logprobs, atol=1e-6)


def test_completions_prompt_forms_and_n(server, tiny):
    srv, url, client = server
    path, tok, cfg, params = tiny
    ids = tok.encode("What is 2+3?")
    a = client.completions.create(model="tiny", prompt=[ids, "What is 2+3?"], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len(a.choices) == 2 and a.choices[0].text == a.choices[1].text
    b = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0.9, seed=7, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in b.choices] == [0, 1, 2]
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0.9, seed=7, n=3,
                                      extra_body={"ignore_eos": True})
    assert [c.glm5["token_ids"] for c in b.choices] == [c.glm5["token_ids"] for c in again.choices]
    assert len({tuple(c.glm5["token_ids"]) for c in b.choices}) > 1     # seed + i per choice


def test_echo_logprobs_equal_model_forward(server, tiny):
    srv, url, client = server
    path, tok, cfg, params = tiny
    prompt = "The calculator expression 5*2 gives 10."
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    lp = r.choices[0].logprobs
    ids = tok.encode(prompt)
    full = np.asarray(jax.nn.log_softmax(model.forward(cfg, params, jnp.asarray([ids])), axis=-1))[0]
    want = [full[i - 1, ids[i]] for i in range(1, len(ids))]
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], want, atol=1e-4)
    assert lp.tokens == [tok.decode([t]) for t in ids] and r.choices[0].text == prompt
    assert lp.text_offset == list(np.cumsum([0] + [len(s) for s in lp.tokens[:-1]]))
    top1 = max(lp.top_logprobs[1].values())
    assert len(lp.top_logprobs[1]) <= 3 and abs(top1 - full[0].max()) < 1e-4
    # echo + generation: the generated tokens follow the prompt's in every list
    g = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert len(g.logprobs.tokens) == len(ids) + 3 and g.text.startswith(prompt)
    np.testing.assert_allclose(g.logprobs.token_logprobs[1:len(ids)], want, atol=1e-4)


def test_concurrent_requests_equal_each_alone(server, tiny):
    srv, url, client = server
    prompts = ["What is 2+3?", "Hello world", "Use the calculator. It says", "this is a tiny model answering",
               "5*2 gives", "questions"]

    def one(i):
        return client.completions.create(model="tiny", prompt=prompts[i], max_tokens=6 + i, temperature=0.8,
                                         top_p=0.95, seed=100 + i, extra_body={"ignore_eos": True, "top_k": 50})
    alone = [one(i).choices[0].glm5["token_ids"] for i in range(len(prompts))]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        together = [f.result().choices[0].glm5["token_ids"] for f in [ex.submit(one, i) for i in range(len(prompts))]]
    assert together == alone
    assert srv.engine.stats["steps"] > 0


def test_requests_sharing_a_prompt_or_its_prefix_get_what_they_get_alone(server, tiny):
    """18 concurrent completions (4 slots) whose prompts are equal, prefixes of one another or extensions
    of one another, greedy and seeded, some with n = 3: every choice's tokens equal that request sent
    alone, and the greedy ones equal the static decoder (glm5_jax.infer.generate), so a prefix taken from
    a busy slot holds exactly the keys the request would compute itself."""
    srv, url, client = server
    path, tok, cfg, params = tiny
    rng = np.random.default_rng(65)
    base = rng.integers(1, cfg.vocab_size, 48).tolist()
    prompts = [base, base, base[:30], base[:30] + rng.integers(1, cfg.vocab_size, 8).tolist(), base + [7, 8, 9],
               base[:47], base[:20], base + [7], base[:12] + [5] * 6]
    reqs = [(p, 0.0, None, 1) for p in prompts] + [(p, 0.9, 40 + i, 3 if i % 3 == 0 else 1)
                                                  for i, p in enumerate(prompts)]

    def one(i):
        p, temp, seed, n = reqs[i]
        r = client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=temp, seed=seed, n=n,
                                      extra_body={"ignore_eos": True})
        return [c.glm5["token_ids"] for c in sorted(r.choices, key=lambda c: c.index)]
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as ex:
        together = [f.result() for f in [ex.submit(one, i) for i in range(len(reqs))]]
    alone = [one(i) for i in range(len(reqs))]
    assert together == alone
    for (p, temp, _, _), got in zip(reqs, together):
        if temp == 0.0:
            assert got[0] == _greedy_ref(cfg, params, p, 8).tokens[0].tolist()
    assert srv.engine.stats["reused_tokens"] > 0


# ----------------------------------------------------------------------------- chat
def test_chat_stream_equals_whole_and_usage(server, tiny):
    srv, url, client = server
    path, tok, cfg, params = tiny
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    for thinking in (True, False):
        kw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                  extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
        r = client.chat.completions.create(**kw)
        m = r.choices[0].message
        ids = ChatTemplate(tok).render(msgs, add_generation_prompt=True).ids
        assert r.usage.prompt_tokens == len(ids) + (0 if thinking else 3)
        assert r.choices[0].glm5["prompt_token_ids"][:len(ids)] == ids
        parts = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert parts[0].choices[0].delta.role == "assistant"
        content = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
        reasoning = "".join(getattr(p.choices[0].delta, "reasoning_content", None) or "" for p in parts if p.choices)
        assert content == (m.content or "")
        assert reasoning == (getattr(m, "reasoning_content", None) or "")
        assert parts[-1].usage.completion_tokens == r.usage.completion_tokens
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == r.choices[0].finish_reason


# ----------------------------------------------------------------------------- tool calls (bigram model)
def _bigram_tool_model(tok, template):
    """A model whose next token depends only on the current one: after '</think>' (thinking off) it emits
    a calculator tool call, after '<|assistant|>' (thinking on) the reply '5'."""
    sp = template.special
    enc = tok.encode
    call = ([sp["</think>"], sp["<tool_call>"]] + enc("calculator") + [sp["<arg_key>"]] + enc("expression")
            + [sp["</arg_key>"], sp["<arg_value>"]] + enc("2+3") + [sp["</arg_value>"], sp["</tool_call>"],
                                                                    sp["<|observation|>"]])
    reply = [sp["<|assistant|>"]] + enc("5") + [sp["<|user|>"]]
    return _bigram_model(tok, [call, reply])


def _bigram_model(tok, seqs):
    """A model whose next token depends only on the current one (attention and MLP outputs zeroed; the
    LM head solved so that each chain token's final-normed embedding scores its successor highest): in
    each of ``seqs`` every token is followed by the next."""
    chain = {}
    for seq in seqs:
        for a, b in zip(seq, seq[1:]):
            assert chain.get(a, b) == b, "the chain needs distinct tokens"
            chain[a] = b
    cfg = ModelConfig(vocab_size=tok.vocab_size, num_layers=2, num_experts=0, mtp_depth=0)
    params = model.init_params(cfg, jax.random.PRNGKey(3))
    stack = params["dense_layers"]["layer_0"]
    stack["attn"]["o_proj"]["kernel"] = jnp.zeros_like(stack["attn"]["o_proj"]["kernel"])
    stack["mlp"]["down_proj"]["kernel"] = jnp.zeros_like(stack["mlp"]["down_proj"]["kernel"])
    src = np.array(sorted(chain))
    emb = np.asarray(params["embed"]["embedding"])[src]
    h = emb / np.sqrt(np.mean(emb ** 2, axis=-1, keepdims=True) + cfg.rms_norm_eps) * np.asarray(params["final_norm"]["scale"])
    target = np.zeros((len(src), cfg.vocab_size), np.float32)
    target[np.arange(len(src)), [chain[t] for t in src]] = 30.0
    params["lm_head"]["kernel"] = jnp.asarray(np.linalg.pinv(h) @ target, jnp.float32)
    return cfg, params


def test_tool_call_round_trip(tiny, tmp_path):
    from tools.serve import build
    path, tok, _, _ = tiny
    cfg, params = _bigram_tool_model(tok, ChatTemplate(tok))
    d = str(tmp_path / "bigram")
    _write_model(d, tok, cfg, params)
    srv = build(d, served_model_name="bigram", max_batch=2, max_model_len=256, tokenizer=os.path.join(path, "tokenizer.json"))
    url, stop = run_in_thread(srv)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                                   "parameters": {"type": "object", "properties": {
                                                       "expression": {"type": "string"}}}}}]
        msgs = [{"role": "user", "content": "What is 2+3?"}]
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        r = client.chat.completions.create(model="bigram", messages=msgs, tools=tools, max_tokens=20, temperature=0,
                                           extra_body=off)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        call = ch.message.tool_calls[0]
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "2+3"}
        # streamed: the same call assembled from deltas
        parts = list(client.chat.completions.create(model="bigram", messages=msgs, tools=tools, max_tokens=20,
                                                    temperature=0, stream=True, extra_body=off))
        name = "".join(tc.function.name or "" for p in parts if p.choices for tc in (p.choices[0].delta.tool_calls or []))
        args = "".join(tc.function.arguments or "" for p in parts if p.choices
                       for tc in (p.choices[0].delta.tool_calls or []))
        assert name == "calculator" and json.loads(args) == json.loads(call.function.arguments)
        assert [p.choices[0].finish_reason for p in parts if p.choices][-1] == "tool_calls"
        # the tool result goes back; the model answers (thinking on: after <|assistant|>)
        msgs2 = msgs + [ch.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id,
                                                                    "content": "5"}]
        r2 = client.chat.completions.create(model="bigram", messages=msgs2, tools=tools, max_tokens=20, temperature=0)
        assert r2.choices[0].message.content == "5" and r2.choices[0].finish_reason == "stop"
        assert r2.choices[0].message.tool_calls is None
        # tool_choice none: the same text stays content-free of calls; a named function is forced
        named = client.chat.completions.create(model="bigram", messages=msgs, tools=tools, max_tokens=20,
                                               temperature=0, tool_choice={"type": "function",
                                                                           "function": {"name": "calculator"}})
        assert named.choices[0].message.tool_calls[0].function.name == "calculator"
    finally:
        stop()
        srv.engine.shutdown()


# ----------------------------------------------------------------------------- errors
def _post(url, path, body=None, raw=None, method="POST"):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_error_mapping(server, tiny):
    srv, url, client = server
    path, tok, cfg, params = tiny
    cases = [
        (dict(raw=b"{not json"), 400, None),
        (dict(raw=b'{"prompt": "\xff\xfe"}'), 400, None),                       # invalid UTF-8
        (dict(raw=b'{"prompt": "a\\ud800b"}'), 400, "prompt"),                  # lone surrogate
        (dict(body={"model": "nope", "prompt": "hi"}), 404, "model"),
        (dict(body={"prompt": "hi", "temperature": -1}), 400, "temperature"),
        (dict(body={"prompt": "hi", "max_tokens": "3"}), 400, "max_tokens"),
        (dict(body={"prompt": "hi", "n": 0}), 400, "n"),
        (dict(body={"prompt": [1, 2, cfg.vocab_size]}), 400, "prompt"),
        (dict(body={"prompt": [1] * MAX_LEN}), 400, "prompt"),
        (dict(body={"prompt": "hi", "max_tokens": MAX_LEN}), 400, "max_tokens"),
        (dict(body={"prompt": "hi", "logprobs": 99}), 400, "logprobs"),
        (dict(body={"prompt": 5}), 400, "prompt"),
        (dict(body=[1, 2]), 400, None),
        (dict(raw=b'{"prompt": "hi", "temperature": NaN}'), 400, None),     # not JSON (one rule, serve.http)
        (dict(raw=b"[" * 100000 + b"]" * 100000), 400, None),             # nesting deeper than the stack
        (dict(body={"prompt": "hi", "echo": 1}), 400, "echo"),             # strict types: 1 is not true
        (dict(body={"prompt": "hi", "best_of": 3}), 400, "best_of"),
    ]
    for kw, status, param in cases:
        s, out = _post(url, "/v1/completions", **kw)
        err = json.loads(out)["error"]
        assert s == status, (kw, s, out)
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param:
            assert err["param"] == param, (kw, err)
    chat_cases = [({"messages": []}, "messages"), ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                  ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}, "tool_choice"),
                  ({"messages": [{"role": "user", "content": "<|user|>"}]}, "messages")]
    for body, param in chat_cases:
        s, out = _post(url, "/v1/chat/completions", body)
        assert s == 400 and json.loads(out)["error"]["param"] == param, (body, out)
    assert _post(url, "/v1/nothing", {"a": 1})[0] == 404
    # a request aiohttp cannot parse gets the OpenAI body too (glm5_jax.serve.http's protocol)
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.endswith(b"}"):
            got = c.recv(4096)
            if not got:
                break
            reply += got
    assert reply.startswith(b"HTTP/1.1 400") or reply.startswith(b"HTTP/1.0 400"), reply[:100]
    assert set(json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]) == {"message", "type", "param", "code"}
    assert _post(url, "/v1/completions", method="GET")[0] == 405
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10 ** 6)


def test_fuzzed_bodies_never_5xx(server):
    srv, url, client = server
    rng = random.Random(0)
    values = [None, True, -1, 0, 1, 2.5, 1e309, "", "x", "\u00e9", [], [1, "a"], {}, {"a": []}, [[1], [2, 3]],
              [-5], [10 ** 9], "a" * 300]
    keys = ["prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "echo",
            "logprobs", "stream", "tools", "tool_choice", "chat_template_kwargs", "model", "stop_token_ids"]
    for i in range(60):
        body = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(1, 6))}
        if i % 3 == 0:
            body["prompt"] = "hi"
        if i % 4 == 1:
            body["messages"] = [{"role": "user", "content": rng.choice(["hi", 5, None, ["x"]])}]
        body["max_tokens"] = rng.choice([1, 2, body.get("max_tokens")])
        for path in ("/v1/completions", "/v1/chat/completions"):
            s, out = _post(url, path, body)
            assert s < 500, (path, body, out)
            if s >= 400:
                assert set(json.loads(out)["error"]) == {"message", "type", "param", "code"}
    assert _post(url, "/health", method="GET")[0] == 200


def test_disconnect_mid_stream_frees_slot_pages_and_metrics(server, tiny):
    srv, url, client = server
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"prompt": "Hello", "max_tokens": MAX_LEN - 4, "stream": True, "ignore_eos": True}).encode()
    s = socket.create_connection((host, int(port)))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    got = b""
    while b"data:" not in got:
        got += s.recv(4096)
    assert srv.engine.active == 1
    s.close()
    deadline = time.time() + 30
    while (srv.engine.active or srv.engine.queue_length) and time.time() < deadline:
        time.sleep(0.05)
    assert srv.engine.active == 0
    assert srv.engine.stats["generated_tokens"] > 0
    s, text = _post(url, "/metrics", method="GET")
    text = text.decode()
    for name in ("glm5_time_to_first_token_seconds", "glm5_inter_token_latency_seconds",
                 "glm5_generation_tokens_per_second", "glm5_queue_length", "glm5_batch_occupancy",
                 "glm5_spec_acceptance_length"):
        assert name in text
    assert 'finish_reason="cancelled"' in text
    # the hung-up stream's pages came back: none held by a running request, free + cached = the pool
    pages = {line.split('state="')[1].split('"')[0]: float(line.split()[-1])
             for line in text.splitlines() if line.startswith("glm5_kv_pages{")}
    assert pages["running"] == 0 and pages["free"] + pages["cached"] == pages["total"] > 0
    assert "glm5_prefix_cache_hit_rate" in text and "glm5_step_host_gap_seconds_count" in text
    assert srv.engine.stats["host_gaps"] > 0 and srv.engine.stats["host_gap_s"] > 0
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


# ----------------------------------------------------------------------------- the checkpoint's own template
# GLM-style (written for this test, in the structure of GLM-4.5 / GLM-5's template): a tools preamble in
# the system turn, /nothink and an empty think block when enable_thinking is false, reasoning shown only
# after the last user turn, tool calls as <arg_key>/<arg_value> pairs read from a mapping, consecutive
# tool results under one <|observation|>.
GLM_STYLE_TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call functions. Their signatures, within <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

Write each call as <tool_call>{name}<arg_key>{key}</arg_key><arg_value>{value}</arg_value></tool_call>.
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- elif m.role == 'user' -%}
<|user|>
{{ m.content }}{{ '/nothink' if (enable_thinking is defined and not enable_thinking) else '' }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- if loop.index0 > ns.last_user and m.reasoning_content -%}
{{ '\n<think>' + m.reasoning_content.strip() + '</think>' }}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if m.content and m.content.strip() -%}
{{ '\n' + m.content.strip() }}
{%- endif -%}
{%- for tc in m.tool_calls or [] -%}
{{ '\n<tool_call>' + tc.function.name }}
{%- for k, v in tc.function.arguments.items() -%}
{{ '\n<arg_key>' + k + '</arg_key>\n<arg_value>' }}{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
{{ '\n</tool_call>' }}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
{{ '\n<tool_response>\n' + m.content + '\n</tool_response>' }}
{%- else -%}
{{ raise_exception('unknown role ' + m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' }}
{%- endif -%}"""


def test_checkpoint_chat_template_prompt_equals_transformers(tiny, tmp_path):
    """A HF folder whose tokenizer_config.json holds a chat template: the served prompt (the TITO record's
    prompt_token_ids) equals transformers' apply_chat_template on the same messages, tools and kwargs,
    for thinking on and off, with a tool call (arguments sent as a JSON string, rendered as a mapping)."""
    transformers = pytest.importorskip("transformers")
    from tools.serve import build
    path, tok, _, _ = tiny
    d = tmp_path / "glm_style"
    shutil.copytree(path, d)
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "chat_template": GLM_STYLE_TEMPLATE}, f)
    reference = transformers.AutoTokenizer.from_pretrained(str(d))
    tools = [{"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                               "parameters": {"type": "object", "properties": {
                                                   "expression": {"type": "string"}}}}}]
    call_args = {"expression": "2+3", "precision": 2}
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"},
             {"role": "assistant", "content": None, "reasoning_content": "Use the calculator.",
              "tool_calls": [{"id": "call_0", "type": "function",
                              "function": {"name": "calculator", "arguments": json.dumps(call_args)}}]},
             {"role": "tool", "tool_call_id": "call_0", "content": "5"}]
    ref_convo = [dict(m) for m in convo]     # (transformers drops None-valued keys itself)
    ref_convo[2] = dict(convo[2], tool_calls=[{"id": "call_0", "type": "function",
                                               "function": {"name": "calculator", "arguments": call_args}}])
    srv = build(str(d), served_model_name="glm", max_batch=2, max_model_len=1024)
    url, stop = run_in_thread(srv)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        python_renderer = ChatTemplate(tok).render(convo, add_generation_prompt=True, tools=tools).ids
        for thinking in (True, False):
            got = client.chat.completions.create(model="glm", messages=convo, tools=tools, max_tokens=1,
                                                 extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
            want = reference.apply_chat_template(ref_convo, tools=tools, add_generation_prompt=True,
                                                 enable_thinking=thinking, tokenize=True)
            want = list(want["input_ids"] if hasattr(want, "keys") else want)
            assert got.choices[0].glm5["prompt_token_ids"] == want, thinking
            assert got.usage.prompt_tokens == len(want)
            assert want != python_renderer          # the checkpoint's template, not the Python renderer
            text = reference.decode(want)
            assert ("/nothink" in text) == (not thinking) and text.endswith("</think>") == (not thinking)
            assert '"precision": 2' not in text and "<arg_value>2</arg_value>" in text   # a mapping, not JSON text
        # a message that would forge a control token is refused, as with the Python renderer
        s, out = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi<|assistant|>"}]})
        assert s == 400 and json.loads(out)["error"]["param"] == "messages"
    finally:
        stop()
        srv.engine.shutdown()


# GLM-4.7 / GLM-5 style (written for this test): the generation prompt opens the think block for the model
# (`<|assistant|><think>`), or closes it when thinking is off (`<|assistant|></think>`); no newlines.
OPEN_THINK_TEMPLATE = """[gMASK]<sop>
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>{{ m.content }}
{%- elif m.role == 'system' -%}<|system|>{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|></think>{{ (m.content or '').strip() }}
{%- else -%}{{ raise_exception('this test template knows user, system and assistant only') }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{ '</think>' if (enable_thinking is defined and not enable_thinking)
else '<think>' }}{%- endif -%}"""


def test_template_that_opens_the_think_block_is_parsed_as_reasoning(tiny, tmp_path):
    """A checkpoint template whose generation prompt ends with <think> (the model writes its reasoning
    straight away): the reply's text up to </think> is reasoning_content, streamed and not; thinking off
    (prompt ends with </think>) is content only. A bigram model writes '<think>' -> 'ok' -> '</think>' ->
    '5' -> '<|user|>'."""
    from tools.serve import build
    path, tok, _, _ = tiny
    t = ChatTemplate(tok)
    sp = t.special
    cfg, params = _bigram_model(tok, [[sp["<think>"]] + tok.encode("ok") + [sp["</think>"]] + tok.encode("5")
                                      + [sp["<|user|>"]]])
    d = tmp_path / "open_think"
    d.mkdir()
    shutil.copy(os.path.join(path, "tokenizer.json"), d / "tokenizer.json")
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"chat_template": OPEN_THINK_TEMPLATE}, f)
    _write_model(str(d), tok, cfg, params)
    srv = build(str(d), served_model_name="open", max_batch=2, max_model_len=128)
    url, stop = run_in_thread(srv)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "What is 2+3?"}]
        r = client.chat.completions.create(model="open", messages=msgs, max_tokens=10, temperature=0)
        m = r.choices[0].message
        assert r.choices[0].glm5["prompt_token_ids"][-1] == sp["<think>"]
        assert (m.reasoning_content, m.content, r.choices[0].finish_reason) == ("ok", "5", "stop"), m
        parts = list(client.chat.completions.create(model="open", messages=msgs, max_tokens=10, temperature=0,
                                                    stream=True))
        assert "".join(getattr(p.choices[0].delta, "reasoning_content", None) or "" for p in parts) == "ok"
        assert "".join(p.choices[0].delta.content or "" for p in parts) == "5"
        off = client.chat.completions.create(model="open", messages=msgs, max_tokens=10, temperature=0,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.choices[0].glm5["prompt_token_ids"][-1] == sp["</think>"]
        assert off.choices[0].message.content == "5" and getattr(off.choices[0].message, "reasoning_content",
                                                                   None) is None
    finally:
        stop()
        srv.engine.shutdown()
