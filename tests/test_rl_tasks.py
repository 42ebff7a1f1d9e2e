"""Verifiable task generators and checkers."""

import re
from fractions import Fraction

import pytest

from glm5_jax.rl.tasks import (
    ARITH_LEVELS,
    COUNTDOWN_LEVELS,
    Task,
    aggregate_statuses,
    arithmetic_task,
    arithmetic_tasks,
    check_countdown,
    countdown_tasks,
    function_tasks,
    make_tasks,
    safe_eval_arith,
    score_arithmetic,
    score_countdown,
)


def test_generators_deterministic_per_seed():
    for kind, levels in (("arithmetic", ARITH_LEVELS), ("countdown", COUNTDOWN_LEVELS)):
        a = make_tasks(kind, 40, seed=3, level=levels)
        b = make_tasks(kind, 40, seed=3, level=levels)
        c = make_tasks(kind, 40, seed=4, level=levels)
        assert a == b and a != c
    assert make_tasks("function", 5, seed=1) == make_tasks("function", 5, seed=1)


def test_level0_is_single_digit_addition():
    for t in arithmetic_tasks(50, seed=0, level=0):
        a, b = t.prompt[:-1].split("+")
        assert len(a) == 1 and len(b) == 1 and t.prompt.endswith("=")
        assert int(t.answer) == int(a) + int(b)
        assert t.solution == t.answer + "\n"


@pytest.mark.parametrize("level", ARITH_LEVELS)
def test_arithmetic_reference_and_solution_score_correct(level):
    for worked in (False, True):
        for t in arithmetic_tasks(30, seed=level, level=level, worked=worked):
            assert len(t.prompt) <= 12
            # reference answer independently: Python's own evaluator on the generated
            # (trusted, digits-and-operators-only) prompt
            assert re.fullmatch(r"[0-9+\-*()]+=", t.prompt)
            assert int(t.answer) == eval(t.prompt[:-1])  # noqa: S307
            assert Fraction(int(t.answer)) == safe_eval_arith(t.prompt[:-1])
            assert t.score(t.solution) == (1.0, "correct")
            assert t.score(t.answer + "\n") == (1.0, "correct")
    if level == 4:
        assert any("(" in t.prompt for t in arithmetic_tasks(10, seed=0, level=4))


def test_arithmetic_statuses():
    t = arithmetic_task(0, level=3)
    good = int(t.answer)
    assert t.score(f"{good}\n") == (1.0, "correct")
    assert t.score(f" {good} \ntrailing junk") == (1.0, "correct")
    assert t.score(f"1=2;{good}\n") == (1.0, "correct")
    assert t.score(f"{good + 1}\n") == (0.0, "wrong")
    assert t.score(f"{good}") == (0.0, "truncated")
    assert t.score("") == (0.0, "truncated")
    for bad in ("\n", "abc\n", f"{good}.0\n", f"{good}+0\n", "1 2\n", "9" * 60 + "\n"):
        assert t.score(bad) == (0.0, "malformed"), bad
    assert score_arithmetic("-3\n", -3) == (1.0, "correct")


@pytest.mark.parametrize("level", COUNTDOWN_LEVELS)
def test_countdown_generated_solutions_are_valid(level):
    for t in countdown_tasks(40, seed=level, level=level):
        assert t.score(t.solution) == (1.0, "correct")
        assert 1 <= t.target <= 99 and t.target not in t.numbers
        assert t.prompt == " ".join(map(str, t.numbers)) + "->" + str(t.target) + ":"


def test_countdown_checker():
    nums, target = (3, 5, 7), 22
    assert check_countdown("3*5+7", nums, target)[0] == "correct"
    assert check_countdown("(7*3)+(5-3)", nums, target)[0] == "wrong"  # reuses 3
    st, detail = check_countdown("7*3+1", nums, target)
    assert st == "wrong" and "not given" in detail
    assert check_countdown("3*5*7", nums, target)[0] == "wrong"
    assert check_countdown("7/(5-5)", (7, 5, 5), 1)[0] == "wrong"  # division by zero
    assert check_countdown("(5+7)/3", nums, 4)[0] == "correct"  # exact division accepted
    assert check_countdown("7/2", (7, 2), 3)[0] == "wrong"  # 3.5, not floor division
    for bad in (
        "__import__('os')",
        "__import__('os').system('true')",
        "(lambda: 22)()",
        "3**5",
        "-3+25",
        "3 5 7",
        "0x16",
        "22.0",
        "3*5+7;",
        "len('aaaa')",
        "[3, 5]",
        "3 if 1 else 5",
        "",
        "(" * 200 + "3" + ")" * 200,
    ):
        assert check_countdown(bad, nums, target)[0] == "malformed", bad
    with pytest.raises(ValueError):
        safe_eval_arith("__import__('os')")


def test_countdown_score_statuses():
    assert score_countdown("3*5+7\n", (3, 5, 7), 22) == (1.0, "correct")
    assert score_countdown("3*5+7", (3, 5, 7), 22) == (0.0, "truncated")
    assert score_countdown("3*7+5\n", (3, 5, 7), 22) == (0.0, "wrong")
    assert score_countdown("7+7+5+3\n", (3, 5, 7), 22) == (0.0, "wrong")  # 7 twice
    assert score_countdown("abc\n", (3, 5, 7), 22) == (0.0, "malformed")


def test_aggregate_statuses():
    t = Task(kind="arithmetic", prompt="1+1=", answer="2", solution="2\n")
    outs = [t.score(x) for x in ("2\n", "3\n", "x\n", "2", "2\n")]
    agg = aggregate_statuses(outs)
    assert agg["n"] == 5 and agg["correct"] == 2 and agg["wrong"] == 1
    assert agg["malformed"] == 1 and agg["truncated"] == 1
    assert agg["frac_correct"] == pytest.approx(0.4) and agg["reward_mean"] == pytest.approx(0.4)
    agg2 = aggregate_statuses(["correct", "truncated"])
    assert agg2["frac_truncated"] == 0.5 and "reward_mean" not in agg2
    assert aggregate_statuses([])["n"] == 0


def test_function_tasks_sandboxed():
    tasks = function_tasks()
    names = [t.prompt.split("(")[0][4:] for t in tasks]
    assert "add" in names and "is_even" in names
    for t in tasks:
        assert t.score(t.solution) == (1.0, "correct"), t.prompt
    add = tasks[names.index("add")]
    assert add.score("    return a - b\n\n") == (0.0, "wrong")
    assert add.score("    return a + b\n") == (0.0, "truncated")
    assert add.score("    return a +\n\n") == (0.0, "malformed")
    assert add.score("    while True:\n        pass\n\n", timeout_s=0.5) == (0.0, "wrong")


def test_held_out_helpers_distinct_tasks_and_draw_excluding():
    import random
    from glm5_jax.rl.tasks import d2d1_task, distinct_tasks, draw_excluding, named_task
    ts = distinct_tasks(d2d1_task, 50, random.Random(0))
    assert len({t.prompt for t in ts}) == 50
    # one call drawing dev + test is the two splits drawn one after the other from the same stream
    rng = random.Random(0)
    dev = distinct_tasks(d2d1_task, 20, rng)
    test = distinct_tasks(d2d1_task, 30, rng, exclude={t.prompt for t in dev})
    assert [t.prompt for t in dev + test] == [t.prompt for t in ts]
    with pytest.raises(ValueError, match="distinct prompts"):
        distinct_tasks(lambda rng: d2d1_task(random.Random(1)), 2, random.Random(0))
    held = {t.prompt for t in ts}
    rng = random.Random(5)
    assert all(draw_excluding(d2d1_task, held, rng).prompt not in held for _ in range(200))
    assert named_task(random.Random(0), "level1").kind == "arithmetic"
    with pytest.raises(ValueError, match="unknown task"):
        named_task(random.Random(0), "sorting")
