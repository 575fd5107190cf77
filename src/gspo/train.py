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
from gspo.rewards import reward_columns
from gspo.metrics import Console, JsonlWriter, Sinks, truncate_metrics, write_completions
from gspo.rollout import Rollout, chunk_seed
from gspo.trackers import open_trackers


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
    columns = reward_columns(batch, G)
    prompts = [row["prompt"] for row in batch for _ in range(G)]
    if ctx.chat:  # TRL's conversational shape, so users' functions work unchanged
        completions = [[{"role": "assistant", "content": c}] for c in rollout.completions]
    else:
        completions = list(rollout.completions)
    return ctx.rewards.score(prompts, completions, columns)


def trainer_logprobs(ctx: RunContext, rollout: Rollout, idx: torch.Tensor, mode: str):
    """The rows `idx` of the rollout (trimmed) and their trainer log-probs (b, T_part). On a MoE
    model the routers' choices are recorded (`mode="capture"`, the π_old pass) or compared with
    the recorded ones, and replayed when `algo.routing_replay` (`mode="compare"`)."""
    part = rollout.select(idx)
    if ctx.routes is None:
        return part, ctx.logprobs(part)
    off = rollout.prompt_ids.shape[1] - part.prompt_ids.shape[1]  # columns trimmed on the left
    with ctx.routes.forward(mode, idx, off, part.attention_mask.to(ctx.device),
                            replay=mode == "compare" and ctx.cfg.algo.routing_replay):
        return part, ctx.logprobs(part)


@torch.no_grad()
def old_logprobs(ctx: RunContext, rollout: Rollout, skip: torch.Tensor | None = None,
                 need: torch.Tensor | None = None) -> torch.Tensor:
    """pi_old per token (N, T): the sampler's log-probs (paper §5.4) or one no-grad trainer pass.

    The rows `skip` (the first minibatch) are left at 0 for `update` to fill: it runs them
    through the trainer before any weights change, so its own forward is pi_old for them and
    a pass here would compute the same numbers again (with num_minibatches=1, the whole pass).
    Rows outside `need` ((N,) bool, `signal_rows`) are left at 0 too: the update never uses them."""
    if ctx.routes is not None:
        ctx.routes.reset(rollout.num_samples, rollout.input_ids.shape[1], ctx.device)
    if ctx.old_logp == "sampler":
        return rollout.sampler_logp
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=ctx.device)
    rows = torch.arange(rollout.num_samples)
    if skip is not None or need is not None:
        keep = torch.ones(rollout.num_samples, dtype=torch.bool) if need is None else need.clone()
        if skip is not None:
            keep[skip] = False
        rows = rows[keep]
    # forwards of minibatch size (one forward over every row runs slower per row once the
    # activations leave the cache), rows sorted by length so each forward trims more padding
    sched = ctx.cfg.schedule
    mbs = sched.micro_batch_size or max(rollout.num_samples // sched.num_minibatches, 1)
    rows = rows[rollout.completion_lengths.cpu()[rows].argsort(stable=True)]
    parts = list(rows.split(mbs)) if len(rows) else []  # (split of an empty tensor yields one empty part)
    if ctx.dist.enabled:  # every forward is a collective (FSDP2 gathers, DDP broadcasts buffers): a
        # process with fewer rows left to run (more of them skipped) pads with one-row forwards
        calls = int(ctx.dist.all_reduce([float(len(parts))], "max")[0])
        parts += [None] * (calls - len(parts))
    for idx in parts:
        if idx is None:  # placeholder: row 0 at the current weights (its π_old), result unused
            trainer_logprobs(ctx, rollout, torch.zeros(1, dtype=torch.long), "capture")
            continue
        _, lp = trainer_logprobs(ctx, rollout, idx, "capture")  # (b, T_part)
        out[idx.to(out.device), : lp.shape[1]] = lp.float()
    return out


def mismatch_metrics(sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """Gap between the sampler's and the trainer's log-probs on the same tokens."""
    m = mask.bool()
    if not m.any():  # the same keys on every rank: NaN is left out of the reduction
        return dict.fromkeys(("mismatch/token_abs_mean", "mismatch/token_abs_max", "mismatch/seq_abs_mean",
                              "mismatch/kl"), math.nan)
    d = (sampler_logp - trainer_logp)[m]
    n = mask.sum(-1).clamp(min=1)
    seq = ((sampler_logp - trainer_logp) * mask).sum(-1) / n
    return {"mismatch/token_abs_mean": d.abs().mean().item(), "mismatch/token_abs_max": d.abs().max().item(),
            "mismatch/seq_abs_mean": seq.abs().mean().item(),
            # k3 estimate of KL(sampler || trainer) on tokens drawn from the sampler
            "mismatch/kl": (torch.exp(-d) - 1 + d).mean().item()}


def minibatches(ctx: RunContext, rollout_index: int, n_local: int) -> list[torch.Tensor]:
    """Local row indices of each of the `num_minibatches` optimizer steps (paper §5.1).

    Every sampling chunk (rollout.batch_size rows, or the process's share) is shuffled with a
    seed made from the run seed, the rollout and the chunk's global position, and deals an equal
    part to every minibatch. With ``schedule.minibatch_by=group`` the shuffle keeps each group's
    rows together (groups in random order, rows in random order within each), so a minibatch
    holds whole groups, or consecutive parts of them, and the trainer runs each prompt once.
    The global minibatch is the union over processes, and is the same for any number of
    processes when rollout.batch_size is set."""
    cfg, d = ctx.cfg, ctx.dist
    M = cfg.schedule.num_minibatches
    chunk = cfg.rollout.batch_size or n_local
    by_group = cfg.schedule.minibatch_by == "group"
    parts: list[list[torch.Tensor]] = [[] for _ in range(M)]
    for start in range(0, n_local, chunk):
        first_row = d.rank * n_local + start  # the chunk's global position
        g = torch.Generator().manual_seed(chunk_seed(cfg.seed, rollout_index, first_row, 1))
        perm = torch.randperm(chunk, generator=g)
        if by_group:  # rows are laid out group by group: global row i is in group i // G
            G = cfg.rollout.group_size
            group = (torch.arange(chunk) + first_row) // G - first_row // G  # (chunk,) 0..k-1
            group_order = torch.randperm(int(group[-1]) + 1, generator=g)
            perm = perm[group_order[group[perm]].argsort(stable=True)]  # rows keep their shuffled order
        for k, piece in enumerate((perm + start).split(chunk // M)):
            parts[k].append(piece)
    return [torch.cat(p) for p in parts]


def _mismatch_parts(gaps: list) -> dict:
    """mismatch_metrics over micro-batches of different widths (padded to the widest)."""
    if not gaps:  # no row ran
        return mismatch_metrics(*[torch.zeros(0, 0)] * 3)
    t = max(g[0].shape[1] for g in gaps)
    pad = lambda x: torch.nn.functional.pad(x, (0, t - x.shape[1]))  # noqa: E731
    return mismatch_metrics(*(torch.cat([pad(g[j]) for g in gaps]) for j in range(3)))


def update(ctx: RunContext, rollout: Rollout, old_logp: torch.Tensor, adv: torch.Tensor,
           state: TrainerState, plan: list[torch.Tensor] | None = None, fill_first: bool = False) -> list[dict]:
    """`num_minibatches` optimizer steps on the rollout; returns per-step metrics (all ranks).

    `plan` is `minibatches(...)` (computed when None). With `fill_first`, the first minibatch's
    rows of `old_logp` were skipped by `old_logprobs`: its forward, taken before the first
    optimizer step, is pi_old for them; it is written into `old_logp` (which then holds pi_old
    for every row) and the routes are captured from it."""
    cfg, d = ctx.cfg, ctx.dist
    token_mean = cfg.algo.aggregation == "token-mean"
    sampler_pi_old = ctx.old_logp == "sampler"
    signal = signal_rows(ctx, adv)  # (N,) bool on the CPU, or None: every row runs
    out = []
    for step_in_rollout, mb_idx in enumerate(plan or minibatches(ctx, state.rollout, rollout.num_samples)):
        fill = fill_first and step_in_rollout == 0
        t0 = time.perf_counter()
        # The wrappers average gradients over ranks, so each rank's loss is its share of the
        # global minibatch loss times world_size: sequence means need equal row counts (they
        # are), token means the global token count.
        if token_mean:
            mb_tokens = d.all_reduce([rollout.completion_mask[mb_idx].sum().item()])[0]
        pieces = _micro_batches(ctx, mb_idx, signal)
        sums: dict[str, float] = {}
        tokens = rows = 0
        loss_total = 0.0
        gaps = []
        for mi, placeholder in pieces:
            part, logp = trainer_logprobs(ctx, rollout, mi, "capture" if fill else "compare")  # (b, T)
            T = part.completion_ids.shape[1]
            if fill:
                old_logp[mi, :T] = logp.detach().float()
            if sampler_pi_old and step_in_rollout == 0:  # π_θ = π_old here: the sampler-trainer gap
                gaps.append((part.sampler_logp, logp.detach(), part.completion_mask * (not placeholder)))
            loss, m = algo.policy_loss(
                logp, old_logp[mi, :T], adv[mi], part.completion_mask, level=cfg.algo.level,
                eps_low=cfg.algo.eps_low, eps_high=cfg.algo.eps_high, aggregation=cfg.algo.aggregation,
                max_log_ratio=cfg.algo.max_log_ratio,
                max_len=cfg.rollout.max_new_tokens if cfg.algo.aggregation == "seq-mean-token-sum-norm" else None)
            # the minibatch loss is the mean over its sequences (or its tokens, for token-mean)
            share = 0.0 if placeholder else len(mi) / len(mb_idx)
            n_tok = 0 if placeholder else round(m["completion/len_mean"] * len(mi))  # (no extra device sync)
            tokens += n_tok
            rows += 0 if placeholder else len(mi)
            w = n_tok / max(mb_tokens, 1) * d.world_size if token_mean else share
            if faults.nan_loss(state.step + 1):  # tests only
                loss = loss * float("nan")
            (loss * w).backward()
            loss_total += loss.item() * w
            _add_metrics(sums, m, n_tok, 0 if placeholder else len(mi))
        if not pieces:  # the whole minibatch had advantage 0: its gradient is exactly zero
            for p in ctx.trainer.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)  # (None would make AdamW skip the step)
        grad_norm = _grad_norm(ctx)
        if sampler_pi_old and step_in_rollout == 0:
            sums.update(_mismatch_parts(gaps))
        if ctx.routes is not None:
            sums.update(ctx.routes.take_metrics(per_layer=cfg.logging.routing_per_layer, captured=fill))
        metrics = _reduce_metrics(d, sums, loss_total, tokens, rows)
        if signal is not None:
            metrics["rows/skipped_frac"] = 1.0 - metrics["rows/minibatch"] / (len(mb_idx) * d.world_size)
        metrics.update(grad_norm=grad_norm, lr=ctx.scheduler.get_last_lr()[0])
        _optimizer_step(ctx, state, metrics["loss"], grad_norm)
        metrics["train/skipped_steps"] = state.skipped_steps
        metrics["time/update"] = time.perf_counter() - t0
        out.append(metrics)
        if state.bad_steps >= cfg.checkpoint.max_bad_steps:
            break
    if sampler_pi_old:  # the gap measured on the first (on-policy) minibatch describes the rollout
        gap = {k: v for k, v in out[0].items() if k.startswith("mismatch/")}
        for m in out[1:]:
            m.update(gap)
    return out


def _micro_batches(ctx: RunContext, mb_idx: torch.Tensor, signal: torch.Tensor | None) -> list[tuple]:
    """The minibatch's micro-batches as (row indices, placeholder). Without `signal` every row
    runs. With it, rows with advantage 0 are left out (they add 0 to the loss and its gradient);
    a micro-batch left with no row on any rank is dropped by every rank, and a rank left with
    none while another rank has some runs one row at weight 0 (the placeholder), so that every
    rank makes the same collective calls."""
    micro = ctx.cfg.schedule.micro_batch_size or len(mb_idx)
    pieces = list(mb_idx.split(micro))
    if signal is None:
        return [(mi, False) for mi in pieces]
    live = [mi[signal[mi]] for mi in pieces]
    anywhere = ctx.dist.all_reduce([float(len(x)) for x in live])
    return [(x, False) if len(x) else (mi[:1], True) for x, mi, n in zip(live, pieces, anywhere) if n > 0]


def _add_metrics(sums: dict, m: dict, n_tok: int, n_rows: int) -> None:
    """Add one micro-batch's `policy_loss` metrics into `sums`: per-token fractions times its
    tokens, per-sequence means times its rows, min / max combined. A placeholder (n_rows 0)
    only makes the keys exist, as NaN, which the reduction over ranks leaves out."""
    for k, v in m.items():
        if k == "loss":  # (the weighted loss is summed by the caller)
            continue
        have = sums.get(k, math.nan) == sums.get(k, math.nan)  # (NaN: nothing counted yet)
        if not n_rows:
            sums.setdefault(k, math.nan)
        elif k.endswith("_min") or k.endswith("_max"):
            sums[k] = (min if k.endswith("_min") else max)(sums[k], v) if have else v
        else:
            x = v * (n_tok if k in algo.TOKEN_METRICS else n_rows)
            sums[k] = sums[k] + x if have else x


def _reduce_metrics(d, sums: dict, loss: float, tokens: int, rows: int) -> dict:
    """The minibatch's metrics over all ranks (one decision on every rank): sums divided by the
    global token / row counts; NaN (null in metrics.jsonl) where no row ran."""
    per_row = [k for k in sums if k in algo.TOKEN_METRICS or k in algo.SEQUENCE_METRICS]
    metrics = d.reduce_metrics({**sums, "loss": loss, "tokens/minibatch": tokens, "rows/minibatch": rows},
                               sums=(*per_row, "tokens/minibatch", "rows/minibatch"))
    for k in algo.ROW_METRICS:
        n = metrics["tokens/minibatch" if k in algo.TOKEN_METRICS else "rows/minibatch"]
        if k in per_row:
            metrics[k] = metrics[k] / n if n > 0 else math.nan
        elif not math.isfinite(metrics.get(k, math.nan)):  # (a min / max over no value)
            metrics[k] = math.nan
    return metrics


def _optimizer_step(ctx: RunContext, state: TrainerState, loss: float, grad_norm: float) -> None:
    """Step (or, with a non-finite loss or gradient, skip and count), clear the gradients, and
    advance the schedule."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        ctx.optimizer.step()
        state.bad_steps = 0
    else:
        state.bad_steps += 1
        state.skipped_steps += 1
        if ctx.dist.is_main:
            warnings.warn(f"step {state.step + 1}: non-finite loss ({loss}) or gradient norm "
                          f"({grad_norm}); step skipped ({state.bad_steps} in a row)")
    ctx.optimizer.zero_grad(set_to_none=True)
    ctx.scheduler.step()
    state.step += 1


def signal_rows(ctx: RunContext, adv: torch.Tensor) -> torch.Tensor | None:
    """Rows whose advantage is not 0 ((N,) bool, on the CPU), when `schedule.skip_zero_advantage`
    leaves the others out of the trainer's passes; None when every row runs. A row with A_i = 0
    adds exactly 0 to the loss and to its gradient at every level and aggregation (the loss has
    no other term); it still counts in the minibatch's size and token count, so the other rows'
    weights do not change. Not with Routing Replay, which needs π_old's routes of any row a
    process runs (under torchrun a process with no such row runs one at weight 0)."""
    if not ctx.cfg.schedule.skip_zero_advantage or (ctx.routes is not None and ctx.cfg.algo.routing_replay):
        return None
    return (adv != 0).cpu()


def _grad_norm(ctx: RunContext) -> float:
    """Global gradient norm (clipped to optim.max_grad_norm); sharded grads are reduced."""
    params = [p for p in ctx.trainer.parameters() if p.grad is not None]
    if not params:
        return 0.0
    max_norm = ctx.cfg.optim.max_grad_norm or float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def rollout_metrics(ctx: RunContext, rollout: Rollout, rewards, adv_stats: dict) -> dict:
    """Rollout-level metrics over the global batch (every rank's rows)."""
    d = ctx.dist
    r = d.all_gather(rewards.rewards.float().cpu())
    valid = r[~torch.isnan(r)]
    lengths = d.all_gather(rollout.completion_lengths.float().cpu())
    truncated = torch.tensor([f == "length" for f in rollout.finish_reason], dtype=torch.float32)
    local = dict(rewards.stats)
    local.update(adv_stats)
    local["completion/truncated_frac"] = truncated.mean().item()
    m = d.reduce_metrics(local, sums=("reward/errors", "reward/timeouts", "reward/missing"))
    m.update({"reward/mean": valid.mean().item() if len(valid) else float("nan"),
              "reward/std": valid.std(unbiased=False).item() if len(valid) > 1 else float("nan"),
              "completion/len_mean": lengths.mean().item(),
              "completion/len_max": lengths.max().item(),
              "completion/empty_frac": (lengths == 0).float().mean().item()})
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
    d = ctx.dist
    state = TrainerState()
    run_dir = cfg.run_dir
    if ctx.resume_from is not None:
        state = TrainerState(**ctx.restore(ctx.resume_from))
        if state.finished:
            if d.is_main:
                print(f"run {run_dir} already finished at rollout {state.rollout}: nothing to do")
            ctx.close()
            return run_dir
        ctx.sampler.load_state_dict(state.sampler)
        if d.is_main:
            truncate_metrics(run_dir / "metrics.jsonl", state.step)
            print(f"resumed from {ctx.resume_from} (rollout {state.rollout}, step {state.step})")
    writer = Sinks(JsonlWriter(run_dir / "metrics.jsonl"), open_trackers(cfg, state.step)) \
        if d.is_main else None  # rank 0 logs: metrics.jsonl and logging.report_to's trackers
    total = cfg.schedule.rollouts
    console = Console(total, state.rollout, enabled=cfg.logging.console and d.is_main)
    eval_metrics = {}
    try:
        with _StopRequest() as stop:
            if state.rollout == 0 and cfg.eval.enabled and writer:
                writer.write({"step": 0, "rollout": 0, **ctx.evaluate()})  # the starting point
            while state.rollout < total:
                t_step = time.perf_counter()
                batch = ctx.sampler.next_batch()                                    # 1. B prompts
                t0 = time.perf_counter()
                n_local = len(batch) * cfg.rollout.group_size
                rollout = ctx.generator.generate(                                   # 2. B*G completions
                    [ctx.render(r["prompt"]) for r in batch], cfg.rollout.group_size,
                    seed=chunk_seed(cfg.seed, state.rollout), offset=d.rank * n_local).to(ctx.device)
                t_gen = time.perf_counter() - t0
                t0 = time.perf_counter()
                rewards = score(ctx, batch, rollout)                                # 3. rewards
                t_score = time.perf_counter() - t0
                adv, adv_stats = algo.group_advantages(rewards.rewards, cfg.rollout.group_size,
                                                       scale=cfg.algo.adv_scale, eps=cfg.algo.adv_eps)  # 4.
                adv = adv.to(ctx.device)
                t0 = time.perf_counter()
                plan = minibatches(ctx, state.rollout, rollout.num_samples)
                signal = signal_rows(ctx, adv)  # None, or the rows with a nonzero advantage
                old_logp = old_logprobs(ctx, rollout, skip=plan[0], need=signal)   # 5. pi_old
                t_old = time.perf_counter() - t0
                common = rollout_metrics(ctx, rollout, rewards, adv_stats)
                steps = update(ctx, rollout, old_logp, adv, state, plan,            # 6. minibatch updates
                               fill_first=ctx.old_logp == "trainer")
                if ctx.old_logp == "trainer":  # old_logp now holds pi_old for every row that ran
                    ran = rollout.completion_mask if signal is None else \
                        rollout.completion_mask * signal.to(rollout.completion_mask.device)[:, None]
                    common.update(d.reduce_metrics(mismatch_metrics(rollout.sampler_logp, old_logp, ran)))
                ctx.sync_sampler()                                                  # 7. sync
                state.rollout += 1
                state.sampler = ctx.sampler.state_dict()
                if cfg.eval.enabled and cfg.eval.every and state.rollout % cfg.eval.every == 0 \
                        and state.rollout < total:
                    eval_metrics = ctx.evaluate()
                elif state.rollout == total and cfg.eval.enabled:
                    eval_metrics = ctx.evaluate()
                dt = time.perf_counter() - t_step
                n_tokens, n_all = (int(x) for x in d.all_reduce(
                    [float(rollout.completion_mask.sum()), float(rollout.attention_mask.sum())]))
                common.update({"tokens/completion": n_tokens, "tokens/total": n_all, "rollout": state.rollout, "time/generate": t_gen, "time/score": t_score,
                               "time/old_logp": t_old, "time/step": dt, "tokens_per_s": n_tokens / dt})
                first = state.step - len(steps) + 1
                for i, m in enumerate(steps):                                       # 8. log
                    rec = {"step": first + i, **common, **m}
                    if i == len(steps) - 1:
                        rec.update(eval_metrics)
                    if writer:
                        writer.write(rec)
                console.update(state.rollout, {**common, **steps[-1], **eval_metrics})
                eval_metrics = {}
                if d.is_main:
                    _log_completions(ctx, console, writer, state, rollout, rewards, adv)
                stop_now = d.all_reduce([float(stop.signum or 0)], "max")[0]  # a signal on any rank stops all
                if state.bad_steps >= cfg.checkpoint.max_bad_steps:
                    ctx.save(state)
                    raise TrainingError(
                        f"{state.bad_steps} optimizer steps in a row had a non-finite loss or gradient norm; "
                        f"stopped and saved the last good state in {run_dir / 'checkpoints'}")
                if stop_now:
                    ctx.save(state)
                    console.print(f"stopped by signal {int(stop_now)} after rollout {state.rollout}; "
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
        if writer:
            writer.close()
        ctx.close()
    return run_dir


def _log_completions(ctx: RunContext, console: Console, writer: Sinks, state: TrainerState, rollout: Rollout,
                     rewards, adv):
    lc = ctx.cfg.logging
    want_file = lc.completions_every and (state.rollout % lc.completions_every == 0 or state.rollout == 1)
    want_table = lc.table_every and state.rollout % lc.table_every == 0
    if not (want_file or want_table):
        return
    rows = completion_rows(state.step, rollout, rewards, adv)
    if want_file:
        write_completions(ctx.cfg.run_dir, state.step, rows)
        writer.table(state.step, rows)  # the trackers mirror completions/
    if want_table:
        G = rollout.group_size
        console.table(f"rollout {state.rollout}", rows[:: max(G // 2, 1)][: lc.table_rows])
