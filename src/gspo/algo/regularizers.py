"""Terms added to the policy loss: a KL penalty towards a frozen reference policy, and an
entropy bonus. GSPO's paper uses neither (its Eq. 5 has no KL term and no reference model);
both are off by default in gspo (`algo.kl_coef = 0`, `algo.entropy_coef = 0`)."""

from __future__ import annotations

import torch

from gspo.algo.checks import _check_max_log_ratio, _check_tensors
from gspo.algo.policy import AGGREGATIONS, aggregate, check_max_len

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_terms(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, *, estimator: str,
             max_log_ratio: float) -> torch.Tensor:
    """Per-token estimates of KL(pi_theta || pi_ref) on tokens sampled from the rollout's policy
    (Schulman, "Approximating KL divergence", 2020), with log r = ref_logp - logp:
        "k1"  -log r                  unbiased, can be negative per token
        "k2"  (log r)^2 / 2           biased, >= 0
        "k3"  r - 1 - log r           unbiased, >= 0 (GRPO's, DeepSeekMath Eq. 4)
    log r is clamped to +-max_log_ratio before exp (k3), so finite inputs give finite values.
    (B, T) -> (B, T), 0 at masked positions (garbage there is never read). The gradient flows
    through `logp` only; `ref_logp` is a constant. The tokens come from pi_old, not pi_theta:
    like GRPO's implementations, the estimate ignores that difference (zero on the first
    minibatch, where pi_theta = pi_old).

    "Unbiased" is said of the values. In the loss, what pulls is each term's gradient, whose
    expectation over tokens drawn from pi_theta is: k1 zero (it does not pull towards pi_ref at
    all: `kl_loss_note`), k2 the gradient of KL(pi_theta || pi_ref), k3 that of the reverse
    KL(pi_ref || pi_theta) (GRPO's, TRL's and verl's default penalty)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    max_log_ratio = _check_max_log_ratio(max_log_ratio)
    mask = _check_tensors(logp, ref_logp, mask, ("logp", "ref_logp", "mask"))
    dt = torch.promote_types(logp.dtype, torch.float32)
    log_r = torch.where(mask, ref_logp.detach().to(dt) - logp.to(dt), 0.0)  # (B, T)
    if estimator == "k1":
        k = -log_r
    elif estimator == "k2":
        k = 0.5 * log_r.square()
    else:
        lr = log_r.clamp(-max_log_ratio, max_log_ratio)
        k = torch.expm1(lr) - lr
    return torch.where(mask, k, 0.0)


def kl_loss_note(estimator: str, coef: float) -> str | None:
    """A warning for a k1 term in the loss (`coef` > 0): its expected gradient is zero, so it adds
    noise and no pull towards the reference; None otherwise."""
    if estimator != "k1" or not coef > 0:
        return None
    return ("algo.kl_estimator=k1 in the loss (algo.kl_coef > 0) has zero expected gradient: it adds noise and no "
            "pull towards the reference; k3 (the default) pulls by the gradient of KL(pi_ref || pi_theta), k2 by "
            "that of KL(pi_theta || pi_ref); k1 still logs a fine estimate with logging.kl_reference=true")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, *, estimator: str,
               aggregation: str, max_log_ratio: float, max_len: int | None = None
               ) -> tuple[torch.Tensor, float]:
    """The KL term of the loss, aggregated over tokens as the policy loss is (the objective's
    aggregation: "seq-mean-token-mean" for GSPO, so that a long response does not weigh more
    than a short one), and its token mean as a float for the logs (`kl/ref`).
    Add `kl_coef * term` to the loss."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    check_max_len(aggregation, max_len)
    k = kl_terms(logp, ref_logp, mask, estimator=estimator, max_log_ratio=max_log_ratio)  # (B, T)
    m = mask if mask.dtype == torch.bool else mask != 0
    with torch.no_grad():
        mean = (k.sum() / torch.count_nonzero(m).clamp(min=1)).item()
    return aggregate(k, m, aggregation, max_len), mean


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, *, aggregation: str,
                  max_len: int | None = None) -> tuple[torch.Tensor, float]:
    """The entropy term of the objective, aggregated as the policy loss is, and its token mean
    as a float (`entropy/mean`). `entropy` (B, T) is pi_theta's entropy at each position, from
    the chunked LM head (`gspo.models.logprobs.token_logprobs(entropy=True)`). Subtract
    `entropy_coef * term` from the loss."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    check_max_len(aggregation, max_len)
    m = mask if mask.dtype == torch.bool else mask != 0
    if entropy.shape != m.shape:
        raise ValueError(f"entropy must have the shape of mask {tuple(m.shape)}, got {tuple(entropy.shape)}")
    h = torch.where(m, entropy.float(), 0.0)  # (B, T)
    with torch.no_grad():
        mean = (h.sum() / torch.count_nonzero(m).clamp(min=1)).item()
    return aggregate(h, m, aggregation, max_len), mean
