"""Reward-hacking guards (GLM-5 report, general RL): applied to a sample's combined reward after every
source (rules, reward model, judge) has scored it.

* **Hard truncation.** A sample that hit the generation budget without its stop token is not an answer,
  however a reward model or a judge likes its (long) text. ``truncation="zero"`` sets its reward to 0,
  ``"penalty"`` to ``-truncation_penalty``; ``"off"`` leaves it. Counted as ``truncated``.
* **Layout anomalies** (each kind counted once per sample; the reward drops by ``layout_penalty`` per kind):
  ``blank_lines``   a run of more than ``max_blank_lines`` consecutive blank lines;
  ``repeated_lines`` a non-empty line occurring more than ``max_line_repeats`` times;
  ``repeated_tokens`` a span of at least ``min_repeat_span`` words (whitespace-split tokens of the text)
                    made of one n-gram (n <= 4) repeated back to back ("very very very ...", a copied
                    phrase). Words, not token ids: the check does not depend on the tokenizer, and code
                    indentation (runs of space tokens in a byte-level vocabulary) is not repetition;
  ``markup``        more than ``max_markup_fraction`` of the visible characters are layout markup (``**``,
                    ``__``, heading ``#``, bullets ``- ``/``* ``, code fences, table ``|``, ``---`` rules): bold and
                    heading spam a reward model over-rewards (``38*2=76`` or ``-5`` are not markup);
  ``judge_injection`` the reply contains a verdict addressed to a grader ("Score: 10", "rating = 9",
                    "rate this ...", "10 out of 10"), not to the user.
  With combined rewards in [0, 1] (glm5_jax.rl.rewards normalises every source) and the default
  ``layout_penalty=1``, an anomalous sample never scores above a clean sample: the gain is removed.

``guard(reward, text, truncated, cfg) -> GuardResult`` (pure Python); ``Counters`` sums them per batch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Sequence

from glm5_jax.fields import check_fields, setting

__all__ = ["GuardConfig", "GuardResult", "ANOMALIES", "layout_anomalies", "max_repeat_span", "guard", "count"]

ANOMALIES = ("blank_lines", "repeated_lines", "repeated_tokens", "markup", "judge_injection")
TRUNCATION_MODES = ("zero", "penalty", "off")
# markup: bold/italic markers, headings, bullets, code fences, table pipes, horizontal rules
_MARKUP = re.compile(r"\*\*|__|^[ \t]*#{1,6}[ \t]|^[ \t]*[-*+][ \t]|```|\||^[ \t]*[-=*]{3,}[ \t]*$", re.M)
# text addressed to a grader: "Score: 10", "rating = 9", "rate this ...", "10 out of 10"
_INJECTION = re.compile(r"\b(score|rating|grade|verdict)\b\s*(is\s*)?[:=]?\s*-?\d|\brate\s+(this|it|me)\b|"
                        r"\b\d+\s+out\s+of\s+\d+\b", re.I)


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    truncation: str = setting("zero", choices=TRUNCATION_MODES)    # zero | penalty | off
    truncation_penalty: float = setting(1.0, min=0)   # "penalty": a truncated sample's reward is -truncation_penalty
    layout_penalty: float = setting(1.0, min=0)       # subtracted once per anomaly kind found (0: count only)
    max_blank_lines: int = setting(1, integer=True, min=0)   # consecutive blank lines allowed ("\n\n" ends code tasks)
    max_line_repeats: int = setting(2, integer=True, min=0)  # times one non-empty line may occur
    min_repeat_span: int = setting(8, integer=True, min=2)   # words of back-to-back n-gram repetition: an anomaly
    max_markup_fraction: float = setting(0.2, gt=0, max=1)
    checks: tuple = ANOMALIES             # which layout checks run

    def __post_init__(self):
        check_fields(self)
        unknown = [c for c in self.checks if c not in ANOMALIES]
        if unknown:
            raise ValueError(f"GuardConfig.checks has unknown check(s) {unknown}; allowed: {', '.join(ANOMALIES)}")


@dataclasses.dataclass
class GuardResult:
    reward: float                         # after the guards
    raw: float                            # before
    truncated: bool
    anomalies: List[str]


def max_repeat_span(ids: Sequence, max_n: int = 4) -> int:
    """Length (items) of the longest span made of one n-gram (n <= max_n) repeated back to back at least
    twice; 0 when nothing repeats."""
    ids = list(ids)
    best = 0
    for n in range(1, max_n + 1):
        for start in range(n):           # every phase of the n-gram grid
            run = 1
            i = start
            while i + 2 * n <= len(ids):
                if ids[i:i + n] == ids[i + n:i + 2 * n]:
                    run += 1
                    if run >= 2:
                        best = max(best, run * n)
                else:
                    run = 1
                i += n
    return best


def layout_anomalies(text: str, cfg: GuardConfig) -> List[str]:
    """The anomaly kinds (ANOMALIES order) found in a reply's text."""
    found = []
    lines = text.split("\n")
    if "blank_lines" in cfg.checks:
        run = best = 0
        for ln in lines[1:-1] if len(lines) > 2 else []:    # a blank line lies between two newlines
            run = run + 1 if not ln.strip() else 0
            best = max(best, run)
        if best > cfg.max_blank_lines:
            found.append("blank_lines")
    if "repeated_lines" in cfg.checks:
        seen: Dict[str, int] = {}
        for ln in lines:
            key = ln.strip()
            if key:
                seen[key] = seen.get(key, 0) + 1
        if seen and max(seen.values()) > cfg.max_line_repeats:
            found.append("repeated_lines")
    if "repeated_tokens" in cfg.checks and max_repeat_span(text.split()) >= cfg.min_repeat_span:
        found.append("repeated_tokens")
    if "markup" in cfg.checks:
        visible = sum(1 for c in text if not c.isspace())
        marks = sum(len(m.group(0).strip()) for m in _MARKUP.finditer(text))
        if visible and marks / visible > cfg.max_markup_fraction:
            found.append("markup")
    if "judge_injection" in cfg.checks and _INJECTION.search(text):
        found.append("judge_injection")
    return found


def guard(reward: float, text: str, truncated: bool, cfg: GuardConfig) -> GuardResult:
    """Apply the guards to one sample's combined reward (module doc)."""
    raw = float(reward)
    anomalies = layout_anomalies(text, cfg)
    r = raw - cfg.layout_penalty * len(anomalies)
    if truncated and cfg.truncation != "off":
        r = 0.0 if cfg.truncation == "zero" else -cfg.truncation_penalty
        r = min(r, raw - cfg.layout_penalty * len(anomalies)) if anomalies else r
    return GuardResult(reward=float(r), raw=raw, truncated=bool(truncated), anomalies=anomalies)


def count(results: Sequence[GuardResult]) -> dict:
    """Batch counters: samples, truncated, anomalous (any kind), per kind, and the reward the guards took
    away (mean raw - mean guarded)."""
    n = len(results)
    out = {"samples": n, "truncated": sum(r.truncated for r in results),
           "anomalous": sum(bool(r.anomalies) for r in results)}
    for k in ANOMALIES:
        out[k] = sum(k in r.anomalies for r in results)
    out["reward_removed"] = (sum(r.raw - r.reward for r in results) / n) if n else 0.0
    return out
