"""Multi-turn episodes with tool calls (gspo.rollout.tools, gspo.rollout.episodes): parsing,
the runner's outcomes on bad input, the masks and |y| of hand-built episodes, token identity
between sampler and learner across turns, and GSPO's ratio of 1 on the on-policy minibatch.
Through the commands (`gspo train`, `gspo eval`): tests/test_tools_cli.py."""

from __future__ import annotations

import dataclasses
import json
import string
import time

import pytest
import torch

from gspo import algo
from gspo.config import AlgoConfig
from gspo.models.logprobs import token_logprobs
from gspo.models.tiny import build_char_tokenizer, build_tiny_model
from gspo.rollout import Rollout
from gspo.rollout.hf import HFGenerator
from gspo.rollout.episodes import run_episodes
from gspo.rollout.tool_calls import ToolCall, ToolConfigError, parse_hermes, parse_llama3_json, resolve_parser
from gspo.rollout.tools import ToolRunner, load_tools, tool_schema

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def boom(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise ValueError(f"no {x}")


def sleepy(s: float) -> str:
    """Sleep.

    Args:
        s: seconds
    """
    time.sleep(s)
    return "awake"


def opaque() -> str:
    """Return something that is not text."""
    return object()  # type: ignore[return-value]


def undocumented(a):
    return a


TOOLS = [add, boom, sleepy, opaque]


def call(name, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


# ------------------------------------------------------------------ parsing and the runner


def test_hermes_calls_are_parsed_and_broken_ones_say_why():
    text = f"let me add {call('add', a=2, b=3)} and {call('add', a=1, b=1)}"
    assert parse_hermes(text) == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})]
    assert parse_hermes('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == \
        [ToolCall("add", {"a": 1})]  # arguments as a JSON string, as some templates write them
    assert parse_hermes("no call here") == []
    bad = parse_hermes("<tool_call>{oops</tool_call><tool_call>[1]</tool_call>"
                       '<tool_call>{"name": "add", "arguments": 3}</tool_call>')
    assert [c.error is not None for c in bad] == [True, True, True]
    assert "not JSON" in bad[0].error and "name" in bad[1].error and "object" in bad[2].error
    # a last call the model left open (it stopped before </tool_call>) is read, as vLLM reads it;
    # it was ignored, and the episode ended as if no call were made
    opened = f"{call('add', a=2, b=3)} then <tool_call>" + '{"name": "add", "arguments": {"a": 1, "b": 1}}'
    assert parse_hermes(opened) == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})]
    assert parse_hermes("<tool_call>{\"name\": \"ad")[0].error.startswith("not JSON")


def test_hermes_calls_drafted_inside_the_reasoning_are_not_calls():
    """Qwen3 thinks in <think> before it calls: a call drafted there is reasoning, as vLLM's
    reasoning parser splits it off before the tool parser reads (it used to be run)."""
    thought = f"<think>maybe {call('add', a=9, b=9)}? no.</think>\n\n{call('add', a=2, b=3)}"
    assert parse_hermes(thought) == [ToolCall("add", {"a": 2, "b": 3})]
    assert parse_hermes(f"{call('add', a=9, b=9)}</think>answer") == []  # the prompt opened <think> (DeepSeek-R1)
    assert parse_hermes(f"<think>I will {call('add', a=9, b=9)}") == []  # out of tokens while thinking
    assert parse_hermes(f"{call('add', a=1, b=1)} <think>then") == [ToolCall("add", {"a": 1, "b": 1})]
    assert parse_hermes("<think></think>" + call("add", a=1, b=2)) == [ToolCall("add", {"a": 1, "b": 2})]
    # a second block is reasoning too; a <think> inside a call's arguments, in a turn without reasoning, is text
    assert parse_hermes(f"<think>a</think>{call('add', a=1, b=1)}<think>{call('add', a=9, b=9)}</think>") == \
        [ToolCall("add", {"a": 1, "b": 1})]
    assert parse_hermes(call("echo", text="<think>")) == [ToolCall("echo", {"text": "<think>"})]


def test_llama3_json_calls_are_the_whole_turn_and_broken_ones_say_why():
    assert resolve_parser("llama3_json") is parse_llama3_json
    one = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
    assert parse_llama3_json(one) == [ToolCall("add", {"a": 2, "b": 3})]
    assert parse_llama3_json(f"<|python_tag|>{one}; " + '{"name": "add", "arguments": {"a": 1, "b": 1}}\n') == \
        [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1, "b": 1})]  # "arguments" too, ';' between
    assert parse_llama3_json("The answer is 5.") == [] and parse_llama3_json("") == []  # an answer: no call
    assert parse_llama3_json(f"I will call {one}") == []  # a call is the whole turn, as the template asks
    assert parse_llama3_json('{"answer": 5}') == []  # an answer written as JSON (it was a malformed call)
    assert parse_llama3_json('<|python_tag|>{"answer": 5}')[0].error is not None  # ... not after the python tag
    for text, why in [('{"name": "add", "parameters": {"a": 2', "not JSON"), ('{"parameters": {}}', "name"),
                      (f"{one} and then some words", "text after"), ('{"name": "add", "parameters": [1]}', "object")]:
        got = parse_llama3_json(text)
        assert got[-1].error is not None and why in got[-1].error, (text, got)
    assert parse_llama3_json(f"{one} trailing")[0] == ToolCall("add", {"a": 2, "b": 3})  # the call before is kept


def test_every_bad_call_gets_a_reply_and_an_outcome():
    with ToolRunner(TOOLS, timeout_s=1.0, num_workers=2) as runner:
        t0 = time.perf_counter()
        replies = runner.run([ToolCall("add", {"a": 2, "b": 3}), ToolCall("boom", {"x": 7}),
                              ToolCall("sleepy", {"s": 30}), ToolCall("opaque"), ToolCall("nope", {}),
                              ToolCall("", error="not JSON"), ToolCall("add", {"c": 1})])
        assert time.perf_counter() - t0 < 10  # the hung call was cut at its deadline
        got = [(r.outcome, r.content) for r in replies]
        assert got[0] == ("ok", "5")
        assert got[1] == ("error", "error: ValueError: no 7")
        assert got[2] == ("timeout", "error: timed out after 1s")
        assert got[3][0] == "bad_return" and "object" in got[3][1]
        assert got[4][0] == "unknown" and "'nope'" in got[4][1] and "add" in got[4][1]
        assert got[5] == ("malformed", "error: malformed tool call: not JSON")
        assert got[6][0] == "error" and "TypeError" in got[6][1]  # wrong arguments: the call raises
        # the worker killed at the deadline was replaced: the runner still works
        assert runner.run([ToolCall("sleepy", {"s": 0})])[0].content == "awake"


def test_tools_without_a_schema_are_refused_naming_the_field(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text("def undocumented(a):\n    return a\n\n"
                 "def add(a: int, b: int) -> int:\n    \"\"\"Add.\n\n    Args:\n        a: x\n        b: y\n    \"\"\"\n"
                 "    return a + b\n")
    assert [fn.__name__ for fn in load_tools([f"{f}:add"])] == ["add"]
    with pytest.raises(ToolConfigError, match=r"rollout.tools\[1\].*'undocumented'.*type hints"):
        load_tools([f"{f}:add", f"{f}:undocumented"])
    with pytest.raises(ToolConfigError, match=r"rollout.tools\[0\].*no attribute 'missing'"):
        load_tools([f"{f}:missing"])
    with pytest.raises(ToolConfigError, match="a second tool named 'add'"):
        load_tools([f"{f}:add", f"{f}:add"])
    assert tool_schema(add)["function"]["parameters"]["required"] == ["a", "b"]


# ------------------------------------------------------------------ hand-built episodes


class Scripted:
    """A generator whose turns are scripted text (each ends with EOS unless it says otherwise),
    with made-up log-probs, so that the episode's layout can be checked by hand."""

    def __init__(self, tok, turns: list[str], max_new_tokens: int = 200):
        self.tok, self.turns, self.max_new_tokens = tok, turns, max_new_tokens
        self.eos_token_ids, self.pad_token_id = [tok.eos_token_id], tok.pad_token_id
        self.end_id = tok.eos_token_id  # the EOS each scripted turn ends with
        self.model = torch.nn.Linear(1, 1)
        self.contexts: list[list[int]] = []
        self.turn = 0

    def generate_ids(self, rows, prompts, group_size=1, *, seed=None, offset=0, max_new_tokens=None):
        text = self.turns[self.turn]
        self.turn += 1
        self.contexts += [list(r) for r in rows]
        eos = not text.endswith("…")
        ids = self.tok(text.rstrip("…"), add_special_tokens=False)["input_ids"] + ([self.end_id] if eos else [])
        ids = ids[:max_new_tokens or self.max_new_tokens]
        n = len(rows)
        comp = torch.tensor([ids] * n)
        return Rollout(prompt_ids=torch.zeros(n, 1, dtype=torch.long), prompt_mask=torch.ones(n, 1, dtype=torch.long),
                       completion_ids=comp, completion_mask=torch.ones_like(comp),
                       sampler_logp=-torch.ones(comp.shape), finish_reason=["eos"] * n, group_size=1,
                       prompts=list(prompts), completions=[text] * n)


def _episode(turns, *, max_turns=4, max_tokens=400, tools=(add,), workers=0):
    tok = build_char_tokenizer(CHARS)
    gen = Scripted(tok, turns)
    with ToolRunner(list(tools), num_workers=workers) as runner:
        ro = run_episodes(gen, tok, [[{"role": "user", "content": "what is 2+3?"}]], 2, tools=list(tools),
                          runner=runner, parser=parse_hermes, max_turns=max_turns, max_tokens=max_tokens)
    return tok, gen, ro


def test_a_tool_episode_masks_the_tool_reply_and_counts_only_the_models_tokens():
    first, second = call("add", a=2, b=3), "5"
    tok, gen, ro = _episode([first, second])
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    # the tiny template: the tool message renders as "tool: 5\n", then "assistant: "; after the
    # model's EOS the template's own "\n" closes the assistant line
    inserted = enc("\ntool: 5\nassistant: ")
    turn1, turn2 = enc(first) + [tok.eos_token_id], enc(second) + [tok.eos_token_id]
    want = turn1 + inserted + turn2
    assert ro.completion_ids[0, :len(want)].tolist() == want and ro.completion_mask[0].sum() == len(want)
    assert ro.loss_mask[0, :len(want)].tolist() == [1] * len(turn1) + [0] * len(inserted) + [1] * len(turn2)
    assert ro.model_lengths.tolist() == [len(turn1) + len(turn2)] * 2  # |y| = the model's tokens only
    assert ro.sampler_logp[0, len(turn1):len(turn1) + len(inserted)].abs().sum() == 0
    # token in, token out: turn 2 continued exactly the ids of turn 1 and the reply
    assert gen.contexts[2] == ro.prompt_ids[0][ro.prompt_mask[0].bool()].tolist() + turn1 + inserted
    assert ro.finish_reason == ["done", "done"] and ro.completions == ["5", "5"]
    assert ro.turns[0] == [{"role": "assistant", "content": first}, {"role": "tool", "name": "add", "content": "5"},
                           {"role": "assistant", "content": "5"}]
    assert ro.episode_stats["episode/tool_calls_mean"] == 1 and ro.episode_stats["episode/tool_ok_mean"] == 1
    assert ro.episode_stats["episode/finish_done"] == 1 and ro.episode_stats["episode/turns_mean"] == 2


def test_an_episode_that_keeps_calling_ends_at_max_turns_and_one_out_of_budget_at_length():
    c = call("add", a=1, b=1)
    _, _, ro = _episode([c, c, c], max_turns=2)
    assert ro.finish_reason == ["max_turns"] * 2 and ro.episode_stats["episode/tool_calls_mean"] == 1  # last not run
    _, _, ro = _episode([c, c], max_tokens=len(c) + 3)  # room for turn 1, not for the reply and turn 2
    assert ro.finish_reason == ["length"] * 2 and int(ro.completion_mask[0].sum()) <= len(c) + 3
    _, _, ro = _episode(["unfinished…"])  # a turn cut by max_new_tokens without EOS
    assert ro.finish_reason == ["length"] * 2


def test_bad_calls_reach_the_model_as_error_replies_and_are_counted():
    _, _, ro = _episode(["<tool_call>{oops</tool_call>", call("nope"), call("boom", x=1), "done"],
                        tools=(add, boom), max_turns=4, workers=1)
    replies = [m["content"] for m in ro.turns[0] if m["role"] == "tool"]
    assert replies[0].startswith("error: malformed tool call") and "unknown tool 'nope'" in replies[1]
    assert replies[2] == "error: ValueError: no 1"
    s = ro.episode_stats
    assert (s["episode/tool_malformed_mean"], s["episode/tool_unknown_mean"], s["episode/tool_error_mean"]) == (1, 1, 1)
    assert ro.finish_reason == ["done", "done"]


def test_a_parser_that_raises_on_a_turn_makes_it_a_malformed_call_and_one_that_returns_junk_stops():
    """The model's text made the user's parser raise: a malformed call, answered and counted, the
    episode goes on. A parser returning anything but ToolCalls is a bug: one error naming the
    field, which stops the run as a failed reward function does (exit status 1, not 2: it comes
    mid-run, with the state saved)."""
    from gspo.rollout.tool_calls import ToolParserError

    def picky(text):
        if "oops" in text:
            raise KeyError("name")
        return parse_hermes(text)

    tok = build_char_tokenizer(CHARS)
    with ToolRunner([add], num_workers=0) as runner:
        ro = run_episodes(Scripted(tok, ["oops", call("add", a=2, b=3), "5"]), tok,
                          [[{"role": "user", "content": "what is 2+3?"}]], 1, tools=[add], runner=runner, parser=picky,
                          max_turns=4, max_tokens=400)
        replies = [m["content"] for m in ro.turns[0] if m["role"] == "tool"]
        assert replies == ["error: malformed tool call: the tool parser could not read this turn (KeyError: 'name')",
                           "5"]
        assert ro.episode_stats["episode/tool_malformed_mean"] == 1 and ro.finish_reason == ["done"]
        with pytest.raises(ToolParserError, match="'rollout.tool_parser': the parser returned .*not a list of"):
            run_episodes(Scripted(tok, [call("add", a=1, b=1)]), tok, [[{"role": "user", "content": "hi"}]], 1,
                         tools=[add], runner=runner, parser=lambda text: [{"name": "add"}], max_turns=4,
                         max_tokens=400)


def test_the_text_after_a_turn_follows_the_eos_the_model_sampled_of_several():
    """A checkpoint may list several EOS ids (Gemma: <eos>, <end_of_turn>); the template's text
    after a turn is found after the one the model wrote, not after the list's first."""
    tok = build_char_tokenizer(CHARS)
    gen = Scripted(tok, [call("add", a=2, b=3), "5"])
    gen.eos_token_ids = [tok.bos_token_id, tok.eos_token_id]  # the model samples the second
    with ToolRunner([add], num_workers=0) as runner:
        ro = run_episodes(gen, tok, [[{"role": "user", "content": "what is 2+3?"}]], 1, tools=[add], runner=runner,
                          parser=parse_hermes, max_turns=4, max_tokens=400)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    turn1 = enc(call("add", a=2, b=3)) + [tok.eos_token_id]
    want = turn1 + enc("\ntool: 5\nassistant: ")  # the template's "\n" after the turn's EOS included
    assert ro.completion_ids[0, :len(want)].tolist() == want


def test_a_turn_ended_by_an_eos_the_template_does_not_write_is_closed_where_the_template_closes_it():
    """Qwen3 lists <|im_end|> and <|endoftext|>; its template closes a turn with <|im_end|> only.
    A turn the model ended with the other EOS still gets the template's text after the turn."""
    tok = build_char_tokenizer(CHARS)
    gen = Scripted(tok, [call("add", a=2, b=3), "5"])
    gen.eos_token_ids = [tok.eos_token_id, tok.bos_token_id]
    gen.end_id = tok.bos_token_id  # sampled, and never written by the template
    with ToolRunner([add], num_workers=0) as runner:
        ro = run_episodes(gen, tok, [[{"role": "user", "content": "what is 2+3?"}]], 1, tools=[add], runner=runner,
                          parser=parse_hermes, max_turns=4, max_tokens=400)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    want = enc(call("add", a=2, b=3)) + [tok.bos_token_id] + enc("\ntool: 5\nassistant: ")
    assert ro.finish_reason == ["done"] and ro.completion_ids[0, :len(want)].tolist() == want


# ------------------------------------------------------------------ a real model across turns


class ForcedFirstTurn(HFGenerator):
    """The tiny random model, made to write a tool call in its first turn (teacher-forced, with
    the model's own log-probs of those tokens), then sampling freely after the tool's reply."""

    def __init__(self, model, tok, first: str, **kw):
        super().__init__(model, tok, **kw)
        self.first, self.turn = first, 0

    def generate_ids(self, rows, prompts, group_size=1, *, seed=None, offset=0, max_new_tokens=None):
        self.turn += 1
        if self.turn > 1:
            return super().generate_ids(rows, prompts, group_size, seed=seed, offset=offset,
                                        max_new_tokens=max_new_tokens)
        forced = self.tokenizer(self.first, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        n, p = len(rows), len(rows[0])
        ids = torch.tensor([list(r) + forced for r in rows])
        with torch.no_grad():
            lp = token_logprobs(self.model, ids, torch.ones_like(ids), len(forced), temperature=self.temperature)
        comp = torch.tensor([forced] * n)
        return Rollout(prompt_ids=ids[:, :p], prompt_mask=torch.ones(n, p, dtype=torch.long), completion_ids=comp,
                       completion_mask=torch.ones_like(comp), sampler_logp=lp, finish_reason=["eos"] * n,
                       group_size=1, prompts=list(prompts), completions=[self.first] * n)


def test_the_learner_sees_the_samplers_tokens_and_gspo_ratio_is_one_on_policy():
    tok = build_char_tokenizer(CHARS)
    model = build_tiny_model(tok, hidden_size=32, num_layers=1, max_position_embeddings=256).eval()
    gen = ForcedFirstTurn(model, tok, call("add", a=2, b=3), max_new_tokens=12, temperature=1.0)
    with ToolRunner([add], num_workers=0) as runner:
        ro = run_episodes(gen, tok, [[{"role": "user", "content": "2+3?"}]] * 2, 2, tools=[add], runner=runner,
                          parser=parse_hermes, max_turns=2, max_tokens=200, seed=3)
    assert all(len(t) >= 3 for t in ro.turns)  # call, reply, a sampled second turn
    ids, mask, T = ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1]
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, T, temperature=1.0)
    model_tok = ro.model_mask.bool()
    second = model_tok.clone()
    second[:, :len(tok(call("add", a=2, b=3))["input_ids"]) + 1] = False  # the sampled turn, after the reply
    assert second.any()
    # the learner's log-probs of the model's tokens are the sampler's, in turn 2 as in turn 1
    torch.testing.assert_close(lp[model_tok], ro.sampler_logp[model_tok], rtol=0, atol=2e-5)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    loss, m = algo.policy_loss(lp, ro.sampler_logp, adv, ro.model_mask, level="sequence", eps_low=3e-4,
                               eps_high=4e-4, aggregation="seq-mean-token-mean", max_log_ratio=AlgoConfig.max_log_ratio)
    assert m["ratio/seq_min"] == pytest.approx(1.0, abs=1e-5) and m["ratio/seq_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["clip/seq_frac"] == 0.0
    # with the tool's tokens in |y| (completion_mask), the ratio is no longer 1: they have no
    # sampler log-prob. The test of the mask is that this differs.
    _, leaked = algo.policy_loss(lp, ro.sampler_logp, adv, ro.completion_mask, level="sequence", eps_low=3e-4,
                                 eps_high=4e-4, aggregation="seq-mean-token-mean", max_log_ratio=AlgoConfig.max_log_ratio)
    assert leaked["ratio/seq_max"] > 1.01 or leaked["ratio/seq_min"] < 0.99


def test_length_metrics_count_only_the_models_tokens():
    from gspo.train.distributed import Dist
    from gspo.train.step_metrics import rollout_metrics

    _, _, ro = _episode([call("add", a=2, b=3), "5"])
    rewards = dataclasses.make_dataclass("R", ["rewards", "stats"])(torch.tensor([1.0, 0.0]), {})
    m = rollout_metrics(Dist(), ro, rewards, {})
    assert m["completion/len_mean"] == float(ro.model_lengths[0]) < float(ro.completion_lengths[0])
    assert m["episode/tool_calls_mean"] == 1.0


def test_calc_evaluates_arithmetic_and_nothing_else():
    from gspo.tool_tasks import calc

    assert calc("347*28") == "9716" and calc("(2+3)*4 - 6/3") == "18" and calc("7/2") == "3.5"
    for bad in ("__import__('os')", "2**99999", "a+1", "[1]"):
        with pytest.raises((ValueError, SyntaxError)):
            calc(bad)


def test_a_parser_that_breaks_mid_run_stops_it_with_the_status_of_a_stated_reason(monkeypatch, capsys):
    """Exit status 2 means bad input found before any compute; this comes mid-run, after the
    state was saved: 1, as for a reward function that raises."""
    from gspo import cli
    from gspo.rollout.tool_calls import ToolParserError

    def breaks(args):
        raise ToolParserError("config field 'rollout.tool_parser': the parser returned None")

    monkeypatch.setattr(cli, "cmd_train", breaks)
    assert cli.main(["train"]) == 1
    assert "stopped: config field 'rollout.tool_parser'" in capsys.readouterr().err


def test_an_episodes_turns_reach_rewards_without_special_tokens_as_a_single_turn_does():
    """Special tokens the model writes mid-turn (Llama 3's <|python_tag|>, a stray header) were
    in the assistant content rewards read; a single-turn completion's text has none."""
    tok = build_char_tokenizer(CHARS)
    tok.add_special_tokens({"additional_special_tokens": ["<|x|>"]})
    gen = Scripted(tok, ["4<|x|>2"])
    with ToolRunner([add], num_workers=0) as runner:
        ro = run_episodes(gen, tok, [[{"role": "user", "content": "what is 40+2?"}]], 1, tools=[add],
                          runner=runner, parser=parse_hermes, max_turns=2, max_tokens=100)
    assert ro.completions == ["42"] and ro.turns[0] == [{"role": "assistant", "content": "42"}]


def squares(n: int) -> str:
    """The squares of 0..n-1, worked out by a process pool.

    Args:
        n: how many
    """
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(2) as pool:
        return str(pool.map(abs, [i * i for i in range(n)]))


def test_a_tool_may_start_a_process_pool():
    """Tool workers were daemonic, and a daemonic process may not have children: a tool that
    used a Pool failed with 'daemonic processes are not allowed to have children'."""
    with ToolRunner([squares], num_workers=1, timeout_s=60) as runner:
        (reply,) = runner.run([ToolCall("squares", {"n": 4})])
    assert (reply.outcome, reply.content) == ("ok", "[0, 1, 4, 9]")


def test_a_tool_replies_numpy_and_fraction_numbers_as_json_numbers():
    """A tool returning np.int64 killed its worker (json.dumps raised in it), and in-process it
    ended the run; a Fraction likewise."""
    import fractions

    import numpy as np

    from gspo.rollout.tools import reply_text

    assert [reply_text(v) for v in (np.int64(3), np.float32(0.5), fractions.Fraction(1, 4), True, [1, 2])] == \
        ["3", "0.5", "0.25", "true", "[1, 2]"]
    assert reply_text(object()) is None and reply_text([object()]) is None  # bad_return


def test_async_tools_and_a_tool_named_as_an_environments_method_are_refused_at_start_up(tmp_path):
    """An async def tool passed start-up and every call replied 'the tool returned coroutine'; a
    tool named like an environment's method never ran (the method took its calls)."""
    from gspo.config import ConfigError, load_config
    from gspo.train.run import load_episode_tools

    (tmp_path / "t.py").write_text(
        'async def aadd(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: one\n        b: two\n    """\n'
        "    return a + b\n\n\n"
        'def bump(n: int) -> int:\n    """Bump.\n\n    Args:\n        n: a number\n    """\n    return n + 1\n\n\n'
        "class Env:\n    def reset(self, **row):\n        return None\n\n"
        '    def bump(self, n: int) -> int:\n        """Bump.\n\n        Args:\n            n: a number\n        """\n'
        "        return n + 2\n")
    with pytest.raises(ToolConfigError, match=r"rollout.tools\[0\]: .*async or generator function"):
        load_tools([f"{tmp_path / 't.py'}:aadd"])
    cfg = load_config(None, [f"rollout.tools=[{tmp_path / 't.py'}:bump]", f"rollout.environment={tmp_path / 't.py'}:Env"])
    with pytest.raises(ConfigError, match=r"rollout.tools\[0\]': 'bump' is also a method of rollout.environment"):
        load_episode_tools(cfg)


def test_one_turn_with_tools_is_warned_about(capsys):
    """With rollout.max_turns=1 no call is ever run (a last turn's calls are not): it started silently."""
    from gspo.config import load_config
    from gspo.train.run import load_episode_tools

    load_episode_tools(load_config(None, ["rollout.tools=[gspo.tool_tasks:calc]", "rollout.max_turns=1"]))
    assert "rollout.max_turns=1 with rollout.tools: no call is ever run" in capsys.readouterr().err
    load_episode_tools(load_config(None, ["rollout.tools=[gspo.tool_tasks:calc]", "rollout.max_turns=2"]))
    assert "max_turns" not in capsys.readouterr().err
