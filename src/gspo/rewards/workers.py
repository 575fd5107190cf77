"""Worker processes that run user code (reward functions, tools, environments) beside training:
how they start, how stop signals reach them, and how they end.

A worker runs in its own process group (`detach_from_stop_signals`): a terminal's Ctrl-C or a
SIGTERM to the job's group reaches the trainer, which decides what happens to its workers, and
one `kill_worker(..., group=True)` ends a worker with every process its user code started.
Workers are not daemonic, so user code may start process pools; `close_at_exit` closes their
owner (a runner) when the interpreter exits, so exit never waits on one.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import weakref

_OWNERS: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _close_owners() -> None:
    for owner in list(_OWNERS):
        owner.close()


def close_at_exit(owner) -> None:
    """Close `owner` (its `close()` stops its workers) at interpreter exit, unless closed before
    (`closed`). Call it before the first worker starts."""
    _OWNERS.add(owner)


def closed(owner) -> None:
    _OWNERS.discard(owner)


def default_start_method() -> str:
    if sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods():
        return "fork"  # functions defined in __main__ or a test module work as they are
    return "spawn"


def _no_op(signum, frame) -> None:
    pass


def _default_stop_signals() -> None:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def detach_from_stop_signals() -> None:
    """In a worker: its own process group, so that a terminal's Ctrl-C or a SIGTERM to the job's
    group does not reach it or what its user code starts, and one killpg ends them all. SIGINT
    and SIGTERM sent to it directly (systemd and Slurm signal every process) are caught and
    dropped; unlike SIG_IGN, a handler is not inherited across exec, and forked children
    (multiprocessing pools) get the default back, so they stay stoppable."""
    os.setpgrp()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _no_op)
    os.register_at_fork(after_in_child=_default_stop_signals)


def ignore_stop_signals() -> None:
    """In a process of the job that is not a worker (async mode's generator): SIGINT and SIGTERM,
    which reach a whole process group, are the trainer's to act on."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def kill_worker(proc, conn, group: bool = False) -> None:
    """SIGKILL a worker process (a hung one cannot be asked) and close its pipe; with `group`,
    its whole process group (`detach_from_stop_signals`): the processes its user code started."""
    if group:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # gone, or never made its group
            pass
    if proc.is_alive():
        os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    conn.close()


def watch_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """In a worker (`detach_from_stop_signals`): a thread that ends it, with whatever its user
    code left running, within `every_s` of its parent's death, even while a call runs (a hung
    reward or tool): out of the job's process group, a worker would otherwise outlive a
    SIGKILLed trainer for as long as its call runs."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="gspo-parent-watch", daemon=True).start()
