"""One cell of bench/trl_compare.py: a fresh process that trains one framework (gspo or TRL's
GRPOTrainer set up for GSPO) on one workload and prints its timings as one JSON line.

    python bench/trl_cells.py gspo|trl SPEC_JSON     # run by trl_compare.py, not by hand

What is timed and how (rollout marks, phases, CPU sampling, cProfile) is described in
trl_compare.py's docstring; the shared settings (workloads, M, LR, the reward) live there.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from trl_compare import _MARK, BENCH, LR, M, NUM_PROMPTS, SEED, bench_reward

def _gspo_overrides(spec: dict, total: int, out_dir: str) -> list[str]:
    return [
        f"model.name_or_path={spec['model_dir']}", "model.dtype=float32", "model.device=cpu",
        f"data.source={Path(spec['model_dir']) / 'prompts.jsonl' if spec.get('prefix') else 'arithmetic'}",
        f"data.num_prompts={NUM_PROMPTS}",
        f"rollout.prompts_per_step={spec['B']}", f"rollout.group_size={spec['G']}",
        f"rollout.max_new_tokens={spec['T']}", "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        "algo.level=sequence", "algo.eps_low=3e-4", "algo.eps_high=4e-4",
        f"optim.lr={LR}", "optim.weight_decay=0.0", "optim.max_grad_norm=1.0",
        f"schedule.rollouts={total}", f"schedule.num_minibatches={M}", "schedule.micro_batch_size=0",
        "schedule.lr_schedule=constant", "eval.enabled=false", "logging.console=false",
        "logging.completions_every=0", "logging.table_every=0", "checkpoint.every=0", "rewards.num_workers=1",
        f"seed={SEED}", f"output.dir={out_dir}", "output.name=bench",
        *spec.get("gspo_set", []),
    ]


def _prompt_order(spec: dict, total: int) -> list[str]:
    """The prompts gspo's prompt stream deals over `total` rollouts, in order (B per rollout)."""
    from gspo.config import load_config
    from gspo.data import PromptStream
    from gspo.train.prompts import load_prompt_rows

    cfg = load_config(None, _gspo_overrides(spec, total, "/nonexistent"))
    rows, _ = load_prompt_rows(cfg)
    stream = PromptStream(rows, spec["B"], seed=cfg.seed, shuffle=cfg.data.shuffle, rank=0, world_size=1)
    return [r["prompt"] for _ in range(total) for r in stream.next_batch()]


class _Phases:
    """Accumulates wall time per named phase."""

    def __init__(self):
        self.t: dict[str, float] = {}

    def add(self, name: str, dt: float) -> None:
        self.t[name] = self.t.get(name, 0.0) + dt

    def wrap(self, name: str, fn):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.add(name, time.perf_counter() - t0)
        return timed


def run_gspo(spec: dict) -> dict:
    import torch

    from gspo.train import loop as gtrain
    from gspo.config import load_config
    from gspo.train.run import build_run

    sys.path.insert(0, str(BENCH))
    from step import phase_hooks  # bench/step.py: the step's phases, timed where train calls them

    total = spec["warmup"] + spec["rollouts"]
    marks, snaps, tokens = _Marks(spec), [], []
    with tempfile.TemporaryDirectory(prefix="trl-compare-gspo-") as tmp:
        t0 = time.perf_counter()
        cfg = load_config(None, _gspo_overrides(spec, total, tmp))
        cfg.rewards.functions[0].name = "trl_compare:bench_reward"
        run = build_run(cfg)  # gspo's own thread default (setup_threads, threads_for_model)
        threads = torch.get_num_threads()  # (the run's: it gives the process's back when it closes)
        t_setup = time.perf_counter() - t0
        gen = run.generator.generate

        def generate(*a, **kw):
            r = gen(*a, **kw)
            tokens.append(int(r.completion_mask.sum()))
            return r

        run.generator.generate = generate
        with phase_hooks(run, on_push=lambda: (marks.append(time.perf_counter()), snaps.append(dict(times)))) as times:
            try:
                marks.append(time.perf_counter())
                snaps.append({})
                gtrain.train(cfg, run=run)  # the final checkpoint + final/ come after the last mark
            finally:
                if marks.prof:
                    marks.prof.disable()  # (already off unless the run failed)
        n_params = sum(p.numel() for p in run.policy.parameters())
    return _cell_result("gspo", spec, marks, snaps, tokens, t_setup, n_params, threads)


def run_gspo_async(spec: dict) -> dict:
    """gspo in async mode as a user starts it: `gspo train ... rollout.mode=async` (one learner
    and one generator process, K = rollout.max_staleness = 1), each process at its default of one
    thread. A rollout's wall time is the learner's `time/step` (from the start of one rollout to
    the start of the next: waiting for the generator, scoring, π_old, the M updates and the
    weight push), read from metrics.jsonl; the phases are the learner's own timers."""
    import subprocess

    total = spec["warmup"] + spec["rollouts"]
    with tempfile.TemporaryDirectory(prefix="trl-compare-gspo-async-") as tmp:
        overrides = [*_gspo_overrides(spec, total, tmp), "rewards.functions=[{name: 'trl_compare:bench_reward'}]",
                     "rollout.mode=async", f"rollout.max_staleness={spec.get('staleness', 1)}"]
        t0 = time.perf_counter()
        cpu0 = _cpu_sample()
        p = subprocess.run([sys.executable, "-m", "gspo", "train", *overrides], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), os.environ.get("PYTHONPATH", "")])})
        wall = time.perf_counter() - t0
        cpu1 = _cpu_sample()
        if p.returncode != 0:
            raise RuntimeError(f"gspo async failed (rc {p.returncode}):\n{p.stderr[-4000:]}")
        per_rollout, update = {}, {}
        for line in (Path(tmp) / "bench" / "metrics.jsonl").read_text().splitlines():  # a line per optimizer step
            r = json.loads(line)
            if "time/step" in r:
                per_rollout[r["rollout"]] = r
                update[r["rollout"]] = update.get(r["rollout"], 0.0) + r.get("time/update", 0.0)
        recs = [per_rollout[k] for k in sorted(per_rollout)][spec["warmup"]:]
    times = [r["time/step"] for r in recs]
    n_seq = spec["B"] * spec["G"]
    tok = [r["completion/len_mean"] * n_seq for r in recs]
    phase = {"generate": statistics.fmean(r.get("async/learner_idle_s", 0.0) for r in recs),  # the learner waiting
             "score": statistics.fmean(r.get("time/score", 0.0) for r in recs),
             "pi_old": statistics.fmean(r.get("time/old_logp", 0.0) for r in recs),
             "update": statistics.fmean(update[r["rollout"]] for r in recs)}
    phase["other"] = statistics.fmean(times) - sum(phase.values())
    busy = max(0.0, (cpu1[1] - cpu0[1]) - (cpu1[2] - cpu0[2])) / max(cpu1[0] - cpu0[0], 1e-9)
    return {"framework": "gspo-async", "rollout_s": times, "median_s": statistics.median(times),
            "tokens": tok, "tokens_per_s": sum(tok) / sum(times), "mean_completion_len": sum(tok) / (len(tok) * n_seq),
            "phases": phase, "setup_s": wall - sum(per_rollout[k]["time/step"] for k in per_rollout),
            "params": 0, "threads": 1, "others_cores": busy}


def run_trl(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    B, G, T = spec["B"], spec["G"], spec["T"]
    total = spec["warmup"] + spec["rollouts"]
    phases, marks, snaps, tokens = _Phases(), _Marks(spec), [], []
    t0 = time.perf_counter()
    torch.set_num_threads(spec.get("trl_threads", 1))
    prompts = _prompt_order(spec, total)
    ds = Dataset.from_dict({"prompt": prompts})
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)

    def reward(prompts, completions, completion_ids=None, **kw):
        tokens.append(sum(len(c) for c in completion_ids))
        return bench_reward(prompts, completions)

    reward.__name__ = "bench_reward"
    with tempfile.TemporaryDirectory(prefix="trl-compare-trl-") as tmp:
        args = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
            seed=SEED, data_seed=SEED, shuffle_dataset=False, dataloader_num_workers=0,
            # GSPO
            importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4, beta=0.0,
            scale_rewards="group", num_iterations=1, router_aux_loss_coef=0.0,
            # rollout shape: one generation batch of B*G rows feeds M optimizer steps of B*G/M rows
            num_generations=G, max_completion_length=T, temperature=1.0, top_p=1.0, top_k=0,
            per_device_train_batch_size=B * G // M, gradient_accumulation_steps=1, steps_per_generation=M,
            max_steps=total * M,
            # optimizer: AdamW, constant lr, clipping
            learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, adam_beta1=0.9,
            adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, optim="adamw_torch",
            # no eval, logging, saving
            eval_strategy="no", logging_strategy="no", report_to="none", save_strategy="no",
            disable_tqdm=True, log_completions=False,
        )
        t_end = [0.0]

        class Timer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                marks.append(time.perf_counter())
                snaps.append({})

            def on_step_end(self, args, state, control, **kw):
                phases.add("update", time.perf_counter() - t_end[0])  # clip, optimizer, scheduler
                if state.global_step % M == 0:
                    marks.append(time.perf_counter())
                    snaps.append(dict(phases.t))

        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[Timer()])
        torch.set_num_threads(spec.get("trl_threads", 1))
        trainer._generate_single_turn = phases.wrap("generate", trainer._generate_single_turn)
        trainer._calculate_rewards = phases.wrap("score", trainer._calculate_rewards)
        logps = trainer._get_per_token_logps_and_entropies

        def get_logps(*a, **kw):
            if torch.is_grad_enabled():
                return logps(*a, **kw)
            t = time.perf_counter()
            try:
                return logps(*a, **kw)
            finally:
                phases.add("pi_old", time.perf_counter() - t)

        trainer._get_per_token_logps_and_entropies = get_logps
        prep, step = trainer._prepare_inputs, trainer.training_step
        in_prep = [0.0]

        def prepare_inputs(*a, **kw):
            t = time.perf_counter()
            try:
                return prep(*a, **kw)
            finally:
                in_prep[0] += time.perf_counter() - t

        def training_step(*a, **kw):
            in_prep[0] = 0.0
            t = time.perf_counter()
            try:
                return step(*a, **kw)
            finally:
                t_end[0] = time.perf_counter()
                phases.add("update", t_end[0] - t - in_prep[0])

        trainer._prepare_inputs, trainer.training_step = prepare_inputs, training_step
        t_setup = time.perf_counter() - t0
        try:
            trainer.train()
        finally:
            if marks.prof:
                marks.prof.disable()  # (already off unless the run failed)
        n_params = sum(p.numel() for p in model.parameters())
        trl_version = __import__("trl").__version__
    res = _cell_result("trl", spec, marks, snaps, tokens, t_setup, n_params, torch.get_num_threads())
    res["trl_version"] = trl_version
    return res


def _cpu_sample() -> tuple[float, float, float]:
    """(wall s, machine busy CPU-s over all cores, this process's CPU-s incl. finished children)."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        busy = (v[0] + v[1] + v[2] + v[5] + v[6]) / hz  # user nice system irq softirq
    except (OSError, ValueError, IndexError):
        busy = float("nan")
    t = os.times()
    return time.perf_counter(), busy, t.user + t.system


class _Marks(list):
    """Rollout-end timestamps (the first is the start). Samples the machine's CPU use over the
    timed rollouts (so that a cell slowed by someone else's job shows), and with --profile runs
    a cProfile.Profile over exactly the timed rollouts."""

    def __init__(self, spec: dict):
        super().__init__()
        self.warmup, self.last = spec["warmup"] + 1, spec["warmup"] + spec["rollouts"] + 1
        self.cpu: list = []
        self.prof = None
        if spec.get("profile"):
            import cProfile

            self.prof = cProfile.Profile()

    def append(self, x) -> None:
        super().append(x)
        if len(self) in (self.warmup, self.last):
            if self.prof is not None:
                (self.prof.enable if len(self) == self.warmup else self.prof.disable)()
            self.cpu.append(_cpu_sample())

    def others_cores(self) -> float:
        """Cores other processes kept busy, on average, during the timed rollouts."""
        if len(self.cpu) < 2:
            return float("nan")
        (w0, b0, o0), (w1, b1, o1) = self.cpu[:2]
        return max(0.0, ((b1 - b0) - (o1 - o0)) / max(w1 - w0, 1e-9))


def _cell_result(framework, spec, marks, snaps, tokens, t_setup, n_params, threads) -> dict:
    w = spec["warmup"]
    times = [b - a for a, b in zip(marks[w:], marks[w + 1:])]
    phase = {}
    names = sorted({k for s in snaps for k in s})
    for k in names:
        phase[k] = (snaps[-1].get(k, 0.0) - snaps[w].get(k, 0.0)) / max(len(times), 1)
    phase["other"] = statistics.fmean(times) - sum(phase.values()) if times else float("nan")
    tok = tokens[w:w + len(times)]
    n_seq = spec["B"] * spec["G"]
    res = {
        "framework": framework, "rollout_s": times, "median_s": statistics.median(times) if times else float("nan"),
        "tokens": tok, "tokens_per_s": sum(tok) / sum(times) if times else float("nan"),
        "mean_completion_len": sum(tok) / (len(tok) * n_seq) if tok else float("nan"),
        "phases": phase, "setup_s": t_setup, "params": n_params, "threads": threads,
        "others_cores": marks.others_cores(),
    }
    if marks.prof is not None:
        res["profile"] = _profile_top(marks.prof)
    return res


def _profile_top(prof, n: int = 25) -> list[str]:
    import io
    import pstats

    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(os.environ.get("GSPO_PROFILE_SORT", "tottime")).print_stats(n)
    return [ln for ln in s.getvalue().splitlines() if ln.strip()][-n - 1:]


def worker_main(framework: str, spec: dict) -> None:
    if framework == "gspo":
        res = run_gspo(spec)
    elif framework == "gspo-async":
        res = run_gspo_async(spec)
    else:
        res = run_trl(spec)
    print(_MARK + json.dumps(res), flush=True)


if __name__ == "__main__":
    worker_main(sys.argv[1], json.loads(sys.argv[2]))
