"""DAPO's dynamic sampling (`rollout.dynamic_sampling`): over-sample, keep the groups with signal.

Yu et al., "DAPO", arXiv 2503.14476, §3.2: a group whose G rewards are all equal (every answer
right, or every one wrong) has advantage 0, so it adds nothing to the gradient and only
shrinks the batch that does. DAPO samples more prompts and keeps those whose groups are
neither all right nor all wrong until the batch is full. Here "signal" is `group_advantages`'
own rule, read off its output (a group has signal when its advantages are not all 0): at least
two valid rewards that are not all equal, so a group whose rewards are all missing has none.
It is judged on the reward the advantages use, the overlong penalty included.

One rollout, on each process (`sample_with_signal`):

1. Round k draws the prompt stream's next batch (B = prompts_per_step / world_size prompts),
   samples its B·G episodes with the seed `chunk_seed(seed, rollout, k)` (round 0 keeps the
   plain rollout's `chunk_seed(seed, rollout)`, so a rollout whose groups all have signal is the
   one sampling without this option would give) and scores them.
2. Another round follows while ANY process has fewer than B groups with signal, up to
   `rollout.dynamic_sampling_max_rounds` rounds (the first included). Every process draws the
   same rounds (one all-reduce per round), so under torchrun the processes' prompt streams stay
   in step and they make the same collective calls; a round that raised on one process stops
   every process there, together (`draw_rounds`).
3. The batch is the first B groups with signal in draw order; when the rounds ran out with
   fewer, the first groups without signal fill it up. Fillers have advantage 0 and leave the
   trainer's passes (`schedule.skip_zero_advantage`), but the batch always has exactly B
   groups: the step's shapes, minibatches and plan never change.

A resumed run is the same run: the rounds' seeds come from the rollout index and the round,
and the prompt stream's position (saved in every checkpoint) counts every round's prompts.
Each process keeps its own groups, so a 2-process run no longer reproduces a 1-process run
sample for sample (each process fills its own half of the batch from its own prompts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from gspo import algo
from gspo.rewards.runner import RewardResult
from gspo.rollout import Rollout, concat_rollouts


@dataclass
class Round:
    """One sampling round: B prompt rows, their B·G episodes and rewards, its times, and which
    of its groups carry signal."""

    batch: list[dict]
    rollout: Rollout
    rewards: RewardResult
    times: dict
    signal: torch.Tensor  # (B,) bool


def group_signal(rewards: torch.Tensor, group_size: int, *, scale: str, eps: float) -> torch.Tensor:
    """(B,) bool: the groups of `rewards` ((B·G,), NaN missing) whose advantages
    (`algo.group_advantages`, the very ones the update uses) are not all 0."""
    adv, _ = algo.group_advantages(rewards, group_size, scale=scale, eps=eps)  # (B·G,)
    return (adv.reshape(-1, group_size) != 0).any(-1).cpu()


class ProcessFailed(RuntimeError):
    """Another process raised while drawing a round of dynamic sampling; this one stops with it
    (`gspo.train.produce.produce_or_save` saves first)."""


def draw_rounds(draw: Callable[[int], Round], *, need: int, max_rounds: int, all_reduce) -> list[Round]:
    """Round 0, then one more while any process has fewer than `need` groups with signal, at
    most `max_rounds` in all. `all_reduce` is the run's (`Dist.all_reduce`): every process
    makes the same calls and draws the same number of rounds.

    Each round ends in one all-reduce that also carries whether the round raised on any
    process (a reward that raised or ran out of time, a tool or data error). Then every process
    raises together: the one that failed its own error, the others `ProcessFailed`, so none is
    left waiting in a collective for one that has gone, and `produce_or_save` saves the state
    before the rollout on every process."""
    rounds: list[Round] = []
    while True:
        fault = None
        try:
            rounds.append(draw(len(rounds)))
        except Exception as e:  # agreed on below
            fault = e
        short = fault is None and sum(int(r.signal.sum()) for r in rounds) < need
        short_any, failed_any = all_reduce([float(short), float(fault is not None)], "max")
        if fault is not None:
            raise fault
        if failed_any:
            raise ProcessFailed
        if not short_any or len(rounds) >= max_rounds:
            return rounds


def pick_groups(signals: list[torch.Tensor], need: int) -> list[tuple[int, int]]:
    """(round, group) of the batch's `need` groups, in draw order: the first `need` groups with
    signal, then, if there are fewer, the first groups without it."""
    drawn = [(k, g) for k, s in enumerate(signals) for g in range(len(s))]
    with_signal = [kg for kg in drawn if signals[kg[0]][kg[1]]]
    without = [kg for kg in drawn if not signals[kg[0]][kg[1]]]
    return sorted(with_signal[:need] + without[: max(need - len(with_signal), 0)])


def sample_with_signal(draw: Callable[[int], tuple], *, need: int, group_size: int, max_rounds: int,
                       adv_scale: str, adv_eps: float, all_reduce, pad_id: int):
    """Rounds of `draw(k) -> (batch, rollout, rewards, times)` until `need` groups have signal
    (module docstring), then the batch: (B rows, their Rollout, RewardResult, times). The times
    are summed over rounds and carry the rollout's `dynamic/*` metrics, over every process:
    rounds, groups drawn, groups kept (with signal, in the batch), and the fraction of the
    drawn groups that had signal (what a plain rollout would have kept)."""
    def one_round(k: int) -> Round:
        batch, rollout, rewards, times = draw(k)
        return Round(batch, rollout, rewards, times,
                     group_signal(rewards.rewards, group_size, scale=adv_scale, eps=adv_eps))

    rounds = draw_rounds(one_round, need=need, max_rounds=max_rounds, all_reduce=all_reduce)
    picks = pick_groups([r.signal for r in rounds], need)
    batch, rollout, rewards = merge_rounds(rounds, picks, group_size, pad_id)
    times: dict = {}
    for r in rounds:
        for k, v in r.times.items():
            times[k] = times.get(k, 0.0) + v
    drawn, kept, with_signal = all_reduce([float(sum(len(r.signal) for r in rounds)),
                                           float(sum(int(rounds[k].signal[g]) for k, g in picks)),
                                           float(sum(int(r.signal.sum()) for r in rounds))], "sum")
    times.update({"dynamic/rounds": len(rounds), "dynamic/groups_drawn": int(drawn), "dynamic/groups_kept": int(kept),
                  "dynamic/signal_frac": with_signal / drawn})
    return batch, rollout, rewards, times


def merge_rounds(rounds: list[Round], picks: list[tuple[int, int]], group_size: int, pad_id: int):
    """The picked groups of `rounds` as one batch: (rows, Rollout, RewardResult). The Rollout's
    episode statistics (multi-turn) are over every episode drawn; the rewards' means describe
    the batch, their failure counts and times every round."""
    G = group_size
    rows_of = {k: [g * G + j for kk, g in picks if kk == k for j in range(G)] for k in range(len(rounds))}
    used = [k for k in range(len(rounds)) if rows_of[k]]
    batch = [rounds[k].batch[g] for k, g in picks]
    rollout = concat_rollouts([rounds[k].rollout.select(rows_of[k]) for k in used], pad_id)
    if rounds[0].rollout.episode_stats:  # every round holds the same number of episodes
        rollout.episode_stats = {key: sum(r.rollout.episode_stats[key] for r in rounds) / len(rounds)
                                 for key in rounds[0].rollout.episode_stats}
    rewards = merge_rewards([rounds[k].rewards for k in used], [rows_of[k] for k in used],
                            every=[r.rewards for r in rounds])
    return batch, rollout, rewards


def merge_rewards(results: list[RewardResult], rows: list[list[int]], *, every: list[RewardResult]) -> RewardResult:
    """The rows `rows[i]` of `results[i]`, in order, as one RewardResult. Its stats: the means
    (`reward/mean`, `reward/std`, `reward/missing`, each `reward/NAME/mean`) recomputed over
    those rows as `RewardRunner.score` computes them; the rest (failure counts, times) summed
    over `every` result, the rounds that were scored."""
    idx = [torch.as_tensor(r, dtype=torch.long) for r in rows]
    rewards = torch.cat([res.rewards[i] for res, i in zip(results, idx)])  # (N,)
    per_function = {name: [v for res, r in zip(results, rows) for v in (res.per_function[name][j] for j in r)]
                    for name in results[0].per_function}
    stats: dict[str, float] = {}
    for res in every:
        for k, v in res.stats.items():
            stats[k] = stats.get(k, 0.0) + v
    ok = rewards[~rewards.isnan()]
    stats["reward/mean"] = ok.mean().item() if len(ok) else math.nan
    stats["reward/std"] = ok.std(unbiased=False).item() if len(ok) else math.nan
    stats["reward/missing"] = float(len(rewards) - len(ok))
    for name, values in per_function.items():
        stats[f"reward/{name}/mean"] = torch.tensor(values, dtype=torch.float64).nanmean().item()
    return RewardResult(rewards=rewards, per_function=per_function, stats=stats,
                        errors=[e for res in every for e in res.errors])
