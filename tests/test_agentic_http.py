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
    server, url = serve_http(ChatEndpoint(template, generate, gateway, max_tokens=32), max_body=4096)
    yield url, gateway, calls, script
    server.shutdown()


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
])
def test_bad_requests_get_4xx_and_server_keeps_answering(served, path, body, raw, code):
    url, *_ = served
    s, out = post(url + path, body, raw)
    assert s == code and out["error"]["code"] == code
    s, out = post(url + "/v1/chat/completions", {"messages": [USER]})
    assert s == 200
