"""Claim 2 (paper §5.4): GSPO's sequence likelihood tolerates a sampler whose precision differs
from the learner's, so the sampler's log-probs can serve as π_old directly. GSPO against GRPO on
the demo task, with the sampler in bf16 and in fp16 and the learner in fp32.

    python examples/claims/precision.py            # 14 cells x 5 seeds, 2 runs at a time: ~20 min on 2 cores
    python examples/claims/precision.py --quick    # 1 seed, 2 cells, 3 rollouts: checks the script

The cells. For each algorithm (GSPO: algo.level=sequence at ε 3e-4 / 4e-4; GRPO: level=token at
0.2 / 0.27, each level's paper clip range, the library default):
    fp32                 the fp32 sampler (its log-probs are the trainer's to ~1e-6), π_old = sampler's
    P-sampler            rollout.mixed_precision=P, π_old = the sampler's log-probs (the paper's §5.4 shortcut)
    P-trainer            the same sampler, π_old recomputed by the fp32 trainer (one no-grad pass)
    P-trainer-tis        that, plus token-level TIS on w = π_old / π_sampler, cap 2 (algo.mismatch_correction=tis)
for P in bf16, fp16 (autocast over the fp32 weights; the learner's passes stay fp32). A correction
with the sampler's π_old does not exist (w ≡ 1; config/rules.py refuses it), so the three P cells
are the whole grid. 2 algorithms x 7 = 14 cells.

The runs. Each is its own `python -m gspo demo seed=S` process (threads=1, OMP_NUM_THREADS=1):
the same 300-step supervised warm-up for a seed in every cell, then --rollouts rollouts of 32
prompts x 8 at lr 1e-4, 4 minibatches per rollout (steps 2-4 off-policy). Equal compute: every
cell has the same rollouts, batch, minibatches and lr; only the overrides above differ. A seed
fixes the warm-up model, the prompts and the sampling seeds, so within a seed cells differ only
in the sampler's precision and what π_old is. Two runs at a time (a thread pool), in the order
seed by seed, every cell of a seed before the next seed (interleaved, so a slow machine phase
falls on every cell alike). Held-out accuracy is greedy decoding of 200 held-out prompts by the
fp32 weights (gspo.train.evaluate), so the precision changes what is learned, not how it is scored.

COLLAPSE (fixed before the runs; `_common.collapsed`): a run collapsed when its final held-out
accuracy is more than 10 points below its accuracy at the start, when a logged loss is not
finite, or when it stopped before its last rollout (a non-zero exit, e.g. the trainer's
non-finite-step guard).

Measured per run, from its metrics.jsonl:
    accuracy      eval/accuracy every --rollouts/6 rollouts (the learning curve), start and end
    mismatch KL   mismatch/kl, the k3 estimate of KL(sampler || fp32 trainer) on the sampled
                  tokens, logged every rollout (step_metrics.mismatch_metrics); mean over rollouts
    seq |Δ|       mismatch/seq_abs_mean: |mean_t (log μ_sampler − log π_trainer)| per sequence, the
                  precision gap in GSPO's length-normalised log-ratio (its clip range is 3e-4/4e-4)
    clip          clip/token_frac on the first minibatch of each rollout (on-policy: with the
                  sampler's π_old anything clipped there is clipped on precision noise alone) and
                  over all steps, counted per token as in the paper's Fig. 2

Writes into --out (default runs/claims/precision): table.md, results.json (every run's raw
numbers and curve), report/report.html (`gspo report` over every run) and each run's directory
(`CELL-seedS`, which examples/claims/clipping.py reads).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import statistics
import time
from pathlib import Path

from _common import cell_mean, fmt, read_run, report, run_demo

ALGOS = {"gspo": "sequence", "grpo": "token"}
# cell -> (sampler precision, pi_old, mismatch correction); fp32 needs no override ("no" is the default)
CELLS = {
    "fp32": ("fp32", "sampler", "none"),
    **{f"{p}-{src}{'-tis' if c == 'tis' else ''}": (p, src, c)
       for p in ("bf16", "fp16") for src, c in (("sampler", "none"), ("trainer", "none"), ("trainer", "tis"))},
}
QUICK_CELLS = [("gspo", "fp16-sampler"), ("grpo", "bf16-trainer-tis")]  # both precisions, pi_old sources, algos
# Time model for the estimate, measured alone on this 2-core VM with one thread: ~10 s to start and
# warm up, ~0.12 s a rollout (evaluations included); two runs at once each run ~15% slower.
SETUP_S, ROLLOUT_S, SHARED_CPU = 10.0, 0.12, 1.15


def overrides(level: str, cell: str) -> list[str]:
    precision, old_logp, correction = CELLS[cell]
    return [f"algo.level={level}", f"rollout.old_logp={old_logp}", f"algo.mismatch_correction={correction}",
            *([] if precision == "fp32" else [f"rollout.mixed_precision={precision}"])]


def seq_gap(run_dir: Path) -> float | None:
    """Mean over rollouts of mismatch/seq_abs_mean (every step of a rollout carries its value)."""
    path = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    per_rollout = {r["rollout"]: r["mismatch/seq_abs_mean"] for r in recs
                   if r.get("mismatch/seq_abs_mean") is not None and math.isfinite(r["mismatch/seq_abs_mean"])}
    return statistics.mean(per_rollout.values()) if per_rollout else None


def estimate_s(n_runs: int, rollouts: int, jobs: int) -> float:
    return math.ceil(n_runs / jobs) * (SETUP_S + ROLLOUT_S * rollouts) * (SHARED_CPU if jobs > 1 else 1.0)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/claims/precision"))
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--rollouts", type=int, default=150, help="GSPO-phase rollouts of every run (the demo's: 300)")
    p.add_argument("--algos", nargs="+", choices=list(ALGOS), default=list(ALGOS))
    p.add_argument("--cells", nargs="+", choices=list(CELLS), default=list(CELLS))
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    grid = [(algo, cell) for cell in a.cells for algo in a.algos]
    if a.quick:
        a.seeds, a.rollouts, grid = 1, 3, QUICK_CELLS
    a.out.mkdir(parents=True, exist_ok=True)
    extra = [f"schedule.rollouts={a.rollouts}", f"eval.every={max(a.rollouts // 6, 1)}", "threads=1"]
    if a.quick:
        # (the quick warm-up answers nothing: every row would be skipped and no gap measured)
        extra += ["rollout.prompts_per_step=8", "eval.num_prompts=32", "data.num_prompts=400",
                  "schedule.skip_zero_advantage=false"]
    jobs = [(seed, algo, cell) for seed in range(a.seeds) for algo, cell in grid]  # interleaved by seed
    est = estimate_s(len(jobs), a.rollouts, a.jobs)
    print(f"{len(grid)} cells x {a.seeds} seeds = {len(jobs)} runs of {a.rollouts} rollouts, {a.jobs} at a time: "
          f"~{est / 60:.0f} min estimated on an otherwise idle 2-core CPU", flush=True)

    def one(job):
        seed, algo, cell = job
        run_dir = a.out / f"{algo}-{cell}-seed{seed}"
        t0 = time.time()
        rc, err = run_demo(run_dir, [f"seed={seed}", *overrides(ALGOS[algo], cell), *extra], quick=a.quick)
        precision, old_logp, correction = CELLS[cell]
        r = {"algo": algo, "cell": cell, "sampler": precision, "old_logp": old_logp, "correction": correction,
             "seed": seed, "rc": rc, "seconds": round(time.time() - t0, 1), **read_run(run_dir, a.rollouts),
             "mismatch_seq_abs": seq_gap(run_dir), "dir": str(run_dir)}
        if rc != 0:
            r["error"] = err
        print(json.dumps({x: r[x] for x in ("algo", "cell", "seed", "rc", "acc_before", "acc_after", "collapsed",
                                            "mismatch_kl", "clip_token_frac_first_minibatch", "seconds")}), flush=True)
        return r

    t_all = time.time()
    with cf.ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(one, jobs))
    minutes = (time.time() - t_all) / 60
    lines = table(results, grid, a, minutes, est / 60)
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    (a.out / "results.json").write_text(json.dumps(results, indent=1))
    report([Path(r["dir"]) for r in results], a.out)
    print("\n".join(lines))
    return results


def table(results: list[dict], grid: list[tuple[str, str]], a, minutes: float, est_minutes: float) -> list[str]:
    """The cells' table, the paired comparison with each algorithm's fp32 cell, and the curves."""
    by_cell = {(algo, cell): [r for r in results if r["algo"] == algo and r["cell"] == cell] for algo, cell in grid}
    command = "--quick" if a.quick else f"--seeds {a.seeds} --rollouts {a.rollouts}"
    head = (f"`python examples/claims/precision.py {command}` ({minutes:.0f} min, estimated {est_minutes:.0f}). "
            "Learner fp32 in every cell. Collapse (fixed before the runs): final held-out accuracy more than 10 "
            "points below the start, a non-finite loss, or a run that stopped early.")
    columns = ("| algorithm | sampler | π_old | correction | seeds | accuracy before → after (mean) | after, per seed | "
               "after − fp32 cell (paired mean; seeds lower) | collapsed | mismatch KL (mean) | seq \\|Δlogp\\| (mean) | "
               "token clip frac (first minibatch) | token clip frac (all steps) |")
    lines = [head, "", columns, "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (algo, cell), rs in by_cell.items():
        base = {r["seed"]: r["acc_after"] for r in by_cell.get((algo, "fp32"), [])}
        pairs = [r["acc_after"] - base[r["seed"]] for r in rs if r["seed"] in base and cell != "fp32"]
        paired = f"{fmt(statistics.mean(pairs))}; {sum(d < 0 for d in pairs)}/{len(pairs)}" if pairs else "–"
        precision, old_logp, correction = CELLS[cell]
        lines.append(
            f"| {algo.upper()} | {precision} | {old_logp} | {correction} | {len(rs)} | "
            f"{fmt(cell_mean(rs, 'acc_before'))} → **{fmt(cell_mean(rs, 'acc_after'))}** | "
            f"{', '.join(fmt(r['acc_after']) for r in rs)} | {paired} | {sum(r['collapsed'] for r in rs)} | "
            f"{sci(cell_mean(rs, 'mismatch_kl'))} | {sci(cell_mean(rs, 'mismatch_seq_abs'))} | "
            f"{fmt(cell_mean(rs, 'clip_token_frac_first_minibatch'), 4)} | {fmt(cell_mean(rs, 'clip_token_frac'), 4)} |")
    failed = [r for r in results if r["rc"] != 0]
    for r in failed:
        last = (r.get("error") or "").strip().splitlines()[-1:] or ["?"]
        lines.append(f"\nStopped: {r['algo']}-{r['cell']}-seed{r['seed']} (exit {r['rc']}): {last[0]}")
    curves = {k: [r["curve"] for r in rs if r["curve"]] for k, rs in by_cell.items()}
    points = sorted({x for cs in curves.values() for c in cs for x, _ in c})
    lines += ["", "Learning curves: held-out accuracy after each rollout count, mean over seeds.", "",
              "| algorithm | cell | " + " | ".join(str(x) for x in points) + " |",
              "|---|---|" + "---:|" * len(points)]
    for (algo, cell), cs in curves.items():
        at = [[v for c in cs for x, v in c if x == q] for q in points]  # every seed's accuracy at rollout q
        means = [statistics.mean(v) if v else None for v in at]
        lines.append(f"| {algo.upper()} | {cell} | " + " | ".join(fmt(m) for m in means) + " |")
    return lines


def sci(x) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1e}"


if __name__ == "__main__":
    main()
