"""Held-out evaluation on the user's path: over-long held-out prompts counted, `gspo eval` reading
the data it is given (data.eval_split, a run's config), and its accuracy over prompts with a reward."""

from __future__ import annotations

import json

from artifacts import plain_rows, write_jsonl, write_plain_jsonl
from gspo.cli import main
from test_user_path import RECORDER, SMALL, _columns_seen, train


def test_held_out_prompts_too_long_are_counted_and_an_eval_source_without_answers_is_refused(tmp_path, saved, capsys):
    model = saved("qwen3")
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "1+1=" * 200, "answer": "2"}] * 2)
    train(tmp_path, model, f"data.source={write_plain_jsonl(tmp_path / 'train.jsonl', n=8)}",
          f"data.eval_source={held}", "data.max_prompt_tokens=64", name="long")
    err = capsys.readouterr().err
    assert f"dropped 2 held-out prompts (data.eval_source {held}) longer than 64 tokens" in err
    assert "every prompt of data.eval_source" in err and "has no held-out split" not in err
    no_answer = write_jsonl(tmp_path / "held_blank.jsonl", [{"prompt": "1+1=", "answer": ""}] * 2)
    rc = main(["train", f"model.name_or_path={model}", *SMALL, f"output.dir={tmp_path}", "output.name=blank",
               f"data.source={tmp_path / 'train.jsonl'}", f"data.eval_source={no_answer}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"data.eval_source {no_answer} has, but with every cell empty" in err and "rewards.functions[0].name" in err


def test_gspo_eval_reads_the_dataset_it_is_given_with_data_eval_split(tmp_path, saved, monkeypatch):
    """It read DATA with data.split, so a DatasetDict given on the command line was evaluated on
    its train split whatever data.eval_split said; unset, held-out data takes its test split."""
    import datasets

    rows = {split: [dict(r, tag=split) for r in plain_rows(4)] for split in ("train", "test")}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in rows.items()}).save_to_disk(str(tmp_path / "dd"))
    (tmp_path / "rec.py").write_text(RECORDER)
    cols = tmp_path / "cols.jsonl"
    monkeypatch.setenv("GSPO_TEST_COLUMNS", str(cols))
    reward = f'rewards.functions=[{{name: "{tmp_path / "rec.py"}:record"}}]'
    for extra, tag in (([], "test"), (["data.eval_split=train"], "train"), (["data.eval_split=test"], "test")):
        assert main(["eval", str(saved("qwen3")), str(tmp_path / "dd"), "--num-prompts", "2", reward, *extra]) == 0
        assert _columns_seen(cols)[-1]["tag"] == [tag, tag]


def test_gspo_eval_with_a_runs_config_says_when_it_evaluates_on_the_training_rows(tmp_path, saved, capsys):
    """A run on one file has no held-out data; `gspo eval FINAL --config RUN/config.yaml` used that
    file's rows as "held-out" ones without a word."""
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    (tmp_path / "run.yaml").write_text(f"model: {{name_or_path: {saved('qwen3')}}}\ndata: {{source: {data}}}\n")
    capsys.readouterr()
    assert main(["eval", str(saved("qwen3")), "--config", str(tmp_path / "run.yaml"), "--num-prompts", "2"]) == 0
    assert "so this evaluates on the rows training reads" in capsys.readouterr().err
    assert main(["eval", str(saved("qwen3")), str(data), "rewards.functions=[{name: exact_answer, weight: 1e40}]"]) == 2
    assert "config field 'rewards.functions[0].weight'" in capsys.readouterr().err  # as gspo train names it
    hub = tmp_path / "hub" / "data"  # a run that trained on a folder's test split holds nothing out either
    hub.mkdir(parents=True)
    write_jsonl(hub / "test-00000-of-00001.jsonl", [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(4)])
    (tmp_path / "split.yaml").write_text(f"model: {{name_or_path: {saved('qwen3')}}}\n"
                                         f"data: {{source: {hub.parent}, split: test}}\n")
    assert main(["eval", str(saved("qwen3")), "--config", str(tmp_path / "split.yaml"), "--num-prompts", "2"]) == 0
    assert "so this evaluates on the rows training reads" in capsys.readouterr().err


def test_evaluation_accuracy_is_over_the_prompts_that_got_a_reward(tmp_path, saved, capsys):
    """A prompt without an answer has no reward: it counted as wrong, capping accuracy at the
    share of prompts that had one."""
    data = write_jsonl(tmp_path / "half.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1) if i % 2 else ""}
                                                 for i in range(4)])
    (tmp_path / "some.py").write_text("def some(prompts, completions, answer, **kw):\n"
                                      "    return [1.0 if a else None for a in answer]\n")
    capsys.readouterr()
    assert main(["eval", str(saved("qwen3")), str(data), "--num-prompts", "4",
                 f"rewards.functions=[{{name: '{tmp_path / 'some.py'}:some'}}]"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["eval/accuracy"] == 1.0 and m["eval/missing_frac"] == 0.5 and m["eval/num_prompts"] == 4
    (tmp_path / "every.py").write_text("def every(prompts, completions, **kw):\n    return [0.5] * len(completions)\n")
    assert main(["eval", str(saved("qwen3")), str(data), "--num-prompts", "4",
                 f"rewards.functions=[{{name: '{tmp_path / 'some.py'}:some'}}, "
                 f"{{name: '{tmp_path / 'every.py'}:every'}}]"]) == 0
    m = json.loads(capsys.readouterr().out)  # every prompt has a reward (TRL's nansum): none is missing
    assert m["eval/accuracy"] == 1.0 and m["eval/missing_frac"] == 0.0 and m["eval/reward_mean"] == 1.0


def test_gspo_eval_with_no_reward_at_all_prints_json_nulls_and_a_warning(tmp_path, saved, capsys):
    """It printed bare NaN (not JSON: jq and strict parsers refuse it) and said nothing."""
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"{i}+1=", "answer": ""} for i in range(2)])
    (tmp_path / "none.py").write_text("def none(prompts, completions, **kw):\n    return [None] * len(completions)\n")
    capsys.readouterr()
    assert main(["eval", str(saved("qwen3")), str(data), "--num-prompts", "2",
                 f"rewards.functions=[{{name: '{tmp_path / 'none.py'}:none'}}]"]) == 0
    out = capsys.readouterr()

    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")

    m = json.loads(out.out, parse_constant=refuse)
    assert m["eval/accuracy"] is None and m["eval/missing_frac"] == 1.0 and "no prompt got a reward" in out.err
    (tmp_path / "boom.py").write_text("def boom(prompts, completions, **kw):\n    raise RuntimeError('down')\n")
    assert main(["eval", str(saved("qwen3")), str(data), "--num-prompts", "2", "rewards.on_error=skip",
                 f"rewards.functions=[{{name: '{tmp_path / 'boom.py'}:boom'}}]"]) == 0
    out = capsys.readouterr()  # it said the functions returned None
    assert "the reward functions failed on 2 of them (rewards.on_error=skip)" in out.err
    assert json.loads(out.out)["eval/reward_failures"] == 2
