"""Tests of gspo.algo: property tests (hypothesis) for finiteness, permutation invariance and
GSPO-token == GSPO, and the argument checks that name the bad argument."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algo_defaults import policy_loss, validate_algo
from test_algo import COMBOS, _grad

F64 = torch.float64
SEQ_EPS = (3e-4, 4e-4)  # paper section 5.1


# --------------------------------------------------------------------------------------------
# Property tests
# --------------------------------------------------------------------------------------------
@st.composite
def batches(draw, max_abs=1e4):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 5))
    floats = st.floats(-max_abs, max_abs, allow_nan=False)
    lr = torch.tensor(draw(st.lists(floats, min_size=B * T, max_size=B * T)), dtype=F64)
    old = torch.tensor(draw(st.lists(st.floats(-50, 0), min_size=B * T, max_size=B * T)),
                       dtype=F64)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T)))
    combo = draw(st.sampled_from(COMBOS))
    n_adv = B * T if combo[3] else B
    adv = torch.tensor(draw(st.lists(st.floats(-10, 10), min_size=n_adv, max_size=n_adv)),
                       dtype=F64)
    old = old.reshape(B, T)
    return (old + lr.reshape(B, T)), old, adv.reshape(B, T) if combo[3] else adv, \
        mask.reshape(B, T), combo


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from([torch.float32, F64]))
def test_finite_inputs_give_finite_loss_and_gradient(batch, dtype):
    logp, old, adv, mask, (level, aggregation, max_len, _) = batch
    logp = logp.to(dtype).requires_grad_()
    loss, m = policy_loss(logp, old.to(dtype), adv.to(dtype), mask, level=level,
                          aggregation=aggregation, max_len=max_len)
    assert torch.isfinite(loss) and torch.isfinite(_grad(loss, logp)).all()
    assert all(math.isfinite(v) for v in m.values())


@settings(max_examples=40, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_permuting_sequences_leaves_loss_unchanged(batch, rnd):
    logp, old, adv, mask, (level, aggregation, max_len, _) = batch
    perm = list(range(logp.shape[0]))
    rnd.shuffle(perm)
    kw = dict(level=level, aggregation=aggregation, max_len=max_len)
    logp = logp.requires_grad_()
    loss, m = policy_loss(logp, old, adv, mask, **kw)
    lp2 = logp.detach()[perm].requires_grad_()
    loss2, m2 = policy_loss(lp2, old[perm], adv[perm], mask[perm], **kw)
    assert loss2.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(_grad(loss2, lp2), _grad(loss, logp)[perm], rtol=1e-12,
                               atol=1e-15)
    assert m2 == pytest.approx(m, rel=1e-12, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(batches(max_abs=1e-2))
def test_property_gspo_token_equals_gspo(batch):
    logp, old, adv, mask, _ = batch
    adv = adv if adv.dim() == 1 else adv[:, 0]
    logp = logp.requires_grad_()
    loss, m = policy_loss(logp, old, adv, mask, level="sequence", max_log_ratio=5e-3)
    loss_t, m_t = policy_loss(logp, old, adv, mask, level="sequence_token", max_log_ratio=5e-3)
    assert loss_t.item() == pytest.approx(loss.item(), rel=1e-12, abs=1e-15)
    assert m_t == pytest.approx(m, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(_grad(loss_t, logp), _grad(loss, logp), rtol=1e-10, atol=1e-15)


# --------------------------------------------------------------------------------------------
# Argument validation
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,match", [
    (dict(level="sequence_level"), "level"),
    (dict(eps_low=-0.1), "eps_low"),
    (dict(eps_low=1.0), "eps_low"),
    (dict(eps_low=math.nan), "eps_low"),
    (dict(eps_low=True), "eps_low"),
    (dict(eps_high=-1e-4), "eps_high"),
    (dict(level="sequence", aggregation="token-mean"), "aggregation"),
    (dict(level="sequence_token", aggregation="seq-mean-token-sum-norm", max_len=8),
     "aggregation"),
    (dict(level="token", aggregation="sum"), "aggregation"),
    (dict(level="token", aggregation="seq-mean-token-sum-norm"), "max_len"),
    (dict(level="token", aggregation="seq-mean-token-sum-norm", max_len=0), "max_len"),
    (dict(level="token", max_len=16), "max_len"),
    (dict(max_log_ratio=0.0), "max_log_ratio"),
    (dict(max_log_ratio=-1.0), "max_log_ratio"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, match):
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, logp, torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), **kwargs)
    positional = {k: kwargs[k] for k in ("level", "eps_low", "eps_high", "aggregation",
                                         "max_len") if k in kwargs}
    extra = {"max_log_ratio": kwargs["max_log_ratio"]} if "max_log_ratio" in kwargs else {}
    with pytest.raises(ValueError, match=match):
        validate_algo(**positional, **extra)


@pytest.mark.parametrize("shapes,level,match", [
    (((3,), (3,), (2,), (3,)), "sequence", "logp"),
    (((2, 3), (2, 4), (2,), (2, 3)), "sequence", "old_logp"),
    (((2, 3), (2, 3), (2,), (3, 2)), "sequence", "mask"),
    (((2, 3), (2, 3), (3,), (2, 3)), "sequence", "advantages"),
    (((2, 3), (2, 3), (2, 3), (2, 3)), "sequence", "advantages"),
    (((2, 3), (2, 3), (2, 3, 1), (2, 3)), "token", "advantages"),
    (((0, 3), (0, 3), (0,), (0, 3)), "sequence", "logp"),
])
def test_bad_shapes_raise_naming_the_argument(shapes, level, match):
    logp, old, adv, mask = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        policy_loss(logp, old, adv, mask, level=level)
