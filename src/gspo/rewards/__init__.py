"""Reward functions: the contract, the built-ins, and name resolution.

The contract is the one TRL users already write:

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]

For a chat dataset, prompts are message lists and each completion is TRL's conversational
shape `[{"role": "assistant", "content": text}]`; the built-ins accept both shapes.
`columns` are the dataset's other columns (e.g. `answer`), each a list aligned with
`completions`, plus any fixed keyword arguments from the `RewardSpec`. A function must accept
`**kwargs` (it is handed every column). One that names `prompts` or `completions`, or takes no
positional parameter (`def f(**kwargs)`), gets both by keyword, as TRL passes them (`by_keyword`);
a signature that cannot take them is refused when the function is resolved. It returns one
value per completion: an int, float or bool, or None when it cannot score that sample (the
sample is then "missing"). NaN and inf are rejected: return None instead of NaN.

`gspo.rewards.runner.RewardRunner` calls the functions in long-lived worker processes with a
deadline; `gspo.rewards.builtins` holds the built-in functions and `gspo.rewards.sandbox` the
contained code execution of `code_tests`. A name `model:PATH_OR_ID` (a sequence-classification
reward model) or `judge:PATH_OR_ID` (a causal-LM judge) is a model loaded once, whose kwargs are
its loading options (`gspo.rewards.models`; it runs in the learner's process).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

from gspo.config import module_in
from gspo.data import column_names
from gspo.rewards.errors import RewardConfigError, RewardError  # noqa: F401  (re-exported)
from gspo.rewards.models import SCORER_PREFIXES, scorer_short_name
from gspo.rewards.builtins import (  # noqa: F401  (re-exported)
    BUILTIN_REWARDS, DEFAULT_FORMAT_PATTERN, completion_text, exact_answer, format_reward,
    import_math_verify, make_format_reward, math_verify,
)


# ---------------------------------------------------------------------------------------------
# Resolving names


def _import_attr(path: str, what: str) -> Callable:
    """`path` is 'package.module:function' (or 'package.module.function') or
    'path/to/file.py:function'. Modules are looked up among installed ones, then in the working
    directory (the `gspo` console script, unlike ``python -m``, does not put it on sys.path);
    a relative file path is taken from the working directory (`gspo.config.load_config` has
    already made paths relative to the config file absolute)."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise RewardConfigError(f"{what}: {path!r} is not 'package.module:function' or 'path/to/file.py:function'")
    try:
        module = _import_file(Path(module_name)) if module_name.endswith(".py") else _import_module(module_name)
    except RewardConfigError as e:
        raise RewardConfigError(f"{what}: {e}") from None
    except Exception as e:
        raise RewardConfigError(f"{what}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    if not hasattr(module, attr):
        raise RewardConfigError(f"{what}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = name.split(".")[0]
        cwd = os.getcwd()
        if e.name != top or cwd in sys.path or not module_in(Path(cwd), top):
            raise
    sys.path.append(cwd)  # appended: an installed module of the same name still wins
    return importlib.import_module(name)


def _import_file(path: Path):
    """A module from a .py file: inside a package (its folder has __init__.py) it is imported
    by its dotted name from the package's root, so relative imports work; a lone file gets a
    private module name, and its folder joins sys.path so that it can import its neighbours."""
    path = path.expanduser().resolve()
    if not path.is_file():
        raise RewardConfigError(f"no such file {str(path)!r}")
    root, parts = path.parent, [] if path.stem == "__init__" else [path.stem]
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    if str(root) not in sys.path:
        sys.path.append(str(root))
    if len(parts) > 1 or path.stem == "__init__":
        return importlib.import_module(".".join(parts))
    name = f"gspo_reward_file_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: dataclasses and pickling look it up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _check_callable(fn: Any, what: str) -> Callable:
    if not callable(fn):
        raise RewardConfigError(f"{what}: {fn!r} is not callable")
    if inspect.isclass(fn):  # calling it would construct an instance, not score
        raise RewardConfigError(f"{what}: {fn.__name__} is a class; give a reward function, or an instance "
                                f"of the class (a module-level `scorer = {fn.__name__}(...)`) whose __call__ scores")
    inner = unwrapped(fn)[0]
    if inspect.isasyncgenfunction(inner) or inspect.isasyncgenfunction(getattr(inner, "__call__", None)):
        raise RewardConfigError(f"{what}: an async generator (an `async def` that yields) gives no list of rewards; "
                                "return the list (an `async def` that returns it is fine)")
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins have no signature; trust them
        return fn
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        raise RewardConfigError(
            f"{what}: reward functions must accept **kwargs (they receive every dataset column), "
            f"e.g. def f(prompts, completions, **kwargs)"
        )
    why = _uncallable(fn)
    if why:
        raise RewardConfigError(f"{what}: cannot be called as reward functions are ({why}): it gets the prompts and "
                                "the completions by keyword when it names `prompts` or `completions` or has no "
                                "positional parameter, else as its first two positional arguments, and the columns "
                                "by keyword; e.g. def f(completions, **kwargs) or def f(prompts, completions, **kwargs)")
    return fn


def by_keyword(fn: Callable) -> bool:
    """Whether the runner passes `prompts` and `completions` to `fn` by keyword, as TRL calls
    reward functions: when `fn` names either as a parameter a keyword can set
    (`def f(completions, **kwargs)`, `def f(completions, answer, **kwargs)`), or takes no
    positional argument at all (`def f(**kwargs)`); otherwise (`def f(ps, cs, **kwargs)`,
    `def f(prompts, completions, /, **kwargs)`) the two go first, by position."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    P = inspect.Parameter
    if not any(p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD, P.VAR_POSITIONAL) for p in params.values()):
        return True
    named = [params[k] for k in ("prompts", "completions") if k in params]
    return bool(named) and all(p.kind is not P.POSITIONAL_ONLY for p in named)


def _uncallable(fn: Callable) -> str | None:
    """Why `fn` cannot take the prompts and the completions as `by_keyword` says the runner passes
    them (a positional parameter too few, a positional-only one that nothing fills: the columns
    come by keyword), or None. A required parameter left over is a column's (checked against
    the data at start-up: `gspo.train.prompts.check_named_columns`)."""
    sig = inspect.signature(fn)
    params = sig.parameters.values()
    keywords = by_keyword(fn)
    try:
        bound = (sig.bind_partial(prompts=[], completions=[]) if keywords else sig.bind_partial([], [])).arguments
    except TypeError as e:
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        return (f"it takes {len(names)} positional argument{'s' * (len(names) != 1)} ({', '.join(names)}), not the "
                "prompts and the completions" if len(names) < 2 else str(e))
    unfilled = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty and p.name not in bound]
    if unfilled:
        return f"its positional-only parameter {unfilled[0]!r} is never given"
    given = [] if keywords else list(bound)  # by position: the prompts first, then the completions
    for i, (name, other) in enumerate((("prompts", "completions"), ("completions", "prompts"))):
        if i < len(given) and given[i] == other:
            return f"by position its parameter {other!r} would get the {name}"
    return None


def resolve_reward(name: str | Callable, kwargs: dict | None = None) -> Callable:
    """A reward function from a built-in name (a key of BUILTIN_REWARDS), an import path
    ('package.module:function' or 'package.module.function'), or a callable (checked, returned);
    `model:PATH_OR_ID` / `judge:PATH_OR_ID` load a reward model or judge with the options in
    `kwargs` (`gspo.rewards.models.load_scorer`)."""
    if isinstance(name, str) and name.startswith(SCORER_PREFIXES):
        from gspo.rewards.models import load_scorer

        return load_scorer(name, kwargs)
    if callable(name):
        return _check_callable(name, f"reward {getattr(name, '__name__', name)!r}")
    if not isinstance(name, str) or not name:
        raise RewardConfigError(f"resolve_reward: expected a name or callable, got {name!r}")
    what = f"reward {name!r}"
    if name in BUILTIN_REWARDS:
        if name == "math_verify":  # fail at start-up, and let forked workers inherit the import
            import_math_verify()
        entry = BUILTIN_REWARDS[name]
        return _check_callable(_import_attr(entry, what) if isinstance(entry, str) else entry, what)
    if "." not in name and ":" not in name:
        raise RewardConfigError(
            f"unknown reward {name!r}; built-in rewards: {', '.join(sorted(BUILTIN_REWARDS))}; "
            "or give an import path 'package.module:function' or a file 'path/to/file.py:function'"
        )
    return _check_callable(_import_attr(name, what), what)


@dataclasses.dataclass
class RewardSpec:
    """One reward function in the weighted sum. `name` is a built-in name, an import path, or a
    callable; `kwargs` are passed to every call (they override a dataset column of that name)."""

    name: str | Callable
    weight: float = 1.0
    kwargs: dict = dataclasses.field(default_factory=dict)
    # a `model:` / `judge:` scorer, loaded on the first validate_specs: (name, kwargs) it was loaded with, scorer
    _loaded: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def scorer(self):
        """The `model:` / `judge:` scorer validation loaded for this spec, else None."""
        return self._loaded[1] if self._loaded else None

    @property
    def short_name(self) -> str:
        """The key used in `per_function` and stats: the built-in name, the last part of an
        import path, or the callable's __name__."""
        if callable(self.name):
            fn = self.name.func if isinstance(self.name, functools.partial) else self.name
            return getattr(fn, "__name__", type(fn).__name__)
        if self.name.startswith(SCORER_PREFIXES):  # a path's dots are not module separators
            return scorer_short_name(self.name)
        return re.split(r"[.:]", self.name)[-1]


def validate_specs(specs: Sequence[RewardSpec | str | dict]) -> list[tuple[str, Callable, RewardSpec]]:
    """Resolve every spec now (call at start-up, before any model loads; a `model:` / `judge:`
    RewardSpec loads its model here, once, and keeps it). A spec may also be a
    name or a dict of RewardSpec fields. Returns (unique key, function, spec) triples; a repeated
    short name gets the first free suffix: "format", "format_2", ..., never another spec's own
    short name (`a`, `a`, `a_2` give `a`, `a_3`, `a_2`)."""
    specs = [specs] if isinstance(specs, (str, dict, RewardSpec)) else specs
    if not specs:
        raise RewardConfigError("validate_specs: at least one reward function is needed")
    resolved = []
    for s in specs:
        try:
            s = RewardSpec(s) if isinstance(s, str) or callable(s) else RewardSpec(**s) if isinstance(s, dict) else s
        except TypeError as e:
            raise RewardConfigError(f"validate_specs: bad reward spec {s!r}: {e}") from e
        if not isinstance(s, RewardSpec):
            raise RewardConfigError(f"validate_specs: expected RewardSpec, str or dict, got {s!r}")
        fn = _resolve_spec(s)
        if (isinstance(s.weight, bool) or not isinstance(s.weight, numbers.Real) or not math.isfinite(s.weight)
                or abs(s.weight) > _FLOAT32_MAX):
            raise _in_field("weight", f"reward {s.short_name!r}: weight must be a finite number within float32's "
                                      f"range (rewards are float32), got {s.weight!r}")
        if not isinstance(s.kwargs, dict):
            raise _in_field("kwargs", f"reward {s.short_name!r}: kwargs must be a dict, got {s.kwargs!r}")
        clash = sorted({"prompts", "completions"} & set(s.kwargs))
        if clash:
            raise _in_field("kwargs", f"reward {s.short_name!r}: kwargs cannot set {clash[0]!r}, which every call "
                                      "passes itself")
        if isinstance(s.name, str) and s.name in BUILTIN_REWARDS:
            _check_builtin_options(s.name, fn, s.kwargs)
        else:
            _check_wrapped_code_options(s, fn)
        resolved.append((fn, s))
    own = {s.short_name for _, s in resolved}  # suffixed keys keep clear of these
    out, used = [], set()
    for fn, s in resolved:
        key, n = s.short_name, 1
        while key in used or (n > 1 and key in own):
            n += 1
            key = f"{s.short_name}_{n}"
        used.add(key)
        out.append((key, fn, s))
    return out


_FLOAT32_MAX = 3.4028234663852886e38


# the dataset columns a built-in reward reads; its other named parameters are options (kwargs)
BUILTIN_COLUMNS = {"exact_answer": ("answer",), "math_verify": ("answer",), "code_tests": ("tests",),
                   "env_reward": ("env_reward",), "format": ()}


def builtin_options(name: str) -> list[str]:
    """The options of the built-in reward `name` (its named parameters that are not the columns
    it reads), which a dataset column of the same name would otherwise replace ([] for a
    function that is not a built-in)."""
    if name not in BUILTIN_COLUMNS:
        return []
    try:
        params = inspect.signature(resolve_reward(name)).parameters.values()
    except (TypeError, ValueError, RewardConfigError):
        return []
    return [p.name for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
            and p.name not in ("prompts", "completions", *BUILTIN_COLUMNS[name])]


def _in_field(field: str, message: str) -> RewardConfigError:
    """The error, with the RewardSpec field at fault as `.field` ("weight", "kwargs"; an error
    without one is about the name), so that a config error can name `rewards.functions[i].weight`."""
    e = RewardConfigError(message)
    e.field = field
    return e


def unwrapped(fn: Callable) -> tuple[Callable, dict]:
    """A `functools.partial`'s innermost function and the keywords bound on the way to it
    (`fn` itself and {} for anything else)."""
    bound = {}
    while isinstance(fn, functools.partial):
        bound, fn = {**fn.keywords, **bound}, fn.func
    return fn, bound


def is_code_tests(fn: Callable) -> bool:
    """Whether `fn` is the code_tests reward, under any name (a partial of it, its import path)."""
    fn = unwrapped(fn)[0]
    return getattr(fn, "__module__", None) == "gspo.rewards.sandbox" and getattr(fn, "__name__", "") == "code_tests_reward"


def _check_wrapped_code_options(s: RewardSpec, fn: Callable) -> None:
    """code_tests under another name (`functools.partial(code_tests_reward, ...)`, its dotted
    path): the options bound in the partial and given in kwargs, checked as the built-in's are."""
    fn, bound = unwrapped(fn)
    if is_code_tests(fn):
        from gspo.rewards.sandbox import check_code_options

        try:
            check_code_options({**bound, **s.kwargs})
        except ValueError as e:
            raise _in_field("kwargs", f"reward {s.short_name!r} (code_tests): {e}") from None


def _check_builtin_options(name: str, fn: Callable, kwargs: dict) -> None:
    """A built-in reward's options are its named parameters: a misspelt one would otherwise vanish
    into **kwargs, and a `format` pattern that is not a regular expression would fail only at
    the first scoring."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    known = [p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD
             and p.name not in ("prompts", "completions")]
    for k in kwargs:
        if k not in known:
            raise _in_field("kwargs", f"reward {name!r}: unknown option {k!r} (its options: {', '.join(known) or 'none'})")
    if name == "code_tests":
        from gspo.rewards.sandbox import check_code_options

        try:
            check_code_options(kwargs)
        except ValueError as e:
            raise _in_field("kwargs", f"reward 'code_tests': {e}") from None
    if name == "format" and "pattern" in kwargs:
        try:
            make_format_reward(str(kwargs["pattern"]))  # compiles it
        except re.error as e:
            raise _in_field("kwargs", f"reward 'format': option 'pattern' {kwargs['pattern']!r} is not a regular "
                                    f"expression ({e})") from None


def _resolve_spec(s: RewardSpec) -> Callable:
    """resolve_reward, except that a `model:` / `judge:` scorer is loaded once per spec: the
    runner resolves the specs that start-up validation already resolved."""
    if not (isinstance(s.name, str) and s.name.startswith(SCORER_PREFIXES)):
        return resolve_reward(s.name)
    if not isinstance(s.kwargs, dict):
        raise RewardConfigError(f"reward {s.name!r}: kwargs must be a dict, got {s.kwargs!r}")
    key = (s.name, repr(sorted(s.kwargs.items())))
    if s._loaded is None or s._loaded[0] != key:
        s._loaded = (key, resolve_reward(s.name, s.kwargs))
    return s._loaded[1]


def reward_columns(rows: Sequence[dict], repeat: int, names: Sequence[str] | None = None) -> dict[str, list]:
    """The keyword columns of a batch of dataset rows, each row repeated `repeat` times (its
    group): `names`, the dataset's columns (default: every column that one of these rows has),
    None where a row lacks one (JSONL rows may have different keys), so that every call of a
    reward function gets every column, whichever rows it scores."""
    names = column_names(rows) if names is None else names
    return {k: [row.get(k) for row in rows for _ in range(repeat)] for k in names}
