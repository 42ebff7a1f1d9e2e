"""StreamParser (glm5_jax/serve/parsing.py): for every chunking of a generated message, the concatenated
OpenAI deltas equal parse_assistant on the whole text (content, reasoning, tool-call names and JSON
arguments). Texts: the chat template's own rendering of random assistant messages (well formed), the
anchor bugs (arguments split across chunks, calls inside <think>, zero-argument calls, tags split at chunk
boundaries, several calls), and random soups of tags and text (malformed)."""

import json
import random

import pytest

from glm5_jax.data.chat import ChatTemplate, parse_assistant
from glm5_jax.serve.parsing import StreamParser

TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
        "</arg_value>", "<|observation|>", "<|user|>", "<|endoftext|>"]


def _collect(deltas):
    """Concatenate deltas -> (content, reasoning, [(name, arguments str)]), checking the OpenAI shape."""
    content, reasoning, calls = "", "", []
    for d in deltas:
        assert isinstance(d, dict) and len(d) == 1, d
        (kind, v), = d.items()
        if kind == "content":
            assert isinstance(v, str) and v
            content += v
        elif kind == "reasoning_content":
            assert isinstance(v, str) and v
            reasoning += v
        else:
            assert kind == "tool_calls" and len(v) == 1, d
            tc = v[0]
            i = tc["index"]
            if "id" in tc:                                   # first fragment of call i
                assert i == len(calls) and tc["type"] == "function" and tc["id"].startswith("call_")
                assert set(tc["function"]) == {"name", "arguments"}
                calls.append([tc["function"]["name"], tc["function"]["arguments"]])
            else:
                assert i == len(calls) - 1 and set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[i][1] += tc["function"]["arguments"]
    return content, reasoning, calls


def _stream(text, chunks, **kw):
    p = StreamParser(**kw)
    out = []
    for c in chunks:
        out += p.feed(c)
    out += p.finish()
    assert "".join(chunks) == text
    return _collect(out), p


def _split(text, cuts):
    cuts = sorted(set(c for c in cuts if 0 < c < len(text)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def _chunkings(text, rng, n_random=6):
    """One character at a time, the whole text, every tag split in its middle, and random multi-char chunks."""
    yield list(text)
    yield [text]
    mids = [i + len(t) // 2 for t in TAGS for i in range(len(text)) if text.startswith(t, i)]
    yield _split(text, mids)
    for _ in range(n_random):
        k = rng.randint(1, max(1, len(text) // 2))
        yield _split(text, rng.sample(range(1, len(text) + 1), min(k, len(text))))


def _want(text):
    p = parse_assistant(text)
    calls = [[c["name"], c["arguments"]] for c in p.tool_calls]
    call_errors = [e for e in p.errors if not e.startswith(("<think>", "stray"))]
    return p.content, p.reasoning or "", calls, call_errors


def _check(text, chunks, stream_arguments=True):
    (content, reasoning, calls), parser = _stream(text, chunks, stream_arguments=stream_arguments)
    want_content, want_reasoning, want_calls, call_errors = _want(text)
    assert content == want_content, (text, chunks)
    assert reasoning == want_reasoning, (text, chunks)
    if not stream_arguments or not call_errors:
        got = [[n, json.loads(a)] for n, a in calls]
        assert json.dumps(got) == json.dumps(want_calls), (text, chunks)    # json: NaN == NaN
        assert parser.tool_calls == len(want_calls)


# ----------------------------------------------------------------------------- well-formed messages
_WORDS = ["hello", "world", " ", "\n", "<", ">", "<b>", "a<c", "{", "}", "[1, 2]", '"q"', "\\", "'", "é", "日本",
          "5", "-3.5", "true", "null", "x y", "\t", "</", "<think", "tool", ":", ","]


def _text(rng, k=6):
    return "".join(rng.choice(_WORDS) for _ in range(rng.randint(0, k)))


def _value(rng):
    kind = rng.randrange(9)
    if kind == 0:
        return rng.randint(-1000, 1000)
    if kind == 1:
        return rng.choice([0.5, -2.25, 1e-3])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return [rng.randint(0, 9), _text(rng, 2)]
    if kind == 4:
        return {"a": _text(rng, 2), "b": [1, {"c": None}]}
    if kind == 5:
        return rng.choice(["5", "true", "null", '"quoted"', "[1]", "{}", "", " ", "NaN", "-"])   # JSON-looking
    return _text(rng, 8)                                     # raw strings (stream character by character)


def _message(rng):
    calls = []
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        args = {}
        for _ in range(rng.choice([0, 1, 1, 2, 3])):         # zero-argument calls included
            args[rng.choice(["city", "n", "path", "q", "x_y", "日付"]) + str(len(args))] = _value(rng)
        calls.append({"name": rng.choice(["get_weather", "search", "f", "run.py"]), "arguments": args})
    reasoning = _text(rng, 8).strip()
    if rng.random() < 0.3:                                   # a tool call written inside the reasoning
        reasoning += "\n<tool_call>get\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call> then"
    m = {"content": _text(rng, 8).strip(), "reasoning": reasoning, "tool_calls": calls}
    forced = rng.random() < 0.2                              # thinking off: generation starts after <think></think>
    prompt, gen = ChatTemplate._assistant_pieces(None, m, True, forced)
    text = "".join(x for _, x in (gen if forced else prompt + gen))
    if rng.random() < 0.2:
        text = text.rsplit("<|", 1)[0]                       # no stop token (max_tokens or the engine cut it)
    return text


def test_template_messages_every_chunking():
    rng = random.Random(0)
    n_calls = 0
    for _ in range(150):
        text = _message(rng)
        want = _want(text)
        assert not want[3], (text, want)                      # the template's text is well formed
        n_calls += len(want[2])
        for chunks in _chunkings(text, rng):
            for mode in (True, False):
                _check(text, chunks, stream_arguments=mode)
    assert n_calls > 100


ANCHORS = [
    # arguments split across chunks (checked by every chunking), several calls, a zero-argument call
    "\n<think>plan</think>\nOK.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>San Francisco, CA"
    "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>"
    "<|observation|>",
    # a tool call inside <think> is reasoning text; the real one follows
    "<think>I should call <tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call> first"
    "</think>\n<tool_call>g\n<arg_key>b</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>",
    # an unclosed <think> (max_tokens in the middle of the reasoning)
    "\n<think>still thinking <tool_call>x",
    # zero-argument call alone, no content, no newline before </tool_call>
    "\n<think></think><tool_call>ping</tool_call><|observation|>",
    # values that look like tags or JSON, multi-line raw strings, a value containing '<'
    "\n<think></think>\n<tool_call>w\n<arg_key>s</arg_key>\n<arg_value>a < b\nc</d></arg_value>\n<arg_key>t"
    "</arg_key>\n<arg_value>\"5\"</arg_value>\n<arg_key>u</arg_key>\n<arg_value>  7 </arg_value>\n</tool_call>",
    # content, then text that is not a call after the calls (parse_assistant stops there)
    "Hi\n<tool_call>a</tool_call>\n\n<tool_call>b</tool_call>",
    "Hi\n<tool_call>a</tool_call> junk <tool_call>b</tool_call>",
    # a malformed call (bad name) is dropped, the next one kept
    "<tool_call>bad name\nx\n<arg_key>k</arg_key><arg_value>1</arg_value></tool_call>\n<tool_call>ok</tool_call>",
    # duplicate keys: the call is dropped
    "<tool_call>d<arg_key>k</arg_key><arg_value>1</arg_value><arg_key>k</arg_key><arg_value>2</arg_value></tool_call>",
    # a key whose </arg_key> is not followed by <arg_value> extends to the next one (parse_assistant's regex)
    "<tool_call>e<arg_key>k</arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",
    # a call never closed
    "text\n<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>abc",
    # stop token inside a value ends the message
    "<tool_call>f<arg_key>k</arg_key><arg_value>ab<|user|>c</arg_value></tool_call>",
    # partial tags that turn out to be text
    "<thinking> is not a tag, nor <tool_ nor </arg_value nor <|us",
    "\n<thi",
    "",
    "   \n ",
]


@pytest.mark.parametrize("text", ANCHORS)
def test_anchor_cases_every_two_piece_split(text):
    rng = random.Random(1)
    for mode in (True, False):
        for i in range(len(text) + 1):                       # every split point, so every partial tag
            _check(text, [text[:i], text[i:]], stream_arguments=mode)
        for chunks in _chunkings(text, rng):
            _check(text, chunks, stream_arguments=mode)


def test_random_tag_soups():
    """Malformed texts: stream_arguments=False equals parse_assistant exactly on all of them; the default
    equals it on content and reasoning always, and on tool calls whenever they are well formed."""
    rng = random.Random(2)
    alphabet = TAGS[:-3] * 3 + ["\n", " ", "a", "b c", "5", '"', "<", "|", "<|user|>", "{", "</think"]
    for _ in range(600):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16)))
        for chunks in list(_chunkings(text, rng, n_random=3)):
            for mode in (True, False):
                _check(text, chunks, stream_arguments=mode)


def test_holds_back_only_possible_tag_prefixes():
    p = StreamParser()
    assert p.feed("\nHel") == [{"content": "Hel"}]          # no <think>: content at once
    assert p.feed("lo <") == [{"content": "lo"}]            # " <" may start a tag (and the space may be stripped)
    assert p.feed("b> x") == [{"content": " <b> x"}]
    assert p.feed("\n<tool_") == []
    first = p.feed("call>get\n<arg_key>")                     # the name goes out as soon as it is complete
    assert first[0]["tool_calls"][0]["function"] == {"name": "get", "arguments": ""}
    assert p.feed("path</arg_key>\n<arg_value>/tmp/a b") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "/tmp/a b'}}]}]    # raw strings stream
    assert p.feed("</arg_value>\n<arg_key>n</arg_key>\n<arg_value>4") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '", "n": '}}]}]             # 4 may become 42
    assert p.feed("2</arg_value>\n</tool_call><|observation|>ignored") == [
        {"tool_calls": [{"index": 0, "function": {"arguments": "42}"}}]}]
    assert p.finish() == [] and p.tool_calls == 1
    assert p.parsed().tool_calls == [{"name": "get", "arguments": {"path": "/tmp/a b", "n": 42}}]
    r = StreamParser()
    assert r.feed("<think>a") == [{"reasoning_content": "a"}]
    assert r.feed(" tool_call </th") == [{"reasoning_content": " tool_call"}]
    assert r.feed("ink>\nyes") == [{"content": "yes"}]


def test_switches_and_errors():
    text = "<think>r</think>\nc\n<tool_call>f</tool_call>"
    (content, reasoning, calls), _ = _stream(text, list(text), thinking=False, tools=False)
    assert (content, reasoning, calls) == (text.strip(), "", [])
    (content, reasoning, calls), _ = _stream(text, [text], tools=False)
    assert (content, reasoning, calls) == ("c\n<tool_call>f</tool_call>", "r", [])
    p = StreamParser()
    with pytest.raises(TypeError, match="str"):
        p.feed(b"bytes")
    p.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        p.feed("x")
