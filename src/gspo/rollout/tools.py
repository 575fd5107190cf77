"""Tools for multi-turn episodes: plain Python functions the model may call.

A tool is a function with type hints and a Google-style docstring, the convention of
transformers' chat templates: its JSON schema (`transformers.utils.get_json_schema`) goes to
the template as ``tools=``, so the model sees it the way its family was trained to. Tools are
named by import path like reward functions (``rollout.tools=[pkg.mod:fn, path/file.py:fn]``).

The model's calls are read from the text of its turn by the parser `rollout.tool_parser` names
(`gspo.rollout.tool_calls`) and run here, by a `ToolRunner` in worker processes with a deadline, so a tool that hangs or crashes costs one reply, not the run. Every call gets a reply
the model reads as a tool message, and an outcome that is counted:

==============  ==============================================  ==========================
outcome         when                                            the reply the model reads
==============  ==============================================  ==========================
ok              the tool returned text (or a number / JSON)     what it returned
error           the tool raised                                 ``error: <Type>: <message>``
timeout         the tool ran past rollout.tool_timeout_s        ``error: timed out after Ns``
malformed       the call's JSON did not parse, or had no name   ``error: malformed tool call``
unknown         the name is not one of the tools                ``error: unknown tool 'x'``
bad_return      the tool returned something that is not text    ``error: returned <type>``
==============  ==============================================  ==========================

Model-written code never runs here: a tool is the user's function. A tool that runs code it is
handed must itself go through `gspo.rewards.sandbox` (the opt-in containment).
"""

from __future__ import annotations

import inspect
import json
import math
import multiprocessing as mp
import numbers
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gspo.config import RolloutConfig
from gspo.rewards import RewardConfigError, _import_attr
from gspo.rewards.workers import (close_at_exit, closed, default_start_method, detach_from_stop_signals,
                                  kill_worker, watch_parent)
from gspo.rollout.tool_calls import ToolCall, ToolConfigError

OUTCOMES = ("ok", "error", "timeout", "malformed", "unknown", "bad_return")


@dataclass(frozen=True)
class ToolReply:
    name: str
    content: str   # what the model reads as the tool message
    outcome: str   # one of OUTCOMES


def load_tools(names: Sequence[str], field_name: str = "rollout.tools") -> list[Callable]:
    """The functions named in `names`, each checked to have a schema (`tool_schema`)."""
    fns, seen = [], {}
    for i, name in enumerate(names):
        what = f"{field_name}[{i}]"
        try:
            fn = _import_attr(str(name), what)
        except RewardConfigError as e:
            raise ToolConfigError(str(e)) from None
        if not callable(fn):
            raise ToolConfigError(f"{what}: {name!r} is not callable")
        if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise ToolConfigError(f"{what}: {name!r} is an async or generator function; a tool returns its reply "
                                  "(text, a number, or a JSON-able list or dict) when called: make it a plain function")
        tool_schema(fn, what)
        if fn.__name__ in seen:
            raise ToolConfigError(f"{what}: a second tool named {fn.__name__!r} ({seen[fn.__name__]} is the first)")
        seen[fn.__name__] = what
        fns.append(fn)
    return fns


def load_environment(name: str, field_name: str = "rollout.environment"):
    """The environment class named `name`: a class with ``reset``, whose tools (`env_tools`) all
    have schemas; its ``step``, if any, is the turn handler of games without tools."""
    try:
        cls = _import_attr(str(name), field_name)
    except RewardConfigError as e:
        raise ToolConfigError(str(e)) from None
    if not isinstance(cls, type):
        raise ToolConfigError(f"{field_name}: {name!r} is not a class (one instance is made per episode)")
    if not callable(getattr(cls, "reset", None)):
        raise ToolConfigError(f"{field_name}: {name!r} has no reset(**row) method")
    for fn in env_tools(cls):
        method_schema(fn, f"{field_name}: method {fn.__name__!r}")
    return cls


def tool_schema(fn: Callable, what: str = "tool") -> dict:
    """`fn`'s JSON schema as chat templates take it (transformers' `get_json_schema`: type
    hints for every argument, a docstring with a description and an ``Args:`` section)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ToolConfigError(
            f"{what}: {getattr(fn, '__name__', fn)!r} cannot be described to the model ({e}); a tool needs type "
            "hints on every argument and a docstring with a description and an 'Args:' section") from None


def clean_text(text: str) -> str:
    """`text` as UTF-8 can carry it: a lone surrogate (from a tool that decoded bytes with
    `surrogateescape`, or sliced an emoji's UTF-16 pair) becomes '?' instead of stopping the
    run where the tokenizer meets it."""
    return text.encode("utf-8", "replace").decode("utf-8")


def describe(e: BaseException) -> str:
    """'Type: message' of an exception raised by user code, whose `str()` may itself raise."""
    try:
        message = str(e)
    except Exception:  # noqa: BLE001
        message = "(its message could not be read: str() raised)"
    return clean_text(f"{type(e).__name__}: {message}")


def reply_text(value: Any) -> str | None:
    """A tool's return value as the text of its reply: str as is, numbers, bools and JSON-able
    lists / dicts as JSON; None for anything else (counted as bad_return)."""
    if isinstance(value, str):
        return clean_text(str.__str__(value))  # (a str subclass's own __str__ is not trusted)
    if isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        value = value.item()  # numpy's and torch's scalars: their Python number
    if isinstance(value, numbers.Rational) and not isinstance(value, numbers.Integral):
        value = float(value)  # a Fraction
    if isinstance(value, (bool, numbers.Real, list, dict)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):  # (a list holding what JSON cannot write)
            return None
    return None


def _call_tool(fn: Callable, arguments: dict) -> tuple[str, str]:
    """(outcome, content) of one call, in whichever process runs it."""
    try:
        value = fn(**arguments)
    except Exception as e:
        return "error", f"error: {describe(e)}"
    text = reply_text(value)
    if text is None:
        return "bad_return", f"error: the tool returned {type(value).__name__}, not text"
    return "ok", text


class _Host:
    """What a worker (or, with no workers, the runner itself) holds: the plain tools and the
    environments of the episodes it serves. Every request returns a picklable reply."""

    def __init__(self, tools: dict, env_class, max_reply_chars: int):
        self.tools, self.env_class, self.envs, self.max_chars = tools, env_class, {}, max_reply_chars

    def _cut(self, text: str | None) -> str | None:
        """`text` at most `max_chars` long (a 64 MB reply stalled the run in the tokenizer)."""
        if text is None or len(text) <= self.max_chars:
            return text
        return f"{text[:self.max_chars]}\n[... {len(text) - self.max_chars} characters cut]"

    def handle(self, op: str, *args):
        """One request's reply; whatever user code raises on the way (a `bool()` or `repr()` of
        what it returned included) is the request's error, never the worker's end."""
        if op not in ("call", "reset", "env_call", "step", "finish"):
            raise ValueError(op)
        try:
            return self._handle(op, *args)
        except Exception as e:  # noqa: BLE001
            return "error", describe(e)

    def _handle(self, op: str, *args):
        if op == "call":
            name, arguments = args
            outcome, text = _call_tool(self.tools[name], arguments)
            return outcome, self._cut(text)
        if op == "reset":  # a new episode's environment: its first observation
            ep, row = args
            env = self.env_class()
            obs = env.reset(**row)  # (what it raises is the request's error: `handle`)
            self.envs[ep] = env
            return "ok", None if obs is None else self._cut(reply_text(obs))
        if op == "env_call":
            ep, name, arguments = args
            outcome, text = _call_tool(getattr(self.envs[ep], name), arguments)
            return outcome, self._cut(text)
        if op == "step":
            ep, messages = args
            new, done = self.envs[ep].step(messages)
            if isinstance(new, str):
                new = [{"role": "user", "content": new}]
            if not (isinstance(new, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                  for m in new)):
                return "error", f"step returned {type(new).__name__}, not a list of messages"
            new = [{**m, "content": clean_text(self._cut(m["content"]))} for m in new]
            return "ok", (new, bool(done))
        if op == "finish":  # the environment's reward (None: it reports none), then it is dropped
            ep = args[0]
            env = self.envs.pop(ep, None)
            value = getattr(env, "reward", None)
            try:
                value = value() if callable(value) else value
            except Exception as e:
                return "error", f"reward raised {describe(e)}"
            ok = value is None or (isinstance(value, numbers.Real) and not isinstance(value, bool)
                                   and math.isfinite(value))
            return ("ok", None if value is None else float(value)) if ok else ("error", f"reward {value!r}")


def _worker_main(conn, tools: dict, env_class, parent_pid: int, max_reply_chars: int) -> None:
    detach_from_stop_signals()  # the trainer decides what happens on Ctrl-C or a SIGTERM to the job
    watch_parent(parent_pid)
    host = _Host(tools, env_class, max_reply_chars)
    conn.send("ready")
    while True:  # (an orphaned worker, its parent SIGKILLed, is ended by `watch_parent`)
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, op, args = msg
        conn.send((call_id, host.handle(op, *args)))


def env_tools(env_class) -> list[Callable]:
    """An environment's tools: its public methods other than reset / step / reward, unbound
    (their schemas are read without `self`)."""
    if env_class is None:
        return []
    out = []
    for name in dir(env_class):
        fn = getattr(env_class, name)
        if name.startswith("_") or name in ("reset", "step", "reward") or not callable(fn) or isinstance(fn, type):
            continue
        out.append(fn)
    return out


def method_schema(fn: Callable, what: str) -> dict:
    """`tool_schema` of a method, without its `self`: a stand-in function with the method's
    name, docstring and resolved type hints (resolved in the method's own module)."""
    import typing

    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:
        raise ToolConfigError(f"{what}: the type hints of {fn.__name__!r} do not resolve ({e})") from None
    sig = inspect.signature(fn)

    def stand_in(*args, **kwargs):  # never called
        raise NotImplementedError

    stand_in.__name__ = stand_in.__qualname__ = fn.__name__
    stand_in.__doc__ = fn.__doc__
    stand_in.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])  # type: ignore[attr-defined]
    stand_in.__annotations__ = {k: v for k, v in hints.items() if k != "self"}
    return tool_schema(stand_in, what)


class ToolRunner:
    """Runs tool calls and hosts episodes' environments in `num_workers` long-lived worker
    processes (forked on Linux), each request with a deadline of `timeout_s`; a worker past it
    is killed and replaced, and the environments it held are lost (`lost` holds their
    episodes: those end in error). Episode e's environment lives on worker e % num_workers.
    ``num_workers=0`` runs everything in-process, without deadlines (for debugging)."""

    def __init__(self, tools: Sequence[Callable], *, timeout_s: float = 10.0, num_workers: int = 1,
                 env_class=None, max_reply_chars: int = RolloutConfig.tool_reply_max_chars):
        self.tools = {fn.__name__: fn for fn in tools}
        self.env_class = env_class
        self.env_methods = {fn.__name__ for fn in env_tools(env_class)}
        self.timeout_s, self.num_workers, self.max_reply_chars = float(timeout_s), int(num_workers), max_reply_chars
        self._ctx = mp.get_context(default_start_method())
        self._workers: list = [None] * self.num_workers
        self._local = _Host(self.tools, env_class, max_reply_chars) if self.num_workers == 0 else None
        self._next_id = 0
        self._homes: dict[int, set] = {w: set() for w in range(self.num_workers)}  # episodes per worker
        self.lost: set[int] = set()
        close_at_exit(self)  # before any worker starts: a non-daemon one must never outlive us
        try:
            for w in range(self.num_workers):
                self._start(w)
        except BaseException:
            self.close()
            raise

    def _start(self, w: int) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=_worker_main,
                                 args=(child, self.tools, self.env_class, os.getpid(), self.max_reply_chars),
                                 name=f"gspo-tool-{w}", daemon=False)  # a tool may start a Pool; close() stops it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            proc.start()
        child.close()
        if not (parent.poll(60.0) and parent.recv() == "ready"):
            raise ToolConfigError(f"tool worker {w} did not start (exit code {proc.exitcode})")
        self._workers[w] = (proc, parent)

    def _kill(self, w: int) -> None:
        kill_worker(*self._workers[w], group=True)
        self._workers[w] = None
        self.lost |= self._homes[w]  # their environments went with the worker
        self._homes[w] = set()

    def close(self) -> None:
        for w in range(self.num_workers):
            if self._workers[w] is not None:
                try:
                    self._workers[w][1].send(None)
                except (OSError, ValueError):
                    pass
                self._workers[w][0].join(timeout=1.0)
                self._kill(w)
        closed(self)

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # (a non-daemon worker of a runner nobody closed would hold up exit)
        try:
            self.close()
        except Exception:
            pass

    def _requests(self, reqs: list[tuple[int, str, tuple]]) -> list[tuple[str, Any]]:
        """(worker, op, args) requests -> (status, value) replies in order; status 'timeout' or
        'died' when the worker did not answer in time (it is then replaced). One request per
        worker is in flight at a time; different workers run theirs at once."""
        if self._local is not None:
            return [self._local.handle(op, *args) for _, op, args in reqs]
        out: list = [None] * len(reqs)
        queues: dict[int, list[int]] = {}
        for i, (w, _, _) in enumerate(reqs):
            queues.setdefault(w, []).append(i)
        while any(queues.values()):
            sent = {}
            for w, q in queues.items():
                if not q:
                    continue
                i = q.pop(0)
                if self._workers[w] is None:
                    self._start(w)
                self._next_id += 1
                try:
                    self._workers[w][1].send((self._next_id, reqs[i][1], reqs[i][2]))
                    sent[w] = (i, self._next_id)
                except (OSError, ValueError):
                    self._kill(w)
                    out[i] = ("died", "the worker's process died")
            for w, (i, call_id) in sent.items():
                got = None
                try:
                    if self._workers[w][1].poll(self.timeout_s):
                        got = self._workers[w][1].recv()
                except (EOFError, OSError):
                    got = (None, None)
                if got is None or got[0] != call_id:
                    self._kill(w)
                    out[i] = ("timeout", None) if got is None else ("died", None)
                else:
                    out[i] = got[1]
        return out

    def _home(self, ep: int) -> int:
        return ep % self.num_workers if self.num_workers else 0

    def run(self, calls: Sequence[ToolCall], episode: int | None = None) -> list[ToolReply]:
        """A reply to every call, in order (see the module docstring for the outcomes); with
        `episode`, its environment's methods are tools too."""
        replies: list[ToolReply | None] = [None] * len(calls)
        reqs, where = [], []
        for i, c in enumerate(calls):
            if c.error is not None:
                replies[i] = ToolReply(c.name, f"error: malformed tool call: {c.error}", "malformed")
            elif episode is not None and c.name in self.env_methods:
                if episode in self.lost:
                    replies[i] = ToolReply(c.name, "error: the environment was lost", "error")
                    continue
                reqs.append((self._home(episode), "env_call", (episode, c.name, c.arguments)))
                where.append(i)
            elif c.name in self.tools:
                reqs.append((i % max(self.num_workers, 1), "call", (c.name, c.arguments)))
                where.append(i)
            else:
                known = ", ".join(sorted(set(self.tools) | self.env_methods)) or "none"
                replies[i] = ToolReply(c.name, f"error: unknown tool {c.name!r} (tools: {known})", "unknown")
        for i, got in zip(where, self._requests(reqs)):
            name = calls[i].name
            if got[0] == "timeout":
                replies[i] = ToolReply(name, f"error: timed out after {self.timeout_s:g}s", "timeout")
            elif got[0] == "died":
                replies[i] = ToolReply(name, "error: the tool's process died", "error")
            else:
                replies[i] = ToolReply(name, got[1], got[0])
        return replies  # type: ignore[return-value]

    def reset(self, rows: Sequence[dict]) -> list[tuple[str, Any]]:
        """A fresh environment for episode i of `rows` (its dataset row's columns as keyword
        arguments): ('ok', first observation or None) or ('error', why)."""
        reqs = []
        for ep, row in enumerate(rows):
            self._homes.setdefault(self._home(ep), set()).add(ep)
            reqs.append((self._home(ep), "reset", (ep, dict(row))))
        self.lost = set()
        return [_as_outcome(o) for o in self._requests(reqs)]

    def step(self, episodes: Sequence[int], messages: Sequence[list[dict]]) -> list[tuple[str, Any]]:
        """env.step(messages) of each episode: ('ok', (new messages, done)) or ('error', why)."""
        out = self._requests([(self._home(ep), "step", (ep, list(m))) for ep, m in zip(episodes, messages)])
        return [_as_outcome(o) for o in out]

    def finish(self, episodes: Sequence[int]) -> tuple[list[float | None], list[str]]:
        """Each episode's environment reward (None: none reported, or it was lost / failed), and
        why each reward that was there could not be read (not a finite number, or it raised)."""
        live = [ep for ep in episodes if ep not in self.lost]
        got = dict(zip(live, self._requests([(self._home(ep), "finish", (ep,)) for ep in live])))
        for w in self._homes:
            self._homes[w] -= set(episodes)
        bad = [got[ep][1] for ep in live if got[ep][0] == "error" and str(got[ep][1]).startswith("reward ")]
        return [got[ep][1] if ep in got and got[ep][0] == "ok" else None for ep in episodes], bad


def _as_outcome(reply: tuple[str, Any]) -> tuple[str, Any]:
    """A worker's ('ok' | 'error', value) as it is; a 'timeout' or 'died' as ('error', that word)."""
    return reply if reply[0] in ("ok", "error") else ("error", reply[0])
