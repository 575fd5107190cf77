"""Claim 1 (paper §5.3): on a MoE whose routes churn, GRPO needs Routing Replay and GSPO does not.

    python examples/claims/moe_routing.py            # 5 algorithms x 5 seeds + a load-balancing sweep: ~8 min on 2 cores
    python examples/claims/moe_routing.py --quick    # 1 seed, 2 algorithms, 3 rollouts: checks the script

The regime. The paper reports that about 10% of the experts a token activates change after
each update of Qwen3-30B-A3B. docs/moe.md's warmed-up tiny MoEs at lr 5e-5 change 0.1-0.4% of
routes per step, where nothing is tested. Routes churn when a router's top-k logits are close
and the router moves fast. The default here: a tiny Qwen3-MoE (4 layers, every one sparse, 16
experts, top-4, hidden 64) warmed up by 600 supervised steps per seed, routers included, then
RL at lr 3e-5 with the routers' own learning rate 300x that (optim.router_lr_scale=300), a
load-balancing loss of weight 3 (algo.router_aux_loss_coef=3) and a shaped reward
(examples/claims/rewards.py:digit_credit: partial credit for digits in place, 1 for the exact
answer). Routes churn when many tokens' k-th and (k+1)-th router logits are close and the router
moves fast: the load-balancing loss keeps the router near uniform (and, unlike the task loss
through renormalised top-k gates, reaches the logits of experts a token did not pick), and the
router lr moves it. The load-balancing sweep (--sweep-aux) moves the churn with nothing else
changed. What a short exploration measured (seed 0, 40 rollouts, GSPO / GRPO; routes: the
off-policy steps' routing/changed_frac; accuracy: held-out greedy, start -> end):
    16 experts top-4, routers frozen in the warm-up (until 2026-12-01 the default), lr 3e-5:
      router lr x 1                            routes 0.4 / 0.5%   accuracy 58.5 -> 80.5 / 81.0%
      router lr x 30                           routes 3.2 / 3.3%   accuracy 58.5 -> 65.0 / 66.0%
      router lr x 100                          routes 4.3 / 4.6%   accuracy 58.5 -> 65.0 / 59.5%
      router lr x 300                          routes 4.3 / 4.9%   accuracy 58.5 -> 48.0 / 55.5%
      router lr x 100, load balancing 0.01     routes 4.3 / 4.3%   accuracy 58.5 -> 61.5 / 58.0%
      router weights x 0.1, router lr x 10     routes 4.5 / 4.3%   accuracy 59.5 -> 56.5 / 54.5%
    64 experts top-8, frozen, router lr x 30    routes 4.2 / 4.2%   accuracy 85.0 -> 74.0 / 80.0%
    8 layers, frozen, router lr x 30            routes 3.3 / 3.4%   accuracy 83.0 -> 81.5 / 91.5%
    16 experts top-4, routers trained in the warm-up (the default), lr 3e-5:
      router lr x 1                            routes 0.1 / 0.2%   accuracy 60.0 -> 84.0 / 83.0%
      router lr x 30                           routes 0.9 / 1.0%   accuracy 60.0 -> 84.0 / 80.0%
      router lr x 100                          routes 2.5 / 2.3%   accuracy 60.0 -> 83.5 / 77.0%
      router lr x 300                          routes 3.6 / 3.8%   accuracy 60.0 -> 68.0 / 68.0%
      router lr x 1000                         routes 4.2 / 3.8%   accuracy 60.0 -> 28.0 / 28.0%
      router lr x 3000                         routes 3.8 / 4.6%   accuracy 60.0 -> 12.5 / 2.0%
      router lr x 30, load balancing 1         routes 1.8 / 2.0%   accuracy 60.0 -> 79.0 / 78.5%
      router lr x 100, load balancing 0.1      routes 3.4 / 3.1%   accuracy 60.0 -> 78.0 / 81.0%
      router lr x 100, load balancing 1        routes 3.8 / 3.8%   accuracy 60.0 -> 75.5 / 75.0%
      router lr x 300, load balancing 1        routes 6.2 / 5.7%   accuracy 60.0 -> 71.0 / 72.5%
      router lr x 300, load balancing 3        routes 7.5 / 6.7%   accuracy 60.0 -> 68.0 / 67.5%   (the default)
      router lr x 300, load balancing 10       routes 10.0 / 8.7%  accuracy 60.0 -> 47.0 / 57.0%
      router lr x 1000, load balancing 1       routes 5.9 / 5.2%   accuracy 60.0 -> 19.5 / 7.0%
      router lr x 1000, load balancing 3       routes 5.2 / 5.9%   accuracy 60.0 -> 16.5 / 20.0%
    8 experts top-2, fresh (no warm-up), lr 1e-3 routes 4.7 / 5.4%   accuracy 0 -> 0 (shaped 0.002 -> 0.060)
Without load balancing the churn levels off at ~4-5% per off-policy step however fast the
routers move, and past ~3% every algorithm stops learning. With it, 5-8% of routes change per
off-policy step (3-4% after one update) while the model still learns; at 10% it stops. Earlier
sessions' exploration (whole-model lr 1e-4 / 3e-4, routers scaled by 0.1 or 0.03) gave 1-4%.

The runs. For each seed: one warm-up, then from it GSPO (algo.level=sequence), GSPO-token
(sequence_token), GRPO (token), GRPO + Routing Replay and SAPO (token, objective=sapo),
interleaved, at equal compute: the same prompts, rollouts, batch (16 prompts x 8), 4 minibatches
per rollout (steps 2-4 off-policy) and lr; each level's paper clip range is the library
default. Then the load-balancing sweep of GSPO and GRPO without replay, same seeds
(--sweep-router-lr and --sweep-lr add sweeps of the router lr and of the whole model's lr). Each run is its own
`python -m gspo train` process with one thread, two at a time.

Collapse, defined before the runs: a run has collapsed when the trainer stopped it ("gspo
train: stopped", e.g. too many non-finite steps), or any logged loss or gradient norm is
non-finite, or its final held-out greedy accuracy (exact answer) is more than 10 points below
its accuracy at the start, or below half of it (this catches a collapse from a low start). A run
that crashes otherwise is an error (the library's fault, not the algorithm's), counted apart.

Measured per run (metrics the trainer logs; nothing is added to the library):
    accuracy   eval/accuracy at the start and the end; eval/reward_mean (the shaped reward)
    routing    routing/changed_frac (and /layer_N) on the off-policy steps: the share of (token,
               layer, k) choices where pi_theta's top-k differs from pi_old's. Under Routing
               Replay the update uses pi_old's experts; the metric still compares the natural
               top-k, so it measures churn, not what replay let through.
    variance   ratio/token_log_var: the variance of the token log-ratios log w_t over each
               off-policy step's tokens (for small ratios, Var(w_t) is about the same)
    kl/approx  k3 estimate of KL(pi_old || pi_theta) per token on the off-policy steps
    clip       clip/token_frac over all steps (SAPO: the tokens whose gate keeps under half the
               gradient), counted per token as in the paper's Fig. 2
    grad_norm  the global gradient norm before clipping (optim.max_grad_norm=1), mean over the
               steps that had rows

Output in --out: table.md, results.json (every run's numbers), report/report.html (the main
cells' runs overlaid, `gspo report`), and each run's directory.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REWARD = Path(__file__).resolve().parent / "rewards.py"  # beside this script, wherever it is copied
ALGOS = {
    "gspo": ["algo.level=sequence"],
    "gspo_token": ["algo.level=sequence_token"],
    "grpo": ["algo.level=token"],
    "grpo_replay": ["algo.level=token", "algo.routing_replay=true"],
    "sapo": ["algo.level=token", "algo.objective=sapo"],
}
SWEEP_ALGOS = ("gspo", "grpo")
MINIBATCHES = 4
COLLAPSE = ("the trainer stopped the run, a non-finite loss or gradient norm, or a final held-out accuracy "
            "more than 10 points below the start or below half of it")


def base_overrides(a) -> list[str]:
    """The overrides every run (and the warm-up) shares."""
    return ["data.source=arithmetic", "data.difficulty=1", "data.num_prompts=4000",
            f"rollout.prompts_per_step={a.prompts}", "rollout.group_size=8", "rollout.max_new_tokens=6",
            f"schedule.num_minibatches={MINIBATCHES}", f"eval.num_prompts={a.eval_prompts}",
            f"eval.every={a.eval_every}",
            f"rewards.functions=[{{name: '{REWARD}:digit_credit'}}]",
            "tiny.moe=true", f"tiny.hidden_size={a.hidden}", f"tiny.num_layers={a.layers}",
            f"tiny.num_experts={a.experts}", f"tiny.experts_per_tok={a.top_k}",
            "logging.routing_per_layer=true", "logging.console=false", "logging.completions_every=0",
            "logging.table_every=0", "threads=1"]


def _env() -> dict:
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def warm_up(a, seed: int) -> Path:
    """The seed's starting model: the tiny MoE initialised with this seed after `a.warmup_steps`
    supervised steps (gspo.demo.warmup), saved once and shared by every run of the seed."""
    shape = f"h{a.hidden}-l{a.layers}-e{a.experts}-k{a.top_k}"  # (one directory per model shape)
    warm = Path(a.out) / f"warmup{a.warmup_steps}{'-frozen' if a.freeze_router else ''}-{shape}-seed{seed}"
    if not (warm / "config.json").exists():
        code = ("from gspo.config import load_config; from gspo.demo import warmup; "
                "from gspo.train.prompts import load_prompt_rows; "
                "from gspo.train.run import build_policy, seed_everything; from gspo.train.threads import setup_threads; "
                f"cfg = load_config(None, {[*base_overrides(a), f'seed={seed}']!r}); setup_threads(1); "
                "seed_everything(cfg.seed); m, t = build_policy(cfg); rows, _ = load_prompt_rows(cfg); "
                f"routers = [p for n, p in m.named_parameters() if n.endswith('mlp.gate.weight')] if {a.freeze_router} else []; "
                "[p.requires_grad_(False) for p in routers]; "
                f"warmup(m, t, rows, steps={a.warmup_steps}, batch_size=64, lr=1e-3, seed={seed}); "
                "[p.requires_grad_(True) for p in routers]; "
                f"m.save_pretrained({str(warm)!r}); t.save_pretrained({str(warm)!r})")
        subprocess.run([sys.executable, "-c", code], env=_env(), check=True, capture_output=True, cwd=ROOT)
    return scale_routers(warm, a.router_scale) if a.router_scale != 1 else warm


def scale_routers(warm: Path, scale: float) -> Path:
    """A copy of `warm` whose router weights are multiplied by `scale`: the same top-k routes
    and (near-uniform) gate weights at the start, but Adam moves each weight by about lr per
    step whatever its size, so the router's learning rate relative to its weights grows by
    1/scale. The library has no per-module learning rate; this stands in for a router lr."""
    from safetensors.torch import load_file, save_file

    dst = warm.with_name(f"{warm.name}-router{scale:g}")
    if not (dst / "config.json").exists():
        shutil.copytree(warm, dst, dirs_exist_ok=True)
        weights = load_file(warm / "model.safetensors")
        weights = {k: v * scale if k.endswith("mlp.gate.weight") else v for k, v in weights.items()}
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _mean(xs) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.mean(xs) if xs else None


def summarize(recs: list[dict], status: str) -> dict:
    """One run's numbers from its metrics.jsonl records (one per optimizer step, evals included)."""
    evals = [r["eval/accuracy"] for r in recs if r.get("eval/accuracy") is not None]
    steps = [r for r in recs if r.get("loss") is not None or r.get("grad_norm") is not None]
    off = [r for r in steps if (r.get("step", 0) - 1) % MINIBATCHES != 0]  # steps 2-4 of a rollout
    first_off = [r for r in steps if (r.get("step", 0) - 1) % MINIBATCHES == 1]  # after one update
    nonfinite = any(not math.isfinite(r[k]) for r in steps for k in ("loss", "grad_norm")
                    if isinstance(r.get(k), (int, float)))
    before, after = (evals[0], evals[-1]) if evals else (math.nan, math.nan)
    shaped = [r["eval/reward_mean"] for r in recs if r.get("eval/reward_mean") is not None]
    layers = sorted({k for r in off for k in r if k.startswith("routing/changed_frac/layer_")},
                    key=lambda k: int(k.rsplit("_", 1)[1]))
    collapsed = not status.startswith("error") and (
        status != "ok" or nonfinite or not math.isfinite(after) or after < before - 0.10 or after < before / 2)
    return {"acc_before": before, "acc_after": after, "acc_curve": evals, "status": status,
            "eval_reward_before": shaped[0] if shaped else None, "eval_reward_after": shaped[-1] if shaped else None,
            "nonfinite": nonfinite, "collapsed": collapsed,
            "routing_off": _mean(r.get("routing/changed_frac") for r in off),
            "routing_first_off": _mean(r.get("routing/changed_frac") for r in first_off),
            "routing_layers": [_mean(r.get(k) for r in off) for k in layers],
            "kl_approx_off": _mean(r.get("kl/approx") for r in off),
            "token_log_ratio_var_off": _mean(r.get("ratio/token_log_var") for r in off),
            "clip_token_frac": _mean(r.get("clip/token_frac") for r in steps),
            "grad_norm": _mean(r.get("grad_norm") for r in steps if r.get("rows/minibatch", 1) > 0),
            "reward_mean": _mean(r.get("reward/mean") for r in steps),
            "steps": len(steps)}


def one_run(a, algo: str, lr: float, router_lr: float, aux: float, seed: int, warm: Path) -> dict:
    name = f"{algo}-lr{lr:g}-router{router_lr:g}-aux{aux:g}-seed{seed}"
    run_dir = Path(a.out) / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "gspo", "train", *base_overrides(a), *ALGOS[algo], f"optim.lr={lr}",
           f"optim.router_lr_scale={router_lr}", f"algo.router_aux_loss_coef={aux}",
           f"schedule.rollouts={a.rollouts}", f"model.name_or_path={warm}", f"seed={seed}",
           f"output.dir={Path(a.out).resolve()}", f"output.name={name}"]
    t0 = time.time()
    p = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=ROOT, check=False)
    if p.returncode == 0:
        status = "ok"
    elif "gspo train: stopped:" in p.stderr:  # the trainer gave up (e.g. non-finite steps): a collapse
        status = "stopped: " + p.stderr.split("gspo train: stopped:")[-1].strip()[:300]
    else:  # a crash is the library's fault, not the algorithm's: reported apart, not a collapse
        status = "error: " + p.stderr.strip()[-300:]
    recs = []
    if (run_dir / "metrics.jsonl").exists():
        from gspo.report.sinks import read_metrics

        recs = read_metrics(run_dir / "metrics.jsonl")
    return {"algo": algo, "lr": lr, "router_lr_scale": router_lr, "aux_coef": aux, "seed": seed, "run": name,
            "seconds": round(time.time() - t0, 1),
            **summarize(recs, status)}


def _f(x, d=3) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{d}f}"


def _cells(rs: list[dict]) -> str:
    """The columns every table shares, over the runs that did not fail with an error."""
    ok = [r for r in rs if not r["status"].startswith("error")]
    m = lambda k: _mean(r[k] for r in ok)
    return (f"{len(ok)} | {_f(m('acc_before'))} → **{_f(m('acc_after'))}** | "
            f"{', '.join(_f(r['acc_after']) for r in ok)} | {sum(r['collapsed'] for r in ok)} | "
            f"{len(rs) - len(ok)} | {_f(m('eval_reward_before'))} → {_f(m('eval_reward_after'))} | "
            f"{_f(m('routing_off'), 4)} | {_f(m('routing_first_off'), 4)} | {_f(m('token_log_ratio_var_off'), 5)} | "
            f"{_f(m('kl_approx_off'), 5)} | "
            f"{_f(m('clip_token_frac'), 4)} | {_f(m('grad_norm'), 2)} | {_f(m('seconds'), 0)} |")


HEADER = ("seeds | accuracy start → end (mean) | end, per seed | collapsed | errors | held-out shaped reward | "
          "routing change (off-policy) | after 1 update | token log-ratio variance | kl/approx | token clip fraction | "
          "grad norm | s / run |")
RULE = "---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"


KNOBS = ("lr", "router_lr_scale", "aux_coef")  # what a sweep moves: a result's key and the argument's name


def _at_main(a, r: dict, *free: str) -> bool:
    """Is `r` at the main cells' settings, except for the knobs `free`?"""
    return all(r[k] == getattr(a, k) for k in KNOBS if k not in free)


def _sweep(title: str, key: str, label: str, runs: list[dict], algos) -> list[str]:
    values = sorted({r[key] for r in runs})
    if len(values) < 2:
        return []
    lines = ["", title, "", f"| {label} | algorithm | " + HEADER, "|---:|---|" + RULE]
    for v in values:
        for algo in algos:
            rs = [r for r in runs if r[key] == v and r["algo"] == algo]
            if rs:
                lines.append(f"| {v:g} | {algo} | " + _cells(rs))
    return lines


def tables(a, results: list[dict]) -> str:
    main = [r for r in results if _at_main(a, r)]
    n_layers = max((len(r["routing_layers"]) for r in main), default=0)
    model = (f"Tiny Qwen3-MoE: {a.layers} layers, {a.experts} experts, top-{a.top_k}, hidden {a.hidden}; "
             f"{a.warmup_steps} supervised warm-up steps per seed (routers {'frozen' if a.freeze_router else 'trained'}), "
             f"router weights x {a.router_scale:g} after it; RL at lr {a.lr:g} with the routers' lr x "
             f"{a.router_lr_scale:g} (optim.router_lr_scale), load-balancing loss x {a.aux_coef:g} "
             f"(algo.router_aux_loss_coef); {a.rollouts} rollouts of {a.prompts} prompts x 8, "
             f"{MINIBATCHES} minibatches; reward digit_credit; held-out greedy accuracy on {a.eval_prompts} prompts.")
    collapse = (f"**Collapsed** (defined before the runs): {COLLAPSE}. **Errors**: runs that crashed (the "
                "library's fault, not the algorithm's); left out of every other column.")
    columns = ("Routing change, token log-ratio variance and kl/approx: mean over the off-policy steps (2-4 of "
               "each rollout); \"after 1 update\": step 2 only. The variance is of log w_t = log pi_theta - "
               "log pi_old over each step's tokens (ratio/token_log_var; for small ratios Var(w) is about the "
               "same); kl/approx is the k3 estimate per token. Token clip fraction over all steps (SAPO: tokens "
               "whose gate keeps under half the gradient). Gradient norm before clipping to 1.")
    names = {"gspo": "GSPO", "gspo_token": "GSPO-token", "grpo": "GRPO", "grpo_replay": "GRPO + Routing Replay",
             "sapo": "SAPO"}
    ran = [names.get(x, x) for x in a.algos]
    lines = [f"# MoE routing: {', '.join(ran[:-1]) + ' and ' if len(ran) > 1 else ''}{ran[-1]} at lr {a.lr:g}, "
             f"router lr x {a.router_lr_scale:g}",
             "", model, "", collapse, "", columns, "", "| algorithm | " + HEADER, "|---|" + RULE]
    for algo in a.algos:
        rs = [r for r in main if r["algo"] == algo]
        if rs:
            lines.append(f"| {algo} | " + _cells(rs))
    if n_layers:
        lines += ["", "Routing change per layer (off-policy steps, mean over seeds):", "",
                  "| algorithm | " + " | ".join(f"layer {i}" for i in range(n_layers)) + " |",
                  "|---|" + "---:|" * n_layers]
        for algo in a.algos:
            rs = [r for r in main if r["algo"] == algo and len(r["routing_layers"]) == n_layers]
            if rs:
                lines.append(f"| {algo} | " + " | ".join(_f(_mean(r["routing_layers"][i] for r in rs), 4)
                                                       for i in range(n_layers)) + " |")
    lines += _sweep("Load-balancing sweep, GSPO against GRPO without replay (everything else as in the main "
                    "cells; same seeds and budget): the routing change rises with it", "aux_coef",
                    "load balancing x", [r for r in results if _at_main(a, r, "aux_coef")], SWEEP_ALGOS)
    lines += _sweep("Router learning-rate sweep, GSPO against GRPO without replay (everything else as in the "
                    "main cells):", "router_lr_scale", "router lr x",
                    [r for r in results if _at_main(a, r, "router_lr_scale")], SWEEP_ALGOS)
    lines += _sweep("Learning-rate sweep of the whole model, GSPO against GRPO without replay (everything else "
                    "as in the main cells):", "lr", "lr", [r for r in results if _at_main(a, r, "lr")], SWEEP_ALGOS)
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/claims/moe_routing")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    p.add_argument("--rollouts", type=int, default=60)
    p.add_argument("--prompts", type=int, default=16, help="prompts per rollout (8 completions each)")
    p.add_argument("--lr", type=float, default=3e-5, help="the main cells' learning rate")
    p.add_argument("--router-lr-scale", type=float, default=300.0,
                   help="the main cells' router learning rate over --lr (optim.router_lr_scale)")
    p.add_argument("--aux-coef", type=float, default=3.0,
                   help="the main cells' load-balancing loss weight (algo.router_aux_loss_coef)")
    p.add_argument("--sweep-aux", type=float, nargs="*", default=[0.0, 1.0, 10.0],
                   help="further load-balancing weights for GSPO and GRPO without replay")
    p.add_argument("--sweep-lr", type=float, nargs="*", default=[],
                   help="further lrs for GSPO and GRPO without replay (the main lr is part of the sweep)")
    p.add_argument("--sweep-router-lr", type=float, nargs="*", default=[],
                   help="further router lr scales for GSPO and GRPO without replay, at the main lr")
    p.add_argument("--warmup-steps", type=int, default=600, help="supervised warm-up steps per seed")
    p.add_argument("--freeze-router", type=int, default=0, choices=(0, 1),
                   help="1: the routers keep their random initialisation through the warm-up")
    p.add_argument("--router-scale", type=float, default=1.0,
                   help="multiply the warmed-up routers' weights by this: their lr relative to their size x 1/this")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="layers, every one a MoE layer")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--eval-prompts", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=20, help="rollouts between held-out evaluations")
    p.add_argument("--parallel", type=int, default=2, help="runs at a time (one thread each)")
    p.add_argument("--quick", action="store_true", help="1 seed, gspo and grpo, 3 rollouts, no sweep")
    a = p.parse_args(argv)
    if a.quick:
        a.seeds, a.rollouts, a.algos, a.sweep_lr, a.sweep_router_lr, a.sweep_aux = 1, 3, ["gspo", "grpo"], [], [], []
        a.warmup_steps, a.prompts, a.eval_prompts, a.eval_every = 5, 4, 8, 0
        a.layers, a.experts, a.top_k = 2, 8, 2
    return a


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    seeds = list(range(a.seeds))
    with cf.ThreadPoolExecutor(a.parallel) as pool:
        warms = dict(zip(seeds, pool.map(lambda s: warm_up(a, s), seeds)))
        # interleaved: within each seed the algorithms alternate, then the sweep's other lrs
        main = tuple(getattr(a, k) for k in KNOBS)
        jobs = [(algo, *main, s) for s in seeds for algo in a.algos]
        for i, values in enumerate((a.sweep_lr, a.sweep_router_lr, a.sweep_aux)):  # one knob at a time
            for s in seeds:
                for v in values:
                    if v != main[i]:
                        jobs += [(algo, *main[:i], v, *main[i + 1:], s) for algo in SWEEP_ALGOS]
        results = []
        for r in pool.map(lambda j: one_run(a, *j, warms[j[4]]), jobs):
            print(json.dumps({k: v for k, v in r.items() if k != "acc_curve"}), flush=True)
            results.append(r)
    text = tables(a, results)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps(
        {"command": " ".join(["python", "examples/claims/moe_routing.py", *(argv if argv is not None else sys.argv[1:])]),
         "args": vars(a), "collapse": COLLAPSE, "seconds": round(time.time() - t0, 1), "results": results}, indent=1))
    from gspo.report.html import make_report

    main_runs = [out / r["run"] for r in results if _at_main(a, r) and (out / r["run"] / "metrics.jsonl").exists()]
    if main_runs:
        make_report(main_runs, out / "report")
    print(text)
    print(f"{len(results)} runs in {time.time() - t0:.0f} s")
    return results


if __name__ == "__main__":
    failed = [r for r in main() if r["status"].startswith("error")]
    if failed:  # the tables are written; a run that could not run is not a result
        print(f"{len(failed)} runs failed; the first: {failed[0]['status'][:300]}", file=sys.stderr)
        sys.exit(1)
