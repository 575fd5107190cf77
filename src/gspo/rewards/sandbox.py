"""The built-in `code_tests` reward: run a completion's Python against test cases.

CONTAINMENT, NOT A SECURITY SANDBOX (see docs/code_execution.md). Model-written code runs only
when the caller passes `allow_code_execution=True` (config: `rewards.allow_code_execution=true`).

Each program runs in a fresh interpreter started through a small bootstrap that, where the OS
allows it, unshares network/mount/PID namespaces, makes every mount read-only except a private
tmpfs working directory, drops root to uid 65534, and sets rlimits (CPU, address space, file
size, process count, open files, no core files) before exec. Whatever it could not do is
logged. A wall-clock deadline kills the whole process group (and with it the PID namespace).

Test format (`tests` column, one element per completion):
  * a str: Python statements (usually asserts) run after the code; one case, scored 1 or 0;
    a str that is a JSON list of str (a list column saved as text) is read as that list;
  * a list of str: one case each, score = fraction of cases that pass;
  * None, [] or a blank str: the sample is not scored (None).
Cases run in order in the program's namespace, as if appended to the code. A crash, timeout or
resource kill scores 0.0 (never None); the reason is counted (see `last_reasons()`).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import logging
import math
import numbers
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from gspo.config import RewardsConfig
from gspo.rewards.builtins import completion_text
from gspo.rewards.code_text import extract_code, test_cases
from gspo.rewards.sandbox_programs import BOOT, HARNESS, read_report

log = logging.getLogger(__name__)

REASONS = ("passed", "failed", "syntax_error", "error", "timeout", "memory", "file_size", "killed")
ENABLE_HINT = ("the code_tests reward runs model-written code; it is off unless you opt in: set "
               "rewards.allow_code_execution=true (or pass allow_code_execution=True). It is a "
               "containment, not a security sandbox: see docs/code_execution.md")


class CodeExecutionDisabled(PermissionError):
    """Raised when code would run without `allow_code_execution=True`."""


@dataclasses.dataclass(frozen=True)
class CodeLimits:
    timeout_s: float = 5.0        # wall-clock deadline for one program (startup included)
    memory_mb: int = 512          # RLIMIT_AS (virtual address space)
    max_file_mb: int = 8          # RLIMIT_FSIZE: largest file written; also caps captured output
    max_procs: int = 32           # RLIMIT_NPROC: processes + threads of the sandbox user
    workdir_mb: int = 64          # size of the tmpfs working directory (with a mount namespace)
    max_open_files: int = 256     # RLIMIT_NOFILE
    max_output_chars: int = 2000  # stdout/stderr kept in CodeResult.detail
    python: str | None = None     # interpreter for the program (default: sys.executable)
    sandbox_uid: int = 65534      # uid the program runs as when we are root ("nobody")
    namespaces: bool = True       # try network/mount/PID/IPC (and user) namespaces
    allow_same_user: bool = False  # non-root with no user namespace: run as the trainer's own uid anyway

    def __post_init__(self):
        for f in ("timeout_s", *_WHOLE_LIMITS):
            if (problem := _limit_problem(f, getattr(self, f))):
                raise ValueError(f"CodeLimits.{f} {problem}")


_WHOLE_LIMITS = ("memory_mb", "max_file_mb", "max_procs", "workdir_mb", "max_open_files")


def _limit_problem(field: str, value: Any) -> str | None:
    """Why `value` cannot be the limit `field` (None when it can): sizes and counts are ints."""
    whole = field in _WHOLE_LIMITS
    if (isinstance(value, bool) or not isinstance(value, int if whole else numbers.Real)
            or not math.isfinite(value) or not value > 0):
        return f"must be {'an int' if whole else 'a finite number'} > 0, got {value!r}"
    return None


def check_code_options(options: dict) -> None:
    """The `code_tests` options' values, checked at start-up (they are otherwise read at the first
    rollout): raises ValueError naming the option."""
    if "allow_code_execution" in options and options["allow_code_execution"] is not True:
        raise ValueError(f"option 'allow_code_execution' must be true (the boolean) for code_tests to run at all, got "
                         f"{options['allow_code_execution']!r}; leave it out and set rewards.allow_code_execution=true")
    if not isinstance(options.get("allow_same_user", False), bool):
        raise ValueError(f"option 'allow_same_user' must be true or false, got {options['allow_same_user']!r}")
    for k in ("timeout_s", "memory_mb", "max_file_mb", "max_procs"):
        if k in options and (problem := _limit_problem(k, options[k])):
            raise ValueError(f"option {k!r} {problem}")
    w = options.get("max_workers")
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise ValueError(f"option 'max_workers' must be an int >= 1 or None, got {w!r}")
    if options.get("executor") is not None and not callable(options["executor"]):
        raise ValueError(f"option 'executor' must be a callable (code, cases, limits) -> CodeResult, "
                         f"got {options['executor']!r}")


@dataclasses.dataclass(frozen=True)
class CodeResult:
    score: float                  # fraction of cases passed; 0.0 on any contained failure
    reason: str                   # one of REASONS
    detail: str = ""              # short message plus truncated stdout/stderr
    cases: tuple = ()             # per-case status: passed | failed | memory | file_size | error:<Type>
    features: dict = dataclasses.field(default_factory=dict)  # containment that was in force


_FEATURES: dict = {}
_LAST_REASONS: collections.Counter = collections.Counter()
_LOCK = threading.Lock()


class SandboxError(RuntimeError):
    """The containment could not be set up (not the program's fault): raised, never scored."""


def _tail(data: bytes, n: int) -> str:
    text = data.decode("utf-8", "replace")
    return text if len(text) <= n else f"[... {len(text) - n} chars cut]\n" + text[-n:]


def _note_features(features: dict) -> None:
    """Log the containment in force the first time it is seen, and whenever it changes."""
    global _FEATURES
    with _LOCK:
        if features == _FEATURES:
            return
        _FEATURES = dict(features)
    wanted = ("netns", "mountns", "pidns", "ipcns", "tmpfs", "readonly", "nproc", "sealed", "unix_blocked")
    missing = [k for k in wanted if not features.get(k)]
    shown = {k: v for k, v in features.items() if k != "errors"}
    if missing:
        log.warning("code sandbox: %s; NOT in force here: %s. %s", shown, ", ".join(missing), "; ".join(features["errors"]))
    else:
        log.info("code sandbox: %s", shown)


def _needed_paths(python: str) -> list[str]:
    paths = {os.path.dirname(os.path.dirname(os.path.realpath(python)))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        paths |= {sys.prefix, sys.base_prefix}
    return sorted(os.path.realpath(p) for p in paths)


_SWEPT = False


def _sweep_left_behind() -> None:
    """Once per process: remove the working folders of runs whose process is gone (killed while a
    program ran, so its own clean-up never came). Each folder's name carries its process id."""
    global _SWEPT
    if _SWEPT:
        return
    _SWEPT = True
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "gspo-code-*-*")):
        pid = os.path.basename(path).split("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        shutil.rmtree(path, ignore_errors=True)


def run_code_tests(code: str, tests: str | Sequence[str], limits: CodeLimits | None = None) -> CodeResult:
    """Run `code`, then each test case, in a contained child process (see the module doc).

    Raises SandboxError when the containment itself cannot start; the program's own failures
    (crash, timeout, limits) come back as a CodeResult with score 0.0."""
    lim = limits or CodeLimits()
    cases = [tests] if isinstance(tests, str) else [str(t) for t in tests]
    if not cases:
        raise ValueError("run_code_tests needs at least one test case")
    python = lim.python or sys.executable
    _sweep_left_behind()
    outer = tempfile.mkdtemp(prefix=f"gspo-code-{os.getpid()}-")
    try:
        os.chmod(outer, 0o711)
        wd = os.path.join(outer, "work")
        os.mkdir(wd, 0o700)
        # root's and private (other runs' programs are uid 65534 too): the bootstrap copies them into the program's
        # own tmpfs and removes them here, or hands them to its uid where it has no tmpfs
        for name, text in (("solution.py", code), ("tests.json", json.dumps(cases)), ("_harness.py", HARNESS)):
            with open(os.open(os.path.join(wd, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w",
                      encoding="utf-8", errors="replace") as f:
                f.write(text)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": wd, "TMPDIR": wd, "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        marker, key = secrets.token_hex(8), secrets.token_hex(32)
        files = [open(os.open(os.path.join(outer, n), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "w+b")
                 for n in ("stdout", "stderr", "info")]
        try:
            out, err, info = files
            cfg = {"wd": wd, "outer": outer, "uid": lim.sandbox_uid, "python": python, "env": env,
                   "need": _needed_paths(python), "namespaces": lim.namespaces,
                   "same_user_ok": lim.allow_same_user, "tmpfs_mb": lim.workdir_mb,
                   "info_fd": info.fileno(), "alarm": math.ceil(lim.timeout_s) + 2,
                   "lim": {"cpu": math.ceil(lim.timeout_s), "as": lim.memory_mb << 20, "fsize": lim.max_file_mb << 20,
                           "nproc": lim.max_procs, "nofile": lim.max_open_files}}
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", BOOT, json.dumps(cfg)], stdin=subprocess.PIPE,
                                    stdout=out, stderr=err, cwd=outer, env=env, start_new_session=True,
                                    pass_fds=(info.fileno(),))
            timed_out = False
            try:
                try:
                    proc.stdin.write(f"{marker} {key}\n".encode())
                    proc.stdin.close()
                except OSError:
                    pass
                proc.wait(timeout=lim.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # stragglers; the PID namespace dies with its init
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
            stdout, stderr, status = (f.seek(0) or f.read() for f in files)
        finally:
            for f in files:
                f.close()
    finally:
        shutil.rmtree(outer, ignore_errors=True)
    status = status.decode("utf-8", "replace").splitlines()
    if status[-1:] and status[-1].startswith("FAIL "):
        raise SandboxError("code sandbox: " + status[-1][5:])
    if not status:
        raise SandboxError(f"code sandbox: the bootstrap failed (exit {proc.returncode}):\n{_tail(stderr, 2000)}")
    features = json.loads(status[0])
    _note_features(features)
    report, stdout = read_report(stdout, marker, key)
    return _classify(proc.returncode, timed_out, stdout, stderr, report, len(cases), lim, features)


def _classify(rc, timed_out, stdout, stderr, report, n, lim, features) -> CodeResult:
    m = lim.max_output_chars
    output = f"\n--- stdout ---\n{_tail(stdout, m)}" if stdout.strip() else ""
    output += f"\n--- stderr ---\n{_tail(stderr, m)}" if stderr.strip() else ""

    def result(score, reason, msg, cases=()):
        return CodeResult(score, reason, msg + output, tuple(cases), features)

    if report is not None:
        if report["setup"]:
            reason = report["setup"] if report["setup"] in REASONS else "error"
            return result(0.0, reason, f"code did not run: {report['msg']}")
        cases = report["cases"]
        if len(cases) != n:  # (the harness reports each case once: anything else is not its report)
            return result(0.0, "error", f"the report holds {len(cases)} results for {n} cases")
        passed = sum(c == "passed" for c in cases)
        bad = {c for c in cases if c != "passed"}
        reason = ("passed" if not bad else "memory" if "memory" in bad else "file_size" if "file_size" in bad
                  else "failed" if bad == {"failed"} else "error")
        return result(passed / n, reason, f"{passed}/{n} cases passed. {report['msg']}".strip(), cases)
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    if timed_out:
        return result(0.0, "timeout", f"killed at the {lim.timeout_s:g}s deadline")
    if sig == signal.SIGXCPU:
        return result(0.0, "timeout", "CPU time limit hit (SIGXCPU)")
    if sig == signal.SIGXFSZ or max(len(stdout), len(stderr)) >= lim.max_file_mb << 20:
        return result(0.0, "file_size", "file size limit hit (RLIMIT_FSIZE; output counts)")
    if b"MemoryError" in stderr:
        return result(0.0, "memory", "out of memory")
    if sig:
        return result(0.0, "killed", f"killed by signal {sig}")
    return result(0.0, "error", f"exited with code {rc} before reporting its test results")


def last_reasons() -> dict[str, int]:
    """Reason counts from the last `code_tests_reward` call in this process."""
    with _LOCK:
        return dict(_LAST_REASONS)


def sandbox_features(limits: CodeLimits | None = None) -> dict:
    """The containment in force here (runs one trivial program the first time)."""
    if not _FEATURES:
        run_code_tests("", "pass", limits)
    with _LOCK:
        return dict(_FEATURES)


Executor = Callable[[str, Sequence[str], CodeLimits], CodeResult]


def code_tests_reward(prompts: Sequence, completions: Sequence, *, tests: Sequence | None = None,
                      allow_code_execution: bool = RewardsConfig.allow_code_execution, timeout_s: float = 5.0, memory_mb: int = 512,
                      max_file_mb: int = 8, max_procs: int = 32, max_workers: int | None = None,
                      executor: Executor | None = None, allow_same_user: bool = False,
                      **columns) -> list[float | None]:
    """Score each completion's code by the fraction of its test cases that pass (see module doc).

    `executor(code, cases, limits) -> CodeResult` replaces the built-in local runner (e.g. to
    call a container or a remote sandbox service). Runs `max_workers` programs at a time
    (default: the CPU count, at most 8). `allow_same_user`: as a non-root user where no user
    namespace can be made, run the programs as your own uid anyway (they can then signal your
    processes, the trainer included, and read their environment); refused otherwise."""
    if allow_code_execution is not True:
        raise CodeExecutionDisabled(ENABLE_HINT)
    if tests is None:
        raise ValueError("code_tests needs a `tests` dataset column: per row, a string of assert statements "
                         "or a list of such strings")
    if len(tests) != len(completions):
        raise ValueError(f"code_tests: {len(tests)} tests for {len(completions)} completions")
    check_code_options(dict(timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=max_file_mb, max_procs=max_procs,
                            max_workers=max_workers, executor=executor, allow_same_user=allow_same_user))
    limits = CodeLimits(timeout_s=timeout_s, memory_mb=memory_mb, max_file_mb=max_file_mb, max_procs=max_procs,
                        allow_same_user=allow_same_user)
    run = executor or run_code_tests
    jobs = []
    for i, (completion, t) in enumerate(zip(completions, tests)):
        t = test_cases(t, i)
        if t:  # None or [] -> not scored
            jobs.append((i, extract_code(completion_text(completion)), [t] if isinstance(t, str) else list(t)))
    scores: list[float | None] = [None] * len(completions)
    reasons: collections.Counter = collections.Counter()
    with ThreadPoolExecutor(max(1, min(len(jobs), max_workers or min(8, os.cpu_count() or 1)))) as pool:
        for (i, _, _), result in zip(jobs, list(pool.map(lambda job: run(job[1], job[2], limits), jobs))):
            scores[i] = float(result.score)
            reasons[result.reason] += 1
    with _LOCK:
        _LAST_REASONS.clear()
        _LAST_REASONS.update(reasons)
    log.info("code_tests: %d programs run: %s", sum(reasons.values()), dict(reasons))
    return scores
