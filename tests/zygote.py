"""Run `gspo` commands in processes forked from one that has already imported torch,
transformers and gspo (a fork server), instead of a fresh `python -m gspo` each time.

Why: a fresh interpreter spends ~4-6 s of CPU importing torch and transformers before a tiny
test run does ~1 s of work, and the suite starts well over a hundred of them. A forked child is
still a separate process: it gets its own pid, exit status, signals (SIGKILL, SIGTERM), open
files and output, so kill-and-resume tests test what they did. It runs `gspo.cli.main` as
`python -m gspo` does and ends as the interpreter does (exit status, non-daemon threads joined,
atexit handlers run, standard streams flushed), then leaves by os._exit: the interpreter's
teardown of every module, ~2 s of CPU with torch and transformers loaded, is skipped.

What a fresh interpreter would read from the environment at import time is set again in the
child where gspo depends on it: the environment itself, the working directory, `PYTHONPATH`
(put on `sys.path`), `OMP_NUM_THREADS` (torch's thread count), `MALLOC_MMAP_THRESHOLD_` (glibc's,
through mallopt) and the random seeds of `random` and numpy. Async mode's generator processes,
which gspo spawns as `python -c ...`, are forked from their learner instead (still its
children). A few commands keep real processes, so the path a user types is tested too: `gspo
demo`, the console script, and torchrun (the README's and one async test).

    p = gspo(["train", "k=v", ...], env=env)              # like subprocess.run(capture_output=True)
    h = gspo_popen(["train", ...], env=env); h.kill()     # like subprocess.Popen
    p = gspo_torchrun(2, ["train", ...], env=env)         # like torchrun --nproc-per-node 2 -m gspo
    h = popen([sys.executable, "bench/x.py", ...])        # python SCRIPT / -c CODE / -m gspo, forked
    monkeypatch.setattr(script, "subprocess", script_subprocess)  # a script's own subprocess.run, forked
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

PRELOAD = ("torch", "transformers", "transformers.models.qwen3.modeling_qwen3", "safetensors.torch", "omegaconf",
           "gspo.cli", "gspo.config", "gspo.train", "gspo.train.run", "gspo.train.loop", "gspo.train.checkpoint",
           "gspo.models", "gspo.models.tiny", "gspo.rollout", "gspo.rewards", "gspo.rewards.runner", "gspo.data")


# --- the server side -----------------------------------------------------------------------------

def _serve() -> dict:
    """The fork server's loop: read one JSON request a line from stdin, fork, reply with the
    child's pid; reap children and reply with their exit status. Returns only in a child, with
    its request."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    inp, out = sys.stdin.fileno(), sys.stdout.fileno()
    running: set[int] = set()

    def reply(msg: dict) -> None:
        os.write(out, (json.dumps(msg) + "\n").encode())

    def reap() -> None:
        for pid in list(running):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                running.discard(pid)
                reply({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})

    reply({"ready": os.getpid()})
    buf = b""
    while True:
        ready, _, _ = select.select([inp], [], [], 0.05)
        reap()
        if not ready:
            continue
        chunk = os.read(inp, 65536)
        if not chunk:  # the test process is gone: stop (children run on to their end)
            os._exit(0)
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return req
            running.add(pid)
            reply({"started": pid, "id": req["id"]})


def _fresh_process_state(env: dict) -> None:
    """What a fresh interpreter would start with that a fork inherits: the environment, and
    unseeded `random` and numpy generators."""
    import random

    import numpy as np

    os.environ.clear()
    os.environ.update(env)
    random.seed()
    np.random.seed()


def _child(req: dict) -> None:
    """Become `python -m gspo ARGV` (or `python -c CODE`, or `python SCRIPT ARGV`) with the
    request's environment, directory and output files."""
    import torch

    env = req["env"]
    _fresh_process_state(env)
    os.chdir(req["cwd"])
    for path in reversed([p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)
    first = os.path.dirname(os.path.abspath(req["script"])) if "script" in req else ""  # what python puts first
    if first not in sys.path:
        sys.path.insert(0, first)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if env.get("MALLOC_MMAP_THRESHOLD_", "").isdigit():  # glibc reads it at start-up; mallopt sets it now
        import ctypes

        ctypes.CDLL(None).mallopt(-3, int(env["MALLOC_MMAP_THRESHOLD_"]))  # M_MMAP_THRESHOLD
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if "code" in req:  # `python -c CODE ARGV`
        _run_code(req["code"], env, req["argv"])
    if "script" in req:  # `python SCRIPT ARGV`
        import runpy

        sys.argv = [req["script"], *req["argv"]]
        _run_as_main(lambda: runpy.run_path(req["script"], run_name="__main__"))
    sys.argv = ["gspo", *req["argv"]]
    from gspo.cli import main
    from gspo.train import async_job

    async_job.subprocess = _ForkingSubprocess  # async mode's generators: forked from the learner too
    _run_as_main(lambda: sys.exit(main(req["argv"])))


class _Signals:
    """Popen's signal methods, for a process with `pid` and `poll()`."""

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended (and reaped) since poll(), as Popen allows
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class _ForkedPopen(_Signals):
    """`subprocess.Popen([python, "-c", CODE], env=ENV, stdin=PIPE)` as a fork of this process
    (the learner) that runs CODE: still the learner's child, with its own pid, exit status and
    signals, its stdin a pipe, its stdout and stderr the learner's, as a spawned one's are."""

    def __init__(self, cmd, env):
        for f in (sys.stdout, sys.stderr):
            f.flush()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.dup2(r, 0)
            os.close(r)
            _run_code(cmd[2], env)
        os.close(r)
        self.args, self.pid, self.returncode = cmd, pid, None
        self.stdin = os.fdopen(w, "wb")

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode



def _run_code(code: str, env: dict, argv=()) -> None:
    """In a forked child: run CODE as `python -c CODE ARGV` would, and end as the interpreter does."""
    _fresh_process_state(env)
    sys.stdin = open(0, closefd=False)
    sys.argv = ["-c", *argv]
    _run_as_main(lambda: exec(compile(code, "<string>", "exec"), {"__name__": "__main__"}))


def _run_as_main(program) -> None:
    """In a forked child: run `program()` as an interpreter runs its main program and end as it
    does: the exit status of a SystemExit (a non-integer one printed, status 1), an uncaught
    exception's traceback and status 1 (an uncaught KeyboardInterrupt ends the process by
    SIGINT), then non-daemon threads joined, atexit handlers run, the standard streams flushed.
    Then os._exit: the teardown of every module that follows in an interpreter (~2 s of freeing
    objects with torch and transformers loaded, a fork's copy of the server's) is skipped."""
    import atexit
    import traceback

    rc, interrupted = 0, False
    try:
        program()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            rc = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        rc, interrupted = 1, True
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
        for f in (sys.stdout, sys.stderr):
            f.flush()
    finally:
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(rc)


class _ForkingSubprocess:
    """What gspo.train.async_job uses of `subprocess`, its `python -c` generators forked."""

    PIPE = subprocess.PIPE
    TimeoutExpired = subprocess.TimeoutExpired

    @staticmethod
    def Popen(cmd, env=None, stdin=None, **kw):
        if cmd[:2] == [sys.executable, "-c"] and stdin == subprocess.PIPE and not kw \
                and threading.active_count() == 1:
            return _ForkedPopen(cmd, dict(os.environ if env is None else env))
        return subprocess.Popen(cmd, env=env, stdin=stdin, **kw)


def server_main() -> None:
    _child(_serve())


# --- the test side -------------------------------------------------------------------------------

class _Server:
    """One fork server per test process, started on first use."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                                             *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-c", "import zygote; zygote.server_main()"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.lock = threading.Lock()
        self.cond = threading.Condition()
        self.started: dict[int, int] = {}  # request id -> pid
        self.exits: dict[int, int] = {}    # pid -> return code
        self.next_id = 0
        first = json.loads(self.proc.stdout.readline())
        assert "ready" in first, first
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.proc.stdin.close)

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.cond:
                if "started" in msg:
                    self.started[msg["id"]] = msg["started"]
                else:
                    self.exits[msg["exit"]] = msg["rc"]
                self.cond.notify_all()

    def start(self, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str, code: str | None = None,
              script: str | None = None) -> int:
        with self.lock:
            rid = self.next_id
            self.next_id += 1
            req = {"id": rid, "argv": list(map(str, argv)), "env": env, "cwd": cwd, "stdout": stdout,
                   "stderr": stderr}
            if code is not None:
                req["code"] = code
            if script is not None:
                req["script"] = script
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        with self.cond:
            self.cond.wait_for(lambda: rid in self.started, timeout=60)
            return self.started[rid]

    def wait(self, pid: int, timeout: float | None) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exits, timeout=timeout)
            return self.exits.get(pid)


_server: _Server | None = None


def _get_server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server


class GspoProcess(_Signals):
    """A running `gspo` command (what `subprocess.Popen` offers that the tests use). Its stdout
    and stderr go to files, readable while it runs (`read_stderr`)."""

    def __init__(self, argv, env=None, cwd=None, code: str | None = None, script: str | None = None):
        self.args = ([sys.executable, "-c", code, *map(str, argv)] if code is not None else
                     [sys.executable, script, *map(str, argv)] if script is not None else ["gspo", *map(str, argv)])
        self._dir = tempfile.mkdtemp(prefix="gspo-zygote-")
        self._out, self._err = os.path.join(self._dir, "stdout"), os.path.join(self._dir, "stderr")
        env = dict(os.environ if env is None else env)
        self.pid = _get_server().start(list(argv), env, os.path.abspath(cwd or os.getcwd()), self._out, self._err,
                                       code, None if script is None else os.path.abspath(os.path.join(cwd or "", script)))
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _get_server().wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = _get_server().wait(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def read_stdout(self) -> str:
        return Path(self._out).read_text() if os.path.exists(self._out) else ""

    def read_stderr(self) -> str:
        return Path(self._err).read_text() if os.path.exists(self._err) else ""

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        out, err = self.read_stdout(), self.read_stderr()
        shutil.rmtree(self._dir, ignore_errors=True)
        return out, err


def gspo_popen(argv, env=None, cwd=None) -> GspoProcess:
    return GspoProcess(argv, env=env, cwd=cwd)


def gspo(argv, env=None, cwd=None, timeout: float | None = 600) -> subprocess.CompletedProcess:
    """`subprocess.run([python, -m, gspo, *argv], capture_output=True, text=True)`, forked."""
    p = GspoProcess(argv, env=env, cwd=cwd)
    out, err = p.communicate(timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


_subprocess_run = subprocess.run


def _forkable(cmd) -> dict | None:
    """GspoProcess's arguments for `python -m gspo ARGS`, `python -c CODE ARGS` or `python
    SCRIPT.py ARGS` (no interpreter options), else None."""
    if not isinstance(cmd, (list, tuple)) or len(cmd) < 2 or str(cmd[0]) != sys.executable:
        return None
    cmd = list(map(str, cmd))
    if cmd[1:3] == ["-m", "gspo"]:
        return {"argv": cmd[3:]}
    if cmd[1] == "-c" and len(cmd) >= 3:
        return {"argv": cmd[3:], "code": cmd[2]}
    if cmd[1].endswith(".py"):
        return {"argv": cmd[2:], "script": cmd[1]}
    return None


def popen(cmd, env=None, cwd=None) -> GspoProcess:
    """`subprocess.Popen(cmd, stdout=PIPE, stderr=PIPE, text=True)` for a command `_forkable`
    takes, forked: `communicate()` returns its output."""
    how = _forkable(cmd)
    assert how is not None, cmd
    return GspoProcess(env=env, cwd=cwd, **how)


def run(cmd, *, env=None, cwd=None, capture_output=False, text=None, check=False, timeout=None, **kw):
    """`subprocess.run` for the commands a script under test starts: `python -m gspo ARGS`,
    `python -c CODE` and `python SCRIPT.py ARGS` with their output captured are forked (as
    `gspo` above), anything else is run as `subprocess.run` runs it."""
    how = _forkable(cmd) if capture_output and not kw else None
    if how is None:
        return _subprocess_run(cmd, env=env, cwd=cwd, capture_output=capture_output, text=text, check=check,
                               timeout=timeout, **kw)
    p = GspoProcess(env=env, cwd=cwd, **how)
    out, err = p.communicate(timeout)
    if not text:
        out, err = out.encode(), err.encode()
    done = subprocess.CompletedProcess(list(cmd), p.returncode, out, err)
    if check:
        done.check_returncode()
    return done


class _ScriptSubprocess:
    """A script's `subprocess` module with `run` forking its `python -m gspo`, `python -c` and
    `python SCRIPT.py` commands (zygote.run): `monkeypatch.setattr(script, "subprocess",
    zygote.script_subprocess)`."""

    run = staticmethod(run)

    def __getattr__(self, name):
        return getattr(subprocess, name)


script_subprocess = _ScriptSubprocess()


def gspo_torchrun(nproc: int, argv, env=None, cwd=None, timeout: float | None = 600) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node NPROC -m gspo ARGV`, its ranks forked.

    This process plays torchrun's agent: it hosts the job's TCPStore on 127.0.0.1 (the ranks'
    `env://` rendezvous joins it as torchrun's agent store), gives each rank the environment
    torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*, and
    OMP_NUM_THREADS=1 unless set), and when one rank fails stops the others (SIGTERM, then
    SIGKILL after a grace) and returns 1. Output: each rank's stdout and stderr in rank order.
    The README's torchrun command and one async test keep the real torchrun."""
    import time

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, nproc + 1, is_master=True, wait_for_workers=False)
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = []
    for rank in range(nproc):
        renv = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        procs.append(GspoProcess(argv, env=renv, cwd=cwd))
    deadline = None if timeout is None else time.monotonic() + timeout
    failed = False
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or (deadline is not None and time.monotonic() > deadline):
            break
        time.sleep(0.05)
    timed_out = not failed and any(p.poll() is None for p in procs)
    for p in procs:  # torchrun's stop: SIGTERM, then SIGKILL after its grace
        if p.poll() is None:
            p.terminate()
    grace = time.monotonic() + 30
    while any(p.poll() is None for p in procs) and time.monotonic() < grace:
        time.sleep(0.05)
    for p in procs:
        p.kill()
        p.wait()
    outs = [p.communicate() for p in procs]
    del store
    if timed_out:
        raise subprocess.TimeoutExpired(["torchrun", *map(str, argv)], timeout)
    rc = 0 if all(p.returncode == 0 for p in procs) else 1
    return subprocess.CompletedProcess(["torchrun", f"--nproc-per-node={nproc}", "-m", "gspo", *map(str, argv)], rc,
                                       "".join(o for o, _ in outs), "".join(e for _, e in outs))
