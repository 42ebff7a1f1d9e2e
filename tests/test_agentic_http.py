"""The OpenAI-style chat endpoint over the GLM chat template (glm5_jax.agentic.http), with a scripted
generator in place of a rollout server: parsing, TITO across turns, error codes."""

import json
import urllib.error
import urllib.request

import pytest

from glm5_jax.agentic.gateway import Gateway
from glm5_jax.agentic.http import ChatEndpoint, serve_http
from glm5_jax.data.chat import ChatTemplate

CORPUS = ["What is 2+3? Use the calculator. It says 5. The calculator expression 5*2 gives 10.\n"] * 40
USER = {"role": "user", "content": "What is 2+3?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": {"expression": "2+3"}}]}
REPLY = {"role": "assistant", "content": "5"}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    from glm5_jax.data.tokenizer import train_hf_tokenizer
    tok = train_hf_tokenizer(CORPUS, 300, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))
    return ChatTemplate(tok, mode="preserved")


def _generated_ids(template, history, msg):
    """The ids an assistant message generates after ``history`` (loss-mask 1 tokens of its rendering)."""
    r = template.render(history + [msg])
    return [t for t, m, i in zip(r.ids, r.loss_mask, r.message_index) if m and i == len(history)]


@pytest.fixture()
def served(template):
    script = [_generated_ids(template, [USER], CALL),
              _generated_ids(template, [USER, CALL, {"role": "tool", "content": "5"}], REPLY)]
    calls = []

    def generate(rollout_id, request_id, ids, n):
        toks = script[len(calls)]
        calls.append(list(ids))
        return {"tokens": toks, "logprobs": [-0.25 * (k + 1) for k in range(len(toks))], "version": 3,
                "finish_reason": "stop"}

    gateway = Gateway()
    server = serve_http(ChatEndpoint(template, generate, gateway, max_tokens=32), max_body=4096)
    yield server.url, gateway, calls, script
    server.close()


def post(url, body, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_completions_tool_call_then_reply_keeps_recorded_tokens(template, served):
    url, gateway, calls, script = served
    s, out = post(url + "/v1/chat/completions", {"messages": [USER], "rollout_id": "r1", "max_tokens": 32})
    assert s == 200 and out["choices"][0]["finish_reason"] == "tool_calls"
    fn = out["choices"][0]["message"]["tool_calls"][0]["function"]
    assert fn["name"] == "calculator" and json.loads(fn["arguments"]) == {"expression": "2+3"}
    assert out["glm5"]["token_ids"] == script[0] and out["glm5"]["version"] == 3
    prompt1 = template.render([USER], add_generation_prompt=True).ids
    assert calls[0] == prompt1
    msgs = [USER, CALL, {"role": "tool", "content": "5"}]
    s, out = post(url + "/v1/chat/completions", {"messages": msgs, "rollout_id": "r1"})
    assert s == 200 and out["choices"][0]["message"]["content"] == "5"
    # the second request's context: the recorded tokens + the tool result + generation prompt, which
    # here (preserved mode, canonical generation) is also the full rendering of the conversation
    assert calls[1][:len(prompt1) + len(script[0])] == prompt1 + script[0]
    assert calls[1] == template.render(msgs, add_generation_prompt=True).ids
    rec = gateway.record("r1")
    assert [t for t, m in zip(rec.tokens, rec.mask) if m] == script[0] + script[1]
    assert [lp for lp, m in zip(rec.logp, rec.mask) if m] == (
        [-0.25 * (k + 1) for k in range(len(script[0]))] + [-0.25 * (k + 1) for k in range(len(script[1]))])
    s, fin = post(url + "/v1/rollouts/r1/finish", {"reward": 1})
    assert s == 200 and fin["generated"] == len(script[0]) + len(script[1])
    assert "r1" not in gateway.open_ids()


@pytest.mark.parametrize("path,body,raw,code", [
    ("/v1/chat/completions", None, b"{not json", 400),
    ("/v1/chat/completions", {"messages": []}, None, 400),
    ("/v1/chat/completions", {"messages": [USER], "max_tokens": 10 ** 6}, None, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, None, 400),
    ("/v1/chat/completions", {"messages": [USER, REPLY]}, None, 400),        # cannot generate after a reply
    ("/v1/chat/completions", None, b"x" * 5000, 413),
    ("/v1/rollouts/nope/finish", {"reward": 1}, None, 404),
    ("/v1/other", {}, None, 404),
    ("/v1/chat/completions", None, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),  # lone surrogate
    ("/v1/chat/completions", None, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": NaN}', 400),
])
def test_bad_requests_get_4xx_and_server_keeps_answering(served, path, body, raw, code):
    url, *_ = served
    s, out = post(url + path, body, raw)
    assert s == code and out["error"]["code"] == code
    s, out = post(url + "/v1/chat/completions", {"messages": [USER]})
    assert s == 200


@pytest.mark.parametrize("raw", [b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": -Infinity}',
                                 b'{"reward": 1e400}', b'{"reward": ' + b"9" * 400 + b'}', b'{"reward": 2e6}',
                                 b'{"reward": "1"}', b'{"reward": true}'])
def test_finish_refuses_non_finite_or_unbounded_rewards_and_keeps_the_record_open(served, raw):
    """NaN / Infinity literals, a float that overflows, a 400-digit int, |reward| > 1e6 and non-numbers
    are 400 (never 500, never recorded); the rollout stays open and a valid reward then finishes it."""
    url, gateway, *_ = served
    assert post(url + "/v1/chat/completions", {"messages": [USER], "rollout_id": "rw"})[0] == 200
    s, out = post(url + "/v1/rollouts/rw/finish", None, raw)
    assert s == 400 and out["error"]["code"] == 400, out
    assert "rw" in gateway.open_ids()
    assert post(url + "/v1/rollouts/rw/finish", {"reward": -0.5})[0] == 200


def test_bad_content_length_is_400_and_a_slow_body_is_408(template):
    """A Content-Length that is not an integer is a 400; a client that sends headers but not its body is
    answered 408 after the deadline (its thread freed), and the server keeps answering."""
    import socket
    import time
    server = serve_http(ChatEndpoint(template, lambda *a: None), timeout_s=0.5)
    url = server.url
    try:
        host, port = server.host, server.port
        for head, want in [(b"Content-Length: abc\r\n", b" 400 "), (b"Content-Length: 100\r\n", b" 408 ")]:
            with socket.create_connection((host, port), timeout=10) as c:
                t0 = time.time()
                c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{")
                reply = c.recv(4096)
                assert want in reply.split(b"\r\n")[0], reply[:200]
                assert time.time() - t0 < 5
        assert post(url + "/v1/rollouts/none/finish", {"reward": 1})[0] == 404
    finally:
        server.close()


def test_open_rollouts_are_bounded(template):
    """Beyond max_open open rollouts a new rollout_id is refused (429) until one finishes; a known
    rollout_id still continues."""
    toks = _generated_ids(template, [USER], REPLY)
    gen = lambda rid, req, ids, n: {"tokens": toks, "logprobs": [0.0] * len(toks), "version": 0,
                                    "finish_reason": "stop"}
    server = serve_http(ChatEndpoint(template, gen, Gateway(), max_tokens=32, max_open=2))
    url = server.url
    try:
        assert [post(url + "/v1/chat/completions", {"messages": [USER], "rollout_id": r})[0]
                for r in ("a", "b", "c")] == [200, 200, 429]
        more = {"messages": [USER, REPLY, {"role": "user", "content": "again"}], "rollout_id": "b"}
        assert post(url + "/v1/chat/completions", more)[0] == 200          # an open rollout continues at the cap
        assert post(url + "/v1/rollouts/a/finish", {"reward": 0})[0] == 200
        assert post(url + "/v1/chat/completions", {"messages": [USER], "rollout_id": "c"})[0] == 200
    finally:
        server.close()
