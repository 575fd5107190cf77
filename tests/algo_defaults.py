"""gspo.algo's functions with gspo's defaults filled in where a test leaves them out: the algo
layer has none (every default lives in gspo.config), the tests of its math use the paper's."""

from gspo import algo
from gspo.config import PAPER_CLIP, AlgoConfig


def _defaults(level: str, kw: dict) -> dict:
    """gspo's defaults where a test leaves them out (the algo layer has none): the level's
    clip range from gspo.config.PAPER_CLIP and AlgoConfig's max_log_ratio."""
    lo, hi = PAPER_CLIP.get(level, PAPER_CLIP["sequence"])
    return {"eps_low": lo, "eps_high": hi, "max_log_ratio": AlgoConfig.max_log_ratio, **kw}


def policy_loss(logp, old_logp, advantages, mask, *, level="sequence", **kw):
    return algo.policy_loss(logp, old_logp, advantages, mask, level=level, **_defaults(level, kw))


def validate_algo(level="sequence", eps_low=None, eps_high=None, aggregation=None, max_len=None, **kw):
    given = {k: v for k, v in (("eps_low", eps_low), ("eps_high", eps_high)) if v is not None}
    d = _defaults(level, {**given, **kw})
    return algo.validate_algo(level, d["eps_low"], d["eps_high"], aggregation, max_len,
                              max_log_ratio=d["max_log_ratio"])


def default_clip(level):
    return PAPER_CLIP[level]


DEFAULT_CLIP = PAPER_CLIP


def group_advantages(rewards, group_size, **kw):
    return algo.group_advantages(rewards, group_size, **{"scale": AlgoConfig.adv_scale, "eps": AlgoConfig.adv_eps, **kw})
