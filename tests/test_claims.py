"""examples/claims/: the staleness claim's command in its quick mode (async mode, GSPO and
GRPO), the clipping read-out over its runs, and the shared collapse rule. The script's
`python -m gspo demo` processes are forked from the fork server (tests/zygote.py), which runs
what they run without a fresh interpreter's imports."""

from __future__ import annotations

import json
import math
import sys

from script_module import ROOT, load_script
from zygote import script_subprocess


def _load(monkeypatch, name):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "claims"))
    return load_script(f"examples/claims/{name}.py", f"claims_{name}")


def test_collapse_rule_is_the_documented_one(monkeypatch):
    common = _load(monkeypatch, "_common")
    assert not common.collapsed(0.50, 0.41, True, True)  # 9 points down: within the rule
    assert common.collapsed(0.50, 0.39, True, True)      # 11 points down
    assert common.collapsed(0.50, 0.90, False, True)     # a non-finite loss
    assert common.collapsed(0.50, 0.90, True, False)     # stopped early
    assert common.collapsed(0.50, math.nan, True, True)


def test_staleness_then_clipping_quick(monkeypatch, tmp_path):
    staleness = _load(monkeypatch, "staleness")
    monkeypatch.setattr(sys.modules[staleness.run_demo.__module__], "subprocess", script_subprocess)
    out = tmp_path / "staleness"
    results = staleness.main(["--quick", "--out", str(out)])
    assert {(r["algo"], r["K"]) for r in results} == {("gspo", 1), ("grpo", 1)}
    assert all(r["rc"] == 0 and r["rollouts_done"] == 3 for r in results), results
    assert all(r["staleness_mean"] is not None and r["staleness_mean"] > 0 for r in results)  # really async
    table = (out / "table.md").read_text()
    assert "| gspo | 1 | 1 |" in table and "| grpo | 1 | 1 |" in table
    assert len(json.loads((out / "results.json").read_text())) == 2

    clipping = _load(monkeypatch, "clipping")
    rows = clipping.main([str(out), "--out", str(tmp_path / "clipping")])
    assert {(r["cell"], r["algorithm"]) for r in rows} == {("gspo-K1", "GSPO"), ("grpo-K1", "GRPO")}
    assert (tmp_path / "clipping" / "table.md").is_file() and (tmp_path / "clipping" / "clipping.png").is_file()
