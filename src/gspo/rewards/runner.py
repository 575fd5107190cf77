"""The reward runner: reward functions called in long-lived worker processes with a deadline,
so that a hung or crashing function cannot stall or take down training, and signal-based
timeouts inside a function (math-verify's) run on the worker's main thread where they work.
The contract and name resolution are in `gspo.rewards`; reward models (`model:` / `judge:`)
run in this process instead (`gspo.rewards.models`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
import multiprocessing as mp
import numbers
import os
import time
import traceback
import warnings
from multiprocessing.connection import wait as _wait_conns
from typing import Any, Sequence

import torch

from gspo.config import RewardsConfig
from gspo.rewards import RewardConfigError, RewardError, RewardSpec, by_keyword, validate_specs
from gspo.rewards.models import DeadlineExceeded, ModelScorer
from gspo.rewards.workers import (close_at_exit, closed, default_start_method, detach_from_stop_signals,
                                  kill_worker, watch_parent)


# ---------------------------------------------------------------------------------------------
# Calling a function (the same code runs in a worker or, with num_workers=0, in-process)


def _check_values(values: Any, n: int, name: str) -> list[float | None]:
    """Values as floats/None; raises RewardError on the wrong count or type (always)."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function {name!r} returned {type(values).__name__}, expected a list of {n} numbers")
    if len(values) != n:
        raise RewardError(f"reward function {name!r} returned {len(values)} values for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if getattr(v, "ndim", None) == 0 and callable(getattr(v, "item", None)):  # numpy scalars, 0-d tensors
            v = v.item()
        if v is None:
            out.append(None)
        elif isinstance(v, numbers.Real) and _finite(v):
            out.append(float(v))
        else:
            raise RewardError(
                f"reward function {name!r} returned {v!r} for sample {i}; values must be finite "
                "int, float or bool, or None when the sample cannot be scored (not NaN)"
            )
    return out


def _finite(v: numbers.Real) -> bool:
    """Finite, and a float can hold it (a Python int past 1.8e308 cannot)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _call(fn, kwargs, prompts, completions, columns) -> Any:
    args = {**columns, **kwargs}
    if by_keyword(fn):
        out = fn(prompts=list(prompts), completions=list(completions), **args)
    else:
        out = fn(list(prompts), list(completions), **args)
    if inspect.isawaitable(out):  # an async reward function: run to completion here, in its worker
        out = asyncio.run(_awaited(out))
    return out


async def _awaited(awaitable):
    return await awaitable


def _run_function(fn, kwargs, name, batch, stop_at_first: bool) -> tuple:
    """('ok', values) | ('bad', message) | ('error', values, [(index, traceback)], batch_tb).

    When the batch call raises, each sample is re-run alone to find which ones fail
    (stopping at the first one when `stop_at_first`)."""
    prompts, completions, columns = batch
    n = len(completions)
    try:
        return ("ok", _check_values(_call(fn, kwargs, prompts, completions, columns), n, name))
    except RewardError as e:
        return ("bad", str(e))
    except DeadlineExceeded:
        raise
    except BaseException:
        batch_tb = traceback.format_exc()
    values: list[float | None] = [None] * n
    failures = []
    for i in range(n):
        one_cols = {k: v[i : i + 1] for k, v in columns.items()}
        try:
            one = _call(fn, kwargs, prompts[i : i + 1], completions[i : i + 1], one_cols)
            values[i] = _check_values(one, 1, name)[0]
        except RewardError as e:
            return ("bad", str(e))
        except DeadlineExceeded:
            raise
        except BaseException:
            failures.append((i, traceback.format_exc()))
            if stop_at_first:
                break
    return ("error", values, failures, batch_tb)


def _run_scorer(scorer: ModelScorer, name: str, batch, stop_at_first: bool, deadline: float) -> tuple:
    """A reward model, in this process: `_run_function`'s reply, or ('timeout', 'in-process')
    when one of its micro-batches ends past `deadline` (the columns are not its input)."""
    prompts, completions, _ = batch

    def fn(p, c, **_):
        return scorer.score(p, c, deadline=deadline)

    try:
        return _run_function(fn, {}, name, (prompts, completions, {}), stop_at_first)
    except DeadlineExceeded:
        return ("timeout", "in-process")


def _worker_main(conn, functions, parent_pid: int) -> None:
    # Ctrl-C, and torchrun's or a scheduler's SIGTERM, must not stop a worker: the parent decides
    # (it stops after the rollout, which still needs its rewards); a worker ends when told, when
    # SIGKILLed with its process group, or when its parent is gone.
    detach_from_stop_signals()
    watch_parent(parent_pid)
    conn.send("ready")
    batch = ([], [], {})
    while True:  # (an orphaned worker, its parent SIGKILLed, is ended by `watch_parent`)
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "stop":
            return
        if msg[0] == "batch":
            batch = msg[1:]
            continue
        _, call_id, index, stop_at_first = msg
        fn, kwargs, name = functions[index]
        conn.send((call_id, _run_function(fn, kwargs, name, batch, stop_at_first)))


# ---------------------------------------------------------------------------------------------
# The runner


@dataclasses.dataclass
class RewardResult:
    """`rewards` (N,) float32: the weighted sum, NaN for missing samples. `per_function`: each
    function's values (NaN where missing). `stats`: scalars for logging. `errors`: one line per
    failure tolerated under on_error="skip"/"zero"."""

    rewards: torch.Tensor
    per_function: dict[str, list[float]]
    stats: dict[str, float]
    errors: list[str] = dataclasses.field(default_factory=list)


_START_TIMEOUT_S = 300.0


def _whole_group_chunks(prompts: list, k: int) -> list[tuple[int, int]]:
    """At most `k` contiguous (lo, hi) chunks covering `prompts`, as even as they can be when
    every cut falls where the prompt changes: a group is never split between two calls."""
    n = len(prompts)
    starts = [0] + [i for i in range(1, n) if prompts[i] != prompts[i - 1]] + [n]
    cuts = sorted({min(starts, key=lambda s: abs(s - round(j * n / k))) for j in range(k + 1)})
    return list(zip(cuts, cuts[1:])) or [(0, 0)]


def _short(text: Any, limit: int = 300) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + f"... [{len(text)} chars]")


class RewardRunner:
    """Scores completions with a weighted sum of reward functions run in worker processes.

    The batch is split into at most `num_workers` contiguous chunks, one per long-lived worker,
    cut only between runs of equal consecutive prompts, so that every call gets whole groups
    (a group's completions share their prompt; functions that compare them stay right); each
    function runs on every chunk with a deadline of `timeout_s` per call (the per-sample
    re-runs that locate a failing sample count toward the same deadline). A worker past its
    deadline is SIGKILLed with its process group (what its function started) and replaced, and
    that call counts as failed for its whole chunk. Workers are not daemonic, so a function may
    start a multiprocessing Pool; close() (also at exit) stops them.
    Workers are forked on Linux (so functions from __main__ or test modules work) and spawned
    elsewhere (functions must then pickle); `num_workers=0` runs in-process without deadlines,
    for debugging.

    on_error, for a function that raises or hangs: "raise" (default) stops with a RewardError
    naming the function and the first failing sample; "skip" scores those samples as missing;
    "zero" scores them 0.0. Breaking the contract (wrong count, non-number, NaN/inf) is always
    a RewardError.

    Missing, as TRL sums with nansum: a sample's reward is the weighted sum over the functions
    with nonzero weight that returned a value for it, so a function may return None for the
    rows it does not apply to (TRL's multi-task pattern); it is NaN (missing) when none of them
    returned one, or when any of them failed on it under "skip" (a failure never turns into a
    partial reward). Functions with weight 0 are logged only.

    Reward models (`model:` / `judge:` names, `gspo.rewards.models`) run in this process on the
    whole batch, under the same weights and on_error policy; their deadline is checked after
    each micro-batch (a forward cannot be killed), and a call past it counts as timed out for
    the whole batch. Workers start only when some function is not a reward model.
    """

    def __init__(self, specs: Sequence[RewardSpec | str | dict], *, timeout_s: float = RewardsConfig.timeout_s,
                 on_error: str = RewardsConfig.on_error, num_workers: int = RewardsConfig.num_workers,
                 start_method: str | None = None):
        if on_error not in ("raise", "skip", "zero"):
            raise RewardConfigError(f"RewardRunner: on_error must be 'raise', 'skip' or 'zero', got {on_error!r}")
        if not (isinstance(timeout_s, numbers.Real) and timeout_s > 0):
            raise RewardConfigError(f"RewardRunner: timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise RewardConfigError(f"RewardRunner: num_workers must be an int >= 0, got {num_workers!r}")
        resolved = validate_specs(specs)
        self.names = [key for key, _, _ in resolved]
        self.weights = [float(s.weight) for _, _, s in resolved]
        self._functions = [(fn, dict(s.kwargs), key) for key, fn, s in resolved]
        self._in_process = [isinstance(fn, ModelScorer) for fn, _, _ in self._functions]
        # a worker never calls a reward model: it gets a placeholder, not a copy of the weights
        self._worker_functions = [(None, {}, f[2]) if here else f for f, here in zip(self._functions, self._in_process)]
        if all(self._in_process):
            num_workers = 0
        self.timeout_s, self.on_error, self.num_workers = float(timeout_s), on_error, num_workers
        self._ctx = mp.get_context(start_method or default_start_method())
        self._workers: list[Any] = [None] * num_workers  # (process, connection) pairs
        self._closed, self._call_id = False, 0
        close_at_exit(self)  # before any worker starts: a non-daemon one must never outlive us
        try:
            for w in range(num_workers):
                self._start_worker(w)
        except BaseException:
            self.close()
            raise

    # -- worker management -----------------------------------------------------------------

    def _start_worker(self, w: int) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main, args=(child_conn, self._worker_functions, os.getpid()),
            name=f"gspo-reward-{w}", daemon=False,  # a function may start a Pool; close() stops it
        )
        with warnings.catch_warnings():  # Python >= 3.12 warns about forking with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            try:
                proc.start()
            except Exception as e:
                raise RewardConfigError(
                    f"RewardRunner: cannot start a {self._ctx.get_start_method()} worker ({e}); "
                    "under 'spawn' reward functions must be importable module-level functions"
                ) from e
        child_conn.close()
        self._workers[w] = (proc, parent_conn)
        # Wait until the worker runs (a spawned one imports first), so start-up time is not
        # charged to the first call's deadline.
        try:
            if parent_conn.poll(_START_TIMEOUT_S) and parent_conn.recv() == "ready":
                return
        except (EOFError, OSError):
            pass
        self._kill_worker(w)
        raise RewardError(f"RewardRunner: reward worker {w} did not start (exit code {proc.exitcode})")

    def _kill_worker(self, w: int) -> None:
        kill_worker(*self._workers[w], group=True)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for w in range(self.num_workers):
            if self._workers[w] is not None:
                self._send(w, ("stop",))
                self._workers[w][0].join(timeout=1.0)
                self._kill_worker(w)
        closed(self)

    def _send(self, w: int, msg: tuple) -> bool:
        try:
            self._workers[w][1].send(msg)
            return True
        except (OSError, ValueError):  # a dead worker: noticed (and replaced) at the next call
            return False

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- one function over all chunks --------------------------------------------------------

    def _call_all(self, index: int, chunks: list[tuple[int, int]], batch) -> list[tuple]:
        """Replies per chunk for function `index`; ('timeout',) or ('died', code) on failure."""
        fn, kwargs, name = self._functions[index]
        stop_at_first = self.on_error == "raise"
        if self._in_process[index]:
            return [_run_scorer(fn, name, batch, stop_at_first, time.monotonic() + self.timeout_s)]
        if self.num_workers == 0:
            return [_run_function(fn, kwargs, name, batch, stop_at_first)]
        # Replies carry the call's id, so a reply left over from an interrupted score() (e.g.
        # by KeyboardInterrupt) is recognised and dropped instead of read as this call's.
        self._call_id += 1
        replies: list[tuple | None] = [None] * len(chunks)
        pending = {}
        for w in range(len(chunks)):
            if self._send(w, ("call", self._call_id, index, stop_at_first)):
                pending[self._workers[w][1]] = w
            else:
                replies[w] = ("died", self._workers[w][0].exitcode)
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready = _wait_conns(list(pending), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                w = pending[conn]
                try:
                    call_id, reply = conn.recv()
                except (EOFError, OSError):
                    self._workers[w][0].join(timeout=1.0)
                    call_id, reply = self._call_id, ("died", self._workers[w][0].exitcode)
                if call_id == self._call_id:
                    replies[w] = reply
                    del pending[conn]
        for w in pending.values():
            replies[w] = ("timeout",)
        for w, reply in enumerate(replies):
            if reply[0] in ("timeout", "died"):  # replace the worker and give it this batch
                self._kill_worker(w)
                self._start_worker(w)
                lo, hi = chunks[w]
                self._send_batch(w, batch, lo, hi)
        return replies

    def _send_batch(self, w: int, batch, lo: int, hi: int) -> None:
        prompts, completions, columns = batch
        self._send(w, ("batch", prompts[lo:hi], completions[lo:hi], {k: v[lo:hi] for k, v in columns.items()}))

    # -- scoring ---------------------------------------------------------------------------

    def score(self, prompts: Sequence, completions: Sequence, columns: dict[str, list] | None = None) -> RewardResult:
        """Score N completions (`prompts` and every column aligned with them)."""
        if self._closed:
            raise RewardError("RewardRunner.score: the runner is closed")
        n, columns = len(completions), {k: list(v) for k, v in (columns or {}).items()}
        bad = [f"{len(prompts)} prompts"] if len(prompts) != n else []
        bad += [f"column {k!r} has {len(v)} values" for k, v in columns.items() if len(v) != n]
        bad += [f"column {k!r} clashes with an argument" for k in {"prompts", "completions"} & columns.keys()]
        if bad:
            raise ValueError(f"RewardRunner.score: {'; '.join(bad)} (for {n} completions)")
        batch = (list(prompts), list(completions), columns)
        chunks = _whole_group_chunks(batch[0], max(1, min(self.num_workers, n)))  # one per worker (one in-process)
        for w, (lo, hi) in enumerate(chunks if self.num_workers else []):
            self._send_batch(w, batch, lo, hi)

        stats: dict[str, float] = {"reward/errors": 0.0, "reward/timeouts": 0.0}
        errors: list[str] = []
        per_function: dict[str, list[float]] = {}
        failed = torch.zeros(n, dtype=torch.bool)  # (N,) a nonzero-weight function failed under "skip"
        t0 = time.perf_counter()
        for index, name in enumerate(self.names):
            t_fn = time.perf_counter()
            replies = self._call_all(index, chunks, batch)
            values: list[float] = []
            for (lo, hi), reply in zip([(0, n)] if self._in_process[index] else chunks, replies):
                chunk, chunk_failed = self._chunk_values(name, reply, lo, hi, batch, stats, errors)
                values += chunk
                if self.weights[index] != 0.0 and self.on_error == "skip":
                    failed[[lo + i for i in chunk_failed]] = True
            per_function[name] = values
            stats[f"reward/{name}/time_s"] = time.perf_counter() - t_fn

        total = torch.zeros(n, dtype=torch.float64)  # (N,)
        scored = torch.zeros(n, dtype=torch.bool)  # (N,) some nonzero-weight function has a value
        for name, weight in zip(self.names, self.weights):
            v = torch.tensor(per_function[name], dtype=torch.float64)  # (N,)
            if weight != 0.0:
                total += torch.where(v.isnan(), 0.0, weight * v)  # TRL's nansum
                scored |= ~v.isnan()
            stats[f"reward/{name}/mean"] = v.nanmean().item()  # NaN when all are missing
            stats[f"reward/{name}/missing_frac"] = v.isnan().double().mean().item()  # None (or skipped) rows
        if any(w != 0.0 for w in self.weights):
            total[~scored | failed] = math.nan
        rewards = total.float()
        over = torch.isinf(rewards) & ~torch.isnan(total)  # sums float32 cannot hold (float64's own overflow too)
        if bool(over.any()):
            i = int(over.nonzero()[0])
            parts = ", ".join(f"{name} {per_function[name][i]:g} x {w:g}" for name, w in zip(self.names, self.weights))
            raise RewardError(f"the weighted reward of sample {i} is {total[i].item():g} ({parts}), beyond what "
                              f"float32 holds (3.4e38): scale the reward functions' values or weights down")
        ok = rewards[~rewards.isnan()]
        stats["reward/mean"] = ok.mean().item() if len(ok) else math.nan
        stats["reward/std"] = ok.std(unbiased=False).item() if len(ok) else math.nan
        stats["reward/missing"] = float(n - len(ok))
        stats["reward/time_s"] = time.perf_counter() - t0
        return RewardResult(rewards=rewards, per_function=per_function, stats=stats, errors=errors)

    def _chunk_values(self, name, reply, lo, hi, batch, stats, errors) -> tuple[list[float], list[int]]:
        """Values of one chunk (NaN for None), applying the on_error policy, and the indices in
        the chunk where the function failed (timed out, died or raised)."""
        kind = reply[0]
        if kind == "bad":
            raise RewardError(reply[1])
        if kind == "ok":
            return [math.nan if v is None else v for v in reply[1]], []
        fill = 0.0 if self.on_error == "zero" else math.nan
        if kind in ("timeout", "died"):
            what = (f"timed out after {self.timeout_s:g}s" if kind == "timeout"
                    else f"killed its worker process (exit code {reply[1]})")
            after = "stopped after a micro-batch" if reply[1:] == ("in-process",) else "worker restarted"
            msg = f"reward function {name!r} {what} on samples {lo}..{hi - 1} ({after})"
            if self.on_error == "raise":
                raise RewardError(msg)
            stats["reward/timeouts" if kind == "timeout" else "reward/errors"] += hi - lo
            errors.append(msg)
            return [fill] * (hi - lo), list(range(hi - lo))
        _, values, failures, batch_tb = reply
        prompts, completions, _ = batch
        if not failures:  # the batch call raised but every sample alone succeeded
            if self.on_error == "raise":
                raise RewardError(f"reward function {name!r} raised on samples {lo}..{hi - 1} as a batch "
                                  f"(but on no sample alone):\n{batch_tb}")
            errors.append(f"reward function {name!r} raised on a batch; scored its samples one by one")
        if failures and self.on_error == "raise":
            i, tb = failures[0]
            raise RewardError(
                f"reward function {name!r} raised on sample {lo + i}:\n"
                f"  prompt: {_short(prompts[lo + i])}\n  completion: {_short(completions[lo + i])}\n{tb}"
            )
        failed = {i for i, _ in failures}
        for i, tb in failures:
            stats["reward/errors"] += 1
            errors.append(f"reward function {name!r} raised on sample {lo + i}: {tb.strip().splitlines()[-1]}")
        return [fill if i in failed else (math.nan if v is None else v) for i, v in enumerate(values)], sorted(failed)
