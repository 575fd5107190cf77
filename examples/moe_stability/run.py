"""GSPO vs GRPO vs GRPO + Routing Replay on a tiny Qwen3-MoE, on a CPU.

    python examples/moe_stability/run.py                 # 3 seeds x 3 algorithms
    python examples/moe_stability/run.py --quick         # a minute: checks the script

1. Build a tiny Qwen3-MoE (8 experts, top-2) and warm it up with supervised steps on the
   built-in arithmetic task (shared by every run), so that groups have differing rewards.
2. Train it from there with each algorithm and seed at equal compute (same rollouts, 4
   minibatches per rollout, the paper's clip range for each level):
     gspo           algo.level=sequence           eps 3e-4 / 4e-4
     grpo           algo.level=token              eps 0.2 / 0.27
     grpo_replay    algo.level=token + algo.routing_replay=true
3. Write `table.md` (final accuracy, mean token clip fraction, mean routing change, collapsed
   runs) and a report over all runs (`gspo report`) into the output directory.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

ALGOS = {
    "gspo": ["algo.level=sequence"],
    "grpo": ["algo.level=token"],
    "grpo_replay": ["algo.level=token", "algo.routing_replay=true"],
}
BASE = ["data.source=arithmetic", "data.difficulty=1", "data.num_prompts=4000",         "rollout.prompts_per_step=16", "rollout.group_size=8", "rollout.max_new_tokens=6",
        "schedule.num_minibatches=4", "eval.num_prompts=200", "eval.every=0", "logging.console=false",
        "logging.completions_every=50", "tiny.moe=true", "tiny.hidden_size=64",
        "tiny.num_layers=2"]


def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv=None) -> list[dict]:
    from gspo.config import load_config
    from gspo.demo import warmup
    from gspo.report.sinks import read_metrics
    from gspo.report.html import make_report
    from gspo.train.prompts import load_prompt_rows
    from gspo.train.run import build_policy, seed_everything
    from gspo.train.threads import setup_threads
    from gspo.train import train

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/moe_stability")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--rollouts", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the tiny Qwen3-MoE")
    p.add_argument("--layers", type=int, default=2, help="its layers (every one a MoE layer)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.rollouts, a.warmup_steps = 1, 3, 20
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = [*BASE, f"optim.lr={a.lr}", f"schedule.rollouts={a.rollouts}", f"output.dir={out}",
            f"tiny.hidden_size={a.hidden}", f"tiny.num_layers={a.layers}",
            f"tiny.num_experts={a.experts}", f"tiny.experts_per_tok={a.top_k}"]

    warm = out / "warmup"
    if not (warm / "config.json").exists():
        cfg = load_config(None, [*base, "output.name=warmup"])
        setup_threads(cfg.threads)
        seed_everything(cfg.seed)
        model, tok = build_policy(cfg)
        rows, _ = load_prompt_rows(cfg)
        losses = warmup(model, tok, rows, steps=a.warmup_steps, batch_size=64, lr=1e-3, seed=0)
        model.save_pretrained(warm, safe_serialization=True)
        tok.save_pretrained(warm)
        print(f"warm-up: {a.warmup_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")

    results, runs = [], []
    for seed in range(a.seeds):
        for name, extra in ALGOS.items():  # interleaved: algorithms alternate within each seed
            run_name = f"{name}-seed{seed}"
            if (out / run_name).exists():
                import shutil

                shutil.rmtree(out / run_name)
            cfg = load_config(None, [*base, *extra, f"model.name_or_path={warm}", f"seed={seed}",
                                     f"output.name={run_name}"])
            t0 = time.time()
            status = "ok"
            try:
                train(cfg)
            except Exception as e:  # a collapse that stops training is a result, not a crash
                status = f"stopped: {type(e).__name__}"
            recs = read_metrics(out / run_name / "metrics.jsonl")
            evals = [r["eval/accuracy"] for r in recs if r.get("eval/accuracy") is not None]
            steps = [r for r in recs if r.get("step", 0) > 0]
            before, after = (evals[0], evals[-1]) if evals else (float("nan"), float("nan"))
            collapsed = status != "ok" or not math.isfinite(after) or after < before - 0.10
            results.append({"algo": name, "seed": seed, "acc_before": before, "acc_after": after,
                            "token_clip_frac": mean([r.get("clip/token_frac") for r in steps]),
                            "routing_changed_frac": mean([r.get("routing/changed_frac") for r in steps
                                                          if r.get("step", 0) % 4 != 1]),  # off-policy steps
                            "collapsed": collapsed, "status": status, "seconds": round(time.time() - t0, 1)})
            runs.append(out / run_name)
            print(json.dumps(results[-1]))
    lines = ["| algorithm | seeds | accuracy before → after (mean) | token clip fraction | routing change (off-policy steps) | collapsed |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in ALGOS:
        rs = [r for r in results if r["algo"] == name]
        lines.append(f"| {name} | {len(rs)} | {100 * mean([r['acc_before'] for r in rs]):.1f}% → "
                     f"{100 * mean([r['acc_after'] for r in rs]):.1f}% | {mean([r['token_clip_frac'] for r in rs]):.4f} | "
                     f"{mean([r['routing_changed_frac'] for r in rs]):.4f} | {sum(r['collapsed'] for r in rs)} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    make_report(runs, out / "report")
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
