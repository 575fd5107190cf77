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

Padding: a forward costs about (rows x the longest row), so a minibatch's rows are cut by
length (`LengthCuts`): into up to `schedule.length_buckets` forwards of similar length,
where the padding saved pays for the extra calls, or, with a micro-batch size, sorted by length
before they are cut. Under torchrun the processes agree on how many forwards (the most any
process wants), in one more all-gather.

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


def bucket_costs(unit_len: torch.Tensor, unit_rows: torch.Tensor, unit_prompt: torch.Tensor,
                 max_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best cuts of units sorted by length into k = 1..K contiguous forwards (K = min(max_buckets, units)).

    A forward over units i..j-1 costs (their rows) x (the longest, unit_len[j-1]) completion
    tokens plus their prompt tokens (unit_prompt: a row's prompt, or a group's once when the
    forward shares it). Returns cost (K,) of the best k-cut and cut (K, K+1) long: the k-cut's
    forward b runs units cut[k-1, b]..cut[k-1, b+1]-1. Dynamic programming over the last cut,
    each step one (n+1) x (n+1) tensor operation."""
    n = len(unit_len)
    K = max(1, min(max_buckets, n))
    zero = torch.zeros(1, dtype=torch.float64)
    rows = torch.cat([zero, unit_rows.double().cumsum(0)])      # (n+1,) rows of units 0..j-1
    prompt = torch.cat([zero, unit_prompt.double().cumsum(0)])  # (n+1,)
    end_len = torch.cat([zero, unit_len.double()])              # (n+1,) the longest of units ..j-1
    i, j = torch.arange(n + 1)[:, None], torch.arange(n + 1)[None, :]
    # cost of one forward over units i..j-1, inf where i >= j
    seg = (rows[None, :] - rows[:, None]) * end_len[None, :] + (prompt[None, :] - prompt[:, None])
    seg = seg.masked_fill(i >= j, float("inf"))
    best = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    best[0] = 0.0
    backs, costs = [], []
    for _ in range(K):
        total = best[:, None] + seg          # (i, j): the k-1 cut of 0..i-1, then one forward i..j-1
        best, back = total.min(0)
        backs.append(back)
        costs.append(best[n])
    cut = torch.zeros((K, K + 1), dtype=torch.long)
    for k in range(1, K + 1):
        at = n
        cut[k - 1, k] = at
        for b in range(k, 0, -1):
            at = int(backs[b - 1][at])
            cut[k - 1, b - 1] = at
    return torch.stack(costs), cut


# Above this many distinct lengths, `LengthCuts` rounds lengths up onto this many levels (its
# cost estimate only; the forwards still trim to their own rows).
_MAX_LEVELS = 256


class LengthCuts:
    """The rows of one minibatch cut into forwards of similar completion length.

    `best` is the bucket count that minimises the padded tokens (`bucket_costs`) plus
    `call_cost` tokens for each forward after the first (what a call's fixed overhead is worth
    in tokens), at most `max_buckets`; `buckets(k)` cuts into exactly k (under torchrun, the
    count every process agreed on: empty buckets where there are too few lengths). With
    `group_of` (N,) a group's rows stay in one forward, which runs their prompt once (prompt
    sharing); otherwise every row pays `prompt_len`. Rows of one length are never cut apart:
    that would only add a call."""

    def __init__(self, rows: torch.Tensor, lengths: torch.Tensor, *, call_cost: float, max_buckets: int,
                 prompt_len: int = 0, group_of: torch.Tensor | None = None):
        self.rows = rows
        if len(rows) == 0:
            self.best = 0
            return
        lens = lengths[rows]
        key = group_of[rows] if group_of is not None else torch.arange(len(rows))
        units, unit_of = torch.unique(key, return_inverse=True)
        u_len = torch.zeros(len(units), dtype=lens.dtype).scatter_reduce(0, unit_of, lens, "amax", include_self=False)
        u_rows = torch.bincount(unit_of, minlength=len(units))
        u_prompt = float(prompt_len) * (torch.ones(len(units)) if group_of is not None else u_rows.double())
        levels, level_of = torch.unique(u_len, sorted=True, return_inverse=True)
        if len(levels) > _MAX_LEVELS:  # coarser levels for the estimate
            step = -(-int(levels[-1]) // _MAX_LEVELS)
            levels, level_of = torch.unique((u_len + step - 1) // step * step, sorted=True, return_inverse=True)
        l_rows = torch.zeros(len(levels), dtype=torch.long).index_add_(0, level_of, u_rows)
        l_prompt = torch.zeros(len(levels), dtype=torch.float64).index_add_(0, level_of, u_prompt.double())
        self.cost, self.cut = bucket_costs(levels, l_rows, l_prompt, max_buckets)
        self.best = int((self.cost + call_cost * torch.arange(len(self.cost))).argmin()) + 1
        self.level_of_row = level_of[unit_of]  # (len(rows),)

    def buckets(self, k: int) -> list[torch.Tensor]:
        if self.best == 0:
            return [self.rows[:0]] * k
        kk = min(k, len(self.cost))
        out = []
        for b in range(kk):
            lo, hi = int(self.cut[kk - 1, b]), int(self.cut[kk - 1, b + 1])
            out.append(self.rows[(self.level_of_row >= lo) & (self.level_of_row < hi)])
        return out + [self.rows[:0]] * (k - kk)


def build_plan(minibatch_rows: list[torch.Tensor], lengths: torch.Tensor, *, live: torch.Tensor | None,
               micro_size: int, token_mean: bool, old_pass: bool, old_forward_size: int,
               gather: Gather, can_share=None, buckets: dict | None = None,
               loss_lengths: torch.Tensor | None = None) -> Plan:
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
    (None), which costs nothing where the processes need not agree. `buckets` (the keyword
    arguments of `LengthCuts`; None: no cut by length) cuts each minibatch's forward
    by length, or with `micro_size` sorts its rows by length before they are cut. `loss_lengths`
    (N,) are the tokens of each row in the loss where they are fewer than its `lengths` (an
    episode's tool replies are attended, not learned): the tokens and token-mean weights count them."""
    lengths = lengths.cpu()
    tok = lengths if loss_lengths is None else loss_lengths.cpu()
    if buckets is not None and not micro_size:  # cut by length, the count agreed by every process
        cuts = [LengthCuts(mb if live is None else mb[live[mb]], lengths, **buckets) for mb in minibatch_rows]
        want = torch.tensor([c.best for c in cuts], dtype=torch.float64)
        k = gather(want).view(-1, len(cuts)).max(0).values.long().tolist()  # the most any process wants
        kept = [c.buckets(max(kb, 1)) for c, kb in zip(cuts, k)]
        pieces = [[b if len(b) else mb[:1] for b in mb_kept] for mb, mb_kept in zip(minibatch_rows, kept)]
    else:  # fixed micro-batches (sorted by length first when cutting by length is on)
        order = minibatch_rows if buckets is None else [mb[lengths[mb].argsort(stable=True)] for mb in minibatch_rows]
        pieces = [list(mb.split(micro_size or max(len(mb), 1))) for mb in order]
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
    mine = ([float(tok[mb].sum()) for mb in minibatch_rows] + [float(len(p)) for mb in kept for p in mb]
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
            tokens = int(tok[rows].sum())
            weight = tokens / max(mb_tokens[k], 1) * world if token_mean else len(rows) / len(mb)
            micro.append(Micro(rows, weight, tokens, False, together))
        out.append(Minibatch(mb, micro, len(mb) * world))
    return Plan(out, old_forwards, live, old_share[:n_old])


def any_process(flag: float, all_reduce) -> float:
    """The largest value of `flag` over processes (a signal on one stops all)."""
    return all_reduce([float(flag)], "max")[0]
