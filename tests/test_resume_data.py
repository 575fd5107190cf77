"""A resume checks the data, not only its length: the prompt stream's state holds a sha256 of
its rows (`PromptStream.data_sha256`), and a resume on rows edited since the checkpoint is
refused unless data.resume_on_changed=true (a run resumed on such data went on silently)."""

from __future__ import annotations

import json

import pytest

from gspo.cli import main
from gspo.data import DataError, PromptStream

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
EDITED = [*ROWS[:5], {"prompt": "5+1=", "answer": "7"}, *ROWS[6:]]  # one answer changed, as many rows


def test_the_stream_state_holds_the_rows_hash_and_a_resume_on_other_rows_is_refused():
    s = PromptStream(ROWS, 2, seed=1, source="rows.jsonl")
    s.next_batch()
    state = s.state_dict()
    assert state["data_sha256"] == PromptStream([dict(r) for r in ROWS], 4, seed=9).data_sha256  # rows alone
    assert state["data_sha256"] != PromptStream(EDITED, 2, seed=1).data_sha256
    same = PromptStream(ROWS, 2, seed=1)
    same.load_state_dict(state)
    assert same.next_batch() == s.next_batch()
    with pytest.raises(DataError, match=r"^config field 'data.source' \(rows.jsonl\): the data changed since the "
                                        r"checkpoint: its 8 prompts are as many as the resumed run's, but not the "
                                        r"same rows .*data.resume_on_changed=true"):
        PromptStream(EDITED, 2, seed=1, source="rows.jsonl").load_state_dict(state)
    edited = PromptStream(EDITED, 2, seed=1)
    assert edited.data_changed(state)
    edited.load_state_dict(state, allow_changed=True)  # the user asked to go on: from the saved position
    assert edited.position == s.position - 2 and edited.epoch == 0
    old = {k: v for k, v in state.items() if k != "data_sha256"}  # a state written before the hash was kept
    before = PromptStream(EDITED, 2, seed=1)
    assert not before.data_changed(old)
    before.load_state_dict(old)
    assert before.position == 2


def test_the_rows_hash_takes_what_files_hold():
    """Values JSON has no word for (Parquet's numpy arrays, dates) and a lone surrogate read from a
    JSON file, which UTF-8 cannot encode, are hashed rather than stopping the first checkpoint."""
    import datetime

    import numpy as np

    rows = [{"prompt": "caf\udce9", "answer": np.array([1, 2]), "when": datetime.date(2026, 1, 1)}] * 2
    h = PromptStream(rows, 1, seed=0).data_sha256
    assert len(h) == 64 and h != PromptStream([{**rows[0], "answer": np.array([1, 3])}] * 2, 1, seed=0).data_sha256


RUN = ["tiny.hidden_size=32", "tiny.num_layers=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
       "rollout.max_new_tokens=4", "schedule.num_minibatches=1", "eval.enabled=false", "logging.console=false",
       "checkpoint.every=1", "rewards.functions=[{name: exact_answer}]"]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_resume_on_edited_data_is_refused_unless_asked_and_an_older_checkpoint_resumes(tmp_path, capsys,
                                                                                          monkeypatch):
    data = tmp_path / "rows.jsonl"
    _write(data, ROWS)
    run = [*RUN, f"data.source={data}", f"output.dir={tmp_path}", "output.name=run"]
    assert main(["train", *run, "schedule.rollouts=1"]) == 0
    _write(data, EDITED)
    capsys.readouterr()
    assert main(["train", *run, "schedule.rollouts=2", "resume=auto"]) == 2
    out, err = capsys.readouterr()
    assert "extends it" not in out  # (it used to say the run goes on, just before refusing it)
    assert f"gspo train: error: config field 'data.source' ({data}): the data changed since the checkpoint" in err
    assert not (tmp_path / "run" / "checkpoints" / "step-2").exists()
    assert main(["train", *run, "schedule.rollouts=2", "resume=auto", "data.resume_on_changed=true"]) == 0
    out, err = capsys.readouterr()
    assert "finished at rollout 1; schedule.rollouts=2 extends it" in out
    assert "the rows changed since the checkpoint" in err and "settings that differ" not in err
    assert (tmp_path / "run" / "checkpoints" / "step-2").is_dir()

    # a checkpoint written before the stream's state held the hash resumes as it did, on any rows
    full = PromptStream.state_dict
    monkeypatch.setattr(PromptStream, "state_dict", lambda self: {k: v for k, v in full(self).items()
                                                                 if k != "data_sha256"})
    older = [*RUN, f"data.source={data}", f"output.dir={tmp_path}", "output.name=older"]
    assert main(["train", *older, "schedule.rollouts=1"]) == 0
    monkeypatch.undo()
    _write(data, ROWS)
    assert main(["train", *older, "schedule.rollouts=2", "resume=auto"]) == 0
    assert (tmp_path / "older" / "checkpoints" / "step-2").is_dir()
