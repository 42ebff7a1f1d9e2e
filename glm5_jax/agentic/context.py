"""Context management for long agent runs (GLM5_SPEC.md section 3; issue 17 item 5): pure functions
over a chat message list (glm5_jax.data.chat format) that decide what the model sees next.

A *tool round* is an assistant message with ``tool_calls`` plus the ``tool`` messages that follow it
(parallel calls are one round; a round marked ``"error": True`` is a round like any other).

  keep_recent(messages, k=5)       the last k rounds stay as they are; the tool results of every
                                   earlier round are replaced by ``PLACEHOLDER`` (the calls stay, so the
                                   model still sees what it did), or with ``drop=True`` the earlier
                                   rounds are removed whole
  discard_tool_history(messages)   every round removed: user turns, system prompt and final replies stay
  hcm(messages, count_tokens, threshold, k=5)
                                   hierarchical: keep_recent first; if the result still counts more than
                                   ``threshold`` tokens, discard all tool history (the paper's threshold
                                   is 32K tokens)

``ContextPolicy`` bundles the choice for an agent loop (``kind`` "full" | "keep_recent" | "hcm").

Every function returns a new list and never mutates its input (messages it changes are copies), so
the full history stays available to the caller (for logging, or for the trainer). The result is
always a valid conversation for ``ChatTemplate.render``: removing a round leaves the message before it
(user or tool) followed by the assistant message after it, an order the template accepts.

Known consequence of HCM, as specified: discarding *all* tool history also removes the latest
observation, so after a discard the agent restarts the task from the user turns (the behaviour
DeepSeek-V3.2 calls discard-all, which HCM falls back to). Context management changes the prompt, so
under TITO a managed context starts a new sample prefix; it is a test-time / rollout option, not a
change of the trained tokens of earlier turns.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

__all__ = ["PLACEHOLDER", "KINDS", "ContextPolicy", "discard_tool_history", "hcm", "keep_recent",
           "template_token_counter", "tool_rounds"]

PLACEHOLDER = "[earlier tool result omitted]"
KINDS = ("full", "keep_recent", "hcm")

TokenCounter = Callable[[Sequence[dict]], int]


def tool_rounds(messages: Sequence[dict]) -> List[Tuple[int, int]]:
    """[start, end) index ranges of the tool rounds, in order."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") == "assistant" and m.get("tool_calls"):
            j = i + 1
            while j < len(messages) and messages[j].get("role") == "tool":
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k={k!r} is invalid: must be an int >= 0 (rounds to keep)")
    return k


def keep_recent(messages: Sequence[dict], k: int = 5, *, placeholder: str = PLACEHOLDER,
                drop: bool = False) -> List[dict]:
    """Keep the last ``k`` tool rounds; earlier rounds get their tool results replaced by
    ``placeholder`` (or, with ``drop``, are removed whole)."""
    k = _check_k(k)
    rounds = tool_rounds(messages)
    old = rounds[:max(len(rounds) - k, 0)]
    if not old:
        return list(messages)
    remove, blank = set(), set()
    for s, e in old:
        if drop:
            remove.update(range(s, e))
        else:
            blank.update(range(s + 1, e))
    out = []
    for i, m in enumerate(messages):
        if i in remove:
            continue
        out.append(dict(m, content=placeholder) if i in blank else m)
    return out


def discard_tool_history(messages: Sequence[dict]) -> List[dict]:
    """All tool rounds removed."""
    gone = {i for s, e in tool_rounds(messages) for i in range(s, e)}
    return [m for i, m in enumerate(messages) if i not in gone]


def hcm(messages: Sequence[dict], count_tokens: TokenCounter, threshold: int, k: int = 5, *,
        placeholder: str = PLACEHOLDER) -> List[dict]:
    """keep_recent(k); then, if that context has more than ``threshold`` tokens, no tool history at all."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold <= 0:
        raise ValueError(f"threshold={threshold!r} is invalid: must be an int > 0 (tokens)")
    kept = keep_recent(messages, k, placeholder=placeholder)
    if count_tokens(kept) > threshold:
        return discard_tool_history(messages)
    return kept


def template_token_counter(template, *, add_generation_prompt: bool = True) -> TokenCounter:
    """Tokens of the rendered context (``ChatTemplate.render``), generation prompt included when the
    last message is one the model answers (user or tool), as the agent loop renders it."""
    def count(messages: Sequence[dict]) -> int:
        gen = add_generation_prompt and bool(messages) and messages[-1].get("role") in ("user", "tool")
        return len(template.render(list(messages), add_generation_prompt=gen).ids)
    return count


@dataclasses.dataclass(frozen=True)
class ContextPolicy:
    """The context-management option of an agent loop: ``apply(messages, count_tokens)``."""
    kind: str = "full"
    k: int = 5
    threshold: int = 32768            # tokens (hcm only); the paper's value
    placeholder: str = PLACEHOLDER
    drop: bool = False                # keep_recent: remove old rounds instead of blanking their results

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"ContextPolicy.kind={self.kind!r} is invalid: allowed: {', '.join(KINDS)}")
        _check_k(self.k)
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, int) or self.threshold <= 0:
            raise ValueError(f"ContextPolicy.threshold={self.threshold!r} is invalid: must be an int > 0")

    def apply(self, messages: Sequence[dict], count_tokens: Optional[TokenCounter] = None) -> List[dict]:
        if self.kind == "full":
            return list(messages)
        if self.kind == "keep_recent":
            return keep_recent(messages, self.k, placeholder=self.placeholder, drop=self.drop)
        if count_tokens is None:
            raise ValueError("ContextPolicy(kind='hcm').apply needs count_tokens (e.g. template_token_counter)")
        return hcm(messages, count_tokens, self.threshold, self.k, placeholder=self.placeholder)
