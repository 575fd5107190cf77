"""Run configuration: one dataclass per concern (`gspo.config.fields`), YAML files and
`key=value` overrides (here), and the cross-field rules (`gspo.config.rules`).

Every default lives in `gspo.config.fields` and nowhere else; YAML and the command line only
override. OmegaConf does the parsing, merging and type checking; `validate` adds the
cross-field rules, and every failure is one `ConfigError` naming the field, raised before any
model loads.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from omegaconf import DictConfig, MISSING, OmegaConf  # noqa: F401  (MISSING re-exported for users)
from omegaconf.errors import OmegaConfBaseException

from gspo.config.fields import (  # noqa: F401  (the names users import from gspo.config)
    OBJECTIVE_CLIP, PAPER_CLIP, TRACKER_NAMES, AlgoConfig, CheckpointConfig, Config, ConfigError, DataConfig, DistributedConfig,
    EvalConfig, LoggingConfig, LoraConfig, ModelConfig, OptimConfig, OutputConfig, RewardFunctionConfig,
    RewardsConfig, RolloutConfig, ScheduleConfig, TinyConfig, VllmConfig, doc,
)
from gspo.config.rules import fill_clip, objective_args, validate, validate_world, vllm_logprobs_mode  # noqa: F401


# ---------------------------------------------------------------- loading


def _friendly(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
    if "not in" in msg and key:
        import difflib

        names = [n for n, _, _ in field_docs()]
        close = difflib.get_close_matches(key, names, n=1)
        msg = "unknown field" + (f" (did you mean '{close[0]}'?)" if close else "")
    return f"config field '{key}': {msg}" if key else msg


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: Config | None = None) -> Config:
    """Defaults <- YAML file <- `key=value` overrides, type-checked, then `validate`d."""
    schema = OmegaConf.structured(base or Config())
    layers = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            layers.append(OmegaConf.load(p))
        except Exception as e:  # yaml syntax errors
            raise ConfigError(f"config file {p}: {e}") from None
        if not isinstance(layers[-1], DictConfig):
            raise ConfigError(f"config file {p}: its top level is a {type(layers[-1]).__name__}, not a mapping of "
                              f"sections (model:, rollout:, ...)")
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override '{o}' is not of the form key=value (e.g. rollout.group_size=16)")
        key = o.split("=", 1)[0].strip()
        if any(part.isdigit() for part in key.replace("[", ".").replace("]", "").split(".")):  # OmegaConf would
            # build a mapping where a list is (dotted), or fail on the type (bracketed)
            raise ConfigError(f"override '{o}': a list is set whole on the command line, e.g. "
                              f"'rewards.functions=[{{name: exact_answer}}]', not one item by its index")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(schema, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_friendly(e)) from None
    for section in (cfg.model, cfg.rollout):  # YAML reads a bare `no` as false: the setting means "no"
        if section.mixed_precision == "False":
            section.mixed_precision = "no"
    if path is not None:
        here = Path(path).resolve().parent
        for f in cfg.rewards.functions:
            f.name = anchor_import_path(f.name, here)
        cfg.data.source = anchor_file_path(cfg.data.source, here)
        if cfg.data.eval_source:
            cfg.data.eval_source = anchor_file_path(cfg.data.eval_source, here)
    fill_clip(cfg)
    validate(cfg)
    return cfg


def anchor_file_path(value: str, config_dir: Path) -> str:
    """A relative data path of a config file: kept when it exists from the working directory (or
    names nothing on disk, e.g. a built-in task), made absolute when it exists beside the config
    file instead, as reward files are (`anchor_import_path`)."""
    p = Path(value).expanduser()
    if p.is_absolute() or p.exists() or not (config_dir / p).exists():
        return value
    return str((config_dir / p).resolve())


def module_in(folder: Path, top: str) -> bool:
    """Whether `folder` holds the top-level module `top` (a file or a package)."""
    return (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file()


def anchor_import_path(name: str, config_dir: Path) -> str:
    """An import path of a config file made independent of the working directory.

    'file.py:fn' relative to the working directory or, failing that, to `config_dir` becomes
    absolute; 'module:fn' whose module is neither installed nor in the working directory but is
    a file or package beside the config file becomes that file's absolute path. Anything else
    (built-in names, installed modules, names that resolve nowhere) is returned unchanged, and
    `gspo.rewards` reports it when it fails to import. A reward model's 'model:PATH' or
    'judge:PATH' has its PATH anchored as a data file's is (`anchor_file_path`)."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        return name
    if module in ("model", "judge"):  # a reward model's folder (or hub id): a path like a data file's
        return f"{module}:{anchor_file_path(attr, config_dir)}"
    if module.endswith(".py"):
        p = Path(module).expanduser()
        if p.is_absolute():
            return name
        for base in (Path.cwd(), config_dir):
            if (base / p).is_file():
                return f"{(base / p).resolve()}:{attr}"
        return name
    import importlib.util

    top = module.split(".")[0]
    if module_in(Path.cwd(), top) or not module_in(config_dir, top) or importlib.util.find_spec(top) is not None:
        return name
    rel = Path(*module.split("."))
    target = config_dir / rel.with_suffix(".py")
    if not target.is_file():
        target = config_dir / rel / "__init__.py"
    return f"{target.resolve()}:{attr}"


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def from_yaml_text(text: str) -> Config:
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config()), OmegaConf.create(text))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_friendly(e)) from None
    fill_clip(cfg)
    return cfg


def field_docs(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, help) of every field, for `--help`."""
    rows = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            rows.extend(field_docs(type(default), name + "."))
            continue
        if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
            default = [dataclasses.asdict(x) for x in default]
        rows.append((name, repr(default), f.metadata.get("help", "")))
    return rows
