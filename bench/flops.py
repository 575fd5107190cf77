"""FLOP/s of a GSPO training step's phases against this machine's measured matmul peak of the
precision each phase runs in (fp32, or bf16 under rollout.mixed_precision / model.mixed_precision).

    python bench/flops.py                                 # hidden 1024, 4 layers, 64 x 128 tokens (~2.5 min)
    python bench/flops.py --quick                         # seconds: the test's smoke run
    python bench/flops.py --out flops.json tiny.num_layers=6   # key=value overrides, as bench/step.py
    python bench/flops.py model.mixed_precision=bf16 rollout.mixed_precision=bf16   # the bf16 step
    python bench/flops.py --model compute-dense           # a bench/trl_compare.py model, saved and loaded

(a) Matmul peaks. fp32 and bf16 `torch.mm` (both measured in the same run; bf16 runs on AMX
where the CPU has it) at the shapes the measured model runs (tokens x hidden times
hidden x {hidden, hidden/2 (k, v), intermediate}, intermediate x hidden, their backward
counterparts dX = dY W and dW = X^T dY, and the LM head), plus (2048 x hidden) x (hidden x
4 hidden) and a 2048^3 square, with the torch thread count the step runs with (the library
default: 1 thread on <= 4 cores, every core for a compute-bound model: gspo.train.threads.setup_threads
and threads_for_model). Each shape is timed in blocks of
>= --mm-seconds; its figure is its best block; the peak is the best shape.

(b) One real training step, timed by phase through bench/step.py (the functions gspo.train.train
calls), on a compute-bound shape: the tiny Qwen3 (hidden 1024, 4 layers; the tiny model's MLP
is always 128 wide, heads 4 / kv heads 2), 8 prompts x 8 completions, completions forced to
run to max_new_tokens=128 (bench/step.py:force_full_length; the random model would otherwise end
~1 in |V| tokens with EOS). FLOPs are counted analytically from the step's own tensors
(bench/flop_count.py: the formulas, checked against torch's FlopCounterMode): every
forward/backward runs on the trimmed (b, L) rectangle of its micro-batch (Rollout.select), so
padding positions inside it are computed and counted.

"% of peak" = executed FLOPs / phase time / the matmul peak of the phase's precision (generate:
rollout.mixed_precision; pi_old and update: model.mixed_precision); "% of fp32 peak" beside it. Update time includes the 4 AdamW steps,
gradient clipping and the loss; pi_old and generate include their Python overheads.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import step as bench_step  # noqa: E402  (bench/step.py)
from flop_count import PHASES, QUICK, cross_check, model_dims, step_cross_check, step_flops  # noqa: E402  (bench/flop_count.py)

# the compute-bound default shape of (b). rollout.old_logp=trainer: the pi_old pass is measured
# as MoE, bf16 and vLLM runs have it (a dense fp32 run on the hf backend skips it by default);
# schedule.skip_zero_advantage=false: every row runs, whatever the rewards
# (equal-reward groups would otherwise leave the passes)
DEFAULT = ["tiny.hidden_size=1024", "tiny.num_layers=4", "rollout.max_new_tokens=128",
           "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.old_logp=trainer",
           "schedule.skip_zero_advantage=false"]


# ---------------------------------------------------------------- (a) matmul peak


def matmul_shapes(d: dict, tokens: int, pi_old_tokens: int, big: bool = True) -> list[tuple[str, int, int, int, bool]]:
    """(label, m, k, n, A transposed) of the model's matmuls at `tokens` rows (an update
    micro-batch), their backward counterparts, q at `pi_old_tokens` rows (the pi_old pass runs
    every row at once), and two generic big ones (the 2048^3 square only when `big`)."""
    H, I, V, A, kv = d["H"], d["intermediate"] or 4 * d["H"], d["V"], d["A"], d["kv"]
    return [
        ("x W_q (fwd)", tokens, H, A, False),
        ("x W_kv (fwd)", tokens, H, kv, False),
        ("x W_up (fwd)", tokens, H, I, False),
        ("h W_down (fwd)", tokens, I, H, False),
        ("dY W_q^T (bwd dX)", tokens, A, H, False),
        ("X^T dY (bwd dW)", H, tokens, A, True),
        ("x W_q (pi_old rows)", pi_old_tokens, H, A, False),
        ("LM head", tokens, H, V, False),
        ("2048xH . Hx4H", 2048, H, 4 * H, False),
        *([("2048^3", 2048, 2048, 2048, False)] if big else []),
    ]


def matmul_peak(shapes, seconds: float = 0.5, blocks: int = 3, dtype=None) -> list[dict]:
    """GFLOP/s of torch.mm per shape (fp32, or `dtype`): the best of `blocks` blocks of >= `seconds` each."""
    import torch

    dtype = dtype or torch.float32
    out = []
    g = torch.Generator().manual_seed(0)
    for label, m, k, n, trans in shapes:
        a = (torch.randn(k, m, generator=g).t() if trans else torch.randn(m, k, generator=g)).to(dtype)
        b = torch.randn(k, n, generator=g).to(dtype)
        c = torch.empty(m, n, dtype=dtype)
        torch.mm(a, b, out=c)  # warm
        flops = 2 * m * k * n
        best = 0.0
        for _ in range(blocks):
            reps, t0 = 0, time.perf_counter()
            while True:
                torch.mm(a, b, out=c)
                reps += 1
                dt = time.perf_counter() - t0
                if dt >= seconds:
                    break
            best = max(best, flops * reps / dt / 1e9)
        out.append({"label": label, "m": m, "k": k, "n": n, "a_transposed": trans, "gflops": best})
    return out


# ---------------------------------------------------------------- main


def run(args, overrides: list[str]) -> dict:
    import torch

    from gspo.train.threads import setup_threads

    threads = setup_threads(args.threads)
    t_start = time.perf_counter()
    check = cross_check()
    check_step = step_cross_check(threads=args.threads)
    steps = []

    def on_step(run, rollout, rollout_index, rec):
        rec.update(step_flops(run, rollout, rollout_index))
        rec["dims"] = model_dims(run.policy)
        rec["threads"] = torch.get_num_threads()  # the run's own (threads_for_model may give a big model every core)
        steps.append(rec)

    if args.model:  # a realistic layer (MLP 4x hidden), saved with save_pretrained and loaded by path
        from trl_compare import WORKLOADS, build_model_dir

        tmp = tempfile.mkdtemp(prefix="flops-model-")
        atexit.register(shutil.rmtree, tmp, True)
        model_dir = Path(tmp) / args.model
        build_model_dir(model_dir, WORKLOADS[args.model])
        overrides = [f"model.name_or_path={model_dir}", *overrides]
    res = bench_step.measure(None, [*(QUICK if args.quick else DEFAULT), *overrides], threads=args.threads,
                             warmup=args.warmup, rollouts=args.rollouts, repeats=1,
                             prepare=None if args.natural_length else bench_step.force_full_length, on_step=on_step)
    recs = res["records"]
    d = recs[0]["dims"]
    # the update's micro-batch rows x columns: the tokens of the model's forward matmuls
    mb_tokens = round(statistics.fmean(r["update_positions"] / r["update_micro_batches"] for r in recs))
    threads = recs[0]["threads"]
    torch.set_num_threads(threads)  # the peaks at the step's own thread count
    old_tokens = round(statistics.fmean(r["pi_old_positions"] for r in recs))
    shapes = matmul_shapes(d, max(mb_tokens, 64), old_tokens, big=not args.quick)
    kw = dict(seconds=0.05 if args.quick else args.mm_seconds, blocks=2 if args.quick else 3)
    mm = matmul_peak(shapes, **kw)
    mm16 = matmul_peak(shapes, dtype=torch.bfloat16, **kw)
    peaks = {"fp32": max(x["gflops"] for x in mm), "bf16": max(x["gflops"] for x in mm16)}
    given = [*(QUICK if args.quick else DEFAULT), *overrides]
    learn = "bf16" if "model.mixed_precision=bf16" in given else "fp32"
    precision = {"generate": "bf16" if "rollout.mixed_precision=bf16" in given else "fp32", "pi_old": learn,
                 "update": learn}
    phases = {}
    for p in PHASES:
        t = sum(r[p] for r in recs)
        f = sum(r[f"flops_{p}"] for r in recs)
        peak = peaks[precision[p]]
        phases[p] = {"s_per_step": t / len(recs), "gflop_per_step": f / len(recs) / 1e9, "precision": precision[p],
                     "gflops": f / t / 1e9, "pct_of_peak": 100 * f / t / 1e9 / peak,
                     "pct_of_fp32_peak": 100 * f / t / 1e9 / peaks["fp32"],
                     "per_step_gflops": [r[f"flops_{p}"] / r[p] / 1e9 for r in recs]}
    fm = sum(r["flops_update_model"] for r in recs)
    phases["update"]["model_gflops"] = fm / sum(r["update"] for r in recs) / 1e9
    phases["update"]["model_pct_of_peak"] = 100 * phases["update"]["model_gflops"] / peaks[learn]
    pos = sum(r["update_positions"] for r in recs)
    real = sum(r["update_real_tokens"] for r in recs)
    return {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": threads,
                    "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")},
        "matmul": mm, "matmul_bf16": mm16, "matmul_peak_gflops": peaks["fp32"],
        "matmul_peak_gflops_bf16": peaks["bf16"], "dims": d, "cross_check": check, "cross_check_step": check_step,
        "step": {k: v for k, v in res.items() if k not in ("records", "blocks")},
        "records": [{k: v for k, v in r.items() if k != "dims"} for r in recs],
        "mean_completion_tokens": statistics.fmean(r["tokens"] for r in recs) / res["samples"],
        "update_pad_share": 1 - real / pos, "update_micro_batch_tokens": mb_tokens,
        "pi_old_pad_share": 1 - sum(r["pi_old_real_tokens"] for r in recs) / max(sum(r["pi_old_positions_total"] for r in recs), 1),
        "update_pad_share_sorted4": 1 - real / sum(r["update_positions_sorted4"] for r in recs),
        "generate_pad_share": 1 - sum(r["generate_real_tokens"] for r in recs) / sum(r["generate_row_steps"] for r in recs),
        "phases": phases, "wall_s": time.perf_counter() - t_start, "model": args.model,
    }


def print_report(out: dict) -> None:
    d, st = out["dims"], out["step"]
    print(f"torch {out['machine']['torch']}, {out['machine']['threads']} thread(s) of {out['machine']['cpus']} CPUs, "
          f"OMP_WAIT_POLICY={out['machine']['omp_wait_policy'] or 'unset'}")
    print("\n(a) torch.mm, best block of the shape (m x k . k x n), fp32 and bf16:")
    for x, y in zip(out["matmul"], out["matmul_bf16"]):
        print(f"  {x['label']:<20}{x['m']:>6} x{x['k']:>6} . x{x['n']:>6}  {x['gflops']:8.1f} {y['gflops']:8.1f} GFLOP/s")
    print(f"  matmul peak: fp32 {out['matmul_peak_gflops']:.1f}, bf16 {out['matmul_peak_gflops_bf16']:.1f} GFLOP/s")
    print(f"\n(b) {out['model'] or 'tiny'} Qwen3: hidden {d['H']}, {d['layers']} layers, MLP {d['intermediate']}, attention width {d['A']}, "
          f"vocab {d['V']}, N = {d['N'] / 1e6:.2f}M matmul weights; {st['samples']} completions x "
          f"max_new_tokens {st['max_new_tokens']}, mean completion {out['mean_completion_tokens']:.1f} tokens; "
          f"{st['warmup']} warm-up + {st['rollouts']} timed steps")
    print(f"    update: {out['update_micro_batch_tokens']} positions per micro-batch (rows x trimmed columns), "
          f"{100 * out['update_pad_share']:.1f}% of them padding (pi_old pass {100 * out['pi_old_pad_share']:.1f}%; "
          f"generate: {100 * out['generate_pad_share']:.1f}% of decode row-steps on finished rows); "
          f"in micro-batches of 4 rows sorted by length: {100 * out['update_pad_share_sorted4']:.1f}%")
    print(f"{'phase':<10}{'prec':>5}{'s/step':>9}{'GFLOP/step':>12}{'GFLOP/s':>10}{'% of peak':>11}{'% fp32':>8}"
          f"   per step GFLOP/s")
    for p in PHASES:
        x = out["phases"][p]
        print(f"{p:<10}{x['precision']:>5}{x['s_per_step']:>9.3f}{x['gflop_per_step']:>12.1f}{x['gflops']:>10.1f}"
              f"{x['pct_of_peak']:>10.1f}%{x['pct_of_fp32_peak']:>7.1f}%   {', '.join(f'{v:.1f}' for v in x['per_step_gflops'])}")
    u = out["phases"]["update"]
    print(f"update in model FLOPs (no recomputation: attention 12, head 6): {u['model_gflops']:.1f} GFLOP/s, "
          f"{u['model_pct_of_peak']:.1f}% of the {u['precision']} peak")
    c = out["cross_check"]
    print("cross-check with FlopCounterMode (tiny model): " + ", ".join(
        f"{k} {c[k]['formula']} vs {c[k]['counted']}" for k in ("forward", "train", "generate")))
    c = out["cross_check_step"]
    print("  and on a whole quick-shape step: " + ", ".join(
        f"{k} {c[k]['formula']} vs {c[k]['counted']}" for k in PHASES))
    print(f"({out['wall_s']:.0f} s in all; CPU during the timed steps: own {st['cpu_own']:.2f}, "
          f"others {st['cpu_others']:.2f} cores)")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (after the default shape)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = the library's auto default)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 1)")
    ap.add_argument("--rollouts", type=int, default=None, help="timed steps (default 3; --quick 1)")
    ap.add_argument("--mm-seconds", type=float, default=0.5, help="seconds per matmul timing block")
    ap.add_argument("--natural-length", action="store_true",
                    help="let completions end at EOS (not forced to max_new_tokens): shows the padding computed")
    ap.add_argument("--quick", action="store_true", help="a tiny shape, one step: seconds (for the test)")
    ap.add_argument("--model", default=None, metavar="WORKLOAD",
                    help="measure a bench/trl_compare.py WORKLOADS model (e.g. compute-dense: hidden 512, 8 layers, "
                         "MLP 2048) instead of the built-in tiny one, whose MLP is 128 wide")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"not a key=value override: {bad[0]}")
    args.warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup
    args.rollouts = (1 if args.quick else 3) if args.rollouts is None else args.rollouts
    out = run(args, args.overrides)
    print_report(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return out


if __name__ == "__main__":
    main()
