"""bf16 where it pays: generation and/or the learner's passes under bf16 autocast over fp32
weights, against fp32, on shapes from the demo's to compute-bound ones.

    python bench/bf16.py --json docs/figures/bf16.json      # 3 shapes x 4 variants x 3 rounds (~12 min)
    python bench/bf16.py --shapes demo --rounds 1           # one quick round

Variants: fp32; gen (rollout.mixed_precision=bf16: the decode loop under autocast); learn
(model.mixed_precision=bf16: pi_old and update under autocast); both. Every variant runs with
rollout.old_logp=trainer and schedule.skip_zero_advantage=false (every row runs, whatever the
rewards of the random model), so the phases compare like for like (with bf16 anywhere, old_logp=auto
picks the trainer's pass too, as the sampler's numbers are then not the trainer's).

Each (shape, variant, round) is a fresh process running bench/step.py's `measure` (the
functions `gspo.train.train` calls, timed by phase) at the library's thread default. Rounds
interleave the variants in alternating order; ratios to fp32 are taken within a round and
the median over rounds is reported.

Mismatch: before the timed steps, one rollout is sampled by the variant's generator and its
log-probs compared with an fp32 trainer pass on the same weights (the number the paper's
ratio would see as pi_old / pi_sampler at the first minibatch): the max and mean |dlogp| over
completion tokens, and the mean |per-sequence mean dlogp| (GSPO's length-normalised log-ratio).
The learner's own gap (its bf16 pass against fp32) is reported the same way.

AMX: /proc/cpuinfo's amx_bf16 flag is printed with the results; on a CPU without it (or
without avx512_bf16) bf16 matmuls are emulated and slow, which is why gspo never turns bf16 on
by itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
_MARK = "BF16_JSON "

SHAPES = {
    "demo": [],  # the demo's GSPO phase: hidden 128, 2 layers, 32 x 8 rows, 6 new tokens
    "h512x4": ["tiny.hidden_size=512", "tiny.num_layers=4", "rollout.max_new_tokens=32",
               "rollout.prompts_per_step=16"],
    "h1024x4": ["tiny.hidden_size=1024", "tiny.num_layers=4", "rollout.max_new_tokens=64",
                "rollout.prompts_per_step=8"],
}
VARIANTS = {
    "fp32": [],
    "gen": ["rollout.mixed_precision=bf16"],
    "learn": ["model.mixed_precision=bf16"],
    "both": ["rollout.mixed_precision=bf16", "model.mixed_precision=bf16"],
}
PHASES = ("generate", "pi_old", "update", "step")


def amx() -> dict:
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split()
    except (OSError, StopIteration):
        flags = []
    return {"amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}


def _gaps(a, b, mask) -> dict:
    import torch

    m = mask.bool()
    d = (a - b).abs()
    per_seq = ((a - b) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return {"token_abs_max": float(d[m].max()), "token_abs_mean": float(d[m].mean()),
            "seq_abs_mean": float(per_seq.abs().mean()), "tokens": int(m.sum()), "_": torch.__version__}


def worker(overrides: list[str], warmup: int, rollouts: int) -> dict:
    import torch

    from step import force_full_length, measure  # bench/step.py

    gap: dict = {}

    def prepare(run):
        force_full_length(run)  # completions run to max_new_tokens: equal work in every variant
        ro = run.generator.generate([r["prompt"] for r in run.prompts.rows[:4]], run.cfg.rollout.group_size, seed=7)
        args = (ro.input_ids, ro.attention_mask, ro.completion_ids.shape[1])
        with torch.no_grad():
            saved = run.trainer.autocast_dtype
            run.trainer.autocast_dtype = None
            fp32 = run.trainer(*args)
            run.trainer.autocast_dtype = saved
            learner = run.trainer(*args)
        gap["sampler_vs_fp32"] = _gaps(ro.sampler_logp, fp32, ro.completion_mask)
        gap["learner_vs_fp32"] = _gaps(learner, fp32, ro.completion_mask)

    res = measure(None, ["rollout.old_logp=trainer", "schedule.skip_zero_advantage=false", *overrides], threads=0, warmup=warmup, rollouts=rollouts,
                  repeats=1, prepare=prepare)
    blk = res["blocks"][0]
    return {"phases": {k: blk[k] for k in PHASES if k in blk}, "tokens": blk["tokens"], "gap": gap,
            "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(_MARK + json.dumps(worker(a.worker[1:] if a.worker[0] == "-" else a.worker, a.warmup, a.rollouts)))
        return {}
    import os

    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(BENCH), os.environ.get("PYTHONPATH", "")])}
    out = {"cpu": amx(), "shapes": {}}
    for shape in a.shapes:
        cells = []
        for r in range(a.rounds):
            order = a.variants if r % 2 == 0 else a.variants[::-1]
            row = {}
            for v in order:
                cmd = [sys.executable, str(Path(__file__)), "--warmup", str(a.warmup), "--rollouts", str(a.rollouts),
                       "--worker", "-", *SHAPES[shape], *VARIANTS[v]]
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
                line = next((x for x in p.stdout.splitlines() if x.startswith(_MARK)), None)
                if line is None:
                    raise RuntimeError(f"{shape}/{v} failed:\n{p.stderr[-3000:]}")
                row[v] = json.loads(line[len(_MARK):])
                ph = row[v]["phases"]
                print(f"  {shape} round {r + 1} {v:>5}: " + " ".join(f"{k} {ph[k]:.3f}" for k in ph), file=sys.stderr)
            cells.append(row)
        summary = {}
        for v in a.variants:
            summary[v] = {
                "phases_s": {k: statistics.median(c[v]["phases"][k] for c in cells) for k in PHASES},
                "speedup_vs_fp32": {k: statistics.median(c["fp32"]["phases"][k] / c[v]["phases"][k] for c in cells)
                                    for k in PHASES} if "fp32" in a.variants else {},
                "gap": cells[0][v]["gap"],
            }
        out["shapes"][shape] = {"overrides": SHAPES[shape], "summary": summary, "cells": cells}
    print(format_table(out))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return out


def format_table(out: dict) -> str:
    lines = [f"AMX bf16: {out['cpu']['amx_bf16']}, avx512_bf16: {out['cpu']['avx512_bf16']}",
             f"{'shape':<8} {'variant':<6} {'gen s':>7} {'pi_old':>7} {'update':>7} {'step':>7}  "
             f"{'gen x':>6} {'upd x':>6} {'step x':>6}  {'sampler|dlogp| max/mean':>24} {'seq':>8}"]
    for shape, s in out["shapes"].items():
        for v, r in s["summary"].items():
            ph, sp, g = r["phases_s"], r["speedup_vs_fp32"], r["gap"]["sampler_vs_fp32"]
            lines.append(f"{shape:<8} {v:<6} {ph['generate']:>7.3f} {ph['pi_old']:>7.3f} {ph['update']:>7.3f} "
                         f"{ph['step']:>7.3f}  {sp.get('generate', 0):>6.2f} {sp.get('update', 0):>6.2f} "
                         f"{sp.get('step', 0):>6.2f}  {g['token_abs_max']:>11.2e}/{g['token_abs_mean']:<11.2e} "
                         f"{g['seq_abs_mean']:>8.1e}")
    lines.append("(median over rounds; x = fp32 time / variant time within a round; |dlogp| against an fp32 "
                 "trainer pass on the same weights)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
