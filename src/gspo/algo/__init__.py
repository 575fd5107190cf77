"""The GSPO / GRPO math as pure functions of tensors: no model, no config object, no I/O.

Paper: Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071 (v2).

    group_advantages    Eq. 6, group-normalised advantages (or mean-only, Dr. GRPO)
    sequence_log_ratio  log s_i of Eq. 7: masked MEAN of the token log-ratios (GSPO's
                        length-normalised ratio, a geometric mean)
    sequence_log_ratio_sum  masked SUM of the token log-ratios: log of the full product
                        prod_t w_t, the sequence importance ratio (NOT GSPO's s_i)
    policy_loss         level="sequence"        GSPO, Eq. 5-7 (gspo's default)
                        level="sequence_token"  GSPO-token, Eq. 13-17 (per-token advantages)
                        level="token"           GRPO baseline (token ratios), with three
                                                aggregations
                        objective=  clip (PPO's, the papers' default) | sapo | cispo | gmpo |
                                    luspo: the objectives after GSPO, each at its paper's level
                        weights=  an optional per-token weight, e.g. from mismatch_weights
    validate_algo       the argument checks of policy_loss, for start-up validation
    kl_penalty          a KL term towards a frozen reference (k1 / k2 / k3 estimators)
    entropy_bonus       pi_theta's entropy, aggregated as the loss is
    mismatch_weights    train/inference mismatch corrections: importance weights
                        pi_trainer(theta_old) / pi_sampler, truncated (TIS) or masked (MIS,
                        IcePop) per token, per sequence (full product) or per geometric mean
    validate_mismatch   the argument checks of mismatch_weights, for start-up validation

Modules: `advantages`, `policy` (the objectives), `regularizers` (KL, entropy), `mismatch`,
`checks` (shared argument checks).

Conventions. `logp`, `old_logp` and `mask` are (B, T): log-probabilities of the sampled
response tokens under pi_theta and pi_old, and which positions are response tokens (nonzero =
valid). Values at masked positions are never read into the loss or its gradient, so padding
may hold anything, even inf or NaN. The loss is computed in at least float32: the sequence
clip range (1 +- 3e-4) is finer than bfloat16 can resolve near 1.

Where this departs from the paper (each is a choice the paper leaves open):
- Log-ratios are clamped to +-max_log_ratio before exp(), so that finite inputs always give a
  finite loss and gradient. Beyond the clamp the ratio is a constant (its gradient is zero).
  At gspo's default 10 the ratio is e^10 ~ 2.2e4, far outside any clip range.
- An empty response (no valid token) adds 0 to the objective but still counts in the mean
  over sequences (its 1/|y_i| uses max(|y_i|, 1)), at every level.
- Advantages are constants of the objective: they are detached.
"""

from gspo.algo.advantages import group_advantages
from gspo.algo.mismatch import (MISMATCH_LEVELS, MISMATCH_METHODS, MISMATCH_METRICS, apply_keep, mismatch_weights,
                                validate_mismatch)
from gspo.algo.policy import (AGGREGATIONS, LEVELS, OBJECTIVE_LEVELS, OBJECTIVES, ROW_METRICS, SEQUENCE_METRICS,
                              TOKEN_METRICS, aggregate, policy_loss, sapo_gate, sequence_log_ratio,
                              sequence_log_ratio_sum, validate_algo)
from gspo.algo.regularizers import KL_ESTIMATORS, entropy_bonus, kl_loss_note, kl_penalty, kl_terms

__all__ = ["AGGREGATIONS", "KL_ESTIMATORS", "LEVELS", "MISMATCH_LEVELS", "MISMATCH_METHODS", "MISMATCH_METRICS",
           "OBJECTIVES", "OBJECTIVE_LEVELS", "ROW_METRICS", "SEQUENCE_METRICS", "TOKEN_METRICS", "aggregate",
           "apply_keep", "entropy_bonus", "group_advantages", "kl_loss_note", "kl_penalty", "kl_terms",
           "mismatch_weights", "policy_loss", "sapo_gate", "sequence_log_ratio", "sequence_log_ratio_sum",
           "validate_algo", "validate_mismatch"]
