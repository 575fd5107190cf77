"""Every command in the README is run here (the demo and training with smaller settings)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from zygote import gspo

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()

# What the tests append to a README command to keep it small; the command itself runs as written.
SHRINK = {
    "gspo demo": ["--quick"],
    "gspo train": ["tiny.hidden_size=32", "tiny.num_layers=1", "rollout.prompts_per_step=4",
                   "schedule.rollouts=2", "eval.num_prompts=8", "logging.console=false"],
    "gspo eval": [],
    "gspo report": [],
    "torchrun": ["tiny.hidden_size=32", "tiny.num_layers=1", "rollout.prompts_per_step=4",
                 "rollout.batch_size=16", "schedule.rollouts=2", "eval.num_prompts=8", "logging.console=false"],
}


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip()]


def gspo_part(cmd: str) -> str:
    return cmd.split("&&")[-1].strip()


def test_every_readme_command_is_known():
    cmds = readme_commands()
    assert len(cmds) >= 5
    for c in cmds:
        g = gspo_part(c)
        assert any(g.startswith(k) for k in SHRINK) or g.startswith("python -m pytest"), c


def test_setup_is_two_commands_that_take_the_cpu_wheel():
    setup = README.split("## Set-up")[1].split("\n## ")[0]
    cmds = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    assert len(cmds) == 2
    for c in cmds:
        assert '"torch==2.13.0"' in c  # an exact pin: a range could pull a multi-GB CUDA build
    assert gspo_part(cmds[0].strip()) == "gspo demo"
    test_cmd = cmds[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, ".ci/run must call exactly the README's test command"


def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    """The command's gspo part, as written plus SHRINK: `gspo demo` and torchrun in processes of
    their own, the rest forked (tests/zygote.py), which runs what the `gspo` script runs
    (`gspo.cli.main`) without a fresh interpreter's imports."""
    g = gspo_part(cmd)
    key = next(k for k in SHRINK if g.startswith(k))
    words = shlex.split(g)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    if key == "torchrun":  # torchrun OPTIONS -m gspo ARGS; --standalone picks a free port
        at = words.index("-m")
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", *words[1:at], *words[at:],
                *SHRINK[key]]
    elif key == "gspo demo":
        argv = [sys.executable, "-m", "gspo", *words[1:], *SHRINK[key]]
    else:
        p = gspo([*words[1:], *SHRINK[key]], env=env, cwd=cwd, timeout=600)
        assert p.returncode == 0, (cmd, p.stderr[-3000:])
        return p
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (cmd, p.stderr[-3000:])
    return p


def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "examples", d / "examples")
    return d


def _runnable() -> list[str]:
    return [c for c in readme_commands() if "gspo " in gspo_part(c) + " " or gspo_part(c).startswith("torchrun")]


def _reads_the_demo(cmd: str) -> bool:
    return gspo_part(cmd).startswith("gspo demo") or "runs/demo" in cmd


def test_the_demo_then_the_commands_that_read_its_run(tmp_path_factory):
    """`gspo demo` first, then what reads its output (eval, report), in README order."""
    d = workdir(tmp_path_factory)
    cmds = [c for c in _runnable() if _reads_the_demo(c)]
    assert len(cmds) >= 3 and gspo_part(cmds[0]).startswith("gspo demo")
    for c in cmds:
        run(c, d)
    summary = json.loads((d / "runs" / "demo" / "summary.json").read_text())
    assert {"accuracy_before_rl", "accuracy_after_rl", "seconds"} <= set(summary)
    assert (d / "runs" / "demo" / "report.html").exists()


@pytest.mark.parametrize("cmd", [c for c in _runnable() if not _reads_the_demo(c)])
def test_readme_command_runs(cmd, tmp_path_factory):
    """Each of the others on its own (they read nothing another wrote), so they spread over workers."""
    run(cmd, workdir(tmp_path_factory))


def test_every_runnable_readme_command_is_run():
    assert len(_runnable()) >= 8 and len([c for c in _runnable() if not _reads_the_demo(c)]) >= 5


def test_the_layers_of_docs_architecture_hold():
    """docs/architecture.md: a module imports from the layers above it in its table, save the two
    named function-level imports (it claimed none at all while eight went down)."""
    import ast

    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = [row.split("|") for row in doc.split("| layer | package | holds |")[1].split("\n\n")[0].splitlines()[2:]]
    rank = {pkg.strip("` "): i for i, cols in enumerate(table) for pkg in cols[2].split(",")}
    rank["gspo.tool_tasks"] = rank["gspo.rollout"]  # the multi-turn tasks' tools and games
    allowed = {("gspo.config.rules", "gspo.rewards.shaping"), ("gspo.rewards.models", "gspo.rollout")}

    def layer(module: str) -> int | None:
        return next((r for pkg, r in rank.items() if module == pkg or module.startswith(pkg + ".")), None)

    down = []
    for path in (ROOT / "src" / "gspo").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT / "src").with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gspo."):
                src, dst = layer(module), layer(node.module)
                if None not in (src, dst) and dst > src and (module, node.module) not in allowed:
                    down.append(f"{module} -> {node.module}")
    assert not down, down


def test_the_readmes_python_runs_as_written(tmp_path, monkeypatch):
    """Each ```python block of the README, in a fresh working directory, with the small settings
    the commands get added to its load_config (`SHRINK`)."""
    import gspo.config

    blocks = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert blocks
    real = gspo.config.load_config
    monkeypatch.setattr(gspo.config, "load_config",
                        lambda path=None, overrides=(), **kw: real(path, [*overrides, *SHRINK["gspo train"]], **kw))
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        scope: dict = {}
        exec(compile(code, "README.md", "exec"), scope)
        assert (scope["run_dir"] / "final").is_dir() and scope["run_dir"] == tmp_path / "runs" / "from-python"
