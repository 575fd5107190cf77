"""The GSPO training loop: sample prompts -> generate groups -> score -> advantages -> minibatch
updates -> log -> checkpoint. `train(cfg)` reads top to bottom; each step is a named function.
"""

from __future__ import annotations

import math
import signal
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gspo import algo, faults
from gspo.config import Config
from gspo.setup import RunContext, build_context
from gspo.metrics import Console, JsonlWriter, truncate_metrics, write_completions
from gspo.rollout import Rollout


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps); the last good state was saved."""


@dataclass
class TrainerState:
    """Counters saved in every checkpoint (JSON)."""

    rollout: int = 0          # rollouts completed
    step: int = 0             # optimizer steps completed
    bad_steps: int = 0        # consecutive non-finite steps
    skipped_steps: int = 0    # non-finite steps skipped in total
    sampler: dict = field(default_factory=dict)
    finished: bool = False


# ---------------------------------------------------------------- named steps


def score(ctx: RunContext, batch: list[dict], rollout: Rollout):
    """Weighted reward per completion (NaN where missing) and each function's own values."""
    G = rollout.group_size
    columns = {k: [row[k] for row in batch for _ in range(G)] for k in batch[0] if k != "prompt"}
    prompts = [row["prompt"] for row in batch for _ in range(G)]
    if ctx.chat:  # TRL's conversational shape, so users' functions work unchanged
        completions = [[{"role": "assistant", "content": c}] for c in rollout.completions]
    else:
        completions = list(rollout.completions)
    return ctx.rewards.score(prompts, completions, columns)


@torch.no_grad()
def old_logprobs(ctx: RunContext, rollout: Rollout) -> torch.Tensor:
    """pi_old per token: the sampler's log-probs (paper §5.4) or one no-grad trainer pass."""
    if ctx.cfg.rollout.old_logp == "sampler":
        return rollout.sampler_logp
    out = []
    mbs = ctx.cfg.schedule.micro_batch_size or rollout.num_samples
    for idx in torch.arange(rollout.num_samples).split(mbs):
        part = rollout.select(idx)
        lp = ctx.logprobs(part)  # (b, T_part)
        out.append(torch.nn.functional.pad(lp, (0, rollout.completion_ids.shape[1] - lp.shape[1])))
    return torch.cat(out)  # (N, T)


def mismatch_metrics(sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Gap between the sampler's and the trainer's log-probs on the same tokens."""
    m = mask.bool()
    if not m.any():
        return {}
    d = (sampler_logp - trainer_logp)[m]
    n = mask.sum(-1).clamp(min=1)
    seq = ((sampler_logp - trainer_logp) * mask).sum(-1) / n
    return {"mismatch/token_abs_mean": d.abs().mean().item(), "mismatch/token_abs_max": d.abs().max().item(),
            "mismatch/seq_abs_mean": seq.abs().mean().item(),
            # k3 estimate of KL(sampler || trainer) on tokens drawn from the sampler
            "mismatch/kl": (torch.exp(-d) - 1 + d).mean().item()}


def update(ctx: RunContext, rollout: Rollout, old_logp: torch.Tensor, adv: torch.Tensor,
           state: TrainerState) -> list[dict]:
    """Split the rollout into `num_minibatches` optimizer steps (paper §5.1); returns per-step metrics."""
    cfg = ctx.cfg
    N = rollout.num_samples
    M = cfg.schedule.num_minibatches
    perm = torch.randperm(N)  # seeded by the global torch RNG, so resumes are exact
    out = []
    for mb_idx in perm.split(N // M):
        t0 = time.perf_counter()
        mb_tokens = rollout.completion_mask[mb_idx].sum().clamp(min=1)
        micro = cfg.schedule.micro_batch_size or len(mb_idx)
        sums: dict[str, float] = {}
        loss_total = 0.0
        for mi in mb_idx.split(micro):
            part = rollout.select(mi)
            T = part.completion_ids.shape[1]
            logp = ctx.logprobs(part)  # (b, T)
            loss, m = algo.policy_loss(
                logp, old_logp[mi, :T], adv[mi], part.completion_mask, level=cfg.algo.level,
                eps_low=cfg.algo.eps_low, eps_high=cfg.algo.eps_high, aggregation=cfg.algo.aggregation,
                max_log_ratio=cfg.algo.max_log_ratio,
                max_len=cfg.rollout.max_new_tokens if cfg.algo.aggregation == "seq-mean-token-sum-norm" else None)
            # the minibatch loss is the mean over its sequences (or its tokens, for token-mean)
            if cfg.algo.aggregation == "token-mean":
                w = (part.completion_mask.sum() / mb_tokens).item()
            else:
                w = len(mi) / len(mb_idx)
            if faults.nan_loss(state.step + 1):  # tests only
                loss = loss * float("nan")
            (loss * w).backward()
            loss_total += loss.item() * w
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v * w
        grad_norm = _grad_norm(ctx)
        metrics = dict(sums)
        metrics["loss"] = loss_total
        metrics["grad_norm"] = grad_norm
        metrics["lr"] = ctx.scheduler.get_last_lr()[0]
        if math.isfinite(loss_total) and math.isfinite(grad_norm):
            ctx.optimizer.step()
            state.bad_steps = 0
        else:
            state.bad_steps += 1
            state.skipped_steps += 1
            warnings.warn(f"step {state.step + 1}: non-finite loss ({loss_total}) or gradient norm ({grad_norm}); "
                          f"step skipped ({state.bad_steps} in a row)")
        ctx.optimizer.zero_grad(set_to_none=True)
        ctx.scheduler.step()
        state.step += 1
        metrics["train/skipped_steps"] = state.skipped_steps
        metrics["time/update"] = time.perf_counter() - t0
        out.append(metrics)
        if state.bad_steps >= cfg.checkpoint.max_bad_steps:
            break
    return out


def _grad_norm(ctx: RunContext) -> float:
    params = [p for p in ctx.model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    max_norm = ctx.cfg.optim.max_grad_norm or float("inf")
    return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def rollout_metrics(rollout: Rollout, rewards, adv_stats: dict) -> dict:
    r = rewards.rewards
    valid = r[~torch.isnan(r)]
    lengths = rollout.completion_lengths.float()
    m = {"reward/mean": valid.mean().item() if len(valid) else float("nan"),
         "reward/std": valid.std().item() if len(valid) > 1 else float("nan"),
         "completion/len_mean": lengths.mean().item(),
         "completion/len_max": lengths.max().item(),
         "completion/truncated_frac": sum(f == "length" for f in rollout.finish_reason) / rollout.num_samples,
         "completion/empty_frac": (lengths == 0).float().mean().item()}
    m.update(rewards.stats)
    m.update(adv_stats)
    return m


def completion_rows(step: int, rollout: Rollout, rewards, adv: torch.Tensor) -> list[dict]:
    rows = []
    for i in range(rollout.num_samples):
        rows.append({"step": step, "prompt": rollout.prompts[i], "completion": rollout.completions[i],
                     "reward": float(rewards.rewards[i]), "advantage": float(adv[i]),
                     "finish_reason": rollout.finish_reason[i],
                     "rewards": {k: float(v[i]) for k, v in rewards.per_function.items()}})
    return rows


# ---------------------------------------------------------------- the loop


class _StopRequest:
    """SIGTERM / SIGINT set a flag; the loop checkpoints after the current rollout and exits."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: Config, *, ctx: RunContext | None = None) -> Path:
    """Run GSPO as configured; returns the run directory (with `final/` in HF format)."""
    ctx = ctx or build_context(cfg)
    state = TrainerState()
    run_dir = cfg.run_dir
    if ctx.resume_from is not None:
        state = TrainerState(**ctx.restore(ctx.resume_from))
        if state.finished:
            print(f"run {run_dir} already finished at rollout {state.rollout}: nothing to do")
            ctx.close()
            return run_dir
        ctx.sampler.load_state_dict(state.sampler)
        truncate_metrics(run_dir / "metrics.jsonl", state.step)
        print(f"resumed from {ctx.resume_from} (rollout {state.rollout}, step {state.step})")
    writer = JsonlWriter(run_dir / "metrics.jsonl")
    total = cfg.schedule.rollouts
    console = Console(total, state.rollout, enabled=cfg.logging.console)
    eval_metrics = {}
    try:
        with _StopRequest() as stop:
            if state.rollout == 0 and cfg.eval.enabled:
                writer.write({"step": 0, "rollout": 0, **ctx.evaluate()})  # the starting point
            while state.rollout < total:
                t_step = time.perf_counter()
                batch = ctx.sampler.next_batch()                                    # 1. B prompts
                t0 = time.perf_counter()
                rollout = ctx.generator.generate([ctx.render(r["prompt"]) for r in batch],
                                                 cfg.rollout.group_size).to(ctx.device)  # 2. B*G completions
                t_gen = time.perf_counter() - t0
                t0 = time.perf_counter()
                rewards = score(ctx, batch, rollout)                                # 3. rewards
                t_score = time.perf_counter() - t0
                adv, adv_stats = algo.group_advantages(rewards.rewards, cfg.rollout.group_size,
                                                       scale=cfg.algo.adv_scale, eps=cfg.algo.adv_eps)  # 4.
                adv = adv.to(ctx.device)
                t0 = time.perf_counter()
                old_logp = old_logprobs(ctx, rollout)                               # 5. pi_old
                t_old = time.perf_counter() - t0
                common = rollout_metrics(rollout, rewards, adv_stats)
                if cfg.rollout.old_logp == "trainer":
                    common.update(mismatch_metrics(rollout.sampler_logp, old_logp, rollout.completion_mask))
                steps = update(ctx, rollout, old_logp, adv, state)                  # 6. minibatch updates
                ctx.generator.sync_weights(ctx.model)                               # 7. sync
                state.rollout += 1
                state.sampler = ctx.sampler.state_dict()
                if cfg.eval.enabled and cfg.eval.every and state.rollout % cfg.eval.every == 0 \
                        and state.rollout < total:
                    eval_metrics = ctx.evaluate()
                elif state.rollout == total and cfg.eval.enabled:
                    eval_metrics = ctx.evaluate()
                dt = time.perf_counter() - t_step
                n_tokens = int(rollout.completion_mask.sum())
                common.update({"rollout": state.rollout, "time/generate": t_gen, "time/score": t_score,
                               "time/old_logp": t_old, "time/step": dt, "tokens_per_s": n_tokens / dt})
                first = state.step - len(steps) + 1
                for i, m in enumerate(steps):                                       # 8. log
                    rec = {"step": first + i, **common, **m}
                    if i == len(steps) - 1:
                        rec.update(eval_metrics)
                    writer.write(rec)
                console.update(state.rollout, {**common, **steps[-1], **eval_metrics})
                eval_metrics = {}
                _log_completions(ctx, console, state, rollout, rewards, adv)
                if state.bad_steps >= cfg.checkpoint.max_bad_steps:
                    ctx.save(state)
                    raise TrainingError(
                        f"{state.bad_steps} optimizer steps in a row had a non-finite loss or gradient norm; "
                        f"stopped and saved the last good state in {run_dir / 'checkpoints'}")
                if stop.signum is not None:
                    ctx.save(state)
                    console.print(f"stopped by signal {stop.signum} after rollout {state.rollout}; "
                                  f"resume with resume=auto")
                    return run_dir
                if cfg.checkpoint.every and state.rollout % cfg.checkpoint.every == 0 and state.rollout < total:
                    ctx.save(state)
                faults.after_rollout(state.rollout)  # tests only
            state.finished = True
            ctx.save(state)
            ctx.save_final()
    finally:
        console.close()
        writer.close()
        ctx.close()
    return run_dir


def _log_completions(ctx: RunContext, console: Console, state: TrainerState, rollout: Rollout, rewards, adv):
    lc = ctx.cfg.logging
    want_file = lc.completions_every and (state.rollout % lc.completions_every == 0 or state.rollout == 1)
    want_table = lc.table_every and state.rollout % lc.table_every == 0
    if not (want_file or want_table):
        return
    rows = completion_rows(state.step, rollout, rewards, adv)
    if want_file:
        write_completions(ctx.cfg.run_dir, state.step, rows)
    if want_table:
        G = rollout.group_size
        console.table(f"rollout {state.rollout}", rows[:: max(G // 2, 1)][: lc.table_rows])
