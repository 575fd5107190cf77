"""The metrics of one step, kept out of the loop so that `gspo.train` reads as the step itself:
the sampler/trainer log-prob gap, one minibatch's metrics summed over micro-batches and reduced
over processes, rollout-level metrics, the completion rows logged to completions/, and
`log_step`, which writes them all (metrics.jsonl, the trackers, the console) after a step."""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import torch

from gspo import algo
from gspo.report.sinks import jsonable, write_completions
from gspo.rollout import Rollout

if TYPE_CHECKING:
    from gspo.report.sinks import Console, Sinks
    from gspo.train.loop import TrainerState
    from gspo.train.produce import ScoredRollout
    from gspo.train.run import Run


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
            # k3 estimate of KL(sampler || trainer) on tokens drawn from the sampler: e^-d - 1 + d, ~d^2/2,
            # in float64 through expm1 (float32's e^-d - 1 cancels to 0 or noise for the gaps of 1e-5..1e-4 it measures)
            "mismatch/kl": (torch.expm1(-d.double()) + d.double()).mean().item()}


def mismatch_over_parts(gaps: list) -> dict:
    """mismatch_metrics over micro-batches of different widths (padded to the widest)."""
    if not gaps:  # no row ran
        return mismatch_metrics(*[torch.zeros(0, 0)] * 3)
    t = max(g[0].shape[1] for g in gaps)
    pad = lambda x: torch.nn.functional.pad(x, (0, t - x.shape[1]))  # noqa: E731
    return mismatch_metrics(*(torch.cat([pad(g[j]) for g in gaps]) for j in range(3)))


_COUNTS = ("count/tokens", "count/sequences", "count/rows")  # what the means below are over (not logged)


def add_micro_metrics(sums: dict, m: dict, n_tok: int, n_rows: int, n_seq: int | None = None) -> None:
    """Add one forward's `policy_loss` metrics into `sums`, each weighted by what it is a mean
    over in that forward: per-token fractions by `n_tok` (the tokens its mask left in the loss),
    means over sequences by `n_seq` (its non-empty rows; default `n_rows`), the mean length by
    `n_rows`; min / max combined over forwards with a sequence. A forward's own means over what
    its mask left then combine into the minibatch's, however it is cut (`algo.mask_truncated`, MIS
    at the sequence levels). A placeholder (n_rows 0) only makes the keys exist, as NaN, which the
    reduction over ranks leaves out."""
    n_tok, n_seq = (n_tok, n_rows if n_seq is None else n_seq) if n_rows else (0, 0)
    for k, n in zip(_COUNTS, (n_tok, n_seq, n_rows)):
        sums[k] = sums.get(k, 0) + n
    for k, v in m.items():
        if k == "loss" or k in _COUNTS:  # (the weighted loss is summed by the caller)
            continue
        have = sums.get(k, math.nan) == sums.get(k, math.nan)  # (NaN: nothing counted yet)
        if not n_rows or (k.endswith(("_min", "_max")) and not n_seq):  # (a ratio min / max over no sequence)
            sums.setdefault(k, math.nan)
        elif k.endswith(("_min", "_max")):
            sums[k] = (min if k.endswith("_min") else max)(sums[k], v) if have else v
        else:
            x = v * _weight(k, n_tok, n_seq, n_rows)
            sums[k] = sums[k] + x if have else x


def _weight(k: str, n_tok, n_seq, n_rows):
    """What metric `k` of `policy_loss` (or of the loss's other terms) is a mean over."""
    return n_tok if k in algo.TOKEN_METRICS else n_rows if k == "completion/len_mean" else n_seq


def reduce_minibatch_metrics(d, sums: dict, loss: float, tokens: int, rows: int) -> dict:
    """The minibatch's metrics over all ranks (one decision on every rank): sums divided by the
    global counts they are means over (`add_micro_metrics`); NaN (null in metrics.jsonl) where no
    row ran, or no token or sequence was left in the loss."""
    per_row = [k for k in sums if k in algo.TOKEN_METRICS or k in algo.SEQUENCE_METRICS]
    metrics = d.reduce_metrics({**sums, "loss": loss, "tokens/minibatch": tokens, "rows/minibatch": rows},
                               sums=(*per_row, *_COUNTS, "tokens/minibatch", "rows/minibatch"))
    counts = [metrics.pop(k, 0) for k in _COUNTS]
    for k in dict.fromkeys((*algo.ROW_METRICS, *per_row)):
        n = _weight(k, *counts)
        if k in per_row:
            metrics[k] = metrics[k] / n if n > 0 else math.nan
        elif not math.isfinite(metrics.get(k, math.nan)):  # (a min / max over no value)
            metrics[k] = math.nan
    if "ratio/token_log_sq_mean" in metrics:  # the spread of the token log-ratios (GRPO's noise, paper §3)
        metrics["ratio/token_log_var"] = max(metrics["ratio/token_log_sq_mean"] - metrics["ratio/token_log_mean"] ** 2,
                                             0.0) if math.isfinite(metrics["ratio/token_log_sq_mean"]) else math.nan
    return metrics


def rollout_metrics(d, rollout: Rollout, rewards, adv_stats: dict) -> dict:
    """Rollout-level metrics over the global batch (every rank's rows)."""
    r = d.all_gather(rewards.rewards.float().cpu())
    valid = r[~torch.isnan(r)]
    lengths = d.all_gather(rollout.model_lengths.float().cpu())  # |y|: the tokens the model wrote, its EOS too
    # empty: the model wrote no text, as `decode_completions` reads it for the rewards (no EOS, no special
    # tokens): its EOS alone, or only special tokens or whitespace. (A continued assistant turn's given
    # start, which the rewards get before it, is not the model's.)
    empty = d.all_gather(torch.tensor([not c.strip() for c in rollout.completions], dtype=torch.float32))
    truncated = rollout.truncated.float()
    local = dict(rewards.stats)
    local.update(adv_stats)
    local["completion/truncated_frac"] = truncated.mean().item()
    m = d.reduce_metrics(local, sums=("reward/errors", "reward/timeouts", "reward/missing"))
    m.update({"reward/mean": valid.mean().item() if len(valid) else float("nan"),
              "reward/std": valid.std(unbiased=False).item() if len(valid) > 1 else float("nan"),
              "completion/len_mean": lengths.mean().item(),
              "completion/len_max": lengths.max().item(),
              "completion/empty_frac": empty.mean().item()})
    if rollout.episode_stats:  # multi-turn episodes: per-episode means, so the processes' mean is the batch's
        m.update(d.reduce_metrics(dict(rollout.episode_stats)))
    return m


def completion_rows(step: int, rollout: Rollout, rewards, adv: torch.Tensor) -> list[dict]:
    rows = []
    for i in range(rollout.num_samples):
        text = rollout.completions[i] if rollout.turns is None else episode_text(rollout.turns[i])
        rows.append({"step": step, "prompt": rollout.prompts[i], "completion": text,
                     "reward": float(rewards.rewards[i]), "advantage": float(adv[i]),
                     "finish_reason": rollout.finish_reason[i],
                     "policy_version": None if rollout.policy_version is None else int(rollout.policy_version[i]),
                     "rewards": {k: float(v[i]) for k, v in rewards.per_function.items()}})
    return rows


def episode_text(messages: list[dict]) -> str:
    """A multi-turn episode as one text for the logs: each message as 'role: content'."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


# the rollout's own value of these is logged, not the step's (policy_loss measures them over the
# minibatch's rows that ran, which leaves out rows with advantage 0 and varies from step to step)
ROLLOUT_WIDE = ("completion/len_mean",)


def log_step(run: Run, sinks: Sinks | None, console: Console, state: TrainerState, scored: ScoredRollout,
             steps: list[dict], info: dict, eval_metrics: dict) -> None:
    """One line per optimizer step in metrics.jsonl (and the trackers): the rollout's metrics,
    the step's own, and the evaluation on the rollout's last step; the console; completions."""
    d, rollout = run.dist, scored.rollout
    common = rollout_metrics(d, rollout, scored.rewards, scored.adv_stats)
    n_tokens, n_all = (int(x) for x in d.all_reduce(
        [float(rollout.completion_mask.sum()), float(rollout.attention_mask.sum())]))
    common.update({**info, **scored.times, "tokens/completion": n_tokens, "tokens/total": n_all,
                   "rollout": state.rollout, "tokens_per_s": n_tokens / info["time/step"]})
    first = state.step - len(steps) + 1
    for i, m in enumerate(steps):
        rec = {"step": first + i, **common, **{k: v for k, v in m.items() if k not in ROLLOUT_WIDE}}
        if i == len(steps) - 1:
            rec.update(eval_metrics)
        if sinks:
            sinks.write(rec)
    console.update(state.rollout, {**common, **{k: v for k, v in steps[-1].items() if k not in ROLLOUT_WIDE},
                                   **eval_metrics})
    rows = _due_completion_rows(run, state, scored)  # every process: the rows of all of them
    if d.is_main:
        _warn_reward_failures(run, state.rollout, scored.rewards.errors, common)
        _warn_no_signal(run, state.rollout, common)
        _warn_silent_functions(run, state.rollout, common)
        _log_completions(run, console, sinks, state, scored.rollout.group_size, rows)


def _warn_reward_failures(run: Run, rollout: int, errors: list[str], metrics: dict) -> None:
    """Say so when rewards failed (a function raised or timed out) and rewards.on_error (skip or
    zero) let the run go on: on the first rollout with failures, then at most once in
    logging.no_signal_every rollouts, with the count since the last message and the first
    failure's line (`reward/errors` and `reward/timeouts` log every rollout's counts)."""
    failed = int(metrics.get("reward/errors", 0) + metrics.get("reward/timeouts", 0))
    run.reward_failures += failed
    if not failed:
        return
    every, last = run.cfg.logging.no_signal_every, run.reward_failures_warned
    if last > -math.inf and (not every or rollout - last < every):
        return
    since = "in this rollout" if last == -math.inf else f"since rollout {last:g}"
    run.reward_failures_warned, n, run.reward_failures = rollout, run.reward_failures, 0
    handled = {"skip": "left out as missing", "zero": "scored 0"}.get(run.cfg.rewards.on_error, "")
    first = f" First: {errors[0]}" if errors else ""
    print(f"rollout {rollout}: {n} rewards failed {since}, {handled} (rewards.on_error={run.cfg.rewards.on_error}; "
          f"reward/errors and reward/timeouts count them).{first}", file=sys.stderr, flush=True)


def _warn_silent_functions(run: Run, rollout: int, metrics: dict) -> None:
    """Say so, on the first rollout it happens and then at most once in logging.no_signal_every
    rollouts, when a reward function gave no value on any completion while another did: the run
    trains on the others alone, which `reward/NAME/mean` (null) alone used to show."""
    if math.isnan(metrics.get("reward/mean", math.nan)):
        return  # no reward at all: `_warn_no_signal` says so
    silent = [k[len("reward/"):-len("/missing_frac")] for k, v in metrics.items()
              if k.startswith("reward/") and k.endswith("/missing_frac") and v >= 1.0]
    every, last = run.cfg.logging.no_signal_every, run.silent_warned
    if not silent or (last > -math.inf and (not every or rollout - last < every)):
        return
    run.silent_warned = rollout
    print(f"rollout {rollout}: reward function{'s' if len(silent) > 1 else ''} {', '.join(map(repr, silent))} gave no "
          "value on any completion (None on every row: a judge whose answers had no score its regex reads, or rows "
          "without what the function reads; or failures rewards.on_error left out), so the rewards are the other "
          "functions' alone (reward/NAME/missing_frac logs it).", file=sys.stderr, flush=True)


def _warn_no_signal(run: Run, rollout: int, metrics: dict) -> None:
    """Say so, at most once in logging.no_signal_every rollouts, when every group of the rollout
    had equal rewards: every advantage was 0, so the update had no gradient from the loss."""
    every = run.cfg.logging.no_signal_every
    all_cut = run.cfg.algo.mask_truncated and metrics.get("completion/truncated_frac", 0.0) >= 1.0
    run.no_signal.append(metrics.get("adv/frac_zero_std", 0.0) >= 1.0 or all_cut)
    if not (every and run.no_signal[-1]) or rollout - run.no_signal_warned < every:
        return
    run.no_signal_warned = rollout
    recent = run.no_signal[-every:]
    a = run.cfg.algo  # a KL, entropy or router term still moves the weights: only the policy term is gone
    term = ("the policy-gradient term has no gradient (the KL / entropy / router-loss terms still act)"
            if a.kl_coef > 0 or a.entropy_coef > 0 or a.router_aux_loss_coef > 0 else "the loss has no gradient")
    if all_cut and metrics.get("adv/frac_zero_std", 0.0) < 1.0:  # (the KL and entropy terms use the same mask)
        term = ("the loss has no gradient but the router-loss term's" if a.router_aux_loss_coef > 0
                else "the loss has no gradient")
        print(f"rollout {rollout}: every completion ran to rollout.max_new_tokens, and algo.mask_truncated=true leaves "
              f"them all out of the loss ({sum(recent)} of the last {len(recent)} rollouts with no signal): {term}. "
              "Raise rollout.max_new_tokens, or set algo.mask_truncated=false.", file=sys.stderr, flush=True)
        return
    if math.isnan(metrics.get("reward/mean", 0.0)):  # no reward at all (`rollout_metrics`: NaN where none is valid)
        print(f"rollout {rollout}: every reward was missing ({sum(recent)} of the last {len(recent)} rollouts with no "
              "signal): the reward functions returned None, or failed and rewards.on_error left them out "
              f"(reward/errors, reward/timeouts); {term}. Check that the data has what they read "
              "(an 'answer' column for exact_answer and math_verify), and that a judge's answers hold a score its "
              "kwargs.regex reads.", file=sys.stderr, flush=True)
        return
    print(f"rollout {rollout}: every group's rewards were equal ({sum(recent)} of the last {len(recent)} rollouts): "
          f"the advantages are all 0 and {term}. Check that the reward functions can tell the "
          "completions apart (rewards.functions), that the model can reach a reward at all (a short supervised "
          "warm-up, easier prompts), or raise rollout.group_size / rollout.temperature for more varied groups.",
          file=sys.stderr, flush=True)


def _completions_due(run: Run, state: TrainerState) -> tuple[bool, bool]:
    """(completions/ file, console table) due after this rollout; the same on every process."""
    lc = run.cfg.logging
    return (bool(lc.completions_every) and (state.rollout % lc.completions_every == 0 or state.rollout == 1),
            bool(lc.table_every) and state.rollout % lc.table_every == 0)


def _due_completion_rows(run: Run, state: TrainerState, scored: ScoredRollout) -> list[dict] | None:
    """The rollout's completion rows, every process's in rank order (under torchrun each samples
    its own prompts' groups), when a completions file or table is due; None otherwise."""
    if not any(_completions_due(run, state)):
        return None
    rows = completion_rows(state.step, scored.rollout, scored.rewards, scored.advantages)
    return [r for part in run.dist.gather_json(jsonable(rows)) for r in part]


def _log_completions(run: Run, console: Console, sinks: Sinks, state: TrainerState, group_size: int,
                     rows: list[dict] | None) -> None:
    want_file, want_table = _completions_due(run, state)
    if want_file:
        write_completions(run.cfg.run_dir, state.step, rows)
        sinks.table(state.step, rows)  # the trackers mirror completions/
    if want_table:
        console.table(f"rollout {state.rollout}", rows[:: max(group_size // 2, 1)][: run.cfg.logging.table_rows])
