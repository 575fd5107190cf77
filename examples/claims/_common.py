"""What the claims' commands share: one run of `gspo demo` / `gspo train` in its own process,
the numbers read back from its metrics.jsonl, the collapse rule, and the report overlay.

COLLAPSE (fixed before any run): a run collapsed when its final held-out accuracy is more than
10 points below its accuracy at the start, when a logged loss is not finite, or when the run
stopped before its last rollout.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COLLAPSE_POINTS = 0.10


def env() -> dict:
    """One thread per run (two runs share the 2 cores), offline, the checkout's gspo first."""
    path = os.pathsep.join(x for x in [str(ROOT / "src"), str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")] if x)
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def run_demo(run_dir: Path, overrides: list[str], quick: bool = False) -> tuple[int, str]:
    """`gspo demo --out run_dir overrides...` (warm-up, then the GSPO phase) afresh; (rc, stderr tail)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "gspo", "demo", "--out", str(run_dir), *(["--quick"] if quick else []),
           *overrides, "logging.console=false"]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    return p.returncode, p.stderr[-2000:]


def read_run(run_dir: Path, rollouts: int) -> dict:
    """The numbers a claim's table needs from one run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    curve = [(r["rollout"], r["eval/accuracy"]) for r in recs if r.get("eval/accuracy") is not None]
    steps = [r for r in recs if "loss" in r]
    firsts: dict[int, dict] = {}
    for r in steps:  # the first optimizer step of each rollout (on-policy in sync mode)
        firsts.setdefault(r["rollout"], r)

    def mean(key, rs=steps):
        xs = [r[key] for r in rs if r.get(key) is not None and math.isfinite(r[key])]
        return statistics.mean(xs) if xs else None

    tokens, cum = 0, {}
    for r in steps:  # trained tokens at the end of each rollout: the learner's compute so far
        tokens += r.get("tokens/minibatch") or 0
        cum[r["rollout"]] = tokens
    done = max((r["rollout"] for r in steps), default=0)  # a step record counts the rollouts done with it
    before, after = (curve[0][1], curve[-1][1]) if curve else (math.nan, math.nan)
    finite = all(r["loss"] is not None and math.isfinite(r["loss"]) for r in steps)
    return {"curve": curve, "acc_before": before, "acc_after": after, "rollouts_done": done,
            "collapsed": collapsed(before, after, finite, done >= rollouts),
            "clip_token_frac": mean("clip/token_frac"),
            "clip_token_frac_first_minibatch": mean("clip/token_frac", list(firsts.values())),
            "mismatch_kl": mean("mismatch/kl"), "grad_norm": mean("grad_norm"),
            "staleness_mean": mean("async/staleness_mean", list(firsts.values())),
            "tokens_trained": tokens, "tokens_by_rollout": sorted(cum.items())}


def collapsed(before: float, after: float, finite: bool, finished: bool) -> bool:
    """The COLLAPSE rule of this module's docstring."""
    return (not finished or not finite or not math.isfinite(after)
            or after < before - COLLAPSE_POINTS)


def fmt(x, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def cell_mean(runs: list[dict], key: str):
    xs = [r[key] for r in runs if r.get(key) is not None and not (isinstance(r[key], float) and math.isnan(r[key]))]
    return statistics.mean(xs) if xs else None


def report(run_dirs: list[Path], out: Path) -> None:
    """`gspo report` over every run (needs matplotlib, gspo[report]); skipped with a note without it."""
    try:
        from gspo.report.html import make_report
    except ImportError as e:  # pragma: no cover
        print(f"report skipped: {e}")
        return
    existing = [d for d in run_dirs if (d / "metrics.jsonl").exists()]
    if existing:
        make_report(existing, out / "report")
