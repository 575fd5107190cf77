"""The run's reward functions, from the config: each with what the config adds to it (the
code-execution opt-in, a reward model's device), resolved and checked before the policy loads.
Training and `gspo eval` alike."""

from __future__ import annotations

from gspo.config import Config, ConfigError
from gspo.config.rules import runs_model_code
from gspo.rewards import RewardConfigError, RewardSpec, is_code_tests, resolve_reward, unwrapped, validate_specs


def reward_specs(cfg: Config) -> list[RewardSpec]:
    """The config's reward functions as the runner takes them: code_tests with the code-execution
    opt-in, a reward model on the policy's device unless told otherwise."""
    specs = []
    for i, f in enumerate(cfg.rewards.functions):
        if not isinstance(f.name, str):  # (a config built in Python can hold anything)
            raise ConfigError(f"config field 'rewards.functions[{i}].name': must be text, a built-in name, "
                              f"'module:function' or 'file.py:function', got {type(f.name).__name__} {f.name!r}; "
                              "put a Python function in a module or file and name it there (its reward workers "
                              "import it by name, as the run's config.yaml records it)")
        kwargs = dict(f.kwargs)
        if runs_model_code(f.name):
            kwargs.setdefault("allow_code_execution", cfg.rewards.allow_code_execution)
        if f.name.startswith(("model:", "judge:")):  # a reward model sits beside the policy unless told otherwise
            kwargs.setdefault("device", cfg.model.device)
        specs.append(RewardSpec(name=f.name, weight=f.weight, kwargs=kwargs))
        opt_in_code_tests(cfg, len(specs) - 1, specs[-1])
    return specs


def checked_reward_specs(cfg: Config) -> list[RewardSpec]:
    """`reward_specs`, each resolved now (a reward model loads here, once), before the policy
    loads: an error names the field at fault, rewards.functions[i].name, .weight or .kwargs."""
    specs = reward_specs(cfg)
    for i, spec in enumerate(specs):
        try:
            validate_specs([spec])
        except RewardConfigError as e:
            raise ConfigError(f"config field 'rewards.functions[{i}].{getattr(e, 'field', None) or 'name'}': {e}") from None
        check_code_sandbox(i, spec)
    return specs


def check_code_sandbox(i: int, spec: RewardSpec) -> None:
    """code_tests on the built-in runner: its containment, set up once now (one trivial program),
    so that a machine where it cannot run model code safely is refused before any compute rather
    than at the first rollout. A user's own executor is its own business."""
    if spec.name.startswith(("model:", "judge:")):
        return
    fn = resolve_reward(spec.name)
    if not is_code_tests(fn):
        return
    from gspo.rewards.sandbox import CodeLimits, SandboxError, run_code_tests

    options = {**unwrapped(fn)[1], **spec.kwargs}
    if options.get("executor") is not None:
        return
    try:
        run_code_tests("", "pass", CodeLimits(allow_same_user=options.get("allow_same_user", False)))
    except SandboxError as e:
        raise ConfigError(f"config field 'rewards.functions[{i}]' ('{spec.name}'): {e}") from None


def opt_in_code_tests(cfg: Config, i: int, spec: RewardSpec) -> None:
    """The code_tests reward under another name (`functools.partial(code_tests_reward,
    executor=...)`, docs/code_execution.md, or its dotted path) runs model-written code as well:
    it needs rewards.allow_code_execution, and gets it, as the built-in name does. (A name that
    does not resolve is left to `validate_specs`, which says why.)"""
    if spec.name.startswith(("model:", "judge:")):
        return
    try:
        fn = resolve_reward(spec.name)
    except Exception:  # noqa: BLE001 (validate_specs reports it)
        return
    if not is_code_tests(fn) or "allow_code_execution" in {**unwrapped(fn)[1], **spec.kwargs}:
        return
    if not cfg.rewards.allow_code_execution:
        raise ConfigError(f"config field 'rewards.allow_code_execution': rewards.functions[{i}] ('{spec.name}') is "
                          "the code_tests reward, which runs model-written code: set rewards.allow_code_execution=true "
                          "to allow it")
    spec.kwargs["allow_code_execution"] = True
