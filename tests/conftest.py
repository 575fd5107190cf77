import os
import sys
import warnings

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_configure(config):
    """Under `-n` without a --dist of one's own (the README's `python -m pytest -n 2`), xdist's
    loadscope: a module's tests go to one worker, a module at a time to whichever worker is free
    (the modules with the most tests first), so a module-scoped fixture (one trained run that
    several tests read) is built once, not on both workers, and the two workers end together.
    Here, not in addopts: pytest without xdist (bench/vllm_cpu.sh's venv) would refuse a --dist
    option."""
    given = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    if getattr(config.option, "dist", None) == "load" and not any(str(a).startswith(("--dist", "-d")) for a in given):
        config.option.dist = "loadscope"


def pytest_collection_modifyitems(config, items):
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ----------------------------------------------------------------------------- deprecations caused by gspo
# pyproject's filterwarnings makes a FutureWarning/DeprecationWarning attributed to a gspo module an
# error. transformers attributes most of its own elsewhere: a deprecated forward kwarg to torch's
# Module.__call__ (stacklevel=2 from its wrapper), a deprecated property to itself (stacklevel=1).
# So every warning shown also passes through here, and the stack is walked out of the package that
# raised it (and torch's module calls): a gspo frame as the first caller fails the test. A warning
# that another library causes on its own (peft reading `is_gradient_checkpointing`) does not.
_DEPRECATIONS = (FutureWarning, DeprecationWarning)
_PLUMBING = {"warnings", "torch", "functools", "contextlib"}
_gspo_caused: list[str] = []


def _package(frame) -> str:
    return (frame.f_globals.get("__name__") or "").partition(".")[0]


def _gspo_caller(frame):
    """The gspo frame that raised a warning or called the package that raised it, or None."""
    while frame is not None and _package(frame) == "warnings":
        frame = frame.f_back
    if frame is None or _package(frame) == "gspo":
        return frame
    raiser = _package(frame)
    while frame is not None and (_package(frame) == raiser or _package(frame) in _PLUMBING):
        frame = frame.f_back
    return frame if frame is not None and _package(frame) == "gspo" else None


_show_warning = warnings._showwarnmsg  # called for every warning shown (not ignored, not made an error)


def _showwarnmsg(msg):
    caller = _gspo_caller(sys._getframe(1)) if issubclass(msg.category, _DEPRECATIONS) else None
    if caller is not None:
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        _gspo_caused.append(f"{msg.category.__name__}: {msg.message} (from {where})")
    _show_warning(msg)


warnings._showwarnmsg = _showwarnmsg


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if _gspo_caused:
        if not report.failed:
            report.outcome, report.longrepr = "failed", "a deprecated call on gspo's side:\n" + "\n".join(_gspo_caused)
        else:
            report.sections.append(("deprecated calls on gspo's side", "\n".join(_gspo_caused)))
        _gspo_caused.clear()
    return report


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """saved(family, **config overrides) -> the directory of a tiny checkpoint of that family,
    written with save_pretrained (tests/artifacts.py), once per session."""
    from artifacts import save_model

    cache: dict = {}

    def get(family: str, **overrides):
        key = (family, repr(sorted(overrides.items())))
        if key not in cache:
            cache[key] = save_model(tmp_path_factory.mktemp(f"ckpt-{family}"), family, **overrides)
        return cache[key]

    return get
