"""Reward functions the tests import by dotted path (`gspo_test_rewards:...`)."""


def count_ones(prompts, completions, **kwargs):
    """Fraction of '1' characters: a tiny random model can learn to raise it in a few steps."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(text.count("1") / max(len(text), 1))
    return out


def always_nan_loss_trigger(prompts, completions, **kwargs):
    return [0.0 for _ in completions]


def raises_on_seven(prompts, completions, **kwargs):
    if any("7" in (c if isinstance(c, str) else c[-1]["content"]) for c in completions):
        raise ValueError("cannot score a 7")
    return [1.0 for _ in completions]


def hangs(prompts, completions, **kwargs):
    import time

    time.sleep(3600)


def none_for_all(prompts, completions, **kwargs):
    return [None for _ in completions]


def always_raises(prompts, completions, **kwargs):
    raise ValueError("this reward function always fails")


def raise_when_told() -> None:
    """Count this call; call number GSPO_TEST_RAISE_AT raises (calls are counted in the file
    GSPO_TEST_CALLS_FILE, one per process under torchrun: its name ends in the rank). With
    GSPO_TEST_RAISE_RANK set, only that rank raises. Without GSPO_TEST_CALLS_FILE: nothing."""
    import os

    calls = os.environ.get("GSPO_TEST_CALLS_FILE")
    rank = os.environ.get("RANK", "")
    if calls:
        calls += rank
        n = int(open(calls).read() or 0) + 1 if os.path.exists(calls) else 1
        open(calls, "w").write(str(n))
        if n == int(os.environ.get("GSPO_TEST_RAISE_AT", "0")) and os.environ.get("GSPO_TEST_RAISE_RANK", rank) == rank:
            raise RuntimeError("the reward service is down")


def count_ones_until_told(prompts, completions, **kwargs):
    """count_ones, except that the call `raise_when_told` picks raises."""
    raise_when_told()
    return count_ones(prompts, completions)
