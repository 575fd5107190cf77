"""Tests of gspo.algo: hand-computed values, invariants from the paper and a loop reference
(property tests and argument checks: test_algo_checks.py). Paper: Zheng et al., arXiv
2507.18071; equation numbers refer to it."""

import math

import pytest
import torch

from algo_defaults import DEFAULT_CLIP, default_clip, policy_loss, validate_algo  # noqa: F401
from gspo import algo
from gspo.algo import LEVELS, sequence_log_ratio
from gspo.config import PAPER_CLIP

F64 = torch.float64
SEQ_EPS = (3e-4, 4e-4)  # paper section 5.1
# (level, aggregation, max_len, per-token advantages) for every supported combination
COMBOS = [
    ("sequence", None, None, False),
    ("sequence_token", None, None, False),
    ("sequence_token", None, None, True),
    ("token", "seq-mean-token-mean", None, False),
    ("token", "token-mean", None, False),
    ("token", "seq-mean-token-sum-norm", 9, False),
    ("token", "seq-mean-token-mean", None, True),
    ("token", "token-mean", None, True),
]


# --------------------------------------------------------------------------------------------
# Plain-Python reference: loops over sequences and tokens, written from the equations.
# 0-d tensor arithmetic so autograd gives a reference gradient too. A clipped term is written
# as a Python constant times A, so "no gradient when clipped" is explicit here.
# --------------------------------------------------------------------------------------------
def reference_policy_loss(logp, old_logp, advantages, mask, *, level, eps_low, eps_high,
                          aggregation="seq-mean-token-mean", max_len=None, max_log_ratio=10.0):
    """Returns (loss, set of clipped (i, t) token positions)."""
    B, T = logp.shape
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    M = max_log_ratio
    rows, old_rows = logp.unbind(0), old_logp.unbind(0)
    clipped = set()

    def val(x):
        return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)

    def adv(i, t):
        return float(advantages[i]) if advantages.dim() == 1 else float(advantages[i, t])

    def surrogate(r, a, positions):
        # min(r A, clip(r, lo, hi) A); Python's min returns the first argument on ties
        if (a > 0 and val(r) > hi) or (a < 0 and val(r) < lo):
            clipped.update(positions)
        return min(r * a, min(max(r, lo), hi) * a)

    def clamp(x):  # beyond +-M the log-ratio is a constant
        return x if abs(val(x)) <= M else torch.tensor(math.copysign(M, val(x)), dtype=F64)

    total, n_all = 0.0, 0
    for i in range(B):
        lp, olp = rows[i].unbind(0), old_rows[i].unbind(0)
        valid = [t for t in range(T) if bool(mask[i, t])]
        n = len(valid)
        n_all += n
        if n == 0:
            continue  # an empty response adds 0 but still counts in B
        if level == "sequence":  # Eq. 5 and 7
            log_s = sum(lp[t] - olp[t] for t in valid) / n
            s = torch.exp(clamp(log_s))
            total = total + surrogate(s, adv(i, None), [(i, t) for t in valid])
            continue
        seq_sum = 0.0
        if level == "sequence_token":  # Eq. 13 and 14
            raw = sum(val(lp[t]) - val(olp[t]) for t in valid) / n  # sg[log s_i]
            log_s = max(min(raw, M), -M)
            for t in valid:
                live = lp[t] - lp[t].detach() if abs(raw) <= M else 0.0
                s_it = torch.exp(torch.as_tensor(log_s, dtype=F64) + live)
                seq_sum = seq_sum + surrogate(s_it, adv(i, t), [(i, t)])
            total = total + seq_sum / n
            continue
        for t in valid:  # token level, GRPO
            w = torch.exp(clamp(lp[t] - olp[t]))
            seq_sum = seq_sum + surrogate(w, adv(i, t), [(i, t)])
        if aggregation == "seq-mean-token-mean":
            total = total + seq_sum / n
        elif aggregation == "token-mean":
            total = total + seq_sum
        else:
            total = total + seq_sum / max_len
    denom = max(n_all, 1) if aggregation == "token-mean" and level == "token" else B
    loss = -torch.as_tensor(total, dtype=F64) / denom
    return loss, clipped


def _grad(loss, x):
    if not loss.requires_grad:
        return torch.zeros_like(x)
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def random_batch(seed, level, per_token_adv=False, B=8, T=6):
    """float64 batch with holes in masks, one empty row, and log-ratios scaled to the level's
    clip range so that some sequences (or tokens) are clipped and some are not."""
    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(B, T, generator=g, dtype=F64)
    scale = 0.5 if level == "token" else 1e-3
    shift = scale * torch.randn(B, 1, generator=g, dtype=F64)
    logp = (old + shift + scale * torch.randn(B, T, generator=g, dtype=F64)).requires_grad_()
    mask = torch.rand(B, T, generator=g) < 0.75
    mask[0] = False
    mask[1, 0] = True
    shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(*shape, generator=g, dtype=F64)
    return logp, old, adv, mask


# --------------------------------------------------------------------------------------------
# Hand-computed values
# --------------------------------------------------------------------------------------------
def test_sequence_level_hand_values():
    # seq 0: log-ratio 0.1 on both tokens, so s = e^0.1 = 1.10517 > 1 + 4e-4; A = +1, so the
    #        term is clipped: 1.0004 * 1 = 1.0004, and it has no gradient.
    # seq 1: log-ratios 1e-4, 2e-4, 3e-4, mean 2e-4, s = e^2e-4 = 1.00020002 inside
    #        [0.9997, 1.0004]; A = -1: term -1.00020002.
    # loss = -(1.0004 - 1.00020002) / 2 = -9.999e-5
    logp = torch.tensor([[0.1, 0.1, 123.0], [1e-4, 2e-4, 3e-4]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, m = policy_loss(logp, old, adv, mask)
    s1 = math.exp(2e-4)
    assert loss.item() == pytest.approx(-(1.0004 - s1) / 2, rel=1e-12)
    # Eq. 10 on seq 1: d loss / d logp_1t = -s_1 A_1 / (B |y_1|) = s1 / 6; seq 0 clipped: 0
    loss.backward()
    expected = torch.tensor([[0.0, 0.0, 0.0], [s1 / 6] * 3], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0)
    # seq 0 clipped: its 2 tokens of the 5 valid ones; 1 of 2 sequences
    assert m["clip/token_frac"] == pytest.approx(0.4) and m["clip/token_frac_high"] == 0.4
    assert m["clip/token_frac_low"] == 0.0 and m["clip/seq_frac"] == 0.5
    assert m["ratio/seq_max"] == pytest.approx(math.exp(0.1), rel=1e-12)
    assert m["ratio/seq_min"] == pytest.approx(s1, rel=1e-12)
    assert m["ratio/seq_mean"] == pytest.approx((math.exp(0.1) + s1) / 2, rel=1e-12)
    assert m["completion/len_mean"] == 2.5 and m["loss"] == loss.item()


def test_sequence_token_level_hand_values():
    # one sequence, log-ratio 1e-3 on both tokens: s_it = s = e^1e-3 = 1.0010005 > 1.0004.
    # token 0: A = +2, clipped: 1.0004 * 2 = 2.0008 (no gradient)
    # token 1: A = -1, not clipped: -1.0010005
    # J = (2.0008 - 1.0010005) / 2 = 0.49989975, loss = -J
    logp = torch.tensor([[1e-3, 1e-3]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([[2.0, -1.0]], dtype=F64)
    loss, m = policy_loss(logp, old, adv, mask, level="sequence_token")
    s = math.exp(1e-3)
    assert loss.item() == pytest.approx(-(2.0008 - s) / 2, rel=1e-12)
    # Eq. 17: the gradient of token 1 is its own, -(1/|y|) A s = -(1/2)(-1) s = s / 2; token 0
    # gets nothing, although the sequence mean in s_i depends on it (stop-gradient, Eq. 14).
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, s / 2]], dtype=F64), rtol=1e-12,
                               atol=0)
    assert m["clip/token_frac_high"] == 0.5 and m["clip/token_frac_low"] == 0.0
    assert m["clip/seq_frac"] == 1.0


@pytest.mark.parametrize("aggregation,max_len,expected", [
    # seq 0: w = [1.5, 0.5], A = +1: 1.5 > 1.27 is clipped to 1.27; 0.5 < 0.8 is not clipped
    #        for A > 0 (min(0.5, 0.8) = 0.5). Token sum 1.77, token mean 0.885.
    # seq 1: w = 0.5, A = -1: clipped to 0.8 * -1 = -0.8 (one token).
    ("seq-mean-token-mean", None, -(0.885 - 0.8) / 2),  # -0.0425
    ("token-mean", None, -(1.77 - 0.8) / 3),  # -0.32333
    ("seq-mean-token-sum-norm", 4, -(1.77 / 4 - 0.8 / 4) / 2),  # -0.12125
])
def test_token_level_hand_values(aggregation, max_len, expected):
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(0.5), -1e30]], dtype=F64,
                        requires_grad=True)
    old = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, m = policy_loss(logp, old, adv, mask, level="token", aggregation=aggregation,
                          max_len=max_len)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # only token (0, 1) is unclipped; d loss / d logp = -(weight) * A * w = -weight * 0.5
    weight = {"seq-mean-token-mean": 1 / 4, "token-mean": 1 / 3,
              "seq-mean-token-sum-norm": 1 / 8}[aggregation]
    loss.backward()
    expected_grad = torch.tensor([[0.0, -weight * 0.5], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expected_grad, rtol=1e-12, atol=0)
    # 2 of 3 valid tokens clipped: (0, 0) on the high side, (1, 0) on the low side
    assert m["clip/token_frac"] == pytest.approx(2 / 3)
    assert m["clip/token_frac_high"] == pytest.approx(1 / 3)
    assert m["clip/token_frac_low"] == pytest.approx(1 / 3) and m["clip/seq_frac"] == 1.0


def test_kl_k3_hand_value():
    # r = 2 on one token: k3 = r - 1 - log r = 1 - ln 2 = 0.306853; r = 1 on the other: 0
    logp = torch.tensor([[math.log(2.0), 0.0]], dtype=F64)
    _, m = policy_loss(logp, torch.zeros(1, 2, dtype=F64), torch.ones(1, dtype=F64),
                       torch.ones(1, 2, dtype=torch.bool))
    assert m["kl/approx"] == pytest.approx((1 - math.log(2.0)) / 2, rel=1e-12)


def test_the_math_has_no_default_clip_range_and_the_config_fills_the_papers():
    from gspo.config import load_config

    args = (torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="eps_low"):
        algo.policy_loss(*args, level="sequence", eps_high=4e-4, max_log_ratio=10.0)
    for level, clip in PAPER_CLIP.items():
        a = load_config(None, [f"algo.level={level}"]).algo
        assert (a.eps_low, a.eps_high) == clip
    assert load_config(None, ["algo.level=token", "algo.eps_high=0.28"]).algo.eps_high == 0.28


def test_default_clip_is_per_level():
    assert DEFAULT_CLIP == {"sequence": (3e-4, 4e-4), "sequence_token": (3e-4, 4e-4),
                            "token": (0.2, 0.27)}
    assert default_clip("token") == (0.2, 0.27) and default_clip("sequence") == SEQ_EPS
    assert validate_algo("token") == (0.2, 0.27, "seq-mean-token-mean")
    # ratio 1.25 with A = +1: inside the token range 1.27, far outside the sequence one 1.0004
    logp = torch.full((1, 1), math.log(1.25), dtype=F64)
    args = (logp, torch.zeros(1, 1, dtype=F64), torch.ones(1, dtype=F64),
            torch.ones(1, 1, dtype=torch.bool))
    assert policy_loss(*args, level="token")[0].item() == pytest.approx(-1.25, rel=1e-12)
    assert policy_loss(*args, level="sequence")[0].item() == pytest.approx(-1.0004, rel=1e-12)


def test_advantages_are_constants():
    # A_i enters the objective as a constant (Eq. 5): no gradient flows into advantages
    logp = torch.tensor([[0.1, -0.2]], dtype=F64, requires_grad=True)
    adv = torch.tensor([0.7], dtype=F64, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2, dtype=F64), adv,
                          torch.ones(1, 2, dtype=torch.bool), level="token")
    assert torch.autograd.grad(loss, adv, allow_unused=True) == (None,)


# --------------------------------------------------------------------------------------------
# Invariants
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level,aggregation,max_len,per_token", COMBOS)
def test_padding_with_garbage_changes_nothing(level, aggregation, max_len, per_token):
    logp, old, adv, mask = random_batch(1, level, per_token)
    B, T = mask.shape
    kw = dict(level=level, aggregation=aggregation, max_len=max_len)
    loss, m = policy_loss(logp, old, adv, mask, **kw)
    g = _grad(loss, logp)
    # 4 extra masked columns holding inf, -inf, NaN and 1e30; also garbage under the
    # existing masked positions
    junk = torch.tensor([math.inf, -math.inf, math.nan, 1e30], dtype=F64).expand(B, 4)
    lp2 = torch.cat([torch.where(mask, logp.detach(), math.nan), junk], 1).requires_grad_()
    old2 = torch.cat([torch.where(mask, old, -math.inf), junk.flip(1)], 1)
    mask2 = torch.cat([mask, torch.zeros(B, 4, dtype=torch.bool)], 1)
    adv2 = torch.cat([torch.where(mask, adv, math.nan), junk], 1) if per_token else adv
    loss2, m2 = policy_loss(lp2, old2, adv2, mask2, **kw)
    g2 = _grad(loss2, lp2)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(g2[:, :T], g, rtol=1e-12, atol=1e-15)
    assert (g2[:, T:] == 0).all() and (g2[:, :T][~mask] == 0).all()
    assert m2 == pytest.approx(m, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("c", [-0.3, -1e-4, 0.0, 2e-4, 0.05, 20.0])
def test_constant_log_ratio_gives_s_equal_e_to_c(c):
    # logp - old_logp = c on every valid token, rows of different lengths: s_i = e^c (Eq. 7);
    # beyond the clamp (c = 20 > 10) s = e^10.
    old = -torch.rand(4, 5, generator=torch.Generator().manual_seed(0), dtype=F64)
    mask = torch.arange(5) < torch.tensor([1, 3, 5, 2])[:, None]
    logp = torch.where(mask, old + c, 7.0)
    torch.testing.assert_close(sequence_log_ratio(logp, old, mask),
                               torch.full((4,), c, dtype=F64), rtol=1e-12, atol=1e-14)
    _, m = policy_loss(logp, old, torch.ones(4, dtype=F64), mask)
    s = math.exp(min(c, 10.0))
    for key in ("ratio/seq_mean", "ratio/seq_min", "ratio/seq_max"):
        assert m[key] == pytest.approx(s, rel=1e-12)


def test_one_token_responses_sequence_equals_token_level():
    # |y_i| = 1: s_i = w_i1, so GSPO, GSPO-token and GRPO coincide for the same eps.
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(16, 1, generator=g, dtype=F64)
    logp = (old + 0.3 * torch.randn(16, 1, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(16, generator=g, dtype=F64)
    mask = torch.ones(16, 1, dtype=torch.bool)
    mask[5] = False  # an empty response too
    eps = dict(eps_low=0.2, eps_high=0.27)
    results = [policy_loss(logp, old, adv, mask, level=lv, **eps) for lv in LEVELS]
    ref_loss, ref_m = results[0]
    ref_grad = _grad(ref_loss, logp)
    assert 0 < ref_m["clip/token_frac"] < 1  # both clipped and unclipped responses
    for loss, m in results[1:]:
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-12)
        torch.testing.assert_close(_grad(loss, logp), ref_grad, rtol=1e-12, atol=1e-15)
        assert m == pytest.approx(ref_m, rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_token_equals_gspo_with_sequence_advantages(seed):
    logp, old, adv, mask = random_batch(seed, "sequence")
    loss, m = policy_loss(logp, old, adv, mask, level="sequence")
    loss_t, m_t = policy_loss(logp, old, adv, mask, level="sequence_token")
    assert 0 < m["clip/seq_frac"] < 1  # the comparison covers both cases
    assert loss_t.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    for key in ("clip/token_frac", "clip/token_frac_low", "clip/token_frac_high",
                "clip/seq_frac"):
        assert m_t[key] == m[key]
    torch.testing.assert_close(_grad(loss_t, logp), _grad(loss, logp), rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_gradient_matches_eq10_on_unclipped_sequences(seed):
    # Eq. 10: grad J = mean_i s_i A_i (1/|y_i|) sum_t grad logp_it, so for an unclipped
    # sequence d loss / d logp_it = -s_i A_i / (B |y_i|) on every valid token: the same weight
    # for all its tokens. Clipped sequences: 0 (checked side by side in the next test).
    logp, old, adv, mask = random_batch(seed, "sequence")
    B = mask.shape[0]
    loss, m = policy_loss(logp, old, adv, mask)
    grad = _grad(loss, logp)
    s = sequence_log_ratio(logp.detach(), old, mask).exp()  # (B,)
    n = mask.sum(-1)
    lo, hi = 1 - SEQ_EPS[0], 1 + SEQ_EPS[1]
    clipped = ((adv > 0) & (s > hi)) | ((adv < 0) & (s < lo))
    assert clipped.any() and (~clipped & (n > 0)).any()
    for i in range(B):
        want = 0.0 if clipped[i] or n[i] == 0 else float(-s[i] * adv[i] / (B * n[i]))
        expected = torch.where(mask[i], torch.tensor(want, dtype=F64), 0.0)
        torch.testing.assert_close(grad[i], expected, rtol=1e-10, atol=1e-16)


@pytest.mark.parametrize("level,c,eps", [("sequence", 0.01, None), ("token", 0.5, None),
                                         ("sequence_token", 0.01, None)])
def test_clip_zeroes_the_gradient_only_on_the_side_of_the_advantage(level, c, eps):
    # four 2-token responses, constant log-ratio +-c so the ratio is e^{+-c}, outside the
    # clip range on both sides (e^0.01 = 1.01 > 1.0004; e^0.5 = 1.65 > 1.27, e^-0.5 = 0.61 < 0.8)
    #   A > 0, ratio > 1 + eps_high: clipped, gradient 0
    #   A > 0, ratio < 1 - eps_low : min picks r A, gradient -r A / (B |y|) = -r / 8
    #   A < 0, ratio < 1 - eps_low : clipped, gradient 0
    #   A < 0, ratio > 1 + eps_high: min picks r A, gradient +r / 8
    sign = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)
    logp = (c * sign[:, None]).expand(4, 2).clone().requires_grad_()
    mask = torch.ones(4, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, torch.zeros(4, 2, dtype=F64), adv, mask, level=level)
    grad = _grad(loss, logp)
    r_hi, r_lo = math.exp(c), math.exp(-c)
    expected = torch.tensor([[0.0] * 2, [-r_lo / 8] * 2, [0.0] * 2, [r_hi / 8] * 2], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    assert m["clip/token_frac_high"] == 0.25 and m["clip/token_frac_low"] == 0.25
    assert m["clip/seq_frac"] == 0.5


def test_all_empty_masks_give_zero_loss_and_gradient():
    for level, aggregation, max_len, per_token in COMBOS:
        logp = torch.full((3, 4), 5e3, dtype=F64, requires_grad=True)
        shape = (3, 4) if per_token else (3,)
        loss, m = policy_loss(logp, torch.full((3, 4), -5e3, dtype=F64), torch.ones(shape,
                              dtype=F64), torch.zeros(3, 4, dtype=torch.bool), level=level,
                              aggregation=aggregation, max_len=max_len)
        assert loss.item() == 0.0 and (_grad(loss, logp) == 0).all()
        assert all(math.isfinite(v) for v in m.values())
        assert m["completion/len_mean"] == 0.0 and m["clip/token_frac"] == 0.0


# --------------------------------------------------------------------------------------------
# Loop reference vs vectorised code
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("level,aggregation,max_len,per_token", COMBOS)
def test_matches_loop_reference(level, aggregation, max_len, per_token, seed):
    logp, old, adv, mask = random_batch(seed, level, per_token)
    eps_low, eps_high = default_clip(level)
    loss, m = policy_loss(logp, old, adv, mask, level=level, aggregation=aggregation,
                          max_len=max_len)
    ref, clipped = reference_policy_loss(logp, old, adv, mask, level=level, eps_low=eps_low,
                                         eps_high=eps_high,
                                         aggregation=aggregation or "seq-mean-token-mean",
                                         max_len=max_len)
    assert 0 < len(clipped) < int(mask.sum())  # the case mixes clipped and unclipped terms
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(_grad(loss, logp), _grad(ref, logp), rtol=1e-10, atol=1e-12)
    assert m["clip/token_frac"] == pytest.approx(len(clipped) / int(mask.sum()), rel=1e-12)
    assert m["clip/seq_frac"] == pytest.approx(
        len({i for i, _ in clipped}) / int((mask.sum(-1) > 0).sum()), rel=1e-12)


def test_loop_reference_with_clamped_log_ratios():
    # log-ratios of +-30 on whole sequences (seq level) and single tokens: the clamp at 10 makes
    # those ratios constants; the reference writes this out by hand.
    logp, old, adv, mask = random_batch(7, "token")
    with torch.no_grad():
        logp[2] += 30.0
        logp[3] -= 30.0
        logp[4, 1] += 30.0
    for level, aggregation, max_len, per_token in COMBOS:
        a = torch.randn(mask.shape, dtype=F64, generator=torch.Generator().manual_seed(1)) \
            if per_token else adv
        eps_low, eps_high = default_clip(level)
        loss, _ = policy_loss(logp, old, a, mask, level=level, aggregation=aggregation,
                              max_len=max_len)
        ref, _ = reference_policy_loss(logp, old, a, mask, level=level, eps_low=eps_low,
                                       eps_high=eps_high,
                                       aggregation=aggregation or "seq-mean-token-mean",
                                       max_len=max_len)
        assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
        torch.testing.assert_close(_grad(loss, logp), _grad(ref, logp), rtol=1e-10,
                                   atol=1e-12)


def test_token_log_ratio_spread_by_hand_and_over_micro_batches():
    """log w = logp - old_logp on valid tokens: micro-batch 1 has (0.1, -0.1, 0.3), micro-batch 2
    (0.2) (its second token is padding). Over the four tokens: mean 0.125, mean square
    (0.01 + 0.01 + 0.09 + 0.04) / 4 = 0.0375, variance 0.0375 - 0.125^2 = 0.021875, the variance
    of the union (not the mean of the two micro-batches' variances, 0.01778 and 0)."""
    from gspo.train.distributed import Dist
    from gspo.train.step_metrics import add_micro_metrics, reduce_minibatch_metrics

    sums = {}
    for old_lr, mask in (([[0.1, -0.1, 0.3]], [[1, 1, 1]]), ([[0.2, 7.0, 0.0]], [[1, 0, 0]])):
        lr, mask = torch.tensor(old_lr), torch.tensor(mask, dtype=torch.bool)
        _, m = policy_loss(lr, torch.zeros_like(lr), torch.ones(1), mask, level="token")
        add_micro_metrics(sums, m, int(mask.sum()), 1)
    got = reduce_minibatch_metrics(Dist(device=torch.device("cpu")), sums, 0.0, 4, 2)
    assert got["ratio/token_log_mean"] == pytest.approx(0.125)
    assert got["ratio/token_log_sq_mean"] == pytest.approx(0.0375)
    assert got["ratio/token_log_var"] == pytest.approx(0.021875)
