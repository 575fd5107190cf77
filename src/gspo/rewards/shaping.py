"""Reward shaping added to the weighted reward: DAPO's soft overlong penalty.

Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476,
§3.4, Eq. 13. A completion that runs into the last L_cache tokens before the length limit
L_max loses reward linearly with the tokens it spends there, down to the full penalty at the
limit, so the model learns that running out of room costs something without a cliff at L_max:

    R_length(y) = 0                                     |y| <= L_max - L_cache
                = (L_max - L_cache - |y|) / L_cache     L_max - L_cache < |y| <= L_max
                = -1                                    L_max < |y|

times `rewards.overlong_penalty` (DAPO's factor is 1). DAPO trains with L_max = 20480 and
L_cache = 4096, a fifth of the limit: gspo's default buffer.
"""

from __future__ import annotations

import torch


def overlong_penalty(lengths: torch.Tensor, *, max_len: int, buffer: int, coef: float) -> torch.Tensor:
    """DAPO's soft overlong penalty (Eq. 13 times `coef`) of completions of `lengths` tokens
    (|y|, (N,)), as (N,) float64: 0 up to `max_len - buffer` tokens, then falling linearly by
    `coef / buffer` per token to `-coef` at `max_len`, and `-coef` beyond."""
    if buffer < 1 or buffer > max_len:
        raise ValueError(f"buffer must be in [1, max_len={max_len}], got {buffer}")
    into = lengths.double() - (max_len - buffer)  # (N,) tokens spent inside the buffer
    return 0.0 - float(coef) * (into / buffer).clamp(0.0, 1.0)  # (0.0 - x: no -0.0 in the logs)


def length_limit(rollout_cfg) -> int:
    """L_max: the most tokens a completion can hold. One completion: rollout.max_new_tokens. A
    multi-turn episode (rollout.tools / rollout.environment): its budget after the prompt,
    rollout.max_episode_tokens (default max_turns x max_new_tokens), which the model's own
    tokens, |y|, reach only when no tool replied."""
    r = rollout_cfg
    if r.tools or r.environment:
        return r.max_episode_tokens or r.max_turns * r.max_new_tokens
    return r.max_new_tokens


def overlong_buffer(buffer: int, max_len: int) -> int:
    """rewards.overlong_buffer resolved: the value set, or (0) a fifth of `max_len` (DAPO's
    4096 of 20480), at least 1."""
    return buffer or max(max_len // 5, 1)
