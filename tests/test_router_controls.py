"""MoE router controls: the load-balancing loss (algo.router_aux_loss_coef) and the routers'
own learning rate (optim.router_lr_scale)."""

from __future__ import annotations

import json

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.models.logprobs import LogprobModule, prompt_share_plan
from gspo.models.routing import RouteTracker, find_routers
from gspo.train import train
from gspo.train.run import build_run
from test_routing import TINY, _grouped, moe  # noqa: F401  (the fixture: Qwen3-MoE, Mixtral, OLMoE)


def test_aux_loss_by_hand():
    """E = 2, k = 1, three tokens, one of them padding. Real tokens: probs (0.75, 0.25) and
    (0.5, 0.5) (logits 0 vs log 3, and equal), both pick expert 0 (a tie goes to the first).
    f = (2, 0) / 2 = (1, 0); P = (0.625, 0.375); loss = 2 * (1 * 0.625 + 0 * 0.375) = 1.25."""
    t = RouteTracker(torch.nn.Module())
    logits = torch.tensor([[torch.log(torch.tensor(3.0)), 0.0], [0.0, 0.0], [-5.0, 5.0]], requires_grad=True)
    idx = torch.tensor([[0], [0], [1]])
    t._add_aux(logits, idx, torch.tensor([[True, True, False]]), None)
    aux = t.take_aux()
    assert aux.item() == pytest.approx(1.25, abs=1e-6)
    aux.backward()  # d/dz of 2 * P_0 (the padded token gets none)
    assert logits.grad[2].abs().max() == 0 and logits.grad[0, 0] > 0
    assert t.take_aux() is None  # taken: the sums start again


def test_aux_loss_counts_a_shared_prompt_once_per_row():
    """A row standing for 3 (a prompt run once for its group of 3) weighs what 3 copies do."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * 4, 5, generator=g)
    idx = logits.topk(2, dim=-1).indices
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    t = RouteTracker(torch.nn.Module())
    t._add_aux(logits, idx, mask, (None, torch.tensor([0, 0, 0, 1])))  # rows 0-2 share prompt 0
    shared = t.take_aux()
    rep = torch.tensor([0, 0, 0, 1])
    t._add_aux(logits.view(2, 4, 5)[rep].reshape(-1, 5), idx.view(2, 4, 2)[rep].reshape(-1, 2), mask[rep], None)
    assert shared.item() == pytest.approx(t.take_aux().item(), rel=1e-6)


def test_aux_loss_equals_transformers_on_each_router_family(moe):  # noqa: F811
    """The tracker's loss over one forward equals transformers' own load_balancing_loss_func on
    that forward's router logits and attention mask, value and router gradients."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model, ids, mask = moe
    routers = find_routers(model)
    t = RouteTracker(model)
    t.aux = True
    with t.forward("compare", torch.arange(ids.shape[0]), 0, mask):
        out = model(ids, attention_mask=mask, output_router_logits=True)
    mine = t.take_aux()
    theirs = load_balancing_loss_func(out.router_logits, routers[0].num_experts, routers[0].top_k, mask)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-5)
    g_mine = torch.autograd.grad(mine, [r.weight for r in routers], retain_graph=True)
    g_theirs = torch.autograd.grad(theirs, [r.weight for r in routers])
    for a, b in zip(g_mine, g_theirs):
        assert b.abs().max() > 0 and torch.allclose(a, b, rtol=1e-4, atol=1e-8)
    with torch.no_grad(), t.forward("compare", torch.arange(ids.shape[0]), 0, mask):
        model(ids, attention_mask=mask)
    assert t.take_aux() is None  # a no-grad pass (pi_old, the reference) adds nothing


def test_aux_loss_is_the_same_through_a_shared_prompt_forward(moe):  # noqa: F811
    model, ids, mask = _grouped(moe)
    assert prompt_share_plan(ids, mask, 6) is not None
    values = []
    for share in (True, False):
        t = RouteTracker(model)
        t.aux = True
        with t.forward("compare", torch.arange(ids.shape[0]), 0, mask):
            LogprobModule(model, share_prompt=share)(ids, mask, 6)
        values.append(t.take_aux().item())
        t.close()
    assert values[0] == pytest.approx(values[1], rel=1e-6)


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_training_adds_the_aux_loss_to_the_loss(tmp_path):
    """Same seed, coefficient 0.5 against 0: the first minibatch (before any update) logs a loss
    larger by exactly 0.5 x routing/aux_loss, which is k (= 2) for a uniform load and more
    otherwise."""
    base = [*TINY, "schedule.rollouts=1", "schedule.num_minibatches=1"]
    plain = _metrics(train(load_config(None, [*base, f"output.dir={tmp_path}/a"])))[0]
    aux = _metrics(train(load_config(None, [*base, "algo.router_aux_loss_coef=0.5", f"output.dir={tmp_path}/b"])))[0]
    assert "routing/aux_loss" not in plain
    assert 2.0 <= aux["routing/aux_loss"] < 4.0
    assert aux["loss"] - plain["loss"] == pytest.approx(0.5 * aux["routing/aux_loss"], abs=1e-5)


def test_router_lr_scale_moves_the_routers_faster(tmp_path):
    """AdamW's first step moves every weight with a gradient by lr (m / sqrt(v) = sign(g)), so
    the largest change of a router weight is lr x the scale and of any other weight lr."""
    cfg = load_config(None, [*TINY, "schedule.rollouts=1", "schedule.num_minibatches=1", "optim.lr=1e-3",
                             "optim.router_lr_scale=8", f"output.dir={tmp_path}"])
    run = build_run(cfg)
    assert [g["lr"] for g in run.optimizer.param_groups] == [1e-3, 8e-3]
    before = {n: p.detach().clone() for n, p in run.policy.named_parameters()}
    train(cfg, run=run)
    router_names = {n for n, p in run.policy.named_parameters()
                    if any(p is q for r in find_routers(run.policy) for q in r.parameters())}
    assert len(router_names) == 2
    moved = {n: (p.detach() - before[n]).abs().max().item() for n, p in run.policy.named_parameters()}
    assert max(moved[n] for n in router_names) == pytest.approx(8e-3, rel=1e-3)
    assert max(v for n, v in moved.items() if n not in router_names) == pytest.approx(1e-3, rel=1e-3)


def test_router_controls_refuse_bad_values_and_dense_models(tmp_path):
    for bad in ("optim.router_lr_scale=0", "optim.router_lr_scale=-1", "algo.router_aux_loss_coef=-0.1",
                "algo.router_aux_loss_coef=nan"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [*TINY, bad])
    dense = [x for x in TINY if "moe" not in x]
    for field in ("optim.router_lr_scale=2", "algo.router_aux_loss_coef=0.01"):
        with pytest.raises(ConfigError, match=field.split("=")[0]):
            train(load_config(None, [*dense, field, f"output.dir={tmp_path}"]))


def test_a_run_with_router_controls_resumes_exactly(tmp_path):
    """Killed after rollout 2 and resumed: the routers' own AdamW group (its lr and moments)
    and the load-balancing loss give what the uninterrupted run gives, bit for bit, on a MoE
    whose pi_old and routes come from the sampler (R3)."""
    from test_resume import assert_same_run, gspo_train

    extra = ("tiny.moe=true", "tiny.num_experts=4", "optim.router_lr_scale=10", "algo.router_aux_loss_coef=0.1")
    gspo_train(tmp_path / "a", "run", *extra)
    p = gspo_train(tmp_path / "b", "run", *extra, faults="exit_after_rollout=2", check=False)
    assert p.returncode == 3
    gspo_train(tmp_path / "b", "run", *extra, "resume=auto")
    assert_same_run(tmp_path / "a" / "run", tmp_path / "b" / "run")
    aux = [r["routing/aux_loss"] for r in _metrics(tmp_path / "a" / "run") if r.get("routing/aux_loss") is not None]
    assert len(aux) >= 8


def test_router_controls_on_a_saved_mixtral_through_the_cli(tmp_path):
    """A user's MoE as they bring it: a Mixtral saved with save_pretrained, trained with
    `gspo train` and both router controls; the routers move 20x faster than the rest, the
    balancing loss is logged every step, and the final model loads back with from_pretrained."""
    from transformers import AutoModelForCausalLM

    from gspo.cli import main
    from gspo.models.tiny import build_char_tokenizer
    from test_routing import _hf_moe

    tok = build_char_tokenizer()
    src = tmp_path / "mixtral"
    _hf_moe("mixtral", len(tok)).save_pretrained(src)
    tok.save_pretrained(src)
    overrides = [x for x in TINY if not x.startswith("tiny.")]
    assert main(["train", *overrides, f"model.name_or_path={src}", "optim.lr=1e-3", "optim.router_lr_scale=20",
                 "algo.router_aux_loss_coef=0.05", f"output.dir={tmp_path}", "output.name=run"]) == 0
    recs = _metrics(tmp_path / "run")
    assert all(r["routing/aux_loss"] >= 2.0 for r in recs if r.get("rows/minibatch"))  # k = 2: 2 at a uniform load
    before = AutoModelForCausalLM.from_pretrained(src)
    after = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    moved = {n: (p - before.state_dict()[n]).abs().max().item() for n, p in after.state_dict().items()
             if n.endswith(("gate.weight", "q_proj.weight"))}
    router = max(v for n, v in moved.items() if n.endswith("gate.weight"))
    attention = max(v for n, v in moved.items() if n.endswith("q_proj.weight"))
    assert router > 5 * attention > 0
