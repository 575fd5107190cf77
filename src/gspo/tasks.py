"""Built-in offline tasks: rows with a prompt and a checkable answer, generated from a seed.

They exist so that a run (the demo, the end-to-end tests) needs no download: a tiny model with
a character-level tokenizer can learn them, and `exact_answer` scores them. Every prompt and
answer is plain text without spaces, drawn from `TASK_CHARS`, and the completion is expected
to be just the answer (e.g. prompt "12+7=", completion "19").

The same (name, n, seed, difficulty) gives the same rows on every machine and Python version:
each task draws from its own `random.Random` seeded with a string (hashed with SHA-512 by the
standard library, so `PYTHONHASHSEED` plays no part).
"""

from __future__ import annotations

import random
from typing import Callable

from gspo.config import DataConfig
from gspo.data import DataError

DIGITS = "0123456789"
# Every character a task prompt or answer can contain; a char tokenizer is built from it.
TASK_CHARS: frozenset[str] = frozenset(DIGITS + "+-*=" + "sort:")

_DIFFICULTIES = (1, 2, 3)


def _check_args(fn: str, n: int, seed: int, difficulty: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise DataError(f"{fn}: n must be a positive int, got {n!r}")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise DataError(f"{fn}: seed must be an int, got {seed!r}")
    if difficulty not in _DIFFICULTIES:
        raise DataError(f"{fn}: difficulty must be one of {_DIFFICULTIES}, got {difficulty!r}")


def arithmetic(n: int, *, seed: int, difficulty: int = DataConfig.difficulty) -> list[dict]:
    """`n` rows like {"prompt": "12+7=", "answer": "19"}.

    difficulty 1: a+b with a, b in 0..99 (one- or two-digit numbers).
    difficulty 2: a+b or a-b with a, b in 10..99 (two-digit); a-b may be negative ("-12").
    difficulty 3: a+b or a-b with a, b in 0..999, or a*b with a, b in 0..99 (so products keep
        at most 4 digits), each operator equally likely.
    """
    _check_args("arithmetic", n, seed, difficulty)
    rng = random.Random(f"gspo.tasks.arithmetic:{difficulty}:{seed}")
    rows = []
    for _ in range(n):
        if difficulty == 1:
            op, hi, lo = "+", 99, 0
        elif difficulty == 2:
            op, hi, lo = rng.choice("+-"), 99, 10
        else:
            op = rng.choice("+-*")
            lo, hi = 0, (99 if op == "*" else 999)
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"prompt": f"{a}{op}{b}=", "answer": str(value)})
    return rows


def sorting(n: int, *, seed: int, difficulty: int = DataConfig.difficulty) -> list[dict]:
    """`n` rows like {"prompt": "sort:3142=", "answer": "1234"}: sort the digits ascending.

    Digits are drawn uniformly with repetition. The number of digits per prompt is drawn
    uniformly from 3..4 (difficulty 1), 5..6 (difficulty 2) or 7..8 (difficulty 3).
    """
    _check_args("sorting", n, seed, difficulty)
    rng = random.Random(f"gspo.tasks.sorting:{difficulty}:{seed}")
    lo, hi = {1: (3, 4), 2: (5, 6), 3: (7, 8)}[difficulty]
    rows = []
    for _ in range(n):
        digits = [rng.choice(DIGITS) for _ in range(rng.randint(lo, hi))]
        rows.append({"prompt": f"sort:{''.join(digits)}=", "answer": "".join(sorted(digits))})
    return rows


def _tool_task(name: str):
    def make(n: int, *, seed: int, difficulty: int = DataConfig.difficulty) -> list[dict]:
        from gspo import tool_tasks

        return getattr(tool_tasks, name)(n, seed=seed, difficulty=difficulty)
    make.__doc__ = f"The multi-turn task gspo.tool_tasks.{name} (its tools or environment: docs/tools.md)."
    return make


TASKS: dict[str, Callable[..., list[dict]]] = {"arithmetic": arithmetic, "sorting": sorting,
                                               "multiply": _tool_task("multiply"), "guess": _tool_task("guess")}
# Tasks whose prompt does not tell one row from another (guess: every game's prompt is the same,
# its secret a column): a prompt cannot leak what a row asks, so their held-out rows are fresh
# draws, not rows whose prompt training never saw (there are none).
SAME_PROMPT_TASKS = frozenset({"guess"})


def make_task(name: str, n: int, seed: int, difficulty: int = DataConfig.difficulty) -> list[dict]:
    """Rows of the built-in task `name` (a key of `TASKS`); DataError for an unknown name."""
    if name not in TASKS:
        raise DataError(f"make_task: unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name](n, seed=seed, difficulty=difficulty)
