"""gspo.rewards and gspo.rewards.runner: built-ins, name resolution, and the worker-process runner's
error policies."""

import math
import threading
import time

import pytest
import torch

from gspo.rewards import (
    BUILTIN_REWARDS,
    RewardConfigError,
    RewardError,
    RewardSpec,
    exact_answer,
    format_reward,
    make_format_reward,
    math_verify,
    resolve_reward,
    validate_specs,
)
from gspo.rewards.runner import RewardRunner

# ------------------------------------------------------------------------ user functions
# Defined in this test module: forked workers must run them as they are.


def length_reward(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def answer_or_none(prompts, completions, answer, **kwargs):
    return [None if a is None else float(c == a) for c, a in zip(completions, answer)]


def fails_on_bad(prompts, completions, **kwargs):
    if any(c == "bad" for c in completions):
        raise ValueError("cannot score 'bad'")
    return [1.0] * len(completions)


def sleeps_on_hang(prompts, completions, **kwargs):
    if "hang" in completions:
        time.sleep(60)
    return [1.0] * len(completions)


def scaled(prompts, completions, scale=1.0, **kwargs):
    return [scale] * len(completions)


# ------------------------------------------------------------------------ built-ins


@pytest.mark.parametrize("completion,expected", [
    ("19", 1.0), ("  19\n", 1.0), ("18", 0.0), ("it is 19", 0.0),
    ("so \\boxed{19}", 1.0), ("\\boxed{18} then \\boxed{ 19 }", 1.0), ("\\boxed{19} then \\boxed{18}", 0.0),
    ("<think>x</think><answer> 19 </answer>", 1.0), ("<answer>19</answer><answer>1</answer>", 0.0),
])
def test_exact_answer(completion, expected):
    assert exact_answer(["p"], [completion], answer=["19"]) == [expected]


def test_an_empty_or_nan_answer_is_missing_not_matched_by_anything():
    """An empty cell (a CSV's "", pandas' or parquet's NaN, blank text) is a missing answer: it
    used to match every completion, since a completion without \\boxed{} or <answer> offered ""
    as a candidate, and NaN matched only the text "nan"."""
    nan = float("nan")
    assert exact_answer(["p"] * 5, ["junk", "", "nan", "  ", "\\boxed{}"], answer=["", "", nan, "  ", " "]) == [None] * 5
    assert exact_answer(["p"] * 2, ["4", "<answer></answer>"], answer=[["", "4"], ["", None]]) == [1.0, None]
    # a whole number written as a float (pandas' integer column with an empty cell) also in its integer form
    assert exact_answer(["p"] * 4, ["4", "4", "4.0", "4.5"], answer=[4.0, "4.0", "4", "4"]) == [1.0, 1.0, 0.0, 0.0]
    assert exact_answer(["p"], ["True"], answer=[True]) == [1.0]


def test_exact_answer_nested_braces_missing_answer_and_chat_shape():
    assert exact_answer(["p"], ["\\boxed{\\frac{1}{2}}"], answer=["\\frac{1}{2}"]) == [1.0]
    assert exact_answer(["p", "p"], ["1", "1"], answer=[None, 1]) == [None, 1.0]  # int answer compared as str
    assert exact_answer(["p"], ["1"]) == [None]  # no answer column at all
    assert exact_answer(["p"], ["b"], answer=[["a", "b"]]) == [1.0]  # list of acceptable answers
    chat = [[{"role": "assistant", "content": "\\boxed{7}"}]]
    assert exact_answer(["p"], chat, answer=["7"]) == [1.0]


def test_math_verify_equivalence():
    completions = ["The answer is \\boxed{1/2}", "\\boxed{0.5}", "\\boxed{0.6}", "no number here"]
    assert math_verify([""] * 4, completions, answer=["0.5", "\\frac{1}{2}", "0.5", "0.5"]) == [1.0, 1.0, 0.0, 0.0]
    assert math_verify([""], ["1"], answer=[None]) == [None]
    # a list of acceptable answers, as exact_answer takes it (str(list) was parsed: always 0)
    assert math_verify([""] * 3, ["4", "\\boxed{4}", "5"], answer=[["4", "four"], [None, "4"], ["4"]]) == [1.0, 1.0, 0.0]
    import numpy as np

    assert math_verify([""], ["nan"], answer=[np.float32("nan")]) == [None]  # numpy's NaN is missing too
    assert exact_answer([""], ["nan"], answer=[np.float32("nan")]) == [None]


def test_math_verify_off_the_main_thread():
    # math-verify's SIGALRM timeouts fail on other threads; the built-in turns them off there.
    out = []
    t = threading.Thread(target=lambda: out.append(math_verify([""], ["\\boxed{2}"], answer=["2"])))
    t.start()
    t.join()
    assert out == [[1.0]]


def test_format_reward():
    good = "<think>\nhmm\n</think>\n<answer>4</answer>\n"
    assert format_reward([""] * 3, [good, "<answer>4</answer>", good + "x"]) == [1.0, 0.0, 0.0]
    digits = make_format_reward(r"\d+")
    assert digits([""] * 2, ["123", "12a"]) == [1.0, 0.0]


# ------------------------------------------------------------------------ resolution


def test_resolve_builtins_paths_and_callables():
    assert resolve_reward("exact_answer") is exact_answer
    assert resolve_reward("gspo.rewards:math_verify") is math_verify
    assert resolve_reward("gspo.rewards.format_reward") is format_reward
    assert resolve_reward(length_reward) is length_reward
    assert "code_tests" in BUILTIN_REWARDS


def test_resolve_errors():
    known = "code_tests, env_reward, exact_answer, format, math_verify"
    with pytest.raises(RewardConfigError, match=rf"unknown reward 'nope'.*{known}"):
        resolve_reward("nope")
    with pytest.raises(RewardConfigError, match="cannot import module 'no_such_pkg.mod'"):
        resolve_reward("no_such_pkg.mod:f")
    with pytest.raises(RewardConfigError, match="has no attribute 'nothing'"):
        resolve_reward("gspo.rewards:nothing")
    with pytest.raises(RewardConfigError, match=r"must accept \*\*kwargs"):
        resolve_reward(lambda prompts, completions: [])


class Scorer:
    def __init__(self, scale=2.0):
        self.scale = scale

    def __call__(self, prompts, completions, **kwargs):
        return [self.scale] * len(completions)


def test_a_class_is_refused_as_a_class_and_an_instance_works():
    """A class's signature is its __init__'s: "must accept **kwargs" would send the user the wrong way."""
    with pytest.raises(RewardConfigError, match=r"Scorer is a class; give a reward function, or an instance"):
        resolve_reward(Scorer)
    with RewardRunner([Scorer(3.0)], num_workers=0) as r:
        assert r.score(["p"], ["c"]).rewards.tolist() == [3.0]


def test_validate_specs_keys_and_errors():
    keys = [k for k, _, _ in validate_specs(["format", {"name": "format", "kwargs": {"pattern": "x"}}, "exact_answer"])]
    assert keys == ["format", "format_2", "exact_answer"]
    with pytest.raises(RewardConfigError, match="weight"):
        validate_specs([RewardSpec("format", weight=float("nan"))])
    with pytest.raises(RewardConfigError, match="weight must be a finite number within float32's range") as e:
        validate_specs([RewardSpec("format", weight=1e39)])
    assert e.value.field == "weight"  # so that a config error names rewards.functions[i].weight
    with pytest.raises(RewardConfigError, match="unknown option") as e:
        validate_specs([RewardSpec("format", kwargs={"patern": "x"})])
    assert e.value.field == "kwargs"


def a(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def a_2(prompts, completions, **kwargs):
    return [2.0] * len(completions)


def test_generated_keys_never_take_another_functions_name():
    """`a`, `a`, `a_2`: the second `a` must not become `a_2`, which would merge two functions' values."""
    keys = [k for k, _, _ in validate_specs([a, a, a_2])]
    assert keys == ["a", "a_3", "a_2"]
    assert [k for k, _, _ in validate_specs([a_2, a, a, a])] == ["a_2", "a", "a_3", "a_4"]
    with RewardRunner([a, a, a_2], num_workers=0) as r:
        res = r.score(["p"], ["c"])
    assert res.per_function == {"a": [1.0], "a_3": [1.0], "a_2": [2.0]} and res.rewards.tolist() == [4.0]
    with pytest.raises(RewardConfigError, match="unknown reward 'nope'"):
        validate_specs(["format", "nope"])


def test_a_builtins_options_are_checked_at_start_up():
    with pytest.raises(RewardConfigError, match=r"'exact_answer': unknown option 'answr' \(its options: answer\)"):
        validate_specs([{"name": "exact_answer", "kwargs": {"answr": "x"}}])
    with pytest.raises(RewardConfigError, match=r"'format': option 'pattern' '\(\[' is not a regular expression"):
        validate_specs([{"name": "format", "kwargs": {"pattern": "(["}}])
    assert len(validate_specs([{"name": "code_tests", "kwargs": {"timeout_s": 2.0, "allow_code_execution": True}},
                               {"name": "format", "kwargs": {"pattern": "a+"}}])) == 2
    for option, value, match in [("timeout_s", -1, "a finite number > 0, got -1"),
                                 ("memory_mb", "lots", "an int > 0, got 'lots'"),
                                 ("max_procs", 2.5, "an int > 0, got 2.5"),
                                 ("max_workers", 0, "an int >= 1 or None, got 0")]:
        with pytest.raises(RewardConfigError, match=f"reward 'code_tests': option '{option}' must be {match}"):
            validate_specs([{"name": "code_tests", "kwargs": {option: value}}])
    # a function of one's own keeps its **kwargs: options it does not name are not refused
    assert validate_specs([{"name": "gspo_test_rewards:count_ones", "kwargs": {"anything": 1}}])


# ------------------------------------------------------------------------ runner


@pytest.fixture(scope="module")
def runner():
    with RewardRunner([RewardSpec(length_reward, weight=0.5), RewardSpec("exact_answer", weight=2.0)],
                      num_workers=2) as r:
        yield r


def test_runner_weighted_sum_in_worker_processes(runner):
    res = runner.score(["p"] * 3, ["ab", "7", "x"], {"answer": ["ab", "7", "y"]})
    # 0.5 * len + 2 * exact: [0.5*2 + 2, 0.5*1 + 2, 0.5*1 + 0]
    assert res.rewards.dtype == torch.float32 and res.rewards.tolist() == [3.0, 2.5, 0.5]
    assert res.per_function == {"length_reward": [2.0, 1.0, 1.0], "exact_answer": [1.0, 1.0, 0.0]}
    assert res.stats["reward/exact_answer/mean"] == pytest.approx(2 / 3)
    assert res.stats["reward/missing"] == 0 and res.stats["reward/errors"] == 0


def test_the_contract_imports_neither_the_runner_nor_torch():
    """gspo.rewards (the contract, names, built-ins) is light: the runner, which needs torch, is
    gspo.rewards.runner, and nothing in gspo.rewards imports it."""
    import subprocess
    import sys

    code = "import sys, gspo.rewards; print('gspo.rewards.runner' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


P4 = ["p0", "p1", "p2", "p3"]  # four groups of one: the runner splits a batch only between groups


def test_a_row_sums_the_functions_that_scored_it_and_is_missing_when_none_did():
    """TRL's nansum: None means "does not apply to this row" (its multi-task pattern)."""
    specs = [RewardSpec(answer_or_none, weight=2.0), RewardSpec(length_reward)]
    with RewardRunner(specs) as r:
        res = r.score(["p"] * 2, ["a", "b"], {"answer": [None, "b"]})
    # row 0: only length 1; row 1: 2 * 1 + length 1
    assert res.rewards.tolist() == [1.0, 3.0] and res.stats["reward/missing"] == 0
    assert math.isnan(res.per_function["answer_or_none"][0])
    with RewardRunner([answer_or_none]) as r:
        res = r.score(["p"] * 2, ["a", "b"], {"answer": [None, "b"]})
    assert math.isnan(res.rewards[0]) and res.rewards[1] == 1.0
    assert res.stats["reward/missing"] == 1 and res.stats["reward/mean"] == 1.0
    with RewardRunner([RewardSpec(answer_or_none), RewardSpec(length_reward, weight=0.0)]) as r:
        assert math.isnan(r.score(["p"], ["a"], {"answer": [None]}).rewards[0])  # weight 0 is logged only


def math_or_none(prompts, completions, task, **kwargs):
    return [float(len(c)) if t == "math" else None for c, t in zip(completions, task)]


def code_or_none(prompts, completions, task, **kwargs):
    if "bad" in completions:
        raise ValueError("cannot score 'bad'")
    return [10.0 if t == "code" else None for c, t in zip(completions, task)]


def test_multi_task_rows_get_their_own_rewards_but_a_failure_still_makes_the_row_missing():
    with RewardRunner([math_or_none, code_or_none], on_error="skip", num_workers=2) as r:
        res = r.score(["p"] * 4, ["ab", "x", "abc", "bad"], {"task": ["math", "code", "math", "code"]})
    # the batch call raised on "bad": re-run alone, only that row failed, and it is missing, not 0
    assert res.rewards.tolist()[:3] == [2.0, 10.0, 3.0] and math.isnan(res.rewards[3])
    assert res.stats["reward/missing"] == 1 and res.stats["reward/errors"] == 1


def test_spec_kwargs_reach_function():
    with RewardRunner([RewardSpec(scaled, kwargs={"scale": 3.0})]) as r:
        assert r.score(["p"], ["c"]).rewards.tolist() == [3.0]


def test_raise_names_function_and_sample():
    with RewardRunner([fails_on_bad], num_workers=2) as r:
        with pytest.raises(RewardError) as e:
            r.score(["p0", "p1", "p2", "the prompt"], ["ok", "ok", "ok", "bad"])
        msg = str(e.value)
        assert "'fails_on_bad' raised on sample 3" in msg and "'the prompt'" in msg and "'bad'" in msg
        assert "ValueError: cannot score 'bad'" in msg  # the traceback text
        assert r.score(["p"], ["ok"]).rewards.tolist() == [1.0]  # still usable


@pytest.mark.parametrize("policy,fill", [("skip", math.nan), ("zero", 0.0)])
def test_skip_and_zero_policies(policy, fill):
    with RewardRunner([fails_on_bad, length_reward], on_error=policy) as r:
        res = r.score(["p"] * 3, ["ok", "bad", "okay"])
    assert res.per_function["fails_on_bad"][0] == 1.0 and res.per_function["fails_on_bad"][2] == 1.0
    got = res.per_function["fails_on_bad"][1]
    assert (math.isnan(got) if math.isnan(fill) else got == fill)
    assert res.stats["reward/errors"] == 1 and res.stats["reward/missing"] == (1 if policy == "skip" else 0)
    assert res.rewards.tolist()[0] == 3.0 and res.rewards.tolist()[2] == 5.0
    assert len(res.errors) == 1 and "sample 1" in res.errors[0]


def test_hang_is_killed_at_deadline_and_runner_recovers():
    with RewardRunner([sleeps_on_hang], timeout_s=1.0, num_workers=2) as r:
        old_pids = [p.pid for p, _ in r._workers]
        t0 = time.monotonic()
        with pytest.raises(RewardError, match=r"'sleeps_on_hang' timed out after 1s on samples 2\.\.3"):
            r.score(P4, ["a", "b", "c", "hang"])
        assert time.monotonic() - t0 < 5
        assert r._workers[0][0].pid == old_pids[0] and r._workers[1][0].pid != old_pids[1]
        assert r.score(P4, ["a"] * 4).rewards.tolist() == [1.0] * 4
    with RewardRunner([sleeps_on_hang, length_reward], timeout_s=1.0, on_error="skip", num_workers=2) as r:
        res = r.score(P4, ["a", "b", "c", "hang"])
        assert res.stats["reward/timeouts"] == 2 and res.stats["reward/missing"] == 2
        assert res.rewards[:2].tolist() == [2.0, 2.0]  # the other chunk and function still count
        assert res.per_function["length_reward"] == [1.0, 1.0, 1.0, 4.0]


def group_sizes(prompts, completions, **kwargs):
    return [float(prompts.count(p)) for p in prompts]


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_each_call_gets_whole_groups(workers):
    """A function that compares a group's completions must see all of them in one call."""
    prompts = ["a"] * 3 + ["b"] * 3 + ["c"] * 3 + ["d"] * 3
    with RewardRunner([group_sizes], num_workers=workers) as r:
        assert r.score(prompts, ["x"] * 12).rewards.tolist() == [3.0] * 12
        assert r.score(["a"] * 5, ["x"] * 5).rewards.tolist() == [5.0] * 5  # one group: one call


def test_stale_reply_from_an_interrupted_call_is_dropped():
    with RewardRunner([length_reward]) as r:
        r.score(["p"], ["abc"])
        r._send(0, ("call", -1, 0, False))  # as if a score() had been interrupted mid-call
        assert r.score(["p"], ["a"]).rewards.tolist() == [1.0]


def test_lazy_builtin_import_failure(monkeypatch):
    monkeypatch.setitem(BUILTIN_REWARDS, "lazy", "gspo_no_such_module:reward")
    with pytest.raises(RewardConfigError, match="reward 'lazy': cannot import module 'gspo_no_such_module'"):
        resolve_reward("lazy")


@pytest.mark.parametrize("fn,match", [
    (lambda prompts, completions, **kw: [1.0], "returned 1 values for 2 completions"),
    (lambda prompts, completions, **kw: [1.0, "x"], "returned 'x' for sample 1"),
    (lambda prompts, completions, **kw: [1.0, float("nan")], "returned nan for sample 1"),
    (lambda prompts, completions, **kw: 1.0, "returned float"),
])
def test_contract_violations_always_raise(fn, match):
    with RewardRunner([fn], on_error="skip") as r:
        with pytest.raises(RewardError, match=match):
            r.score(["p"] * 2, ["a", "b"])


def test_numpy_and_bool_values_accepted():
    import numpy as np

    with RewardRunner([lambda prompts, completions, **kw: np.array([True, False])], num_workers=0) as r:
        assert r.score(["p"] * 2, ["a", "b"]).rewards.tolist() == [1.0, 0.0]


def test_numpy_scalars_and_zero_d_tensors_are_numbers():
    import numpy as np

    def scalars(prompts, completions, **kw):  # list(arr % 2 == 0) gives np.bool_, a tensor's items are 0-d
        return [np.bool_(True), np.float32(0.5), torch.tensor(2.0), np.int64(3)]

    with RewardRunner([scalars], num_workers=0) as r:
        assert r.score(["p"] * 4, ["a", "b", "c", "d"]).rewards.tolist() == [1.0, 0.5, 2.0, 3.0]


def trl_style(completions, **kwargs):  # TRL's quickstart signature: completions by keyword
    return [float(len(c)) for c in completions]


def trl_with_column(completions, answer, **kwargs):
    return [float(c == a) for c, a in zip(completions, answer)]


def keyword_only(*, prompts, completions, **kwargs):
    return [float(p == "q") for p in prompts]


def positional_names(ps, cs, **kwargs):  # any names: the two come first, by position
    return [float(len(c) + len(p)) for p, c in zip(ps, cs)]


async def async_reward(prompts, completions, **kwargs):
    return [1.0 for _ in completions]


def positional_only(prompts, completions, /, **kwargs):  # the names, but not by keyword
    return [float(len(c) + len(p)) for p, c in zip(prompts, completions)]


@pytest.mark.parametrize("fn, expected", [
    (trl_style, [1.0, 2.0]), (trl_with_column, [1.0, 0.0]), (keyword_only, [1.0, 0.0]),
    (positional_names, [2.0, 3.0]), (async_reward, [1.0, 1.0]), (positional_only, [2.0, 3.0]),
])
def test_reward_signatures_as_trl_calls_them(fn, expected):
    """TRL passes prompts= and completions= by keyword and awaits async functions; gspo does the
    same wherever a function names those parameters, and passes them first otherwise."""
    for workers in (0, 1):
        with RewardRunner([fn], num_workers=workers) as r:
            assert r.score(["q", "r"], ["a", "bb"], {"answer": ["a", "x"]}).rewards.tolist() == expected


def test_math_verify_in_runner():
    with RewardRunner(["math_verify"], timeout_s=20.0) as r:
        res = r.score(["q"] * 2, ["\\boxed{1/2}", "\\boxed{2}"], {"answer": ["0.5", "3"]})
    assert res.rewards.tolist() == [1.0, 0.0]


def test_score_argument_errors(runner):
    with pytest.raises(ValueError, match=r"column 'answer' has 1 values \(for 2 completions\)"):
        runner.score(["p"] * 2, ["a", "b"], {"answer": ["x"]})
    with pytest.raises(RewardConfigError, match="on_error"):
        RewardRunner(["format"], on_error="ignore")


def huge(prompts, completions, **kwargs):
    return [1e39 if c == "b" else 1.0 for c in completions]


def huger(prompts, completions, **kwargs):
    return [1e300 if c == "b" else 1.0 for c in completions]


def test_a_finite_reward_beyond_float32_is_one_error_naming_it():
    """1e39 is finite (the contract's), but the rewards are float32: it would turn into inf and
    stop the run as bad input. It is a reward error naming the sample, the function and weight."""
    with RewardRunner([RewardSpec(huge, weight=2.0)], num_workers=0) as r:
        assert r.score(["p", "p"], ["a", "a"], {}).rewards.tolist() == [2.0, 2.0]
        with pytest.raises(RewardError, match=r"sample 1 is 2e\+39 \(huge 1e\+39 x 2\), beyond what float32 holds"):
            r.score(["p", "p"], ["a", "b"], {})
    # a weighted sum past float64's own range: inf before float32 (it was `group_advantages`' "bad input", exit 2)
    with RewardRunner([RewardSpec(huger, weight=1e10)], num_workers=0) as r:
        with pytest.raises(RewardError, match=r"sample 1 is inf \(huger 1e\+300 x 1e\+10\), beyond what float32"):
            r.score(["p", "p"], ["a", "b"], {})


def too_big_an_int(prompts, completions, **kwargs):
    return [10 ** 400 for _ in completions]


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_int_no_float_can_hold_is_a_bad_value_not_a_raise(on_error):
    """10**400 made gspo's own value check raise OverflowError, reported as the function raising
    (and, under skip, counted as a failure and dropped)."""
    with RewardRunner([RewardSpec(too_big_an_int)], num_workers=0, on_error=on_error) as r:
        with pytest.raises(RewardError, match=r"'too_big_an_int' returned 1000.* for sample 0; values must be finite"):
            r.score(["p", "p"], ["a", "b"], {})


def test_code_tests_options_under_a_users_name_and_call_arguments_in_kwargs_are_refused_at_start_up():
    """A partial of code_tests_reward with a bad option (bound, or in kwargs) failed at the first
    rollout, as did kwargs that set prompts or completions (given twice to every call)."""
    import functools

    from gspo.rewards import RewardConfigError, RewardSpec, validate_specs
    from gspo.rewards.sandbox import code_tests_reward

    bad_bound = functools.partial(code_tests_reward, timeout_s=0)
    with pytest.raises(RewardConfigError, match="option 'timeout_s'") as e:
        validate_specs([RewardSpec(name=bad_bound)])
    assert e.value.field == "kwargs"
    ok = functools.partial(code_tests_reward, executor=lambda code, cases, limits: None)
    with pytest.raises(RewardConfigError, match="option 'memory_mb'"):
        validate_specs([RewardSpec(name=ok, kwargs={"memory_mb": "lots"})])
    with pytest.raises(RewardConfigError, match="option 'timeout_s'"):
        validate_specs([RewardSpec(name="gspo.rewards.sandbox:code_tests_reward", kwargs={"timeout_s": -1})])
    assert validate_specs([RewardSpec(name=ok, kwargs={"timeout_s": 2})])[0][0]
    with pytest.raises(RewardConfigError, match="kwargs cannot set 'completions'") as e:
        validate_specs([RewardSpec(name="exact_answer", kwargs={"completions": []})])
    assert e.value.field == "kwargs"


def test_built_in_rewards_read_the_models_last_turn_not_a_tool_reply_or_the_environments_message():
    """An episode cut right after a tool's reply ended with that reply, and an environment's last
    message ended a finished game: exact_answer scored them as the model's answer (a calculator's
    '9716' earned 1.0 for a model that never answered)."""
    from gspo.rewards.builtins import exact_answer

    cut = [{"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'},
           {"role": "tool", "content": "9716"}]
    game = [{"role": "assistant", "content": "7"}, {"role": "user", "content": "wrong, it was 42"}]
    assert exact_answer(["p", "p"], [cut, game], answer=["9716", "wrong, it was 42"]) == [0.0, 0.0]
    assert exact_answer(["p"], [game], answer=["7"]) == [1.0]
