"""A run's own config.yaml, given back to `gspo train` after its folder was copied or moved, and
what resume=auto says when it finds no run."""

from __future__ import annotations

import json
import shutil

import pytest

from gspo.cli import main
from test_train import TINY


def _rollouts(run_dir) -> list[int]:  # the rollouts a run learned from (a line per optimizer step)
    return sorted({json.loads(x)["rollout"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
                   if "loss" in json.loads(x)})


def test_a_copied_or_moved_runs_config_names_both_folders_and_the_overrides_for_the_copy(tmp_path, capsys):
    """Its output.dir and output.name still name the first folder: resume=auto used to extend the
    original from the copy's config (a moved run started afresh at the old path)."""
    base = ["train", *TINY, "schedule.rollouts=1", "eval.enabled=false"]
    assert main([*base, f"output.dir={tmp_path / 'runs'}", "output.name=a"]) == 0
    original, copy = tmp_path / "runs" / "a", tmp_path / "elsewhere" / "b"
    shutil.copytree(original, copy)
    capsys.readouterr()
    assert main(["train", str(copy / "config.yaml"), "resume=auto", "schedule.rollouts=2"]) == 2
    err = capsys.readouterr().err
    assert f"the run in {copy}" in err and f"output.dir={copy.parent} output.name=b" in err and str(original) in err
    assert _rollouts(original) == [1]  # untouched
    assert main(["train", str(copy / "config.yaml"), "resume=auto", "schedule.rollouts=2",
                 f"output.dir={copy.parent}", "output.name=b"]) == 0  # the overrides it names go on with the copy
    assert _rollouts(copy) == [1, 2] and _rollouts(original) == [1]
    assert main(["train", str(original / "config.yaml"), "resume=auto", "schedule.rollouts=2"]) == 0  # its own place


def test_resume_auto_says_when_it_finds_no_run(tmp_path, capsys):
    capsys.readouterr()
    assert main(["train", *TINY, "schedule.rollouts=1", "eval.enabled=false", f"output.dir={tmp_path}",
                 "output.name=fresh", "resume=auto"]) == 0
    assert f"resume=auto: no run in {tmp_path / 'fresh'} yet, so a new one starts at rollout 0" in capsys.readouterr().err


@pytest.mark.parametrize("field", ["logging.completions_every", "logging.table_every", "logging.table_rows"])
def test_negative_logging_counts_are_refused_naming_the_field(field):
    """A negative count was accepted (completions_every=-1 ran a whole run that wrote none)."""
    from gspo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"config field '{field}': must be >= 0, got -1"):
        load_config(None, [f"{field}=-1"])
    load_config(None, [f"{field}=0"])


def test_a_users_own_config_beside_a_checkpoints_folder_is_not_taken_for_a_run(tmp_path, monkeypatch):
    """A project folder with its own config.yaml (relative output.dir) beside checkpoints/ or a
    metrics.jsonl of its own is not a copied run: nothing is asked."""
    from gspo.config import check_run_config, load_config

    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-1")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "config.yaml").write_text("output: {dir: runs, name: mine}\n")
    monkeypatch.chdir(tmp_path)
    check_run_config(tmp_path / "config.yaml", load_config(tmp_path / "config.yaml"), [])
