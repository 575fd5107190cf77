"""Rollouts per second, async mode against sync mode, at equal work, over a grid of workloads.

    python bench/async_speed.py                      # the grid, 2 interleaved rounds (~10 min on 2 cores)
    python bench/async_speed.py --rounds 1 --rollouts 6 --json docs/figures/async_speed.json

Every cell is a fresh `gspo train` process on the tiny Qwen3-style model built from scratch
(eval off, one checkpoint at the end), run once in sync mode (the library's defaults: one
process, one thread on this machine) and once in async mode (`rollout.mode=async`, one
generator process, K = max_staleness). Rounds interleave the modes cell by cell, so drift in
the machine's speed hits both alike.

The figure is steady-state throughput: rollouts / sum of `time/step` over the rollouts after
the first (the first holds the pipeline's fill and the first-call set-up of either side).
Equal work: the same prompts, group size, token limit and minibatches in both modes; async
mode trains on rollouts sampled K versions earlier, which costs the same compute. The models
are untrained (they seldom emit EOS, so completions run to the limit, and the exact-answer
reward is 0 everywhere), so `schedule.skip_zero_advantage=false` makes the learner run every
row: without it a rollout with no signal costs the learner nothing.

A cell's generation/learning balance is printed from the sync run (time/generate against
the rest of the step): async mode can at best hide the shorter of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BASE = ["data.source=arithmetic", "data.num_prompts=2000", "eval.enabled=false", "logging.console=false",
        "logging.completions_every=0", "logging.table_every=0", "optim.lr=1e-4", "rollout.temperature=1.0",
        "schedule.skip_zero_advantage=false"]

# (name, overrides): prompts x completions, token limit, model size, dense / MoE
GRID = [
    ("demo 32x8 t6 h128", ["rollout.prompts_per_step=32", "rollout.group_size=8", "rollout.max_new_tokens=6",
                           "tiny.hidden_size=128", "tiny.num_layers=2"]),
    ("16x8 t32 h128", ["rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=32",
                       "tiny.hidden_size=128", "tiny.num_layers=2"]),
    ("4x8 t16 h128", ["rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=16",
                      "tiny.hidden_size=128", "tiny.num_layers=2"]),
    ("4x8 t64 h256 l4", ["rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=64",
                         "tiny.hidden_size=256", "tiny.num_layers=4"]),
    ("8x8 t128 h128", ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=128",
                       "tiny.hidden_size=128", "tiny.num_layers=2"]),
    ("4x8 t16 h128 moe", ["rollout.prompts_per_step=4", "rollout.group_size=8", "rollout.max_new_tokens=16",
                          "tiny.hidden_size=128", "tiny.num_layers=2", "tiny.moe=true"]),
    ("8x8 t64 h256 l4", ["rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_new_tokens=64",
                         "tiny.hidden_size=256", "tiny.num_layers=4"]),
    ("32x8 t16 h512 l4", ["rollout.prompts_per_step=32", "rollout.group_size=8", "rollout.max_new_tokens=16",
                          "tiny.hidden_size=512", "tiny.num_layers=4"]),
]


def run_cell(overrides: list[str], mode: list[str], rollouts: int, out: Path, name: str) -> dict:
    cmd = [sys.executable, "-m", "gspo", "train", *BASE, *overrides, *mode, f"schedule.rollouts={rollouts}",
           f"output.dir={out}", f"output.name={name}"]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{name} failed:\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    per_rollout = {}
    for r in recs:  # one line per optimizer step; the rollout's figures repeat on each
        if "time/step" in r:
            per_rollout[r["rollout"]] = r
    steady = [per_rollout[k] for k in sorted(per_rollout)][1:]
    secs = sum(r["time/step"] for r in steady)
    return {"rollouts_per_s": len(steady) / secs,
            "generate_s": statistics.mean(r["time/generate"] for r in steady),
            "step_s": secs / len(steady),
            "learner_idle_s": statistics.mean(r.get("async/learner_idle_s", 0.0) for r in steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=8)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--cells", type=int, default=len(GRID), help="only the first N cells")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    modes = {"sync": [], "async": ["rollout.mode=async", f"rollout.max_staleness={args.staleness}"]}
    results: dict = {name: {m: [] for m in modes} for name, _ in GRID[: args.cells]}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for ci, (name, ov) in enumerate(GRID[: args.cells]):
                for m, mode in (modes.items() if rnd % 2 == 0 else reversed(modes.items())):
                    r = run_cell(ov, mode, args.rollouts, Path(tmp), f"c{ci}-{m}-{rnd}")
                    results[name][m].append(r)
                    print(f"round {rnd} {name:20s} {m:5s} {r['rollouts_per_s']:.3f} rollouts/s "
                          f"(generate {r['generate_s']:.2f} s, step {r['step_s']:.2f} s)", flush=True)
    rows, ratios = [], []
    for name, by in results.items():
        s = statistics.median(r["rollouts_per_s"] for r in by["sync"])
        a = statistics.median(r["rollouts_per_s"] for r in by["async"])
        gen = statistics.median(r["generate_s"] for r in by["sync"])
        step = statistics.median(r["step_s"] for r in by["sync"])
        ratios.append(a / s)
        rows.append({"cell": name, "sync_rollouts_per_s": s, "async_rollouts_per_s": a, "speedup": a / s,
                     "sync_generate_frac": gen / step})
    print(f"\n{'cell':22s} {'sync r/s':>9s} {'async r/s':>9s} {'speedup':>8s} {'gen share (sync)':>17s}")
    for r in rows:
        print(f"{r['cell']:22s} {r['sync_rollouts_per_s']:9.3f} {r['async_rollouts_per_s']:9.3f} "
              f"{r['speedup']:7.2f}x {r['sync_generate_frac']:16.0%}")
    print(f"median speedup {statistics.median(ratios):.2f}x, worst {min(ratios):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"staleness": args.staleness, "rounds": args.rounds,
                                         "rollouts": args.rollouts, "cells": rows,
                                         "median_speedup": statistics.median(ratios),
                                         "worst_speedup": min(ratios)}, indent=1))


if __name__ == "__main__":
    main()
