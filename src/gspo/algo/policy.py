"""The policy-gradient objectives: GSPO (the default), GSPO-token, the GRPO baseline, and the
ones that came after GSPO (SAPO, CISPO, GMPO, LUSPO), as one function `policy_loss`.

An objective is two choices: the `level` of its importance ratio (GSPO's length-normalised
sequence ratio s_i, GSPO-token's s_it, or GRPO's token ratio w_it) and the `objective` applied
to it (PPO's clip, SAPO's soft gate, CISPO's truncated stop-gradient weight, GMPO's clipped
geometric mean, LUSPO's length-weighted clip). Each objective is defined at the level its paper
uses; any other pairing raises (`OBJECTIVE_LEVELS`).
"""

from __future__ import annotations

import math
import numbers

import torch

from gspo.algo.checks import _check_max_log_ratio, _check_number, _check_tensors, _check_weights

LEVELS = ("sequence", "sequence_token", "token")
AGGREGATIONS = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
OBJECTIVES = ("clip", "sapo", "cispo", "gmpo", "luspo")
# the levels each objective is defined at (its paper's); every other pairing raises
OBJECTIVE_LEVELS = {"clip": LEVELS, "sapo": ("token",), "cispo": ("token",), "gmpo": ("sequence",),
                    "luspo": ("sequence",)}
# the objectives whose aggregation over tokens is a choice (the token-level ones); the others
# are means over sequences by definition
TOKEN_AGGREGATED = ("clip", "sapo", "cispo")


def validate_algo(level: str, eps_low: float | None, eps_high: float | None, aggregation: str | None = None,
                  max_len: int | None = None, *, max_log_ratio: float, objective: str = "clip",
                  tau_pos: float | None = None, tau_neg: float | None = None
                  ) -> tuple[float | None, float | None, str]:
    """Check the non-tensor arguments of `policy_loss`; return (eps_low, eps_high, aggregation)
    with the aggregation filled in. Raises ValueError naming the bad argument. The clip range has
    no default here: it differs per level and objective by orders of magnitude (the papers'
    values are `gspo.config.PAPER_CLIP` / `OBJECTIVE_CLIP`, where every default of gspo lives).

    Rules:
    - `objective` in OBJECTIVES, at one of its levels (OBJECTIVE_LEVELS).
    - "clip", "luspo": eps_low in [0, 1) (else the lower bound 1 - eps_low is not a positive
      ratio); eps_high >= 0 (inf allowed: no upper clip).
    - "cispo": eps_low in [0, 1] (1: no lower bound, as MiniMax-M1 runs it); eps_high >= 0.
    - "gmpo": eps_low, eps_high >= 0, bounds of the token LOG-ratio (inf allowed).
    - "sapo": no clip range (eps_low and eps_high must be None); tau_pos, tau_neg > 0.
      tau_pos / tau_neg are refused by every other objective.
    - Levels "sequence" and "sequence_token", and objectives "gmpo" and "luspo", accept only
      aggregation None or "seq-mean-token-mean": the paper's objective is a plain mean over
      sequences (Eq. 5, 13); any token-weighted aggregation weights sequences by their length.
      "cispo" defaults to "token-mean" (MiniMax-M1 divides by the batch's token count), the
      others to "seq-mean-token-mean".
    - `max_len` is required by, and only accepted with, aggregation "seq-mean-token-sum-norm".
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
    if level not in OBJECTIVE_LEVELS[objective]:
        raise ValueError(f"objective={objective!r} is defined at level={OBJECTIVE_LEVELS[objective][0]!r} "
                         f"(its paper's ratio), not level={level!r}")
    if objective == "sapo":
        for name, v in (("eps_low", eps_low), ("eps_high", eps_high)):
            if v is not None:
                raise ValueError(f"{name} is not used by objective='sapo' (a soft gate, no clip range); leave it "
                                 f"None and set tau_pos / tau_neg")
        for name, v in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
            if v is None or _check_number(name, v, low=0.0) == 0:
                raise ValueError(f"{name} must be a number > 0 with objective='sapo', got {v!r}")
    else:
        for name, v in (("tau_pos", tau_pos), ("tau_neg", tau_neg)):
            if v is not None:
                raise ValueError(f"{name} is only used by objective='sapo', but objective is {objective!r}")
        for name, v in (("eps_low", eps_low), ("eps_high", eps_high)):
            if v is None:  # (the config fills them in; a call of its own names them)
                where = f"OBJECTIVE_CLIP[{objective!r}]" if objective in ("gmpo", "cispo") else f"PAPER_CLIP[{level!r}]"
                raise ValueError(f"{name} must be given (no default here: the paper's value is gspo.config.{where})")
        if objective == "gmpo":
            eps_low = _check_number("eps_low", eps_low, low=0.0, allow_inf=True)
        elif objective == "cispo":  # a weight's floor of 1 - eps_low: 0 at most, never negative
            eps_low = _check_number("eps_low", eps_low, low=0.0)
            if eps_low > 1.0:
                raise ValueError(f"eps_low must be in [0.0, 1.0] with objective='cispo', got {eps_low!r}")
        else:
            eps_low = _check_number("eps_low", eps_low, low=0.0, high=1.0)
        eps_high = _check_number("eps_high", eps_high, low=0.0, allow_inf=True)
    per_sequence = level in ("sequence", "sequence_token") or objective not in TOKEN_AGGREGATED
    if per_sequence:
        if aggregation not in (None, "seq-mean-token-mean"):
            raise ValueError(
                f"aggregation={aggregation!r} is not allowed with level={level!r}, objective={objective!r}: the "
                "objective averages a length-normalised sequence term over sequences (GSPO Eq. 5/13), and any other "
                "aggregation weights sequences by their length. Leave aggregation=None.")
        aggregation = "seq-mean-token-mean"
    elif aggregation is None:
        aggregation = "token-mean" if objective == "cispo" else "seq-mean-token-mean"
    elif aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be None or one of {AGGREGATIONS}, got {aggregation!r}")
    check_max_len(aggregation, max_len)
    _check_max_log_ratio(max_log_ratio)
    return eps_low, eps_high, aggregation


def check_max_len(aggregation: str, max_len) -> None:
    """`max_len` is required by, and only accepted with, aggregation "seq-mean-token-sum-norm"."""
    if aggregation == "seq-mean-token-sum-norm":
        if isinstance(max_len, bool) or not isinstance(max_len, numbers.Integral) or max_len < 1:
            raise ValueError("max_len must be a positive int (the fixed generation budget) with "
                             f"aggregation='seq-mean-token-sum-norm', got {max_len!r}")
    elif max_len is not None:
        raise ValueError(f"max_len is only used by aggregation='seq-mean-token-sum-norm', but "
                         f"aggregation is {aggregation!r}; leave max_len=None")


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


def aggregate(x: torch.Tensor, mask: torch.Tensor, aggregation: str, max_len: int | None = None) -> torch.Tensor:
    """A (B, T) per-token quantity, 0 at masked positions, to one number:
    "seq-mean-token-mean"  mean_i (1/max(|y_i|, 1)) sum_t x_it
    "token-mean"           sum_it x_it / max(sum_i |y_i|, 1)
    "seq-mean-token-sum-norm"  mean_i (1/max_len) sum_t x_it"""
    if aggregation == "seq-mean-token-mean":
        return (x.sum(-1) / torch.count_nonzero(mask, dim=-1).clamp(min=1).to(x.dtype)).mean()
    if aggregation == "token-mean":
        return x.sum() / torch.count_nonzero(mask).clamp(min=1).to(x.dtype)
    return (x.sum(-1) / max_len).mean()


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, lo: float,
                       hi: float) -> torch.Tensor:
    """min(ratio * A, clip(ratio, lo, hi) * A), the PPO-style surrogate of Eq. 5/13/GRPO."""
    return torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)


def sapo_gate(ratio: torch.Tensor, adv: torch.Tensor, tau_pos: float, tau_neg: float):
    """SAPO's soft gate (arXiv 2511.20347): f(r) = (4 / tau) sigmoid(tau (r - 1)),
    tau = tau_pos where A > 0 and tau_neg elsewhere. Returns (f(r), its gradient weight
    f'(r) = 4 sigma (1 - sigma)): 1 on-policy (r = 1), falling smoothly to 0 as r leaves 1, so
    the gradient A f'(r) r grad log pi is the plain policy gradient near r = 1 and fades far
    from it instead of being cut at a clip bound."""
    tau = torch.where(adv > 0, ratio.new_tensor(tau_pos), ratio.new_tensor(tau_neg))  # (the ratio's dtype, not float32)
    sig = torch.sigmoid(tau * (ratio - 1.0))
    return 4.0 / tau * sig, 4.0 * sig * (1.0 - sig)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, *, level: str, eps_low: float | None, eps_high: float | None,
                aggregation: str | None = None, max_log_ratio: float,
                max_len: int | None = None, weights: torch.Tensor | None = None,
                objective: str = "clip", tau_pos: float | None = None,
                tau_neg: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy-gradient loss (to minimise, = -J) and float metrics.

    Args:
        logp, old_logp, mask: (B, T); see the module docstring.
        advantages: (B,) per sequence, or (B, T) per token (not with level="sequence").
        level: the importance ratio.
               "sequence" = GSPO, Eq. 5-7:
                   s_i = exp(clamp(seq_log_ratio_i)),
                   J = mean_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i).
               "sequence_token" = GSPO-token, Eq. 13-17:
                   log s_it = sg[log s_i] + logp_it - sg[logp_it]   (value s_i),
                   J = mean_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it, ...) A_it).
                   With A_it = A_i it equals GSPO in value, clipped set and gradient.
               "token" = GRPO baseline: w_it = exp(clamp(logp_it - old_logp_it)), token-wise
                   clipped surrogate, aggregated by `aggregation`.
        objective: what is applied to the ratio (each at its paper's level only):
               "clip"  (any level) PPO's clipped surrogate, as above.
               "sapo"  (token) SAPO, arXiv 2511.20347: J = agg_t (4/tau) sigmoid(tau (w_it - 1)) A_it,
                   tau = tau_pos (paper 1.0) where A > 0, tau_neg (1.05) elsewhere; no clip range.
               "cispo" (token) CISPO, MiniMax-M1 (arXiv 2506.13585) Eq. 4:
                   J = agg_t sg[clip(w_it, 1-eps_low, 1+eps_high)] A_it logp_it: the REINFORCE
                   gradient of every token, weighted by its truncated importance ratio; no token's
                   gradient is dropped. Default aggregation "token-mean", as the paper's 1/sum|y_i|.
                   (The loss VALUE is that of the surrogate sg[w] A logp, not comparable with the
                   others'; its gradient is the objective.)
               "gmpo"  (sequence) GMPO, arXiv 2507.20673: J = mean_i A_i exp(mean_t l_it), with the
                   token log-ratio clipped on the side its advantage's sign makes harmful:
                   l_it = min(log w_it, eps_high) where A_i > 0, max(log w_it, -eps_low) where
                   A_i < 0 (paper: eps 0.4 both sides, i.e. ratio bounds e^-0.4, e^0.4): PPO's
                   min(r A, clip(r) A) per token, in log space, inside GSPO's geometric mean.
               "luspo" (sequence) LUSPO, arXiv 2602.05261: GSPO's sequence term times |y_i|,
                   J = mean_i |y_i| min(s_i A_i, clip(s_i, ...) A_i), undoing the length
                   normalisation's bias towards short responses. The loss scale grows with the
                   mean length (AdamW's step does not).
        eps_low, eps_high: clip range (paper section 5.1: 3e-4/4e-4 for the sequence levels,
            0.2/0.27 for the token level; `gspo.config.PAPER_CLIP` and `OBJECTIVE_CLIP`); for
            "gmpo" bounds of the log-ratio; None for "sapo".
        aggregation: for the token-level objectives (clip at level "token", sapo, cispo); the
            others accept None or "seq-mean-token-mean":
            "seq-mean-token-mean" mean_i (1/|y_i|) sum_t, as in the paper's GRPO;
            "token-mean" (DAPO) sum over all tokens / number of valid tokens;
            "seq-mean-token-sum-norm" (Dr. GRPO) mean_i (1/max_len) sum_t; needs `max_len`.
        max_log_ratio: log-ratios are clamped to +-this before exp(); beyond it the ratio is a
            constant with zero gradient (at both sequence levels alike).
        weights: None (every weight 1: exactly the unweighted loss, bit for bit) or a (B, T)
            multiplicative weight per token, a constant of the objective (detached), e.g. the
            train/inference mismatch correction of `mismatch_weights`. It must be finite and
            >= 0 at valid positions; masked positions are never read. It enters as:
              token-level terms ("token", "sequence_token", sapo, cispo): each token's term is
                  multiplied by its weight before aggregation (TIS as in Yao et al. 2025).
              sequence terms ("sequence", gmpo, luspo): the sequence's term is multiplied by the
                  masked mean of its row's weights, (1/|y_i|) sum_t weights_it; for a sequence
                  weight W_i broadcast over the row that is exactly W_i. With sequence weights
                  broadcast, "sequence_token" and "sequence" therefore still agree.
            Masking tokens or sequences (MIS, IcePop) is a weight of 0 at the token level (the
            dropped tokens stay in the count) and `mask & keep` at the sequence levels (they
            leave the ratio s_i and |y_i|): `gspo.algo.apply_keep`. A sequence with no token
            left adds 0 but still counts in the mean over sequences (as an empty response does).
            The metrics do not depend on the weights (but "loss" is the returned, weighted value).
    Metrics (python floats, under no_grad). The clip fractions count, per objective, the tokens
    whose gradient the objective cuts or truncates:
        clip, luspo: A > 0 and ratio > 1 + eps_high ("high"), or A < 0 and ratio < 1 - eps_low
            ("low"); the ratio is s_i at the sequence levels and w_it at the token level. So at
            level "sequence" every token of a clipped sequence counts, as in the paper's Fig. 2.
        gmpo: the tokens whose log-ratio is clipped (the rule above, in log space).
        cispo: the tokens whose weight is truncated, w > 1 + eps_high or w < 1 - eps_low (A != 0).
        sapo: no hard clip; the tokens whose gate keeps under half of the gradient
            (f'(w) < 1/2, A != 0), "high" where w > 1. Plus gate/weight_mean: f'(w) over valid
            tokens (1 on-policy).
        clip/token_frac, clip/token_frac_low, clip/token_frac_high: over valid tokens.
        clip/seq_frac: fraction of non-empty sequences with any clipped token.
        ratio/seq_mean, ratio/seq_min, ratio/seq_max: s_i over non-empty sequences (all levels).
        kl/approx: k3 estimate of KL(pi_old || pi_theta) per valid token, on tokens sampled from
            pi_old: r - 1 - log r with r = exp(logp - old_logp) (clamped); unbiased since
            E_old[r] = 1, and >= 0 per token.
        ratio/token_log_mean, ratio/token_log_sq_mean: the mean and the mean square of the token
            log-ratios log w_t over valid tokens (all levels), which reduce over micro-batches and
            processes as token means; the trainer logs their variance, ratio/token_log_var.
        completion/len_mean: mean |y_i| over all B sequences.  loss: the returned value.
        count/tokens, count/sequences: the valid tokens and non-empty sequences the token and
            sequence means are over (what a trainer weights them by to combine forwards).
    """
    eps_low, eps_high, aggregation = validate_algo(level, eps_low, eps_high, aggregation, max_len,
                                                   max_log_ratio=max_log_ratio, objective=objective,
                                                   tau_pos=tau_pos, tau_neg=tau_neg)
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
    lo = None if eps_low is None else 1.0 - eps_low
    hi = None if eps_high is None else 1.0 + eps_high
    lengths = torch.count_nonzero(mask, dim=-1)  # (B,) |y_i|
    len_f = lengths.clamp(min=1).to(dt)  # (B,) max(|y_i|, 1)
    nonempty = lengths > 0  # (B,)

    tok_lr = torch.where(mask, logp - old_logp, 0.0)  # (B, T) masked token log-ratio
    raw_seq_lr = tok_lr.sum(-1) / len_f  # (B,)
    seq_lr = raw_seq_lr.clamp(-max_log_ratio, max_log_ratio)  # (B,) log s_i
    seq_ratio = seq_lr.exp()  # (B,) s_i
    row_w = None if w is None else w.sum(-1) / len_f  # (B,) masked mean weight of each row
    extra = {}

    if level == "sequence":
        if objective == "gmpo":  # sign-aware clip of each token's log-ratio, then the geometric mean
            l_clip = torch.where(adv[:, None] > 0, tok_lr.clamp(max=eps_high),
                                 torch.where(adv[:, None] < 0, tok_lr.clamp(min=-eps_low), tok_lr))  # (B, T)
            gm = (l_clip.sum(-1) / len_f).clamp(-max_log_ratio, max_log_ratio).exp()  # (B,)
            obj = adv * gm  # (B,)
            high = mask & (adv[:, None] > 0) & (tok_lr > eps_high)  # (B, T) gradient removed
            low = mask & (adv[:, None] < 0) & (tok_lr < -eps_low)
        else:
            obj = _clipped_objective(seq_ratio, adv, lo, hi)  # (B,)
            if objective == "luspo":
                obj = obj * lengths.to(dt)  # |y_i| times GSPO's term
            high = nonempty & (adv > 0) & (seq_ratio > hi)  # (B,) whole sequences are clipped
            low = nonempty & (adv < 0) & (seq_ratio < lo)
        if row_w is not None:
            obj = obj * row_w
        loss = -torch.where(nonempty, obj, 0.0).mean()
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
        loss = -aggregate(obj, mask, "seq-mean-token-mean")
        s = seq_ratio[:, None]  # (B, 1) equals s_it in value, exactly (live is 0)
        high, low = mask & (adv_tok > 0) & (s > hi), mask & (adv_tok < 0) & (s < lo)
    else:
        ratio_tok = tok_lr.clamp(-max_log_ratio, max_log_ratio).exp()  # (B, T) w_it
        adv_tok = adv[:, None] if adv.dim() == 1 else torch.where(mask, adv, 0.0)  # (B, 1|T)
        live = mask & (adv_tok != 0)  # (B, T) tokens with a gradient at all
        if objective == "clip":
            obj = _clipped_objective(ratio_tok, adv_tok, lo, hi)  # (B, T)
            high, low = mask & (adv_tok > 0) & (ratio_tok > hi), mask & (adv_tok < 0) & (ratio_tok < lo)
        elif objective == "sapo":
            gate, grad_w = sapo_gate(ratio_tok, adv_tok, tau_pos, tau_neg)  # (B, T) each
            obj = gate * adv_tok
            damped = live & (grad_w.detach() < 0.5)
            high, low = damped & (ratio_tok > 1), damped & (ratio_tok <= 1)
            with torch.no_grad():
                n = torch.count_nonzero(mask).clamp(min=1)
                extra["gate/weight_mean"] = (torch.where(mask, grad_w, 0.0).sum() / n).item()
        else:  # cispo: sg[clip(w)] A logp, every token's REINFORCE gradient, truncated weight
            lp = torch.where(mask, logp, 0.0)  # (B, T) garbage-free
            obj = ratio_tok.detach().clamp(lo, hi) * adv_tok * lp
            high, low = live & (ratio_tok > hi), live & (ratio_tok < lo)
        obj = torch.where(mask, obj, 0.0)  # (B, T)
        obj = obj if w is None else obj * w  # w is 0 at masked positions
        loss = -aggregate(obj, mask, aggregation, max_len)

    metrics = _metrics(loss, high, low, tok_lr, seq_ratio, mask, lengths, max_log_ratio)
    metrics.update(extra)
    return loss, metrics


# metrics that are means over completion tokens (the rest of `_metrics` are over sequences,
# or a min / max): combined across micro-batches and processes weighted by token counts
TOKEN_METRICS = ("clip/token_frac", "clip/token_frac_low", "clip/token_frac_high", "kl/approx",
                 "ratio/token_log_mean", "ratio/token_log_sq_mean",
                 "gate/weight_mean", "entropy/mean", "kl/ref", "routing/aux_loss")
# ... and the means over sequences, weighted by sequence counts
SEQUENCE_METRICS = ("clip/seq_frac", "ratio/seq_mean", "completion/len_mean")
# every metric of policy_loss but the loss itself (and the objectives' own, gate/weight_mean)
ROW_METRICS = ("clip/token_frac", "clip/token_frac_low", "clip/token_frac_high", "clip/seq_frac", "ratio/seq_mean",
               "ratio/seq_min", "ratio/seq_max", "kl/approx", "completion/len_mean", "ratio/token_log_mean",
               "ratio/token_log_sq_mean")


@torch.no_grad()
def _metrics(loss, high, low, tok_lr, seq_ratio, mask, lengths, max_log_ratio):
    """See policy_loss. high, low: what the objective clipped, (B,) whole sequences (every
    token of one counts) or (B, T) tokens. Counts with count_nonzero: summing a bool tensor
    copies it."""
    nonempty = lengths > 0  # (B,)
    if high.dim() == 1:  # whole sequences are clipped: count per sequence
        n_high, n_low = (lengths * high).sum(), (lengths * low).sum()
        n_seq_clipped = torch.count_nonzero(high | low)
    else:
        n_high, n_low = torch.count_nonzero(high), torch.count_nonzero(low)
        n_seq_clipped = torch.count_nonzero((high | low).any(-1))
    n_tok = lengths.sum().clamp(min=1).double()  # float64 so fractions print exactly
    n_seq = torch.count_nonzero(nonempty).clamp(min=1).double()
    any_seq = nonempty.any()
    lr = tok_lr.clamp(-max_log_ratio, max_log_ratio)  # (B, T)
    k3 = torch.where(mask, torch.expm1(lr) - lr, 0.0)  # (B, T) r - 1 - log r
    lr_valid = torch.where(mask, lr, 0.0).double()  # (B, T) log w_t, 0 on padding
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
        lr_valid.sum() / n_tok,
        lr_valid.square().sum() / n_tok,
        lengths.sum(),
        torch.count_nonzero(nonempty),
    )]).tolist()  # one device sync for all metrics
    return dict(zip(("loss", *ROW_METRICS, "count/tokens", "count/sequences"), values))
