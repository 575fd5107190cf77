"""Shaped rewards for the claims commands (loaded by path: `examples/claims/rewards.py:digit_credit`).

The built-in `exact_answer` gives a model that answers almost nothing right almost no signal:
most groups then have equal rewards and no advantage. `digit_credit` gives partial credit for
digits in the right places, so a weak model's groups still differ, while an exact answer alone
earns full marks. That keeps held-out accuracy (the fraction of greedy answers with reward >= 1,
gspo.train.evaluate) the exact-match accuracy.
"""

from __future__ import annotations

from gspo.rewards import completion_text


def digit_credit(prompts, completions, answer=None, **kwargs) -> list[float | None]:
    """1.0 for the exact answer; otherwise 0.5 x the share of the answer's characters matched
    position by position from the right (units under units), over the longer of the two
    strings, so a wrong length costs credit too. "19" for gold "19": 1.0; "18": 0.5 x 1/2 =
    0.25; "119": 0.5 x 2/3 = 0.333; "": 0.0. None where the answer is missing."""
    if answer is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        if gold is None:
            out.append(None)
            continue
        gold, text = str(gold).strip(), completion_text(completion).strip()
        if text == gold:
            out.append(1.0)
            continue
        same = sum(a == b for a, b in zip(reversed(text), reversed(gold)))
        out.append(0.5 * same / max(len(text), len(gold), 1))
    return out
