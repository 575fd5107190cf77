"""The code_tests harness against wrong solutions that try to fool it (patching, gc, forged
reports, reruns) and right ones that must still score (multiprocessing): what the program can and
cannot do to the report, docs/code_execution.md. The containment itself: tests/test_sandbox.py."""

import pytest

from gspo.rewards import sandbox, sandbox_programs
from gspo.rewards.sandbox import CodeLimits, run_code_tests
from test_sandbox import FAST


@pytest.mark.parametrize("patch", [
    # each makes a wrong solution's failing case read as passed, were the harness to look it up again
    "import json\n_d = json.dumps\njson.dumps = lambda o, **k: _d({'setup': None, 'cases': ['passed'], 'msg': ''})",
    "import builtins\nbuiltins.exec = lambda *a, **k: None",
    "import builtins\n_c = builtins.compile\nbuiltins.compile = lambda s, n, m, *a, **k: _c('pass', n, m)",
    "import __main__\n__main__._status = lambda e: None",
    # json's internals, which json.dumps looks up on each call
    "import json\n_e = json._default_encoder.encode\n"
    "def _f(o):\n    o['cases'] = ['passed'] * len(o.get('cases', ())) if isinstance(o, dict) else o\n    return _e(o)\n"
    "json._default_encoder.encode = _f",
    # containers the harness keeps, found through gc: its statuses (here when it flushes stdout) and the cases
    "import gc, sys\nclass _Out:\n    def write(self, x): return len(x)\n    def flush(self):\n"
    "        for o in gc.get_objects():\n            for v in (o.values() if isinstance(o, dict) else [o]):\n"
    "                if isinstance(v, list) and 'failed' in v: v[:] = ['passed' if x == 'failed' else x for x in v]\n"
    "sys.stdout = _Out()",
    "import gc\nfor o in gc.get_objects():\n"
    "    if isinstance(o, list) and any(isinstance(x, str) and x.startswith('assert') for x in o): o[:] = ['pass'] * len(o)",
    # an exception whose class name is a str subclass (or a metaclass property) that makes "error:" + name "passed"
    "class S(str):\n    def __radd__(self, other): return 'passed'\nclass E(Exception): pass\nE.__name__ = S('E')\n"
    "def add(a, b): raise E",
    "class N:\n    def __radd__(self, other): return ''\nclass M(type):\n    @property\n    def __name__(cls): return N()\n"
    "class E(Exception, metaclass=M): pass\ndef add(a, b): raise E",
    # the names the harness used to look up after the program ran: str, type, AssertionError
    "_S = str\nclass F:\n    @staticmethod\n    def encode(f, *a): return _S.encode('passed' if f == 'failed' else f, *a)\n"
    "import builtins\nbuiltins.str = F",
    "import builtins\nclass S(str):\n    def __radd__(self, other): return 'passed'\nclass T: pass\nt = T()\nt.__name__ = S('x')\n"
    "_type = type\nbuiltins.type = lambda *a: t if len(a) == 1 and isinstance(a[0], BaseException) else _type(*a)\n"
    "builtins.AssertionError = KeyError",
    # asserts compiled away: the interpreter's optimisation level raised at run time
    "import _testinternalcapi as t\nc = t.get_config()\nc['optimization_level'] = 2\nt.set_config(c)",
    # the answers read off the tests' file in the working directory
    "import json, re\nans = {}\nfor t in json.load(open('tests.json')):\n"
    "    m = re.fullmatch(r'assert add\\((.*)\\) == (.*)', t)\n    ans[m.group(1).replace(' ', '')] = int(m.group(2))\n"
    "def add(a, b): return ans.get(f'{a},{b}', 0)",
    # a Python function the harness calls after the program ran, rewritten through its __code__
    "import gc, types\nfor o in gc.get_objects():\n    if isinstance(o, types.FunctionType) and o.__name__ in ('run', '_run', '_status'):\n"
    "        o.__code__ = (lambda *a, **k: None).__code__",
])
def test_patching_modules_builtins_or_the_harness_does_not_pass_a_wrong_solution(patch):
    result = run_code_tests("def add(a, b):\n    return 0\n" + patch, ["assert add(1, 2) == 3"], FAST)
    assert result.score == 0.0, result


_INTERCEPT = """
import os
def add(a, b): return 0
st1 = os.fstat(1)
out = next(f for f in map(int, os.listdir("/proc/self/fd")) if f > 2 and f != 255
           and (lambda s: (s.st_ino, s.st_dev) == (st1.st_ino, st1.st_dev))(os.fstat(f)))
r, w = os.pipe()
os.dup2(w, out); os.close(w)
if os.fork() == 0:  # reads the harness's own report off the pipe, marks every case passed, writes it on
    os.close(out)
    buf = b""
    while b"\\n" not in buf.lstrip(b"\\n"):
        c = os.read(r, 65536)
        if not c: break
        buf += c
    marker, mac, payload = buf.strip().split(b" ")
    fields = payload.split(b"\\t")
    fields[1:-1] = [b"passed".hex().encode()] * (len(fields) - 2)
    os.write(1, b"\\n" + marker + b" " + mac + b" " + b"\\t".join(fields) + b"\\n")
    os._exit(0)
os.close(r)
"""


def test_a_report_intercepted_and_altered_is_not_believed():
    """A wrong solution pointed the harness's copy of stdout at a pipe and forked: its child read the
    report (and its nonce), marked the cases passed and wrote it on; the last report won. Now the
    report's MAC is keyed by a secret that never leaves the harness."""
    for _ in range(3):
        assert run_code_tests(_INTERCEPT, ["assert add(1, 2) == 3"], FAST).score == 0.0
    key, marker = "k" * 64, "m" * 16
    payload = b"\t".join(x.encode().hex().encode() for x in ("", "failed", "msg"))
    good = f"{marker} ".encode() + sandbox_programs.mac(key.encode(), payload) + b" " + payload
    forged = good.replace(b"failed".hex().encode(), b"passed".hex().encode())
    assert sandbox_programs.read_report(b"out\n" + forged + b"\n", marker, key)[0] is None
    report, rest = sandbox_programs.read_report(b"out\n" + forged + b"\n" + good + b"\n", marker, key)
    assert report == {"setup": None, "cases": ["failed"], "msg": "msg"} and rest == b"out\n" + forged


def test_a_program_that_reruns_a_passing_case_gets_no_credit_for_it():
    """It rewound the harness's loop (a tuple iterator found through gc) so that a passing case ran
    50 more times: 25.5 for a solution that passes one case of two. The loop has no iterator now,
    and a report with more (or fewer) results than cases is no report."""
    code = ("import gc\nits = [o for o in gc.get_objects() if type(o).__name__ == 'tuple_iterator']\nruns = [0]\n"
            "def add(a, b):\n    if runs[0] < 50 and (a, b) == (2, 2):\n        runs[0] += 1\n"
            "        for it in its:\n            try: it.__setstate__(len(it.__reduce__()[1][0]) - 1)\n"
            "            except Exception: pass\n    return a * b\n")
    result = run_code_tests(code, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"], FAST)
    assert result.score <= 0.5, result
    forged = sandbox._classify(0, False, b"", b"", {"setup": None, "cases": ["passed"] * 3, "msg": ""}, 2, FAST, {})
    assert forged.score == 0.0 and forged.reason == "error"


def test_a_program_using_a_multiprocessing_pool_scores_as_its_answer_deserves():
    """Pool's semaphores need a writable /dev/shm (read-only before: OSError, scored 0), and its
    workers find the program's functions as __main__.<name> (the harness's module before)."""
    code = ("import multiprocessing as mp\ndef sq(x): return x * x\n"
            "with mp.get_context('fork').Pool(2) as p: squares = p.map(sq, range(5))\ndef add(a, b): return a + b\n")
    result = run_code_tests(code, ["assert squares == [0, 1, 4, 9, 16]", "assert add(1, 2) == 3"], CodeLimits(timeout_s=10))
    assert result.score == 1.0, result
