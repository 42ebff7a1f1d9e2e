"""The multi-turn tool tasks and the agent pool that plays them through the gateway.

Protocol (character vocabulary, ``glm5_jax.rl.sft.CharVocab``): the policy calls the task's tool by
emitting ``(<argument>)`` + newline; the environment answers ``><result>`` + newline (observation
tokens: masked in the loss); a reply that does not start with ``(`` is the final answer, scored 1 if
it equals the task's answer, else 0. At most ``max_turns`` policy turns.

Tasks (each has ``prompt``, ``answer``, ``tool(arg) -> str`` and ``transcript()``, the worked
episode used by the SFT warm start):

* ``CalcTask``: ``47*6-8=``; one calculator call, then the answer (2 turns, always).
* ``ChainTask``: pointer chasing through a key-value store, ``371:``; ``(371)`` -> ``>552``,
  ``(552)`` -> ``>=81``, answer ``81``. The number of lookups (hops) is a property of the task,
  drawn from a truncated power law P(k) ~ k^-alpha (``hop_probs``): most episodes are short, a few are
  long, like agent episodes whose tool-call count depends on the task. It is the long-tail workload of
  async_vs_sync: a synchronous step waits for its longest episode.

``RolloutPool`` runs trajectories on ``threads`` threads. Each trajectory's id is
``<group>/<k>``; its requests are routed by that id. When its worker dies mid-trajectory
(``WorkerLost``) the partial record is discarded and the trajectory re-queued from its prompt (same
id, attempt + 1), so every issued id ends in exactly one finished record. A finished group (all
``group_size`` records) is put on ``done`` as a list of records.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time
from typing import Callable, Dict, List, Optional

from glm5_jax.agentic.coordinator import NoWorkers, WorkerLost
from glm5_jax.agentic.gateway import Gateway
from glm5_jax.rl.tasks import safe_eval_arith

__all__ = ["CalcTask", "ChainTask", "TurnTask", "make_calc_task", "make_chain_task", "hop_probs", "calculator",
           "service_calculator", "sft_example", "play", "RolloutPool"]


@dataclasses.dataclass(frozen=True)
class CalcTask:
    expr: str
    answer: int

    @property
    def prompt(self) -> str:
        return self.expr + "="

    def tool(self, arg: str) -> str:
        return calculator(arg)

    def transcript(self) -> list:
        """The worked episode as (text, trained) pieces after the prompt."""
        return [(f"({self.expr})\n", 1), (f">{self.answer}\n", 0), (f"{self.answer}\n", 1)]


@dataclasses.dataclass(frozen=True)
class ChainTask:
    """Pointer chasing: ``keys[0]`` is the prompt's key, each lookup of ``keys[i]`` answers
    ``keys[i + 1]``, the last key answers ``=<answer>``. hops = len(keys) tool calls."""
    keys: tuple
    answer: int

    @property
    def prompt(self) -> str:
        return f"{self.keys[0]}:"

    @property
    def hops(self) -> int:
        return len(self.keys)

    def tool(self, arg: str) -> str:
        """The key-value lookup: the next key, ``=<value>`` at the end of the chain, '' if unknown."""
        for i, k in enumerate(self.keys):
            if arg == str(k):
                return str(self.keys[i + 1]) if i + 1 < len(self.keys) else f"={self.answer}"
        return ""

    def transcript(self) -> list:
        out = []
        for i, k in enumerate(self.keys):
            out += [(f"({k})\n", 1), (f">{self.tool(str(k))}\n", 0)]
        return out + [(f"{self.answer}\n", 1)]



@dataclasses.dataclass(frozen=True)
class TurnTask:
    """One turn of an episode as a single-turn task (on-policy distillation of one turn): the prompt is the
    worked episode up to policy turn ``turn`` (its tool results included: the same ids a multi-turn
    context holds, one character being one token), the expected text that turn's (a tool call ``(kkk)``
    or the final answer)."""
    chain: ChainTask
    turn: int
    kind = "agentic"

    @property
    def prompt(self) -> str:
        out, k = [self.chain.prompt], 0
        for text, trained in self.chain.transcript():       # policy turns trained, tool results not
            if trained:
                if k == self.turn:
                    break
                k += 1
            out.append(text)
        return "".join(out)

    @property
    def expected(self) -> str:
        return [t for t, m in self.chain.transcript() if m][self.turn].rstrip("\n")

    def score(self, text: str):
        final = text.split("\n")[0] if "\n" in text else None
        if final is None:
            return 0.0, "truncated"
        return (1.0, "correct") if final == self.expected else (0.0, "wrong")

def hop_probs(max_hops: int, alpha: float) -> list:
    """P(hops = k) for k = 1..max_hops, proportional to k^-alpha (alpha 0: uniform)."""
    if max_hops < 1 or alpha < 0:
        raise ValueError(f"hop_probs: max_hops={max_hops} must be >= 1 and alpha={alpha} >= 0")
    w = [k ** -alpha for k in range(1, max_hops + 1)]
    return [x / sum(w) for x in w]


def make_chain_task(rng: random.Random, max_hops: int = 8, alpha: float = 2.0) -> ChainTask:
    """Distinct 3-digit keys (the start key is the prompt: 900 possible), a 2-digit answer."""
    k = rng.choices(range(1, max_hops + 1), weights=hop_probs(max_hops, alpha))[0]
    return ChainTask(tuple(rng.sample(range(100, 1000), k)), rng.randint(10, 99))


def make_calc_task(rng: random.Random) -> CalcTask:
    a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(1, 9)
    op = rng.choice("+-")
    expr = f"{a}*{b}{op}{c}"
    return CalcTask(expr, a * b + (c if op == "+" else -c))


def calculator(expr: str) -> str:
    """The tool: exact integer value of an arithmetic expression, or '' when it is invalid."""
    try:
        v = safe_eval_arith(expr)
    except Exception:
        return ""
    return str(int(v)) if v.denominator == 1 and abs(v) < 10 ** 6 else ""


def service_calculator(url: str, timeout: float = 10.0) -> Callable[[str], str]:
    """The calculator of the environment service (``glm5_jax.agentic.envs``) as a tool function.
    A tool-level error (bad expression) is the observation ''; a protocol fault or an unanswered request
    raises, which ``play`` records as a broken sample (``env_error``)."""
    from glm5_jax.agentic.envs import call_tool

    def tool(expr: str) -> str:
        res = str(call_tool(url, "calculator", {"expression": expr}, timeout=timeout))
        return res if res.lstrip("-").isdigit() else ""
    return tool


def sft_example(task: CalcTask, vocab):
    """The worked transcript as (ids, loss_mask): only the policy's turns are trained."""
    class Ex:
        pass
    pieces = [(vocab.encode(task.prompt, bos=True), 0)] + [(vocab.encode(t), m) for t, m in task.transcript()]
    ex = Ex()
    ex.ids = [t for ids, _ in pieces for t in ids]
    ex.loss_mask = [m for ids, m in pieces for _ in ids]
    return [ex]


def play(gateway: Gateway, generate: Callable, traj_id: str, group_id: str, task, vocab, *,
         max_turns: int = 3, max_len: int = 64, max_new_tokens: int = 10, attempt: int = 0,
         tool: Optional[Callable[[str], str]] = None, env_crash: Callable[[], bool] = lambda: False):
    """One trajectory. ``generate(traj_id, request_id, ids)`` is the routed server call; ``tool``
    (default: the task's own, ``task.tool``) answers the policy's calls."""
    tool = task.tool if tool is None else tool
    gateway.open(traj_id, group_id, vocab.encode(task.prompt, bos=True), attempt)
    try:
        for turn in range(max_turns):
            if len(gateway.context(traj_id)) + max_new_tokens > max_len:
                return gateway.finish(traj_id, 0.0, "done")      # out of context: a failed episode
            out = gateway.generate(traj_id, lambda ids: generate(traj_id, f"{traj_id}@{attempt}.{turn}", ids))
            text = vocab.decode(out["tokens"])
            if out["finish_reason"] != "stop":
                return gateway.finish(traj_id, 0.0, "done")      # truncated reply: reward 0
            text = text[:-1]
            if text.startswith("(") and text.endswith(")"):
                try:
                    if env_crash():
                        raise RuntimeError("simulated environment crash")
                    result = tool(text[1:-1])
                except Exception:
                    return gateway.finish(traj_id, 0.0, "env_error")   # broken sample: never trained
                gateway.observe(traj_id, vocab.encode(f">{result}\n"))
                continue
            return gateway.finish(traj_id, float(text == str(task.answer)), "done")
        return gateway.finish(traj_id, 0.0, "done")              # too many tool calls
    except BaseException:
        gateway.discard(traj_id)
        raise


class RolloutPool:
    def __init__(self, coordinator, gateway: Gateway, vocab, *, group_size: int, threads: int = 16,
                 max_turns: int = 3, max_len: int = 64, max_new_tokens: int = 10, env_crash_p: float = 0.0,
                 seed: int = 0, tool: Optional[Callable[[str], str]] = None, log: Callable[[str], None] = lambda s: None):
        self.coord, self.gateway, self.vocab = coordinator, gateway, vocab
        self.group_size = group_size
        self.kw = dict(max_turns=max_turns, max_len=max_len, max_new_tokens=max_new_tokens, tool=tool)
        self.env_crash_p, self._rng = env_crash_p, random.Random(seed)
        self.log = log
        self.jobs: "queue.Queue" = queue.Queue()
        self.done: "queue.Queue" = queue.Queue()
        self._groups: Dict[str, list] = {}
        self._lock = threading.Lock()
        self.issued: List[str] = []
        self.requeued = 0
        self.in_flight_groups = 0
        self.error: Optional[BaseException] = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, daemon=True, name=f"agent-{i}") for i in range(threads)]
        for t in self._threads:
            t.start()

    def native_ids(self) -> List[int]:
        """OS thread ids of the agent threads (for CPU pinning: agents belong to the rollout side)."""
        return [t.native_id for t in self._threads if t.native_id is not None]

    def submit_group(self, group_id: str, task) -> None:
        with self._lock:
            self._groups[group_id] = []
            self.in_flight_groups += 1
            for k in range(self.group_size):
                self.issued.append(f"{group_id}/{k}")
        for k in range(self.group_size):
            self.jobs.put((f"{group_id}/{k}", group_id, task, 0))

    def _crash(self) -> bool:
        with self._lock:
            return self._rng.random() < self.env_crash_p

    def _work(self):
        while not self._stop.is_set():
            # a blocking get, not a polling one: 64 idle threads waking every 0.1 s would take the
            # driver's GIL ~640 times a second from the trainer that shares this process
            job = self.jobs.get()
            if job is None:          # close()
                return
            traj_id, group_id, task, attempt = job
            try:
                rec = play(self.gateway, self.coord.generate, traj_id, group_id, task, self.vocab, attempt=attempt,
                           env_crash=self._crash, **self.kw)
            except WorkerLost as e:
                with self._lock:
                    self.requeued += 1
                self.log(f"[pool] {traj_id}: worker {e} lost; re-queued (attempt {attempt + 1})")
                self.jobs.put((traj_id, group_id, task, attempt + 1))
                continue
            except NoWorkers as e:
                self.error = e
                self._stop.set()
                return
            except BaseException as e:       # a bug: surface it to the trainer instead of hanging
                self.error = e
                self._stop.set()
                return
            with self._lock:
                g = self._groups[group_id]
                g.append(rec)
                if len(g) == self.group_size:
                    del self._groups[group_id]
                    self.in_flight_groups -= 1
                    self.done.put(sorted(g, key=lambda r: r.traj_id))

    def get_group(self, timeout: float = 600.0):
        """Next finished group (list of records); raises the pool's error if a worker thread failed."""
        t0 = time.time()
        while True:
            if self.error is not None:
                raise RuntimeError(f"rollout pool failed: {self.error!r}") from self.error
            try:
                return self.done.get(timeout=0.1)
            except queue.Empty:
                if time.time() - t0 > timeout:
                    raise TimeoutError(f"no finished group within {timeout} s")

    def close(self):
        self._stop.set()
        for _ in self._threads:
            self.jobs.put(None)
        for t in self._threads:
            t.join(timeout=5)
