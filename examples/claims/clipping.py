"""Claim (paper Fig. 2 and §5.3): GSPO clips far more tokens than GRPO, orders of magnitude
more, and still learns more per unit of compute. Read off the runs the other claims made.

    python examples/claims/clipping.py runs/claims/staleness runs/claims/precision runs/claims/moe_routing

Takes the output directories of the other claims' commands (any directory whose
subdirectories are runs with a metrics.jsonl and a config.yaml), groups each one's runs into
cells by name (`CELL-seedN`), and reports per cell:
- the algorithm, from the run's own config.yaml (GSPO = algo.level sequence, GSPO-token =
  sequence_token, GRPO = token; another algo.objective is named as such);
- the token clip fraction, mean over every optimizer step (`clip/token_frac`; the paper's
  Fig. 2 plots this for GSPO against GRPO);
- learning per unit of compute: held-out accuracy gained per million tokens the learner trained
  on (`tokens/minibatch` summed over the steps: the compute spent, since rows without signal are
  skipped), and the final accuracy.
Writes into --out: table.md, clipping.json and clipping.png (clip fractions as bars, log scale;
accuracy against trained tokens, the mean over seeds of each cell).
Nothing is run here: it costs seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from _common import fmt, read_run

LEVEL_NAMES = {"sequence": "GSPO", "sequence_token": "GSPO-token", "token": "GRPO"}


def algorithm(run_dir: Path) -> str:
    """GSPO / GSPO-token / GRPO by algo.level, or the algo.objective's name, from config.yaml."""
    from gspo.config import from_yaml_text

    a = from_yaml_text((run_dir / "config.yaml").read_text()).algo
    name = LEVEL_NAMES[a.level] if a.objective == "clip" else a.objective.upper()
    return name + (" + replay" if a.routing_replay else "")


def cells(claim_dir: Path) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for d in sorted(p for p in claim_dir.iterdir() if (p / "metrics.jsonl").exists() and (p / "config.yaml").exists()):
        out.setdefault(re.sub(r"-seed\d+$", "", d.name), []).append(d)
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("claims", type=Path, nargs="+", help="output directories of the other claims' commands")
    p.add_argument("--out", type=Path, default=Path("runs/claims/clipping"))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for claim in a.claims:
        for cell, dirs in cells(claim).items():
            runs = [read_run(d, 0) for d in dirs]
            gains = [(r["acc_after"] - r["acc_before"]) / max(r["tokens_trained"], 1) * 1e6 for r in runs]
            rows.append({"claim": claim.name, "cell": cell, "algorithm": algorithm(dirs[0]), "seeds": len(runs),
                         "clip_token_frac": statistics.mean(r["clip_token_frac"] or 0.0 for r in runs),
                         "acc_after": statistics.mean(r["acc_after"] for r in runs),
                         "gain_per_mtok": statistics.mean(gains),
                         "tokens_trained": statistics.mean(r["tokens_trained"] for r in runs),
                         "curves": [r["curve"] for r in runs], "tokens": [r["tokens_by_rollout"] for r in runs]})
    lines = ["| claim | cell | algorithm | seeds | token clip fraction | accuracy after | accuracy gain per 1M trained "
             "tokens (points) | trained tokens |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['claim']} | {r['cell']} | {r['algorithm']} | {r['seeds']} | {r['clip_token_frac']:.4f} | "
                     f"{fmt(r['acc_after'])} | {100 * r['gain_per_mtok']:.2f} | {r['tokens_trained'] / 1e6:.2f} M |")
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    (a.out / "clipping.json").write_text(json.dumps(rows, indent=1))
    plot(rows, a.out / "clipping.png")
    print("\n".join(lines))
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Left: token clip fraction per cell (log scale). Right: accuracy against trained tokens."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        print("clipping.png skipped: matplotlib is not installed (pip install 'gspo[report]')")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, max(3.5, 0.3 * len(rows) + 1)))
    labels = [f"{r['claim']}/{r['cell']}" for r in rows]
    colors = ["tab:blue" if r["algorithm"].startswith("GSPO") else "tab:orange" for r in rows]
    ax1.barh(labels, [max(r["clip_token_frac"], 1e-6) for r in rows], color=colors)
    ax1.set_xscale("log")
    ax1.set_xlabel("token clip fraction (blue: GSPO levels, orange: others)")
    ax1.invert_yaxis()
    for r, c in zip(rows, colors):
        pts = []
        for curve, toks in zip(r["curves"], r["tokens"]):  # an evaluation at rollout q follows the steps of rollouts <= q
            pts.append([(max([t for ro, t in toks if ro <= q], default=0), acc) for q, acc in curve])
        if not pts or not all(pts):
            continue
        n = min(map(len, pts))
        xs = [statistics.mean(p[i][0] for p in pts) / 1e6 for i in range(n)]
        ys = [statistics.mean(p[i][1] for p in pts) for i in range(n)]
        ax2.plot(xs, ys, color=c, alpha=0.7, label=f"{r['claim']}/{r['cell']}")
    ax2.set_xlabel("trained tokens (M)")
    ax2.set_ylabel("held-out accuracy (mean over seeds)")
    if len(rows) <= 12:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
