"""What a TRL user brings: reward functions in TRL's signatures, a reward that reads the prompt
column by its own name, and GRPOConfig's names for settings. Each test here failed before the
fix it guards."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.config import ConfigError, field_docs, load_config
from gspo.config.trl_names import TRL_NAMES
from gspo.rewards.runner import RewardRunner

ROOT = Path(__file__).parents[1]
TINY = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=64", "rollout.prompts_per_step=4",
        "rollout.group_size=4", "rollout.max_new_tokens=4", "schedule.rollouts=1", "schedule.num_minibatches=1",
        "eval.enabled=false", "logging.console=false"]


def train(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    return main(["train", *TINY, f"output.dir={tmp_path}", "output.name=run", *extra]), tmp_path / "run"


# ------------------------------------------------------------------------ reward signatures


def keywords_only(**kwargs):  # all by keyword, as TRL passes them
    return [len(c) + (p == "q") + 10 * (a == c) for p, c, a in
            zip(kwargs["prompts"], kwargs["completions"], kwargs["answer"])]


def test_a_reward_function_that_takes_only_keywords_gets_the_prompts_and_completions_by_keyword():
    """`def f(**kwargs)` was given the two positionally: a TypeError at the first scoring."""
    for workers in (0, 1):
        with RewardRunner([keywords_only], num_workers=workers) as r:
            # "a": 1 + ("q" == "q") + 10 * ("a" == "a") = 12; "bb": 2 + 0 + 0 = 2
            assert r.score(["q", "r"], ["a", "bb"], {"answer": ["a", "x"]}).rewards.tolist() == [12.0, 2.0]


@pytest.mark.parametrize("signature, why", [
    ("one(x, **kw)", r"it takes 1 positional argument \(x\), not the prompts and the completions"),
    ("one(prompts, completions, answer, /, **kw)", r"its positional-only parameter 'answer' is never given"),
    # by position the two would land swapped, with no error at all
    ("one(completions, /, prompts, **kw)", r"by position its parameter 'completions' would get the prompts"),
])
def test_a_reward_signature_no_call_fits_is_one_error_naming_it_before_compute(tmp_path, capsys, signature, why):
    """It failed at the first scoring, after a rollout, with the worker's TypeError."""
    (tmp_path / "r.py").write_text(f"def {signature}:\n    return [1.0] * 4\n")
    rc, run_dir = train(tmp_path, f"rewards.functions=[{tmp_path / 'r.py'}:one]")
    err = capsys.readouterr().err
    assert rc == 2 and re.search(rf"config field 'rewards.functions\[0\].name': reward '\S*r.py:one': cannot be "
                                 rf"called as reward functions are \({why}\)", err), err[-1500:]
    assert not (run_dir / "metrics.jsonl").exists()


def test_an_async_generator_reward_is_refused_before_compute(tmp_path, capsys):
    """It passed start-up and stopped the run at the first scoring ("returned async_generator")."""
    (tmp_path / "r.py").write_text("async def one(completions, **kw):\n    yield [1.0] * len(completions)\n")
    rc, run_dir = train(tmp_path, f"rewards.functions=[{tmp_path / 'r.py'}:one]")
    err = capsys.readouterr().err
    assert rc == 2 and "r.py:one': an async generator (an `async def` that yields) gives no list" in err, err[-1500:]
    assert not (run_dir / "metrics.jsonl").exists()


# ------------------------------------------------------------------------ the prompt column


@pytest.mark.parametrize("argument", ["question", "question=None", "*, question=''"])
def test_a_reward_that_reads_the_prompt_column_by_name_is_told_it_is_prompts(tmp_path, capsys, argument):
    """`def r(completions, question, **kw)` with data.prompt_column=question was told the file had
    no column 'question' (it has: the prompt column, renamed when read); with a default, the
    reward got that default on every call, silently."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    (tmp_path / "r.py").write_text(f"def r(completions, {argument}, **kw):\n    return [1.0] * len(completions)\n")
    rc, run_dir = train(tmp_path, f"data.source={data}", "data.prompt_column=question",
                        f"rewards.functions=[{tmp_path / 'r.py'}:r]")
    err = capsys.readouterr().err
    assert rc == 2 and "r.py:r' needs the argument 'question': 'question' is the prompt column (data.prompt_column), " \
                       "which reward functions receive as `prompts`, never under its own name: name the argument prompts" in err, \
        err[-1500:]
    assert not (run_dir / "metrics.jsonl").exists()


# ------------------------------------------------------------------------ GRPOConfig's names


def test_every_trl_name_points_at_fields_gspo_has():
    """A renamed field must be renamed in the table too: every field it names, in either column."""
    names = {n for n, _, _ in field_docs()}
    sections = sorted({n.split(".")[0] for n in names if "." in n})
    for trl, (field, note) in TRL_NAMES.items():
        assert field is None or field in names, (trl, field)
        assert field is not None or note, trl  # a gap says what gspo does instead
        for ref in re.findall(rf"\b(?:{'|'.join(sections)})\.\w+", note):
            assert ref in names, (trl, ref)


def test_every_trl_name_is_trls():
    trl = pytest.importorskip("trl")
    import dataclasses

    older = {"max_prompt_length", "warmup_ratio"}  # (older TRL and transformers)
    theirs = {f.name for f in dataclasses.fields(trl.GRPOConfig)} | older
    assert set(TRL_NAMES) <= theirs, set(TRL_NAMES) - theirs


@pytest.mark.parametrize("override, message", [
    ("num_generations=8", "config field 'num_generations': unknown field; TRL's num_generations is rollout.group_size "
                          "here"),
    ("algo.beta=0.04", "config field 'algo.beta': unknown field; TRL's beta is algo.kl_coef here (a KL penalty"),
    ("rollout.repetition_penalty=1.1", "config field 'rollout.repetition_penalty': unknown field; TRL's "
                                       "repetition_penalty has no counterpart here: gspo samples from the policy"),
    ("scale_rewards=batch", "config field 'scale_rewards': unknown field; TRL's scale_rewards is algo.adv_scale here "
                            "(group for TRL's group or true, none for none or false; batch has no counterpart)"),
])
def test_a_trl_name_is_answered_with_gspos_field(override, message):
    """`num_generations=8` was asked "did you mean 'rollout.generators'?" (the async generator processes)."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert str(e.value).startswith(message), str(e.value)


def test_a_trl_name_in_a_yaml_file_is_answered_too(tmp_path):
    (tmp_path / "run.yaml").write_text("algo:\n  importance_sampling_level: sequence\n")
    with pytest.raises(ConfigError, match=r"'algo.importance_sampling_level': unknown field; TRL's "
                                          r"importance_sampling_level is algo.level here \(sequence \(GSPO"):
        load_config(tmp_path / "run.yaml")


def test_docs_trl_lists_every_name_of_the_table():
    doc = (ROOT / "docs" / "trl.md").read_text()
    assert [n for n in TRL_NAMES if f"`{n}`" not in doc] == []
