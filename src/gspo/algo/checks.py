"""Argument checks shared by the functions of `gspo.algo`: numbers, (B, T) tensors, weights."""

from __future__ import annotations

import math
import numbers

import torch


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



def _check_max_log_ratio(max_log_ratio) -> float:
    max_log_ratio = _check_number("max_log_ratio", max_log_ratio, low=0.0)
    if max_log_ratio == 0:
        raise ValueError("max_log_ratio must be > 0, got 0")
    return max_log_ratio



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
