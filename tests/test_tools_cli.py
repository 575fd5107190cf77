"""Multi-turn tool episodes through the commands, as a user runs them: `gspo train` from a saved
checkpoint (resumed exactly; async mode at staleness 0 trains what sync mode trains), `gspo eval`
with the run's tool settings, bad tool settings refused before any compute, and
examples/tools/calculator.py end to end; also the console's warning of a `gspo train` whose
groups have no signal. The pieces, in process: tests/test_tools.py."""

from __future__ import annotations

import json

import pytest
import torch

from gspo.models.tiny import build_char_tokenizer, build_tiny_model
from gspo.rollout.tools import tool_schema


# ------------------------------------------------------------------ the CLI's path


def _tool_model(path, hidden: int = 32):
    """A tiny model, warmed up a little to write tool calls (often malformed at this stage:
    every outcome then reaches the model), saved as a user's checkpoint is."""
    from script_module import load_script

    from gspo.tool_tasks import calc, multiply

    ex = load_script("examples/tools/calculator.py", "calculator_example")
    tok = build_char_tokenizer(ex.CHARS)
    model = build_tiny_model(tok, hidden_size=hidden, num_layers=1, seed=0, max_position_embeddings=320)
    ex.warm_up(model, tok, multiply(200, seed=0), [tool_schema(calc)], steps=50, tool_frac=1.0, seed=0, batch=16,
               lr=1e-2)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


TOOL_RUN = ["data.source=multiply", "rollout.tools=[gspo.tool_tasks:calc]", "rollout.max_new_tokens=80",
            "rollout.max_turns=2", "rollout.temperature=1.0", "rewards.functions=[{name: exact_answer}]",
            "rewards.on_error=skip", "eval.num_prompts=4", "eval.every=2"]


def test_gspo_train_runs_tool_episodes_from_a_saved_checkpoint_and_resumes_exactly(tmp_path):
    from test_resume import assert_same_run, gspo_train, metrics_without_timings

    model = _tool_model(tmp_path / "model")
    run = [f"model.name_or_path={model}", *TOOL_RUN, "schedule.rollouts=3"]
    gspo_train(tmp_path, "whole", *run)
    recs = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "episode/turns_mean" in r]
    assert steps and max(r["episode/turns_mean"] for r in steps) > 1  # the tools answered, the model went on
    assert all("eval/tool_call_frac" in r for r in recs if "eval/accuracy" in r)
    completions = (tmp_path / "whole" / "completions").glob("*.jsonl")
    assert any("tool_call" in p.read_text() for p in completions)
    # `gspo eval` of final/ with the run's tool settings (given after a --flag) plays episodes too
    from zygote import gspo

    ev = gspo(["eval", tmp_path / "whole" / "final", "multiply", "--num-prompts", "4",
               *[x for x in TOOL_RUN if x.startswith(("rollout.", "rewards."))]], timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]
    m = json.loads(ev.stdout)
    assert m["eval/num_prompts"] == 4 and 0 <= m["eval/tool_call_frac"] <= 1 and m["eval/turns_mean"] >= 1
    # killed after rollout 2, resumed: the same run, episodes and all
    p = gspo_train(tmp_path, "cut", *run, faults="exit_after_rollout=2", check=False)
    assert p.returncode != 0
    gspo_train(tmp_path, "cut", *run, "resume=auto")
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    assert metrics_without_timings(tmp_path / "whole") == metrics_without_timings(tmp_path / "cut")


@pytest.mark.parametrize("extra,field", [
    (["rollout.tools=[gspo.tool_tasks:nope]"], "rollout.tools[0]"),
    (["rollout.environment=gspo.tool_tasks:calc"], "rollout.environment"),
    (["rollout.tools=[gspo.tool_tasks:calc]", "rollout.tool_parser=nowhere:parse"], "rollout.tool_parser"),
    (["rollout.max_turns=0"], "rollout.max_turns"),
])
def test_bad_tool_settings_fail_before_any_compute_naming_the_field(tmp_path, extra, field):
    from test_resume import gspo_train

    p = gspo_train(tmp_path, "bad", "data.source=multiply", *extra, check=False)
    assert p.returncode != 0 and field in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_async_mode_plays_the_episodes_on_its_generator_and_at_k0_trains_what_sync_trains(tmp_path):
    from test_resume import final_state, gspo_train, metrics_without_timings

    model = _tool_model(tmp_path / "model")
    run = [f"model.name_or_path={model}", *TOOL_RUN, "schedule.rollouts=2", "rollout.old_logp=trainer"]
    gspo_train(tmp_path, "sync", *run)
    gspo_train(tmp_path, "async", *run, "rollout.mode=async", "rollout.max_staleness=0")
    (ms, _), (ma, _) = final_state(tmp_path / "sync"), final_state(tmp_path / "async")
    assert ms.keys() == ma.keys() and all(torch.equal(ms[k], ma[k]) for k in ms)  # bitwise
    strip = lambda recs: [{k: v for k, v in r.items() if not k.startswith("async/")} for r in recs]  # noqa: E731
    sync, asyn = strip(metrics_without_timings(tmp_path / "sync")), strip(metrics_without_timings(tmp_path / "async"))
    assert sync == asyn and max(r.get("episode/turns_mean", 0) for r in sync) > 1


def test_the_calculator_example_quick(tmp_path):
    """examples/tools/calculator.py end to end at its smallest: warm-up, save, GSPO, the table."""
    from script_module import load_script

    results = load_script("examples/tools/calculator.py", "calculator_example").main(["--quick", "--out", str(tmp_path)])
    assert len(results) == 1 and {"accuracy_before", "accuracy_after", "tool_call_before", "tool_call_after"} <= \
        results[0].keys()
    assert "tool-call rate" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "seed0" / "final" / "config.json").exists()


def test_a_run_without_signal_says_so_at_most_once_every_n_rollouts(tmp_path):
    """Every group's rewards equal (exact_answer on a random model: all 0): the console says
    so on stderr, with what to change, at most once in logging.no_signal_every rollouts."""
    from test_resume import gspo_train

    p = gspo_train(tmp_path, "flat", "rewards.functions=[{name: exact_answer}]", "schedule.rollouts=4",
                   "logging.no_signal_every=2", "eval.enabled=false")
    lines = [ln for ln in p.stderr.splitlines() if "every group's rewards were equal" in ln]
    assert [ln.split(":")[0] for ln in lines] == ["rollout 1", "rollout 3"], p.stderr[-2000:]
    assert "rewards.functions" in lines[0] and "rollout.group_size" in lines[0] and "(2 of the last 2" in lines[1]
    quiet = gspo_train(tmp_path, "signal", "schedule.rollouts=2", "eval.enabled=false")  # count_ones: signal
    assert "rewards were equal" not in quiet.stderr


def test_gspo_eval_refuses_a_template_that_cannot_play_tool_episodes_as_training_does(tmp_path, capsys):
    """gspo train refused a template that drops role 'tool'; gspo eval played the episodes with
    it, every reply hidden from the model."""
    from gspo.cli import main

    path = tmp_path / "no-tool-turns"
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789*+=: \n{}\"<>/_,")
    build_tiny_model(tok, hidden_size=16, num_layers=1, seed=0).save_pretrained(path)
    tok.chat_template = ("{% for m in messages %}{% if m.role != 'tool' %}{{ m.role }}: {{ m.content }}{{ '\\n' }}"
                         "{% endif %}{% endfor %}")
    tok.save_pretrained(path)
    rc = main(["eval", str(path), "multiply", "--num-prompts", "1", "rollout.tools=[gspo.tool_tasks:calc]"])
    assert rc == 2 and "drops messages of role 'tool'" in capsys.readouterr().err
