"""Train/inference mismatch corrections: importance weights pi_trainer(theta_old) / pi_sampler,
truncated (TIS) or masked (MIS, IcePop), per token, per sequence or per geometric mean."""

from __future__ import annotations

import math

import torch

from gspo.algo.checks import _check_max_log_ratio, _check_number, _check_tensors

MISMATCH_METHODS = ("none", "tis", "mis")
MISMATCH_LEVELS = ("token", "sequence", "geometric")
# metrics of mismatch_weights: means, fractions, max and min over its units (valid tokens at
# mismatch level "token", non-empty sequences at "sequence" and "geometric")
MISMATCH_METRICS = ("mismatch_is/weight_mean", "mismatch_is/truncated_frac",
                    "mismatch_is/masked_frac", "mismatch_is/weight_max", "mismatch_is/weight_min")


def validate_mismatch(method: str, level: str, cap: float, floor: float) -> None:
    """Check the non-tensor arguments of `mismatch_weights` (config names mismatch_correction,
    mismatch_level, mismatch_cap, mismatch_floor). Raises ValueError naming the bad argument.

    Rules: method in MISMATCH_METHODS, level in MISMATCH_LEVELS; cap finite and > 1 for every
    method (a cap <= 1 would truncate or mask the on-policy weight 1 itself); with "mis" also
    0 <= floor < 1. floor is ignored by "tis" (which only truncates from above) and "none".
    """
    if method not in MISMATCH_METHODS:
        raise ValueError(f"mismatch_correction must be one of {MISMATCH_METHODS}, got {method!r}")
    if level not in MISMATCH_LEVELS:
        raise ValueError(f"mismatch_level must be one of {MISMATCH_LEVELS}, got {level!r}")
    cap = _check_number("mismatch_cap", cap, low=-math.inf)
    if cap <= 1:
        raise ValueError(f"mismatch_cap must be > 1, got {cap!r}")
    if method == "mis":
        _check_number("mismatch_floor", floor, low=0.0, high=1.0)


@torch.no_grad()
def mismatch_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, *,
                     method: str, level: str, cap: float, floor: float, max_log_ratio: float
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Train/inference mismatch correction: importance weights w = pi_trainer(theta_old) /
    pi_sampler, for the `weights` and `mask` of `policy_loss`.

    old_logp: (B, T) the trainer's log-probs under the old weights; sampler_logp: (B, T) the
    sampler's (e.g. vLLM's) log-probs of the same tokens; mask as in the module docstring
    (garbage at masked positions, even inf or NaN, is never read; valid positions must be
    finite, else ValueError). Per valid token
    log w_t = old_logp_t - sampler_logp_t, and the weight at `level` is
        "token":     w_t = exp(clamp(log w_t))                 per token
        "sequence":  W_i = exp(clamp(sum_t log w_t))           the FULL product prod_t w_t,
                     the sequence importance ratio (`sequence_log_ratio_sum`), broadcast
        "geometric": W_i = exp(clamp((1/|y_i|) sum_t log w_t)) the geometric mean, GSPO-style
                     length normalisation (`sequence_log_ratio`), broadcast
    with clamp to +-max_log_ratio as in the loss. `method`:
        "none": weights 1, keep = mask.
        "tis":  truncated IS (Yao et al. 2025): weights = min(w, cap), keep = mask.
        "mis":  masked IS: weights 1, keep = mask & (floor <= w <= cap): out-of-range tokens,
                or every token of an out-of-range sequence, leave the loss. At level "token"
                with floor 0.5, cap 5 this is IcePop's token masking (values as reported).

    Returns (weights (B, T) float, 1 at masked positions; keep (B, T) bool; metrics), all
    detached; `apply_keep` makes them policy_loss's `weights` and `mask` for an objective's
    level. Float metrics (MISMATCH_METRICS) over the level's units, valid tokens or non-empty
    sequences: weight_mean / weight_max / weight_min of the UNtruncated w, truncated_frac
    (w > cap, "tis" only, else 0), masked_frac
    (outside [floor, cap], "mis" only, else 0). With no unit: mean, max and min are 1.
    """
    validate_mismatch(method, level, cap, floor)
    max_log_ratio = _check_max_log_ratio(max_log_ratio)
    mask = _check_tensors(old_logp, sampler_logp, mask, ("old_logp", "sampler_logp", "mask"))
    dt = torch.promote_types(torch.promote_types(old_logp.dtype, sampler_logp.dtype),
                             torch.float32)
    tok_lr = torch.where(mask, old_logp.to(dt) - sampler_logp.to(dt), 0.0)  # (B, T) log w_t
    if not torch.isfinite(tok_lr).all():  # else the sums below could be inf - inf = NaN
        raise ValueError("old_logp and sampler_logp must be finite at valid positions "
                         "(mask != 0)")
    lengths = torch.count_nonzero(mask, dim=-1)  # (B,)
    if level == "token":
        log_w, valid = tok_lr, mask  # (B, T) per token
    else:
        log_w = tok_lr.sum(-1)  # (B,) log of the full product
        if level == "geometric":
            log_w = log_w / lengths.clamp(min=1).to(dt)  # (B,) log of the geometric mean
        valid = lengths > 0  # (B,) non-empty sequences
    w = log_w.clamp(-max_log_ratio, max_log_ratio).exp()  # (B, T) or (B,) untruncated

    truncated = torch.zeros_like(valid)
    outside = torch.zeros_like(valid)
    unit_keep = torch.ones_like(valid)
    if method == "tis":
        truncated = valid & (w > cap)
        unit_w = w.clamp(max=cap)
    else:  # "none" and "mis" weight 1; "mis" masks instead
        unit_w = torch.ones_like(w)
        if method == "mis":
            unit_keep = (w >= floor) & (w <= cap)
            outside = valid & ~unit_keep
    if level != "token":  # broadcast each sequence's unit to its tokens
        unit_w, unit_keep = unit_w[:, None], unit_keep[:, None]
    weights = torch.where(mask, unit_w, 1.0)  # (B, T)
    keep = mask & unit_keep  # (B, T)

    n = torch.count_nonzero(valid).clamp(min=1).double()
    any_unit = valid.any()
    values = torch.stack([v.double() for v in (
        torch.where(any_unit, torch.where(valid, w, 0.0).sum() / n, 1.0),
        torch.count_nonzero(truncated) / n,
        torch.count_nonzero(outside) / n,
        torch.where(any_unit, torch.where(valid, w, -math.inf).max(), 1.0),
        torch.where(any_unit, torch.where(valid, w, math.inf).min(), 1.0),
    )]).tolist()  # one device sync for all metrics
    return weights, keep, dict(zip(MISMATCH_METRICS, values))


def apply_keep(weights: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, level: str
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """`mismatch_weights`' (weights, keep) as `policy_loss` takes them, for an objective at `level`
    over the loss tokens `mask`: (weights, mask). What MIS drops leaves the loss's sum either way;
    whether it leaves the count too is the level's:

    - "token" (GRPO, SAPO, CISPO): a dropped token is a weight of 0 and stays in the count, as
      IcePop writes it (1 / sum_i |y_i| over every token) and TRL masks. Then a minibatch's
      token-mean is the same however it is cut into forwards, whose counts are known before
      their pi_old is (the first minibatch's pi_old is its own forward). The KL and entropy terms,
      and the metrics, still take every loss token, as TRL's masking leaves them.
    - "sequence", "sequence_token" (GSPO, GSPO-token, GMPO, LUSPO): a dropped token leaves the
      sequence's ratio s_i and its length |y_i| (`mask & keep`); a sequence left with no token
      adds 0 and still counts in the mean over sequences, so no cut changes that mean either. The
      KL and entropy terms take the same mask."""
    if level == "token":
        return weights * keep.to(weights.dtype), mask
    return weights, mask & keep
