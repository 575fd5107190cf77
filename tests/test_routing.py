"""MoE routing: route capture, routing/changed_frac, Routing Replay, and the sampler-trainer
mismatch monitor (issue 6)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.models.logprobs import LogprobModule
from gspo.models.routing import RouteTracker, find_routers
from gspo.models.tiny import build_char_tokenizer, build_tiny_model
from gspo.train import train


def _hf_moe(arch: str, vocab: int):
    """A tiny Mixtral (renormalised top-k gates) or OLMoE (un-renormalised gates) from a config:
    the same router contract as Qwen3-MoE, with the other gate-weight rule for OLMoE."""
    from transformers import MixtralConfig, MixtralForCausalLM, OlmoeConfig, OlmoeForCausalLM

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=2, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(num_local_experts=4, **common)).eval()
    return OlmoeForCausalLM(OlmoeConfig(num_experts=4, **common)).eval()


@pytest.fixture(params=["qwen3_moe", "mixtral", "olmoe"])
def moe(request):
    tok = build_char_tokenizer()
    if request.param == "qwen3_moe":
        model = build_tiny_model(tok, hidden_size=32, num_layers=2, moe=True, seed=0)
    else:
        model = _hf_moe(request.param, len(tok))
    ids = torch.randint(4, len(tok), (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row: padded tokens are not counted
    return model, ids, mask


def _pass(tracker, lp, ids, mask, mode, replay=False):
    with tracker.forward(mode, torch.arange(ids.shape[0]), 0, mask, replay=replay):
        return lp(ids, mask, 4)


def _record_used(router):
    """The experts a router's output finally carries (after the tracker's hook)."""
    used = []
    h = router.register_forward_hook(lambda m, a, out: used.append(out[2].clone()))
    return used, h


def test_routers_found_on_moe_only(moe):
    model, _, _ = moe
    assert len(find_routers(model)) == 2
    dense = build_tiny_model(build_char_tokenizer(), hidden_size=32, num_layers=2, seed=0)
    assert find_routers(dense) == [] and not RouteTracker(dense).active


def test_changed_frac_zero_when_unchanged_and_positive_after_router_moves(moe):
    model, ids, mask = moe
    tracker, lp = RouteTracker(model), LogprobModule(model)
    tracker.reset(*ids.shape, ids.device)
    with torch.no_grad():
        _pass(tracker, lp, ids, mask, "capture")
        _pass(tracker, lp, ids, mask, "compare")
    m = tracker.take_metrics(per_layer=True)
    assert m["routing/changed_frac"] == 0.0 and m["routing/changed_frac/layer_1"] == 0.0
    real = mask.bool().clone()
    real[:, -1] = False  # the last token predicts nothing: it is not run
    assert (tracker.routes[real] >= 0).all() and (tracker.routes[~real] == -1).all()  # nor is padding
    with torch.no_grad():
        for r in find_routers(model):
            r.weight.add_(torch.randn_like(r.weight) * 5.0)
        _pass(tracker, lp, ids, mask, "compare")
    m = tracker.take_metrics()
    assert 0.0 < m["routing/changed_frac"] <= 1.0
    assert math.isnan(tracker.take_metrics()["routing/changed_frac"])  # counters were reset: nothing compared


def test_replay_uses_pi_old_experts_and_router_still_gets_gradients(moe):
    model, ids, mask = moe
    tracker, lp = RouteTracker(model), LogprobModule(model)
    tracker.reset(*ids.shape, ids.device)
    routers = find_routers(model)
    with torch.no_grad():
        _pass(tracker, lp, ids, mask, "capture")
        for r in routers:
            r.weight.add_(torch.randn_like(r.weight) * 5.0)
    used, h = _record_used(routers[0])
    out = _pass(tracker, lp, ids, mask, "compare", replay=True)
    h.remove()
    run = mask[:, :-1].bool()  # the tokens run: all but the last column
    real = run.reshape(-1)
    assert torch.equal(used[0][real].long(), tracker.routes[:, :-1, 0][run].long())
    assert tracker.take_metrics()["routing/changed_frac"] > 0  # the natural choice did change
    out.sum().backward()
    assert routers[0].weight.grad is not None and routers[0].weight.grad.abs().sum() > 0
    # without replay, the moved router picks other experts
    used2, h = _record_used(routers[0])
    with torch.no_grad():
        _pass(tracker, lp, ids, mask, "compare", replay=False)
    h.remove()
    assert not torch.equal(used2[0][real].long(), used[0][real].long())


def test_replay_with_unchanged_router_changes_nothing(moe):
    model, ids, mask = moe
    tracker, lp = RouteTracker(model), LogprobModule(model)
    tracker.reset(*ids.shape, ids.device)
    with torch.no_grad():
        a = _pass(tracker, lp, ids, mask, "capture")
        b = _pass(tracker, lp, ids, mask, "compare", replay=True)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)  # gate weights recomputed identically



def _grouped(moe):
    """Two prompts (one left-padded) × 3 completions each, so that a shared forward runs each
    prompt once: (model, ids (6, 14), mask)."""
    model, _, _ = moe
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompts = torch.randint(4, vocab, (2, 8), generator=g).repeat_interleave(3, 0)
    ids = torch.cat([prompts, torch.randint(4, vocab, (6, 6), generator=g)], 1)
    mask = torch.ones_like(ids)
    mask[3:, :2] = 0  # the second prompt is 6 tokens, left-padded
    mask[1, -2:] = 0  # a completion that ended early
    return model, ids, mask


def _grouped_pass(tracker, lp, ids, mask, mode, replay=False):
    with tracker.forward(mode, torch.arange(ids.shape[0]), 0, mask, replay=replay):
        return lp(ids, mask, 6)


def test_shared_prompt_forward_records_and_compares_the_same_routes(moe):
    """With model.share_prompt, each prompt runs once for its group: the routes recorded for
    every row and the changed fraction equal those of the unshared forward."""
    from gspo.models.logprobs import prompt_share_plan

    model, ids, mask = _grouped(moe)
    assert prompt_share_plan(ids, mask, 6) is not None  # the shared path does run
    shared, plain = LogprobModule(model, share_prompt=True), LogprobModule(model, share_prompt=False)
    calls = []
    hook = find_routers(model)[0].register_forward_hook(lambda m, a, out: calls.append(out[2].shape[0]))
    tracker = RouteTracker(model)
    tracker.reset(*ids.shape, ids.device)
    with torch.no_grad():
        _grouped_pass(tracker, lp=shared, ids=ids, mask=mask, mode="capture")
    hook.remove()
    assert calls[-2:] == [2 * 8, 6 * 5]  # the 2 prompts once (8 columns), then the completions
    assert 6 * 13 not in calls  # (before them, only the one-off head check)
    routes_shared = tracker.routes.clone()
    tracker.reset(*ids.shape, ids.device)
    with torch.no_grad():
        _grouped_pass(tracker, lp=plain, ids=ids, mask=mask, mode="capture")
    assert torch.equal(tracker.routes, routes_shared)  # the same record, every row's prompt included
    real = mask.bool().clone()
    real[:, -1] = False  # the last token is never fed
    assert (routes_shared[real] >= 0).all() and (routes_shared[~real] == -1).all()
    with torch.no_grad():
        for r in find_routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(3)) * 5.0)
        _grouped_pass(tracker, lp=shared, ids=ids, mask=mask, mode="compare")
        a = tracker.take_metrics(per_layer=True)
        _grouped_pass(tracker, lp=plain, ids=ids, mask=mask, mode="compare")
        b = tracker.take_metrics(per_layer=True)
    assert a["routing/changed_frac"] > 0
    assert a == pytest.approx(b, rel=1e-12)  # prompt tokens counted once per row, as unshared


def test_replay_through_a_shared_prompt_forward_equals_unshared_replay(moe):
    """Routing Replay on a shared forward: the prompt run once takes its group's π_old experts;
    log-probs and every gradient equal the unshared replay."""
    model, ids, mask = _grouped(moe)
    tracker = RouteTracker(model)
    tracker.reset(*ids.shape, ids.device)
    with torch.no_grad():
        _grouped_pass(tracker, LogprobModule(model, share_prompt=True), ids, mask, "capture")
        for r in find_routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(4)) * 5.0)
    results = []
    for share in (True, False):
        model.zero_grad()
        out = _grouped_pass(tracker, LogprobModule(model, share_prompt=share), ids, mask, "compare", replay=True)
        (out * torch.linspace(-1, 1, 6)).sum().backward()
        results.append((out.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
        tracker.take_metrics()
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert ga.keys() == gb.keys() and any("gate" in k or "router" in k for k in ga)
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=0, atol=1e-5, msg=k)
    # without replay the moved routers would pick other experts: replay did act
    with torch.no_grad():
        natural = _grouped_pass(tracker, LogprobModule(model, share_prompt=True), ids, mask, "compare")
    assert not torch.allclose(natural, a, atol=1e-4)

TINY = ["tiny.hidden_size=32", "tiny.num_layers=2", "tiny.moe=true", "data.num_prompts=8",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=4", "schedule.rollouts=2",
        "schedule.num_minibatches=2", "eval.enabled=false", "logging.console=false", "optim.lr=1e-2",
        "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]"]


def _metrics(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("extra", [[], ["algo.level=token", "algo.routing_replay=true"]])
def test_training_logs_routing_change(tmp_path, extra):
    run = train(load_config(None, [*TINY, *extra, "logging.routing_per_layer=true", f"output.dir={tmp_path}"]))
    m = _metrics(run)
    assert m[0]["routing/changed_frac"] == 0.0  # first minibatch: pi_theta = pi_old
    assert m[1]["routing/changed_frac"] > 0 and "routing/changed_frac/layer_1" in m[1]


def test_sampler_as_pi_old_logs_mismatch_of_zero_for_the_same_model(tmp_path):
    run = train(load_config(None, [*TINY, "rollout.old_logp=sampler", f"output.dir={tmp_path}"]))
    for rec in _metrics(run):
        assert rec["mismatch/token_abs_max"] < 1e-5 and abs(rec["mismatch/kl"]) < 1e-8


@pytest.mark.parametrize("extra", [[], ["algo.level=token", "algo.routing_replay=true"]])
def test_sync_moe_takes_pi_old_and_routes_from_the_sampler(tmp_path, extra):
    """rollout.old_logp=auto on a MoE: gspo's decode loop records the routes as it samples (R3),
    so there is no pi_old pass, and the run trains what the trainer's pass trains: the sampler's
    log-probs and routes are the trainer's numbers (fp32, the same weights)."""
    from gspo.train.run import build_run

    runs = {}
    for old in ("auto", "trainer"):
        cfg = load_config(None, [*TINY, *extra, f"rollout.old_logp={old}", f"output.dir={tmp_path}/{old}"])
        run = build_run(cfg)
        assert run.old_logp == ("sampler" if old == "auto" else "trainer")
        assert (run.generator.routes is not None) == (old == "auto")
        runs[old] = _metrics(train(cfg, run=run))
    auto, trainer = runs["auto"], runs["trainer"]
    assert len(auto) == len(trainer) == 4
    for a, t in zip(auto, trainer):
        assert a["loss"] == pytest.approx(t["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-4)
        if t["routing/changed_frac"] is not None:  # (null: no row of the minibatch had signal)
            # the same up to each row's last token, which R3 leaves out (the sampler never ran it)
            assert a["routing/changed_frac"] == pytest.approx(t["routing/changed_frac"], rel=0.03)
    assert auto[1]["routing/changed_frac"] > 0
    assert auto[0]["time/old_logp"] < trainer[0]["time/old_logp"]


def test_tiny_moe_shape_from_the_config(tmp_path):
    from gspo.train.run import build_policy

    model, _ = build_policy(load_config(None, [*TINY, "tiny.num_experts=6", "tiny.experts_per_tok=3"]))
    routers = find_routers(model)
    assert len(routers) == 2 and all(r.num_experts == 6 and r.top_k == 3 for r in routers)
    with pytest.raises(ConfigError, match="tiny.experts_per_tok"):
        load_config(None, [*TINY, "tiny.num_experts=2", "tiny.experts_per_tok=3"])


def test_replay_needs_the_trainer_pass_and_a_moe_model(tmp_path):
    with pytest.raises(ConfigError, match="algo.routing_replay"):  # generate records no routes
        load_config(None, [*TINY, "algo.routing_replay=true", "rollout.old_logp=sampler", "rollout.decode=generate"])
    with pytest.raises(ConfigError, match="algo.routing_replay"):  # a tool's reply has no sampler route
        load_config(None, [*TINY, "algo.routing_replay=true", "rollout.old_logp=sampler",
                           "rollout.tools=[gspo.tool_tasks:calc]"])
    dense = [x for x in TINY if "moe" not in x]
    with pytest.raises(ConfigError, match="no MoE routers"):
        train(load_config(None, [*dense, "algo.routing_replay=true", f"output.dir={tmp_path}"]))


def test_a_moe_whose_routers_gspo_cannot_hook_is_named_as_one(tmp_path):
    """JetMoE's experts are routed by a module that is not transformers' TopKRouter: the error says
    the model is a MoE whose routers gspo cannot hook, not that it has none."""
    import transformers as T

    from gspo.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    model = T.JetMoeForCausalLM(T.JetMoeConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                               num_key_value_heads=2, kv_channels=8, intermediate_size=32,
                                               num_local_experts=4, num_experts_per_tok=2))
    model.save_pretrained(tmp_path / "jetmoe")
    tok.save_pretrained(tmp_path / "jetmoe")
    with pytest.raises(ConfigError, match=r"algo.routing_replay.*finds no router it can hook in this MoE \(JetMoe"):
        train(load_config(None, [f"model.name_or_path={tmp_path / 'jetmoe'}", "algo.routing_replay=true",
                                 f"output.dir={tmp_path}", "rollout.prompts_per_step=2"]))
    # nor can transformers checkpoint its layers: one error naming the field, at start-up
    with pytest.raises(ConfigError, match=r"'model.gradient_checkpointing': JetMoeForCausalLM does not support"):
        train(load_config(None, [f"model.name_or_path={tmp_path / 'jetmoe'}", "model.gradient_checkpointing=true",
                                 f"output.dir={tmp_path}", "rollout.prompts_per_step=2"]))


def test_moe_stability_reproduction_quick(tmp_path):
    """The reproduction script end to end at its smallest: 3 algorithms, a table and a report."""
    from script_module import load_script

    mod = load_script("examples/moe_stability/run.py", "moe_stability_run")
    results = mod.main(["--quick", "--out", str(tmp_path)])
    assert [r["algo"] for r in results] == ["gspo", "grpo", "grpo_replay"]
    # every run finishes: replay on the warmed-up model loaded from disk, whose rows end at EOS
    # at different lengths (a row's last token runs in some forwards and not in others)
    assert [r["status"] for r in results] == ["ok"] * 3, results
    table = (tmp_path / "table.md").read_text()
    assert "grpo_replay" in table and "routing change" in table
    assert (tmp_path / "report" / "report.html").is_file()


def test_training_on_a_saved_mixtral_logs_routes_and_replays(tmp_path):
    """The whole loop on a second architecture loaded with from_pretrained: routes are
    captured and compared, and replay runs (its gate-weight rule checked against Mixtral's)."""
    tok = build_char_tokenizer()
    model = _hf_moe("mixtral", len(tok))
    model.save_pretrained(tmp_path / "mixtral")
    tok.save_pretrained(tmp_path / "mixtral")
    overrides = [x for x in TINY if not x.startswith("model.")]
    run = train(load_config(None, [*overrides, f"model.name_or_path={tmp_path / 'mixtral'}", "algo.level=token",
                                   "algo.routing_replay=true", f"output.dir={tmp_path}"]))
    m = _metrics(run)
    # the first minibatch's routes are its own; some later step sees routes the updates moved
    # (a step whose groups all got equal rewards has no gradient and moves nothing)
    assert m[0]["routing/changed_frac"] == 0.0 and max(x["routing/changed_frac"] for x in m[1:]) > 0


def _deepseek_v3(vocab: int):
    """A tiny DeepSeek-V3 (`DeepseekV3TopkRouter`: sigmoid scores, expert groups, a scaling
    factor): every layer MoE, 4 experts in 2 groups, top-2."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                           first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=4,
                           qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=64, eos_token_id=1,
                           pad_token_id=0, bos_token_id=None)
    return DeepseekV3ForCausalLM(cfg).eval()


def _tracked(model, vocab: int, router: str | None = None):
    """A route tracker and a log-prob module on `model`, and a batch of 4 rows x 10 tokens (row 0
    left-padded by 3): (routers, tracker, lp, ids, mask); `router`: the class every one of the
    model's 2 routers must be."""
    routers = find_routers(model)
    if router is not None:
        assert [type(r).__name__ for r in routers] == [router] * 2
    ids = torch.randint(4, vocab, (4, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    tracker, lp = RouteTracker(model), LogprobModule(model)
    tracker.reset(*ids.shape, ids.device)
    return routers, tracker, lp, ids, mask


def test_deepseek_v3_routes_are_tracked_and_softmax_only_rules_refused():
    """The DeepSeek-V3 line spells its router `*TopkRouter`, with the same (logits, weights,
    experts) output: its routes are recorded and compared. Replay's gate-weight rule and the
    Switch load-balancing loss are softmax ones, which its sigmoid gates are not: both refused."""
    tok = build_char_tokenizer()
    routers, tracker, lp, ids, mask = _tracked(_deepseek_v3(len(tok)), len(tok), "DeepseekV3TopkRouter")
    with torch.no_grad():
        _pass(tracker, lp, ids, mask, "capture")
        _pass(tracker, lp, ids, mask, "compare")
        assert tracker.take_metrics()["routing/changed_frac"] == 0.0
        for r in routers:
            r.weight.add_(torch.randn_like(r.weight) * 5.0)
        _pass(tracker, lp, ids, mask, "compare")
    assert 0.0 < tracker.take_metrics()["routing/changed_frac"] <= 1.0
    with torch.no_grad(), pytest.raises(ConfigError, match="'algo.routing_replay': DeepseekV3TopkRouter computes gate"):
        _pass(tracker, lp, ids, mask, "compare", replay=True)
    tracker.aux = True
    with pytest.raises(ConfigError, match="'algo.router_aux_loss_coef': DeepseekV3TopkRouter does not gate with a"):
        _pass(tracker, lp, ids, mask, "compare")


def _llama4(vocab: int):
    """A tiny Llama 4 text model: every layer a MoE of 4 experts, top-1, whose `Llama4Router`
    (an nn.Linear subclass) returns (scores (n, E), logits (n, E))."""
    from archs import build_arch

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    return build_arch("llama4", vocab, tok).eval()


def test_llama4_routes_are_tracked_replayed_with_its_sigmoid_gates_and_the_softmax_loss_refused():
    tok = build_char_tokenizer()
    routers, tracker, lp, ids, mask = _tracked(_llama4(len(tok)), len(tok), "Llama4Router")
    with torch.no_grad():
        a = _pass(tracker, lp, ids, mask, "capture")
        b = _pass(tracker, lp, ids, mask, "compare", replay=True)  # unchanged router: the same log-probs
        assert tracker.take_metrics()["routing/changed_frac"] == 0.0
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    run = mask[:, :-1].bool()
    assert (tracker.routes[:, :-1][run] >= 0).all() and (tracker.routes[~mask.bool()] == -1).all()
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn_like(r.weight) * 5.0)
    used = []  # the experts the router's output finally gates (after the tracker's hook)
    h = routers[0].register_forward_hook(lambda m, args, out: used.append(out[0].clone()))
    out = _pass(tracker, lp, ids, mask, "compare", replay=True)
    h.remove()
    assert tracker.take_metrics()["routing/changed_frac"] > 0  # the natural choice did change
    gated = used[0].view(4, 9, -1)[run]  # (m, E) over the tokens run: one nonzero gate each (top-1)
    assert ((gated > 0).sum(-1) == 1).all()
    assert torch.equal(gated.argmax(-1), tracker.routes[:, :-1, 0][run].long()[:, 0])  # π_old's experts
    out.sum().backward()
    assert routers[0].weight.grad is not None and routers[0].weight.grad.abs().sum() > 0
    with torch.no_grad():  # without replay the moved router picks other experts
        natural = _pass(tracker, lp, ids, mask, "compare")
    assert not torch.allclose(natural, out.detach(), atol=1e-4)
    tracker.aux = True
    with pytest.raises(ConfigError, match="'algo.router_aux_loss_coef': Llama4Router does not gate with a softmax"):
        _pass(tracker, lp, ids, mask, "compare")


def test_training_on_a_saved_llama4_logs_routes_and_replays(tmp_path):
    """Llama 4 loaded from disk: routes come from the sampler (R3) and are compared, and replay runs."""
    tok = build_char_tokenizer()
    _llama4(len(tok)).save_pretrained(tmp_path / "llama4")
    tok.save_pretrained(tmp_path / "llama4")
    overrides = [x for x in TINY if not x.startswith(("model.", "tiny."))]
    run = train(load_config(None, [*overrides, f"model.name_or_path={tmp_path / 'llama4'}", "algo.level=token",
                                   "algo.routing_replay=true", f"output.dir={tmp_path}"]))
    m = _metrics(run)
    assert m[0]["routing/changed_frac"] == 0.0 and max(x["routing/changed_frac"] for x in m[1:]) > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama4"])
def test_replay_and_the_balancing_loss_under_activation_checkpointing_match_the_pass_without_it(arch):
    """A checkpointed layer runs its router again in the backward pass, after the tracker's
    forward context has closed: the hooks must compute there what they computed in the forward
    (torch stopped with 'a different number of tensors was saved'), and count nothing twice."""
    from gspo.models import set_activation_checkpointing, set_trainer_mode

    tok = build_char_tokenizer()
    model = (build_tiny_model(tok, hidden_size=32, num_layers=2, moe=True, seed=0) if arch == "qwen3_moe"
             else _llama4(len(tok)))
    _, tracker, lp, ids, mask = _tracked(model, len(tok))
    tracker.aux = arch == "qwen3_moe"  # (Llama 4's sigmoid gates have no Switch loss)
    with torch.no_grad():
        _pass(tracker, lp, ids, mask, "capture")
        for r in find_routers(model):
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(5)) * 5.0)
    results = []
    for checkpointed in (False, True):
        set_activation_checkpointing(model, checkpointed)
        set_trainer_mode(model, dropout=False)
        model.zero_grad()
        out = _pass(tracker, lp, ids, mask, "compare", replay=True)
        loss = (out * torch.linspace(-1, 1, out.shape[1])).sum()
        aux = tracker.take_aux()
        if tracker.aux:
            loss = loss + 0.5 * aux
        loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((out.detach(), grads, tracker.take_metrics(), None if aux is None else aux.item()))
        assert tracker.take_aux() is None  # nothing added by the recomputation
    set_activation_checkpointing(model, False)
    (a, ga, ma, xa), (b, gb, mb, xb) = results
    assert ma["routing/changed_frac"] > 0 and ma == mb and xa == xb
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert ga.keys() == gb.keys() and any("router" in k or "gate" in k for k in ga)
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], rtol=0, atol=1e-6, msg=k)


def test_a_router_that_replay_or_the_balancing_loss_cannot_serve_is_refused_before_any_sampling(tmp_path):
    """It was refused in the first update pass, after a rollout's compute and with the run's files
    written, so the corrected command then met 'run directory already holds a run'."""
    tok = build_char_tokenizer()
    _llama4(len(tok)).save_pretrained(tmp_path / "llama4")
    tok.save_pretrained(tmp_path / "llama4")
    base = [x for x in TINY if not x.startswith(("model.", "tiny."))]
    base += [f"model.name_or_path={tmp_path / 'llama4'}", f"output.dir={tmp_path}", "output.name=run"]
    sampled = []
    import gspo.rollout.hf as hf

    real = hf.HFGenerator.generate
    hf.HFGenerator.generate = lambda *a, **k: sampled.append(1) or real(*a, **k)
    try:
        with pytest.raises(ConfigError, match="'algo.router_aux_loss_coef': Llama4Router does not gate with a softmax"):
            train(load_config(None, [*base, "algo.router_aux_loss_coef=0.01"]))
    finally:
        hf.HFGenerator.generate = real
    assert not sampled and not (tmp_path / "run" / "config.yaml").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    train(load_config(None, base))  # the corrected command runs in the same directory
