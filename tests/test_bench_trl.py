"""bench/trl_compare.py --quick: gspo's side always runs; TRL's side (and the ratio) when trl imports."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
from script_module import load_script
from zygote import script_subprocess

ROOT = Path(__file__).resolve().parents[1]


def _trl_missing() -> str | None:
    try:
        import trl  # noqa: F401
    except Exception as e:
        return f"trl is not importable ({type(e).__name__}: {e}); install the bench extra: pip install -e '.[bench]'"
    return None


TRL_MISSING = _trl_missing()


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict:
    """One `--quick` run (both sides when trl imports, else gspo only) and its JSON: the script's
    main() in this process, each cell's `python bench/trl_cells.py` process forked from the fork
    server (tests/zygote.py), which runs it without a fresh interpreter's imports of torch,
    transformers and gspo."""
    out = tmp_path_factory.mktemp("trl_compare") / "result.json"
    mod = load_script("bench/trl_compare.py", "bench_trl_compare")
    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "subprocess", script_subprocess)
        mp.setenv("OMP_WAIT_POLICY", "PASSIVE")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.chdir(ROOT)
        with contextlib.redirect_stdout(stdout):
            mod.main(["--quick", "--out", str(out)])  # the script skips TRL itself if missing
    res = json.loads(out.read_text())
    res["_stdout"] = stdout.getvalue()
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


def test_grid_bounds_by_hand(tmp_path) -> None:
    """bench/grid_bounds.py on two made-up cells, each scenario worked out by hand."""
    mod = load_script("bench/grid_bounds.py", "bench_grid_bounds")

    def cell(trl, gspo, gen, update, asyn=None):
        c = {"trl": {"rollout_s": trl},
             "gspo": {"rollout_s": gspo, "phases": {"generate": gen, "update": update, "pi_old": 0.0}}}
        if asyn is not None:
            c["gspo-async"] = {"rollout_s": asyn}
        return c

    # a: TRL 1.2 s; gspo 0.6 = generate 0.2 + update 0.35 + 0.05 other (rest r = 0.4)
    #    now 1.2/0.6 = 2; gen/2 1.2/(0.1+0.4) = 2.4; gen=0 1.2/0.4 = 3; update=0 1.2/0.25 = 4.8;
    #    overlap 1.2/max(0.2, 0.4) = 3; async 1.2/0.3 = 4
    # b: TRL 1.0 s; gspo 0.8 = generate 0.5 + update 0.3 (r = 0.3)
    #    now 1.25; gen/2 1.0/0.55; gen=0 1.0/0.3; update=0 1.0/0.5 = 2; overlap 1.0/0.5 = 2; no async
    results = {"workloads": {"a": cell(1.2, 0.6, 0.2, 0.35, asyn=0.3), "b": cell(1.0, 0.8, 0.5, 0.3),
                             "gspo-only": {"gspo": {"rollout_s": 1.0, "phases": {}}}}}
    res = mod.summarise(results)
    assert set(res["cells"]) == {"a", "b"}  # a cell without TRL's side is left out
    a, b = res["cells"]["a"], res["cells"]["b"]
    for got, want in [(a["now"], 2.0), (a["gen/2"], 2.4), (a["gen=0"], 3.0), (a["update=0"], 4.8),
                      (a["overlap"], 3.0), (a["async"], 4.0), (b["now"], 1.25), (b["gen/2"], 1.0 / 0.55),
                      (b["gen=0"], 1.0 / 0.3), (b["update=0"], 2.0), (b["overlap"], 2.0)]:
        assert math.isclose(got, want, rel_tol=1e-12), (got, want)
    assert "async" not in b
    s = res["summary"]
    assert math.isclose(s["now"]["median"], (2.0 + 1.25) / 2) and s["now"]["worst_cell"] == "b"
    assert math.isclose(s["overlap"]["worst"], 2.0)
    assert s["async"] == {"median": 4.0, "worst": 4.0, "worst_cell": "a"}  # over the one cell that has it
    f = tmp_path / "grid.json"
    f.write_text(json.dumps(results))
    assert mod.main([str(f)])["summary"] == s


def test_decode_rows_fit_and_a_small_run() -> None:
    """bench/decode_rows.py: the least-squares line by hand, then one tiny measurement."""
    mod = load_script("bench/decode_rows.py", "bench_decode_rows")
    # y = 2 + 0.5 x exactly at x = 0, 2, 4; then points (0, 0), (1, 1), (2, 1): slope
    # sum((x - 1)(y - 2/3)) / sum((x - 1)^2) = (2/3 + 1/3) / 2 = 0.5, intercept 2/3 - 0.5 = 1/6
    assert mod.fit([0.0, 2.0, 4.0], [2.0, 3.0, 4.0]) == (2.0, 0.5)
    a, b = mod.fit([0.0, 1.0, 2.0], [0.0, 1.0, 1.0])
    assert math.isclose(a, 1 / 6) and math.isclose(b, 0.5)
    res = mod.main(["--cells", "g-dense-32r-p8-t16", "--rows", "2", "4", "--steps", "3", "--rounds", "1",
                    "--threads", "1"])
    (r,) = res
    assert r["threads"] == 1 and set(r["ms_per_step"]) == {2, 4}
    assert all(v > 0 and math.isfinite(v) for v in r["ms_per_step"].values())
