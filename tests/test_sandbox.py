"""The code_tests reward and its containment. Every hostile program here runs only after the
fixture has checked which limits are in force; the fork bomb runs only with an enforced
process limit and a 2 s deadline."""

import concurrent.futures
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

from gspo.rewards import sandbox
from gspo.rewards.sandbox import (CodeExecutionDisabled, CodeLimits, CodeResult, SandboxError, code_tests_reward,
                          extract_code, last_reasons, run_code_tests)

FAST = CodeLimits(timeout_s=2.0, memory_mb=256, max_file_mb=1)


NEWNS, NEWNET, NEWPID, NEWUSER, NEWIPC = 0x20000, 0x40000000, 0x20000000, 0x10000000, 0x8000000


def _can_unshare(flag):
    """Whether this OS lets us create the namespace at all (probed without the sandbox code)."""
    flag |= 0 if os.geteuid() == 0 else NEWUSER
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({flag}) != 0)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


@pytest.fixture(scope="module")
def features():
    found = sandbox.sandbox_features(FAST)
    # where the OS allows a namespace, the sandbox must have used it (a skip must not hide a bug)
    for key, flag in (("netns", NEWNET), ("mountns", NEWNS), ("pidns", NEWPID), ("ipcns", NEWIPC), ("readonly", NEWNS)):
        if _can_unshare(flag):
            assert found[key], (key, found)
    if found["userns"]:  # its user namespace allows no nested one (whose capabilities would reopen the rest)
        assert found.get("sealed"), found
    return found


def _reward(completions, tests, **kw):
    return code_tests_reward([""] * len(completions), completions, tests=tests, allow_code_execution=True,
                             timeout_s=kw.pop("timeout_s", 2.0), memory_mb=256, max_file_mb=1, **kw)


def test_disabled_by_default_and_needs_exactly_true():
    for flag in ({}, {"allow_code_execution": False}, {"allow_code_execution": "true"}, {"allow_code_execution": 1}):
        with pytest.raises(CodeExecutionDisabled, match=r"rewards\.allow_code_execution=true"):
            code_tests_reward(["p"], ["def f(): return 1"], tests=["assert f() == 1"], **flag)
    assert issubclass(CodeExecutionDisabled, PermissionError)


def test_scores_and_formats():
    good = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    chat = [{"role": "assistant", "content": good}]
    scores = _reward(
        [good, wrong, good, "def add(a, b): return a * b", chat, good],
        ["assert add(1, 2) == 3",
         "assert add(1, 2) == 3",
         ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(0, 0) == 0", "assert add(-1, 1) == 0"],
         ["assert add(2, 2) == 4", "assert add(1, 2) == 3"],
         ["assert add(1, 1) == 2"],
         None])
    assert scores == [1.0, 0.0, 0.75, 0.5, 1.0, None]
    assert last_reasons() == {"passed": 2, "failed": 3}


def test_extract_code():
    assert extract_code("x = 1") == "x = 1"
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\nx = 2\n```\n") == "x = 2\n"
    assert extract_code("```\ny = 3\n```") == "y = 3\n"
    assert extract_code("```text\nnot code\n```\n```python\nz = 4\n```") == "z = 4\n"
    assert extract_code("```python\nunclosed = 5\n") == "unclosed = 5\n"


@pytest.mark.parametrize("text", [
    "1. The solution:\n   ```python\n   def f(x):\n       return 2 * x\n   ```\n",  # in a markdown list item
    "```python\nFENCE = '```'\ndef f(x):\n    return 2 * x\n```\n",  # a fence inside the code's strings
    "```python\ndef f(x):\n    return 2 * x```",  # closed at the end of the last line
    "<think>try ```python\ndef f(x): return 0\n```</think>\n```python\ndef f(x):\n    return 2 * x\n```",
])
def test_extract_code_from_fences_as_models_write_them(text):
    code = extract_code(text)
    namespace = {}
    exec(compile(code, "solution", "exec"), namespace)
    assert namespace["f"](2) == 4


def test_tests_saved_as_json_text_are_read_as_a_list():
    """Parquet/CSV datasets often hold the list as a JSON string: run as Python it is one
    statement that does nothing, and every completion would pass."""
    seen = []

    def executor(code, cases, limits):
        seen.append(list(cases))
        return CodeResult(0.5, "failed")

    tests = ['["assert x == 1", "assert x == 2"]', "  ", " []", "[x] == [1] or None", "assert x"]
    scores = code_tests_reward(["p"] * 5, ["x = 1"] * 5, tests=tests, allow_code_execution=True, executor=executor)
    assert scores == [0.5, None, None, 0.5, 0.5]
    assert seen == [["assert x == 1", "assert x == 2"], ["[x] == [1] or None"], ["assert x"]]
    seen.clear()  # pandas' CSV repr of a list column, and one statement saved as a JSON string
    tests = ["['assert x == 1']", '"assert x == 2"', "'a' in 'abc'"]
    assert code_tests_reward(["p"] * 3, ["x = 1"] * 3, tests=tests, allow_code_execution=True,
                             executor=executor) == [0.5] * 3
    assert seen == [["assert x == 1"], ["assert x == 2"], ["'a' in 'abc'"]]
    with pytest.raises(TypeError, match="tests for sample 0 is a list saved as text whose items are not all strings"):
        code_tests_reward(["p"], ["x = 1"], tests=['["assert x", 2]'], allow_code_execution=True, executor=executor)
    with pytest.raises(TypeError, match="tests for sample 1 must be a list of str .*got an item None"):
        code_tests_reward(["p"] * 2, ["x = 1"] * 2, tests=[["assert x"], ["assert x", None]], allow_code_execution=True,
                          executor=executor)


def test_exit_tricks_do_not_pass():
    scores = _reward(["import sys\nsys.exit(0)", "import os\nos._exit(0)", "def f(:", "raise ValueError('x')"],
                     ["assert False"] * 4)
    assert scores == [0.0, 0.0, 0.0, 0.0]
    assert last_reasons() == {"error": 3, "syntax_error": 1}


def test_custom_executor_and_reasons():
    seen = []

    def executor(code, cases, limits):
        seen.append((code, list(cases), limits.timeout_s))
        return CodeResult(0.25, "failed")

    scores = code_tests_reward(["p"], ["```python\nx = 1\n```"], tests=[["assert x"]], allow_code_execution=True,
                               timeout_s=3.0, executor=executor)
    assert scores == [0.25] and seen == [("x = 1\n", ["assert x"], 3.0)]
    with pytest.raises(ValueError, match="tests"):
        code_tests_reward(["p"], ["x"], allow_code_execution=True)


def test_program_never_runs_as_root_seen_from_outside(features):
    for key in ("netns", "mountns", "pidns", "tmpfs", "readonly", "nproc", "uid"):
        assert key in features
    # the program renames itself; `ps` here shows the uid the kernel really gives it
    tag = "g" + secrets.token_hex(6)
    code = f"import time\nopen('/proc/self/comm', 'w').write({tag!r})\ntime.sleep(1.0)"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(run_code_tests, code, "pass", FAST)
        uids = []
        while not uids and not future.done():
            ps = subprocess.run(["ps", "-eo", "uid=,comm="], capture_output=True, text=True).stdout.split("\n")
            uids = [int(line.split()[0]) for line in ps if line.split()[1:] == [tag]]
            time.sleep(0.05)
        assert future.result().score == 1.0
    assert uids, "the program was not seen running"
    assert uids[0] == (features["uid"] if os.geteuid() == 0 else os.geteuid())
    assert uids[0] != 0, "model code must never run as root"


def test_never_runs_as_root_without_namespaces():
    limits = CodeLimits(timeout_s=2.0, namespaces=False)
    try:
        result = run_code_tests("import os\nprint('uid', os.getuid())", "pass", limits)
    except SandboxError as e:
        assert os.geteuid() == 0 and "refusing" in str(e)
    else:
        assert result.score == 1.0 and (os.geteuid() != 0) == (result.features["uid"] == os.geteuid())
        assert "uid 0\n" not in result.detail


def test_infinite_loop_hits_deadline():
    t = time.monotonic()
    result = run_code_tests("while True: pass", "assert True", CodeLimits(timeout_s=1.0))
    assert time.monotonic() - t < 4.0
    assert (result.score, result.reason) == (0.0, "timeout")


def test_sleeping_child_in_new_session_is_killed(features):
    if not features["pidns"]:
        pytest.skip("no PID namespace here: a child that calls setsid() can outlive the run")
    tag = secrets.token_hex(6)
    code = f"import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60 + 0 * len('{tag}'))\n"
    assert run_code_tests(code, "pass", FAST).score == 1.0
    time.sleep(0.2)
    assert tag not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def _sandbox_user_procs(uid):
    return [line for line in subprocess.run(["ps", "-o", "pid=", "-u", str(uid)], capture_output=True,
                                            text=True).stdout.split() if line]


def test_process_limit(features):
    if not features["nproc"]:
        pytest.skip("process limit not enforced here")
    code = ("import os, time\nstarted = 0\ntry:\n    for _ in range(40):\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        started += 1\nexcept OSError:\n    pass\n")
    result = run_code_tests(code, ["assert 3 <= started < 8", "assert started >= 40"], CodeLimits(timeout_s=3.0, max_procs=8))
    assert result.cases == ("passed", "failed"), result.detail


def test_fork_bomb_is_contained(features):
    if not features["nproc"]:
        pytest.skip("process limit not enforced here: refusing to run a fork bomb")
    before = len(_sandbox_user_procs(features["uid"]))
    t = time.monotonic()
    for code in ("import os\nwhile True: os.fork()",
                 "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"):
        result = run_code_tests(code, "assert True", CodeLimits(timeout_s=2.0, max_procs=16))
        assert result.score == 0.0 and result.reason in ("error", "timeout")
        if "try" not in code:  # fork() failed at the limit and the program died of it, well before 2 s
            assert result.reason == "error" and "BlockingIOError" in result.detail
    assert time.monotonic() - t < 8.0
    time.sleep(0.2)
    assert len(_sandbox_user_procs(features["uid"])) <= before


def test_fork_bomb_does_not_starve_neighbours(features):
    if not (features["nproc"] and (features["userns"] or features["uid"] != 65534)):
        pytest.skip("process count is shared by all sandbox runs here")
    bomb = "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"
    good = "import threading\nt = threading.Thread(target=lambda: None); t.start(); t.join()\nok = 1"
    scores = _reward([bomb, good, good, good], ["assert ok"] * 4, max_workers=4)
    assert scores == [0.0, 1.0, 1.0, 1.0]


def test_memory_hog():
    for code in ("x = bytearray(10**10)", "x = []\nwhile True:\n    x.append(' ' * 10**6)"):
        result = run_code_tests(code, "assert True", FAST)
        assert (result.score, result.reason) == (0.0, "memory"), result.detail


def test_file_size_limit():
    big = "with open('big', 'wb') as f:\n    f.write(b'x' * (5 << 20))"
    result = run_code_tests(big, "assert True", FAST)
    assert (result.score, result.reason) == (0.0, "file_size")
    capped = ("import errno, os\ntry:\n    open('big', 'wb').write(b'x' * (5 << 20))\n"
              "except OSError as e:\n    assert e.errno == errno.EFBIG\n")
    assert run_code_tests(capped, "assert os.path.getsize('big') <= 1 << 20", FAST).score == 1.0
    flood = run_code_tests("print('y' * (3 << 20))", "assert True", FAST)
    assert (flood.score, flood.reason) == (0.0, "file_size") and len(flood.detail) < 3 * FAST.max_output_chars


def test_workdir_is_writable_and_private():
    code = "open('scratch.txt', 'w').write('hi')\nimport os\nwd = os.getcwd()"
    assert run_code_tests(code, ["assert open('scratch.txt').read() == 'hi'"], FAST).score == 1.0


def test_write_outside_workdir_is_blocked(features):
    if not features["readonly"]:
        pytest.skip("no read-only mount namespace here: the program may write where its uid may")
    targets = [f"/tmp/gspo_escape_{secrets.token_hex(6)}", os.path.join(os.getcwd(), f"gspo_escape_{secrets.token_hex(6)}")]
    try:
        for path in targets:
            result = run_code_tests(f"open({path!r}, 'w').write('x')", "assert True", FAST)
            assert result.score == 0.0 and "Read-only file system" in result.detail, result.detail
            assert not os.path.exists(path)
    finally:
        for path in targets:
            if os.path.exists(path):
                os.remove(path)


def test_network_is_unreachable(features):
    if not features["netns"]:
        pytest.skip("network namespace not permitted here")  # the fixture checked that it is not
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\ns.sendall(b'hi')"
        result = run_code_tests(code, "assert True", FAST)
        assert result.score == 0.0 and result.reason == "error"
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()



def _shm_keys() -> set[str]:
    lines = open("/proc/sysvipc/shm").read().splitlines()[1:]
    return {line.split()[0] for line in lines}


def test_system_v_shared_memory_ends_with_the_program(features):
    if not _can_unshare(NEWIPC):  # (where it can, the fixture checked that the sandbox made one)
        pytest.skip("this OS allows no IPC namespace")
    key = secrets.randbelow(2**30) + 1
    code = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"shmid = libc.shmget({key}, 1 << 20, 0o1600)\nassert shmid >= 0, ctypes.get_errno()\n")
    try:
        result = run_code_tests(code, "pass", FAST)
        assert result.score == 1.0, result
        assert str(key) not in _shm_keys()  # the segment was the program's namespace's, gone with it
    finally:
        subprocess.run(["ipcrm", "-M", str(key)], capture_output=True)
    # and no more of it than memory_mb: a segment past the limit is refused inside
    big = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
           f"assert libc.shmget({key}, {FAST.memory_mb + 64} << 20, 0o1600) < 0\n")
    assert run_code_tests(big, "pass", FAST).score == 1.0


_AS_OTHER_USER = """
import json, sys
from gspo.rewards.sandbox import CodeLimits, SandboxError, run_code_tests
out = {}
for same in (False, True):
    try:
        r = run_code_tests("import os\\nprint(os.getuid())", "pass", CodeLimits(namespaces=False, allow_same_user=same))
        out[str(same)] = r.score
    except SandboxError as e:
        out[str(same)] = str(e)
print(json.dumps(out))
"""


def test_model_code_never_runs_as_the_trainers_own_uid_without_a_user_namespace_unless_allowed():
    """As a non-root user with no user namespace the program would run as the trainer's uid, able to
    SIGKILL it and read /proc/PID/environ: refused, unless allow_same_user. (As root, the test
    becomes uid 1000 in a user namespace of its own, which reaches what root's files allow.)"""
    argv = [sys.executable, "-c", _AS_OTHER_USER]
    if os.geteuid() == 0:
        argv = ["unshare", "--user", "--map-user=1000", "--map-group=1000", *argv]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    out = __import__("json").loads(p.stdout.splitlines()[-1])
    assert "refusing to run model code as uid" in out["False"] and "allow_same_user" in out["False"]
    assert out["True"] == 1.0


def test_a_code_execution_opt_in_that_is_not_true_is_refused_at_start_up():
    from gspo.config import ConfigError, load_config
    from gspo.train.reward_specs import checked_reward_specs

    for value in ("'yes'", "false", "1"):
        cfg = load_config(None, ["rewards.allow_code_execution=true",
                                 f"rewards.functions=[{{name: code_tests, kwargs: {{allow_code_execution: {value}}}}}]"])
        with pytest.raises(ConfigError, match=r"rewards\.functions\[0\]\.kwargs.*'allow_code_execution' must be true"):
            checked_reward_specs(cfg)
    cfg = load_config(None, ["rewards.allow_code_execution=true", "rewards.functions=[code_tests]"])
    assert checked_reward_specs(cfg)[0].kwargs["allow_code_execution"] is True


def test_working_folders_of_a_killed_caller_are_removed(monkeypatch):
    monkeypatch.setattr(sandbox, "_SWEPT", False)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tmp = sandbox.tempfile.gettempdir()
    left = os.path.join(tmp, f"gspo-code-{int(dead.stdout)}-{secrets.token_hex(4)}")
    alive = os.path.join(tmp, f"gspo-code-{os.getppid()}-{secrets.token_hex(4)}")
    try:
        for d in (left, alive):
            os.makedirs(os.path.join(d, "work"))
        assert run_code_tests("x = 1", "assert x == 1", FAST).score == 1.0
        assert not os.path.exists(left) and os.path.exists(alive)
        assert not [p for p in os.listdir(tmp) if p.startswith(f"gspo-code-{os.getpid()}-")]  # its own is gone too
    finally:
        for d in (left, alive):
            sandbox.shutil.rmtree(d, ignore_errors=True)





def test_a_program_can_make_no_namespace_of_its_own(features):
    """With a nested user namespace a program became pid 2 of a PID namespace of its own, as the
    harness is, so that a forked copy reported (brute-forcing the answers: 1.0); and mounted a
    tmpfs of half the RAM past memory_mb."""
    if not features["userns"]:
        pytest.skip("no user namespace here")
    code = "import ctypes\nlibc = ctypes.CDLL(None)\nassert libc.unshare(0x10000000) != 0\nassert libc.unshare(0x20000) != 0\n"
    assert run_code_tests(code, "pass", FAST).score == 1.0


def test_a_program_cannot_read_another_runs_files():
    """The host copies of solution.py and tests.json stayed in /tmp/gspo-code-*/work, readable by
    every run's program (all uid 65534): one completion copied a sibling's code and tests."""
    import tempfile
    import threading

    pattern = os.path.join(tempfile.gettempdir(), "gspo-code-*", "work", "*")
    thief = (f"import glob, os\nfound = []\nfor p in glob.glob({pattern!r}):\n    if p.startswith(os.getcwd()):\n"
             "        continue  # (its own)\n    try:\n        open(p).read()\n"
             "        found.append(p)\n    except OSError:\n        pass\nassert not found, found\n")
    victim = threading.Thread(target=run_code_tests, args=("import time\ntime.sleep(3)", "pass", CodeLimits(timeout_s=6)))
    victim.start()
    time.sleep(1.0)
    try:
        result = run_code_tests(thief, "pass", FAST)
    finally:
        victim.join()
    assert result.score == 1.0, result


def test_a_program_cannot_reach_a_unix_socket_on_the_host(tmp_path):
    """The network namespace leaves sockets with a filesystem path reachable: a program talked to a
    listener in /tmp. socket(AF_UNIX) now fails (seccomp); socketpair, pipes and multiprocessing work."""
    import platform
    import socket
    import tempfile

    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("no filter for this architecture")
    path = tempfile.mktemp(prefix="gspo-test-", suffix=".sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(1)
    try:
        code = (f"import socket\ntry:\n    s = socket.socket(socket.AF_UNIX)\n    s.connect({path!r})\n    reached = True\n"
                "except OSError:\n    reached = False\nassert not reached\n"
                "a, b = socket.socketpair()\na.send(b'x')\nassert b.recv(1) == b'x'\n"
                "import multiprocessing as mp\nq = mp.get_context('fork').Queue()\nq.put(1)\nassert q.get() == 1\n")
        result = run_code_tests(code, "pass", CodeLimits(timeout_s=10))
        assert result.score == 1.0 and result.features.get("unix_blocked"), result
    finally:
        server.close()
        os.unlink(path)
