"""The GSPO training loop. One step is two functions:

    produce(run, state) -> ScoredRollout     prompts -> B·G episodes -> rewards -> group advantages
                                             (`gspo.train.produce`)
    learn(run, scored, state) -> metrics     the plan -> π_old -> minibatch updates -> weight push

`train(cfg)` builds the run (`gspo.train.run.build_run`), resumes it, and calls the two in turn,
then logs and checkpoints. Everything a process must agree on with the others before its
forwards is in the rollout's plan (`gspo.train.plan`).
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gspo import algo
from gspo.train import async_job, checkpoint, run_state
from gspo.train.stops import Interrupted, StopRequest, kept_note, peer_lost  # noqa: F401  (Interrupted: the CLI's)
from gspo.train.async_wire import load_inflight
from gspo.train import faults
from gspo.config import Config, checked_config, objective_args, to_yaml
from gspo.models.logprobs import can_share_prompt, share_min_saved
from gspo.train.evaluate import evaluate_run
from gspo.report.sinks import Console, JsonlWriter, Sinks, truncate_metrics
from gspo.train.plan import Minibatch, Plan, any_process, build_plan
from gspo.rollout import Rollout, chunk_seed
from gspo.train.produce import (ScoredRollout, TrainingError, produce,  # noqa: F401
                                evaluate_or_save, produce_or_save, sample_and_score, score)  # (some re-exported)
from gspo.train.resume import check_base_weights
from gspo.train.run import Run, build_run, push_weights
from gspo.train.step_metrics import (add_micro_metrics, log_step, mismatch_metrics, mismatch_over_parts,
                                     reduce_minibatch_metrics)
from gspo.report.trackers import open_trackers


@dataclass
class TrainerState:
    """Counters saved in every checkpoint (JSON)."""

    rollout: int = 0          # rollouts completed
    step: int = 0             # optimizer steps completed
    bad_steps: int = 0        # consecutive non-finite steps
    skipped_steps: int = 0    # non-finite steps skipped in total
    prompts: dict = field(default_factory=dict)  # the prompt stream's position
    finished: bool = False
    base_weights: str = ""    # the starting weights the checkpoints do not hold (`resume.base_weights_fingerprint`)


# ---------------------------------------------------------------- learn


def learn(run: Run, scored: ScoredRollout, state: TrainerState) -> tuple[list[dict], dict]:
    """π_old, then `num_minibatches` optimizer steps, then the new weights to the generator.
    Returns each step's metrics and the rollout's own (the π_old pass's time, and with the
    trainer's pass the sampler/trainer gap over every row that ran)."""
    rollout, adv = scored.rollout, scored.advantages
    t0 = time.perf_counter()
    plan = make_plan(run, rollout, adv, state)
    old_logp = old_logprobs(run, rollout, plan)                                 # π_old (N, T)
    info = {"time/old_logp": time.perf_counter() - t0}
    steps = []
    for k, mb in enumerate(plan.minibatches):                                   # optimizer steps
        steps.append(minibatch_step(run, rollout, old_logp, adv, mb, state, first=k == 0, skips=plan.skips))
        if state.bad_steps >= run.cfg.checkpoint.max_bad_steps:
            break
    if run.old_logp == "trainer":  # old_logp now holds π_old for every row that ran
        ran = rollout.model_mask if plan.live is None else \
            rollout.model_mask * plan.live.to(rollout.model_mask.device)[:, None]
        info.update(run.dist.reduce_metrics(mismatch_metrics(rollout.sampler_logp, old_logp, ran)))
    else:  # the gap measured on the first (on-policy) minibatch describes the rollout
        gap = {k: v for k, v in steps[0].items() if k.startswith("mismatch/")}
        for m in steps[1:]:
            m.update(gap)
    push_weights(run)                                                           # weight sync
    return steps, info


def minibatches(run: Run, rollout_index: int, n_local: int) -> list[torch.Tensor]:
    """Local row indices of each of the `num_minibatches` optimizer steps (paper §5.1).

    Every sampling chunk (rollout.batch_size rows, or the process's share) is shuffled with a
    seed made from the run seed, the rollout and the chunk's global position, and deals an equal
    part to every minibatch. With ``schedule.minibatch_by=group`` the shuffle keeps each group's
    rows together (groups in random order, rows in random order within each), so a minibatch
    holds whole groups, or consecutive parts of them, and the trainer runs each prompt once.
    The global minibatch is the union over processes, and is the same for any number of
    processes when rollout.batch_size is set."""
    cfg, d = run.cfg, run.dist
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


def live_rows(run: Run, adv: torch.Tensor) -> torch.Tensor | None:
    """Rows whose advantage is not 0 ((N,) bool, on the CPU), when `schedule.skip_zero_advantage`
    leaves the others out of the trainer's passes; None when every row runs. A row with A_i = 0
    adds exactly 0 to the loss and to its gradient at every level and aggregation (the loss has
    no other term); it still counts in the minibatch's size and token count, so the other rows'
    weights do not change. Not with Routing Replay, which needs π_old's routes of any row a
    process runs (under torchrun a process with no such row runs one at weight 0), nor with
    logging.kl_reference, whose kl/ref is over every row of every step."""
    a = run.cfg.algo
    if not run.cfg.schedule.skip_zero_advantage or (run.routes is not None and a.routing_replay):
        return None
    if a.kl_coef > 0 or a.entropy_coef > 0 or a.router_aux_loss_coef > 0:  # terms that give every row a gradient
        return None
    if run.cfg.logging.kl_reference:  # kl/ref is logged every step, over every row
        return None
    return (adv != 0).cpu()


def loss_lengths(run: Run, rollout: Rollout) -> torch.Tensor | None:
    """(N,) the tokens of each row that enter the loss, where they are not the completion's
    length: only the model's own tokens of an episode, none of a completion cut by the length
    limit under `algo.mask_truncated`. None: the completion lengths."""
    if rollout.loss_mask is None and not run.cfg.algo.mask_truncated:
        return None
    lengths = rollout.model_lengths
    return lengths * ~rollout.truncated.to(lengths.device) if run.cfg.algo.mask_truncated else lengths


def make_plan(run: Run, rollout: Rollout, adv: torch.Tensor, state: TrainerState) -> Plan:
    """The rollout's plan (`gspo.train.plan.build_plan`) with this run's settings. The π_old pass runs
    in forwards of minibatch size (one forward over every row runs slower per row once the
    activations leave the cache)."""
    s, n, d = run.cfg.schedule, rollout.num_samples, run.dist

    def can_share(rows: torch.Tensor) -> bool:  # would the forward over these rows run each prompt once?
        part = rollout.select(rows)
        return run.cfg.model.share_prompt and can_share_prompt(run.policy, part.input_ids, part.attention_mask,
                                                               part.completion_ids.shape[1],
                                                               run.cfg.model.share_prompt_min_work)

    return build_plan(minibatches(run, state.rollout, n), rollout.completion_lengths, live=live_rows(run, adv),
                      loss_lengths=loss_lengths(run, rollout),
                      micro_size=s.micro_batch_size, token_mean=run.cfg.algo.aggregation == "token-mean",
                      old_pass=run.old_logp == "trainer", old_forward_size=s.micro_batch_size or max(n // s.num_minibatches, 1),
                      gather=d.all_gather,  # under FSDP2 every decoder call gathers shards: agree on sharing
                      can_share=can_share if d.enabled and d.strategy == "fsdp" else None,
                      buckets=length_cut_costs(run, rollout))


def length_cut_costs(run: Run, rollout: Rollout) -> dict | None:
    """What cutting a minibatch's forward by length costs (the arguments of `gspo.train.plan.LengthCuts`),
    or None with schedule.length_buckets=1. One more decoder call is worth the tokens whose matrix
    products cost what its fixed overhead does: the same measure as prompt sharing's threshold
    (`share_min_saved`, from model.share_prompt_min_work). A group's rows are kept together where
    its prompt, run once, saves more than that."""
    s, m = run.cfg.schedule, run.cfg.model
    if s.length_buckets <= 1:
        return None
    call = share_min_saved(run.policy, m.share_prompt_min_work)
    prompt = int(rollout.prompt_mask.sum(1).max()) if rollout.num_samples else 0
    shares = m.share_prompt and (rollout.group_size - 1) * prompt >= max(call, 1)
    return dict(call_cost=float(call), max_buckets=s.length_buckets, prompt_len=prompt,
                group_of=rollout.group_ids.cpu() if shares else None)


def trainer_logprobs(run: Run, rollout: Rollout, idx: torch.Tensor, mode: str, share: bool | None,
                     entropy: bool = False):
    """The rows `idx` of the rollout (trimmed) and their trainer log-probs (b, T_part), each
    distinct prompt run once when the plan says `share` (None: the forward decides); with
    `entropy`, (log-probs, entropies). On a MoE model the routers' choices are recorded
    (`mode="capture"`, the π_old pass) or compared with the recorded ones, and replayed when
    `algo.routing_replay` (`mode="compare"`); `mode=None`: neither (a placeholder, whose routes
    would count in the metrics)."""
    part = rollout.select(idx)
    ids, mask, T = part.input_ids.to(run.device), part.attention_mask.to(run.device), part.completion_ids.shape[1]
    if run.routes is None or mode is None:
        return part, run.trainer(ids, mask, T, share, entropy)
    off = rollout.prompt_ids.shape[1] - part.prompt_ids.shape[1]  # columns trimmed on the left
    with run.routes.forward(mode, idx, off, mask, replay=mode == "compare" and run.cfg.algo.routing_replay):
        return part, run.trainer(ids, mask, T, share, entropy)


@torch.no_grad()
def reference_logprobs(run: Run, part: Rollout, share: bool | None) -> torch.Tensor:
    """π_ref's log-probs (b, T_part) of a micro-batch's rows: the frozen starting weights, or
    with LoRA the base model with its adapters disabled (`gspo.train.run.AdaptersOff`).
    Outside any route recording: a MoE's tracked routes stay the trainer's."""
    ids, mask = part.input_ids.to(run.device), part.attention_mask.to(run.device)
    return run.reference(ids, mask, part.completion_ids.shape[1], share)


@torch.no_grad()
def old_logprobs(run: Run, rollout: Rollout, plan: Plan) -> torch.Tensor:
    """π_old per token (N, T): the sampler's log-probs (paper §5.4) or one no-grad trainer pass
    over `plan.old_forwards`. The first minibatch's rows are not in it: `minibatch_step` runs
    them before any weight changes, so their own forward is π_old and fills them in (with
    num_minibatches=1 there is no separate pass at all). Rows that never run stay at 0."""
    if run.routes is not None:
        if run.old_logp == "sampler":  # async mode: the generator recorded them in its own forward (R3)
            run.routes.use_sampler_routes(rollout.routes)
        else:
            run.routes.reset(rollout.num_samples, rollout.input_ids.shape[1], run.device)
    if run.old_logp == "sampler":
        return rollout.sampler_logp
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=run.device)
    for idx, share in zip(plan.old_forwards, plan.old_share):
        if idx is None:  # placeholder: row 0 at the current weights (its π_old), result unused
            trainer_logprobs(run, rollout, torch.zeros(1, dtype=torch.long), "capture", share)
            continue
        _, lp = trainer_logprobs(run, rollout, idx, "capture", share)  # (b, T_part)
        out[idx.to(out.device), : lp.shape[1]] = lp.float()
    return out


def minibatch_step(run: Run, rollout: Rollout, old_logp: torch.Tensor, adv: torch.Tensor, mb: Minibatch,
                   state: TrainerState, *, first: bool, skips: bool) -> dict:
    """One optimizer step: for each micro-batch, loss = policy_loss(...); backward; then the
    step. On the first minibatch (`first`), the forward before any update is π_θ = π_old: with
    the trainer's π_old it fills `old_logp` for these rows (and captures their routes); with the
    sampler's it measures the sampler/trainer gap."""
    cfg, a = run.cfg, run.cfg.algo
    fill, gap = first and run.old_logp == "trainer", first and run.old_logp == "sampler"
    with_entropy = cfg.logging.entropy or a.entropy_coef > 0
    objective = objective_args(cfg)
    max_len = objective["max_len"]
    t0 = time.perf_counter()
    sums: dict[str, float] = {}
    corr: dict[str, float] = {}  # the mismatch correction's metrics
    corrects = a.mismatch_correction in ("tis", "mis")
    lengths = rollout.model_lengths.cpu() if corrects else None  # (N,) its units per row, read once a step
    loss_total, gaps = 0.0, []
    for micro in mb.micro:
        mode = None if micro.placeholder else "capture" if fill else "compare"
        part, logp = trainer_logprobs(run, rollout, micro.rows, mode, micro.share, with_entropy)  # (b, T) or a pair
        logp, entropy = logp if with_entropy else (logp, None)
        T = part.completion_ids.shape[1]
        if fill:
            old_logp[micro.rows, :T] = logp.detach().float()
        if gap:
            gaps.append((part.sampler_logp, logp.detach(), part.model_mask * (not micro.placeholder)))
        mask, weights = part.model_mask, None  # the tokens the model wrote (not a tool's reply)
        if a.mask_truncated:  # DAPO's overlong filtering: a completion cut by the length limit adds 0
            mask = mask & ~part.truncated.to(mask.device)[:, None]
        if corrects:  # w = pi_old / pi_sampler, truncated or masked
            weights, keep, cm = algo.mismatch_weights(
                old_logp[micro.rows, :T], part.sampler_logp, part.model_mask, method=a.mismatch_correction,
                level=a.mismatch_level, cap=a.mismatch_cap, floor=a.mismatch_floor, max_log_ratio=a.max_log_ratio)
            weights, mask = algo.apply_keep(weights, keep, mask, a.level)
            n = lengths[micro.rows.cpu()]  # the tokens, or the non-empty sequences, the means are over
            _add_correction_metrics(corr, cm, int(n.sum() if a.mismatch_level == "token" else n.count_nonzero())
                                    * (micro.num_rows > 0))
        loss, m = algo.policy_loss(logp, old_logp[micro.rows, :T], adv[micro.rows], mask, weights=weights,
                                   **objective)
        if entropy is not None:  # pi_theta's entropy, from the same chunked head
            bonus, m["entropy/mean"] = algo.entropy_bonus(entropy, mask, aggregation=a.aggregation, max_len=max_len)
            if a.entropy_coef > 0:
                loss = loss - a.entropy_coef * bonus
        if run.reference is not None:  # KL(pi_theta || pi_ref), logged and, with kl_coef, in the loss
            kl, m["kl/ref"] = algo.kl_penalty(logp, reference_logprobs(run, part, micro.share), mask,
                                              estimator=a.kl_estimator, aggregation=a.aggregation,
                                              max_log_ratio=a.max_log_ratio, max_len=max_len)
            if a.kl_coef > 0:
                loss = loss + a.kl_coef * kl
        if a.router_aux_loss_coef > 0:  # MoE load balancing, over the tokens this forward routed
            aux = run.routes.take_aux()
            if aux is not None:
                loss = loss + a.router_aux_loss_coef * aux
                m["routing/aux_loss"] = aux.item()
        if faults.nan_loss(state.step + 1):  # tests only
            loss = loss * float("nan")
        (loss * micro.weight).backward()
        loss_total += loss.item() * micro.weight
        add_micro_metrics(sums, m, int(m["count/tokens"]), micro.num_rows, int(m["count/sequences"]))
    if not mb.micro:  # no row of the minibatch had signal anywhere: its gradient is exactly zero
        for p in run.trainer.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # (None would make AdamW skip the step)
    grad_norm = _grad_norm(run)
    if gap:
        sums.update(mismatch_over_parts(gaps))
    if run.routes is not None:
        sums.update(run.routes.take_metrics(per_layer=cfg.logging.routing_per_layer, captured=fill))
    if with_entropy:  # logged every step: null where no row ran (every advantage 0), as clip/* are
        sums.setdefault("entropy/mean", math.nan)
    metrics = reduce_minibatch_metrics(run.dist, sums, loss_total, sum(m.tokens for m in mb.micro),
                                       sum(m.num_rows for m in mb.micro))
    if corrects:  # means over the correction's units (tokens, or sequences) of every forward and rank; null
        corr = {"_units": 0, **dict.fromkeys(algo.MISMATCH_METRICS, math.nan), **corr}  # where none ran, as clip/*
        corr = run.dist.reduce_metrics(corr, sums=tuple(k for k in corr if not k.endswith(("_max", "_min"))))
        units = corr.pop("_units")
        metrics.update({k: (v if math.isfinite(v) else math.nan) if k.endswith(("_max", "_min"))
                        else v / units if units else math.nan for k, v in corr.items()})
    if skips:
        metrics["rows/skipped_frac"] = 1.0 - metrics["rows/minibatch"] / mb.global_rows
    metrics.update(grad_norm=grad_norm, lr=run.scheduler.get_last_lr()[0])
    _optimizer_step(run, state, metrics["loss"], grad_norm)
    metrics["train/skipped_steps"] = state.skipped_steps
    metrics["time/update"] = time.perf_counter() - t0
    return metrics


def _add_correction_metrics(acc: dict, m: dict, units: int) -> None:
    """A forward's metrics of `algo.mismatch_weights` into `acc`: means weighted by the units
    (tokens or sequences, at algo.mismatch_level) they are over, max / min."""
    acc["_units"] = acc.get("_units", 0) + units
    for k, v in m.items() if units else ():  # (a placeholder measured nothing)
        if k.endswith("_max"):
            acc[k] = max(acc.get(k, -math.inf), v)
        elif k.endswith("_min"):
            acc[k] = min(acc.get(k, math.inf), v)
        else:
            acc[k] = acc.get(k, 0.0) + v * units


def _grad_norm(run: Run) -> float:
    """Clip the gradients to optim.max_grad_norm and return their global norm before clipping
    (logged as grad_norm, as TRL and torch's clip_grad_norm_ report it); sharded grads are reduced."""
    params = [p for p in run.trainer.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, run.cfg.optim.max_grad_norm or float("inf"))
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
        norm = norm.full_tensor()
    return float(norm)


def _optimizer_step(run: Run, state: TrainerState, loss: float, grad_norm: float) -> None:
    """Step (or, with a non-finite loss or gradient, skip and count), clear the gradients, and
    advance the schedule."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        run.optimizer.step()
        if not weights_finite(run):  # a finite step the optimizer took too far (an lr far too large)
            raise TrainingError(
                f"optimizer step {state.step + 1} made weights non-finite (its loss {loss:.4g} and gradient norm "
                f"{grad_norm:.4g} were finite; optim.lr={run.cfg.optim.lr:g}, optim.adam_eps={run.cfg.optim.adam_eps:g}); "
                f"nothing of it was saved: {kept_note(checkpoint.latest_checkpoint(run.cfg.run_dir))}, with a lower "
                f"optim.lr", everywhere=True)
        state.bad_steps = 0
    else:
        state.bad_steps += 1
        state.skipped_steps += 1
        if run.dist.is_main:
            warnings.warn(f"step {state.step + 1}: non-finite loss ({loss}) or gradient norm "
                          f"({grad_norm}); step skipped ({state.bad_steps} in a row)")
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    state.step += 1


def weights_finite(run: Run) -> bool:
    """Whether every trainable weight is finite, on every process (each checks its own shards:
    one fused norm per tensor list, not a pass per tensor)."""
    local = [p.detach() for g in run.optimizer.param_groups for p in g["params"]]
    local = [p.to_local() if hasattr(p, "to_local") else p for p in local]
    ok = float(bool(torch.stack(torch._foreach_norm(local)).isfinite().all())) if local else 1.0
    return run.dist.all_reduce([ok], "min")[0] == 1.0


# ---------------------------------------------------------------- the loop


def train(cfg: Config, *, run: Run | None = None) -> Path:
    """Run GSPO as configured; returns the run directory (with `final/` in HF format). A run that a
    signal stopped (Ctrl-C, SIGTERM) returns it after saving, without final/: resume=auto goes on.
    `cfg` built or edited in Python is checked as a config file is (`checked_config`), and a copy
    of it is what the run takes."""
    if run is None:
        cfg = checked_config(cfg)
    if async_job.is_generator_rank(cfg):  # torchrun, rollout.mode=async: this rank samples
        from gspo.train.async_generator import serve

        try:
            serve(cfg)
        except (RuntimeError, ConnectionError) as e:  # the learners are gone (they say why): one line, no traceback
            raise async_job.GeneratorError(f"generator rank {os.environ.get('RANK')}: the learners are gone "
                                           f"({str(e).splitlines()[0][:160]})") from e
        return cfg.run_dir
    run = run or build_run(cfg)
    d, run_dir, total = run.dist, cfg.run_dir, cfg.schedule.rollouts
    try:  # a failure before the loop (a checkpoint that does not load, a tracker) lets the run go
        state = TrainerState(base_weights=run.base_weights)
        inflight = {}
        if run.resume_from is not None:
            state = TrainerState(**run_state.restore_run(run, run.resume_from))
            check_base_weights(cfg, state.base_weights, run.base_weights)
            inflight = load_inflight(run.resume_from, d.rank) if run.remote is not None else {}
            extended = state.finished and state.rollout < total  # schedule.rollouts raised: on from the last rollout
            state.finished = state.finished and not extended
            if state.finished:
                if d.broadcast_object(not (run_dir / "final").is_dir()):  # killed while writing final/
                    run_state.save_final(run)
                    if d.is_main:
                        print(f"run {run_dir} finished at rollout {state.rollout}; final/ was not whole and is "
                              f"written again from {run.resume_from}")
                elif d.is_main:
                    print(f"run {run_dir} already finished at rollout {state.rollout}: nothing to do")
                run.close()
                return run_dir
            run.prompts.load_state_dict(state.prompts, allow_changed=cfg.data.resume_on_changed)
            if d.is_main and run.prompts.data_changed(state.prompts):
                print(f"warning: data.source {cfg.data.source}: the rows changed since the checkpoint (as many as "
                      "before); data.resume_on_changed=true goes on over them from the saved position",
                      file=sys.stderr)
            if d.is_main and extended:  # (said once the resume is sure to go on)
                print(f"run {run_dir} finished at rollout {state.rollout}; schedule.rollouts={total} extends it"
                      + (" (the cosine learning-rate schedule is stretched over the new total)"
                         if cfg.schedule.lr_schedule == "cosine" else ""))
            if d.is_main:
                (run_dir / "config.yaml").write_text(to_yaml(cfg))  # the settings it goes on with
                truncate_metrics(run_dir / "metrics.jsonl", state.step)
                checkpoint.resume_here(run.resume_from)
                print(f"resumed from {run.resume_from} (rollout {state.rollout}, step {state.step})")
        sinks = Sinks(JsonlWriter(run_dir / "metrics.jsonl"), open_trackers(cfg, state.step)) \
            if d.is_main else None  # rank 0 logs: metrics.jsonl and logging.report_to's trackers
        console = Console(total, state.rollout, enabled=cfg.logging.console and d.is_main)
    except BaseException:
        run.close()  # (its lock, its generators, its reward workers)
        raise
    try:
        if run.remote is not None:
            run.remote.begin(state.rollout, inflight)  # the generators start on what the schedule needs
        with StopRequest(say=d.is_main, run_dir=run_dir) as stop:
            if state.rollout == 0 and cfg.eval.enabled:
                start = evaluate_run(run, 0)  # the starting point
                if sinks:
                    sinks.write({"step": 0, "rollout": 0, **start})
            saved = state.step if run.resume_from is not None else -1  # the step the newest checkpoint holds
            saved_at = time.monotonic()  # (checkpoint.every_minutes counts from here)
            while state.rollout < total:
                t_step = time.perf_counter()
                rng = checkpoint.capture_rng_state() if saved != state.step else None
                scored = produce_or_save(run, state, rng)                       # 1. episodes, rewards
                steps, info = learn(run, scored, state)                         # 2. π_old, updates, sync
                state.rollout += 1
                if run.remote is not None:  # the new weights go out at once; prompts are drawn ahead
                    run.remote.after_update(state.rollout)
                    state.prompts = run.remote.stream_state(state.rollout)
                else:
                    state.prompts = run.prompts.state_dict()
                due = cfg.eval.every and state.rollout % cfg.eval.every == 0

                def log(eval_metrics: dict) -> None:
                    timed = {**info, "time/step": time.perf_counter() - t_step}
                    log_step(run, sinks, console, state, scored, steps, timed, eval_metrics)
                evaluating = cfg.eval.enabled and (due or state.rollout == total)
                eval_metrics = evaluate_or_save(run, state, log) if evaluating else {}
                try:
                    log(eval_metrics)                                            # 3. log
                except BaseException:  # a tracker or the console failed after the update (rich's
                    # SystemExit on a broken pipe too): keep the update
                    if not d.enabled:  # (one process alone: a save is collective under torchrun)
                        run_state.save_run(run, state)
                    raise
                stop_now = any_process(stop.signum or 0, d.all_reduce)
                if state.bad_steps >= cfg.checkpoint.max_bad_steps:             # 4. checkpoint
                    run_state.save_run(run, state)
                    raise TrainingError(
                        f"{state.bad_steps} optimizer steps in a row had a non-finite loss or gradient norm; "
                        f"stopped and saved the last good state in {run_dir / 'checkpoints'}", everywhere=True)
                if stop_now:
                    run_state.save_run(run, state)
                    if d.is_main:  # (a console that is off prints plainly: on rank 0 alone)
                        console.print(f"stopped by signal {int(stop_now)} after rollout {state.rollout}; "
                                      f"resume with resume=auto")
                    return run_dir
                minutes = cfg.checkpoint.every_minutes
                timed = any_process(int(bool(minutes) and time.monotonic() - saved_at >= 60 * minutes), d.all_reduce)
                if state.rollout < total and (timed or (cfg.checkpoint.every and state.rollout % cfg.checkpoint.every == 0)):
                    run_state.save_run(run, state)
                    saved, saved_at = state.step, time.monotonic()
                faults.after_rollout(state.rollout)  # tests only
            state.finished = True
            run_state.save_run(run, state)
            run_state.save_final(run)
    except RuntimeError as e:
        if not (d.enabled and peer_lost(e)) or isinstance(e, TrainingError):
            raise
        raise TrainingError(f"another process of the job is gone (rank {d.rank} of {d.world_size} lost its "
                            f"connection: {str(e).splitlines()[0][:160]}); "
                            f"{kept_note(checkpoint.latest_checkpoint(run_dir))}") from e
    finally:
        console.close()
        if sinks:
            sinks.close()
        run.close()
    return run_dir
