"""Claim: GSPO tolerates stale rollouts. GSPO against GRPO on the demo task, in sync mode (K = 0)
and in async mode with rollouts sampled up to K = 1, 2 and 4 versions behind.

    python examples/claims/staleness.py                    # 2 algorithms x 4 K x 5 seeds, ~25 min on 2 cores
    python examples/claims/staleness.py --quick            # seconds: checks the script

Each run is `gspo demo seed=S` (warm-up, then `--rollouts` GSPO-phase rollouts of 32 x 8 at lr
1e-4, 4 minibatches) with `algo.level` (sequence = GSPO at eps 3e-4 / 4e-4, token = GRPO at 0.2 /
0.27: each level's paper clip range) and, for K > 0, `rollout.mode=async rollout.max_staleness=K`.
A seed gives the same warm-up model, prompts and sampling seeds at every K, so cells differ only
in which weights sampled the rollouts. π_old is the sampler's log-probs everywhere (async mode's
default, and sync mode's for this dense fp32 model), as the paper takes the engine's (§5.4): with
K > 0 the first minibatch's ratio already carries K versions of drift, and the clip fraction of
the first minibatch measures it. Async mode's schedule is fixed, so the numbers do not depend on
the machine's timing.

Collapse (fixed before the runs, `_common.COLLAPSE`): the final held-out accuracy more than 10
points below the start, a non-finite loss, or a run that stopped early.

Writes into --out: table.md, results.json (every run's curve and metrics) and report/ (`gspo
report` over every run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from _common import cell_mean, fmt, read_run, report, run_demo

ALGOS = {"gspo": "sequence", "grpo": "token"}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/claims/staleness"))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4], help="K; 0 = sync mode")
    p.add_argument("--rollouts", type=int, default=150)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.staleness, a.rollouts = 1, [1], 3
    a.out.mkdir(parents=True, exist_ok=True)
    extra = [f"schedule.rollouts={a.rollouts}", f"eval.every={max(a.rollouts // 6, 1)}", "threads=1"]
    if a.quick:
        extra += ["rollout.prompts_per_step=8", "eval.num_prompts=32", "data.num_prompts=400"]
    results, dirs = [], []
    t_all = time.time()
    for seed in range(a.seeds):
        for k in a.staleness:
            for name, level in ALGOS.items():  # interleaved: every cell of a seed before the next seed
                run_dir = a.out / f"{name}-K{k}-seed{seed}"
                mode = [] if k == 0 else ["rollout.mode=async", f"rollout.max_staleness={k}"]
                t0 = time.time()
                rc, err = run_demo(run_dir, [f"seed={seed}", f"algo.level={level}", *mode, *extra], quick=a.quick)
                r = {"algo": name, "K": k, "seed": seed, "rc": rc, "seconds": round(time.time() - t0, 1),
                     **read_run(run_dir, a.rollouts)}
                if rc != 0:
                    r["error"] = err
                results.append(r)
                dirs.append(run_dir)
                print(json.dumps({x: r[x] for x in ("algo", "K", "seed", "acc_before", "acc_after", "collapsed",
                                                    "clip_token_frac", "seconds")}), flush=True)
    lines = [f"`python examples/claims/staleness.py --seeds {a.seeds} --rollouts {a.rollouts}` "
             f"({(time.time() - t_all) / 60:.0f} min). Collapse: final accuracy > 10 points below the start, "
             "a non-finite loss, or an early stop.", "",
             "| algorithm | K | seeds | accuracy before → after (mean) | after, per seed | collapsed | token clip frac "
             "(all steps) | token clip frac (first minibatch) | staleness (mean) |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for name in ALGOS:
        for k in a.staleness:
            rs = [r for r in results if r["algo"] == name and r["K"] == k]
            lines.append(f"| {name} | {k} | {len(rs)} | {fmt(cell_mean(rs, 'acc_before'))} → "
                         f"**{fmt(cell_mean(rs, 'acc_after'))}** | {', '.join(fmt(r['acc_after']) for r in rs)} | "
                         f"{sum(r['collapsed'] for r in rs)} | {fmt(cell_mean(rs, 'clip_token_frac'), 4)} | "
                         f"{fmt(cell_mean(rs, 'clip_token_frac_first_minibatch'), 4)} | "
                         f"{fmt(cell_mean(rs, 'staleness_mean'), 2)} |")
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    report(dirs, a.out)
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
