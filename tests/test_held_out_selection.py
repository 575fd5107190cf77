"""Which held-out prompts evaluation takes on a saved checkpoint (the first eval.num_prompts that
fit, under a learned position table too), the columns its reward calls get, and rows named."""

from __future__ import annotations

import json

import pytest

import artifacts
from gspo.cli import main
from test_saved_artifacts import RUN, records, train


def test_held_out_prompts_are_taken_from_those_that_fit(saved, tmp_path, capsys):
    """eval.num_prompts was cut from the held-out rows before the over-long ones were dropped:
    4 long rows then 4 short ones left no held-out prompt at all ("every prompt ... is too long")."""
    rows = [{"prompt": "9" * 60 + f"+{i}=", "answer": "0"} for i in range(4)] + \
        [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
    held = artifacts.write_jsonl(tmp_path / "held.jsonl", rows)
    data = artifacts.write_plain_jsonl(tmp_path / "train.jsonl")
    run = train(saved("qwen3"), tmp_path, f"data.source={data}", f"data.eval_source={held}",
                "data.max_prompt_tokens=50")
    evals = [r for r in records(run) if "eval/num_prompts" in r or "eval/accuracy" in r]
    assert evals and "no held-out prompts" not in capsys.readouterr().err
    capsys.readouterr()
    assert main(["eval", str(run / "final"), str(held), "--num-prompts", "4", "data.max_prompt_tokens=50"]) == 0
    assert json.loads(capsys.readouterr().out)["eval/num_prompts"] == 4


def test_evaluation_reward_calls_get_the_held_out_datas_columns(saved, tmp_path, capsys):
    """Evaluation called the reward with the columns of the first eval.num_prompts rows: one
    needing a column only later rows have raised at the first evaluation, and in gspo eval."""
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), **({"a": 1} if i < 8 else {"b": 2})} for i in range(16)]
    held = artifacts.write_jsonl(tmp_path / "held.jsonl", rows)
    (tmp_path / "needb.py").write_text("def needb(completions, b, **kw):\n    return [0.0 if v is None else 1.0 for v in b]\n")
    reward = f"rewards.functions=[{tmp_path / 'needb.py'}:needb]"
    run = tmp_path / "x"
    assert main(["train", f"model.name_or_path={saved('qwen3')}", f"data.source={held}", f"data.eval_source={held}",
                 *RUN, "eval.num_prompts=3", reward, f"output.dir={tmp_path}", "output.name=x"]) == 0
    assert any("eval/accuracy" in r for r in records(run))
    assert main(["eval", str(run / "final"), str(held), "--num-prompts", "3", reward]) == 0


def test_held_out_prompts_under_learned_positions_are_the_first_that_fit(saved, tmp_path, capsys):
    """The second pass (a learned position table's cap) filtered the rows the first pass had
    already cut to eval.num_prompts: 1 of the 5 asked for, though 6 fit."""
    rows = [{"prompt": "9" * 300 + f"+{i}=", "answer": "0"} for i in range(4)] + \
        [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)]
    held = artifacts.write_jsonl(tmp_path / "held.jsonl", rows)
    data = artifacts.write_plain_jsonl(tmp_path / "train.jsonl")
    run = train(saved("gpt2"), tmp_path, f"data.source={data}", f"data.eval_source={held}", "eval.num_prompts=5")
    assert "fewer than eval.num_prompts" not in capsys.readouterr().err
    assert main(["eval", str(run / "final"), str(held), "--num-prompts", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["eval/num_prompts"] == 5


def test_a_row_that_cannot_be_rendered_is_named_by_its_row_in_the_data():
    """Taken a few at a time, the rows were numbered within each chunk."""
    from gspo.train.prompts import first_fitting

    tok = artifacts.build_tokenizer("gpt2")  # no chat template
    rows = [{"prompt": "9" * 50}] * 3 + [{"prompt": [{"role": "user", "content": "hi"}]}]
    with pytest.raises(Exception, match=r"held\.jsonl: row 3: "):
        first_fitting(rows, 1, tok, 10, None, source="held.jsonl")
