"""End-to-end: `gspo train` through the CLI on the tiny model, its outputs, and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gspo.cli import main
from gspo.config import ConfigError, field_docs, load_config

TINY = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=64",         "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
        "schedule.rollouts=2", "schedule.num_minibatches=2", "eval.num_prompts=8", "logging.console=false",
        "logging.completions_every=1"]


def run(tmp_path: Path, *extra: str, name: str = "run") -> tuple[int, Path]:
    rc = main(["train", *TINY, f"output.dir={tmp_path}", f"output.name={name}", *extra])
    return rc, tmp_path / name


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rollout_metrics_are_the_rollouts_on_every_step_when_rows_are_left_out(tmp_path):
    """A random model scores 0 everywhere: every advantage is 0 and (skip_zero_advantage, the
    default) no row runs in the update. completion/len_mean is still the rollout's mean length on
    every step, not the mean over the rows that ran (none); with logging.kl_reference no row is
    left out, so kl/ref is measured on every step."""
    rc, run_dir = run(tmp_path, "logging.kl_reference=true")
    assert rc == 0
    steps = [r for r in records(run_dir) if r["step"] > 0]
    assert all(r["adv/frac_zero_std"] == 1.0 for r in steps)  # no signal anywhere
    by_rollout = {}
    for r in steps:
        by_rollout.setdefault(r["rollout"], set()).add(r["completion/len_mean"])
    assert all(len(v) == 1 and None not in v and 0 < next(iter(v)) <= 4 for v in by_rollout.values())
    assert all(r["kl/ref"] is not None for r in steps) and steps[0]["kl/ref"] == 0.0


def test_train_cli_end_to_end(tmp_path):
    # a random model scores 0 everywhere: every advantage is 0, so make the rows run anyway
    rc, run_dir = run(tmp_path, "schedule.skip_zero_advantage=false")
    assert rc == 0
    assert (run_dir / "config.yaml").exists()
    recs = records(run_dir)
    # step 0 = the evaluation before training, then one line per optimizer step: 2 rollouts x 2 minibatches
    assert [r["step"] for r in recs] == [0, 1, 2, 3, 4]
    for key in ["reward/mean", "reward/std", "reward/exact_answer/mean", "clip/token_frac", "clip/seq_frac",
                "ratio/seq_mean", "kl/approx", "completion/len_mean", "completion/truncated_frac",
                "adv/frac_zero_std", "grad_norm", "lr", "time/generate", "time/score", "time/old_logp",
                "time/update", "tokens_per_s"]:
        assert key in recs[1], key
    assert "eval/accuracy" in recs[0] and "eval/accuracy" in recs[-1]
    # the first minibatch of a rollout is on-policy: its sequence ratios are exactly 1
    assert recs[1]["ratio/seq_min"] == pytest.approx(1.0, abs=1e-5)
    assert recs[1]["ratio/seq_max"] == pytest.approx(1.0, abs=1e-5)
    comp = sorted((run_dir / "completions").glob("*.jsonl"))
    assert comp
    row = json.loads(comp[0].read_text().splitlines()[0])
    assert {"prompt", "completion", "reward", "advantage", "finish_reason", "rewards"} <= set(row)
    # the saved model reloads with transformers and generates
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    tok = AutoTokenizer.from_pretrained(run_dir / "final")
    ids = tok("12+7=", return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_reward_rises_on_a_learnable_task(tmp_path):
    """A random tiny model learns to emit more '1' characters within a few rollouts (fixed seed)."""
    rc, run_dir = run(tmp_path, "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]",
                      "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=6",
                      "schedule.rollouts=12", "schedule.num_minibatches=2", "optim.lr=3e-3",
                      "eval.enabled=false", "data.source=sorting", "seed=1")
    assert rc == 0
    per_rollout = {}
    for r in records(run_dir):
        per_rollout.setdefault(r["rollout"], r["reward/mean"])
    rewards = [per_rollout[k] for k in sorted(per_rollout)]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards


def test_chat_prompts_and_dataset_columns(tmp_path):
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        for a in range(12):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1)}) + "\n")
    rc, run_dir = run(tmp_path, f"data.source={data}", "data.prompt_column=messages")
    assert rc == 0
    comp = sorted((run_dir / "completions").glob("*.jsonl"))[0]
    row = json.loads(comp.read_text().splitlines()[0])
    assert row["prompt"].startswith("user: ") and row["prompt"].endswith("assistant: ")


def test_plain_prompts_from_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"question": [f"{a}+2=" for a in range(12)], "answer": [str(a + 2) for a in range(12)]})
    pq.write_table(table, tmp_path / "d.parquet")
    rc, run_dir = run(tmp_path, f"data.source={tmp_path / 'd.parquet'}", "data.prompt_column=question")
    assert rc == 0 and (run_dir / "final" / "config.json").exists()
    # the parquet's prompts are the ones sampled and scored against their own answers
    comp = [json.loads(x) for f in sorted((run_dir / "completions").glob("*.jsonl")) for x in f.read_text().splitlines()]
    assert comp and {r["prompt"] for r in comp} <= {f"{a}+2=" for a in range(12)}
    assert [r["step"] for r in records(run_dir)][-1] == 4


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for name, default, help in field_docs():
        assert name in out
        assert help.split()[0] in out


@pytest.mark.parametrize("override, field", [
    ("rollout.group_size=1", "rollout.group_size"),
    ("schedule.num_minibatches=5", "schedule.num_minibatches"),
    ("schedule.micro_batch_size=64", "schedule.micro_batch_size"),
    ("algo.eps_low=-1", "config field 'algo.eps_low'"),
    ("algo.level=banana", "config field 'algo.level': 'banana' is not sequence | sequence_token | token"),
    ("algo.sapo_tau_pos=2", "config field 'algo.sapo_tau_pos'"),  # SAPO's, with objective=clip: not silently ignored
    ("algo.aggregation=token-mean", "config field 'algo.aggregation'"),  # length weighting at sequence level
    ("algo.mismatch_correction=bogus", "config field 'algo.mismatch_correction'"),  # (both named 'algo' before)
    ("rewards.overlong_buffer=5", "config field 'rewards.overlong_buffer'"),  # with the penalty off: it did nothing
    ("algo.sapo_tau_neg=2", "config field 'algo.sapo_tau_neg'"),  # (it named sapo_tau_pos)
    ("rewards.functions=[exact_answer,5]", "'rewards.functions[1]' is a section (name, weight, kwargs, ...), not 5: "
                                           "write it as {name: ...} in the list"),
    ("rewards.functions=[{name: exact_answer, weight: yes}]", "'rewards.functions[0].weight': must be a number"),
    ("rewards.functions=[{name:exact_answer,kwargs:{foo:1}}]", "is not valid YAML (a space after each ':'"),
    ("rewards.functions=[{name:exact_answer}]", "(a space after the ':')"),
    ("nonsense.key=1", "nonsense"),
    ("rollout.group_size=abc", "rollout.group_size"),
    ("rewards.functions=[{name: code_tests}]", "rewards.allow_code_execution"),  # opt-in only
    ("rewards.functions=[{name: 'gspo.rewards.sandbox:code_tests_reward'}]", "rewards.allow_code_execution"),  # by path
    ("algo.eps_low=5e-4", "algo.eps_low"),        # above eps_high's default 4e-4: out of order
    ("rewards.functions.0.name=exact_answer", "rewards.functions=[{name: exact_answer}]"),  # a list by index
    ("rewards.functions[0].weight=2", "rewards.functions=[{name: exact_answer}]"),  # ... in brackets
    ("output.name=..", "output.name"),  # would write into output.dir's parent
    ("output.name=.", "output.name"),
    ("optim.lr=inf", "optim.lr"),                 # would train to a non-finite model
    ("optim.beta1=2", "optim.beta1"),
    ("optim.weight_decay=-1", "optim.weight_decay"),
    ("algo.adv_eps=-1", "algo.adv_eps"),
    ("seed=-1", "seed"),
    ("tiny.hidden_size=33", "tiny.hidden_size"),
    ("tiny.num_layers=0", "tiny.num_layers"),
    ("rollout.temperature=inf", "rollout.temperature"),
    ("eval.num_prompts=-1", "eval.num_prompts"),
    ("rollout.tool_reply_max_chars=0", "rollout.tool_reply_max_chars"),
    # shapes (a traceback, or OmegaConf's own words, before): a section given a value, a field of a
    # list's item misspelt, a field misplaced in another section
    ("rollout=5", "config field 'rollout' is a section"),
    ("rewards.functions=[{nme: exact_answer}]", "'rewards.functions[0].nme': unknown field (did you mean "
                                                "'rewards.functions[0].name'?)"),
    ("model.group_size=4", "'model.group_size': unknown field (did you mean 'rollout.group_size'?)"),
    ("rollout.group_sie=4", "(did you mean 'rollout.group_size'?)"),
    ("output.name=off", "config field 'output.name': YAML read False"),  # the run went to runs/False
    ("rewards.functions=[{name: exact_answer, kwargs: 5}]", "'rewards.functions[0].kwargs': must be a mapping"),
    ("rewards.functions=[{name: exact_answer, weight: .nan}]", "config field 'rewards.functions[0].weight'"),
])
def test_bad_config_is_one_clear_error(tmp_path, override, field, capsys):
    rc, _ = run(tmp_path, override)
    err = capsys.readouterr().err
    assert rc == 2
    assert field in err and "Traceback" not in err


@pytest.mark.parametrize("override, needle", [
    ("model.name_or_path=/nonexistent/model", "/nonexistent/model"),
    ("rewards.functions=[{name: no_such_reward}]", "no_such_reward"),
    ("data.source=/nonexistent/data.jsonl", "/nonexistent/data.jsonl"),
])
def test_bad_inputs_named_before_compute(tmp_path, override, needle, capsys):
    rc, run_dir = run(tmp_path, override)
    assert rc == 2
    assert needle in capsys.readouterr().err
    assert not (run_dir / "metrics.jsonl").exists()


def test_dataset_without_prompt_column_or_empty(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    rc, _ = run(tmp_path, f"data.source={bad}")
    assert rc == 2 and "prompt" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, _ = run(tmp_path, f"data.source={empty}", name="r2")
    assert rc == 2 and "empty.jsonl" in capsys.readouterr().err


def test_a_list_field_given_one_item_takes_it_as_a_list_of_one_and_a_folder_is_no_config(tmp_path, capsys):
    from gspo.config import load_config

    cfg = load_config(None, ["lora.target_modules=q_proj", "rewards.functions={name: format}",
                             "rollout.tools=gspo.tool_tasks:calc"])
    assert cfg.lora.target_modules == ["q_proj"] and [f.name for f in cfg.rewards.functions] == ["format"]
    assert cfg.rollout.tools == ["gspo.tool_tasks:calc"]
    # reward functions by bare name (the advice given for them was refused as setting a list by index)
    assert load_config(None, ["rewards.functions=[{name: format, kwargs: null}]"]).rewards.functions[0].kwargs == {}
    cfg = load_config(None, ["rewards.functions=[exact_answer, {name: format, weight: 0.5}]"])
    assert [(f.name, f.weight) for f in cfg.rewards.functions] == [("exact_answer", 1.0), ("format", 0.5)]
    y = tmp_path / "one.yaml"
    y.write_text("rewards:\n  functions:\n    name: exact_answer\n    weight: 2\n")
    assert [(f.name, f.weight) for f in load_config(y).rewards.functions] == [("exact_answer", 2.0)]
    assert main(["train", str(tmp_path)]) == 2
    assert "is a folder: give a YAML config file" in capsys.readouterr().err


def test_a_yaml_file_that_is_not_a_mapping_is_one_error(tmp_path, capsys):
    bad = tmp_path / "list.yaml"
    bad.write_text("- rollout.group_size: 4\n")
    assert main(["train", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "list.yaml" in err and "not a mapping" in err and "Traceback" not in err


def test_an_answer_reward_on_data_without_answers_is_one_error_before_compute(tmp_path, capsys):
    math = tmp_path / "math.jsonl"
    math.write_text("".join(json.dumps({"problem": f"{i}+1=", "solution": f"\\boxed{{{i + 1}}}"}) + "\n"
                            for i in range(16)))
    rc, run_dir = run(tmp_path, f"data.source={math}", "data.prompt_column=problem",
                      "rewards.functions=[{name: math_verify}]")
    err = capsys.readouterr().err
    assert rc == 2 and "rewards.functions[0].name" in err and "'answer' column" in err and "solution" in err
    assert not (run_dir / "metrics.jsonl").exists()
    gsm = tmp_path / "gsm8k.jsonl"  # GSM8K as it comes: the answer cell is a worked solution
    gsm.write_text("".join(json.dumps({"question": f"{i} apples and one more?",
                                       "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}) + "\n"
                           for i in range(16)))
    rc, _ = run(tmp_path, f"data.source={gsm}", "data.prompt_column=question", "rewards.functions=[exact_answer]",
                name="gsm")
    err = capsys.readouterr().err
    assert rc == 2 and "16 of 16 cells" in err and "part after '####'" in err


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc = main(["train", *TINY, f"output.dir={blocker}", "output.name=run"])
    assert rc == 2 and "output.dir" in capsys.readouterr().err


def test_existing_run_needs_resume(tmp_path, capsys):
    rc, _ = run(tmp_path, "schedule.rollouts=1")
    assert rc == 0
    rc, _ = run(tmp_path, "schedule.rollouts=1")
    assert rc == 2 and "resume=auto" in capsys.readouterr().err


def test_yaml_config_and_overrides(tmp_path):
    cfg_file = Path(__file__).parents[1] / "examples" / "arithmetic.yaml"
    cfg = load_config(cfg_file, ["rollout.group_size=16", "algo.eps_high=5e-4"])
    assert cfg.rollout.group_size == 16 and cfg.algo.eps_high == 5e-4 and cfg.rollout.prompts_per_step == 32
    with pytest.raises(ConfigError, match="rollout.group_sise"):
        load_config(cfg_file, ["rollout.group_sise=16"])


def test_overlong_prompts_are_dropped_and_counted(tmp_path, capsys):
    # arithmetic prompts are 4-6 characters: a limit of 5 drops the 6-character ones
    rc, run_dir = run(tmp_path, "data.max_prompt_tokens=5", "schedule.rollouts=1")
    assert rc == 0
    err = capsys.readouterr().err
    assert "dropped" in err and "data.max_prompt_tokens=5" in err
    for p in (run_dir / "completions").glob("*.jsonl"):
        for line in p.read_text().splitlines():
            assert len(json.loads(line)["prompt"]) <= 5


def test_the_code_execution_opt_in_reaches_code_tests_by_either_name():
    from gspo.train.run import reward_specs

    for name in ("code_tests", "gspo.rewards.sandbox:code_tests_reward"):
        cfg = load_config(None, [f"rewards.functions=[{{name: '{name}'}}]", "rewards.allow_code_execution=true"])
        assert reward_specs(cfg)[0].kwargs["allow_code_execution"] is True


def test_the_code_tests_reward_under_a_users_name_takes_the_opt_in(tmp_path, monkeypatch, capsys):
    """docs/code_execution.md's `functools.partial(code_tests_reward, executor=...)`, and the dotted
    path: with rewards.allow_code_execution=true they get the opt-in as the built-in name does
    (they stopped at the first rollout with CodeExecutionDisabled); without it, refused at start-up."""
    (tmp_path / "my_code.py").write_text(
        "import functools\nfrom gspo.rewards.sandbox import CodeResult, code_tests_reward\n"
        "def fake(code, cases, limits):\n    return CodeResult(score=float(len(code) % 2), reason='ok')\n"
        "code_tests_remote = functools.partial(code_tests_reward, executor=fake)\n")
    rows = [{"prompt": f"{i}+1=", "tests": ["assert True"]} for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)
    common = ["data.source=rows.jsonl", "data.num_prompts=8", "eval.enabled=false", "schedule.rollouts=1"]
    for name in ["my_code:code_tests_remote", "gspo.rewards.sandbox.code_tests_reward"]:
        rc, _ = run(tmp_path, *common, f"rewards.functions=[{name}]", name="refused")
        err = capsys.readouterr().err
        assert rc == 2 and "rewards.allow_code_execution" in err, err[-2000:]
    rc, run_dir = run(tmp_path, *common, "rewards.functions=[my_code:code_tests_remote]",
                      "rewards.allow_code_execution=true", name="allowed")
    assert rc == 0, capsys.readouterr().err[-2000:]
    assert records(run_dir)[-1]["reward/missing"] == 0


def test_the_demo_never_replaces_a_folder_it_did_not_write(tmp_path, capsys):
    """`gspo demo --out DIR` replaced DIR whenever it held a metrics.jsonl: a user's run there was
    deleted, exit 0. Now only a folder with the demo's mark (or an earlier demo's summary) is
    replaced, and output.dir / output.name, which --out sets, are refused before any work."""
    user = tmp_path / "my-run"
    user.mkdir()
    (user / "metrics.jsonl").write_text('{"step": 1}\n')
    (user / "notes.txt").write_text("keep me")
    assert main(["demo", "--quick", "--out", str(user)]) == 2
    assert "no demo wrote it" in capsys.readouterr().err and (user / "notes.txt").exists()
    assert main(["demo", "--quick", "--out", str(tmp_path / "d"), "output.name=foo"]) == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "d").exists() and not Path("foo").exists()
    mine = tmp_path / "mine"  # a demo's folder survives a typo in an override
    mine.mkdir()
    (mine / ".gspo-demo").write_text("")
    (mine / "summary.json").write_text("{}")
    assert main(["demo", "--quick", "--out", str(mine), "rollout.group_sise=4"]) == 2
    assert (mine / "summary.json").exists() and "rollout.group_sise" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["demo", "--quick", "--out", str(tmp_path / "afile")]) == 2
    assert "a file, not a folder" in capsys.readouterr().err
    old = tmp_path / "old-demo"
    old.mkdir()
    (old / "summary.json").write_text('{"accuracy_before_rl": 0.3}')
    from gspo.demo import _old_demo
    assert _old_demo(old) and not _old_demo(user)


def test_entropy_is_logged_on_every_step_null_where_no_row_ran(tmp_path):
    """README: entropy/mean is logged every step. On a step where every advantage is 0 no row
    runs, and the key was absent (clip/* were null); under torchrun the ranks' metric keys then
    differed in the all-reduce."""
    (tmp_path / "flat.py").write_text("def flat(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    rc, run_dir = run(tmp_path, f"rewards.functions=[{tmp_path / 'flat.py'}:flat]", "eval.enabled=false")
    assert rc == 0
    steps = [r for r in records(run_dir) if r.get("step", 0) > 0]
    assert steps and all("entropy/mean" in r and r["entropy/mean"] is None for r in steps)


def test_the_no_signal_warning_says_what_still_moves_the_weights(tmp_path, capsys):
    """With an entropy (or KL) term in the loss, equal rewards leave a gradient: the warning said
    'the loss has no gradient' while the weights moved."""
    (tmp_path / "flat.py").write_text("def flat(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    flat = f"rewards.functions=[{tmp_path / 'flat.py'}:flat]"
    assert run(tmp_path, flat, "eval.enabled=false", "algo.entropy_coef=0.1", name="bonus")[0] == 0
    err = capsys.readouterr().err
    assert "the policy-gradient term has no gradient (the KL / entropy / router-loss terms still act)" in err
    assert run(tmp_path, flat, "eval.enabled=false", name="plain")[0] == 0
    assert "the advantages are all 0 and the loss has no gradient" in capsys.readouterr().err


@pytest.mark.parametrize("fn, column", [("def f(completions, solution, **kw):\n    return [1.0] * len(completions)\n", "solution"),
                                        ("def f(completions, trainer_state, **kw):\n    return [1.0] * len(completions)\n",
                                         "trainer_state"),
                                        ("def f(prompts, completions, /, *, level, **kw):\n    return [1.0] * len(completions)\n",
                                         "level")])
def test_a_reward_argument_no_column_supplies_is_one_error_before_compute(tmp_path, capsys, fn, column):
    """It failed at the first scoring, after a rollout, with a TypeError."""
    (tmp_path / "needs.py").write_text(fn)
    rc, run_dir = run(tmp_path, f"rewards.functions=[{tmp_path / 'needs.py'}:f]")
    err = capsys.readouterr().err
    assert rc == 2 and f"needs the argument {column!r}" in err and "rewards.functions[0]" in err, err[-1500:]
    assert not (run_dir / "metrics.jsonl").exists()
    assert ("TRL adds" in err) == (column == "trainer_state")


def test_code_tests_without_a_tests_column_is_one_error_before_compute(tmp_path, capsys):
    rc, _ = run(tmp_path, "rewards.functions=[code_tests]", "rewards.allow_code_execution=true")
    err = capsys.readouterr().err
    assert rc == 2 and "needs the argument 'tests'" in err, err[-1500:]


def test_an_environments_reward_counts_as_a_column_for_the_start_up_check(tmp_path):
    """The argument check refused `def f(completions, env_reward, **kw)` under rollout.environment,
    whose env_reward column the trainer adds after the episodes."""
    from gspo.config import load_config
    from gspo.data import DataError
    from gspo.train.prompts import check_named_columns, load_prompt_rows

    (tmp_path / "env.py").write_text("def f(completions, env_reward, **kw):\n    return list(env_reward)\n")
    reward = f"rewards.functions=[{tmp_path / 'env.py'}:f]"
    game = load_config(None, ["data.source=guess", "rollout.environment=gspo.tool_tasks:GuessNumber", reward])
    check_named_columns(game, load_prompt_rows(game)[0])
    plain = load_config(None, [reward])
    with pytest.raises(DataError, match="needs the argument 'env_reward'"):
        check_named_columns(plain, load_prompt_rows(plain)[0])


def test_a_run_whose_output_pipe_closes_trains_to_its_end(tmp_path):
    """`gspo train ... | head -1`: once head exits, a warning's print raised BrokenPipeError (rich's
    console turned its own into SystemExit) and the run stopped mid-way, exit 1; a finished run
    exited 1 on its last line. The console now writes nowhere once its reader is gone."""
    import shlex
    import shutil
    import subprocess

    exe = shutil.which("gspo")
    (tmp_path / "flat.py").write_text("def flat(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    args = [exe, "train", *TINY, "schedule.rollouts=6", "logging.no_signal_every=1", "logging.console=true",
            f"rewards.functions=[{tmp_path / 'flat.py'}:flat]", f"output.dir={tmp_path}", "output.name=run"]
    p = subprocess.run(["bash", "-o", "pipefail", "-c", " ".join(map(shlex.quote, args)) + " 2>&1 | head -c 1"],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "run" / "final").is_dir() and records(tmp_path / "run")[-1]["rollout"] == 6


def test_ctrl_c_in_gspo_eval_is_one_line_and_exit_130(monkeypatch, capsys, saved):
    """It printed KeyboardInterrupt's traceback (gspo train has its own signal handling)."""
    import gspo.train.evaluate as ev

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(ev, "evaluate", interrupted)
    assert main(["eval", str(saved("qwen3")), "arithmetic", "--num-prompts", "2"]) == 130
    err = capsys.readouterr().err
    assert "gspo eval: interrupted" in err and "Traceback" not in err


def test_ctrl_c_before_any_command_runs_is_one_line_and_exit_130(monkeypatch, capsys):
    """A Ctrl-C while torch and transformers import (before a command's own handling) printed
    a traceback."""
    import gspo.cli as cli

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["report", "nowhere"]) == 130
    err = capsys.readouterr().err
    assert "gspo: interrupted" in err and "Traceback" not in err
