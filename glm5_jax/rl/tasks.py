"""Verifiable tasks with real checkers for the RL stage (sized for a ~1M-parameter model).

Answer format (all tasks)
-------------------------
The model continues the prompt. Its completion must contain the task's *terminator*
(``"\\n"`` for arithmetic and countdown, ``"\\n\\n"`` for function tasks); text after the first
terminator is ignored, and a completion without it is ``truncated`` (reward 0). For one-line
tasks the text before the terminator may hold optional working steps separated by ``";"``;
the final answer is the last ``";"``-separated field::

    prompt "17+38*2="      completion "93\\n"                 -> correct
                           completion "38*2=76;17+76=93;93\\n" -> correct (worked form)
                           completion "93"                    -> truncated
                           completion "9x3\\n"                 -> malformed
    prompt "3 5 7->22:"    completion "3*5+7\\n"              -> correct

Statuses: ``correct`` (reward 1), ``wrong``, ``malformed``, ``truncated`` (reward 0).
:func:`aggregate_statuses` counts them over a batch.

Generators are seeded (``random.Random(seed)``) and return :class:`Task` objects holding the
prompt, the reference answer, an SFT completion (``solution``: worked example ending with the
terminator) and a ``score(completion) -> (reward, status)`` method.

Levels
------
arithmetic: 0 single-digit a+b | 1 single-digit a op b (op in + - *) | 2 two-digit + -, and
2-digit * 1-digit | 3 three operands with precedence ("17+38*2") | 4 three operands with
parentheses ("(17+38)*2").
countdown: 0 two numbers 1..9 | 1 three numbers 1..9 | 2 four numbers 1..12 (target 1..99,
reached with + - * and parentheses; a solution may use any subset, each number at most once;
``/`` is accepted by the checker when exact).
"""

from __future__ import annotations

import ast
import dataclasses
import random
import re
from fractions import Fraction
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

__all__ = [
    "TERMINATOR",
    "CODE_TERMINATOR",
    "STATUSES",
    "Task",
    "extract_final",
    "aggregate_statuses",
    "score_arithmetic",
    "check_countdown",
    "score_countdown",
    "score_function",
    "safe_eval_arith",
    "arithmetic_task",
    "arithmetic_tasks",
    "countdown_task",
    "countdown_tasks",
    "FUNCTION_TASKS",
    "function_tasks",
    "make_tasks",
    "ARITH_LEVELS",
    "COUNTDOWN_LEVELS",
    "NAMED_TASKS",
    "d2d1_task",
    "named_task",
    "SortTask",
    "sort_task",
    "sort_preference_pair",
    "distinct_tasks",
    "draw_excluding",
]

TERMINATOR = "\n"
CODE_TERMINATOR = "\n\n"
STEP_SEP = ";"
STATUSES = ("correct", "wrong", "malformed", "truncated")
MAX_ANSWER_CHARS = 128

ARITH_LEVELS = (0, 1, 2, 3, 4)
COUNTDOWN_LEVELS = (0, 1, 2)


# ----------------------------------------------------------------------------- task object


@dataclasses.dataclass(frozen=True)
class Task:
    kind: str  # "arithmetic" | "countdown" | "function"
    prompt: str
    answer: str  # reference answer (no terminator)
    solution: str  # SFT completion: worked example, ends with the terminator
    level: int = 0
    terminator: str = TERMINATOR
    numbers: Tuple[int, ...] = ()  # countdown
    target: int = 0  # countdown
    tests: str = ""  # function tasks: assert-based unit tests

    @property
    def sft_text(self) -> str:
        return self.prompt + self.solution

    def score(self, answer_text: str, **sandbox_kwargs) -> Tuple[float, str]:
        """Score a completion (the text generated after the prompt)."""
        if self.kind == "arithmetic":
            return score_arithmetic(answer_text, int(self.answer))
        if self.kind == "countdown":
            return score_countdown(answer_text, self.numbers, self.target)
        if self.kind == "function":
            return score_function(answer_text, self.prompt, self.tests, **sandbox_kwargs)
        raise ValueError(f"unknown task kind {self.kind!r}")


def extract_final(text: str, terminator: str = TERMINATOR) -> Optional[str]:
    """Final answer field of a completion, or None when the terminator is missing."""
    cut = text.find(terminator)
    if cut < 0:
        return None
    return text[:cut].split(STEP_SEP)[-1].strip()


def aggregate_statuses(results: Iterable[Union[str, Tuple[float, str]]]) -> Dict[str, float]:
    """Counts and fractions of each status, plus the mean reward when rewards are given.

    Accepts statuses or ``(reward, status)`` pairs. Keys: ``n``, ``<status>`` (count),
    ``frac_<status>``, and ``reward_mean`` (pairs only). Unknown statuses are counted too.
    """
    counts: Dict[str, int] = {s: 0 for s in STATUSES}
    rewards: List[float] = []
    n = 0
    for item in results:
        if isinstance(item, tuple):
            rewards.append(float(item[0]))
            status = item[1]
        else:
            status = item
        counts[status] = counts.get(status, 0) + 1
        n += 1
    out: Dict[str, float] = {"n": n}
    for s, c in counts.items():
        out[s] = c
        out["frac_" + s] = c / n if n else 0.0
    if rewards:
        out["reward_mean"] = sum(rewards) / len(rewards)
    return out


# ----------------------------------------------------------------------------- safe arithmetic

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_ALLOWED_CHARS = re.compile(r"[0-9+\-*/() ]+")


class _Disallowed(ValueError):
    pass


def _parse_expr(text: str) -> ast.AST:
    """Parse ``text`` into an AST made only of int literals and + - * / (no unary ops)."""
    if len(text) > MAX_ANSWER_CHARS or not _ALLOWED_CHARS.fullmatch(text):
        raise _Disallowed("characters outside 0-9 + - * / ( ) space")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise _Disallowed(f"syntax error: {e.msg}") from None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.BinOp)) or type(node) in _OPS:
            continue
        if isinstance(node, ast.Constant) and type(node.value) is int:
            continue
        raise _Disallowed(f"disallowed syntax: {type(node).__name__}")
    return tree.body


def _literals(node: ast.AST) -> List[int]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    a, b = _eval(node.left), _eval(node.right)
    op = _OPS[type(node.op)]
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise ZeroDivisionError
    return a / b


def safe_eval_arith(text: str) -> Fraction:
    """Exact value of an expression of ints and + - * / ( ); never calls eval().

    Raises ValueError on anything else, ZeroDivisionError on division by zero.
    """
    return _eval(_parse_expr(text))


# ----------------------------------------------------------------------------- scorers

_INT = re.compile(r"-?\d{1,40}")


def score_arithmetic(answer_text: str, expected: int) -> Tuple[float, str]:
    final = extract_final(answer_text, TERMINATOR)
    if final is None:
        return 0.0, "truncated"
    if not _INT.fullmatch(final):
        return 0.0, "malformed"
    return (1.0, "correct") if int(final) == expected else (0.0, "wrong")


def check_countdown(expr: str, numbers: Sequence[int], target: int) -> Tuple[str, str]:
    """(status, detail) for a countdown expression (no terminator handling here)."""
    expr = expr.strip()
    if not expr:
        return "malformed", "empty"
    try:
        tree = _parse_expr(expr)
    except _Disallowed as e:
        return "malformed", str(e)
    pool = list(numbers)
    for v in _literals(tree):
        if v in pool:
            pool.remove(v)
        elif v in numbers:
            return "wrong", f"number {v} used more often than given"
        else:
            return "wrong", f"number {v} not given"
    try:
        value = _eval(tree)
    except ZeroDivisionError:
        return "wrong", "division by zero"
    if value != target:
        return "wrong", f"evaluates to {value}, not {target}"
    return "correct", ""


def score_countdown(answer_text: str, numbers: Sequence[int], target: int) -> Tuple[float, str]:
    final = extract_final(answer_text, TERMINATOR)
    if final is None:
        return 0.0, "truncated"
    status, _ = check_countdown(final, numbers, target)
    return (1.0 if status == "correct" else 0.0), status


def score_function(answer_text: str, prompt: str, tests: str, **sandbox_kwargs) -> Tuple[float, str]:
    """Completion = function body; the program is ``prompt + body``, run against ``tests``.

    Missing terminator -> truncated; not parseable -> malformed (checked in-process with
    ``ast.parse``, nothing is executed); otherwise executed by :func:`run_sandboxed`:
    passed -> correct, anything else (failed / error / timeout / memory / network) -> wrong.
    """
    cut = answer_text.find(CODE_TERMINATOR)
    if cut < 0:
        return 0.0, "truncated"
    code = prompt + answer_text[:cut] + "\n"
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return 0.0, "malformed"
    from glm5_jax.rl.sandbox import run_sandboxed

    res = run_sandboxed(code, tests, **sandbox_kwargs)
    return (1.0, "correct") if res.passed else (0.0, "wrong")


# ----------------------------------------------------------------------------- expression trees
# A tree is an int leaf or a tuple (op, left, right).


def _render(tree, parent_prec: int = 0, right_of: str = "") -> str:
    if isinstance(tree, int):
        return str(tree)
    op, left, right = tree
    p = _PREC[op]
    s = _render(left, p, "") + op + _render(right, p, op)
    need = p < parent_prec or (p == parent_prec and right_of in ("-", "/"))
    return f"({s})" if need else s


def _value(tree) -> int:
    if isinstance(tree, int):
        return tree
    op, a, b = tree
    a, b = _value(a), _value(b)
    return a + b if op == "+" else a - b if op == "-" else a * b


def _steps(tree, out: List[str]) -> int:
    if isinstance(tree, int):
        return tree
    op, a, b = tree
    va, vb = _steps(a, out), _steps(b, out)
    v = _value((op, va, vb))
    out.append(f"{va}{op}{vb}={v}")
    return v


def _solution(tree, worked: bool) -> str:
    v = _value(tree)
    if worked and not isinstance(tree, int):
        steps: List[str] = []
        _steps(tree, steps)
        if len(steps) > 1:
            return STEP_SEP.join(steps + [str(v)]) + TERMINATOR
    return f"{v}{TERMINATOR}"


# ----------------------------------------------------------------------------- arithmetic


def _rng(seed_or_rng) -> random.Random:
    return seed_or_rng if isinstance(seed_or_rng, random.Random) else random.Random(seed_or_rng)


def _pick_level(rng: random.Random, level) -> int:
    if isinstance(level, int):
        return level
    return rng.choice(list(level))


def arithmetic_task(rng, level: int = 0, *, worked: bool = False) -> Task:
    """One arithmetic problem. ``rng``: random.Random or a seed."""
    rng = _rng(rng)
    d1 = lambda: rng.randint(0, 9)
    d2 = lambda: rng.randint(10, 99)
    if level == 0:
        tree = ("+", d1(), d1())
    elif level == 1:
        tree = (rng.choice("+-*"), d1(), d1())
    elif level == 2:
        op = rng.choice("+-*")
        tree = (op, d2(), d1()) if op == "*" else (op, d2(), d2())
    elif level in (3, 4):
        ops = [rng.choice("+-*"), rng.choice("+-*")]
        vals = [rng.randint(1, 50), rng.randint(1, 50), rng.randint(1, 9)]
        if level == 3:
            # precedence decides the grouping
            if _PREC[ops[1]] > _PREC[ops[0]]:
                tree = (ops[0], vals[0], (ops[1], vals[1], vals[2]))
            else:
                tree = (ops[1], (ops[0], vals[0], vals[1]), vals[2])
        else:
            # grouping that needs parentheses against precedence
            if rng.random() < 0.5:
                ops[0], ops[1] = rng.choice("+-"), "*"
                tree = (ops[1], (ops[0], vals[0], vals[1]), vals[2])
            else:
                ops[0], ops[1] = rng.choice("*-"), rng.choice("+-")
                tree = (ops[0], vals[2], (ops[1], vals[0], vals[1]))
    else:
        raise ValueError(f"arithmetic level must be in {ARITH_LEVELS}, got {level}")
    expr = _render(tree)
    value = _value(tree)
    assert safe_eval_arith(expr) == value
    return Task(
        kind="arithmetic",
        prompt=expr + "=",
        answer=str(value),
        solution=_solution(tree, worked),
        level=level,
    )


def arithmetic_tasks(n: int, seed: int, level: Union[int, Sequence[int]] = 0, *,
                     worked: bool = False) -> List[Task]:
    rng = random.Random(seed)
    return [arithmetic_task(rng, _pick_level(rng, level), worked=worked) for _ in range(n)]


# ----------------------------------------------------------------------------- countdown

_CD_SPEC = {0: (2, 9), 1: (3, 9), 2: (4, 12)}  # level -> (how many numbers, max value)
_CD_MAX_TARGET = 99


def _random_tree(rng: random.Random, leaves: List[int]):
    if len(leaves) == 1:
        return leaves[0]
    k = rng.randint(1, len(leaves) - 1)
    return (rng.choice("+-*"), _random_tree(rng, leaves[:k]), _random_tree(rng, leaves[k:]))


def countdown_task(rng, level: int = 1) -> Task:
    """One countdown problem: reach ``target`` from ``numbers`` (each at most once)."""
    rng = _rng(rng)
    if level not in _CD_SPEC:
        raise ValueError(f"countdown level must be in {COUNTDOWN_LEVELS}, got {level}")
    count, hi = _CD_SPEC[level]
    while True:
        numbers = [rng.randint(1, hi) for _ in range(count)]
        used = rng.sample(numbers, rng.randint(2, count)) if count > 2 else list(numbers)
        rng.shuffle(used)
        tree = _random_tree(rng, used)
        target = _value(tree)
        # positive, small, and not trivially one of the given numbers
        if 1 <= target <= _CD_MAX_TARGET and target not in numbers:
            break
    expr = _render(tree)
    assert check_countdown(expr, numbers, target)[0] == "correct"
    prompt = " ".join(map(str, numbers)) + "->" + str(target) + ":"
    return Task(
        kind="countdown",
        prompt=prompt,
        answer=expr,
        solution=expr + TERMINATOR,
        level=level,
        numbers=tuple(numbers),
        target=target,
    )


def countdown_tasks(n: int, seed: int, level: Union[int, Sequence[int]] = 1) -> List[Task]:
    rng = random.Random(seed)
    return [countdown_task(rng, _pick_level(rng, level)) for _ in range(n)]


# ----------------------------------------------------------------------------- function tasks

# (prompt, reference body, tests). Bodies contain no blank line (the terminator is "\n\n").
FUNCTION_TASKS: Tuple[Tuple[str, str, str], ...] = (
    (
        "def add(a, b):\n",
        "    return a + b\n",
        "assert add(1, 2) == 3\nassert add(-4, 4) == 0\nassert add(10, 25) == 35\n",
    ),
    (
        "def is_even(n):\n",
        "    return n % 2 == 0\n",
        "assert is_even(0) is True\nassert is_even(7) is False\nassert is_even(-2) is True\n"
        "assert is_even(13) is False\n",
    ),
    (
        "def square(x):\n",
        "    return x * x\n",
        "assert square(3) == 9\nassert square(-4) == 16\nassert square(0) == 0\n",
    ),
    (
        "def maximum(xs):\n",
        "    m = xs[0]\n    for x in xs:\n        if x > m:\n            m = x\n    return m\n",
        "assert maximum([1, 5, 2]) == 5\nassert maximum([-3, -1]) == -1\nassert maximum([4]) == 4\n",
    ),
    (
        "def reverse(s):\n",
        "    return s[::-1]\n",
        "assert reverse('abc') == 'cba'\nassert reverse('') == ''\nassert reverse('ab') == 'ba'\n",
    ),
    (
        "def count_a(s):\n",
        "    return s.count('a')\n",
        "assert count_a('banana') == 3\nassert count_a('xyz') == 0\nassert count_a('a') == 1\n",
    ),
    (
        "def factorial(n):\n",
        "    r = 1\n    for i in range(2, n + 1):\n        r *= i\n    return r\n",
        "assert factorial(0) == 1\nassert factorial(1) == 1\nassert factorial(5) == 120\n",
    ),
    (
        "def sign(x):\n",
        "    if x > 0:\n        return 1\n    if x < 0:\n        return -1\n    return 0\n",
        "assert sign(5) == 1\nassert sign(-2) == -1\nassert sign(0) == 0\n",
    ),
)


def function_tasks() -> List[Task]:
    return [
        Task(
            kind="function",
            prompt=prompt,
            answer=body,
            solution=body + "\n",  # body ends with "\n"; one more makes the "\n\n" terminator
            level=0,
            terminator=CODE_TERMINATOR,
            tests=tests,
        )
        for prompt, body, tests in FUNCTION_TASKS
    ]


def make_tasks(kind: str, n: int, seed: int, level: Union[int, Sequence[int], None] = None,
               **kwargs) -> List[Task]:
    """Seeded batch of ``n`` tasks of ``kind`` ("arithmetic" | "countdown" | "function")."""
    if kind == "arithmetic":
        return arithmetic_tasks(n, seed, 0 if level is None else level, **kwargs)
    if kind == "countdown":
        return countdown_tasks(n, seed, 1 if level is None else level)
    if kind == "function":
        pool = function_tasks()
        rng = random.Random(seed)
        return [rng.choice(pool) for _ in range(n)]
    raise ValueError(f"unknown task kind {kind!r}")


# ----------------------------------------------------------------------------- experiment tasks

NAMED_TASKS = ("d2d1", "level0", "level1", "level2", "level3", "level4")


def d2d1_task(rng: random.Random) -> Task:
    """Two-digit +/- one-digit arithmetic ("47+8=" -> "55", "53-6=" -> "47"; 1,800 problems)."""
    a, b, op = rng.randint(10, 99), rng.randint(0, 9), rng.choice("+-")
    v = a + b if op == "+" else a - b
    return Task(kind="arithmetic", prompt=f"{a}{op}{b}=", answer=str(v), solution=f"{v}\n", level=-1)


def named_task(rng: random.Random, name: str) -> Task:
    """A task by name (NAMED_TASKS): ``d2d1`` (d2d1_task) or ``levelN`` (arithmetic_task at level N)."""
    if name.startswith("level"):
        return arithmetic_task(rng, int(name[5:]))
    if name != "d2d1":
        raise ValueError(f"unknown task {name!r}: d2d1 | level0..level4")
    return d2d1_task(rng)


@dataclasses.dataclass(frozen=True)
class SortTask:
    """Digit sorting: ``"4827>"`` -> ``"2478"`` + newline. ``score`` is the rule (the sorted digits, exactly)."""
    digits: str
    kind = "general"

    @property
    def prompt(self) -> str:
        return self.digits + ">"

    @property
    def answer(self) -> str:
        return "".join(sorted(self.digits))

    @property
    def solution(self) -> str:
        return self.answer + TERMINATOR

    def score(self, text: str):
        final = extract_final(text)
        if final is None:
            return 0.0, "truncated"
        if not final.isdigit():
            return 0.0, "malformed"
        return (1.0, "correct") if final == self.answer else (0.0, "wrong")


def sort_task(rng: random.Random, n_digits: int) -> SortTask:
    return SortTask("".join(rng.choice("0123456789") for _ in range(n_digits)))


def sort_preference_pair(task: SortTask, rng: random.Random) -> tuple:
    """(chosen, rejected) replies for a reward model: chosen = the sorted digits; rejected = one of an
    unsorted permutation, the sorted digits with one digit changed, one digit dropped, or descending order
    (whichever differs from the chosen reply)."""
    good = task.answer
    d = list(good)
    for _ in range(20):
        kind = rng.randrange(4)
        if kind == 0:
            p = d[:]
            rng.shuffle(p)
            bad = "".join(p)
        elif kind == 1:
            i = rng.randrange(len(d))
            p = d[:]
            p[i] = rng.choice([c for c in "0123456789" if c != d[i]])
            bad = "".join(sorted(p))
        elif kind == 2:
            p = d[:]
            p.pop(rng.randrange(len(p)))
            bad = "".join(p)
        else:
            bad = good[::-1]
        if bad != good:
            return good + "\n", bad + "\n"
    return good + "\n", good[:-1] + "\n"                    # all digits equal: a dropped one


def distinct_tasks(make_task, n: int, rng: random.Random, *, exclude=(), max_draws: Optional[int] = None) -> list:
    """The first ``n`` tasks ``make_task(rng)`` draws whose prompts are distinct and not in ``exclude``
    (held-out splits: draw the splits of one stream in one call and slice it). Raises ValueError after
    ``max_draws`` draws (default 200 n) without n of them."""
    seen, out = set(exclude), []
    for _ in range(200 * n if max_draws is None else max_draws):
        if len(out) == n:
            return out
        t = make_task(rng)
        if t.prompt not in seen:
            seen.add(t.prompt)
            out.append(t)
    if len(out) == n:
        return out
    raise ValueError(f"found only {len(out)} distinct prompts of the {n} wanted; lower the held-out sizes "
                     "(most prompts must stay for training)")


def draw_excluding(make_task, exclude, rng: random.Random, *args):
    """``make_task(rng, *args)``, drawn again until its prompt is not in ``exclude`` (training draws around
    the held-out prompts)."""
    while True:
        t = make_task(rng, *args)
        if t.prompt not in exclude:
            return t
