"""GLM chat template (glm5_jax.data.chat): round trips for the three thinking modes with both tokenizer
back ends, loss masks and roles against hand-written transcripts, SFT samples, parser and errors."""

import io

import pytest

from glm5_jax.data.chat import (ROLE_IDS, ChatFormatError, ChatTemplate, canonical_messages, parse_assistant,
                                parse_conversation, sft_samples)

CORPUS = ["What is 2+3? Use the calculator. It says 5. Double it. The calculator expression 5*2 gives 10.\n",
          "kv_get key apple value 42. Look up the key. error: bad expression\n"] * 40


@pytest.fixture(scope="module", params=["hf", "spm"])
def tok(request, tmp_path_factory):
    from glm5_jax.data.tokenizer import TRAINER_OPTIONS, load_tokenizer, train_hf_tokenizer
    d = tmp_path_factory.mktemp(f"tok_{request.param}")
    if request.param == "hf":
        return train_hf_tokenizer(CORPUS, 360, str(d / "tokenizer.json"))
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=buf, vocab_size=330,
                                   hard_vocab_limit=False, minloglevel=2, **TRAINER_OPTIONS)
    (d / "chat.model").write_bytes(buf.getvalue())
    return load_tokenizer(str(d / "chat.model"))


def calc(expr):
    return [{"name": "calculator", "arguments": {"expression": expr}}]


def conversation(turn_two_thinking=True):
    """Two user turns; the second has an erroneous tool call kept in context (error=True)."""
    r = (lambda s: s) if turn_two_thinking else (lambda s: "")
    user2 = {"role": "user", "content": "Double it."}
    if not turn_two_thinking:
        user2["thinking"] = False
    return [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "reasoning": "Use the calculator.", "content": "", "tool_calls": calc("2+3")},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "reasoning": "It says 5.", "content": "5"},
        user2,
        {"role": "assistant", "reasoning": r("Look up the key."), "content": "", "tool_calls": calc("5*"),
         "error": True},
        {"role": "tool", "content": "error: bad expression"},
        {"role": "assistant", "reasoning": r("Use 5*2."), "content": "", "tool_calls": calc("5*2")},
        {"role": "tool", "content": "10"},
        {"role": "assistant", "reasoning": r("It says 10."), "content": "10"},
    ]


# ---------------------------------------------------------------- hand-written transcripts
U, A, T, X = ROLE_IDS["user"], ROLE_IDS["assistant"], ROLE_IDS["tool"], ROLE_IDS["template"]


def call_pieces(expr):
    return ["\n", "<tool_call>", "calculator", "\n", "<arg_key>", "expression", "</arg_key>", "\n", "<arg_value>",
            expr, "</arg_value>", "\n", "</tool_call>", "<|observation|>"]


def expected(mode):
    """(pieces, role, mask) blocks written out by hand for conversation(); a piece in SPECIAL is one token."""
    think_on = mode != "turn"
    keep_old = mode == "preserved"
    old = lambda s: ["<think>", s, "</think>"] if keep_old else ["<think>", "</think>"]
    old_mask = 1 if keep_old else 0               # shown reasoning != generated: not trained
    blocks = [
        (["[gMASK]", "<sop>"], X, 0),
        (["<|user|>", "\nWhat is 2+3?"], U, 0),
        (["<|assistant|>"], A, 0),
        (["\n"] + old("Use the calculator.") + call_pieces("2+3"), A, old_mask),
        (["\n", "<tool_response>", "\n5\n", "</tool_response>"], T, 0),
        (["<|assistant|>"], A, 0),
        (["\n"] + old("It says 5.") + ["\n5", "<|user|>"], A, old_mask),
        (["\nDouble it." + ("" if think_on else "/nothink")], U, 0),
    ]
    new = (lambda s: ["\n", "<think>", s, "</think>"]) if think_on else (lambda s: ["\n", "<think>", "</think>"])
    forced = not think_on        # thinking off: the empty think is prompt, not generated
    for reasoning, tail, mask in (("Look up the key.", call_pieces("5*"), 0),     # error=True: masked
                                  ("Use 5*2.", call_pieces("5*2"), 1),
                                  ("It says 10.", ["\n10", "<|user|>"], 1)):
        if forced:
            blocks += [(["<|assistant|>"] + new(reasoning), A, 0), (tail, A, mask)]
        else:
            blocks += [(["<|assistant|>"], A, 0), (new(reasoning) + tail, A, mask)]
        if tail[-1] == "<|observation|>":
            result = "error: bad expression" if reasoning.startswith("Look") else "10"
            blocks.append((["\n", "<tool_response>", "\n" + result + "\n", "</tool_response>"], T, 0))
    return blocks


def flatten(tok, blocks):
    from glm5_jax.data.chat import TEMPLATE_TOKENS
    ids, roles, mask = [], [], []
    for pieces, role, m in blocks:
        for p in pieces:
            t = [tok.special_id(p)] if p in TEMPLATE_TOKENS else tok.encode(p)
            ids += t
            roles += [role] * len(t)
            mask += [m] * len(t)
    return ids, roles, mask


@pytest.mark.parametrize("mode", ["interleaved", "preserved", "turn"])
def test_render_matches_hand_written_transcript(tok, mode):
    r = ChatTemplate(tok, mode).render(conversation(turn_two_thinking=mode != "turn"))
    ids, roles, mask = flatten(tok, expected(mode))
    assert r.ids == ids
    assert r.roles == roles
    assert r.loss_mask == mask


@pytest.mark.parametrize("mode", ["interleaved", "preserved", "turn"])
def test_round_trip(tok, mode):
    conv = conversation(turn_two_thinking=mode != "turn")
    t = ChatTemplate(tok, mode)
    got = parse_conversation(t.decode(t.render(conv).ids), mode)
    want = []
    for i, m in enumerate(conv):
        m = {k: v for k, v in m.items() if k != "error"}
        if m["role"] == "assistant" and i < 4 and mode != "preserved":
            m["reasoning"] = ""           # dropped from the context before the last user message
        want.append(m)
    assert got == want


def test_round_trip_argument_types_and_tools(tok):
    args = {"s": "5", "t": "true", "n": 5, "f": 2.5, "b": False, "l": [1, "x"], "d": {"k": None}, "w": "two words"}
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go"},
            {"role": "assistant", "reasoning": "r", "content": "calling",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": args}},
                            {"name": "g", "arguments": "{}"}]},
            {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
    t = ChatTemplate(tok, "preserved")
    r = t.render(conv, tools=[{"name": "f"}])
    got = parse_conversation(t.decode(r.ids), "preserved")
    assert got[0]["content"].startswith("Be brief.\n\n# Tools\n<tools>\n")
    assert got[2]["tool_calls"] == [{"name": "f", "arguments": args}, {"name": "g", "arguments": {}}]
    assert [m["content"] for m in got[3:]] == ["a", "b"]
    assert set(r.message_index) == {-1, 0, 1, 2, 3, 4}   # the caller's numbering


def test_sft_samples(tok):
    conv = conversation()
    inter = sft_samples(ChatTemplate(tok, "interleaved"), conv)
    pres = sft_samples(ChatTemplate(tok, "preserved"), conv)
    assert len(inter) == 2 and len(pres) == 1
    # turn 1 alone: its reasoning is shown and trained
    first = ChatTemplate(tok, "interleaved").render(conv[:4])
    assert inter[0].ids == first.ids and inter[0].loss_mask == first.loss_mask
    assert sum(first.loss_mask) > 0
    # turn 2: the full conversation, loss only from message 4 on (== the interleaved render's mask)
    full = ChatTemplate(tok, "interleaved").render(conv)
    assert inter[1].ids == full.ids and inter[1].loss_mask == full.loss_mask
    # every trained token of the interleaved samples is trained exactly once in the preserved sample
    assert sum(pres[0].loss_mask) == sum(inter[0].loss_mask) + sum(inter[1].loss_mask)


def test_generation_prompt_and_parse_generated(tok):
    t = ChatTemplate(tok, "turn")
    on = t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    off = t.render([{"role": "user", "content": "hi", "thinking": False}], add_generation_prompt=True)
    assert on.ids[-1] == tok.special_id("<|assistant|>") and sum(on.loss_mask) == 0
    assert t.decode(off.ids).endswith("/nothink<|assistant|>\n<think></think>")
    gen = "\n<think>add</think>\n<tool_call>calculator\n<arg_key>expression</arg_key>\n<arg_value>2+3</arg_value>" \
          "\n</tool_call><|observation|>junk"
    p = parse_assistant(gen)
    assert p.ok and p.stop == "<|observation|>" and p.reasoning == "add" and p.tool_calls == calc("2+3")
    assert t.stop_ids == tuple(tok.special_id(s) for s in ("<|user|>", "<|observation|>", "<|endoftext|>"))


@pytest.mark.parametrize("text,needle", [
    ("\n<think>never closed", "never closed"),
    ("<tool_call>f\n<arg_key>a</arg_key>\n</tool_call>", "malformed arguments"),
    ("<tool_call>f\n</tool_call>\ntrailing", "text after the tool calls"),
    ("<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>a</arg_key><arg_value>2</arg_value>"
     "</tool_call>", "given twice"),
    ("<tool_call>\n</tool_call>", "name"),
])
def test_parse_malformed_generations(text, needle):
    p = parse_assistant(text)
    assert not p.ok and any(needle in e for e in p.errors), p.errors
    with pytest.raises(ChatFormatError, match="does not fit"):
        parse_assistant(text, strict=True)


@pytest.mark.parametrize("messages,needle", [
    ([{"role": "bot", "content": "x"}], "role='bot' is invalid: allowed: system, user, assistant, tool"),
    ([{"role": "user", "content": "x", "name": "n"}], "unknown keys ['name']"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": "{bad"}]}],
     "tool_calls[0].arguments is not valid JSON"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"name": "f", "arguments": [1]}]}],
     "must be a JSON object"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"arguments": {}}]}], ".name=None"),
    ([{"role": "user", "content": "say <|user|>"}], "template token '<|user|>'"),
    ([{"role": "assistant", "content": "x"}], "must follow a user or tool message"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}], "must follow an assistant message"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "may only come first"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": calc("1")},
      {"role": "user", "content": "y"}], "results (role 'tool') must come next"),
    ([{"role": "user", "content": "x", "thinking": False}], "needs mode='turn'"),
    ([], "non-empty list"),
])
def test_bad_messages_raise_clear_errors(messages, needle):
    with pytest.raises(ChatFormatError) as e:
        canonical_messages(messages, "interleaved")
    assert needle in str(e.value)


def test_bad_template_settings(tok):
    with pytest.raises(ChatFormatError, match="mode='fast' is invalid: allowed: interleaved, preserved, turn"):
        ChatTemplate(tok, "fast")

    class NoSpecials:
        def special_id(self, name):
            raise KeyError(name)
    with pytest.raises(ChatFormatError, match="lacks the chat template token"):
        ChatTemplate(NoSpecials())
    t = ChatTemplate(tok, "turn")
    with pytest.raises(ChatFormatError, match="answers a thinking=False turn"):
        t.render([{"role": "user", "content": "x", "thinking": False}, {"role": "assistant", "reasoning": "r"}])
    with pytest.raises(ChatFormatError, match="add_generation_prompt needs"):
        t.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], add_generation_prompt=True)
    with pytest.raises(ChatFormatError, match="starts with"):
        parse_conversation("<|user|>\nx")
