"""Built-in multi-turn tasks: a calculator tool that makes a hard task easy, and a number
guessing game with higher / lower feedback (docs/tools.md, examples/tools/).

    data.source=multiply rollout.tools=[gspo.tool_tasks:calc]        rewards: exact_answer
    data.source=guess rollout.environment=gspo.tool_tasks:GuessNumber rewards: env_reward

`calc` evaluates arithmetic by walking Python's syntax tree (numbers, + - * / // % and
parentheses only): nothing the model writes is executed.
"""

from __future__ import annotations

import ast
import operator
import random
import re

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _value(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 1e18:
            raise ValueError("result too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError("only numbers, + - * / // % and parentheses are allowed")


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: numbers with + - * / // % and parentheses, e.g. 347*28
    """
    if len(expression) > 200:
        raise ValueError("expression too long")
    v = _value(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    return str(v)


def multiply(n: int, *, seed: int, difficulty: int = 1) -> list[dict]:
    """`n` products too hard to answer digit by digit for a tiny model and easy with `calc`:
    'what is 347*28?' -> '9716'. Difficulty d: the first factor has d + 2 digits, the second 2."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10 ** (difficulty + 1), 10 ** (difficulty + 2) - 1), rng.randint(10, 99)
        rows.append({"prompt": f"what is {a}*{b}?", "answer": str(a * b)})
    return rows


def guess(n: int, *, seed: int, difficulty: int = 1) -> list[dict]:
    """`n` games of `GuessNumber`: a secret from 1 to 8 * 2**difficulty (a column of the row)."""
    rng = random.Random(seed)
    top = 8 * 2 ** difficulty
    return [{"prompt": f"guess my number from 1 to {top}. answer with one number.", "secret": rng.randint(1, top),
             "top": top} for _ in range(n)]


class GuessNumber:
    """A game without tools: the model guesses, the environment says higher or lower. The
    reward is 1 when the secret is found, less 0.1 a wrong guess (at least 0); 0 if never."""

    def reset(self, secret: int = 1, top: int = 16, **row) -> None:
        self.secret, self.top, self.guesses, self.found = int(secret), int(top), 0, False
        return None  # the prompt already says what to do

    def step(self, messages: list[dict]):
        text = messages[-1]["content"] if messages else ""
        m = re.search(r"-?\d+", text)
        self.guesses += 1
        if m is None:
            return [{"role": "user", "content": "answer with one number"}], False
        g = int(m.group())
        if g == self.secret:
            self.found = True
            return [{"role": "user", "content": "correct"}], True
        return [{"role": "user", "content": "higher" if g < self.secret else "lower"}], False

    @property
    def reward(self) -> float:
        return max(0.0, 1.0 - 0.1 * (self.guesses - 1)) if self.found else 0.0
