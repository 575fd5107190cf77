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
                        weights=  an optional per-token weight, e.g. from mismatch_weights
    validate_algo       the argument checks of policy_loss, for start-up validation
    mismatch_weights    train/inference mismatch corrections: importance weights
                        pi_trainer(theta_old) / pi_sampler, truncated (TIS) or masked (MIS,
                        IcePop) per token, per sequence (full product) or per geometric mean
    validate_mismatch   the argument checks of mismatch_weights, for start-up validation

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

from __future__ import annotations

import math
import numbers

import torch

LEVELS = ("sequence", "sequence_token", "token")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
MISMATCH_METHODS = ("none", "tis", "mis")
MISMATCH_LEVELS = ("token", "sequence", "geometric")
# metrics of mismatch_weights: means, fractions, max and min over its units (valid tokens at
# mismatch level "token", non-empty sequences at "sequence" and "geometric")
MISMATCH_METRICS = ("mismatch_is/weight_mean", "mismatch_is/truncated_frac",
                    "mismatch_is/masked_frac", "mismatch_is/weight_max", "mismatch_is/weight_min")


def _check_number(name: str, value, *, low: float, high: float | None = None,
                  allow_inf: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def validate_algo(level: str, eps_low: float, eps_high: float, aggregation: str | None = None,
                  max_len: int | None = None, *, max_log_ratio: float) -> tuple[float, float, str]:
    """Check the non-tensor arguments of `policy_loss`; return (eps_low, eps_high, aggregation)
    with the aggregation filled in. Raises ValueError naming the bad argument. The clip range has
    no default here: it differs per level by orders of magnitude (the paper's values are
    `gspo.config.PAPER_CLIP`, where every default of gspo lives).

    Rules: eps_low in [0, 1) (else the lower clip bound 1 - eps_low is not a positive ratio);
    eps_high >= 0 (inf allowed: no upper clip). Levels "sequence" and "sequence_token" accept
    only aggregation None or "seq-mean-token-mean": the paper's objective is a plain mean over
    sequences (Eq. 5, 13); any token-weighted aggregation weights sequences by their length.
    `max_len` is required by, and only accepted with, aggregation "seq-mean-token-sum-norm".
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    eps_low = _check_number("eps_low", eps_low, low=0.0, high=1.0)
    eps_high = _check_number("eps_high", eps_high, low=0.0, allow_inf=True)
    if level in ("sequence", "sequence_token"):
        if aggregation not in (None, "seq-mean-token-mean"):
            raise ValueError(
                f"aggregation={aggregation!r} is not allowed with level={level!r}: GSPO averages "
                "the length-normalised sequence objective over sequences (paper Eq. 5/13), and "
                "any other aggregation weights sequences by their length. Leave aggregation=None.")
        aggregation = "seq-mean-token-mean"
    elif aggregation is None:
        aggregation = "seq-mean-token-mean"
    elif aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be None or one of {AGGREGATIONS}, got {aggregation!r}")
    if aggregation == "seq-mean-token-sum-norm":
        if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 1:
            raise ValueError("max_len must be a positive int (the fixed generation budget) with "
                             f"aggregation='seq-mean-token-sum-norm', got {max_len!r}")
    elif max_len is not None:
        raise ValueError(f"max_len is only used by aggregation='seq-mean-token-sum-norm', but "
                         f"aggregation is {aggregation!r}; leave max_len=None")
    _check_max_log_ratio(max_log_ratio)
    return eps_low, eps_high, aggregation


def _check_max_log_ratio(max_log_ratio) -> float:
    max_log_ratio = _check_number("max_log_ratio", max_log_ratio, low=0.0)
    if max_log_ratio == 0:
        raise ValueError("max_log_ratio must be > 0, got 0")
    return max_log_ratio


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


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str,
                     eps: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-relative advantages, paper Eq. 6: A_i = (r_i - mean(r_group)) / (std(r_group) + eps).

    rewards: (N,) with N = num_groups * group_size; consecutive samples form a group.
    scale="group" divides by the group std (paper); scale="none" only subtracts the group mean
    (Dr. GRPO). std is the POPULATION std (divide by the number of valid rewards n, not n - 1):
    Eq. 6 writes the std of the G rewards themselves, and then sum_i A_i^2 = n exactly (eps
    aside). TRL's unbiased torch.std gives advantages smaller by sqrt((n - 1) / n).

    NaN rewards are missing: they are left out of their group's mean and std and get advantage
    0. A group with fewer than 2 valid rewards, or whose valid rewards are all equal, carries no
    signal: its advantages are exactly 0 (tested with min == max, not std == 0, so rounding in
    the mean cannot leak a tiny nonzero value). Computed in float64; returned in the rewards'
    floating dtype (float32 for integer or bool rewards).

    Returns (advantages (N,), stats) with float stats: adv/frac_zero_std (fraction of groups
    without signal), adv/abs_mean, reward/frac_missing, reward/mean (over valid rewards; NaN if
    none is valid).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D tensor (N,), got "
                         f"{getattr(rewards, 'shape', type(rewards).__name__)}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) \
            or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    n_total = rewards.shape[0]
    if n_total == 0 or n_total % group_size != 0:
        raise ValueError(f"group_size={group_size} must divide the number of rewards "
                         f"(N={n_total}, N > 0)")
    if scale not in ("group", "none"):
        raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")
    eps = _check_number("eps", eps, low=0.0)

    r = rewards.detach().to(torch.float64).reshape(-1, group_size)  # (G, g)
    if torch.isinf(r).any():
        raise ValueError("rewards must be finite or NaN (missing); got +-inf")
    valid = ~torch.isnan(r)  # (G, g)
    n = valid.sum(-1)  # (G,)
    mean = torch.where(valid, r, 0.0).sum(-1) / n.clamp(min=1)  # (G,)
    dev = torch.where(valid, r - mean[:, None], 0.0)  # (G, g)
    # population std, computed on dev / max|dev| so that tiny spreads do not underflow to 0
    spread = dev.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(r.dtype).tiny)  # (G, 1)
    std = spread[:, 0] * ((dev / spread).square().sum(-1) / n.clamp(min=1)).sqrt()  # (G,)
    r_max = torch.where(valid, r, -math.inf).amax(-1)  # (G,)
    r_min = torch.where(valid, r, math.inf).amin(-1)  # (G,)
    signal = (n >= 2) & (r_max > r_min)  # (G,)
    adv = dev / (std[:, None] + eps) if scale == "group" else dev  # (G, g)
    adv = torch.where(signal[:, None] & valid, adv, 0.0)  # (G, g)

    n_valid = int(n.sum())
    stats = {
        "adv/frac_zero_std": (~signal).sum().item() / signal.numel(),
        "adv/abs_mean": adv.abs().mean().item(),
        "reward/frac_missing": (n_total - n_valid) / n_total,
        "reward/mean": (torch.where(valid, r, 0.0).sum() / n_valid).item()
        if n_valid else math.nan,
    }
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    return adv.reshape(-1).to(out_dtype), stats


def _check_tensors(logp, old_logp, mask, names=("logp", "old_logp", "mask")):
    """Shape and dtype checks of two (B, T) log-prob tensors and their mask, whose argument
    names are `names`; returns the mask as bool."""
    n_lp, n_old, n_mask = names
    if not isinstance(logp, torch.Tensor) or logp.dim() != 2:
        raise ValueError(f"{n_lp} must be a 2-D tensor (B, T), got "
                         f"{getattr(logp, 'shape', type(logp).__name__)}")
    if logp.shape[0] == 0:
        raise ValueError(f"{n_lp} must hold at least one sequence (B >= 1), got B = 0")
    for name, t in ((n_old, old_logp), (n_mask, mask)):
        if not isinstance(t, torch.Tensor) or t.shape != logp.shape:
            raise ValueError(f"{name} must have the shape of {n_lp} {tuple(logp.shape)}, got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    if not logp.is_floating_point() or not old_logp.is_floating_point():
        raise ValueError(f"{n_lp} and {n_old} must be floating-point tensors")
    return mask if mask.dtype == torch.bool else mask != 0


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """log s_i of paper Eq. 7: (1/|y_i|) sum_t (logp_it - old_logp_it) over valid tokens.

    This is GSPO's length-normalised ratio: s_i is the GEOMETRIC MEAN of the token ratios. It
    is not the sequence importance ratio prod_t w_t (whose log is the SUM, see
    `sequence_log_ratio_sum`); the two agree only on one-token responses.

    (B, T) -> (B,). |y_i| is clamped to >= 1, so an empty response has log-ratio 0. Masked
    positions are excluded with torch.where (not a multiply), so garbage there, even inf or
    NaN, reaches neither the value nor the gradient. Not clamped; `policy_loss` clamps.
    """
    mask = _check_tensors(logp, old_logp, mask)
    tok = torch.where(mask, logp - old_logp, 0.0)  # (B, T)
    return tok.sum(-1) / torch.count_nonzero(mask, dim=-1).clamp(min=1).to(tok.dtype)  # (B,)


def sequence_log_ratio_sum(logp: torch.Tensor, old_logp: torch.Tensor,
                           mask: torch.Tensor) -> torch.Tensor:
    """The sequence importance ratio's log, NOT GSPO's s_i: sum_t (logp_it - old_logp_it).

    exp of it is the full product prod_t w_t = pi(y_i | x) / pi_old(y_i | x), the likelihood
    ratio of the whole response, which grows or shrinks exponentially with |y_i|. GSPO's
    log s_i (`sequence_log_ratio`) is this divided by |y_i|.

    (B, T) -> (B,). An empty response has log-ratio 0. Garbage at masked positions is
    excluded with torch.where, as in `sequence_log_ratio`. Not clamped.
    """
    mask = _check_tensors(logp, old_logp, mask)
    return torch.where(mask, logp - old_logp, 0.0).sum(-1)  # (B,)


def _check_weights(weights, mask: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The `weights` of policy_loss, detached, in dtype dt, with 0 at masked positions (where
    anything, even NaN, is allowed). Raises ValueError unless finite and >= 0 where valid."""
    if not isinstance(weights, torch.Tensor) or weights.shape != mask.shape:
        raise ValueError(f"weights must be None or a tensor of the shape of logp "
                         f"{tuple(mask.shape)}, got "
                         f"{tuple(getattr(weights, 'shape', ())) or type(weights).__name__}")
    w = weights.detach().to(dt)
    bad = mask & ~(torch.isfinite(w) & (w >= 0))  # NaN fails w >= 0 too
    if bad.any():
        raise ValueError(f"weights must be finite and >= 0 at valid positions (mask != 0); "
                         f"{int(torch.count_nonzero(bad))} are not")
    return torch.where(mask, w, 0.0)


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, lo: float,
                       hi: float) -> torch.Tensor:
    """min(ratio * A, clip(ratio, lo, hi) * A), the PPO-style surrogate of Eq. 5/13/GRPO."""
    return torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, level: str, eps_low: float, eps_high: float,
                aggregation: str | None = None, max_log_ratio: float,
                max_len: int | None = None,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss (to minimise, = -J) and float metrics.

    Args:
        logp, old_logp, mask: (B, T); see the module docstring.
        advantages: (B,) per sequence, or (B, T) per token (not with level="sequence").
        level: "sequence" = GSPO, Eq. 5-7:
                   s_i = exp(clamp(seq_log_ratio_i)),
                   J = mean_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i).
               "sequence_token" = GSPO-token, Eq. 13-17:
                   log s_it = sg[log s_i] + logp_it - sg[logp_it]   (value s_i),
                   J = mean_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it, ...) A_it).
                   With A_it = A_i it equals GSPO in value, clipped set and gradient.
               "token" = GRPO baseline: w_it = exp(clamp(logp_it - old_logp_it)), token-wise
                   clipped surrogate, aggregated by `aggregation`.
        eps_low, eps_high: clip range (paper section 5.1: 3e-4/4e-4 for the sequence levels,
            0.2/0.27 for the token level; `gspo.config.PAPER_CLIP`).
        aggregation: only for level="token" (the sequence levels accept None or
            "seq-mean-token-mean"):
            "seq-mean-token-mean" (default) mean_i (1/|y_i|) sum_t, as in the paper's GRPO;
            "token-mean" (DAPO) sum over all tokens / number of valid tokens;
            "seq-mean-token-sum-norm" (Dr. GRPO) mean_i (1/max_len) sum_t; needs `max_len`.
        max_log_ratio: log-ratios are clamped to +-this before exp(); beyond it the ratio is a
            constant with zero gradient (at both sequence levels alike).
        weights: None (every weight 1: exactly the unweighted loss, bit for bit) or a (B, T)
            multiplicative weight per token, a constant of the objective (detached), e.g. the
            train/inference mismatch correction of `mismatch_weights`. It must be finite and
            >= 0 at valid positions; masked positions are never read. It enters as:
              "token", "sequence_token": each token's clipped term is multiplied by its weight
                  before aggregation, J = mean_i (1/|y_i|) sum_t weights_it * obj_it (likewise
                  for the other token aggregations); TIS as in Yao et al. 2025.
              "sequence": the sequence's term is multiplied by the masked mean of its row's
                  weights, (1/|y_i|) sum_t weights_it; for a sequence weight W_i broadcast over
                  the row that is exactly W_i. With sequence weights broadcast, "sequence_token"
                  and "sequence" therefore still agree (value and gradient).
            Masking tokens or sequences (MIS, IcePop) is not a weight: pass `mask & keep` as
            `mask`, and the dropped tokens leave the ratio s_i, |y_i| and the loss. A sequence
            with no token left adds 0 but still counts in the mean over sequences (as an empty
            response does). The metrics do not depend on the weights (but "loss" is the
            returned, weighted value).
    Metrics (python floats, under no_grad). A token counts as clipped when the clip removes
    its gradient: A > 0 and ratio > 1 + eps_high ("high"), or A < 0 and ratio < 1 - eps_low
    ("low"); the ratio is s_i at the sequence levels and w_it at the token level. So at level
    "sequence" every token of a clipped sequence counts, as in the paper's Fig. 2.
        clip/token_frac, clip/token_frac_low, clip/token_frac_high: over valid tokens.
        clip/seq_frac: fraction of non-empty sequences with any clipped token.
        ratio/seq_mean, ratio/seq_min, ratio/seq_max: s_i over non-empty sequences (all levels).
        kl/approx: k3 estimate of KL(pi_old || pi_theta) per valid token, on tokens sampled from
            pi_old: r - 1 - log r with r = exp(logp - old_logp) (clamped); unbiased since
            E_old[r] = 1, and >= 0 per token.
        completion/len_mean: mean |y_i| over all B sequences.  loss: the returned value.
    """
    eps_low, eps_high, aggregation = validate_algo(level, eps_low, eps_high, aggregation,
                                                   max_len, max_log_ratio=max_log_ratio)
    mask = _check_tensors(logp, old_logp, mask)  # (B, T) bool
    B, T = logp.shape
    if not isinstance(advantages, torch.Tensor) or advantages.shape not in ((B,), (B, T)):
        raise ValueError(f"advantages must be a tensor of shape (B,) = ({B},) or (B, T) = "
                         f"({B}, {T}), got {getattr(advantages, 'shape', type(advantages))}")
    if level == "sequence" and advantages.dim() == 2:
        raise ValueError("advantages must be per sequence, shape (B,), with level='sequence'; "
                         "use level='sequence_token' for per-token advantages (paper Eq. 13)")
    # float32 at least: 1 + 4e-4 and 1 are the same number in bfloat16.
    dt = torch.promote_types(torch.promote_types(logp.dtype, old_logp.dtype), torch.float32)
    logp, old_logp = logp.to(dt), old_logp.to(dt)
    adv = advantages.detach().to(dt)  # (B,) or (B, T)
    w = None if weights is None else _check_weights(weights, mask, dt)  # (B, T), 0 if masked
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    lengths = torch.count_nonzero(mask, dim=-1)  # (B,) |y_i|
    len_f = lengths.clamp(min=1).to(dt)  # (B,) max(|y_i|, 1)
    nonempty = lengths > 0  # (B,)

    tok_lr = torch.where(mask, logp - old_logp, 0.0)  # (B, T) masked token log-ratio
    raw_seq_lr = tok_lr.sum(-1) / len_f  # (B,)
    seq_lr = raw_seq_lr.clamp(-max_log_ratio, max_log_ratio)  # (B,) log s_i
    seq_ratio = seq_lr.exp()  # (B,) s_i

    if level == "sequence":
        obj = _clipped_objective(seq_ratio, adv, lo, hi)  # (B,)
        if w is not None:  # masked mean of the row's weights (W_i for a broadcast W_i)
            obj = obj * (w.sum(-1) / len_f)
        loss = -torch.where(nonempty, obj, 0.0).mean()
        clip_ratio = seq_ratio  # (B,)
    elif level == "sequence_token":
        # Eq. 14: value s_i, gradient that of logp_it alone. Out of the clamp range the live
        # term is dropped, as GSPO's clamp drops the gradient there, so that the two levels
        # agree everywhere (clamp passes the gradient at the bound itself, hence <=).
        in_range = (raw_seq_lr.detach().abs() <= max_log_ratio)[:, None]  # (B, 1)
        lp = torch.where(mask, logp, 0.0)  # (B, T) garbage-free
        live = torch.where(in_range, lp - lp.detach(), 0.0)  # (B, T) zero in value
        ratio_tok = (seq_lr.detach()[:, None] + live).exp()  # (B, T) s_it
        adv_tok = adv[:, None] if adv.dim() == 1 else torch.where(mask, adv, 0.0)  # (B, 1|T)
        obj = torch.where(mask, _clipped_objective(ratio_tok, adv_tok, lo, hi), 0.0)  # (B, T)
        obj = obj if w is None else obj * w  # w is 0 at masked positions
        loss = -(obj.sum(-1) / len_f).mean()
        clip_ratio = seq_ratio  # (B,) equals s_it in value, exactly (live is 0)
    else:
        ratio_tok = tok_lr.clamp(-max_log_ratio, max_log_ratio).exp()  # (B, T) w_it
        adv_tok = adv[:, None] if adv.dim() == 1 else torch.where(mask, adv, 0.0)  # (B, 1|T)
        obj = torch.where(mask, _clipped_objective(ratio_tok, adv_tok, lo, hi), 0.0)  # (B, T)
        obj = obj if w is None else obj * w  # w is 0 at masked positions
        if aggregation == "seq-mean-token-mean":
            loss = -(obj.sum(-1) / len_f).mean()
        elif aggregation == "token-mean":
            loss = -obj.sum() / lengths.sum().clamp(min=1).to(dt)
        else:  # seq-mean-token-sum-norm: fixed denominator, no length bias (Dr. GRPO)
            loss = -(obj.sum(-1) / max_len).mean()
        clip_ratio = ratio_tok  # (B, T)

    metrics = _metrics(loss, clip_ratio, adv, tok_lr, seq_ratio, mask, lengths, max_log_ratio,
                       lo, hi)
    return loss, metrics


# metrics that are means over completion tokens (the rest of `_metrics` are over sequences,
# or a min / max): combined across micro-batches and processes weighted by token counts
TOKEN_METRICS = ("clip/token_frac", "clip/token_frac_low", "clip/token_frac_high", "kl/approx")
# ... and the means over sequences, weighted by sequence counts
SEQUENCE_METRICS = ("clip/seq_frac", "ratio/seq_mean", "completion/len_mean")
# every metric of policy_loss but the loss itself
ROW_METRICS = ("clip/token_frac", "clip/token_frac_low", "clip/token_frac_high", "clip/seq_frac", "ratio/seq_mean",
               "ratio/seq_min", "ratio/seq_max", "kl/approx", "completion/len_mean")


@torch.no_grad()
def _metrics(loss, ratio, adv, tok_lr, seq_ratio, mask, lengths, max_log_ratio, lo, hi):
    """See policy_loss. ratio: (B,) s_i at the sequence levels or (B, T) w_it at the token
    level; adv: (B,) or (B, T). Counts with count_nonzero: summing a bool tensor copies it."""
    nonempty = lengths > 0  # (B,)
    if ratio.dim() == 1 and adv.dim() == 1:  # whole sequences are clipped: count per sequence
        high_s = nonempty & (adv > 0) & (ratio > hi)  # (B,)
        low_s = nonempty & (adv < 0) & (ratio < lo)  # (B,)
        n_high, n_low = (lengths * high_s).sum(), (lengths * low_s).sum()
        n_seq_clipped = torch.count_nonzero(high_s | low_s)
    else:
        r = ratio[:, None] if ratio.dim() == 1 else ratio  # (B, 1) or (B, T)
        a = adv[:, None] if adv.dim() == 1 else adv  # (B, 1) or (B, T)
        high = mask & (a > 0) & (r > hi)  # (B, T) the clip removes the gradient
        low = mask & (a < 0) & (r < lo)  # (B, T)
        n_high, n_low = torch.count_nonzero(high), torch.count_nonzero(low)
        n_seq_clipped = torch.count_nonzero((high | low).any(-1))
    n_tok = lengths.sum().clamp(min=1).double()  # float64 so fractions print exactly
    n_seq = torch.count_nonzero(nonempty).clamp(min=1).double()
    any_seq = nonempty.any()
    lr = tok_lr.clamp(-max_log_ratio, max_log_ratio)  # (B, T)
    k3 = torch.where(mask, torch.expm1(lr) - lr, 0.0)  # (B, T) r - 1 - log r
    s = seq_ratio  # (B,)
    values = torch.stack([v.double() for v in (
        loss,
        (n_high + n_low) / n_tok,
        n_low / n_tok,
        n_high / n_tok,
        n_seq_clipped / n_seq,
        torch.where(any_seq, torch.where(nonempty, s, 0.0).sum() / n_seq, 1.0),
        torch.where(any_seq, torch.where(nonempty, s, math.inf).min(), 1.0),
        torch.where(any_seq, torch.where(nonempty, s, -math.inf).max(), 1.0),
        k3.sum() / n_tok,
        lengths.sum().double() / lengths.numel(),
    )]).tolist()  # one device sync for all metrics
    return dict(zip(("loss", *ROW_METRICS), values))


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
    detached; pass `weights=weights, mask=keep` to policy_loss. Float metrics (MISMATCH_METRICS)
    over the level's units, valid tokens or non-empty sequences: weight_mean / weight_max /
    weight_min of the UNtruncated w, truncated_frac (w > cap, "tis" only, else 0), masked_frac
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
