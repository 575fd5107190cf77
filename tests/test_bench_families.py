"""bench/families.py: a tiny checkpoint of a family, saved and trained through the CLI, and the
verdict it reads off the run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

from script_module import load_script

families = load_script("bench/families.py", "bench_families")


def test_a_family_trains_on_policy(tmp_path: Path, capsys):
    out = tmp_path / "families.json"
    assert families.main(["--families", "llama", "--modes", "default", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert (r["family"], r["verdict"], r["steps"]) == ("llama", "ok", 4)
    assert r["mismatch_max"] < 1e-4
    assert "1 cells" in capsys.readouterr().out


def test_the_verdict_names_what_went_wrong():
    run = {"rc": 0, "steps": 4, "finite": True, "mismatch_max": 1e-6, "first_ratio": [1.0, 1.0]}
    assert families.verdict(run) == "ok"
    assert families.verdict({**run, "first_ratio": [None, None]}) == "ok"  # (no row had a nonzero advantage)
    assert families.verdict({**run, "mismatch_max": 0.15}) == "off-policy"  # a dropout in a trainer pass
    assert families.verdict({**run, "first_ratio": [0.98, 1.0]}) == "off-policy"
    assert families.verdict({**run, "finite": False}) == "failed"
    assert families.verdict({"rc": 2, "message": "config field 'algo.routing_replay': ..."}) == "refused"
    assert families.verdict({"error": "RuntimeError: ..."}) == "error"
