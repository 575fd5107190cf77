"""The reward layer's two errors, in a module of their own so that the built-ins, the runner
and the contract (`gspo.rewards`) import them one way."""


class RewardError(RuntimeError):
    """A reward function failed, hung, or broke the contract; the message names the function."""


class RewardConfigError(ValueError):
    """A reward name or spec is unusable (unknown name, failed import, bad weight)."""
