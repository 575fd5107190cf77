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
import re
from pathlib import Path

from omegaconf import DictConfig, MISSING, OmegaConf  # noqa: F401  (MISSING re-exported for users)
from omegaconf.errors import OmegaConfBaseException

from gspo.config.fields import (  # noqa: F401  (the names users import from gspo.config)
    OBJECTIVE_CLIP, PAPER_CLIP, TRACKER_NAMES, AlgoConfig, CheckpointConfig, Config, ConfigError, DataConfig, DistributedConfig,
    EvalConfig, LoggingConfig, LoraConfig, ModelConfig, OptimConfig, OutputConfig, RewardFunctionConfig,
    RewardsConfig, RolloutConfig, ScheduleConfig, TinyConfig, VllmConfig, doc,
)
from gspo.config.rules import fill_clip, objective_args, validate, validate_world, vllm_logprobs_mode  # noqa: F401
from gspo.config.trl_names import trl_hint


# ---------------------------------------------------------------- loading


def _friendly(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    msg = (getattr(err, "msg", None) or str(err)).splitlines()[0]
    if "not in" in msg and key:
        import difflib

        names = [n for n, _, _ in field_docs()]
        close = difflib.get_close_matches(key, names, n=1)
        trl = trl_hint(key.rsplit(".", 1)[-1])
        msg = "unknown field" + (f"; {trl}" if trl else f" (did you mean '{close[0]}'?)" if close else "")
    return f"config field '{key}': {msg}" if key else msg


def _shape(value, cls: type, prefix: str = ""):
    """A YAML or override layer (plain containers) checked against the dataclass `cls` before
    OmegaConf merges it, so that a shape mistake is one error naming the field: a section given
    a value (`rollout=5`), an unknown field inside a list's items (`rewards.functions[0].nme`,
    with the near name). A list field given one item is taken as a list of it
    (`lora.target_modules=q_proj`, `rewards.functions={name: format}`)."""
    import difflib
    import typing

    if not isinstance(value, dict):
        first = dataclasses.fields(cls)[0].name
        example = (f"write it as {{{first}: ...}} in the list" if prefix.endswith("].") else
                   f"set its fields, e.g. {prefix}{first}=...")
        raise ConfigError(f"config field '{prefix.rstrip('.') or 'the top level'}' is a section ("
                          f"{', '.join(f.name for f in dataclasses.fields(cls)[:3])}, ...), not {value!r}: {example}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, v in value.items():
        name = f"{prefix}{key}"
        if key not in names:
            trl = trl_hint(str(key)) if "[" not in prefix else None  # TRL's name, bare or under any section
            if trl:
                raise ConfigError(f"config field '{name}': unknown field; {trl}")
            every = [n for n, _, _ in field_docs()] if "[" not in prefix else []
            close = [n for n in every if n.rsplit(".", 1)[-1] == key][:1]  # the field of another section
            close = close or [prefix + c for c in difflib.get_close_matches(str(key), names, n=1)]
            close = close or difflib.get_close_matches(name, every, n=1)
            if ":" in str(key):  # `{name:exact_answer}`: YAML reads one key without the space
                close = [f"{prefix}{str(key).split(':', 1)[0]}: ... (a space after the ':')"]
            raise ConfigError(f"config field '{name}': unknown field" + (f" (did you mean '{close[0]}'?)"
                                                                          if close else ""))
        hint = hints[key]
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if isinstance(v, bool) and (hint is str or (origin is typing.Union and str in args)):
            if key == "mixed_precision" and v is False:  # YAML reads a bare `no` as false: the setting means "no"
                v = "no"
            else:  # `output.name=off` would name the run False
                raise ConfigError(f"config field '{name}': YAML read {v} (from true/false, yes/no or on/off) where "
                                  f"it takes text; quote it, e.g. {name}='off'")
        if dataclasses.is_dataclass(hint):
            v = _shape(v, hint, f"{name}.")
        elif (hint is list or origin in (list, typing.List)) and v is not None:
            item = args[0] if args else typing.Any
            if not isinstance(v, list):
                v = [v]  # one item given for a list
            if dataclasses.is_dataclass(item):
                named = "name" in {f.name for f in dataclasses.fields(item)}
                v = [_shape({"name": x} if named and isinstance(x, str) else x, item, f"{name}[{i}].")
                     for i, x in enumerate(v)]  # (a bare name: `rewards.functions=[exact_answer, format]`)
        elif hint is dict or origin in (dict, typing.Dict):
            if v is None:  # `kwargs:` left empty in YAML
                v = {}
            elif not isinstance(v, dict):
                raise ConfigError(f"config field '{name}': must be a mapping, e.g. {{key: value}}; got {v!r}")
        elif hint in (int, float) and (isinstance(v, bool) or not (_number(v) or "${" in str(v))):  # (${...}: OmegaConf's)
            raise ConfigError(f"config field '{name}': must be a number, got {v!r}")
        out[key] = v
    return out


def _number(v) -> bool:
    """Whether OmegaConf can take `v` for a number field (YAML reads 1e-6 as text)."""
    try:
        float(v)
        return True
    except (TypeError, ValueError):
        return False


def load_config(path: str | os.PathLike | dict | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: Config | None = None) -> Config:
    """Defaults <- YAML file (or a dict of its sections) <- `key=value` overrides, type-checked,
    then `validate`d."""
    schema = OmegaConf.structured(base or Config())
    layers = []
    if isinstance(path, dict):  # the file's layer, given in Python
        layers.append(OmegaConf.create(path))
        path = None
    elif path is not None:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder: give a YAML config file (a model folder is "
                              f"model.name_or_path={p})")
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
    for o in overrides:  # one that is not YAML: one error naming it (yaml's own traceback before)
        try:
            OmegaConf.from_dotlist([o])
        except Exception as e:
            hint = " (a space after each ':' in {key: value})" if re.search(r"\{[^}]*\w:\S", o) else ""
            raise ConfigError(f"override '{o}' is not valid YAML{hint}: {str(e).splitlines()[0]}") from None
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        shaped = [_shape(OmegaConf.to_container(x), type(base or Config())) for x in layers]
        _strict_opt_ins(shaped)
        layers = [OmegaConf.create(x) for x in shaped]
        merged = OmegaConf.merge(schema, *layers)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_friendly(e)) from None
    anchor_paths(cfg, Path(path).resolve().parent if path is not None else None)
    fill_clip(cfg)
    validate(cfg)
    return cfg


_ROWS = ("a file or folder: save the rows (datasets' Dataset.to_json('rows.jsonl') or save_to_disk, or a .jsonl you "
         "write) and name it")
_TAKES = {  # what a path field takes, and how to get there from a Python object
    "model.name_or_path": "a model folder or hub id: save the model and its tokenizer with save_pretrained on one "
                          "folder and name it",
    "data.source": _ROWS,
    "data.eval_source": _ROWS,
}


def checked_config(cfg) -> Config:
    """A Config built or edited in Python, checked as `load_config` checks a file: the path fields
    hold paths, rewards.functions holds entries (not Python functions), every other field the
    schema's type (converted as from YAML), and `validate`'s rules. One ConfigError naming the
    field; returns the checked copy (`gspo.train.train` runs on it)."""
    if not isinstance(cfg, Config):
        raise ConfigError(f"train() takes a gspo.config.Config (gspo.config.load_config(path or dict of sections, "
                          f"overrides)), got a {type(cfg).__name__}")
    for name, takes in _TAKES.items():
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise ConfigError(f"config field '{name}': takes {takes} (got a {type(value).__name__})")
    for name in STRICT_OPT_INS:  # (OmegaConf's conversion below would read "yes" or 1 as true)
        section, key = name.split(".")
        value = getattr(getattr(cfg, section), key)
        if not isinstance(value, bool):
            raise ConfigError(f"config field '{name}': must be True or False, got {value!r}; it lets code run that "
                              f"gspo does not control, so nothing else turns it on")
    for i, f in enumerate(cfg.rewards.functions):
        if not isinstance(f, (RewardFunctionConfig, dict)):
            raise ConfigError(f"config field 'rewards.functions': item {i} is a {type(f).__name__}; each is "
                              f"{{name: ..., weight: ..., kwargs: ...}}, its name a built-in, 'module:function' or "
                              f"'path/file.py:function': put a Python function in a module or file and name it there")
    try:  # as load_config merges a file's layer: plain values, "${" kept literal (escaped as a file writes it)
        out = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config()), OmegaConf.create(_plain(cfg))))
    except OmegaConfBaseException as e:
        raise ConfigError(_friendly(e)) from None
    validate(out)
    return out


def _plain(x):
    """A config's values as YAML would give them: dataclasses as dicts, tuples as lists, NumPy
    scalars as Python numbers, paths as text, and "${" escaped (a value set in Python is literal:
    load_config resolved any interpolation of the file's already)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, os.PathLike):
        x = os.fspath(x)
    if isinstance(x, str):
        return x.replace("${", "\\${")
    if hasattr(x, "item") and type(x).__module__ == "numpy":  # (np.float64(1e-5) from a sweep)
        return x.item()
    return x


def check_run_config(path: str | os.PathLike | None, cfg: Config, overrides: list[str] | tuple[str, ...]) -> None:
    """A run's own config.yaml, read from a run directory other than the one its output.dir and
    output.name name (the folder was copied or moved): `gspo train` would go on with, or write
    over, the run where it was first written. One error naming both and the overrides for the
    copy, unless output.dir or output.name is given on the command line."""
    if path is None or Path(path).name != "config.yaml" or \
            any(o.split("=", 1)[0].strip() in ("output.dir", "output.name") for o in overrides):
        return
    here = Path(path).resolve().parent
    if not ((here / "metrics.jsonl").is_file() or (here / "checkpoints" / "latest").is_file()):
        return  # not a run directory
    out = OmegaConf.load(path).get("output") or {}
    if not (isinstance(out.get("dir"), str) and os.path.isabs(out["dir"]) and out.get("name")):
        return  # not the config a run wrote (its output.dir is absolute): a user's own, beside other files
    if here != cfg.run_dir.resolve():
        raise ConfigError(f"config file {path} is the config of the run in {here}, but its output.dir and output.name "
                          f"name {cfg.run_dir} (where the run was first written: the folder was copied or moved); to "
                          f"go on with the run in {here}, add output.dir={here.parent} output.name={here.name}; for "
                          f"the other, name {cfg.run_dir / 'config.yaml'}")


# Opt-ins to running code that gspo does not control: only the YAML booleans turn them on or off
# (OmegaConf would read 1, 2, "on" or "True" as true).
STRICT_OPT_INS = ("rewards.allow_code_execution", "model.trust_remote_code")


def _strict_opt_ins(layers: list[dict]) -> None:
    """Each layer (a YAML file's or the overrides', as plain containers) sets the opt-ins, if at
    all, to a YAML boolean."""
    for layer in layers:
        for name in STRICT_OPT_INS:
            section, key = name.split(".")
            part = layer.get(section) if isinstance(layer, dict) else None
            if isinstance(part, dict) and key in part:
                value = part[key]
                if not isinstance(value, bool):
                    raise ConfigError(f"config field '{name}': must be true or false (the YAML boolean), got "
                                      f"{value!r}; it lets code run that gspo does not control, so nothing else "
                                      f"turns it on")


def anchor_paths(cfg: Config, config_dir: Path | None) -> None:
    """Every path of `cfg` that names something on disk made absolute, found from the working
    directory or, failing that, beside the config file (`config_dir`; None: no file): the
    model, the data, the reward functions, the tools, the environment and a tool parser given
    by import path; and output.dir, from the working directory. The run's own config.yaml then
    means the same from anywhere (`gspo eval --config RUN/config.yaml`, a resume started from
    another directory)."""
    m, d, r = cfg.model, cfg.data, cfg.rollout
    # (the runs' folder is the working directory's, as before, but written down whole: a resume
    # started from elsewhere with RUN/config.yaml finds its run)
    cfg.output.dir = str(Path(cfg.output.dir).expanduser().absolute())
    m.name_or_path = anchor_file_path(m.name_or_path, config_dir)
    d.source = anchor_file_path(d.source, config_dir)
    if d.eval_source:
        d.eval_source = anchor_file_path(d.eval_source, config_dir)
    for f in cfg.rewards.functions:
        f.name = anchor_import_path(f.name, config_dir)
    r.tools = [anchor_import_path(t, config_dir) if isinstance(t, str) else t for t in r.tools]
    if r.environment:
        r.environment = anchor_import_path(r.environment, config_dir)
    r.tool_parser = anchor_import_path(r.tool_parser, config_dir)


def anchor_file_path(value: str, config_dir: Path | None) -> str:
    """A relative path made absolute where it exists: from the working directory, else beside the
    config file (`config_dir`), as reward files are (`anchor_import_path`). A value that names
    nothing on disk (a built-in task, a hub id) is returned unchanged."""
    if not value:
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return value
    for base in (Path.cwd(), config_dir):
        if base is not None and (base / p).exists():
            return str((base / p).resolve())
    return value


def module_in(folder: Path, top: str) -> bool:
    """Whether `folder` holds the top-level module `top` (a file or a package)."""
    return (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file()


def anchor_import_path(name: str, config_dir: Path | None) -> str:
    """An import path made independent of the working directory.

    'file.py:fn' relative to the working directory or, failing that, to `config_dir` becomes
    absolute; 'module:fn' whose module is not installed but is a file or package in the working
    directory or, failing that, beside the config file becomes that file's absolute path (an
    installed module of the same name wins, as when it is imported). Anything else (built-in
    names, installed modules, names that resolve nowhere) is returned unchanged, and the loader
    reports it when it fails to import. A reward model's 'model:PATH' or 'judge:PATH' has its
    PATH anchored as a data file's is (`anchor_file_path`)."""
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        return name
    if module in ("model", "judge"):  # a reward model's folder (or hub id): a path like a data file's
        return f"{module}:{anchor_file_path(attr, config_dir)}"
    bases = [b for b in (Path.cwd(), config_dir) if b is not None]
    if module.endswith(".py"):
        p = Path(module).expanduser()
        if p.is_absolute():
            return name
        for base in bases:
            if (base / p).is_file():
                return f"{(base / p).resolve()}:{attr}"
        return name
    top = module.split(".")[0]
    base = next((b for b in bases if module_in(b, top)), None)
    if base is None or _installed(top, base):
        return name
    rel = Path(*module.split("."))
    target = base / rel.with_suffix(".py")
    if not target.is_file():
        target = base / rel / "__init__.py"
    return f"{target.resolve()}:{attr}" if target.is_file() else name


def _installed(top: str, folder: Path) -> bool:
    """Whether the module `top` imports from somewhere other than `folder` (an installed module,
    or one on sys.path), which an import by name would then take."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    where = [Path(x).resolve() for x in (spec.submodule_search_locations or [])] or \
        ([Path(spec.origin).resolve().parent] if spec.origin else [])
    return not any(w in (folder.resolve(), (folder / top).resolve()) for w in where)


def to_yaml(cfg: Config) -> str:
    """`cfg` as YAML that `load_config` reads back to it (a literal "${" stays escaped)."""
    return OmegaConf.to_yaml(OmegaConf.create(_plain(cfg)))


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
