"""Step time by phase against group size G, response length and model width, with log-log fits.

    python bench/scaling.py                      # 3 axes x 4 points, 8 interleaved rounds (~2 min)
    python bench/scaling.py --quick              # seconds: the test's smoke run
    python bench/scaling.py --rounds 8 --out scaling.json --axes G,length

One axis moves at a time from the base shape: the tiny Qwen3 of hidden 256, 2 layers, 8 prompts
x G=8 completions, max_new_tokens=32, the library's 4 minibatches and thread default.

    G       rollout.group_size      4, 8, 16, 32   (prompts fixed at 8: 32 ... 256 completions)
    length  rollout.max_new_tokens  16, 32, 64, 128
    width   tiny.hidden_size  128, 256, 512, 1024   (2 layers; the tiny MLP stays 128 wide)

Every completion runs to max_new_tokens (bench/step.py:force_full_length: the generator's EOS id
is one past the vocabulary; the random model would otherwise stop ~1 in |V| tokens); the mean
completion length is reported per point. Steps are timed through bench/step.py:timed_step, i.e.
the functions gspo.train.train calls, phase by phase.

Noise: a timing on this kind of machine moves by +-25 %, so every point's context is built once,
warmed up (--warmup steps), and then the points are run one step each per round, the rounds in
alternating order (no point always first or last), --rounds times. A point's time is the median
over rounds. The exponent of an axis and phase is the least-squares slope of log(time) against
log(x) over the axis's points (medians), with the min-max of the same fit done round by round;
1.0 is linear, the issue's goal for G and length is <= 1.1. Next to it, the "FLOP exponent": the
same fit of the phase's executed FLOPs (bench/flop_count.py:step_flops) -- what the arithmetic alone
would give (attention is quadratic in length, the weights quadratic in width) -- and the
GFLOP/s at each point. Time exponent above the FLOP exponent = the phase gets less efficient
as the axis grows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import flop_count  # noqa: E402  (bench/flop_count.py)
import step as bench_step  # noqa: E402  (bench/step.py)

PHASES = ("step", "generate", "pi_old", "update", "score")
FLOP_PHASES = ("generate", "pi_old", "update")
# rollout.old_logp=trainer: the pi_old pass is measured too (MoE, bf16 and vLLM runs have it; a
# dense fp32 run on the hf backend skips it by default); every row runs, whatever the rewards
BASE = {"tiny.hidden_size": 256, "tiny.num_layers": 2, "rollout.prompts_per_step": 8,
        "rollout.group_size": 8, "rollout.max_new_tokens": 32, "rollout.old_logp": "trainer",
        "schedule.skip_zero_advantage": False}
AXES = {"G": ("rollout.group_size", [4, 8, 16, 32]),
        "length": ("rollout.max_new_tokens", [16, 32, 64, 128]),
        "width": ("tiny.hidden_size", [128, 256, 512, 1024])}
QUICK_BASE = {"rollout.old_logp": "trainer", "schedule.skip_zero_advantage": False,
              "tiny.hidden_size": 32, "tiny.num_layers": 1,
              "rollout.prompts_per_step": 2,
              "rollout.group_size": 2, "rollout.max_new_tokens": 4, "data.num_prompts": 64}
QUICK_AXES = {"G": ("rollout.group_size", [2, 4]), "length": ("rollout.max_new_tokens", [4, 8]),
              "width": ("tiny.hidden_size", [32, 64])}


def fit_exponent(xs, ys) -> float:
    """Least-squares slope of log(y) against log(x): y ~ c x^k -> k."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    if sxx == 0:
        raise ValueError("need at least two distinct x values")
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx


def points(base: dict, axes: dict, names: list[str]) -> tuple[list[dict], dict]:
    """Unique configs (dict of overrides) and, per axis, [(x, config index)]."""
    configs: list[dict] = []
    where: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        key, values = axes[name]
        where[name] = []
        for v in values:
            c = {**base, key: v}
            if c not in configs:
                configs.append(c)
            where[name].append((v, configs.index(c)))
    return configs, where


def run(args, extra: list[str]) -> dict:
    import torch

    from gspo.train import loop as train

    base, axes = (QUICK_BASE, QUICK_AXES) if args.quick else (BASE, AXES)
    names = [n.strip() for n in args.axes.split(",") if n.strip()]
    unknown = [n for n in names if n not in axes]
    if unknown or not names:
        raise SystemExit(f"--axes: unknown axis {unknown[0] if unknown else ''!r}; choose from {', '.join(axes)}")
    configs, where = points(base, axes, names)
    t_start = time.perf_counter()
    times = [[] for _ in configs]   # per config: one dict of phase seconds per round
    tokens = [[] for _ in configs]  # mean completion length per timed step
    flops = [[] for _ in configs]   # executed FLOPs per phase per timed step (bench/flops.py)
    info = [None] * len(configs)
    ctxs = []
    with tempfile.TemporaryDirectory(prefix="gspo-bench-scaling-") as tmp:
        try:
            for i, c in enumerate(configs):  # build and warm every point first
                ov = [f"{k}={v}" for k, v in c.items()] + list(extra)
                cfg, ctx, t_build = bench_step.build(None, ov, threads=args.threads, steps=args.warmup + args.rounds,
                                                     out_dir=os.path.join(tmp, str(i)))
                bench_step.force_full_length(ctx)
                state = train.TrainerState()
                ctxs.append((ctx, state))
                for _ in range(args.warmup):
                    bench_step.timed_step(ctx, state)
                info[i] = {"overrides": ov, "params": sum(p.numel() for p in ctx.policy.parameters()),
                           "samples": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
                           "max_new_tokens": cfg.rollout.max_new_tokens, "build_s": t_build}
            t_warm = time.perf_counter() - t_start
            cpu0 = bench_step._cpu_sample()
            for r in range(args.rounds):
                order = range(len(configs)) if r % 2 == 0 else reversed(range(len(configs)))
                for i in order:
                    ctx, state = ctxs[i]
                    index = state.rollout
                    t, rollout = bench_step.timed_step(ctx, state)
                    flops[i].append(flop_count.step_flops(ctx, rollout, index))
                    times[i].append(t)
                    tokens[i].append(float(rollout.completion_mask.sum()) / rollout.num_samples)
                if not args.quiet:
                    print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
            cpu1 = bench_step._cpu_sample()
        finally:
            for ctx, _ in ctxs:
                ctx.close()
    wall = cpu1[0] - cpu0[0]
    own = (cpu1[3] - cpu0[3]) / wall
    others = max((cpu1[1] - cpu0[1]) / wall - own, 0.0)
    med = [{p: statistics.median(t[p] for t in ts) for p in PHASES} for ts in times]
    med_flops = [{p: statistics.median(f[f"flops_{p}"] for f in fs) for p in FLOP_PHASES} for fs in flops]
    fits = {}
    for name, pts in where.items():
        xs = [x for x, _ in pts]
        fits[name] = {}
        for p in PHASES:
            if any(med[i][p] <= 0 for _, i in pts) or (
                    p in FLOP_PHASES and any(med_flops[i][p] <= 0 for _, i in pts)):  # e.g. no pi_old pass
                continue
            per_round = [fit_exponent(xs, [times[i][r][p] for _, i in pts]) for r in range(args.rounds)]
            fits[name][p] = {"exponent": fit_exponent(xs, [med[i][p] for _, i in pts]),
                             "min": min(per_round), "max": max(per_round)}
            if p in FLOP_PHASES:  # the exponent the phase's arithmetic alone would have
                fits[name][p]["flop_exponent"] = fit_exponent(xs, [med_flops[i][p] for _, i in pts])
    return {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "base": base, "axes": {n: {"key": axes[n][0], "points": [{"x": x, "config": i} for x, i in where[n]]}
                               for n in names},
        "configs": [{**info[i], "median": med[i], "rounds": times[i],
                     "mean_completion_tokens": statistics.fmean(tokens[i]),
                     "gflop_per_step": {p: med_flops[i][p] / 1e9 for p in FLOP_PHASES},
                     "gflops": {p: med_flops[i][p] / med[i][p] / 1e9 for p in FLOP_PHASES}} for i in range(len(configs))],
        "fits": fits, "rounds": args.rounds, "warmup": args.warmup,
        "build_and_warmup_s": t_warm, "wall_s": time.perf_counter() - t_start,
        "cpu_own": own, "cpu_others": others,
    }


def _span(fit: dict) -> str:
    return f"{fit['min']:.2f}..{fit['max']:.2f}"


def print_report(out: dict) -> None:
    m = out["machine"]
    print(f"torch {m['torch']}, {m['threads']} thread(s) of {m['cpus']} CPUs, OMP_WAIT_POLICY={m['omp_wait_policy'] or 'unset'}; "
          f"base {', '.join(f'{k}={v}' for k, v in out['base'].items())}")
    print(f"{out['warmup']} warm-up step(s) per point, then {out['rounds']} interleaved rounds of one step per point; "
          f"median over rounds (s/step)")
    for name, ax in out["axes"].items():
        print(f"\n{name} ({ax['key']})")
        print(f"{'x':>6}{'completions':>13}{'mean len':>10}{'params':>10}" + "".join(f"{p:>13}" for p in PHASES))
        for pt in ax["points"]:
            c = out["configs"][pt["config"]]
            print(f"{pt['x']:>6}{c['samples']:>13}{c['mean_completion_tokens']:>10.1f}{c['params'] / 1e6:>9.2f}M"
                  + "".join(f"{c['median'][p]:>13.3f}" for p in PHASES))
        f = out["fits"][name]
        print(f"{'exponent':>39}" + "".join(f"{f[p]['exponent']:>13.2f}" if p in f else f"{'-':>13}" for p in PHASES))
        print(f"{'per-round min..max':>39}" + "".join(
            f"{_span(f[p]) if p in f else '-':>13}" for p in PHASES))
        print(f"{'FLOP exponent':>39}" + "".join(
            f"{f[p]['flop_exponent']:>13.2f}" if "flop_exponent" in f.get(p, {}) else f"{'':>13}" for p in PHASES))
        rates = {p: "/".join(f"{out['configs'][pt['config']]['gflops'][p]:.0f}" for pt in ax["points"])
                 for p in FLOP_PHASES}
        print(f"{'GFLOP/s at the points':>39}" + "".join(f"{rates.get(p, ''):>13}" for p in PHASES))
    print(f"\n{out['wall_s']:.0f} s in all ({out['build_and_warmup_s']:.0f} s building and warming up); CPU during the "
          f"rounds: own {out['cpu_own']:.2f}, others {out['cpu_others']:.2f} cores")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides applied to every point (after the axes')")
    ap.add_argument("--axes", default="G,length,width", help="comma-separated: G, length, width")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timed rounds (default 8; --quick 1)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per point first (default 1; --quick 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = the library's auto default)")
    ap.add_argument("--quick", action="store_true", help="two tiny points per axis, one round: seconds (for the test)")
    ap.add_argument("--quiet", action="store_true", help="no per-round progress lines")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"not a key=value override: {bad[0]}")
    args.rounds = (1 if args.quick else 8) if args.rounds is None else args.rounds
    args.warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup
    out = run(args, args.overrides)
    print_report(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
