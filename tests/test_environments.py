"""Environments in tool episodes (rollout.environment): methods as tools with state across turns,
the reward they report, a failing or hung one, and a game answered through step."""

from __future__ import annotations

import time

import pytest

from gspo.models.tiny import build_char_tokenizer
from gspo.rollout.episodes import run_episodes
from gspo.rollout.tool_calls import parse_hermes
from gspo.rollout.tool_calls import ToolCall
from gspo.rollout.tools import ToolRunner
from test_tools import CHARS, Scripted, call


# ------------------------------------------------------------------ environments


class Counter:
    """An environment whose tool keeps state across turns; it reports how far it counted."""

    def reset(self, start: int = 0, **row) -> str:
        if start < 0:
            raise ValueError("negative start")
        self.n = start
        return f"count from {start}"

    def bump(self, by: int) -> str:
        """Add to the counter.

        Args:
            by: how much
        """
        self.n += by
        return str(self.n)

    def stall(self) -> str:
        """Never return when the count is 0."""
        if self.n == 0:
            time.sleep(60)
        return "fine"

    @property
    def reward(self) -> float:
        return float(self.n)


def _env_episode(turns, env, rows, *, workers=1, timeout=1.0, max_turns=4):
    tok = build_char_tokenizer(CHARS)
    gen = Scripted(tok, turns)
    with ToolRunner([], num_workers=workers, timeout_s=timeout, env_class=env) as runner:
        ro = run_episodes(gen, tok, [[{"role": "user", "content": "go"}] for _ in rows], 1, tools=[], runner=runner,
                          parser=parse_hermes, max_turns=max_turns, max_tokens=600, rows=rows)
    return tok, gen, ro


def test_an_environments_methods_are_tools_with_state_across_turns_and_its_reward_is_reported():
    tok, gen, ro = _env_episode([call("bump", by=2), call("bump", by=3), "done"], Counter, [{"start": 10}, {"start": 1}])
    assert [m["content"] for m in ro.turns[0] if m["role"] == "tool"] == ["12", "15"]  # state kept
    assert [m["content"] for m in ro.turns[1] if m["role"] == "tool"] == ["3", "6"]    # one instance an episode
    assert ro.env_reward == [15.0, 6.0] and ro.finish_reason == ["done", "done"]
    first = tok.decode(gen.contexts[0])  # reset's observation follows the prompt as a user message
    assert "user: go\nuser: count from 10\nassistant: " in first and "system: tools bump,stall" in first
    # ... and begins the episode's messages, which reward functions and the completions log get
    # (each episode's own: it was in neither)
    assert ro.turns[0][0] == {"role": "user", "content": "count from 10"} and ro.turns[1][0]["content"] == "count from 1"
    assert ro.episode_stats["episode/env_reward_error_mean"] == 0.0


class BadReward(Counter):
    reward = "lots"


def test_an_environment_reward_that_is_not_a_number_is_counted_and_said():
    """It became a missing reward without a word."""
    with pytest.warns(UserWarning, match=r"rollout.environment: BadReward's reward could not be read .*'lots'"):
        _, _, ro = _env_episode(["done"], BadReward, [{"start": 1}, {"start": 2}])
    assert ro.env_reward == [None, None] and ro.episode_stats["episode/env_reward_error_mean"] == 1.0


def test_a_failing_reset_or_a_hung_environment_fails_only_its_episode():
    _, _, ro = _env_episode(["done"], Counter, [{"start": -1}, {"start": 2}])
    assert ro.finish_reason == ["error", "done"] and ro.env_reward == [None, 2.0]
    assert ro.episode_stats["episode/finish_error"] == 0.5
    # episode 0's environment hangs: its worker is killed at the deadline, with the environment
    # of every episode it held (one worker here: both); both episodes end in error, no reward
    _, _, ro = _env_episode([call("stall"), "done"], Counter, [{"start": 0}, {"start": 5}], timeout=0.5)
    assert [m["content"] for m in ro.turns[0] if m["role"] == "tool"] == ["error: timed out after 0.5s"]
    assert [m["content"] for m in ro.turns[1] if m["role"] == "tool"] == ["error: the environment was lost"]
    assert ro.finish_reason == ["error", "error"] and ro.env_reward == [None, None]
    # with a worker each, the other episode's environment lives on
    _, _, ro = _env_episode([call("stall"), "done"], Counter, [{"start": 0}, {"start": 5}], workers=2, timeout=0.5)
    assert ro.finish_reason[0] == "error" and ro.env_reward[1] == 5.0


def test_a_game_without_tools_answers_each_turn_through_step():
    from gspo.tool_tasks import GuessNumber, guess

    tok, gen, ro = _env_episode(["8", "4", "6"], GuessNumber, [{"secret": 6, "top": 16}], max_turns=5)
    assert [m["content"] for m in ro.turns[0]] == ["8", "lower", "4", "higher", "6", "correct"]
    assert ro.finish_reason == ["done"] and ro.env_reward == [pytest.approx(0.8)]  # found on guess 3
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    between = enc("\nuser: lower\nassistant: ")
    assert ro.loss_mask[0].tolist()[:2 + len(between) + 2] == [1, 1] + [0] * len(between) + [1, 1]
    assert ro.model_lengths.tolist() == [6]  # three guesses and their EOS
    _, _, ro = _env_episode(["1", "2"], GuessNumber, [{"secret": 9, "top": 16}], max_turns=2)
    assert ro.finish_reason == ["max_turns"] and ro.env_reward == [0.0]
    assert guess(3, seed=0)[0].keys() >= {"prompt", "secret", "top"}


class Unreadable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


class Hostile:
    """An environment whose texts carry lone surrogates (a tool that decoded bytes with
    surrogateescape) and whose failures cannot describe themselves."""

    def reset(self, **row) -> str:
        self.steps = 0
        return "start \udce9"

    def echo(self, x: int) -> str:
        """Echo.

        Args:
            x: anything
        """
        return f"got {x} \ud800"

    def rude(self) -> str:
        """Raise an exception whose message cannot be read."""
        raise Unreadable()

    def step(self, messages):
        self.steps += 1
        return [{"role": "user", "content": "again \udfff"}], self.steps > 1


@pytest.mark.parametrize("workers", [0, 1])
def test_lone_surrogates_and_unreadable_exceptions_from_user_code_are_replies_not_a_crash(workers):
    """A lone surrogate reached the tokenizer, which raised TypeError and stopped the run; an
    exception whose str() raised killed the tool worker (or escaped the runner with no workers)."""
    tok, gen, ro = _env_episode([call("echo", x=1), call("rude"), "answer", "final"], Hostile, [{}], workers=workers)
    texts = [m["content"] for m in ro.turns[0]]
    for t in texts:
        t.encode("utf-8")  # every text the tokenizer saw is UTF-8
    tool = [m["content"] for m in ro.turns[0] if m["role"] == "tool"]
    assert tool[0] == "got 1 ?" and "Unreadable" in tool[1] and tool[1].startswith("error: ")
    assert "again ?" in texts and ro.finish_reason == ["done"]


class Flood:
    """Replies of 4 MB, from a tool method, the first observation and a step."""

    def reset(self, **row) -> str:
        return "o" * (4 << 20)

    def big(self) -> str:
        """Reply with a flood."""
        return "t" * (4 << 20)

    def step(self, messages):
        return [{"role": "user", "content": "s" * (4 << 20)}], True


@pytest.mark.parametrize("workers", [0, 1])
def test_a_flood_of_a_reply_is_cut_to_tool_reply_max_chars(workers):
    """A tool that returned 64 MB stalled a one-rollout run past 4 minutes (in the tokenizer)."""
    with ToolRunner([], num_workers=workers, env_class=Flood, max_reply_chars=100) as runner:
        (outcome, obs), = runner.reset([{}])
        reply = runner.run([ToolCall("big")], episode=0)[0]
        (_, (messages, done)), = runner.step([0], [[{"role": "assistant", "content": "x"}]])
    cut = f"\n[... {(4 << 20) - 100} characters cut]"
    assert obs == "o" * 100 + cut and reply.content == "t" * 100 + cut and reply.outcome == "ok"
    assert messages[0]["content"] == "s" * 100 + cut and done
