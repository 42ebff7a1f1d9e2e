"""Run a chat model on tool-use conversations: generate (glm5_jax.infer.generate), parse the reply
(glm5_jax.data.chat), execute its tool calls, feed the results back, and score the final answers.

Every round renders each active conversation with the generation prompt and decodes all of them in
one batch (greedy by default). Shapes are kept few so the jitted prefill/decode compile a handful of
times: the batch always has every conversation plus one filler row (finished conversations decode a
one-token filler prompt), the filler row's length rounds the prompt width up to a multiple of
``bucket``, and the cache size is fixed (``max_len``).

The model's messages are appended as parsed and re-rendered next round (earlier turns' reasoning is
dropped by the template in interleaved/turn mode, so the context is re-rendered anyway); within a turn
this re-tokenises generated text, which can differ from the generated ids when the model produced a
non-canonical split. Evaluation only; an RL trainer must keep the generated ids (TITO).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence

from glm5_jax.agentic.context import ContextPolicy, template_token_counter
from glm5_jax.data.chat import ChatFormatError, ChatTemplate
from glm5_jax.infer import generate

__all__ = ["ConversationResult", "run_conversations", "summarize"]


@dataclasses.dataclass
class ConversationResult:
    status: str                    # "done" | "malformed" | "truncated" | "too_many_steps" | "context"
    answers: List[str]             # the model's reply to each user turn it reached
    success: bool                  # every expected answer given, in order
    tool_calls: int                # tool calls emitted
    valid_calls: int               # of which well formed: known tool, exactly its arguments
    attempted_calls: int           # <tool_call> openings generated (parsed or not)
    malformed_messages: int        # messages that did not parse
    messages: list                 # the conversation as played
    last_text: str = ""            # the last generated message, as decoded (shows how a failure looked)


def _valid_call(call: dict, tool_args: dict) -> bool:
    return call["name"] in tool_args and set(call["arguments"]) == set(tool_args[call["name"]])


def run_conversations(model_cfg, params, template: ChatTemplate, conversations: Sequence, *,
                      execute: Callable[[dict, object], str], tool_args: dict, max_new_tokens: int = 48,
                      max_steps: int = 8, max_len: int = 384, bucket: int = 64, temperature: float = 0.0,
                      seed: int = 0, context: Optional[ContextPolicy] = None) -> List[ConversationResult]:
    """Play each conversation (``.user_turns``, ``.answers``, ``.store``) against the model.

    execute(call, store) -> result text; tool_args: {tool name: argument names} for validity.
    A conversation ends "done" after its last user turn's reply, or fails: "malformed" (a reply that
    does not parse or cannot be rendered back), "truncated" (max_new_tokens without a stop token),
    "too_many_steps" (more than max_steps assistant messages) or "context" (prompt + max_new_tokens
    would pass max_len).
    context: what the model sees each round (keep-recent-k / HCM, glm5_jax.agentic.context); None = the
    full history. ``ConversationResult.messages`` always holds the full history.
    """
    msgs = [[{"role": "user", "content": c.user_turns[0]}] for c in conversations]
    state = [dict(status=None, answers=[], turn=0, steps=0, calls=0, valid=0, attempted=0, malformed=0, text="")
             for _ in conversations]
    filler = [template.special["[gMASK]"]]
    count = template_token_counter(template) if context is not None else None
    round_ = 0
    while any(s["status"] is None for s in state):
        prompts = []
        for i, s in enumerate(state):
            if s["status"] is None:
                shown = context.apply(msgs[i], count) if context is not None else msgs[i]
                ids = template.render(shown, add_generation_prompt=True).ids
                if len(ids) + max_new_tokens > max_len:
                    s["status"] = "context"
                    ids = filler
                prompts.append(ids)
            else:
                prompts.append(filler)
        width = max(len(p) for p in prompts)
        width = min(-(-width // bucket) * bucket, max_len - max_new_tokens)
        prompts.append(filler * width)
        res = generate(model_cfg, params, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                       seed=seed + round_, stop_tokens=template.stop_ids, max_len=max_len)
        round_ += 1
        for i, s in enumerate(state):
            if s["status"] is not None:
                continue
            c = conversations[i]
            gen = res.tokens[i, :res.lengths[i]]
            text = template.decode(gen)
            p = template.parse(gen)
            s["steps"] += 1
            s["text"] = text
            s["attempted"] += text.count("<tool_call>")
            if res.finish_reasons[i] != "stop":
                s["status"] = "truncated"
                continue
            if not p.ok:
                s["malformed"] += 1
                s["status"] = "malformed"
                continue
            msg = p.as_message()
            try:
                template.render(msgs[i] + [msg])      # can the reply be put back in the context?
            except ChatFormatError:
                s["malformed"] += 1
                s["status"] = "malformed"
                continue
            msgs[i].append(msg)
            if p.tool_calls:
                s["calls"] += len(p.tool_calls)
                s["valid"] += sum(_valid_call(tc, tool_args) for tc in p.tool_calls)
                msgs[i] += [{"role": "tool", "content": execute(tc, c.store)} for tc in p.tool_calls]
            else:
                s["answers"].append(p.content)
                s["turn"] += 1
                if s["turn"] == len(c.user_turns):
                    s["status"] = "done"
                    continue
                msgs[i].append({"role": "user", "content": c.user_turns[s["turn"]]})
            if s["steps"] >= max_steps:
                s["status"] = "too_many_steps"
    out = []
    for i, s in enumerate(state):
        c = conversations[i]
        out.append(ConversationResult(
            status=s["status"], answers=s["answers"], success=s["status"] == "done" and s["answers"] == list(c.answers),
            tool_calls=s["calls"], valid_calls=s["valid"], attempted_calls=s["attempted"],
            malformed_messages=s["malformed"], messages=msgs[i], last_text=s["text"]))
    return out


def summarize(results: Sequence[ConversationResult]) -> dict:
    """Fractions over conversations: task_success; tool_call_valid (made at least one tool call, every
    message parsed and every call well formed); statuses; per-call well-formed rate."""
    n = max(len(results), 1)
    statuses = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    attempted = sum(r.attempted_calls for r in results)
    return {
        "task_success": sum(r.success for r in results) / n,
        "tool_call_valid": sum(r.tool_calls > 0 and r.valid_calls == r.tool_calls and r.malformed_messages == 0
                               and r.attempted_calls == r.tool_calls for r in results) / n,
        "calls_per_conversation": sum(r.tool_calls for r in results) / n,
        "wellformed_call_rate": (sum(r.valid_calls for r in results) / attempted) if attempted else None,
        "statuses": {k: v / n for k, v in sorted(statuses.items())},
        "n": len(results),
    }

