"""The update passes on one rollout: π_old's pass for the first minibatch, rows without signal
left out, micro-batches that change no metric, and where π_old's log-probs come from."""

from __future__ import annotations

import pytest

from gspo.config import load_config
from test_train import TINY, records, run


def _step_inputs(tmp_path, *extra):
    import torch

    from gspo.train.run import build_run
    from gspo.train import TrainerState, minibatches, produce

    cfg = load_config(None, [*TINY, "eval.enabled=false", "rollout.old_logp=trainer",
                             "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]",
                             "schedule.skip_zero_advantage=false", f"output.dir={tmp_path}", *extra])
    run = build_run(cfg)
    scored = produce(run, TrainerState())
    return run, scored.rollout, scored.advantages, minibatches(run, 0, scored.rollout.num_samples), TrainerState(), torch


def _plan(run, rollout, adv, state, old_rows=None):
    """The rollout's plan; with `old_rows`, its π_old pass runs exactly those rows (one forward)."""
    import dataclasses

    from gspo.train import make_plan

    plan = make_plan(run, rollout, adv, state)
    return plan if old_rows is None else dataclasses.replace(plan, old_forwards=[old_rows], old_share=[None])


def _update(run, rollout, old_logp, adv, state, plan):
    """Every minibatch step of the plan, as `learn` runs them."""
    from gspo.train import minibatch_step

    return [minibatch_step(run, rollout, old_logp, adv, mb, state, first=k == 0, skips=plan.skips)
            for k, mb in enumerate(plan.minibatches)]


def test_first_minibatch_forward_is_pi_old_for_its_rows(tmp_path):
    """old_logprobs skips the first minibatch; update fills it from its own pre-step forward,
    which must equal what the separate pi_old pass gives for those rows."""
    from gspo.train import old_logprobs

    ctx, rollout, adv, plan, state, torch = _step_inputs(tmp_path, "schedule.num_minibatches=2")
    full = old_logprobs(ctx, rollout, _plan(ctx, rollout, adv, state, torch.arange(rollout.num_samples)))
    part = old_logprobs(ctx, rollout, _plan(ctx, rollout, adv, state))
    assert (part[plan[0]] == 0).all() and torch.equal(part[plan[1]], full[plan[1]])
    steps = _update(ctx, rollout, part, adv, state, _plan(ctx, rollout, adv, state))
    mask = rollout.completion_mask.bool()
    torch.testing.assert_close(part[mask], full[mask], atol=1e-5, rtol=0)
    # its ratio is exactly 1: pi_theta = pi_old, bit for bit
    assert steps[0]["ratio/seq_min"] == steps[0]["ratio/seq_max"] == 1.0 and steps[0]["clip/seq_frac"] == 0.0
    ctx.close()


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_zero_advantage_rows_leave_the_passes_and_change_nothing(tmp_path, level):
    """schedule.skip_zero_advantage: rows with A = 0 run in neither the pi_old pass nor the
    update, and the update is the same: losses, gradient norms, parameters. The second minibatch
    is all zeros: it still takes its AdamW step (zero gradient, momentum from the first)."""
    from gspo.train import old_logprobs

    results = []
    for skip in (False, True):
        ctx, rollout, adv, plan, state, torch = _step_inputs(
            tmp_path / str(skip), "schedule.num_minibatches=2", "optim.lr=0.05", f"algo.level={level}",
            f"schedule.skip_zero_advantage={str(skip).lower()}")
        adv = adv.clone()
        adv[plan[1]] = 0.0  # a whole minibatch without signal
        adv[plan[0][::2]] = 0.0  # and half of the other
        assert (adv[plan[0]] != 0).any()
        ran = []
        h = ctx.trainer.register_forward_hook(lambda m, a, o: ran.append(a[0].shape[0]))
        the_plan = _plan(ctx, rollout, adv, state)
        steps = _update(ctx, rollout, old_logprobs(ctx, rollout, the_plan), adv, state, the_plan)
        h.remove()
        params = {k: p.detach().clone() for k, p in ctx.policy.named_parameters()}
        results.append((steps, params, ran))
        ctx.close()
    (full, p_full, ran_full), (skipped, p_skip, ran_skip) = results
    assert sum(ran_skip) == int((adv[plan[0]] != 0).sum()) < sum(ran_full)  # only the signal rows ran
    assert skipped[0]["rows/skipped_frac"] == pytest.approx(1 - (adv[plan[0]] != 0).float().mean().item())
    assert skipped[1]["rows/skipped_frac"] == 1.0 and "rows/skipped_frac" not in full[0]
    for a, b in zip(full, skipped):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-8)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-8)
    assert full[1]["grad_norm"] == 0.0  # no signal: a zero gradient, yet the parameters move
    for k in p_full:
        torch.testing.assert_close(p_skip[k], p_full[k], rtol=0, atol=1e-6, msg=k)


def test_on_policy_schedule_runs_no_separate_pi_old_pass(tmp_path):
    from gspo.train import old_logprobs

    ctx, rollout, adv, plan, state, torch = _step_inputs(tmp_path, "schedule.num_minibatches=1")
    calls = []
    h = ctx.trainer.register_forward_hook(lambda *a: calls.append(1))
    out = old_logprobs(ctx, rollout, _plan(ctx, rollout, adv, state))
    h.remove()
    assert calls == [] and (out == 0).all()
    ctx.close()


def test_micro_batches_combine_token_and_extreme_metrics_exactly(tmp_path):
    """Splitting a minibatch into micro-batches of uneven lengths (row by row, sorted pairs, or
    cut by length) changes no metric and no update: token fractions are token-weighted, ratio
    min / max are the min / max (not averages)."""
    import dataclasses

    from gspo.train import old_logprobs

    results, forwards, params = [], [], []
    settings = [("schedule.micro_batch_size=0", "schedule.length_buckets=1"),  # one forward a minibatch
                ("schedule.micro_batch_size=1", "schedule.length_buckets=1"),  # one a row
                ("schedule.micro_batch_size=2", "schedule.length_buckets=8"),  # pairs of rows sorted by length
                # cut by length (a call made cheap, so that the tiny model's minibatch is cut)
                ("schedule.micro_batch_size=0", "schedule.length_buckets=8", "model.share_prompt_min_work=1e3",
                 "model.share_prompt=false")]  # (sharing would keep each group, lengths 1..4, together)
    for i, extra in enumerate(settings):
        ctx, rollout, adv, plan, state, torch = _step_inputs(
            tmp_path / str(i), "schedule.num_minibatches=2", *extra, "optim.lr=0.05")
        lengths = torch.arange(rollout.num_samples) % rollout.completion_ids.shape[1] + 1  # 1..T, uneven
        keep = (torch.arange(rollout.completion_ids.shape[1])[None, :] < lengths[:, None]).long()
        rollout = dataclasses.replace(rollout, completion_mask=rollout.completion_mask * keep)
        the_plan = _plan(ctx, rollout, adv, state)
        forwards.append([len(mb.micro) for mb in the_plan.minibatches])
        results.append(_update(ctx, rollout, old_logprobs(ctx, rollout, the_plan), adv, state, the_plan))
        params.append(torch.cat([p.detach().flatten() for p in ctx.policy.parameters()]))
        ctx.close()
    whole = results[0]
    assert forwards[0] == [1, 1] and forwards[1] == [8, 8] and forwards[2] == [4, 4]
    assert all(1 < n < 8 for n in forwards[3]), forwards[3]  # cut by length, not row by row
    for split, theta in zip(results[1:], params[1:]):
        for k in ("clip/token_frac", "kl/approx", "ratio/seq_min", "ratio/seq_max", "clip/seq_frac", "loss"):
            assert split[1][k] == pytest.approx(whole[1][k], rel=1e-4, abs=1e-7), k  # step 2 follows a step
        assert split[1]["ratio/seq_min"] < split[1]["ratio/seq_max"]  # the second step is off-policy
        assert torch.allclose(theta, params[0], rtol=1e-4, atol=1e-6)  # the same update, however it is cut


@pytest.mark.parametrize("extra,has_routers,want", [
    ([], False, "sampler"),                                   # hf, fp32: the sampler's numbers are the trainer's
    ([], True, "sampler"),                                    # MoE: gspo's decode loop records the routes (R3)
    (["rollout.decode=generate"], True, "trainer"),           # ... transformers' generate cannot: the pass does
    (["rollout.decode=generate"], False, "sampler"),
    (["rollout.tools=[gspo.tool_tasks:calc]"], True, "trainer"),  # a tool's reply tokens: no sampler runs them
    (["rollout.tools=[gspo.tool_tasks:calc]"], False, "sampler"),
    (["rollout.mode=async", "rollout.tools=[gspo.tool_tasks:calc]"], True, "trainer"),
    (["rollout.mode=async"], True, "sampler"),
    (["model.mixed_precision=bf16"], False, "trainer"),
    (["model.dtype=bfloat16"], False, "trainer"),
    (["lora.enabled=true"], False, "sampler"),                # dropout off: the sampler's numbers still
    (["model.dropout=true"], False, "trainer"),               # dropout in the trainer's passes
    (["lora.enabled=true", "lora.dropout=0.1", "model.dropout=true"], False, "trainer"),
    (["rollout.backend=vllm"], False, "trainer"),
    (["algo.routing_replay=true"], False, "sampler"),          # the sampler's routes are replayed
    (["algo.routing_replay=true", "rollout.decode=generate"], False, "trainer"),
    (["rollout.old_logp=trainer"], False, "trainer"),
    (["rollout.old_logp=sampler"], True, "sampler"),
])
def test_old_logp_auto_resolution(extra, has_routers, want):
    from gspo.train.run import resolve_old_logp

    assert resolve_old_logp(load_config(None, [*TINY, *extra]), has_routers=has_routers) == want


def test_default_dense_run_uses_sampler_logp_and_monitors_the_gap(tmp_path):
    rc, run_dir = run(tmp_path, "eval.enabled=false", "schedule.skip_zero_advantage=false")  # (all rewards 0)
    assert rc == 0
    for rec in records(run_dir):
        assert rec["mismatch/token_abs_max"] < 1e-5  # same weights, same precision: rounding only


@pytest.mark.parametrize("case", ["grpo-token-mean-mis", "gspo-mis-truncated", "cispo-mis-sequence"])
def test_what_mis_and_overlong_filtering_drop_changes_no_update_or_metric_however_it_is_cut(tmp_path, case):
    """MIS (IcePop) drops tokens or sequences whose pi_old / pi_sampler is out of range, and
    algo.mask_truncated drops completions cut by the length limit. Neither may make the update or
    a metric depend on how a minibatch is cut into forwards: a forward's token-mean used to divide
    by the tokens it kept while the plan weighted it by all it held (GRPO token-mean + MIS:
    gradients 12-72% apart), and means over sequences were weighted by rows, masked or not."""
    import dataclasses

    from gspo.train import old_logprobs

    extra = {"grpo-token-mean-mis": ["algo.level=token", "algo.aggregation=token-mean"],
             "gspo-mis-truncated": ["algo.mask_truncated=true"],
             "cispo-mis-sequence": ["algo.objective=cispo", "algo.level=token", "algo.mismatch_level=sequence"]}[case]
    results, params = [], []
    for i, micro in enumerate((0, 1, 2)):
        ctx, rollout, adv, plan, state, torch = _step_inputs(
            tmp_path / str(i), "schedule.num_minibatches=2", f"schedule.micro_batch_size={micro}",
            "schedule.length_buckets=1", "algo.mismatch_correction=mis", "algo.mismatch_floor=0.97",
            "algo.mismatch_cap=1.03", "optim.lr=0.05", *extra)
        n, T = rollout.completion_ids.shape
        g = torch.Generator().manual_seed(0)  # a sampler 3-10% off pi_old on some tokens: MIS drops those
        noise = (torch.rand(n, T, generator=g) < 0.4) * 0.1 * torch.randn(n, T, generator=g)
        lengths = torch.arange(n) % T + 1  # uneven lengths, so forwards keep uneven shares
        keep = (torch.arange(T)[None, :] < lengths[:, None]).long()
        finish = ["length" if k % 3 == 0 else "eos" for k in range(n)]  # (truncated rows: mask_truncated's)
        rollout = dataclasses.replace(rollout, completion_mask=rollout.completion_mask * keep, finish_reason=finish,
                                      sampler_logp=rollout.sampler_logp + noise * rollout.completion_mask)
        the_plan = _plan(ctx, rollout, adv, state)
        results.append(_update(ctx, rollout, old_logprobs(ctx, rollout, the_plan), adv, state, the_plan))
        params.append(torch.cat([p.detach().flatten() for p in ctx.policy.parameters()]))
        ctx.close()
    whole = results[0]
    assert 0 < whole[0]["mismatch_is/masked_frac"] < 1, whole[0]  # MIS dropped some, not all
    for split, theta in zip(results[1:], params[1:]):
        for step in (0, 1):
            for k in ("loss", "clip/token_frac", "clip/seq_frac", "kl/approx", "ratio/seq_mean", "ratio/seq_min",
                      "ratio/seq_max", "mismatch_is/masked_frac", "mismatch_is/weight_mean", "mismatch_is/weight_max",
                      "completion/len_mean"):
                assert split[step][k] == pytest.approx(whole[step][k], rel=1e-4, abs=1e-6), (step, k)
        assert torch.allclose(theta, params[0], rtol=0, atol=1e-4)  # the same update, however it is cut


def test_mis_at_the_token_level_is_icepops_token_mean():
    """IcePop's objective, 1 / sum_i |y_i| * sum_i sum_t M_it * min(r A, clip(r) A): a token MIS
    drops leaves the sum and stays in the count (`algo.apply_keep`); at the sequence levels it
    leaves the sequence's ratio instead."""
    import torch

    from gspo import algo

    g = torch.Generator().manual_seed(1)
    B, T = 4, 5
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 4, 2])[:, None]
    old = -torch.rand(B, T, generator=g)
    logp, sampler = old + 0.05 * torch.randn(B, T, generator=g), old + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    w, keep, _ = algo.mismatch_weights(old, sampler, mask, method="mis", level="token", cap=1.2, floor=0.8,
                                       max_log_ratio=20.0)
    assert (keep != mask).any() and keep.any()
    weights, m = algo.apply_keep(w, keep, mask, "token")
    loss, _ = algo.policy_loss(logp, old, adv, m, weights=weights, level="token", eps_low=0.2, eps_high=0.28,
                               aggregation="token-mean", max_log_ratio=20.0)
    r = (logp - old).exp()
    by_hand = torch.minimum(r * adv[:, None], r.clamp(0.8, 1.28) * adv[:, None])
    assert loss.item() == pytest.approx(-(by_hand * keep).sum().item() / mask.sum().item(), rel=1e-6)
    _, m_seq = algo.apply_keep(w, keep, mask, "sequence")
    assert torch.equal(m_seq, mask & keep)


def test_a_step_with_every_row_skipped_logs_the_mismatch_keys_as_null(tmp_path):
    """Every group has equal rewards (a random model scores 0 on arithmetic): no row runs, and the
    correction's keys are null, as clip/* and ratio/* are (they were left out of such steps)."""
    import json

    rc, run_dir = run(tmp_path, "eval.enabled=false", "rollout.old_logp=trainer", "algo.mismatch_correction=mis",
                      "schedule.rollouts=1")
    assert rc == 0
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert steps and all(s["rows/skipped_frac"] == 1.0 for s in steps)
    assert all("mismatch_is/masked_frac" in s and s["mismatch_is/masked_frac"] is None for s in steps)
