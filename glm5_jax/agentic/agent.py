"""The multi-turn calculator task and the agent pool that plays it through the gateway.

Task (character vocabulary, ``glm5_jax.rl.sft.CharVocab``): the prompt is an expression such as
``47*6-8=``. The policy may call the calculator by emitting ``(<expr>)`` + newline; the environment
answers ``><value>`` + newline (observation tokens: masked in the loss); a reply that does not start
with ``(`` is the final answer, scored 1 if it equals the value, else 0. At most ``max_turns``
policy turns. The worked transcript (for the SFT warm start) is: call, observation, answer.

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

__all__ = ["CalcTask", "make_calc_task", "calculator", "service_calculator", "sft_example", "play", "RolloutPool"]


@dataclasses.dataclass(frozen=True)
class CalcTask:
    expr: str
    answer: int

    @property
    def prompt(self) -> str:
        return self.expr + "="


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
    pieces = [(vocab.encode(task.prompt, bos=True), 0), (vocab.encode(f"({task.expr})\n"), 1),
              (vocab.encode(f">{task.answer}\n"), 0), (vocab.encode(f"{task.answer}\n"), 1)]
    ex = Ex()
    ex.ids = [t for ids, _ in pieces for t in ids]
    ex.loss_mask = [m for ids, m in pieces for _ in ids]
    return [ex]


def play(gateway: Gateway, generate: Callable, traj_id: str, group_id: str, task: CalcTask, vocab, *,
         max_turns: int = 3, max_len: int = 64, max_new_tokens: int = 10, attempt: int = 0,
         tool: Callable[[str], str] = calculator, env_crash: Callable[[], bool] = lambda: False):
    """One trajectory. ``generate(traj_id, request_id, ids)`` is the routed server call."""
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
                 seed: int = 0, tool: Callable[[str], str] = calculator, log: Callable[[str], None] = lambda s: None):
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

    def submit_group(self, group_id: str, task: CalcTask) -> None:
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
            try:
                traj_id, group_id, task, attempt = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
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
        for t in self._threads:
            t.join(timeout=5)
