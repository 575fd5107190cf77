"""gspo.train.plan: the per-rollout plan and the counts processes agree on, checked for several
simulated processes without starting any (build_plan is a pure function of their counts)."""

from __future__ import annotations

import pytest
import torch
from simulated_ranks import SimulatedRanks

from gspo.train.plan import LengthCuts, bucket_costs, build_plan


def _plans(per_rank: list[dict], **common) -> list:
    """build_plan on every simulated process, each in a thread, its all-gathers answered as
    Dist.all_gather would: every process's vector, once all have sent one."""
    ranks = SimulatedRanks(len(per_rank))
    return ranks.run(lambda r: build_plan(**per_rank[r], **common,
                                          gather=lambda v: torch.stack(ranks.exchange(r, v))))


def _rank(lengths, live=None, minibatches=((0, 1, 2, 3), (4, 5, 6, 7))):
    return dict(minibatch_rows=[torch.tensor(m) for m in minibatches], lengths=torch.tensor(lengths),
                live=None if live is None else torch.tensor(live, dtype=torch.bool))


def test_one_process_every_row_runs():
    (plan,) = _plans([_rank([3, 1, 4, 1, 5, 9, 2, 6])], micro_size=2, token_mean=False, old_pass=True,
                     old_forward_size=3)
    assert [len(mb.micro) for mb in plan.minibatches] == [2, 2]
    for mb in plan.minibatches:
        assert sum(m.weight for m in mb.micro) == 1.0  # 2/4 + 2/4: the minibatch mean over its sequences
        assert not any(m.placeholder for m in mb.micro) and mb.global_rows == 4
    assert [m.tokens for m in plan.minibatches[1].micro] == [5 + 9, 2 + 6]
    # π_old: rows 4..7 (the first minibatch's own forward is its π_old), shortest first, 3 a forward
    assert [f.tolist() for f in plan.old_forwards] == [[6, 4, 7], [5]]


def test_skipped_rows_placeholders_and_dropped_micro_batches():
    # process 0: rows 0, 1 (micro-batch 0 of minibatch 0) and 6, 7 have advantage 0;
    # process 1: rows 0, 1 too, and every row of minibatch 1
    lengths = [2] * 8
    p0, p1 = _plans([_rank(lengths, [0, 0, 1, 1, 1, 1, 0, 0]), _rank(lengths, [0, 0, 1, 1, 0, 0, 0, 0])],
                    micro_size=2, token_mean=False, old_pass=True, old_forward_size=2)
    # micro-batch (0, 1) has no row on either process: both drop it
    assert [m.rows.tolist() for m in p0.minibatches[0].micro] == [[2, 3]]
    assert [m.rows.tolist() for m in p1.minibatches[0].micro] == [[2, 3]]
    assert p0.minibatches[0].micro[0].weight == 2 / 4  # its share of the local minibatch, skipped rows counted
    # micro-batch (4, 5) runs on process 0 only: process 1 runs a placeholder at weight 0
    assert p0.minibatches[1].micro[0].rows.tolist() == [4, 5] and not p0.minibatches[1].micro[0].placeholder
    ph = p1.minibatches[1].micro[0]
    assert ph.placeholder and ph.weight == 0 and ph.tokens == 0 and ph.num_rows == 0 and len(ph.rows) == 1
    # micro-batch (6, 7): no row anywhere
    assert len(p0.minibatches[1].micro) == len(p1.minibatches[1].micro) == 1
    assert p0.minibatches[1].global_rows == 8
    # π_old: process 0 needs rows 4, 5 (one forward), process 1 none: it pads with a placeholder
    assert [f.tolist() for f in p0.old_forwards] == [[4, 5]] and p1.old_forwards == [None]


def test_a_minibatch_without_signal_anywhere_has_no_forward():
    (plan,) = _plans([_rank([1] * 8, [1, 1, 0, 0, 0, 0, 0, 0])], micro_size=0, token_mean=False, old_pass=False,
                     old_forward_size=4)
    assert len(plan.minibatches[0].micro) == 1 and plan.minibatches[1].micro == []
    assert plan.old_forwards == []


def test_token_mean_weights_are_shares_of_the_global_token_count():
    # minibatch 0 holds 3+1+4+1 = 9 tokens on process 0 and 2+2+2+2 = 8 on process 1: 17 in all;
    # the wrappers average gradients over the 2 processes, so each weight is tokens / 17 * 2
    p0, p1 = _plans([_rank([3, 1, 4, 1, 5, 9, 2, 6]), _rank([2] * 8, [1, 1, 1, 0, 1, 1, 1, 1])],
                    micro_size=2, token_mean=True, old_pass=False, old_forward_size=4)
    assert [m.weight for m in p0.minibatches[0].micro] == [4 / 17 * 2, 5 / 17 * 2]
    assert [m.weight for m in p1.minibatches[0].micro] == [4 / 17 * 2, 2 / 17 * 2]  # row 3 skipped, still counted
    total = sum(m.weight for p in (p0, p1) for m in p.minibatches[0].micro) / 2
    assert abs(total - 15 / 17) < 1e-15  # the skipped row's 2 tokens carry weight 0, the rest their share


def test_the_counts_go_in_one_collective():
    calls = []
    build_plan([torch.arange(4), torch.arange(4, 8)], torch.ones(8, dtype=torch.long),
               live=torch.ones(8, dtype=torch.bool), micro_size=1, token_mean=True, old_pass=True,
               old_forward_size=2, gather=lambda v: calls.append(v) or v[None])
    assert len(calls) == 1 and calls[0].dtype == torch.float64


def test_under_fsdp_a_forward_shares_its_prompts_only_where_every_process_can():
    # process 0 could share every forward; process 1 only those holding row 4 (its minibatch-1
    # piece (4, 5) and the π_old forward over it)
    kw = dict(micro_size=2, token_mean=False, old_pass=True, old_forward_size=2)
    ranks = [_rank([2] * 8), _rank([2] * 8)]
    sent = []
    for r, can in enumerate((lambda rows: True, lambda rows: 4 in rows.tolist())):
        build_plan(**ranks[r], **kw, gather=lambda v: sent.append(v) or v[None], can_share=can)
    every = torch.stack(sent)
    plans = [build_plan(**ranks[r], **kw, gather=lambda v: every.flatten(), can_share=can)
             for r, can in enumerate((lambda rows: True, lambda rows: 4 in rows.tolist()))]
    for p in plans:  # the same decision on both processes, forward by forward
        assert [m.share for mb in p.minibatches for m in mb.micro] == [False, False, True, False]
        assert p.old_share == [True, False]
    # one process, DDP: no can_share, so each forward decides for itself
    (alone,) = _plans([ranks[0]], **kw)
    assert all(m.share is None for mb in alone.minibatches for m in mb.micro) and alone.old_share == [None, None]


def test_bucket_costs_by_hand():
    # two rows of length 1 and two of length 10, no prompt: one forward pads all four to 10
    # (4 x 10 = 40 tokens); two forwards cost 2 x 1 + 2 x 10 = 22
    cost, cut = bucket_costs(torch.tensor([1, 10]), torch.tensor([2, 2]), torch.zeros(2), 8)
    assert cost.tolist() == [40.0, 22.0]
    assert cut[0, :2].tolist() == [0, 2] and cut[1].tolist() == [0, 1, 2]
    # a 5-token prompt on each row: + 4 x 5 = 20 in either cut
    cost, _ = bucket_costs(torch.tensor([1, 10]), torch.tensor([2, 2]), torch.full((2,), 10.0), 8)
    assert cost.tolist() == [60.0, 42.0]


def test_length_cuts_take_the_count_that_pays():
    rows, lengths = torch.arange(8), torch.tensor([5, 100, 3, 90, 4, 100, 2, 95])
    # one forward: 8 x 100 = 800; two: 4 x 5 + 4 x 100 = 420; three: 20 + 2 x 95 + 2 x 100 = 410;
    # four: 20 + 90 + 95 + 200 = 405. With 20 tokens a call: 800, 440, 450, 465 -> two forwards
    cuts = LengthCuts(rows, lengths, call_cost=20, max_buckets=4)
    assert cuts.best == 2
    assert [b.tolist() for b in cuts.buckets(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert LengthCuts(rows, lengths, call_cost=0, max_buckets=4).best == 4  # calls free: the most
    assert LengthCuts(rows, lengths, call_cost=1000, max_buckets=4).best == 1  # calls dear: one forward
    assert LengthCuts(rows, lengths, call_cost=0, max_buckets=2).best == 2     # capped
    # a forced count: every row once, in forwards of rising length; empty ones past the lengths
    forced = LengthCuts(rows[:3], lengths, call_cost=0, max_buckets=8).buckets(5)
    assert [b.tolist() for b in forced] == [[2], [0], [1], [], []]
    # rows of one length are never cut apart, whatever a call costs
    same = LengthCuts(rows, torch.full((8,), 7), call_cost=0, max_buckets=8)
    assert same.best == 1 and same.buckets(1)[0].tolist() == list(range(8))


def test_length_cuts_keep_a_groups_rows_together_when_it_shares_its_prompt():
    # groups {0,1} and {2,3}: lengths (1, 10) and (2, 9); 100-token prompts, run once a group.
    # Kept together, one forward costs 4 x 10 + 2 x 100 = 240 and the only cut is by group
    # (2 x 10 + 100 + 2 x 9 + 100 = 238). Rows on their own would cut (0, 2) from (1, 3).
    rows, lengths, groups = torch.arange(4), torch.tensor([1, 10, 2, 9]), torch.tensor([0, 0, 1, 1])
    shared = LengthCuts(rows, lengths, call_cost=0, max_buckets=4, prompt_len=100, group_of=groups)
    assert sorted(b.tolist() for b in shared.buckets(2)) == [[0, 1], [2, 3]]
    alone = LengthCuts(rows, lengths, call_cost=0, max_buckets=2, prompt_len=100)
    assert sorted(sorted(b.tolist()) for b in alone.buckets(2)) == [[0, 2], [1, 3]]


def test_processes_agree_on_the_count_of_forwards_cut_by_length():
    # process 0's minibatch 0 has lengths spread out, process 1's all alike: each runs the most
    # forwards any process wants (empty ones are placeholders), and every live row once
    buckets = dict(call_cost=0.0, max_buckets=4)
    spread, alike = _rank([1, 5, 20, 60, 3, 3, 3, 3]), _rank([4, 4, 4, 4, 9, 9, 9, 9], [1, 1, 1, 0, 1, 1, 1, 1])
    p0, p1 = _plans([spread, alike], micro_size=0, token_mean=False, old_pass=False, old_forward_size=4,
                    buckets=buckets)
    assert [len(mb.micro) for mb in p0.minibatches] == [len(mb.micro) for mb in p1.minibatches] == [4, 1]
    assert [m.rows.tolist() for m in p0.minibatches[0].micro] == [[0], [1], [2], [3]]
    mb0 = p1.minibatches[0].micro
    assert [m.placeholder for m in mb0] == [False, True, True, True] and mb0[0].rows.tolist() == [0, 1, 2]
    for p, live in ((p0, 8), (p1, 7)):
        ran = [r for mb in p.minibatches for m in mb.micro if not m.placeholder for r in m.rows.tolist()]
        assert sorted(ran) == sorted(set(ran)) and len(ran) == live
        for mb in p.minibatches:  # seq-mean weights: rows / the minibatch's rows, skipped ones counted
            assert sum(m.weight for m in mb.micro) == pytest.approx(sum(m.num_rows for m in mb.micro) / 4)
    # with a micro-batch size the rows are sorted by length, then cut: the same count of forwards
    (sorted_,) = _plans([spread], micro_size=2, token_mean=False, old_pass=False, old_forward_size=4, buckets=buckets)
    assert [m.rows.tolist() for m in sorted_.minibatches[0].micro] == [[0, 1], [2, 3]]
    assert [m.rows.tolist() for m in sorted_.minibatches[1].micro] == [[4, 5], [6, 7]]
