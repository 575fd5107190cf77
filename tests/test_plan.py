"""gspo.train.plan: the per-rollout plan and the counts processes agree on, checked for several
simulated processes without starting any (build_plan is a pure function of their counts)."""

from __future__ import annotations

import torch

from gspo.train.plan import build_plan


def _plans(per_rank: list[dict], **common) -> list:
    """build_plan on every simulated process: a first call per process collects the vector it
    would send, a second gets all of them, as Dist.all_gather gives them."""
    sent = []
    for kw in per_rank:
        build_plan(**kw, **common, gather=lambda v: sent.append(v) or v[None])
    every = torch.stack(sent)
    return [build_plan(**kw, **common, gather=lambda v: every.flatten()) for kw in per_rank]


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
