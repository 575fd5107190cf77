"""What the code_tests reward reads: the program in a completion (`extract_code`, the last
python fence of a markdown answer) and a row's test cases (`test_cases`, from a list, or from a
list or string a dataset saved as text)."""

from __future__ import annotations

import ast
import json
import re
import textwrap
from typing import Any


def _fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of each ``` block, read line by line: a block opens at ``` anywhere in
    a line (not ```inline``` code) and closes at a line that starts or ends with ``` (so a '```'
    inside the code's strings does not close it); an unclosed block runs to the end."""
    blocks, lang, body = [], None, []
    for line in text.splitlines(keepends=True):
        if lang is None:
            at = line.find("```")
            if at >= 0 and "```" not in line[at + 3 :]:
                lang, body = re.match(r"[ \t]*([\w+-]*)", line[at + 3 :]).group(1), []
            continue
        stripped = line.strip()
        if stripped.startswith("```") or stripped.endswith("```"):
            if not stripped.startswith("```"):  # code```: the code before it is the block's last line
                body.append(line.rstrip()[:-3] + "\n")
            blocks.append((lang, "".join(body)))
            lang = None
        else:
            body.append(line)
    if lang is not None:
        blocks.append((lang, "".join(body)))
    return blocks


def extract_code(text: str) -> str:
    """The last ```python (or ```py) block; else the last unlabeled ``` block; else all of `text`.
    A block is dedented (a fence inside a markdown list item is indented with its code)."""
    blocks = _fenced_blocks(text)
    for wanted in (("python", "py", "python3"), ("",)):
        found = [body for lang, body in blocks if lang.lower() in wanted]
        if found:
            return textwrap.dedent(found[-1])
    return text


def _literal(text: str) -> Any:
    """`text` read as a JSON value, else as a Python literal (pandas writes a list column to CSV
    as its repr, ['assert f(1) == 2']); None when it is neither (Python code that starts so)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def test_cases(t: Any, i: int) -> str | list | tuple | None:
    """One row's `tests` as code_tests reads it. A string that is a list or a string saved as
    text (JSON, or a Python repr as pandas writes a list column to CSV) is that list or string:
    run as Python it would be one expression that does nothing, and pass. A blank string is no
    tests."""
    t = t.tolist() if hasattr(t, "tolist") else t  # numpy/arrow rows
    if not isinstance(t, (str, list, tuple, type(None))):
        raise TypeError(f"code_tests: tests for sample {i} must be a str or a list of str, got {type(t).__name__}")
    if isinstance(t, str) and not t.strip():
        return None
    if isinstance(t, str) and t.lstrip()[:1] in ("[", "'", '"'):  # a list or a string, saved as text
        cases = _literal(t)
        if isinstance(cases, str):  # one quoted statement: run unquoted (quoted, it is a no-op that passes)
            return cases
        if isinstance(cases, list):
            if not all(isinstance(c, str) for c in cases):
                raise TypeError(f"code_tests: tests for sample {i} is a list saved as text whose items are not all "
                                f"strings (each must be Python statements): {t[:200]!r}")
            return cases
    if isinstance(t, (list, tuple)) and not all(isinstance(c, str) for c in t):  # 1 or None would pass as statements
        raise TypeError(f"code_tests: tests for sample {i} must be a list of str (Python statements), got an item "
                        f"{next(c for c in t if not isinstance(c, str))!r}")
    return t
