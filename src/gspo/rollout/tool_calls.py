"""Reading the tool calls a model wrote in its turn: `ToolCall`, and the parsers
`rollout.tool_parser` names, each for the format a family's chat template shows its models:

- `parse_hermes` (``hermes``, the default): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, Qwen2.5 / Qwen3 and the Hermes templates;
- `parse_llama3_json` (``llama3_json``): a turn that is ``{"name": ..., "parameters": {...}}``
  calls, Llama 3.1-3.3;
- `parse_mistral` (``mistral``): calls after ``[TOOL_CALLS]``, each with the id Mistral's templates
  pair its reply by;
- or a function ``text -> list[ToolCall]`` of the user's, by import path (`resolve_parser`).

A call that cannot be read is a `ToolCall` with `error` set; the model reads why as the reply.
Running the calls is `gspo.rollout.tools`' job.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
from dataclasses import dataclass, field, replace
from typing import Callable

from gspo.rewards import RewardConfigError, _import_attr


class ToolConfigError(RewardConfigError):
    """A tool or tool parser named in the config cannot be used (raised before any compute)."""


class ToolParserError(RuntimeError):
    """A user's tool parser broke mid-run (it returned something other than ToolCalls): the run
    stops with its last state saved, as for a reward function that raises."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: a tool name and its arguments, or why it could not be read."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set for a malformed call
    id: str | None = None  # where the family's template pairs each reply with its call (Mistral's)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _json_call(obj) -> ToolCall:
    """A call from its JSON object: {"name": str, "arguments" (or Llama's "parameters"): an
    object, or a JSON string of one}; anything else is a malformed call saying why."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error="no \"name\" string")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error="\"arguments\" is a string that is not JSON")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error="\"arguments\" is not an object")
    return ToolCall(obj["name"], args)


_THINKING = re.compile(r"<think>.*?</think>", re.DOTALL)


def after_thinking(text: str) -> str:
    """What a turn says after its reasoning, as vLLM's reasoning parsers split it before a tool
    parser reads the turn: a turn that opens with ``<think>`` (Qwen3) says what follows its
    ``</think>``, and nothing if it never closes it (the model ran out of tokens thinking); one
    whose first ``</think>`` comes before any ``<think>`` (its prompt opened the reasoning, as
    DeepSeek-R1's templates do) says what follows that; any later whole ``<think>…</think>``
    block is reasoning too. A call the model drafts while it thinks is not a call; a ``<think>``
    inside a call's arguments, in a turn that did not open with one, is left as written. (A
    prompt-opened reasoning the model never closes cannot be told from a plain turn.)"""
    if text.lstrip().startswith("<think>"):
        text = text.partition("</think>")[2]
    elif "</think>" in text and "<think>" not in text.partition("</think>")[0]:
        text = text.partition("</think>")[2]
    return _THINKING.sub("", text)


def parse_hermes(text: str) -> list[ToolCall]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of `text`, in order
    (the format of Qwen2.5 / Qwen3 and the Hermes templates), and a last block left open at the
    end of the turn; none inside the turn's reasoning (`after_thinking`: Qwen3 thinks in
    ``<think>`` before it calls). `arguments` may also be a JSON string of an object. A block that
    does not parse is a ToolCall with `error` set."""
    text = after_thinking(text)
    bodies = _HERMES.findall(text)
    end = text.rfind("</tool_call>")
    rest = text[end + len("</tool_call>"):] if end >= 0 else text
    if (opened := rest.find("<tool_call>")) >= 0:  # a last call left open at the end of the turn (the model
        bodies.append(rest[opened + len("<tool_call>"):].strip())  # stopped before its closing tag), as vLLM reads it
    calls = []
    for body in bodies:
        try:
            calls.append(_json_call(json.loads(body)))
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"not JSON ({e.msg} at {e.pos})"))
    return calls


def parse_llama3_json(text: str) -> list[ToolCall]:
    """Llama 3.1-3.3's JSON tool calls (the format their templates show the model): the whole
    turn is ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several
    calls separated by ";". A turn that does not start with "{" is an answer, with no call, and so
    is one of JSON objects none of which has a "name", "parameters" or "arguments" (an answer
    written as JSON, as vLLM's parser reads it); any other that starts with "{" but is not such
    calls throughout is a malformed call."""
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].lstrip()
    if not body.startswith("{"):
        return []
    calls, objs, decoder, pos = [], [], json.JSONDecoder(), 0
    while pos < len(body):
        try:
            obj, pos = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            return calls + [ToolCall("", error=f"not JSON ({e.msg} at {e.pos})")]
        objs.append(obj)
        calls.append(_json_call(obj))
        rest = body[pos:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        if rest and not rest.startswith("{"):
            return calls + [ToolCall("", error="text after the JSON call")]
        pos = len(body) - len(rest)
    if not tagged and all(isinstance(o, dict) and not o.keys() & {"name", "parameters", "arguments"} for o in objs):
        return []  # an answer that is JSON
    return calls


_MISTRAL_CALLS, _MISTRAL_ARGS, _MISTRAL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits


def call_id(text: str, index: int) -> str:
    """A call id of 9 letters and digits (the form Mistral's templates require) for call `index`
    of the turn `text`, derived from both: a turn gets the same ids in every run."""
    digest = hashlib.sha256(f"{index}\0{text}".encode()).digest()
    return "".join(_ID_CHARS[b % len(_ID_CHARS)] for b in digest[:9])


def parse_mistral(text: str) -> list[ToolCall]:
    """Mistral's tool calls, each after ``[TOOL_CALLS]``: a JSON list (or object) of
    ``{"name": ..., "arguments": {...}}`` calls (Mistral 7B v0.3, Mixtral, Nemo, Small 3.1), or
    ``name[ARGS]{...}``, optionally ``name[CALL_ID]id[ARGS]{...}`` (the v11+ tokenizers: Small 3.2,
    Magistral, Devstral). Text before the first ``[TOOL_CALLS]`` is the turn's answer; text after
    a call's JSON is ignored. Every call carries an id, which the template pairs with its reply:
    the model's own where it wrote one of 9 letters and digits, else `call_id`'s."""
    start = text.find(_MISTRAL_CALLS)
    if start < 0:
        return []
    calls, decoder = [], json.JSONDecoder()
    for part in text[start + len(_MISTRAL_CALLS):].split(_MISTRAL_CALLS):
        body = part.strip()
        if body.startswith(("[", "{")):  # a JSON list of calls, or one call
            try:
                obj = decoder.raw_decode(body)[0]
            except json.JSONDecodeError as e:
                calls.append(ToolCall("", error=f"not JSON ({e.msg} at {e.pos})"))
                continue
            for o in obj if isinstance(obj, list) else [obj]:
                own = o.get("id") if isinstance(o, dict) else None
                calls.append(replace(_json_call(o), id=own if isinstance(own, str) else None))
            continue
        name, sep, rest = body.partition(_MISTRAL_ARGS)
        name, _, own = name.partition(_MISTRAL_ID)
        if not sep or not name.strip():
            calls.append(ToolCall("", error=f"no tool name and {_MISTRAL_ARGS} after {_MISTRAL_CALLS}"))
            continue
        try:
            args = decoder.raw_decode(rest.strip())[0]
        except json.JSONDecodeError as e:
            calls.append(ToolCall(name.strip(), error=f"{_MISTRAL_ARGS} not JSON ({e.msg} at {e.pos})"))
            continue
        calls.append(replace(_json_call({"name": name.strip(), "arguments": args}), id=own.strip() or None))
    own_ok = lambda c: c.id and len(c.id) == 9 and c.id.isascii() and c.id.isalnum()  # noqa: E731
    return [c if own_ok(c) else replace(c, id=call_id(text, i)) for i, c in enumerate(calls)]


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json,
                                                       "mistral": parse_mistral}


def writes_call_ids(name: str) -> bool | None:
    """Whether the parser `rollout.tool_parser` names gives calls ids; None for one of the user's."""
    return name == "mistral" if name in PARSERS else None


def resolve_parser(name: str) -> Callable[[str], list[ToolCall]]:
    """A built-in parser by name, or a function ``text -> list[ToolCall]`` by import path."""
    if name in PARSERS:
        return PARSERS[name]
    try:
        fn = _import_attr(name, "rollout.tool_parser")
    except RewardConfigError as e:
        raise ToolConfigError(f"{e} (built-in parsers: {', '.join(PARSERS)})") from None
    if not callable(fn):
        raise ToolConfigError(f"rollout.tool_parser: {name!r} is not callable")
    return fn
