"""What the sync-mode ratio over TRL could reach on each grid cell if one of gspo's phases cost
less: read from a `bench/trl_compare.py --grid` result, no new measurement.

    python bench/grid_bounds.py docs/figures/trl_grid_amx.json

For each cell, with gspo's measured phases (generate g, the rest r = rollout - g) and TRL's
rollout time R, it prints R over:

    now          g + r                      the measured ratio
    gen/2        g/2 + r                    a decode loop twice as fast
    gen=0        r                          generation for free
    update=0     rollout - update           the optimizer steps for free
    overlap      max(g, r)                  generation and learning fully overlapped on two cores
                                            with exact sync semantics: the bound of any within-rollout
                                            pipeline (minibatch k+1 sampled while k trains), which in
                                            practice also pays for sampling in smaller batches
    async        gspo async's measured rollout (when the file has it)

then the median and the worst over the cells. The issue-17 goals (median >= 3x, worst >= 1.5x)
are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

GOALS = {"median": 3.0, "worst": 1.5}
SCENARIOS = ("now", "gen/2", "gen=0", "update=0", "overlap", "async")


def cell_bounds(cell: dict) -> dict[str, float]:
    """TRL's seconds per rollout over gspo's under each scenario, for one workload of the JSON."""
    R = cell["trl"]["rollout_s"]
    s = cell["gspo"]["rollout_s"]
    ph = cell["gspo"]["phases"]
    g = ph["generate"]
    r = s - g
    out = {"now": R / s, "gen/2": R / (g / 2 + r), "gen=0": R / r, "update=0": R / (s - ph["update"]),
           "overlap": R / max(g, r)}
    if "gspo-async" in cell:
        out["async"] = R / cell["gspo-async"]["rollout_s"]
    return out


def summarise(results: dict) -> dict[str, dict]:
    """{scenario: {"median", "worst", "worst_cell"}} over the workloads that ran both sides."""
    per_cell = {n: cell_bounds(w) for n, w in results["workloads"].items() if "trl" in w and "gspo" in w}
    out = {}
    for sc in SCENARIOS:
        vals = {n: b[sc] for n, b in per_cell.items() if sc in b}
        if vals:
            worst = min(vals, key=vals.get)
            out[sc] = {"median": statistics.median(vals.values()), "worst": vals[worst], "worst_cell": worst}
    return {"cells": per_cell, "summary": out}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid_json", type=Path, help="a bench/trl_compare.py --out file")
    a = ap.parse_args(argv)
    res = summarise(json.loads(a.grid_json.read_text()))
    scen = [sc for sc in SCENARIOS if sc in res["summary"]]
    print(f"{'cell':<28}" + "".join(f"{sc:>10}" for sc in scen))
    for name, b in res["cells"].items():
        print(f"{name:<28}" + "".join(f"{b[sc]:>9.2f}x" if sc in b else f"{'-':>10}" for sc in scen))
    for key in ("median", "worst"):
        print(f"{key + f' (goal {GOALS[key]:g}x)':<28}" + "".join(f"{res['summary'][sc][key]:>9.2f}x" for sc in scen))
    return res


if __name__ == "__main__":
    main()
