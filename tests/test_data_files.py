"""Data files as users hand them over, read through `gspo.data.load_rows` and the CLI: a
gzipped file that is cut short or not gzip at all is one error naming it, exit 2."""

from __future__ import annotations

import gzip
import json

import pytest

from gspo.cli import main
from gspo.data import DataError, load_rows


@pytest.mark.parametrize("name", ["rows.jsonl.gz", "rows.json.gz", "rows.csv.gz"])
def test_a_gzipped_data_file_cut_short_or_not_gzip_is_one_error_naming_it(tmp_path, capsys, name):
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(50)]
    text = ("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in rows) if name.startswith("rows.csv")
            else "".join(json.dumps(r) + "\n" for r in rows))
    whole = gzip.compress(text.encode())
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / name).write_bytes(whole)
    assert len(load_rows(tmp_path / "ok" / name)) == 50
    cut, plain = tmp_path / f"cut-{name}", tmp_path / f"plain-{name}"
    cut.write_bytes(whole[:30])
    plain.write_text(text)
    for bad in (cut, plain):
        with pytest.raises(DataError, match=rf"{bad.name}: cannot read it as gzip .*cut short, corrupt"):
            load_rows(bad)
    capsys.readouterr()
    assert main(["train", f"data.source={cut}", "schedule.rollouts=1", f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "cannot read it as gzip" in err and "Traceback" not in err


def test_a_glob_is_said_to_be_unexpanded(tmp_path):
    for i in range(2):
        (tmp_path / f"part{i}.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(DataError, match="a pattern \\(glob\\) is not expanded: put the files in one folder"):
        load_rows(tmp_path / "part*.jsonl")
    assert len(load_rows(tmp_path)) == 2  # the folder, as it says


def test_data_errors_number_rows_from_0_and_name_the_line_they_start_on(tmp_path):
    """Content errors counted rows from 0 past blank lines, CSV cell errors by file line: the
    numbers disagreed and neither led to the record. Each now says both (row from 0, file line)."""
    ok = json.dumps({"prompt": "1+1=", "answer": "2"})
    (tmp_path / "gaps.jsonl").write_text(f"{ok}\n\n{ok}\n\n" + json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(DataError, match=r"gaps\.jsonl: row 2 \(line 5\), column 'prompt'"):
        load_rows(tmp_path / "gaps.jsonl")
    (tmp_path / "multi.csv").write_text('prompt,answer\n"two\nlines",1\n,2\n')  # a quoted newline in row 0
    with pytest.raises(DataError, match=r"multi\.csv: row 1 \(line 4\), column 'prompt'"):
        load_rows(tmp_path / "multi.csv")
    (tmp_path / "short.csv").write_text('prompt,answer\n"two\nlines",1\nx\n')
    with pytest.raises(DataError, match=r"short\.csv: row 1 \(line 4\) has fewer cells"):
        load_rows(tmp_path / "short.csv")


def test_a_folder_of_files_of_different_formats_or_columns_says_it_reads_them_as_one(tmp_path, capsys):
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "mixed" / "b.csv").write_text("prompt,label\n2+2=,4\n")
    capsys.readouterr()
    assert len(load_rows(tmp_path / "mixed")) == 2
    assert "read 2 files of different formats and columns as one dataset (a.jsonl, b.csv)" in capsys.readouterr().err
    (tmp_path / "shards").mkdir()
    for i in range(2):  # a dataset's shards: nothing to say
        (tmp_path / "shards" / f"part-{i}.jsonl").write_text(json.dumps({"prompt": f"{i}+1=", "answer": "x"}) + "\n")
    assert len(load_rows(tmp_path / "shards")) == 2 and "note:" not in capsys.readouterr().err
