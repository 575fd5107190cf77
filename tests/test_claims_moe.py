"""examples/claims/moe_routing.py end to end at its smallest (--quick), and its shaped reward.
The script's `python -m gspo train` and `python -c` warm-up processes are forked from the fork
server (tests/zygote.py), which runs what they run without a fresh interpreter's imports."""

from __future__ import annotations

import json

from script_module import load_script
from zygote import script_subprocess


def test_digit_credit_by_hand():
    mod = load_script("examples/claims/rewards.py", "claims_rewards")
    # exact: 1; "18" for 19: units wrong, tens right -> 0.5 x 1/2; "119": the last two match,
    # over 3 characters -> 0.5 x 2/3; empty: 0; missing answer: None
    got = mod.digit_credit(["12+7="] * 5, ["19", "18", "119", "", "19"], answer=["19", "19", "19", "19", None])
    assert got == [1.0, 0.25, 0.5 * 2 / 3, 0.0, None]
    assert mod.digit_credit(["1+1="], [[{"role": "assistant", "content": " 2 "}]], answer=["2"]) == [1.0]


def test_moe_routing_quick(monkeypatch, tmp_path):
    """Run from a copy of examples/claims (it found its reward file through the repository's
    layout, and a copy's runs all failed)."""
    import shutil
    from pathlib import Path

    copy = shutil.copytree(Path(__file__).parents[1] / "examples" / "claims", tmp_path / "elsewhere" / "claims")
    mod = load_script(str(copy / "moe_routing.py"), "claims_moe_routing")
    monkeypatch.setattr(mod, "subprocess", script_subprocess)
    tmp_path = tmp_path / "out"
    results = mod.main(["--quick", "--out", str(tmp_path)])
    assert [(r["algo"], r["seed"]) for r in results] == [("gspo", 0), ("grpo", 0)]
    assert all(r["status"] == "ok" and r["steps"] == 3 * mod.MINIBATCHES for r in results)
    # the off-policy steps compare routes (the first step of each rollout is pi_old itself)
    assert all(r["routing_off"] is not None and len(r["routing_layers"]) == 2 for r in results)
    assert all(r["token_log_ratio_var_off"] > 0 for r in results)  # off-policy steps: the ratios spread
    table = (tmp_path / "table.md").read_text()
    assert "| gspo | 1 |" in table and "| grpo | 1 |" in table and "Collapsed" in table and "layer 1" in table
    assert table.startswith("# MoE routing: GSPO and GRPO at lr")  # the algorithms that ran
    saved = json.loads((tmp_path / "results.json").read_text())
    assert [r["run"] for r in saved["results"]] == [r["run"] for r in results] and saved["collapse"] == mod.COLLAPSE
    assert (tmp_path / "report" / "report.html").is_file()
