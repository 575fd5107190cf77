"""The objectives side by side: GSPO, GSPO-token, GRPO, SAPO, CISPO, GMPO and LUSPO on the demo
task (dense) and on a tiny Qwen3-MoE, 3 seeds each, at equal compute.

    python bench/objectives.py --json docs/figures/objectives.json         # ~30 min on 2 cores
    python bench/objectives.py --tasks demo --seeds 0 --objectives gspo sapo --rollouts 20   # a quick look

Every run starts from the same warmed-up model per (task, seed) and gets the same rollouts,
batch, learning rate and 4 minibatches per rollout; only `algo.*` differs, each objective with
its paper's defaults (`gspo.config.PAPER_CLIP` / `OBJECTIVE_CLIP`):
    demo  `gspo demo seed=S` (hidden 128, 2 layers, 300 rollouts of 32 x 8, lr 1e-4)
    moe   examples/moe_stability's model (8 experts, top-2, hidden 64, 2 layers), warmed up by
          --moe-warmup supervised steps (600), then 150 rollouts of 16 x 8 at --moe-lr (5e-5):
          docs/moe.md's setting in which every algorithm learns (at lr 3e-4 after 300 warm-up
          steps all of them degrade)
Each run logs the KL to its starting weights (`logging.kl_reference=true`, not in the loss).
Reported per cell (mean over seeds, and each seed's final accuracy): held-out greedy accuracy
before and after, the objective's clip (or SAPO's gate) fraction clip/token_frac, SAPO's
gate/weight_mean, completion length, entropy, kl/ref at the end, and seconds per run.
Runs go two at a time (one thread each); each is its own process.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OBJECTIVES = {
    "gspo": ["algo.level=sequence"],
    "gspo_token": ["algo.level=sequence_token"],
    "grpo": ["algo.level=token"],
    "sapo": ["algo.level=token", "algo.objective=sapo"],
    "cispo": ["algo.level=token", "algo.objective=cispo"],
    "gmpo": ["algo.level=sequence", "algo.objective=gmpo"],
    "luspo": ["algo.level=sequence", "algo.objective=luspo"],
}
COMMON = ["logging.console=false", "logging.kl_reference=true", "threads=1"]
MOE = ["data.source=arithmetic", "data.difficulty=1", "data.num_prompts=4000", "rollout.prompts_per_step=16",
       "rollout.group_size=8", "rollout.max_new_tokens=6", "schedule.num_minibatches=4", "eval.num_prompts=200",
       "eval.every=0", "tiny.moe=true", "tiny.hidden_size=64", "tiny.num_layers=2",
       "logging.completions_every=0", "logging.table_every=0"]


def _env() -> dict:
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def moe_warmup(out: Path, seed: int, steps: int) -> Path:
    """examples/moe_stability's warm-up of the tiny MoE for this seed (made once, then reused)."""
    warm = out / f"moe-warmup{steps}-seed{seed}"
    if not (warm / "config.json").exists():
        code = ("import sys; from gspo.config import load_config; from gspo.demo import warmup; "
                "from gspo.train.prompts import load_prompt_rows; "
                "from gspo.train.run import build_policy, seed_everything; "
                f"cfg = load_config(None, {MOE + [f'seed={seed}']!r}); seed_everything(cfg.seed); "
                "m, t = build_policy(cfg); rows, _ = load_prompt_rows(cfg); "
                f"warmup(m, t, rows, steps={steps}, batch_size=64, lr=1e-3, seed={seed}); "
                f"m.save_pretrained({str(warm)!r}); t.save_pretrained({str(warm)!r})")
        subprocess.run([sys.executable, "-c", code], env=_env(), check=True, capture_output=True)
    return warm


def one_run(task: str, name: str, seed: int, out: Path, rollouts: int | None, moe_lr: float = 5e-5,
            moe_warmup_steps: int = 600) -> dict:
    run_dir = out / f"{task}-{name}-seed{seed}"
    over = [*OBJECTIVES[name], *COMMON, f"seed={seed}"]
    if task == "demo":
        if rollouts:
            over.append(f"schedule.rollouts={rollouts}")
        cmd = [sys.executable, "-m", "gspo", "demo", "--out", str(run_dir), *over]
    else:
        warm = moe_warmup(out, seed, moe_warmup_steps)
        cmd = [sys.executable, "-m", "gspo", "train", *MOE, *over, f"model.name_or_path={warm}", f"optim.lr={moe_lr}",
               f"schedule.rollouts={rollouts or 150}", f"output.dir={out}", f"output.name={run_dir.name}"]
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    t0 = time.time()
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True)
    seconds = time.time() - t0
    if p.returncode != 0 or not (run_dir / "metrics.jsonl").exists():
        return {"task": task, "objective": name, "seed": seed, "status": f"failed: {p.stderr[-500:]}"}
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/accuracy"] for r in recs if r.get("eval/accuracy") is not None]
    steps = [r for r in recs if r.get("loss") is not None]
    last = steps[-max(len(steps) // 10, 1):]  # the last tenth of the run

    def mean(key, rs=steps):
        xs = [r[key] for r in rs if r.get(key) is not None and math.isfinite(r[key])]
        return statistics.mean(xs) if xs else None

    return {"task": task, "objective": name, "seed": seed, "status": "ok", "seconds": round(seconds, 1),
            "acc_before": evals[0], "acc_after": evals[-1], "clip_token_frac": mean("clip/token_frac"),
            "gate_weight_mean": mean("gate/weight_mean"), "len_mean": mean("completion/len_mean"),
            "len_end": mean("completion/len_mean", last), "entropy_end": mean("entropy/mean", last),
            "kl_ref_end": mean("kl/ref", last), "grad_norm": mean("grad_norm")}


def table(results: list[dict]) -> str:
    lines = ["| task | objective | accuracy before → after (mean) | after, per seed | clip / gate frac | SAPO gate weight "
             "| length (end) | entropy (end) | KL to start (end) | s / run |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    f = lambda x, d=3: "–" if x is None else f"{x:.{d}f}"  # noqa: E731
    for task in dict.fromkeys(r["task"] for r in results):
        for name in OBJECTIVES:
            rs = [r for r in results if r["task"] == task and r["objective"] == name and r["status"] == "ok"]
            if not rs:
                continue
            m = lambda k: (statistics.mean(v) if (v := [r[k] for r in rs if r[k] is not None]) else None)  # noqa: E731
            lines.append(f"| {task} | {name} | {f(m('acc_before'))} → **{f(m('acc_after'))}** | "
                         f"{', '.join(f(r['acc_after']) for r in rs)} | {f(m('clip_token_frac'), 4)} | "
                         f"{f(m('gate_weight_mean'), 4)} | {f(m('len_end'), 2)} | {f(m('entropy_end'))} | "
                         f"{f(m('kl_ref_end'), 4)} | {f(m('seconds'), 0)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["demo", "moe"], choices=["demo", "moe"])
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rollouts", type=int, default=None, help="rollouts per run (demo: 300, moe: 150)")
    ap.add_argument("--moe-lr", type=float, default=5e-5)
    ap.add_argument("--moe-warmup", type=int, default=600, help="supervised warm-up steps of the MoE")
    ap.add_argument("--out", type=Path, default=Path("runs/objectives"))
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    for seed in a.seeds if "moe" in a.tasks else []:
        moe_warmup(a.out, seed, a.moe_warmup)
    jobs = [(t, n, s) for t in a.tasks for s in a.seeds for n in a.objectives]  # objectives interleaved
    results = []
    with cf.ThreadPoolExecutor(a.parallel) as pool:
        for r in pool.map(lambda j: one_run(*j, a.out, a.rollouts, a.moe_lr, a.moe_warmup), jobs):
            print(json.dumps(r), flush=True)
            results.append(r)
    print(table(results))
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "results": results, "table": table(results)},
                                     indent=1))


if __name__ == "__main__":
    main()
