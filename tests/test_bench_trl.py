"""bench/trl_compare.py --quick: gspo's side always runs; TRL's side (and the ratio) when trl imports."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "trl_compare.py"


def _trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except Exception as e:
        return f"trl is not importable ({type(e).__name__}: {e}); install the bench extra: pip install -e '.[bench]'"
    return None


TRL_MISSING = _trl_missing()


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    """One `--quick` run (both sides when trl imports, else gspo only) and its JSON."""
    out = tmp_path_factory.mktemp("trl_compare") / "result.json"
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, str(SCRIPT), "--quick", "--out", str(out)]  # the script skips TRL itself if missing
    p = subprocess.run(args, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert p.returncode == 0, f"stdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-6000:]}"
    res = json.loads(out.read_text())
    res["_stdout"] = p.stdout
    return res


def _check_side(side: dict, max_len: int) -> None:
    assert side["rollout_s"] > 0 and math.isfinite(side["rollout_s"])
    assert side["tokens_per_s"] > 0
    assert 0 < side["mean_completion_len"] <= max_len
    assert side["threads"] == 1
    ph = side["phases"]
    for k in ("generate", "pi_old", "update"):
        assert ph[k] > 0, k  # each phase ran in every timed rollout
    assert ph["generate"] + ph["pi_old"] + ph["update"] <= side["rollout_s"] * 1.5


def test_gspo_side_runs(quick: dict) -> None:
    w = quick["workloads"]["quick"]
    cell = w["cells"][0]["gspo"]
    assert len(cell["rollout_s"]) == w["rollouts"] and len(cell["tokens"]) == w["rollouts"]
    _check_side(w["gspo"], w["shape"]["T"])
    assert "gspo" in quick["_stdout"]  # the table was printed


def test_trl_side_and_ratio(quick: dict) -> None:
    if TRL_MISSING:
        assert quick["frameworks"] == ["gspo"] and "trl" in quick["trl_skipped"]
        pytest.skip(f"TRL side not run: {TRL_MISSING}")
    w = quick["workloads"]["quick"]
    assert quick["frameworks"] == ["gspo", "trl"]
    _check_side(w["trl"], w["shape"]["T"])
    assert w["ratio_trl_over_gspo"] > 0 and len(w["ratios"]) == w["rounds"]
    # same model, same sampling: the mean completion lengths agree (a random model rarely says EOS)
    assert abs(w["trl"]["mean_completion_len"] - w["gspo"]["mean_completion_len"]) <= 0.25 * w["shape"]["T"]
    assert "TRL/gspo" in quick["_stdout"]


def test_reward_is_deterministic_and_in_range() -> None:
    mod = load_script("bench/trl_compare.py", "bench_trl_compare")
    comps = ["12", "abc", "", "99+1"]
    r = mod.bench_reward(["p"] * 4, comps)
    assert r == mod.bench_reward(["q"] * 4, comps)
    assert all(0.0 <= x <= 1.0 for x in r) and len(set(r)) > 1
    assert mod.bench_reward(["p"], [[{"role": "assistant", "content": "12"}]]) == r[:1]
