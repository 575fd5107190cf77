"""Learning with stale rollouts: the demo task in sync mode and in async mode with K = 1, 2, 4,
GSPO against GRPO, 3 seeds each.

    python bench/async_learning.py --json docs/figures/async_learning.json      (~30 min on 2 cores)
    python bench/async_learning.py --seeds 0 --staleness 1 --levels sequence    (one cell)
    python bench/async_learning.py --staleness 2 --extra rollout.old_logp=trainer algo.mismatch_correction=tis \
        --tag " trainer+tis" --json docs/figures/async_learning_tis.json      (the corrections)

Each run is `gspo demo` (warm-up, then the GSPO phase of 300 rollouts) with `seed`,
`algo.level` (sequence = GSPO, token = GRPO, each with the paper's clip range) and the mode as
overrides; the same seed gives the same warm-up model, prompts and sampling seeds in every
mode, so a cell differs from sync mode only in which weights sampled its rollouts. π_old is
the sampler's log-probs in every mode (async mode's default, and sync mode's for this dense
fp32 model), so with K > 0 the first minibatch's ratio already carries K versions of drift.

Async mode's schedule is fixed, so these results do not depend on the machine's timing (a
rerun gives the same numbers). Reported per cell: held-out greedy accuracy every 50 rollouts
(mean and each seed), the token clip fraction over the run (mean of clip/token_frac) and its
mean on the first minibatch of each rollout, and the final accuracy's spread over seeds.
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


def run(out: Path, overrides: list[str]) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "gspo", "demo", "--out", str(out), *overrides, "logging.console=false"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{out} failed:\n{p.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["rollout"], r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None]
    steps = [r for r in recs if "clip/token_frac" in r and r["clip/token_frac"] is not None]
    firsts = {}
    for r in steps:  # the first optimizer step of each rollout
        firsts.setdefault(r["rollout"], r)
    return {"curve": curve, "clip_token_frac": statistics.mean(r["clip/token_frac"] for r in steps),
            "clip_token_frac_first_minibatch": statistics.mean(r["clip/token_frac"] for r in firsts.values()),
            "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in firsts.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="0 = sync mode")
    ap.add_argument("--levels", nargs="+", default=["sequence", "token"])
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run, e.g. rollout.old_logp=trainer")
    ap.add_argument("--tag", default="", help="appended to every cell's name")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cells = {}
    with tempfile.TemporaryDirectory() as tmp:
        for level in args.levels:
            for k in args.staleness:
                mode = [] if k == 0 else ["rollout.mode=async", f"rollout.max_staleness={k}"]
                name = f"{'GSPO' if level == 'sequence' else 'GRPO'} {'sync' if k == 0 else f'async K={k}'}{args.tag}"
                runs = []
                for seed in args.seeds:
                    r = run(Path(tmp) / f"{level}-{k}-{seed}", [f"seed={seed}", f"algo.level={level}", *mode, *args.extra])
                    runs.append(r)
                    print(f"{name:16s} seed {seed}: accuracy {[round(a, 3) for _, a in r['curve']]}, "
                          f"clip/token_frac {r['clip_token_frac']:.4f}", flush=True)
                finals = [r["curve"][-1][1] for r in runs]
                cells[name] = {
                    "level": level, "staleness": k, "seeds": args.seeds,
                    "rollouts": [x for x, _ in runs[0]["curve"]],
                    "accuracy_mean": [statistics.mean(r["curve"][i][1] for r in runs) for i in range(len(runs[0]["curve"]))],
                    "accuracy_by_seed": [[a for _, a in r["curve"]] for r in runs],
                    "final_mean": statistics.mean(finals), "final_min": min(finals), "final_max": max(finals),
                    "clip_token_frac": statistics.mean(r["clip_token_frac"] for r in runs),
                    "clip_token_frac_first_minibatch": statistics.mean(r["clip_token_frac_first_minibatch"] for r in runs),
                }
    print(f"\n{'cell':16s} {'start':>6s} {'final (mean, min-max)':>24s} {'clip tok':>9s} {'clip tok mb1':>12s}")
    for name, c in cells.items():
        print(f"{name:16s} {c['accuracy_mean'][0]:6.3f} {c['final_mean']:10.3f} ({c['final_min']:.3f}-{c['final_max']:.3f})"
              f" {c['clip_token_frac']:9.4f} {c['clip_token_frac_first_minibatch']:12.4f}")
    if args.json:
        args.json.write_text(json.dumps(cells, indent=1))


if __name__ == "__main__":
    main()
