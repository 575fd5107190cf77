"""The per-rollout plan of `learn`: which rows each forward runs and with what weight, settled
before the first forward, with every count the processes must agree on gathered in ONE
collective.

Why agreement matters: under torchrun every trainer forward is a collective (FSDP2 gathers the
shards, DDP syncs buffers and reduces gradients), so every process must make the same number
of forwards in the same order, whatever its own rows. Three things differ between processes:

- rows whose advantage is 0 are left out (`schedule.skip_zero_advantage`): a micro-batch left
  with no row on ANY process is dropped by all; a process left with none while another has
  some runs one row at weight 0 (a placeholder);
- the π_old pass runs the rows that need it in forwards of a fixed size: a process with fewer
  forwards pads with placeholders up to the largest count;
- with `algo.aggregation=token-mean` a micro-batch's weight is its share of the GLOBAL token
  count of its minibatch;
- whether a forward runs each distinct prompt once (`model.share_prompt`) changes how many
  decoder calls it makes: under FSDP2 a forward shares only if it does on every process.

`build_plan` takes every process's counts from `gather` (one all-gather of a short vector;
the identity on one process), so it is a pure function of them and is tested without processes
(`tests/test_plan.py`). The other cross-process decision of a step, stopping on a signal, is
`any_process`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class Micro:
    """One forward + backward of a minibatch."""

    rows: torch.Tensor  # (b,) local row indices the forward runs
    weight: float       # factor on its loss: its share of the minibatch loss (0 for a placeholder)
    tokens: int         # completion tokens of `rows` (0 for a placeholder)
    placeholder: bool   # runs only so that every process makes the same calls; adds nothing
    share: bool | None = None  # runs each distinct prompt once; None: the forward decides from its rows

    @property
    def num_rows(self) -> int:
        return 0 if self.placeholder else len(self.rows)


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step (paper §5.1: a rollout is split into `num_minibatches` of them)."""

    rows: torch.Tensor   # (m,) every local row of the step, skipped ones included
    micro: list[Micro]   # empty when no process has a row to run: the gradient is exactly 0
    global_rows: int     # rows of the step on all processes


@dataclass(frozen=True)
class Plan:
    minibatches: list[Minibatch]
    old_forwards: list[torch.Tensor | None]  # the π_old pass, one entry per forward; None: placeholder
    live: torch.Tensor | None                # (N,) bool: rows with a nonzero advantage; None: every row runs
    old_share: list[bool | None] = field(default_factory=list)  # per π_old forward, as Micro.share

    @property
    def skips(self) -> bool:
        return self.live is not None


Gather = Callable[[torch.Tensor], torch.Tensor]  # (k,) float64 -> (world_size, k): every process's vector


def build_plan(minibatch_rows: list[torch.Tensor], lengths: torch.Tensor, *, live: torch.Tensor | None,
               micro_size: int, token_mean: bool, old_pass: bool, old_forward_size: int,
               gather: Gather, can_share=None) -> Plan:
    """The plan of one rollout on this process.

    `minibatch_rows` are the local rows of each optimizer step (`gspo.train.minibatches`);
    `lengths` (N,) the completion lengths; `live` (N,) bool the rows to run (None: all);
    `micro_size` rows per forward (0: the whole minibatch). With `old_pass`, the π_old pass runs
    every live row outside the first minibatch (whose own forward, before the first optimizer
    step, is π_old), sorted by length so each forward trims more padding, `old_forward_size`
    rows a forward. `gather` is `Dist.all_gather` (or the identity with a leading dim).
    `can_share(rows) -> bool` says whether the forward over `rows` would run each distinct
    prompt once (`gspo.models.logprobs.can_share_prompt`); given it (FSDP2), a forward shares
    only if it does on every process. Without it the plan leaves the decision to each forward
    (None), which costs nothing where the processes need not agree."""
    lengths = lengths.cpu()
    pieces = [list(mb.split(micro_size or max(len(mb), 1))) for mb in minibatch_rows]
    kept = [[p if live is None else p[live[p]] for p in mb] for mb in pieces]
    old_rows = torch.tensor([], dtype=torch.long)
    if old_pass:
        need = torch.ones(len(lengths), dtype=torch.bool) if live is None else live.clone()
        need[minibatch_rows[0]] = False
        old_rows = need.nonzero().squeeze(1)
        old_rows = old_rows[lengths[old_rows].argsort(stable=True)]
    old_forwards: list = list(old_rows.split(old_forward_size)) if len(old_rows) else []

    # this process's counts: tokens of each minibatch | live rows of each piece | π_old forwards
    # | whether each piece's forward would share | whether each possible π_old forward would
    n_pieces = sum(len(mb) for mb in pieces)
    share_slots = []
    if can_share is not None:
        max_old = -(-len(lengths) // old_forward_size) if old_pass else 0  # the most π_old forwards of any process
        share_slots = ([float(len(p) > 0 and can_share(p)) for mb in kept for p in mb]
                       + [float(can_share(f)) for f in old_forwards] + [0.0] * (max_old - len(old_forwards)))
    mine = ([float(lengths[mb].sum()) for mb in minibatch_rows] + [float(len(p)) for mb in kept for p in mb]
            + [float(len(old_forwards))] + share_slots)
    every = gather(torch.tensor(mine, dtype=torch.float64)).view(-1, len(mine))  # (world, k)
    world = every.shape[0]
    total = every.sum(0).tolist()
    M = len(minibatch_rows)
    mb_tokens, anywhere = total[:M], total[M:M + n_pieces]
    n_old = int(every[:, M + n_pieces].max())
    if can_share is None:
        piece_share, old_share = [None] * n_pieces, [None] * n_old
    else:
        decided = [bool(x) for x in every.min(0).values.tolist()]  # all processes share, or none
        piece_share, old_share = decided[M + n_pieces + 1:M + 2 * n_pieces + 1], decided[M + 2 * n_pieces + 1:]
    old_forwards += [None] * (n_old - len(old_forwards))

    out, j = [], 0
    for k, (mb, mb_pieces, mb_kept) in enumerate(zip(minibatch_rows, pieces, kept)):
        micro = []
        for piece, rows in zip(mb_pieces, mb_kept):
            n_any, j = anywhere[j], j + 1
            if n_any == 0:
                continue  # no process runs it: every process drops it
            together = piece_share[j - 1]
            if len(rows) == 0:
                micro.append(Micro(piece[:1], 0.0, 0, True, together))
                continue
            tokens = int(lengths[rows].sum())
            weight = tokens / max(mb_tokens[k], 1) * world if token_mean else len(rows) / len(mb)
            micro.append(Micro(rows, weight, tokens, False, together))
        out.append(Minibatch(mb, micro, len(mb) * world))
    return Plan(out, old_forwards, live, old_share[:n_old])


def any_process(flag: float, all_reduce) -> float:
    """The largest value of `flag` over processes (a signal on one stops all)."""
    return all_reduce([float(flag)], "max")[0]
