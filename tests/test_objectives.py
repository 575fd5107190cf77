"""The objectives after GSPO (SAPO, CISPO, GMPO, LUSPO), the KL penalty, the entropy from the
chunked head, and overlong masking: hand-computed values with the arithmetic in comments,
invariants against GSPO / GRPO, bad combinations, and the trainer using them."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gspo import algo
from gspo.config import ConfigError, load_config

BIG = dict(max_log_ratio=10.0)


def _grad(fn, logp):
    lp = logp.clone().requires_grad_(True)
    loss, m = fn(lp)
    loss.backward()
    return loss.item(), lp.grad, m


# ------------------------------------------------------------------ SAPO


def test_sapo_hand_values():
    # one token, r = 1.5, A = +1, tau_pos = 1: f = (4/1) sigmoid(0.5) = 4 * 0.6224593 = 2.4898372
    # d loss / d logp = -A f'(r) r = -(4 sig (1 - sig)) * 1.5 = -(4 * 0.6224593 * 0.3775407) * 1.5 = -1.4099...
    logp, old = torch.tensor([[math.log(1.5)]]), torch.zeros(1, 1)
    mask = torch.ones(1, 1, dtype=torch.bool)
    sig = 1 / (1 + math.exp(-0.5))
    loss, g, m = _grad(lambda lp: algo.policy_loss(lp, old, torch.tensor([1.0]), mask, level="token", objective="sapo",
                                                   eps_low=None, eps_high=None, tau_pos=1.0, tau_neg=1.05, **BIG), logp)
    assert loss == pytest.approx(-4 * sig, rel=1e-6)
    assert g.item() == pytest.approx(-4 * sig * (1 - sig) * 1.5, rel=1e-5)
    assert m["gate/weight_mean"] == pytest.approx(4 * sig * (1 - sig), rel=1e-6)
    # A = -1 takes tau_neg = 1.05: f = (4/1.05) sigmoid(1.05 * 0.5); loss = -A f = +f
    loss, g, _ = _grad(lambda lp: algo.policy_loss(lp, old, torch.tensor([-1.0]), mask, level="token", objective="sapo",
                                                   eps_low=None, eps_high=None, tau_pos=1.0, tau_neg=1.05, **BIG), logp)
    s2 = 1 / (1 + math.exp(-0.525))
    assert loss == pytest.approx(4 / 1.05 * s2, rel=1e-6)
    assert g.item() == pytest.approx(4 * s2 * (1 - s2) * 1.5, rel=1e-5)
    # in float64 to float64's precision (tau was built in float32: 1.05 became 1.0499999523)
    loss64, _, _ = _grad(lambda lp: algo.policy_loss(lp, old.double(), torch.tensor([-1.0], dtype=torch.float64),
                                                     mask, level="token", objective="sapo", eps_low=None,
                                                     eps_high=None, tau_pos=1.0, tau_neg=1.05, **BIG),
                         torch.tensor([[math.log(1.5)]], dtype=torch.float64))
    assert loss64 == pytest.approx(4 / 1.05 * s2, rel=1e-12)


def test_sapo_on_policy_gradient_is_the_plain_policy_gradient():
    # at r = 1 the gate's weight 4 sigma(0) (1 - sigma(0)) = 1: SAPO's gradient equals GRPO's unclipped one
    torch.manual_seed(0)
    logp = torch.randn(3, 5)
    mask = torch.rand(3, 5) > 0.3
    adv = torch.tensor([1.0, -0.5, 2.0])
    _, g_sapo, m = _grad(lambda lp: algo.policy_loss(lp, logp, adv, mask, level="token", objective="sapo",
                                                     eps_low=None, eps_high=None, tau_pos=1.0, tau_neg=1.05, **BIG), logp)
    _, g_grpo, _ = _grad(lambda lp: algo.policy_loss(lp, logp, adv, mask, level="token", eps_low=0.2, eps_high=0.27,
                                                     **BIG), logp)
    torch.testing.assert_close(g_sapo, g_grpo, rtol=1e-6, atol=1e-7)
    assert m["gate/weight_mean"] == pytest.approx(1.0) and m["clip/token_frac"] == 0.0


def test_sapo_counts_tokens_whose_gate_keeps_under_half_the_gradient():
    # f'(r) = 4 sig (1 - sig) < 1/2 once tau |r - 1| > ln((1 + sqrt(.5)) / (1 - sqrt(.5))) = 1.7627
    logp = torch.log(torch.tensor([[3.0, 1.2, 0.1]]))  # r - 1 = 2.0 (damped), 0.2, -0.9 (not)
    _, m = algo.policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), level="token",
                            objective="sapo", eps_low=None, eps_high=None, tau_pos=1.0, tau_neg=1.05, **BIG)
    assert m["clip/token_frac"] == pytest.approx(1 / 3) and m["clip/token_frac_high"] == pytest.approx(1 / 3)


# ------------------------------------------------------------------ CISPO


def test_cispo_hand_values():
    # two tokens, r = 2 and 0.5, A = 1, eps_high 0.28, no lower bound (eps_low 1):
    # weights sg[min(2, 1.28)] = 1.28 and 0.5; token-mean: loss = -(1.28 logp_1 + 0.5 logp_2) / 2
    logp = torch.tensor([[math.log(0.4), math.log(0.1)]])
    old = logp - torch.log(torch.tensor([[2.0, 0.5]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, g, m = _grad(lambda lp: algo.policy_loss(lp, old, torch.tensor([1.0]), mask, level="token",
                                                   objective="cispo", eps_low=1.0, eps_high=0.28, **BIG), logp)
    assert loss == pytest.approx(-(1.28 * math.log(0.4) + 0.5 * math.log(0.1)) / 2, rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[-1.28 / 2, -0.5 / 2]]))  # every token keeps a gradient
    assert m["clip/token_frac"] == 0.5 and m["clip/token_frac_high"] == 0.5  # the weight 2 was truncated
    # a lower bound (eps_low 0.2: 0.8) truncates the 0.5 too
    _, g, m = _grad(lambda lp: algo.policy_loss(lp, old, torch.tensor([1.0]), mask, level="token",
                                                objective="cispo", eps_low=0.2, eps_high=0.28, **BIG), logp)
    torch.testing.assert_close(g, torch.tensor([[-1.28 / 2, -0.8 / 2]]))
    assert m["clip/token_frac"] == 1.0


def test_cispo_on_policy_gradient_is_grpo_token_mean():
    torch.manual_seed(1)
    logp, mask = torch.randn(4, 6), torch.rand(4, 6) > 0.4
    adv = torch.randn(4)
    _, g_c, _ = _grad(lambda lp: algo.policy_loss(lp, logp, adv, mask, level="token", objective="cispo",
                                                  eps_low=1.0, eps_high=0.28, **BIG), logp)
    _, g_g, _ = _grad(lambda lp: algo.policy_loss(lp, logp, adv, mask, level="token", aggregation="token-mean",
                                                  eps_low=0.2, eps_high=0.28, **BIG), logp)
    torch.testing.assert_close(g_c, g_g)


# ------------------------------------------------------------------ GMPO


def test_gmpo_hand_values():
    # two tokens, log r = 0.6 and -0.2, eps 0.4 (log space)
    # A = +1: l = (min(0.6, 0.4), -0.2) = (0.4, -0.2), mean 0.1: loss = -e^0.1;
    #   d loss / d logp = (0 (clipped), -e^0.1 / 2)
    logp = torch.tensor([[0.6, -0.2]])
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    kw = dict(level="sequence", objective="gmpo", eps_low=0.4, eps_high=0.4, **BIG)
    loss, g, m = _grad(lambda lp: algo.policy_loss(lp, old, torch.tensor([1.0]), mask, **kw), logp)
    assert loss == pytest.approx(-math.exp(0.1), rel=1e-6)
    torch.testing.assert_close(g, torch.tensor([[0.0, -math.exp(0.1) / 2]]))
    assert m["clip/token_frac"] == 0.5 and m["clip/token_frac_high"] == 0.5 and m["clip/seq_frac"] == 1.0
    # A = -1: l = (max(0.6, -0.4), max(-0.2, -0.4)) = (0.6, -0.2), mean 0.2: loss = +e^0.2, nothing clipped
    loss, g, m = _grad(lambda lp: algo.policy_loss(lp, old, torch.tensor([-1.0]), mask, **kw), logp)
    assert loss == pytest.approx(math.exp(0.2), rel=1e-6)
    torch.testing.assert_close(g, torch.full((1, 2), math.exp(0.2) / 2))
    assert m["clip/token_frac"] == 0.0


def test_gmpo_unclipped_equals_gspo_unclipped():
    # inside every bound GMPO's exp(mean log r) A is GSPO's s_i A: same value and gradient
    torch.manual_seed(2)
    old = torch.randn(3, 4)
    logp = old + 0.01 * torch.randn(3, 4)
    mask, adv = torch.rand(3, 4) > 0.2, torch.tensor([0.7, -1.2, 0.3])
    l1, g1, _ = _grad(lambda lp: algo.policy_loss(lp, old, adv, mask, level="sequence", objective="gmpo",
                                                  eps_low=0.4, eps_high=0.4, **BIG), logp)
    l2, g2, _ = _grad(lambda lp: algo.policy_loss(lp, old, adv, mask, level="sequence", eps_low=0.99,
                                                  eps_high=math.inf, **BIG), logp)
    assert l1 == pytest.approx(l2, rel=1e-6)
    torch.testing.assert_close(g1, g2)


# ------------------------------------------------------------------ LUSPO


def test_luspo_is_gspo_times_length():
    # rows of lengths 3 and 1: J = mean_i |y_i| term_i, so with B = 2 loss = (3 t_1 + 1 t_2) / 2
    torch.manual_seed(3)
    old = torch.randn(2, 3)
    logp = old + torch.tensor([[1e-4, 2e-4, 0.0], [5e-3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])
    kw = dict(level="sequence", eps_low=3e-4, eps_high=4e-4, **BIG)
    per_row = [algo.policy_loss(logp[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1], **kw)[0].item()
               for i in range(2)]  # each = -term_i
    loss, m = algo.policy_loss(logp, old, adv, mask, objective="luspo", **kw)
    assert loss.item() == pytest.approx((3 * per_row[0] + 1 * per_row[1]) / 2, rel=1e-6)
    # the second row's s = e^5e-3 > 1 + 4e-4 with A > 0: clipped, its one token counted
    assert m["clip/token_frac"] == pytest.approx(1 / 4)


# ------------------------------------------------------------------ shared invariants


@pytest.mark.parametrize("objective,level,eps", [("sapo", "token", (None, None)), ("cispo", "token", (1.0, 0.28)),
                                                 ("gmpo", "sequence", (0.4, 0.4)), ("luspo", "sequence", (3e-4, 4e-4))])
def test_padding_and_garbage_change_nothing(objective, level, eps):
    torch.manual_seed(4)
    old = torch.randn(3, 4)
    logp = old + 0.05 * torch.randn(3, 4)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0, 0.5])
    kw = dict(level=level, objective=objective, eps_low=eps[0], eps_high=eps[1], **BIG)
    if objective == "sapo":
        kw.update(tau_pos=1.0, tau_neg=1.05)
    pad = lambda x, v: torch.cat([x, torch.full((3, 2), v)], 1)  # noqa: E731
    l1, g1, _ = _grad(lambda lp: algo.policy_loss(lp, old, adv, mask, **kw), logp)
    l2, g2, _ = _grad(lambda lp: algo.policy_loss(lp, pad(old, math.nan), adv, pad(mask, False), **kw),
                      pad(logp, math.inf))
    assert l1 == pytest.approx(l2, rel=1e-6)
    assert torch.isfinite(g2).all()
    torch.testing.assert_close(g2[:, :4], g1)
    assert (g2[:, 4:] == 0).all()


@pytest.mark.parametrize("kw,field", [
    (dict(objective="sapo", level="sequence", eps_low=None, eps_high=None, tau_pos=1.0, tau_neg=1.05), "level"),
    (dict(objective="sapo", level="token", eps_low=0.2, eps_high=None, tau_pos=1.0, tau_neg=1.05), "eps_low"),
    (dict(objective="sapo", level="token", eps_low=None, eps_high=None, tau_pos=0.0, tau_neg=1.05), "tau_pos"),
    (dict(objective="clip", level="token", eps_low=0.2, eps_high=0.2, tau_pos=1.0), "tau_pos"),
    (dict(objective="gmpo", level="token", eps_low=0.4, eps_high=0.4), "level"),
    (dict(objective="luspo", level="sequence", eps_low=3e-4, eps_high=4e-4, aggregation="token-mean"), "aggregation"),
    (dict(objective="cispo", level="token", eps_low=1.5, eps_high=0.28), "eps_low"),
    (dict(objective="nope", level="token", eps_low=0.2, eps_high=0.2), "objective"),
])
def test_invalid_combinations_raise_naming_the_argument(kw, field):
    with pytest.raises(ValueError, match=field):
        algo.validate_algo(kw.pop("level"), kw.pop("eps_low"), kw.pop("eps_high"), kw.pop("aggregation", None),
                           max_log_ratio=10.0, **kw)


def test_cispo_defaults_to_token_mean():
    assert algo.validate_algo("token", 1.0, 0.28, objective="cispo", max_log_ratio=10.0)[2] == "token-mean"


@pytest.mark.parametrize("overrides,field", [
    (["algo.objective=sapo"], "algo.level"),  # sapo is token-level; the default level is sequence
    (["algo.objective=sapo", "algo.level=token", "algo.eps_low=0.2"], "algo.eps_low"),
    (["algo.objective=soft"], "algo.objective"),
    (["algo.kl_estimator=k4"], "algo.kl_estimator"),
    (["algo.kl_coef=-1"], "algo.kl_coef"),
    (["algo.entropy_coef=nan"], "algo.entropy_coef"),
])
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_config_fills_each_objectives_paper_defaults():
    a = load_config(None, ["algo.objective=gmpo"]).algo
    assert (a.eps_low, a.eps_high, a.aggregation) == (0.4, 0.4, "seq-mean-token-mean")
    a = load_config(None, ["algo.objective=cispo", "algo.level=token"]).algo
    assert (a.eps_low, a.eps_high, a.aggregation) == (1.0, 0.28, "token-mean")
    a = load_config(None, ["algo.objective=sapo", "algo.level=token"]).algo
    assert (a.eps_low, a.eps_high, a.sapo_tau_pos, a.sapo_tau_neg) == (None, None, 1.0, 1.05)
    a = load_config(None, ["algo.objective=luspo"]).algo
    assert (a.eps_low, a.eps_high) == (3e-4, 4e-4)


# ------------------------------------------------------------------ KL


def test_kl_estimators_hand_values():
    # pi = 0.5, pi_ref = 0.25: log r = log(0.25 / 0.5) = -0.693147
    # k1 = -log r = 0.693147; k2 = (log r)^2 / 2 = 0.240227; k3 = r - 1 - log r = 0.5 - 1 + 0.693147 = 0.193147
    # d k3 / d logp = -(r - 1) = 0.5;  d k1 / d logp = 1;  d k2 / d logp = -log r = 0.693147
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    mask = torch.ones(1, 1, dtype=torch.bool)
    for est, value, grad in (("k1", 0.693147, 1.0), ("k2", 0.240227, 0.693147), ("k3", 0.193147, 0.5)):
        lp = logp.clone().requires_grad_(True)
        term, mean = algo.kl_penalty(lp, ref, mask, estimator=est, aggregation="seq-mean-token-mean", max_log_ratio=10.0)
        term.backward()
        assert term.item() == pytest.approx(value, rel=1e-5) and mean == pytest.approx(value, rel=1e-5)
        assert lp.grad.item() == pytest.approx(grad, rel=1e-5)


def test_kl_is_aggregated_as_the_loss_and_ignores_padding():
    # rows of 2 and 1 tokens with k3 values (a, b) and (c): seq-mean-token-mean ((a + b) / 2 + c) / 2,
    # token-mean (a + b + c) / 3
    logp = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.9, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.4, math.nan], [0.1, 0.0, 0.0]]))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    k = algo.kl_terms(logp, ref, mask, estimator="k3", max_log_ratio=10.0)
    a, b, c = k[0, 0].item(), k[0, 1].item(), k[1, 0].item()
    assert b == 0 and a == pytest.approx(0.193147, rel=1e-5) and c == pytest.approx(0.193147, rel=1e-5)
    seq, _ = algo.kl_penalty(logp, ref, mask, estimator="k3", aggregation="seq-mean-token-mean", max_log_ratio=10.0)
    tok, mean = algo.kl_penalty(logp, ref, mask, estimator="k3", aggregation="token-mean", max_log_ratio=10.0)
    assert seq.item() == pytest.approx(((a + b) / 2 + c) / 2, rel=1e-6)
    assert tok.item() == pytest.approx((a + b + c) / 3, rel=1e-6) and mean == pytest.approx(tok.item())


# ------------------------------------------------------------------ entropy in the chunked head


def _tiny_lm(vocab=29, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("temperature,chunk,recompute", [(1.0, 4, False), (0.7, 3, False), (0.7, 3, True)])
def test_chunked_entropy_equals_the_full_logits_entropy_and_its_gradient(temperature, chunk, recompute, monkeypatch):
    from gspo.models import lm_head, logprobs

    if recompute:  # the head's chunks under activation checkpointing, as with a real vocabulary
        monkeypatch.setattr(lm_head, "_UNCHECKPOINTED_LOGITS_BYTES", 0)
    model = _tiny_lm()
    ids = torch.randint(0, 29, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    mask[2, -2:] = 0  # right padding
    kw = dict(temperature=temperature)
    lp, ent = logprobs.token_logprobs(model, ids, mask, 5, chunk_size=chunk, share_prompt=False, entropy=True, **kw)
    # reference: log_softmax of the full logits / T, entropy -sum p log p
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=logprobs.position_ids_from_mask(mask)).logits[:, 3:8].float() / temperature
    ref = torch.log_softmax(logits, -1)
    valid = mask[:, 4:].bool()
    ref_ent = torch.where(valid, -(ref.exp() * ref).sum(-1), 0.0)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lp, logprobs.naive_token_logprobs(model, ids, mask, 5, **kw), rtol=1e-5, atol=1e-6)
    # the gradient of (sum of log-probs + 0.3 * sum of entropies) matches autograd's through the full logits
    w = torch.randn(3, 5)
    model.zero_grad()
    lp, ent = logprobs.token_logprobs(model, ids, mask, 5, chunk_size=chunk, share_prompt=False, entropy=True, **kw)
    ((lp * w).sum() + 0.3 * ent.sum()).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lpn, entn = logprobs.naive_token_logprobs(model, ids, mask, 5, entropy=True, **kw)
    ((lpn * w).sum() + 0.3 * entn.sum()).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_entropy_bonus_aggregates_as_the_loss():
    ent = torch.tensor([[1.0, 3.0, 9.0], [2.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    term, mean = algo.entropy_bonus(ent, mask, aggregation="seq-mean-token-mean")
    assert term.item() == pytest.approx(((1 + 3) / 2 + 2) / 2) and mean == pytest.approx((1 + 3 + 2) / 3)


# ------------------------------------------------------------------ in the trainer


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


TRAIN = ["tiny.hidden_size=32", "tiny.num_layers=1", "data.num_prompts=16", "rollout.prompts_per_step=4",
         "rollout.group_size=4", "rollout.max_new_tokens=4", "schedule.rollouts=2", "schedule.num_minibatches=2",
         "eval.enabled=false", "logging.console=false", "rollout.temperature=1.5", "optim.lr=1e-2",
         "rewards.functions=[{name: 'gspo_test_rewards:count_ones'}]"]


@pytest.mark.parametrize("extra", [[], ["lora.enabled=true", "lora.target_modules=[all-linear]"]])
def test_kl_reference_is_the_starting_policy(tmp_path, extra):
    """The first optimizer step runs at the starting weights, so its KL to the reference is 0
    exactly; after an update it is not (full copy, or LoRA's base with adapters off)."""
    from gspo.cli import main

    assert main(["train", *TRAIN, *extra, "algo.kl_coef=0.1", f"output.dir={tmp_path}", "output.name=r"]) == 0
    steps = [r for r in _records(tmp_path / "r") if "kl/ref" in r]
    assert len(steps) == 4
    assert steps[0]["kl/ref"] == 0.0
    assert steps[1]["kl/ref"] > 0 and steps[3]["kl/ref"] > 0
    assert all(0 < r["entropy/mean"] < math.log(64) for r in steps)


def test_kl_coefficient_changes_the_update_and_logging_alone_does_not(tmp_path):
    from gspo.cli import main
    from safetensors.torch import load_file

    runs = {}
    for name, extra in (("plain", []), ("logged", ["logging.kl_reference=true"]), ("kl", ["algo.kl_coef=1.0"])):
        assert main(["train", *TRAIN, *extra, "schedule.skip_zero_advantage=false", f"output.dir={tmp_path}",
                     f"output.name={name}"]) == 0
        runs[name] = load_file(tmp_path / name / "final" / "model.safetensors")
    assert all(torch.equal(runs["plain"][k], runs["logged"][k]) for k in runs["plain"])
    assert not all(torch.equal(runs["plain"][k], runs["kl"][k]) for k in runs["plain"])
    assert "kl/ref" in _records(tmp_path / "logged")[-1] and "kl/ref" not in _records(tmp_path / "plain")[-1]


def test_mask_truncated_leaves_cut_completions_out_of_the_loss(tmp_path):
    """Every completion cut by the length limit: the loss is 0 and the weights never move;
    without the mask the same run trains."""
    import dataclasses

    from gspo.train import TrainerState, learn, produce
    from gspo.train.run import build_run

    finals = {}
    for masked in (True, False):
        cfg = load_config(None, [*TRAIN, "schedule.skip_zero_advantage=false", f"algo.mask_truncated={masked}",
                                 f"output.dir={tmp_path}", f"output.name=m{masked}"])
        run = build_run(cfg)
        try:
            before = {k: v.clone() for k, v in run.policy.state_dict().items()}
            scored = produce(run, TrainerState())
            scored = dataclasses.replace(scored, rollout=dataclasses.replace(
                scored.rollout, finish_reason=["length"] * scored.rollout.num_samples))
            steps, _ = learn(run, scored, TrainerState())
            after = run.policy.state_dict()
            finals[masked] = all(torch.equal(before[k], after[k]) for k in before)
            if masked:
                assert all(s["loss"] == 0.0 and s["grad_norm"] == 0.0 for s in steps)
        finally:
            run.close()
    assert finals == {True: True, False: False}


@pytest.mark.parametrize("extra", [["algo.objective=sapo", "algo.level=token"],
                                   ["algo.objective=cispo", "algo.level=token"],
                                   ["algo.objective=gmpo"], ["algo.objective=luspo"]])
def test_each_objective_trains_through_the_cli(tmp_path, extra):
    from gspo.cli import main

    assert main(["train", *TRAIN, *extra, f"output.dir={tmp_path}", "output.name=r"]) == 0
    steps = [r for r in _records(tmp_path / "r") if "loss" in r]
    assert len(steps) == 4 and all(math.isfinite(r["loss"]) for r in steps)
    assert ("gate/weight_mean" in steps[-1]) == (extra[0] == "algo.objective=sapo")


def test_kl_run_resumes_exactly_with_the_starting_weights_as_reference(tmp_path):
    """On resume the reference is rebuilt from the starting model, not the checkpoint: the
    resumed run equals an uninterrupted one bit for bit."""
    from test_resume import assert_same_run, gspo_train

    extra = ("algo.kl_coef=0.5", "algo.objective=sapo", "algo.level=token")
    gspo_train(tmp_path / "a", "run", *extra)
    p = gspo_train(tmp_path / "b", "run", *extra, faults="exit_after_rollout=2", check=False)
    assert p.returncode == 3
    gspo_train(tmp_path / "b", "run", *extra, "resume=auto")
    assert_same_run(tmp_path / "a" / "run", tmp_path / "b" / "run")


@pytest.mark.parametrize("extra,max_len", [([], 16),
                                           (["rollout.tools=[gspo.tool_tasks:calc]", "rollout.max_turns=3"], 48),
                                           (["rollout.tools=[gspo.tool_tasks:calc]", "rollout.max_episode_tokens=40"], 40)])
def test_dr_grpos_constant_is_the_most_tokens_the_model_can_write(extra, max_len):
    """Dr. GRPO divides each sequence's token sum by a constant, the generation budget. An
    episode's model may write up to its whole budget (max_turns x max_new_tokens, or
    max_episode_tokens), not one turn's max_new_tokens (which it used to take)."""
    from gspo.config import load_config
    from gspo.config.rules import objective_args

    cfg = load_config(None, ["algo.level=token", "algo.aggregation=seq-mean-token-sum-norm",
                             "rollout.max_new_tokens=16", *extra])
    assert objective_args(cfg)["max_len"] == max_len


def test_a_k1_kl_term_in_the_loss_is_warned_of_its_expected_gradient_is_zero():
    """k1's value is an unbiased KL estimate, but as a loss term its expected gradient is
    E_theta[grad log pi_theta] = 0: computed exactly here over a 5-token vocabulary (k3's is the
    gradient of KL(ref || theta), k2's of KL(theta || ref)); a k1 term in the loss is warned of."""
    import torch

    from gspo.algo import kl_loss_note, kl_terms

    g = torch.Generator().manual_seed(0)
    theta, ref = torch.randn(5, generator=g, requires_grad=True), torch.randn(5, generator=g).log_softmax(-1)

    def expected_grad(estimator):  # sum_y pi(y) grad k(y), the tokens drawn from pi (not differentiated)
        logp = theta.log_softmax(-1)
        k = kl_terms(logp[None], ref[None], torch.ones(1, 5, dtype=torch.bool), estimator=estimator,
                     max_log_ratio=20.0)[0]
        return torch.autograd.grad((logp.detach().exp() * k).sum(), theta)[0]

    def kl_grad(forward):
        logp = theta.log_softmax(-1)
        kl = (logp.exp() * (logp - ref)).sum() if forward else (ref.exp() * (ref - logp)).sum()
        return torch.autograd.grad(kl, theta)[0]

    assert expected_grad("k1").abs().max() < 1e-6
    torch.testing.assert_close(expected_grad("k3"), kl_grad(forward=False))
    torch.testing.assert_close(expected_grad("k2"), kl_grad(forward=True))
    assert "zero expected gradient" in kl_loss_note("k1", 0.1)
    assert kl_loss_note("k1", 0.0) is None and kl_loss_note("k3", 0.1) is None
