"""Group-relative advantages (paper Eq. 6)."""

from __future__ import annotations

import math
import numbers

import torch

from gspo.algo.checks import _check_number


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
