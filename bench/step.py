"""Wall time of one GSPO training step, by phase: generate, score, pi_old pass, update.

    python bench/step.py                                  # the demo's tiny model, library thread default
    python bench/step.py --threads 2 tiny.hidden_size=512 tiny.num_layers=4
    python bench/step.py --compare-threads                # 1 vs 2 threads x OMP_WAIT_POLICY (~8 min)

The step is the one `gspo.train.train` runs: `train.produce` (prompts -> generator.generate ->
train.score -> advantages) then `train.learn` (train.make_plan -> train.old_logprobs, which
skips the first minibatch's rows, whose forward in the update is their pi_old ->
train.minibatch_step per minibatch -> push_weights), each phase timed where those functions
are called (`phase_hooks`). Logging, checkpoints and evaluation are left out (eval is disabled). "other" is the step's wall time not spent in
the four phases (prompt sampling and rendering, advantages, bookkeeping).

The default config is the demo's GSPO phase (gspo.demo.DEMO_OVERRIDES: tiny Qwen3-style model,
hidden 128, 2 layers, 32 prompts x 8 completions, max_new_tokens=6), built from scratch with
no supervised warm-up: the untrained model samples near-random characters, so completions
mostly run to max_new_tokens; the mean completion length is printed with the figures.
Tokens are completion tokens (the mask, EOS included); tokens/s of a phase is the step's
completion tokens divided by that phase's time.

Timing: --warmup steps are run first and discarded (allocator, transformers' first-call
set-up), then --repeats blocks of --rollouts steps are timed; a phase's figure is the median
over blocks of its mean seconds per step, with the min-max over blocks.

--compare-threads runs the same measurement in fresh subprocesses (OMP_WAIT_POLICY is read
once, when libgomp loads, so each setting needs its own process) for four variants: 1 thread;
2 threads with OMP_WAIT_POLICY=PASSIVE, unset (libgomp spins ~300k iterations, then sleeps)
and ACTIVE (spins). Three shapes: the tiny demo model; a bigger, compute-bound one (hidden
512, 4 layers, max_new_tokens=32, 16 prompts x 8); and the tiny model again while one other
process keeps one core busy (a reward pool, a second job, CI's parallel tests). Variants are
interleaved round by round, in alternating order; ratios to "1 thread" are taken within a
round (neighbours in time) and the median over rounds is reported, to damp the drift of a
noisy machine. Which policy a real run gets: `gspo train` / `gspo demo` and any script that
imports gspo before torch run with PASSIVE unless the user set OMP_WAIT_POLICY (gspo's
__init__ sets it by setdefault); a script that imports torch first gets libgomp's default
("unset"). Every cell also records how many cores other processes used during its timed
steps (from /proc/stat), so that a cell disturbed by someone else's job shows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# libgomp reads OMP_WAIT_POLICY once, when torch loads it; `import gspo` sets it to PASSIVE when
# unset (setdefault), which only takes effect if gspo is imported before torch. This script
# imports torch first, so the policy in force is the one the process was started with.
_OMP_AT_START = os.environ.get("OMP_WAIT_POLICY")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PHASES = ("generate", "score", "pi_old", "update")
# the bigger, compute-bound shape of --compare-threads (16 prompts x 8, so that a cell stays ~20 s)
BIG_MODEL = ["tiny.hidden_size=512", "tiny.num_layers=4", "rollout.max_new_tokens=32",
             "rollout.prompts_per_step=16"]
# (label, torch threads, OMP_WAIT_POLICY: None = unset)
VARIANTS = [
    ("1 thread", 1, None),
    ("2 threads PASSIVE", 2, "PASSIVE"),
    ("2 threads unset", 2, None),
    ("2 threads ACTIVE", 2, "ACTIVE"),
]
_MARK = "BENCH_STEP_JSON "


def _cpu_sample() -> tuple[float, float, float, float]:
    """(wall s, machine busy CPU-s, steal CPU-s, this process's CPU-s). /proc/stat counts every core."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy, steal = (v[0] + v[1] + v[2] + v[5] + v[6]) / hz, v[7] / hz  # user nice system irq softirq
    except (OSError, ValueError, IndexError):
        busy = steal = float("nan")
    t = os.times()
    return time.perf_counter(), busy, steal, t.user + t.system


def base_overrides(demo: bool = True) -> list[str]:
    """The demo's GSPO phase (unless a YAML config is given), eval and console output off."""
    from gspo.demo import DEMO_OVERRIDES

    return [*(DEMO_OVERRIDES if demo else []), "eval.enabled=false", "logging.console=false", "logging.completions_every=0",
            "logging.table_every=0", "checkpoint.every=0"]


# ---------------------------------------------------------------- one measurement (in process)


def build(config: str | None, overrides: list[str], *, threads: int, steps: int, out_dir: str):
    """(cfg, run, seconds to build): the run `gspo.train.train` would build, for `steps`
    rollouts, writing under `out_dir`. The caller closes the run."""
    from gspo.config import load_config
    from gspo.train.run import build_run

    cfg = load_config(config, [*base_overrides(demo=config is None), f"schedule.rollouts={steps}", f"threads={threads}",
                               f"output.dir={out_dir}", "output.name=bench", *overrides])
    t0 = time.perf_counter()
    run = build_run(cfg)  # calls setup_threads(cfg.threads)
    return cfg, run, time.perf_counter() - t0


@contextlib.contextmanager
def phase_hooks(run, wrap=None, on_push=None):
    """Time (and, with `wrap(phase)`, run inside a context manager) each phase of the step that
    `gspo.train.produce` and `learn` call by name: generate (the generator), score, pi_old (the
    plan and the no-grad pass), update (the minibatch steps and the weight push). Yields the
    dict of seconds per phase, summed over calls; `on_push()` runs after each weight push."""
    from gspo.train import loop as train

    times = dict.fromkeys(PHASES, 0.0)
    wrap = wrap or (lambda phase: contextlib.nullcontext())

    def timed(phase, fn, after=None):
        def call(*a, **kw):
            t0 = time.perf_counter()
            with wrap(phase):
                out = fn(*a, **kw)
            times[phase] += time.perf_counter() - t0
            if after is not None:
                after()
            return out
        return call

    names = {"score": "score", "make_plan": "pi_old", "old_logprobs": "pi_old", "minibatch_step": "update",
             "push_weights": "update"}
    saved = {n: getattr(train, n) for n in names}
    generate = run.generator.generate
    run.generator.generate = timed("generate", generate)
    for n, phase in names.items():
        setattr(train, n, timed(phase, saved[n], on_push if n == "push_weights" else None))
    try:
        yield times
    finally:
        for n, fn in saved.items():
            setattr(train, n, fn)
        run.generator.generate = generate


def timed_step(run, state, wrap=None) -> tuple[dict, object]:
    """One training step, `gspo.train.produce` then `learn`, timed by phase (`phase_hooks`):
    ({"step", "generate", "score", "pi_old", "update": seconds}, the step's Rollout)."""
    from gspo.train import loop as train

    t_step = time.perf_counter()
    with phase_hooks(run, wrap) as times:
        scored = train.produce(run, state)
        train.learn(run, scored, state)
    state.rollout += 1
    return {"step": time.perf_counter() - t_step, **times}, scored.rollout


def force_full_length(run) -> None:
    """Make every completion run to max_new_tokens: the generator's only EOS id becomes one past
    the vocabulary, which is never sampled (the model, its log-probs and the loss are unchanged;
    without it the random model ends ~1 completion in |V| per token with EOS)."""
    vocab = run.policy.get_output_embeddings().weight.shape[0]
    run.generator.eos_token_ids = [int(vocab)]


def measure(config: str | None, overrides: list[str], *, threads: int, warmup: int, rollouts: int,
            repeats: int, prepare=None, on_step=None) -> dict:
    """`prepare(run)` runs once after the run is built; `on_step(run, rollout, state, record)`
    after each timed step may add keys to its record (the records are then returned too)."""
    import torch

    from gspo.train import loop as train

    steps_total = warmup + rollouts * repeats
    with tempfile.TemporaryDirectory(prefix="gspo-bench-step-") as tmp:
        cfg, run, t_build = build(config, overrides, threads=threads, steps=steps_total, out_dir=tmp)
        run_threads = torch.get_num_threads()  # (the run's: it gives the process's back when it closes)
        state = train.TrainerState()
        records = []
        try:
            if prepare is not None:
                prepare(run)
            cpu0 = _cpu_sample()
            for i in range(steps_total):
                rollout_index = state.rollout
                times, rollout = timed_step(run, state)
                if i == warmup - 1:
                    cpu0 = _cpu_sample()
                if i >= warmup:
                    rec = {**times, "tokens": int(rollout.completion_mask.sum()),
                           "samples": rollout.num_samples, "max_len": rollout.completion_ids.shape[1]}
                    if on_step is not None:
                        on_step(run, rollout, rollout_index, rec)
                    records.append(rec)
            cpu1 = _cpu_sample()
        finally:
            run.close()
        n_params = sum(p.numel() for p in run.policy.parameters())
    wall = cpu1[0] - cpu0[0]
    own = (cpu1[3] - cpu0[3]) / wall
    busy = (cpu1[1] - cpu0[1]) / wall
    blocks = [records[b * rollouts:(b + 1) * rollouts] for b in range(repeats)]
    out = {
        "blocks": [{k: statistics.fmean(r[k] for r in blk) for k in ("step", *PHASES, "tokens")} for blk in blocks],
        "samples": records[0]["samples"],
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "params": n_params,
        "hidden": cfg.tiny.hidden_size if cfg.model.name_or_path == "tiny" else None,
        "layers": cfg.tiny.num_layers if cfg.model.name_or_path == "tiny" else None,
        "model": cfg.model.name_or_path,
        "threads": run_threads,
        "omp_wait_policy": _OMP_AT_START,
        "build_s": t_build,
        # during the timed steps, in cores: this process, every other process, hypervisor steal
        "cpu_own": own, "cpu_others": max(busy - own, 0.0), "cpu_steal": (cpu1[2] - cpu0[2]) / wall,
        "warmup": warmup, "rollouts": rollouts, "repeats": repeats,
    }
    if on_step is not None:
        out["records"] = records
    return out


def summarize(res: dict) -> dict:
    """Per phase: median over blocks of mean s/step, (min, max) over blocks."""
    out = {}
    for k in ("step", *PHASES, "tokens"):
        vals = [b[k] for b in res["blocks"]]
        out[k] = (statistics.median(vals), min(vals), max(vals))
    phase_sum = sum(out[p][0] for p in PHASES)
    out["other"] = (max(out["step"][0] - phase_sum, 0.0),) * 3
    return out


def print_phases(res: dict) -> None:
    s = summarize(res)
    step, tokens = s["step"][0], s["tokens"][0]
    print(f"model {res['model']} (hidden {res['hidden']}, layers {res['layers']}, {res['params'] / 1e6:.2f}M params), "
          f"{res['samples']} completions/step, max_new_tokens {res['max_new_tokens']}, "
          f"mean completion {tokens / res['samples']:.1f} tokens ({tokens:.0f} tokens/step)")
    print(f"torch threads {res['threads']}, OMP_WAIT_POLICY={res['omp_wait_policy'] or 'unset'} (as torch loaded); "
          f"{res['warmup']} warm-up steps, then {res['repeats']} x {res['rollouts']} timed steps "
          f"(context built in {res['build_s']:.1f}s)")
    print(f"CPU during the timed steps, in cores: this process {res['cpu_own']:.2f}, other processes "
          f"{res['cpu_others']:.2f}, steal {res['cpu_steal']:.2f} (of {os.cpu_count()})")
    print(f"{'phase':<10}{'s/step':>9}{'min-max':>17}{'share':>8}{'tokens/s':>11}")
    for k in (*PHASES, "other", "step"):
        med, lo, hi = s[k]
        rng = f"{lo:.3f}-{hi:.3f}" if k != "other" else ""
        share = f"{100 * med / step:.1f}%"
        tps = f"{tokens / med:.0f}" if med > 0 else "-"
        print(f"{k:<10}{med:>9.3f}{rng:>17}{share:>8}{tps:>11}")


# ---------------------------------------------------------------- --compare-threads


def run_worker(config: str | None, overrides: list[str], threads: int, policy: str | None, warmup: int,
               rollouts: int, timeout: float) -> dict:
    env = dict(os.environ)
    for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT"):
        env.pop(k, None)
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--threads", str(threads),
           "--warmup", str(warmup), "--rollouts", str(rollouts), "--repeats", "1"]
    if config:
        cmd += ["--config", config]
    cmd += overrides
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    for line in reversed(p.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"worker failed (rc {p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


class _BusyCore:
    """One busy-looping process for the duration of a cell: another job holding one core."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def compare_threads(args, user_overrides: list[str]) -> None:
    import contextlib

    # (label, overrides, warmup, timed steps, one core busy)
    big = [*BIG_MODEL, *args.big, *user_overrides]
    known = {"tiny": (list(user_overrides), 2, 5, False), "bigger": (big, 1, 2, False),
             "tiny+busy": (list(user_overrides), 2, 5, True), "bigger+busy": (big, 1, 2, True)}
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"--shapes: unknown shape {unknown[0] if unknown else ''!r}; choose from {', '.join(known)}")
    shapes = [(n, *known[n]) for n in names]
    if args.warmup is not None or args.rollouts is not None:
        shapes = [(s, ov, args.warmup if args.warmup is not None else w, args.rollouts or r, b)
                  for s, ov, w, r, b in shapes]
    results = {(s[0], v[0]): [] for s in shapes for v in VARIANTS}
    t_start = time.perf_counter()
    print(f"load average before: {_loadavg()}", flush=True)
    for r in range(args.repeats):
        for shape, ov, warmup, rollouts, busy in shapes:
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]  # alternate the order: no variant always first
            for label, threads, policy in order:
                with (_BusyCore() if busy else contextlib.nullcontext()):
                    res = run_worker(args.config, ov, threads, policy, warmup, rollouts, args.worker_timeout)
                results[(shape, label)].append(res)
                s = summarize(res)
                print(f"round {r + 1}/{args.repeats} {shape:<10} {label:<18} step {s['step'][0]:7.3f}s  "
                      + "  ".join(f"{p} {s[p][0]:.3f}" for p in PHASES)
                      + f"  | cores: own {res['cpu_own']:.2f} others {res['cpu_others']:.2f}", flush=True)
    print(f"\n{args.repeats} rounds in {time.perf_counter() - t_start:.0f}s (load average after: {_loadavg()}); "
          f"each cell is a fresh process: warm-up steps, then timed steps, all shown per shape")
    for shape, _, warmup, rollouts, busy in shapes:
        base = results[(shape, VARIANTS[0][0])]
        r0 = base[0]
        tok = statistics.median(b["blocks"][0]["tokens"] for b in base)
        print(f"\n{shape}: hidden {r0['hidden']}, layers {r0['layers']}, {r0['params'] / 1e6:.2f}M params, "
              f"{r0['samples']} completions x max_new_tokens {r0['max_new_tokens']} (~{tok:.0f} tokens/step), "
              f"{warmup} warm-up + {rollouts} timed steps per cell" + (", one other core-bound process" if busy else ""))
        print(f"{'variant':<20}{'step s':>8}{'tokens/s':>10}{'vs 1 thread':>13}{'range':>13}   "
              + "".join(f"{p:>10}" for p in PHASES) + f"{'own/others cores':>18}")
        for label, _, _ in VARIANTS:
            runs = results[(shape, label)]
            steps = [x["blocks"][0]["step"] for x in runs]
            ratios = [x["blocks"][0]["step"] / b["blocks"][0]["step"] for x, b in zip(runs, base)]
            phase_ratios = [statistics.median(x["blocks"][0][p] / b["blocks"][0][p] for x, b in zip(runs, base))
                            for p in PHASES]
            med = statistics.median(steps)
            print(f"{label:<20}{med:>8.3f}{tok / med:>10.0f}{statistics.median(ratios):>13.2f}"
                  f"{f'{min(ratios):.2f}-{max(ratios):.2f}':>13}   " + "".join(f"{x:>10.2f}" for x in phase_ratios)
                  + f"{statistics.median(x['cpu_own'] for x in runs):>12.2f} / "
                  + f"{statistics.median(x['cpu_others'] for x in runs):.2f}")
    print("\nvs 1 thread = step time / the '1 thread' step time of the same round and shape, median over rounds "
          "(< 1 is faster); range = min-max over rounds; phase columns = the same ratio per phase; own/others cores = "
          "CPU use during the timed steps by the measured process and by every other process (median over rounds).\n"
          "`gspo train` runs with PASSIVE unless OMP_WAIT_POLICY is set; 'unset' is a script that imports torch before gspo")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{s}|{v}": x for (s, v), x in results.items()}, indent=1))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (after the demo's defaults)")
    ap.add_argument("--config", default=None, help="YAML config instead of the demo's settings (eval is still disabled)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = the library's auto default)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --compare-threads: 2 tiny, 1 bigger)")
    ap.add_argument("--rollouts", type=int, default=None, help="timed steps per block (default 10; --compare-threads: 5 tiny, 2 bigger)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed blocks (in --compare-threads: interleaved rounds of fresh processes)")
    ap.add_argument("--compare-threads", action="store_true",
                    help="1 vs 2 threads x OMP_WAIT_POLICY, in subprocesses, over --shapes")
    ap.add_argument("--big", action="append", default=[], metavar="KEY=VALUE",
                    help=f"extra override for the bigger shape of --compare-threads, repeatable "
                         f"(applied after {' '.join(BIG_MODEL)})")
    ap.add_argument("--shapes", default="tiny,bigger,tiny+busy",
                    help="--compare-threads shapes, comma-separated: tiny, bigger, tiny+busy, bigger+busy")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--worker-timeout", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        ap.error(f"not a key=value override: {bad[0]}")
    if args.compare_threads:
        compare_threads(args, args.overrides)
        return
    args.warmup = 3 if args.warmup is None else args.warmup
    args.rollouts = 10 if args.rollouts is None else args.rollouts
    res = measure(args.config, args.overrides, threads=args.threads, warmup=args.warmup,
                  rollouts=args.rollouts, repeats=args.repeats)
    if args.worker:
        print(_MARK + json.dumps(res), flush=True)
        return
    print_phases(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
