"""Chat SFT: packing rendered samples with their loss masks (rl.sft.pack_examples), the synthetic tool-use
dataset (post.tooldata), the conversation player (post.agent) with a scripted generator, and the loss the
one train step computes on a packed chat batch."""

import dataclasses
import random

import numpy as np
import pytest

from glm5_jax.data.chat import ChatTemplate, sft_samples
from glm5_jax.post import agent
from glm5_jax.post.tooldata import TOOL_ARGS, execute_tool, heldout, make_conversation
from glm5_jax.rl.sft import SFTIterator, pack_examples


@dataclasses.dataclass
class Sample:
    ids: list
    loss_mask: list


def test_pack_rendered_samples_hand_checked():
    a = Sample([5, 6, 7, 8], [0, 0, 1, 1])
    b = Sample([9, 10, 11], [0, 1, 0])
    c = ([3, 4], [2])                               # a (prompt, answer) pair packs alongside
    out = pack_examples([a, b, c, a], batch_size=2, seq_len=7)
    np.testing.assert_array_equal(out["tokens"], [[5, 6, 7, 8, 9, 10, 11], [3, 4, 2, 5, 6, 7, 8]])
    np.testing.assert_array_equal(out["targets"], [[6, 7, 8, 0, 10, 11, 0], [4, 2, 0, 6, 7, 8, 0]])
    # position j is trained iff token j+1 is: a -> [0,1,1,-], b -> [1,0,-], c -> [0,1,-]
    np.testing.assert_array_equal(out["loss_mask"], [[0, 1, 1, 0, 1, 0, 0], [0, 1, 0, 0, 1, 1, 0]])
    np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 1, 2, 2, 2], [3, 3, 3, 4, 4, 4, 4]])
    np.testing.assert_array_equal(out["positions"], [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="3 ids but 2 loss_mask"):
        pack_examples([Sample([1, 2, 3], [0, 1])], 1, 8)
    with pytest.raises(ValueError, match="does not fit seq_len=2"):
        pack_examples([a], 1, 2)


def test_tool_dataset_is_consistent():
    rng = random.Random(0)
    errors = 0
    for _ in range(200):
        c = make_conversation(rng)
        store, answers, prev = c.store, [], None
        for i, m in enumerate(c.messages):
            if m["role"] == "tool":   # every gold tool result is what the tool returns for the call
                assert m["content"] == execute_tool(prev["tool_calls"][0], store)
            if m["role"] == "assistant" and not m.get("tool_calls"):
                answers.append(m["content"])
            if m.get("error"):       # an erroneous call gets an error result and is retried
                errors += 1
                assert c.messages[i + 1]["content"].startswith("error:")
                assert c.messages[i + 2]["tool_calls"] != m["tool_calls"]
            prev = m
        assert answers == c.answers and len(c.user_turns) == len(answers)
    assert 10 < errors < 60                       # p_error = 0.15
    h = heldout(50, seed=3)
    assert len({c.prompt for c in h}) == 50 and [c.prompt for c in h] == [c.prompt for c in heldout(50, seed=3)]
    assert execute_tool({"name": "calculator", "arguments": {"expression": "2+3*4"}}, {}) == "14"
    assert execute_tool({"name": "calculator", "arguments": {"expression": "2+"}}, {}) == "error: invalid expression"
    assert execute_tool({"name": "kv_get", "arguments": {"key": "x"}}, {"x": 7}) == "7"
    assert execute_tool({"name": "kv_get", "arguments": {"k": "x"}}, {}).startswith("error: kv_get takes key")
    assert execute_tool({"name": "rm", "arguments": {}}, {}) == "error: unknown tool rm"


class CharTok:
    """A character tokenizer with the GLM specials (the contract's interface), for scripted decoding."""
    def __init__(self):
        from glm5_jax.data.chat import TEMPLATE_TOKENS
        self.specials = {t: i for i, t in enumerate(TEMPLATE_TOKENS)}
        self.names = {i: t for t, i in self.specials.items()}

    def special_id(self, name):
        return self.specials[name]

    def encode(self, text):
        return [100 + ord(ch) for ch in text]

    def decode(self, ids):
        return "".join(self.names[i] if i in self.names else chr(i - 100) for i in ids)


def test_sft_iterator_with_chat_samples():
    t = ChatTemplate(CharTok(), "interleaved")
    exclude = {c.prompt for c in heldout(20, seed=0)}
    seen = []

    def sampler(rng):
        c = make_conversation(rng)
        seen.append(c.prompt)
        return c
    it = SFTIterator(sampler, None, 2, 1024, seed=1, exclude=exclude, encode=lambda c: sft_samples(t, c.messages))
    b1 = it.batch(5)
    assert not exclude & set(seen)
    np.testing.assert_array_equal(b1["tokens"], it.batch(5)["tokens"])     # batch i is a function of (seed, i)
    assert b1["loss_mask"].sum() > 0 and b1["loss_mask"].sum() < (b1["segment_ids"] > 0).sum()


def test_play_conversations_with_scripted_model(monkeypatch):
    """Feeding each gold assistant message as the 'generation' reproduces the gold answers, and a
    malformed or stop-less generation ends the conversation with that status."""
    from glm5_jax.infer import GenerateResult
    tok = CharTok()
    t = ChatTemplate(tok, "interleaved")
    convs = heldout(12, seed=1, p_followup=0.5, p_error=0.3)
    script = {}
    for c in convs:      # prompt ids -> gold next message ids
        for k, m in enumerate(c.messages):
            if m["role"] == "assistant":
                prompt = t.render(c.messages[:k], add_generation_prompt=True).ids
                script[tuple(prompt)] = t.render(c.messages[:k + 1]).ids[len(prompt):]
    obs = tok.special_id("<|observation|>")
    broken = {convs[0].user_turns[0]: tok.encode("\n<think>x</think>\n<tool_call>calculator\n<arg_key>e") + [obs],
              convs[1].user_turns[0]: tok.encode("\n<think>x</think>\n12")}          # no stop token

    def fake_generate(cfg, params, prompts, *, max_new_tokens, stop_tokens, max_len, **kw):
        outs = []
        for p in prompts:
            text = tok.decode(p)
            bad = next((v for q, v in broken.items() if text.endswith(q + "<|assistant|>")), None)
            outs.append(bad if bad is not None else script.get(tuple(p), [1]))
        toks = np.zeros((len(prompts), max_new_tokens), np.int32)
        lens = np.zeros(len(prompts), np.int32)
        reasons = []
        for i, o in enumerate(outs):
            o = o[:max_new_tokens]
            toks[i, :len(o)] = o
            lens[i] = len(o)
            reasons.append("stop" if o and o[-1] in stop_tokens else "length")
        return GenerateResult(toks, np.zeros_like(toks, np.float32), lens, reasons)

    monkeypatch.setattr(agent, "generate", fake_generate)
    res = agent.run_conversations(None, None, t, convs, execute=execute_tool, tool_args=TOOL_ARGS,
                                  max_new_tokens=200, max_len=4096)
    assert res[0].status == "malformed" and res[1].status == "truncated"
    assert all(r.status == "done" and r.success and r.answers == c.answers for r, c in zip(res[2:], convs[2:]))
    s = agent.summarize(res)
    assert s["task_success"] == pytest.approx(10 / 12) and s["tool_call_valid"] == pytest.approx(10 / 12)
    assert s["statuses"] == {"done": pytest.approx(10 / 12), "malformed": pytest.approx(1 / 12),
                             "truncated": pytest.approx(1 / 12)}


@pytest.mark.slow      # compiles the train step (~30 s unloaded)
def test_train_step_loss_is_masked_ce_on_assistant_tokens():
    """The one train step's cross-entropy on a packed chat batch equals a numpy masked CE computed from
    the model's logits, and targets at masked positions do not change it."""
    import jax
    from glm5_jax.config import ModelConfig
    from glm5_jax.model import GLM5
    from glm5_jax.train import TrainConfig
    from glm5_jax.train.state import init_train_state
    from glm5_jax.train.step import make_train_step

    t = ChatTemplate(CharTok(), "preserved")
    convs = heldout(2, seed=0, p_followup=0.0, p_error=0.0)
    samples = [s for c in convs for s in sft_samples(t, c.messages)]
    batch = pack_examples(samples, 2, 192)
    batch["tokens"] = batch["tokens"] % 256
    batch["targets"] = batch["targets"] % 256
    mcfg = ModelConfig(vocab_size=256, d_model=32, num_layers=1, ffn_dim=64, attention="mla", num_heads=2,
                       q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                       num_experts=0, mtp_depth=0, attn_chunk=64)
    tc = TrainConfig(steps=1, batch_size=2, seq_len=192, weight_decay=0.0)
    state, tx = init_train_state(mcfg, tc)
    params = jax.tree.map(np.asarray, state["params"])
    logits = np.asarray(GLM5(mcfg).apply({"params": params}, batch["tokens"], batch["positions"],
                                         batch["segment_ids"])["logits"], np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = lse - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
    m = batch["loss_mask"]
    want = (nll * m).sum() / m.sum()
    step = make_train_step(mcfg, tc, tx)
    _, metrics = step(state, batch)
    assert float(metrics["ce"]) == pytest.approx(want, rel=1e-4)
    scrambled = dict(batch, targets=np.where(m > 0, batch["targets"], (batch["targets"] + 7) % 256))
    state2, _ = init_train_state(mcfg, tc)
    _, metrics2 = step(state2, scrambled)
    assert float(metrics2["ce"]) == pytest.approx(float(metrics["ce"]), rel=1e-6)
