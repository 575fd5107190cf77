"""gspo vs TRL's GRPOTrainer configured for GSPO: wall time per rollout at equal work, side by side.

    python bench/trl_compare.py --out runs/trl_compare.json   # tiny dense, tiny MoE, compute-bound dense (~7 min)
    python bench/trl_compare.py --quick               # one small round (< 60 s); gspo only when trl is missing
    python bench/trl_compare.py --workloads tiny-dense --rounds 5 --out runs/trl_compare.json
    python bench/trl_compare.py --profile --workloads tiny-dense    # + cProfile's top functions of each

Needs the `bench` extra (`pip install -e ".[bench]"`: trl) for the TRL side.

Equal work. Both frameworks train the same saved model (random Qwen3 / Qwen3-MoE weights built
from a config, fp32, loaded with `from_pretrained` from one directory) with the same character
tokenizer, on the same prompts in the same order (gspo's arithmetic task; the TRL dataset is laid
out in the order gspo's prompt sampler deals them, and TRL reads it unshuffled), B prompts x G
completions per rollout, at most T new tokens sampled at temperature 1, top_p 1, top_k 0 by
transformers `generate` (no vLLM), the same reward function (`bench_reward`, a deterministic
checksum of the completion text), group-normalised advantages, M=4 optimizer steps per rollout
on minibatches of B*G/M sequences (no micro-batching), the sequence-level GSPO loss with clip
range (3e-4, 4e-4), no KL term, a pi_old pass with the pre-update weights, AdamW (betas 0.9/0.999,
eps 1e-8, no weight decay) at a constant learning rate, gradient norm clipped to 1, fp32, no
gradient checkpointing, no evaluation, no intermediate checkpoints.

  TRL: GRPOConfig(importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4,
       epsilon_high=4e-4, beta=0, num_generations=G, max_completion_length=T,
       per_device_train_batch_size=B*G/M, gradient_accumulation_steps=1, steps_per_generation=M,
       num_iterations=1, ...): in TRL 1.16 a "step" of steps_per_generation is one micro-batch of
       per_device_train_batch_size rows, so with no accumulation one generation batch of B*G rows
       feeds M optimizer steps; as gradient_accumulation_steps (1) is not a multiple of
       steps_per_generation (4), TRL runs its no-grad pi_old pass (old_per_token_logps). bf16 and
       gradient checkpointing (TRL's defaults) are off, router_aux_loss_coef=0 (gspo has no MoE
       aux loss), logging_strategy="no", report_to="none", save_strategy="no", use_cpu=True.
  gspo: its defaults (minibatches of whole groups, schedule.minibatch_by=group, where TRL
       shuffles rows: the same rows and tokens per step; each group's prompt runs once per
       trainer call, model.share_prompt; rows with advantage 0 skipped, which the checksum
       reward makes rare; rollout.old_logp=auto: on a dense fp32 model the sampler's log-probs
       are pi_old and there is no pi_old pass; a MoE model keeps the pass, which records
       routes; --gspo-set rollout.old_logp=trainer forces the pass), algo.level=sequence,
       schedule.num_minibatches=4, eval off,
       console/completions/table logging off, checkpoint.every=0 (it still writes metrics.jsonl
       every step and a checkpoint + final/ after the last rollout: those come after the timed
       rollouts), rewards.num_workers=1 (gspo's minimum: the reward runs in one forked worker
       process, TRL calls it in-process; the "score" phase shows what that costs, ~1 ms).

Completion lengths: the tokenizer has the task characters plus 1000 filler characters, so a random
model samples EOS with probability ~1e-3 per token and completions almost always run to T; the
mean completion length of each side is reported, and so are completion tokens/s.

Measurement. Each (framework, round) cell is a fresh subprocess (bench/trl_cells.py) with
OMP_WAIT_POLICY=PASSIVE; TRL runs at each of --trl-threads torch threads (default 1) and each round
takes its fastest, gspo at its own default (1 thread on <= 4 cores, every core for a model of
>= 0.75M weights in a decoder layer or the LM head: gspo.train.threads.threads_for_model). Start-up (imports, model load, trainer set-up) and
--warmup rollouts are not timed; then --rollouts rollouts are. A rollout's wall time runs from the
end of one rollout to the end of the next: generation, reward, pi_old pass, the M optimizer steps
and the framework's own bookkeeping between them. TRL: timestamps at on_step_end of every M-th
optimizer step (a TrainerCallback); gspo: `gspo.train.train` itself, with a timestamp taken when it
pushes the weights (push_weights) at the end of every rollout. Rounds alternate the order (gspo, trl), (trl,
gspo), ...; the TRL/gspo ratio is taken within a round (median rollout time of each cell) and the
median over rounds is reported. Each cell also records how many cores other processes kept busy
during its timed rollouts (/proc/stat), so that a cell slowed by someone else's job shows.

Phases (mean seconds per timed rollout): generate (gspo: HFGenerator.generate; TRL:
_generate_single_turn), score (the reward call), pi_old (gspo: the plan and train.old_logprobs; TRL: its
no-grad _get_per_token_logps_and_entropies), update (the M optimizer steps: forward, backward,
clipping, AdamW, scheduler; gspo: train.minibatch_step and the weight push; TRL: training_step minus its _prepare_inputs,
plus the time from the end of training_step to on_step_end), other (the rest of the rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
_MARK = "TRL_COMPARE_JSON "

# Model shapes and rollout shapes. B prompts x G completions, T new tokens at most.
WORKLOADS: dict[str, dict] = {
    # the demo's model size (gspo demo: hidden 128, 2 layers)
    "tiny-dense": dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=128, moe=False, B=16, G=8, T=32),
    "tiny-moe": dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=128, moe=True, B=16, G=8, T=32),
    # ~30M parameters, 128-token responses: the matmuls dominate
    "compute-dense": dict(hidden=512, layers=8, heads=8, kv_heads=4, inter=2048, moe=False, B=1, G=8, T=128),
    "compute-moe": dict(hidden=384, layers=6, heads=6, kv_heads=2, inter=512, moe=True, B=1, G=8, T=128),
}
# The same shapes with ~128-token prompts: a fixed 122-token instruction before each arithmetic
# question, as a chat template or a task description puts before real RL prompts.
for _name in ("tiny-dense", "tiny-moe", "compute-dense"):
    WORKLOADS[f"{_name}-p128"] = dict(WORKLOADS[_name], prefix=122)
DEFAULT_WORKLOADS = ["tiny-dense", "tiny-moe", "compute-dense", "tiny-dense-p128", "tiny-moe-p128", "compute-dense-p128"]
# per workload: (warm-up rollouts, timed rollouts, rounds) for the full run
SCHEDULE = {"tiny-dense": (2, 4, 3), "tiny-moe": (2, 4, 3), "compute-dense": (1, 2, 3), "compute-moe": (1, 2, 3),
            "tiny-dense-p128": (2, 4, 3), "tiny-moe-p128": (2, 4, 3),
            "compute-dense-p128": (1, 2, 3)}
# The grid (issue 17): a spread of rollout shapes, not a chosen workload. Rows B*G from 32 to
# 256, prompts of ~8 (arithmetic) or ~130 tokens (prefix), completions of 16 to 128 tokens,
# dense and MoE, and two kinds of random model: the usual 1000 filler characters, whose EOS is
# rare (completions run to T), and a 16-filler vocabulary (`filler`), whose EOS comes about
# once in 35 tokens (completions end early and vary in length, as a warmed-up model's do).
TINY_D = dict(hidden=128, layers=2, heads=4, kv_heads=2, inter=128, moe=False)
TINY_M = dict(TINY_D, moe=True)
GRID: dict[str, dict] = {
    "g-dense-32r-p8-t16": dict(TINY_D, B=4, G=8, T=16),
    "g-moe-32r-p8-t16": dict(TINY_M, B=4, G=8, T=16),
    "g-dense-128r-p8-t32": dict(TINY_D, B=16, G=8, T=32),
    "g-dense-64r-p128-t64-eos": dict(TINY_D, B=8, G=8, T=64, prefix=122, filler=16),
    "g-moe-128r-p128-t32": dict(TINY_M, B=16, G=8, T=32, prefix=122),
    "g-dense-256r-p8-t128-eos": dict(TINY_D, B=32, G=8, T=128, filler=16),
    "g-moe-64r-p8-t128-eos": dict(TINY_M, B=8, G=8, T=128, filler=16),
    "g-32m-32r-p8-t64": dict(WORKLOADS["compute-dense"], B=4, G=8, T=64),
}
WORKLOADS.update(GRID)
# A real tokenizer's vocabulary (32k entries, as Llama 2 / Mistral have): the LM head and the
# sampler weigh as they do for a small real model. Not in GRID (the grid's figures predate it).
WORKLOADS["g-dense-64r-p8-t32-v32k"] = dict(TINY_D, B=8, G=8, T=32, filler=32000)
WORKLOADS["g-moe-64r-p8-t32-v32k"] = dict(TINY_M, B=8, G=8, T=32, filler=32000)
# Long completions (256 tokens, EOS rare): the decode's attention and cache grow with every step.
WORKLOADS["g-dense-32r-p8-t256"] = dict(TINY_D, B=4, G=8, T=256)
# Off the grid (2026-12-07): shapes no earlier run measured, to check that the edge holds away from
# the grid's: a deep narrow model (per-layer call overhead), the smallest group (G = 2, nothing to
# share), a large one (G = 32 of 2 prompts), and prefill-heavy rows (~500-token prompts, 8 new tokens).
WORKLOADS["x-deep-64r-p8-t32"] = dict(hidden=64, layers=8, heads=4, kv_heads=2, inter=128, moe=False, B=8, G=8, T=32)
WORKLOADS["x-g2-128r-p8-t32"] = dict(TINY_D, B=64, G=2, T=32)
WORKLOADS["x-g32-64r-p8-t32"] = dict(TINY_D, B=2, G=32, T=32)
WORKLOADS["x-moe-32r-p500-t8"] = dict(TINY_M, B=4, G=8, T=8, prefix=494)
SCHEDULE.update({n: (1, 3, 3) for n in WORKLOADS if n.startswith(("g-", "x-"))})
QUICK = dict(hidden=64, layers=2, heads=4, kv_heads=2, inter=128, moe=False, B=4, G=4, T=8)
M = 4  # optimizer steps (minibatches) per rollout
LR = 1e-5
SEED = 0
FILLER_CHARS = 1000  # extra tokenizer characters, so that EOS is rare under a random model
NUM_PROMPTS = 2000


def bench_reward(prompts, completions, **kwargs) -> list[float]:
    """Cheap deterministic reward both frameworks call in-process: a checksum of the text in [0, 1]."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[0]["content"]
        out.append((sum(map(ord, text)) % 11) / 10.0)
    return out


# ---------------------------------------------------------------- models


def tokenizer_chars(filler: int = FILLER_CHARS) -> str:
    from gspo.tasks import TASK_CHARS

    return "".join(sorted(TASK_CHARS)) + "".join(chr(0x4E00 + i) for i in range(filler))


def instruction(n: int, filler: int = FILLER_CHARS) -> str:
    """A fixed `n`-character instruction (one token per character) put before every prompt."""
    return "".join(chr(0x4E00 + (37 * i) % filler) for i in range(n))


def build_model_dir(path: Path, w: dict) -> dict:
    """Save a random model of shape `w` and the char tokenizer to `path` (and, for a workload
    with a `prefix`, its prompts as prompts.jsonl); returns the model's size."""
    from gspo.tasks import arithmetic
    from gspo.models.tiny import build_char_tokenizer, build_tiny_model

    filler = w.get("filler", FILLER_CHARS)
    tok = build_char_tokenizer(tokenizer_chars(filler))
    model = build_tiny_model(tok, hidden_size=w["hidden"], num_layers=w["layers"], num_heads=w["heads"],
                             num_kv_heads=w["kv_heads"], intermediate_size=w["inter"], moe=w["moe"], seed=SEED,
                             max_position_embeddings=max(128, 32 + w.get("prefix", 0) + w["T"]))
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    if w.get("prefix"):
        head = instruction(w["prefix"], filler)
        rows = [{"prompt": head + r["prompt"], "answer": r["answer"]} for r in arithmetic(NUM_PROMPTS, seed=SEED)]
        (path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"params": sum(p.numel() for p in model.parameters()), "vocab": len(tok)}


# ---------------------------------------------------------------- driver


def _env() -> dict:
    env = dict(os.environ)
    env.update(OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=os.pathsep.join(
                   [str(ROOT / "src"), str(BENCH), *filter(None, [os.environ.get("PYTHONPATH")])]),
               TRANSFORMERS_VERBOSITY="error")
    return env


def run_cell(framework: str, spec: dict, timeout: float) -> dict:
    """One (framework, round) cell in a fresh process (bench/trl_cells.py); its result."""
    cmd = [sys.executable, str(BENCH / "trl_cells.py"), framework, json.dumps(spec)]
    env = _env()
    if framework.startswith("gspo"):  # gspo picks its own thread count (1 on <= 4 cores, all for a compute-bound model)
        env.pop("OMP_NUM_THREADS", None)
        env.pop("MKL_NUM_THREADS", None)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=str(ROOT))
    for line in p.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"{framework} worker failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")


def trl_available() -> str | None:
    """None when trl imports, else the reason it does not."""
    try:
        import trl  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return f"trl is not importable ({type(e).__name__}: {e}); pip install -e '.[bench]'"
    return None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=None)
    ap.add_argument("--grid", action="store_true", help="the workload grid (GRID, ~40 min); median and worst reported")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default per workload)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rollouts per cell (default per workload)")
    ap.add_argument("--rollouts", type=int, default=None, help="timed rollouts per cell (default per workload)")
    ap.add_argument("--quick", action="store_true", help="one small round of a tiny model (< 60 s)")
    ap.add_argument("--gspo-only", action="store_true", help="skip the TRL side")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed rollouts; print each side's top functions")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per cell")
    ap.add_argument("--trl-threads", type=int, nargs="+", default=[1],
                    help="torch thread counts to run the TRL side at; each round takes its fastest (gspo runs at "
                         "its default: 1 thread on <= 4 cores)")
    ap.add_argument("--async", dest="async_mode", action="store_true",
                    help="also run gspo in async mode (rollout.mode=async: a learner and a generator process, "
                         "K=1), reported beside sync mode as its own ratio")
    ap.add_argument("--gspo-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra gspo config override, repeatable (e.g. rollout.old_logp=trainer)")
    a = ap.parse_args(argv)

    skip = "--gspo-only" if a.gspo_only else trl_available()
    frameworks = (["gspo"] if skip else ["gspo", "trl"]) + (["gspo-async"] if a.async_mode else [])
    if skip and not a.gspo_only:
        print(f"TRL side skipped: {skip}", file=sys.stderr)
    if a.quick:
        workloads = {"quick": QUICK}
        sched = {"quick": (1, 2, 1)}
    else:
        names = a.workloads or (list(GRID) if a.grid else DEFAULT_WORKLOADS)
        workloads = {n: WORKLOADS[n] for n in names}
        sched = {n: SCHEDULE[n] for n in names}
    sys.path.insert(0, str(ROOT / "src"))
    results: dict = {"machine": _machine(), "frameworks": frameworks, "trl_skipped": skip, "workloads": {},
                     "gspo_set": a.gspo_set}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trl-compare-models-") as tmp:
        for name, w in workloads.items():
            warm, timed, rounds = sched[name]
            warm = a.warmup if a.warmup is not None else warm
            timed = a.rollouts if a.rollouts is not None else timed
            rounds = a.rounds if a.rounds is not None else rounds
            mdir = Path(tmp) / name
            info = build_model_dir(mdir, w)
            spec = {**w, "model_dir": str(mdir), "warmup": warm, "rollouts": timed, "profile": a.profile,
                    "gspo_set": a.gspo_set}
            cells: list[dict] = []
            for r in range(rounds):
                order = frameworks if r % 2 == 0 else frameworks[::-1]
                row = {}
                for fw in order:
                    tried = []
                    for threads in (a.trl_threads if fw == "trl" else [1]):
                        t0 = time.perf_counter()
                        res = run_cell(fw, {**spec, "trl_threads": threads}, a.timeout)
                        res["cell_wall_s"] = time.perf_counter() - t0
                        tried.append(res)
                        print(f"  {name} round {r + 1}/{rounds} {fw} ({threads} thr): {res['median_s']:.3f} s/rollout "
                              f"({res['tokens_per_s']:.0f} tok/s, cell {res['cell_wall_s']:.0f} s)", file=sys.stderr)
                    row[fw] = min(tried, key=lambda x: x["median_s"])  # TRL at its best thread count
                    if len(tried) > 1:
                        row[fw]["by_threads"] = {x["threads"]: x["median_s"] for x in tried}
                cells.append(row)
            results["workloads"][name] = _summarise(name, w, info, spec, cells, frameworks)
    results["wall_s"] = time.perf_counter() - t_all
    ratios = [w["ratio_trl_over_gspo"] for w in results["workloads"].values() if "ratio_trl_over_gspo" in w]
    if ratios:
        worst = min(results["workloads"], key=lambda n: results["workloads"][n].get("ratio_trl_over_gspo", 1e9))
        results["summary"] = {"cells": len(ratios), "median_ratio": statistics.median(ratios),
                              "worst_ratio": min(ratios), "worst_cell": worst, "best_ratio": max(ratios)}
    ratios_async = {n: w["ratio_trl_over_gspo_async"] for n, w in results["workloads"].items()
                    if "ratio_trl_over_gspo_async" in w}
    if ratios_async:
        v = list(ratios_async.values())
        results["summary_async"] = {"cells": len(v), "median_ratio": statistics.median(v), "worst_ratio": min(v),
                                    "worst_cell": min(ratios_async, key=ratios_async.get), "best_ratio": max(v)}
    print(format_table(results))
    if "summary" in results:
        sm = results["summary"]
        print(f"TRL/gspo over {sm['cells']} cells: median {sm['median_ratio']:.2f}x, worst {sm['worst_ratio']:.2f}x "
              f"({sm['worst_cell']}), best {sm['best_ratio']:.2f}x")
    if "summary_async" in results:
        sm = results["summary_async"]
        print(f"TRL/gspo-async over {sm['cells']} cells: median {sm['median_ratio']:.2f}x, worst "
              f"{sm['worst_ratio']:.2f}x ({sm['worst_cell']}), best {sm['best_ratio']:.2f}x")
    if a.profile:
        for name, wres in results["workloads"].items():
            for fw in frameworks:
                prof = wres["cells"][0][fw].get("profile")
                if prof:
                    print(f"\n--- cProfile {name} / {fw} (timed rollouts, by own time) ---")
                    print("\n".join(prof))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=2))
    return results


def _summarise(name, w, info, spec, cells, frameworks) -> dict:
    out = {"shape": {k: w[k] for k in w}, **info, "M": M, "warmup": spec["warmup"], "rollouts": spec["rollouts"],
           "rounds": len(cells), "cells": cells}
    for fw in frameworks:
        med = [c[fw]["median_s"] for c in cells]
        out[fw] = {
            "rollout_s": statistics.median(med), "rollout_s_min": min(med), "rollout_s_max": max(med),
            "tokens_per_s": statistics.median(c[fw]["tokens_per_s"] for c in cells),
            "mean_completion_len": statistics.fmean(c[fw]["mean_completion_len"] for c in cells),
            "phases": {k: statistics.median(c[fw]["phases"].get(k, 0.0) for c in cells)
                       for k in ("generate", "score", "pi_old", "update", "other")},
            "setup_s": statistics.median(c[fw]["setup_s"] for c in cells),
            "threads": cells[0][fw]["threads"],
            "others_cores_max": max(c[fw]["others_cores"] for c in cells),
        }
    if "trl" in frameworks:
        ratios = [c["trl"]["median_s"] / c["gspo"]["median_s"] for c in cells]
        if "gspo-async" in frameworks:
            out["ratios_async"] = [c["trl"]["median_s"] / c["gspo-async"]["median_s"] for c in cells]
            out["ratio_trl_over_gspo_async"] = statistics.median(out["ratios_async"])
        out["ratio_trl_over_gspo"] = statistics.median(ratios)
        out["ratios"] = ratios
        # the same in completion tokens/s (gspo over TRL), neutral to any difference in lengths
        out["ratio_tokens_per_s"] = statistics.median(c["gspo"]["tokens_per_s"] / c["trl"]["tokens_per_s"] for c in cells)
    return out


def format_table(results: dict) -> str:
    head = (f"{'workload':<18} {'params':>7} {'BxG,T':>9} {'side':<10} {'s/rollout':>10} {'tok/s':>8} {'len':>6} "
            f"{'gen':>7} {'pi_old':>7} {'update':>7} {'other':>7}  TRL/gspo")
    lines = [head]
    for name, w in results["workloads"].items():
        s = w["shape"]
        first = [name, f"{w['params'] / 1e6:.2f}M", f"{s['B']}x{s['G']},{s['T']}"]
        for i, fw in enumerate(results["frameworks"]):
            f, ph = w[fw], w[fw]["phases"]
            c = first if i == 0 else ["", "", ""]
            ratio = f"{w['ratio_trl_over_gspo']:.2f}x" if i == 0 and "ratio_trl_over_gspo" in w else ""
            if fw == "gspo-async" and "ratio_trl_over_gspo_async" in w:
                ratio = f"{w['ratio_trl_over_gspo_async']:.2f}x"
            lines.append(f"{c[0]:<18} {c[1]:>7} {c[2]:>9} {fw:<10} {f['rollout_s']:>10.3f} {f['tokens_per_s']:>8.0f} "
                         f"{f['mean_completion_len']:>6.1f} {ph['generate']:>7.3f} {ph['pi_old']:>7.3f} "
                         f"{ph['update']:>7.3f} {ph['other'] + ph['score']:>7.3f}  {ratio}")
    busy = max(w[fw]["others_cores_max"] for w in results["workloads"].values() for fw in results["frameworks"])
    m = results["machine"]
    lines.append(f"(median over rounds; phases in s per rollout, 'other' includes the reward; {m['cpu']}, "
                 f"{m['cores']} cores, torch {m['torch']}, transformers {m['transformers']}, trl {m.get('trl', '-')}, "
                 f"gspo {sorted({c['gspo']['threads'] for w in results['workloads'].values() for c in w['cells']})} threads (its default; async: 1 a process), TRL the best of {sorted({c['trl']['threads'] for w in results['workloads'].values() for c in w['cells']}) if 'trl' in results['frameworks'] else '-'} threads; other processes kept up to {busy:.2f} cores busy during a timed cell)")
    return "\n".join(lines)


def _machine() -> dict:
    import platform

    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for ln in Path("/proc/cpuinfo").read_text().splitlines():
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    m = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
         "transformers": transformers.__version__}
    try:
        import trl

        m["trl"] = trl.__version__
    except Exception:
        pass
    return m


if __name__ == "__main__":
    main()
