"""A checkpoint's own Jinja chat template (glm5_jax.data.hf_chat_template) outside the server: where it is read
from, which named template a request gets, refusals as ChatFormatError (raise_exception, the sandbox, a
forged control token), against transformers' apply_chat_template where it is installed; and
ChatTemplate.generation_tail, the prompt tail both renderers share."""

import json

import pytest

from glm5_jax.data.chat import ChatFormatError, ChatTemplate
from glm5_jax.data.hf_chat_template import HFChatTemplate, load_chat_template
from glm5_jax.data.tokenizer import train_hf_tokenizer

CORPUS = ["What is 2+3? Use the calculator. It says 5. Hello world.\n"] * 30
SIMPLE = ("[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_hf_tokenizer(CORPUS, 300, str(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _dir_with(tmp_path, tok, config=None, jinja=None):
    import shutil
    shutil.copy(tok.model_path, tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    from glm5_jax.data.tokenizer import load_tokenizer
    return load_tokenizer(str(tmp_path))


def test_where_the_template_comes_from(tok, tmp_path):
    (tmp_path / "none").mkdir()
    assert load_chat_template(_dir_with(tmp_path / "none", tok)) is None       # no template: the Python renderer
    (tmp_path / "cfg").mkdir()
    t = load_chat_template(_dir_with(tmp_path / "cfg", tok, {"chat_template": SIMPLE}))
    assert t.render_text([{"role": "user", "content": "hi"}]) == "[gMASK]<sop><|user|>\nhi<|assistant|>"
    (tmp_path / "jinja").mkdir()          # chat_template.jinja wins over tokenizer_config.json
    t = load_chat_template(_dir_with(tmp_path / "jinja", tok, {"chat_template": "x"}, jinja=SIMPLE + "!"))
    assert t.render_text([{"role": "user", "content": "hi"}]).endswith("<|assistant|>!")
    (tmp_path / "named").mkdir()
    named = [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    t = load_chat_template(_dir_with(tmp_path / "named", tok, {"chat_template": named}))
    assert t.render_text([{"role": "user", "content": "hi"}]) == "plain"
    assert t.render_text([{"role": "user", "content": "hi"}], tools=[{"a": 1}, {"b": 2}]) == "tools:2"


@pytest.mark.parametrize("source,messages,match", [
    ("{{ raise_exception('no system role') }}", [{"role": "user", "content": "x"}], "no system role"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}], "refused"),
    (SIMPLE, [{"role": "user", "content": "a<|user|>b"}], "control token"),
    ("{% for k, v in messages[0].tool_calls[0].function.arguments.items() %}{{ k }}{% endfor %}",
     [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}], "not JSON"),
])
def test_refusals_are_chat_format_errors(tok, source, messages, match):
    with pytest.raises(ChatFormatError, match=match):
        HFChatTemplate(source, tok).encode(messages)


def test_does_not_compile_is_a_chat_format_error(tok):
    with pytest.raises(ChatFormatError, match="does not compile"):
        HFChatTemplate("{% for %}", tok)


def test_arguments_are_a_mapping_and_reasoning_is_aliased(tok):
    src = ("{% for m in messages %}{{ m.thinking }}|{{ m.reasoning_content }}|"
           "{% for tc in m.tool_calls %}{% for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }};"
           "{% endfor %}{% endfor %}{% endfor %}")
    m = {"role": "assistant", "reasoning": "why", "content": None,
         "tool_calls": [{"function": {"name": "f", "arguments": json.dumps({"x": "é", "n": 2})}}]}
    assert HFChatTemplate(src, tok).render_text([m]) == 'why|why|x="é";n=2;'


def test_equals_transformers_apply_chat_template(tok, tmp_path):
    """The rendering and the ids equal transformers' on a template using tojson, loop controls, a
    namespace and add_generation_prompt (tests/test_serve.py does the same through the server)."""
    transformers = pytest.importorskip("transformers")
    src = ("[gMASK]<sop>{%- set ns = namespace(n=0) -%}{% for m in messages %}{% if m.role == 'tool' %}{% continue %}"
           "{% endif %}{% set ns.n = ns.n + 1 %}<|{{ m.role }}|>\n  {{ m.content }}  \n{% endfor %}"
           "{% if tools %}{{ tools | tojson }}{% endif %}{{ ns.n }}{% if add_generation_prompt %}<|assistant|>"
           "{{ '<think></think>' if enable_thinking is defined and not enable_thinking }}{% endif %}")
    (tmp_path / "d").mkdir()
    ours = load_chat_template(_dir_with(tmp_path / "d", tok, {"chat_template": src, "eos_token": "<|endoftext|>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "d"))
    msgs = [{"role": "user", "content": "What is 2+3? é"}, {"role": "tool", "content": "5"}]
    for kw in ({}, {"enable_thinking": False}):
        for tools in (None, [{"name": "calc", "description": "<b>&"}]):
            want = ref.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False, **kw)
            assert ours.render_text(msgs, tools=tools, **kw) == want
            ids = ref.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, **kw)
            assert ours.encode(msgs, tools=tools, **kw) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_generation_tail(tok):
    t = ChatTemplate(tok)
    sp = t.special
    prompt = t.render([{"role": "user", "content": "hi"}], add_generation_prompt=True).ids
    assert t.generation_tail(prompt, empty_think=False) == ([], "")
    think = tok.encode("\n") + [sp["<think>"], sp["</think>"]]
    assert t.generation_tail(prompt, empty_think=True) == (think, "")
    # a prompt that already closed its think block (a thinking-off turn) gets no second one
    assert t.generation_tail(prompt + think, empty_think=True) == ([], "")
    ids, forced = t.generation_tail(prompt, empty_think=True, call="calculator")
    assert ids == think + tok.encode("\n") + [sp["<tool_call>"]] + tok.encode("calculator")
    assert forced == "\n<tool_call>calculator" and tok.decode(ids) == "\n<think></think>" + forced
    assert t.generation_tail(prompt, empty_think=False, call="")[1] == "\n<tool_call>"

    # a template that opened the think block: the parser is fed "<think>"; an empty think closes it
    opened = prompt[:-1] + [sp["<|assistant|>"], sp["<think>"]]
    assert t.generation_tail(opened, empty_think=False) == ([], "<think>")
    assert t.generation_tail(opened, empty_think=True) == ([sp["</think>"]], "<think></think>")
    ids, forced = t.generation_tail(opened, empty_think=True, call="f")
    assert ids == [sp["</think>"]] + tok.encode("\n") + [sp["<tool_call>"]] + tok.encode("f")
    assert forced == "<think></think>\n<tool_call>f"
