"""Tests of gspo.algo's train/inference mismatch corrections: the two sequence ratios (full
product vs GSPO's geometric mean), mismatch_weights (TIS, MIS / IcePop) and the `weights` of
policy_loss. Hand-computed values, the arithmetic in comments; float64 throughout."""

import math

import pytest
import torch

from algo_defaults import policy_loss
from gspo import algo
from gspo.algo import (MISMATCH_METRICS, mismatch_weights, sequence_log_ratio,
                       sequence_log_ratio_sum, validate_mismatch)
from test_algo import COMBOS, _grad, random_batch

F64 = torch.float64
NAN = math.nan
L = math.log


def _mw(old, sampler, mask, method, level, cap=2.0, floor=0.5, max_log_ratio=10.0):
    return mismatch_weights(old, sampler, mask, method=method, level=level, cap=cap,
                            floor=floor, max_log_ratio=max_log_ratio)


# --------------------------------------------------------------------------------------------
# The two sequence ratios
# --------------------------------------------------------------------------------------------
def test_sequence_ratio_sum_is_the_full_product_and_mean_is_gspo():
    # row 0: token log-ratios 0.1, -0.4, 0.9 (and garbage in the padding):
    #        sum = 0.6 (prod_t w_t = e^0.6), mean = 0.2 (GSPO's s = e^0.2)
    # row 1: empty, both 0
    logp = torch.tensor([[0.1, -0.4, 0.9, NAN], [math.inf, NAN, 1.0, 2.0]], dtype=F64)
    old = torch.tensor([[0.0, 0.0, 0.0, -math.inf], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    total = sequence_log_ratio_sum(logp, old, mask)
    mean = sequence_log_ratio(logp, old, mask)
    assert total.tolist() == pytest.approx([0.6, 0.0], rel=1e-12, abs=0)
    assert mean.tolist() == pytest.approx([0.2, 0.0], rel=1e-12, abs=0)
    assert total[1].item() == 0.0 and mean[1].item() == 0.0


def test_sequence_ratio_sum_has_garbage_free_gradient():
    # d sum / d logp_t = 1 on valid tokens, 0 on the padding (which holds inf)
    logp = torch.tensor([[0.3, math.inf]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    sequence_log_ratio_sum(logp, old, torch.tensor([[1, 0]])).sum().backward()
    assert logp.grad.tolist() == [[1.0, 0.0]]


# --------------------------------------------------------------------------------------------
# mismatch_weights: a 2x3 batch, token weights w_t = pi_old / pi_sampler
#   row 0: w = [3, 0.5, pad]   row 1: w = [1.5, 0.4, 6]
# Full products: W_0 = 3 * 0.5 = 1.5, W_1 = 1.5 * 0.4 * 6 = 3.6.
# Geometric means: G_0 = 1.5^(1/2) = 1.2247449, G_1 = 3.6^(1/3) = 1.5326188.
# The padded position holds NaN in both inputs.
# --------------------------------------------------------------------------------------------
def _batch():
    old = torch.tensor([[L(3.0), L(0.5), NAN], [L(1.5), L(0.4), L(6.0)]], dtype=F64)
    sampler = torch.tensor([[0.0, 0.0, NAN], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    return old, sampler, mask


G0, G1 = 1.5 ** 0.5, 3.6 ** (1 / 3)


def _check(weights, keep, m, exp_weights, exp_keep, exp_m):
    torch.testing.assert_close(weights, torch.tensor(exp_weights, dtype=F64), rtol=1e-12,
                               atol=0)
    assert keep.dtype == torch.bool and keep.tolist() == exp_keep
    assert set(m) == set(MISMATCH_METRICS)
    assert m == pytest.approx(dict(zip(MISMATCH_METRICS, exp_m)), rel=1e-12, abs=0)


def test_tis_token():
    # cap 2: weights min(w, 2) = [2, 0.5, (pad) 1], [1.5, 0.4, 2]; 3 and 6 truncated: 2 of 5
    # untruncated mean (3 + 0.5 + 1.5 + 0.4 + 6) / 5 = 11.4 / 5 = 2.28; max 6, min 0.4
    w, keep, m = _mw(*_batch(), "tis", "token", cap=2.0)
    _check(w, keep, m, [[2.0, 0.5, 1.0], [1.5, 0.4, 2.0]],
           [[True, True, False], [True, True, True]], [2.28, 0.4, 0.0, 6.0, 0.4])


def test_tis_sequence_uses_the_full_product():
    # cap 2: W = [1.5, min(3.6, 2) = 2] broadcast; 1 of 2 sequences truncated
    # mean (1.5 + 3.6) / 2 = 2.55; max 3.6, min 1.5
    w, keep, m = _mw(*_batch(), "tis", "sequence", cap=2.0)
    _check(w, keep, m, [[1.5, 1.5, 1.0], [2.0, 2.0, 2.0]],
           [[True, True, False], [True, True, True]], [2.55, 0.5, 0.0, 3.6, 1.5])


def test_tis_geometric_uses_the_mean():
    # cap 1.5: G = [1.2247, min(1.5326, 1.5) = 1.5]; 1 of 2 truncated; mean (G0 + G1) / 2
    w, keep, m = _mw(*_batch(), "tis", "geometric", cap=1.5)
    _check(w, keep, m, [[G0, G0, 1.0], [1.5, 1.5, 1.5]],
           [[True, True, False], [True, True, True]], [(G0 + G1) / 2, 0.5, 0.0, G1, G0])


def test_tis_sequence_clamps_the_log_product():
    # max_log_ratio 1: log W_1 = ln 3.6 = 1.28 > 1 is clamped, W_1 = e = 2.718 (then cap 5 does
    # not truncate it); log W_0 = ln 1.5 = 0.405 is untouched
    w, _, m = _mw(*_batch(), "tis", "sequence", cap=5.0, max_log_ratio=1.0)
    assert w[1].tolist() == pytest.approx([math.e] * 3, rel=1e-12)
    assert w[0, :2].tolist() == pytest.approx([1.5, 1.5], rel=1e-12)
    assert m["mismatch_is/weight_max"] == pytest.approx(math.e, rel=1e-12)
    assert m["mismatch_is/truncated_frac"] == 0.0


def test_mis_token_icepop_bounds():
    # IcePop bounds [0.5, 5]: 3 and 1.5 inside; 0.5 is on the bound and kept (exp(ln 0.5) is
    # exactly 0.5 in float64); 0.4 < 0.5 and 6 > 5 masked: 2 of 5 tokens. Weights stay 1.
    w, keep, m = _mw(*_batch(), "mis", "token", cap=5.0, floor=0.5)
    _check(w, keep, m, [[1.0] * 3] * 2,
           [[True, True, False], [True, False, False]], [2.28, 0.0, 0.4, 6.0, 0.4])


def test_mis_sequence_masks_whole_sequences():
    # [0.5, 2]: W_0 = 1.5 kept, W_1 = 3.6 masked (every token of row 1): 1 of 2 sequences
    w, keep, m = _mw(*_batch(), "mis", "sequence", cap=2.0, floor=0.5)
    _check(w, keep, m, [[1.0] * 3] * 2,
           [[True, True, False], [False, False, False]], [2.55, 0.0, 0.5, 3.6, 1.5])
    # [0.5, 1.4]: both full products are above 1.4: both masked
    _, keep, m = _mw(*_batch(), "mis", "sequence", cap=1.4, floor=0.5)
    assert not keep.any() and m["mismatch_is/masked_frac"] == 1.0


def test_mis_geometric_masks_by_the_mean():
    # [0.5, 1.4]: G_0 = 1.2247 kept, G_1 = 1.5326 masked (the full product masked both above)
    w, keep, m = _mw(*_batch(), "mis", "geometric", cap=1.4, floor=0.5)
    _check(w, keep, m, [[1.0] * 3] * 2,
           [[True, True, False], [False, False, False]], [(G0 + G1) / 2, 0.0, 0.5, G1, G0])
    # [0.5, 2]: both geometric means inside: nothing masked
    _, keep, m = _mw(*_batch(), "mis", "geometric", cap=2.0, floor=0.5)
    assert keep.tolist() == _batch()[2].tolist() and m["mismatch_is/masked_frac"] == 0.0


def test_mis_floor_masks_low_sequences():
    # [0.9, 2] at level "geometric" on w = [0.5, 0.5] (G = 0.5 < 0.9) and [1.1] (G = 1.1)
    old = torch.tensor([[L(0.5), L(0.5)], [L(1.1), NAN]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    _, keep, m = _mw(old, torch.zeros(2, 2, dtype=F64), mask, "mis", "geometric", cap=2.0,
                     floor=0.9)
    assert keep.tolist() == [[False, False], [True, False]]
    assert m["mismatch_is/masked_frac"] == 0.5
    assert m["mismatch_is/weight_min"] == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("level", algo.MISMATCH_LEVELS)
def test_none_gives_ones_and_keeps_the_mask(level):
    # untruncated metrics still reported: the token mean 2.28, or the sequence means
    w, keep, m = _mw(*_batch(), "none", level)
    assert torch.equal(w, torch.ones(2, 3, dtype=F64))
    assert torch.equal(keep, _batch()[2])
    assert m["mismatch_is/truncated_frac"] == 0.0 and m["mismatch_is/masked_frac"] == 0.0
    expected_mean = {"token": 2.28, "sequence": 2.55, "geometric": (G0 + G1) / 2}[level]
    assert m["mismatch_is/weight_mean"] == pytest.approx(expected_mean, rel=1e-12)


@pytest.mark.parametrize("level", algo.MISMATCH_LEVELS)
def test_empty_rows_and_detached_outputs(level):
    # row 1 is empty (garbage everywhere): weight 1, keep nothing, and not in the metrics,
    # which are those of row 0 alone: w = [2, 2] -> tokens 2, product 4, geometric 2; cap 3
    # truncates the product to 3 only.
    old = torch.tensor([[L(2.0), L(2.0)], [NAN, math.inf]], dtype=F64, requires_grad=True)
    sampler = torch.tensor([[0.0, 0.0], [-math.inf, NAN]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1], [0, 0]])
    w, keep, m = _mw(old, sampler, mask, "tis", level, cap=3.0)
    unit = {"token": 2.0, "sequence": 4.0, "geometric": 2.0}[level]
    torch.testing.assert_close(w, torch.tensor([[min(unit, 3.0)] * 2, [1.0, 1.0]], dtype=F64),
                               rtol=1e-12, atol=0)
    assert keep.tolist() == [[True, True], [False, False]]
    assert m["mismatch_is/weight_mean"] == pytest.approx(unit, rel=1e-12)
    assert m["mismatch_is/truncated_frac"] == (1.0 if level == "sequence" else 0.0)
    assert not w.requires_grad and not keep.requires_grad
    # no valid token at all: mean / max / min 1, fractions 0
    _, keep, m = _mw(old, sampler, torch.zeros(2, 2), "mis", level)
    assert not keep.any()
    assert m == dict(zip(MISMATCH_METRICS, [1.0, 0.0, 0.0, 1.0, 1.0]))


# --------------------------------------------------------------------------------------------
# policy_loss(weights=...)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level,aggregation,max_len,per_token", COMBOS)
def test_weights_none_equals_all_ones_bitwise(level, aggregation, max_len, per_token):
    logp, old, adv, mask = random_batch(3, level, per_token)
    kw = dict(level=level, aggregation=aggregation, max_len=max_len)
    loss, m = policy_loss(logp, old, adv, mask, **kw)
    ones = torch.ones_like(old).masked_fill(~mask, NAN)  # NaN padding is never read
    loss_1, m_1 = policy_loss(logp, old, adv, mask, weights=ones, **kw)
    assert torch.equal(loss, loss_1) and m == m_1
    assert torch.equal(_grad(loss, logp), _grad(loss_1, logp))


def _token_case():
    # paper token clip (0.2, 0.27) as in test_algo.test_token_level_hand_values:
    # (0, 0): w = 1.5 > 1.27, A = +1, clipped term 1.27 (no gradient)
    # (0, 1): w = 0.5, A = +1, term 0.5 (unclipped)
    # (1, 0): w = 0.5, A = -1, clipped term -0.8 (no gradient);  (1, 1) padding
    logp = torch.tensor([[L(1.5), L(0.5)], [L(0.5), -1e30]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    weights = torch.tensor([[2.0, 3.0], [0.5, NAN]], dtype=F64)
    return logp, old, adv, mask, weights


@pytest.mark.parametrize("aggregation,expected,grad01", [
    # row 0: (2 * 1.27 + 3 * 0.5) / 2 = 4.04 / 2 = 2.02; row 1: 0.5 * -0.8 = -0.4
    # J = (2.02 - 0.4) / 2 = 0.81; d loss / d logp_01 = -(1/2)(1/2) * 3 * A * w = -0.375
    ("seq-mean-token-mean", -0.81, -0.375),
    # (2.54 + 1.5 - 0.4) / 3 = 3.64 / 3; gradient -(1/3) * 3 * 0.5 = -0.5
    ("token-mean", -3.64 / 3, -0.5),
])
def test_token_level_weights_hand_values(aggregation, expected, grad01):
    logp, old, adv, mask, weights = _token_case()
    loss, m = policy_loss(logp, old, adv, mask, level="token", aggregation=aggregation,
                          weights=weights)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, grad01], [0.0, 0.0]], dtype=F64),
                               rtol=1e-12, atol=0)
    # metrics come from the ratios, not the weights: as unweighted (2 of 3 tokens clipped)
    _, m0 = policy_loss(logp, old, adv, mask, level="token", aggregation=aggregation)
    assert {k: v for k, v in m.items() if k != "loss"} == \
        {k: v for k, v in m0.items() if k != "loss"}
    assert m["loss"] == loss.item()


def _sequence_case():
    # row 0: log-ratios 1e-4, 1e-4 (padding inf): s_0 = e^1e-4, A = +1, unclipped
    # row 1: log-ratios 2e-4, 0, 1e-4: mean 1e-4, s_1 = e^1e-4, A = -1, unclipped
    logp = torch.tensor([[1e-4, 1e-4, math.inf], [2e-4, 0.0, 1e-4]], dtype=F64,
                        requires_grad=True)
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    return logp, old, adv, mask


@pytest.mark.parametrize("weights", [
    [[2.0, 2.0, NAN], [0.5, 0.5, 0.5]],  # W = [2, 0.5] broadcast
    [[1.0, 3.0, -7.0], [0.0, 1.5, 0.0]],  # row means 2 and 0.5: the same loss
])
def test_sequence_level_weights_scale_the_sequence_term(weights):
    # J = (W_0 s A_0 + W_1 s A_1) / 2 = (2 s - 0.5 s) / 2 = 0.75 s, s = e^1e-4
    # Eq. 10 times W_i: d loss / d logp_it = -W_i A_i s / (B |y_i|)
    #   row 0: -2 * 1 * s / (2 * 2) = -s / 2;  row 1: -0.5 * -1 * s / (2 * 3) = s / 12
    logp, old, adv, mask = _sequence_case()
    w = torch.tensor(weights, dtype=F64)
    loss, _ = policy_loss(logp, old, adv, mask, level="sequence", weights=w)
    s = math.exp(1e-4)
    assert loss.item() == pytest.approx(-0.75 * s, rel=1e-12)
    loss.backward()
    expected = torch.tensor([[-s / 2, -s / 2, 0.0], [s / 12] * 3], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_sequence_token_with_sequence_weights_equals_sequence(seed):
    logp, old, adv, mask = random_batch(seed, "sequence")
    g = torch.Generator().manual_seed(100 + seed)
    W = 3.0 * torch.rand(logp.shape[0], 1, generator=g, dtype=F64)  # (B, 1) in [0, 3)
    weights = W.expand_as(old).masked_fill(~mask, NAN)
    loss, m = policy_loss(logp, old, adv, mask, level="sequence", weights=weights)
    loss_t, m_t = policy_loss(logp, old, adv, mask, level="sequence_token", weights=weights)
    assert loss_t.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    assert m_t == pytest.approx(m, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(_grad(loss_t, logp), _grad(loss, logp), rtol=1e-12, atol=1e-15)
    # and the weights did change the loss (random_batch has clipped and unclipped rows)
    loss_0, _ = policy_loss(logp, old, adv, mask, level="sequence")
    assert loss.item() != loss_0.item()


def test_mis_keep_as_mask_drops_tokens_from_the_ratio():
    # IcePop at level "token" on the GSPO loss: row 0 has token weights [1, 0.4] (0.4 < 0.5
    # masked), so s_0 is the log-ratio of token 0 alone: s_0 = e^1e-4, |y_0| = 1.
    # row 1 keeps both tokens. Same as the loss on the batch with token (0, 1) padded.
    logp = torch.tensor([[1e-4, 5.0], [1e-4, 3e-4]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 2, dtype=F64)
    sampler = torch.tensor([[0.0, -L(0.4)], [0.0, 0.0]], dtype=F64)  # old - sampler = ln 0.4
    mask = torch.ones(2, 2, dtype=torch.bool)
    weights, keep, m = _mw(old, sampler, mask, "mis", "token", cap=5.0, floor=0.5)
    assert keep.tolist() == [[True, False], [True, True]] and m["mismatch_is/masked_frac"] == 0.25
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    loss, metrics = policy_loss(logp, old, adv, keep, weights=weights)
    # J = (s_0 * 1 + s_1 * -1) / 2 with s_1 = e^2e-4
    assert loss.item() == pytest.approx(-(math.exp(1e-4) - math.exp(2e-4)) / 2, rel=1e-12)
    assert metrics["completion/len_mean"] == 1.5
    assert _grad(loss, logp)[0, 1].item() == 0.0


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,level,cap,floor,match", [
    ("is", "token", 2.0, 0.5, "mismatch_correction"),
    ("TIS", "token", 2.0, 0.5, "mismatch_correction"),
    ("tis", "tokens", 2.0, 0.5, "mismatch_level"),
    ("mis", "sequence_token", 2.0, 0.5, "mismatch_level"),
    ("tis", "token", 1.0, 0.5, "mismatch_cap"),
    ("tis", "token", 0.5, 0.5, "mismatch_cap"),
    ("tis", "token", math.inf, 0.5, "mismatch_cap"),
    ("tis", "token", math.nan, 0.5, "mismatch_cap"),
    ("mis", "token", True, 0.5, "mismatch_cap"),
    ("mis", "sequence", "2", 0.5, "mismatch_cap"),
    ("mis", "token", 5.0, -0.1, "mismatch_floor"),
    ("mis", "token", 5.0, 1.0, "mismatch_floor"),
    ("mis", "geometric", 5.0, math.nan, "mismatch_floor"),
    ("mis", "token", 5.0, None, "mismatch_floor"),
])
def test_bad_mismatch_arguments_raise_naming_the_argument(method, level, cap, floor, match):
    with pytest.raises(ValueError, match=match):
        validate_mismatch(method, level, cap, floor)
    with pytest.raises(ValueError, match=match):
        _mw(*_batch(), method, level, cap=cap, floor=floor)


def test_good_mismatch_arguments_pass():
    validate_mismatch("tis", "token", 2.0, -5.0)  # tis ignores the floor
    validate_mismatch("tis", "sequence", 2.0, None)
    validate_mismatch("mis", "token", 5.0, 0.5)  # IcePop
    validate_mismatch("mis", "geometric", 1.001, 0.0)
    validate_mismatch("none", "token", 2.0, None)


def test_mismatch_weights_tensor_checks():
    old, sampler, mask = _batch()
    with pytest.raises(ValueError, match="max_log_ratio"):
        _mw(old, sampler, mask, "tis", "token", max_log_ratio=0.0)
    with pytest.raises(ValueError, match="sampler_logp"):
        _mw(old, sampler[:, :2], mask, "tis", "token")
    with pytest.raises(ValueError, match="mask"):
        _mw(old, sampler, mask[:1], "tis", "token")
    bad = sampler.clone()
    bad[0, 0] = NAN  # NaN at a valid position
    with pytest.raises(ValueError, match="finite"):
        _mw(old, bad, mask, "tis", "sequence")
    bad[0, 0] = math.inf
    with pytest.raises(ValueError, match="finite"):
        _mw(old, bad, mask, "mis", "token")


@pytest.mark.parametrize("bad", ["negative", "nan", "inf", "shape", "list"])
def test_policy_loss_rejects_bad_weights(bad):
    logp, old, adv, mask, weights = _token_case()
    weights = {
        "negative": torch.tensor([[1.0, -1e-3], [1.0, 1.0]], dtype=F64),
        "nan": torch.tensor([[NAN, 1.0], [1.0, 1.0]], dtype=F64),
        "inf": torch.tensor([[1.0, 1.0], [math.inf, 1.0]], dtype=F64),
        "shape": torch.ones(2, dtype=F64),
        "list": [[1.0, 1.0], [1.0, 1.0]],
    }[bad]
    for level in algo.LEVELS:
        with pytest.raises(ValueError, match="weights"):
            policy_loss(logp, old, adv, mask, level=level, weights=weights)


def test_policy_loss_accepts_anything_at_masked_weight_positions():
    # position (1, 1) is padding: NaN, inf or negative there changes nothing, bit for bit
    logp, old, adv, mask, weights = _token_case()
    ref = weights.clone()
    ref[1, 1] = 1.0
    loss_ref, _ = policy_loss(logp, old, adv, mask, level="token", weights=ref)
    grad_ref = _grad(loss_ref, logp)
    for v in (NAN, math.inf, -5.0):
        weights[1, 1] = v
        loss, _ = policy_loss(logp, old, adv, mask, level="token", weights=weights)
        assert torch.equal(loss, loss_ref)
        assert torch.equal(_grad(loss, logp), grad_ref)


def test_the_mismatch_kl_is_exact_for_the_small_gaps_it_measures():
    """It was e^-d - 1 + d in float32: 5.6x too high at gaps of 3e-5, and exactly 0 under an fp16
    or bf16 sampler whose token gaps were ~4e-5."""
    from gspo.train.step_metrics import mismatch_metrics

    g = torch.Generator().manual_seed(0)
    trainer = torch.randn(4, 6, generator=g) - 3.0
    for scale in (1e-2, 1e-4, 3e-5):
        d = torch.randn(4, 6, generator=g) * scale
        sampler = trainer + d
        d64 = (sampler.double() - trainer.double())  # the gap the float32 tensors hold
        exact = (d64 ** 2 / 2 - d64 ** 3 / 6 + d64 ** 4 / 24).mean().item()
        got = mismatch_metrics(sampler, trainer, torch.ones(4, 6))["mismatch/kl"]
        assert got == pytest.approx(exact, rel=1e-6), (scale, got, exact)
