"""gspo.rewards.runner's worker processes: signals to the job's process group, pools and processes
a reward function starts, a timed-out or dead worker, a runner or trainer that goes away."""

import os
import time

import pytest

from gspo.rewards import RewardSpec
from gspo.rewards.runner import RewardRunner
from test_rewards import P4

# ------------------------------------------------------------------------ user functions
# Defined in this test module: forked workers must run them as they are.


def worker_pid(prompts, completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def dies(prompts, completions, **kwargs):
    os._exit(3)


def test_runner_runs_in_other_processes():
    with RewardRunner([worker_pid], num_workers=2) as r:
        pids = set(r.score(P4, ["c"] * 4).per_function["worker_pid"])
    assert len(pids) == 2 and os.getpid() not in pids


def test_a_sigterm_to_the_process_group_leaves_the_reward_workers_to_the_parent():
    """torchrun, Slurm and systemd stop a job with SIGTERM to its process group: the run stops
    after the current rollout, which still needs its rewards, so the workers must outlive it."""
    import signal
    import time

    with RewardRunner([worker_pid], num_workers=2) as r:
        pids = set(r.score(P4, ["c"] * 4).per_function["worker_pid"])
        for pid in pids:
            os.kill(int(pid), signal.SIGTERM)
            os.kill(int(pid), signal.SIGINT)
        time.sleep(0.3)
        again = r.score(P4, ["c"] * 4)
        assert set(again.per_function["worker_pid"]) == pids and again.stats["reward/errors"] == 0


def _pool_reward(c):
    return float(len(c))


def pool_reward(prompts, completions, **kwargs):
    import faulthandler
    import multiprocessing
    import sys
    from concurrent.futures import ProcessPoolExecutor

    # This test once hung past its 60 s in a full CI run (never alone): if it does again, the
    # worker's stacks reach the report's captured stderr
    faulthandler.dump_traceback_later(40, file=sys.__stderr__)
    try:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            first = pool.map(_pool_reward, completions)
        with ProcessPoolExecutor(2) as ex:
            return [a + b for a, b in zip(first, ex.map(_pool_reward, completions))]
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_a_reward_function_may_start_a_process_pool():
    """Pool and ProcessPoolExecutor start children of the worker: a daemonic worker may have none."""
    with RewardRunner([pool_reward], num_workers=1) as r:
        assert r.score(["p"] * 2, ["ab", "c"]).rewards.tolist() == [4.0, 2.0]


def child_stop_signals(prompts, completions, **kwargs):
    import signal
    import subprocess

    out = subprocess.run(["grep", "SigIgn", "/proc/self/status"], capture_output=True, text=True, check=True).stdout
    ignored = int(out.split()[1], 16)  # bit n - 1 for signal n
    return [float(not ignored & (1 << signal.SIGINT - 1 | 1 << signal.SIGTERM - 1))] * len(completions)


def starts_a_sleeper(prompts, completions, pid_file, **kwargs):
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    with open(pid_file, "w") as f:
        f.write(str(child.pid))
    child.wait()
    return [1.0] * len(completions)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is dead (init may not reap it)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_processes_a_function_starts_stay_stoppable_and_die_with_a_timed_out_worker(tmp_path):
    """The worker drops SIGINT/SIGTERM, but what its functions start must not inherit that; and a
    worker killed at its deadline takes its process group (the function's children) with it."""
    with RewardRunner([child_stop_signals], num_workers=1) as r:
        assert r.score(["p"], ["c"]).rewards.tolist() == [1.0]
    pid_file = tmp_path / "pid"
    spec = RewardSpec(starts_a_sleeper, kwargs={"pid_file": str(pid_file)})
    with RewardRunner([spec], timeout_s=1.0, on_error="skip", num_workers=1) as r:
        assert r.score(["p"], ["c"]).stats["reward/timeouts"] == 1
        pid = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)


def test_an_unclosed_runner_does_not_hold_up_interpreter_exit():
    import subprocess
    import sys

    code = ("from gspo.rewards.runner import RewardRunner\n"
            "def f(prompts, completions, **kw): return [1.0] * len(completions)\n"
            "r = RewardRunner([f], num_workers=2); print(r.score(['p'], ['c']).rewards.tolist())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[1.0]", out.stderr


def test_a_worker_whose_trainer_is_killed_mid_call_ends_with_what_its_function_started(tmp_path):
    """Out of the job's process group, a reward worker checked for its parent only between calls:
    a hung call kept it (and the process its function started) alive after a SIGKILLed trainer."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(
        "import os, subprocess, sys, time\n"
        "from gspo.rewards.runner import RewardRunner\n"
        "def hang(prompts, completions, **kw):\n"
        "    child = subprocess.Popen(['sleep', '300'])\n"
        "    open(sys.argv[1], 'w').write(f'{os.getpid()} {child.pid}')\n"
        "    time.sleep(300)\n"
        "with RewardRunner([hang], timeout_s=600, num_workers=1) as runner:\n"
        "    runner.score(['p'], ['c'])\n")
    pids = tmp_path / "pids"
    trainer = subprocess.Popen([sys.executable, str(script), str(pids)])
    deadline = time.monotonic() + 60
    while not (pids.exists() and pids.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    worker, child = map(int, pids.read_text().split())
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()

    def alive(pid: int) -> bool:
        try:
            return "\nState:\tZ" not in open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while (alive(worker) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(worker) and not alive(child)


def test_dead_worker_is_replaced():
    with RewardRunner([dies], on_error="zero") as r:
        res = r.score(["p"], ["c"])
        assert res.rewards.tolist() == [0.0] and res.stats["reward/errors"] == 1
        assert r._workers[0][0].is_alive()
