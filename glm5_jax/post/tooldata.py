"""A synthetic multi-turn tool-use dataset: arithmetic solved with a calculator tool, key-value lookups
with a kv tool, both chained, with short reasoning before every tool call and reply (interleaved
thinking), follow-up user turns, and erroneous tool calls kept in context but marked ``error``.

Every conversation carries its own environment (the kv store), so held-out conversations can be
replayed against the model: the tools are executed (``execute_tool``) and their results fed back.

Kinds (``KINDS``):
  calc     "What is 37*12+5?"          -> calculator(expression) -> "449" -> "449"
  kv       "What is the value of owl?" -> kv_get(key)            -> "731" -> "731"
  kv_calc  "What is owl plus 12?"      -> kv_get(key) -> calculator("731+12") -> "743"
A conversation gets a follow-up user turn with probability ``p_followup`` ("Now multiply it by 3."
-> calculator -> answer), and its first tool call is wrong with probability ``p_error`` (a dangling
operator or a misspelt key; the tool answers with an error, the next message retries correctly).

Split: ``heldout(n, seed)`` draws n conversations with distinct first questions from a seed stream
that training never uses; training draws (``make_conversation`` from SFTIterator's per-batch rngs)
exclude those questions (``Conversation.prompt``).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Dict, List, Optional

from glm5_jax.rl.tasks import safe_eval_arith

__all__ = ["KINDS", "TOOLS", "Conversation", "execute_tool", "heldout", "make_conversation", "tokenizer_texts"]

KINDS = ("calc", "kv", "kv_calc")
TOOLS = (
    {"name": "calculator", "description": "evaluate an integer arithmetic expression",
     "parameters": {"expression": "string"}},
    {"name": "kv_get", "description": "the value stored under a key", "parameters": {"key": "string"}},
)
TOOL_ARGS = {t["name"]: tuple(t["parameters"]) for t in TOOLS}
WORDS = ("owl", "river", "apple", "stone", "cloud", "maple", "tiger", "lemon", "frost", "amber", "coral", "delta",
         "ember", "flint", "grape", "honey", "ivory", "jade", "koala", "lilac", "mango", "nectar", "olive", "pearl",
         "quartz", "raven", "sage", "tulip", "umber", "violet", "willow", "yarrow", "zinc", "birch", "cedar",
         "daisy", "fern", "garnet", "hazel", "iris")
FOLLOWUPS = (("multiply it by {n}", "*"), ("add {n} to it", "+"), ("subtract {n} from it", "-"))


@dataclasses.dataclass
class Conversation:
    kind: str
    prompt: str                      # the split key: the first question (+ the store for kv kinds)
    messages: List[dict]             # the gold conversation (reasoning, tool calls, errors marked)
    user_turns: List[str]            # the user messages, in order
    answers: List[str]               # the expected reply of each user turn
    store: Dict[str, int]            # the kv tool's environment


def execute_tool(call: dict, store: Dict[str, int]) -> str:
    """Run one parsed tool call {"name", "arguments"} against ``store``; problems come back as
    "error: ..." results (as an environment would answer), never as exceptions."""
    name, args = call.get("name"), call.get("arguments", {})
    if name not in TOOL_ARGS:
        return f"error: unknown tool {name}"
    if set(args) != set(TOOL_ARGS[name]):
        return f"error: {name} takes {', '.join(TOOL_ARGS[name])}"
    if name == "calculator":
        try:
            v = safe_eval_arith(str(args["expression"]))
        except (ValueError, ZeroDivisionError, SyntaxError, TypeError):
            return "error: invalid expression"
        return str(int(v)) if v.denominator == 1 else "error: not an integer"
    key = str(args["key"])
    return str(store[key]) if key in store else "error: unknown key"


def _expr(rng: random.Random) -> str:
    """a op b [op c] with a positive value (a follow-up feeds it back to the calculator, which has no
    unary minus)."""
    while True:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice("+-*")
        e = f"{a}{op}{b}"
        if rng.random() < 0.5:
            e += f"{rng.choice('+-')}{rng.randint(2, 99)}"
        if safe_eval_arith(e) > 0:
            return e


def _call(name: str, **args) -> List[dict]:
    return [{"name": name, "arguments": args}]


def _tool_round(msgs: List[dict], reasoning: str, call: List[dict], store) -> str:
    msgs.append({"role": "assistant", "reasoning": reasoning, "content": "", "tool_calls": call})
    result = execute_tool(call[0], store)
    msgs.append({"role": "tool", "content": result})
    return result


def _wrong(call: List[dict], rng: random.Random, store) -> List[dict]:
    """An erroneous version of a call, one the tool rejects: the expression gets a dangling operator
    (as if cut short), or the key loses a letter."""
    c = dict(call[0], arguments=dict(call[0]["arguments"]))
    if "expression" in c["arguments"]:
        c["arguments"]["expression"] += rng.choice("+-*")
    else:
        k = c["arguments"]["key"]
        i = rng.randrange(len(k))
        c["arguments"]["key"] = k[:i] + k[i + 1:]
        if c["arguments"]["key"] in store:
            c["arguments"]["key"] += "x"
    return [c]


def make_conversation(rng: random.Random, kind: Optional[str] = None, p_followup: float = 0.3,
                      p_error: float = 0.15) -> Conversation:
    kind = kind or rng.choice(KINDS)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is invalid: allowed: {', '.join(KINDS)}")
    keys = rng.sample(WORDS, 3)
    store = {k: rng.randint(10, 999) for k in keys}
    key = keys[0]
    msgs: List[dict] = []
    err = rng.random() < p_error

    def first_call(reasoning, call):
        if err:      # kept in context, masked from the loss; the retry is trained
            bad = _wrong(call, rng, store)
            msgs.append({"role": "assistant", "reasoning": reasoning, "content": "", "tool_calls": bad,
                         "error": True})
            msgs.append({"role": "tool", "content": execute_tool(bad[0], store)})
            reasoning = "That failed. Retry."
        return _tool_round(msgs, reasoning, call, store)

    if kind == "calc":
        e = _expr(rng)
        q = f"What is {e}?"
        msgs.append({"role": "user", "content": q})
        value = first_call(f"Compute {e}.", _call("calculator", expression=e))
    elif kind == "kv":
        q = f"What is the value of {key}?"
        msgs.append({"role": "user", "content": q})
        value = first_call(f"Look up {key}.", _call("kv_get", key=key))
    else:
        n = rng.randint(2, 99)
        q = f"What is {key} plus {n}?"
        msgs.append({"role": "user", "content": q})
        v = first_call(f"Look up {key}.", _call("kv_get", key=key))
        value = _tool_round(msgs, f"Compute {v}+{n}.", _call("calculator", expression=f"{v}+{n}"), store)
    msgs.append({"role": "assistant", "reasoning": f"The result is {value}.", "content": value})
    users, answers = [q], [value]
    if rng.random() < p_followup:
        text, op = rng.choice(FOLLOWUPS)
        n = rng.randint(2, 9)
        u = f"Now {text.format(n=n)}."
        msgs.append({"role": "user", "content": u})
        e = f"{value}{op}{n}"
        value = _tool_round(msgs, f"Compute {e}.", _call("calculator", expression=e), store)
        msgs.append({"role": "assistant", "reasoning": f"The result is {value}.", "content": value})
        users.append(u)
        answers.append(value)
    # the split key: a calc question fixes its answer; a kv question's answer also depends on the store
    key_text = q if kind == "calc" else f"{q} {sorted(store.items())}"
    return Conversation(kind, key_text, msgs, users, answers, store)


def heldout(n: int, seed: int, **kw) -> List[Conversation]:
    """n conversations with distinct first questions from the held-out seed stream (never used in training)."""
    rng = random.Random(f"heldout-{seed}")
    seen, out = set(), []
    while len(out) < n:
        c = make_conversation(rng, **kw)
        if c.prompt not in seen:
            seen.add(c.prompt)
            out.append(c)
    return out


def tokenizer_texts(n: int, seed, **kw) -> List[str]:
    """Plain texts of ``n`` synthetic conversations from stream ``f"tokenizer-{seed}"`` (make_conversation
    ``kw``) to train a tokenizer on: every message's reasoning and content, tool names and arguments,
    without template tokens (those are the tokenizer's added tokens)."""
    rng = random.Random(f"tokenizer-{seed}")
    out = []
    for _ in range(n):
        c = make_conversation(rng, **kw)
        parts = []
        for m in c.messages:
            parts += ["\n" + m.get("reasoning", ""), "\n" + m["content"]]
            for tc in m.get("tool_calls", ()):
                parts += ["\n" + tc["name"]] + [f"\n{k}\n{v}" for k, v in tc["arguments"].items()]
        out.append("".join(parts))
    return out
