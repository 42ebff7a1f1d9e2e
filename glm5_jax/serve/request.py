"""A request to the serving engine: its sampling parameters, its growing outputs and their events.

``SamplingParams`` is validated when submitted (``EngineError`` names the field); a ``RequestHandle``
collects the tokens, log-probs and text deltas the engine produces and hands them out as ``TokenEvent``s
(``events()``, or the ``on_event`` callback from the engine thread)."""

from __future__ import annotations

import dataclasses
import queue as queue_mod
import threading
import time
from typing import Callable, List, Optional, Sequence

from glm5_jax.errors import Glm5Error

__all__ = ["EngineError", "QueueFull", "RequestHandle", "SamplingParams", "TokenEvent"]


class EngineError(Glm5Error):
    """A request the engine cannot serve (bad parameters, too long, bad token ids); ``param`` names the field."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The bounded request queue is full; retry later."""


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: Optional[int] = None        # None: drawn from the engine's generator
    stop: Sequence[str] = ()          # stop strings (need a tokenizer); the text is cut before them
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False          # False: the engine's default stop ids end the request too
    prompt_logprobs: bool = False     # log-probs of the prompt tokens (echo): prefills the whole prompt

    def validate(self, vocab_size: int) -> "SamplingParams":
        def bad(field, msg):
            raise EngineError(f"{field}={getattr(self, field)!r} is invalid: {msg}", field)
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature <= 100:
            bad("temperature", "a number in [0, 100]")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2 ** 63 <= self.seed < 2 ** 64):
            bad("seed", "an integer")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop) or len(self.stop) > 16:
            bad("stop", "a list of at most 16 non-empty strings")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in self.stop_token_ids):
            bad("stop_token_ids", f"token ids in [0, {vocab_size})")
        return self


@dataclasses.dataclass
class TokenEvent:
    token: int
    logprob: float                    # the model's log-softmax (temperature 1) of the chosen token
    sample_logprob: float             # log-prob under the distribution it was drawn from (RL's)
    top: List[tuple]                  # [(token, logprob)] * TOP_LOGPROBS, best first
    text: str                         # text delta released with this token ("" without a tokenizer)
    version: int


class RequestHandle:
    """A submitted request: its outputs grow as the engine produces them. Iterate ``events()`` (blocking)
    or pass ``on_event`` to ``Engine.submit`` (called from the engine thread). ``result()`` waits for the end."""

    def __init__(self, rid: str, prompt: List[int], params: SamplingParams, on_event: Optional[Callable]):
        self.id, self.prompt, self.params = rid, prompt, params
        self.tokens: List[int] = []
        self.logprobs: List[float] = []
        self.sample_logprobs: List[float] = []
        self.top_logprobs: List[list] = []
        self.versions: List[int] = []
        self.prompt_logprobs: Optional[List[Optional[float]]] = None   # [None, lp(t1 | t0), ...] with echo
        self.prompt_top_logprobs: Optional[List[Optional[list]]] = None
        self.text = ""
        self.finish_reason: Optional[str] = None     # stop | length | cancelled | error
        self.error: Optional[str] = None
        self.reused_tokens = 0
        self.submitted = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.token_times: List[float] = []
        self._on_event = on_event
        self._q: "queue_mod.Queue" = queue_mod.Queue()
        self._done = threading.Event()
        self._cancel = False
        self._stream = None           # glm5_jax.serve.detok.TextStream when the engine has a tokenizer
        self._prefix_ok = True        # may reuse a cached prefix (set by Engine.submit)
        self._seed = 0

    # ---------------------------------------------------------------- consumer side
    def cancel(self) -> None:
        """Stop generating (e.g. the client went away); the slot frees at the next step."""
        self._cancel = True

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: Optional[float] = None) -> "RequestHandle":
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self

    def events(self):
        """Yield TokenEvent per token, then the finish reason (a str) last."""
        while True:
            ev = self._q.get()
            yield ev
            if isinstance(ev, str):
                return

    # ---------------------------------------------------------------- engine side
    def _emit(self, ev):
        self._q.put(ev)
        if self._on_event is not None:
            self._on_event(self, ev)

    def _finish(self, reason: str, error: Optional[str] = None):
        if self.finish_reason is not None:
            return
        self.finish_reason, self.error = reason, error
        self.finished_at = time.perf_counter()
        self._emit(reason)
        self._done.set()
