"""Built-in reward functions (TRL's contract: `fn(prompts, completions, **columns)`).

- `exact_answer`: the completion's answer equals the `answer` column (whole completion, last
  `\\boxed{...}` or `<answer>...</answer>`).
- `math_verify`: mathematical equivalence with the `answer` column, via the `math-verify` package.
- `format`: the completion fully matches a regular expression.
- `code_tests`: runs model-written code against tests (gspo.rewards.sandbox; opt-in only).
"""

from __future__ import annotations

import functools
import numbers
import re
import threading
from typing import Any, Callable

from gspo.rewards.errors import RewardConfigError


_BOXED = re.compile(r"\\boxed\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced; None if there is none (or unclosed)."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start, depth = matches[-1].end(), 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def completion_text(completion: Any) -> str:
    """The text of a completion: a str, or the content of the last assistant message of a message
    list (TRL's conversational shape); "" when the model wrote none. An episode may end with a
    tool's reply or the environment's message (its budget ran out after a call; the game ended):
    those are not the model's answer."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and all(isinstance(m, dict) for m in completion):
        said = [m for m in completion if m.get("role", "assistant") == "assistant"]
        return str(said[-1].get("content") or "") if said else ""
    raise TypeError(f"a completion must be a str or a list of messages, got {type(completion).__name__}")


_WHOLE_FLOAT = re.compile(r"^([+-]?\d+)\.0+$")


def gold_answers(gold) -> set[str]:
    """The accepted forms of one row's `answer` (empty: the answer is missing). Missing are None,
    NaN (an empty cell read by pandas or parquet) and empty or blank text; a list accepts any
    of its items. A whole number written as a float, as pandas writes an integer column that
    has an empty cell (4.0 for 4), is accepted in its integer form too."""
    out: set[str] = set()
    for g in gold if isinstance(gold, (list, tuple)) else [gold]:
        if g is None or (isinstance(g, numbers.Number) and g != g):  # (numpy's NaN too)
            continue
        text = str(g).strip()
        if not text:
            continue
        out.add(text)
        if (m := _WHOLE_FLOAT.match(text)) and not isinstance(g, bool):
            out.add(str(int(m.group(1))))
    return out


def exact_answer(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 when the completion's answer equals the `answer` column (after stripping whitespace),
    else 0.0; None where the answer is missing (`gold_answers`: None, NaN, empty or blank). The
    completion's answer is the whole completion, the last \\boxed{...}, or the last
    <answer>...</answer> (any may match; an empty one never does). A list-valued answer accepts
    any of its items; a non-string answer is compared as `str(answer)`."""
    if answer is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        golds = gold_answers(gold)
        if not golds:
            out.append(None)
            continue
        text = completion_text(completion)
        tags = _ANSWER_TAG.findall(text)
        candidates = [text, _last_boxed(text), tags[-1] if tags else None]
        out.append(float(any(c is not None and c.strip() in golds for c in candidates)))
    return out


def import_math_verify():
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise RewardConfigError("reward 'math_verify' needs the math-verify package: pip install 'gspo[math]'") from e
    return parse, verify


def math_verify(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 when math-verify finds the completion mathematically equal to the `answer` column
    ("\\boxed{1/2}" matches "0.5"), else 0.0; None where the answer is missing or unparsable.

    math-verify's own timeouts use SIGALRM, which only works on a main thread: they are kept
    there (as in RewardRunner's workers) and turned off elsewhere, where only the runner's
    deadline bounds the call. Needs the optional extra `gspo[math]`.
    """
    parse, verify = import_math_verify()
    if answer is None:
        return [None] * len(completions)
    t = 5 if threading.current_thread() is threading.main_thread() else None
    out: list[float | None] = []
    for completion, gold_cell in zip(completions, answer):
        golds = [g for text in sorted(gold_answers(gold_cell))  # None, NaN, empty or blank: missing
                 if (g := parse(text, parsing_timeout=t) or parse(f"${text}$", parsing_timeout=t))]
        if not golds:  # missing or unparsable
            out.append(None)
            continue
        pred = parse(completion_text(completion), parsing_timeout=t)
        out.append(float(bool(pred) and any(verify(g, pred, timeout_seconds=t) for g in golds)))
    return out


DEFAULT_FORMAT_PATTERN = r"^\s*<think>.*</think>\s*<answer>.*</answer>\s*$"


def format_reward(prompts, completions, pattern: str = DEFAULT_FORMAT_PATTERN, **kwargs) -> list[float]:
    """1.0 when the whole completion matches `pattern` (re.fullmatch with re.DOTALL), else 0.0."""
    rx = re.compile(pattern, re.DOTALL)
    return [float(rx.fullmatch(completion_text(c)) is not None) for c in completions]


def make_format_reward(pattern: str = DEFAULT_FORMAT_PATTERN) -> Callable[..., list[float]]:
    """A `format` reward with a fixed pattern (a partial, so it pickles for spawned workers)."""
    re.compile(pattern)  # fail now on a bad pattern
    return functools.partial(format_reward, pattern=pattern)


# A string value is imported on first use ("module:attr"), so optional parts load lazily.
def env_reward(prompts, completions, env_reward=None, **kwargs) -> list[float | None]:
    """The reward each episode's environment reported (rollout.environment); None where it
    reported none."""
    if env_reward is None:
        return [None] * len(completions)
    return [None if v is None else float(v) for v in env_reward]


BUILTIN_REWARDS: dict[str, Callable | str] = {
    "env_reward": env_reward,
    "exact_answer": exact_answer,
    "math_verify": math_verify,
    "format": format_reward,
    "code_tests": "gspo.rewards.sandbox:code_tests_reward",
}
