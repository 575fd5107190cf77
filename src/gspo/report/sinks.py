"""Where metrics go: `metrics.jsonl` (one line per optimizer step), completions files, the console."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable


def jsonable(v: Any) -> Any:
    """`v` as JSON can hold it: a non-finite float as None (JSON has no NaN; None reads back as
    "no value"), a tensor or numpy scalar as its number, inside dicts and lists as well."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if hasattr(v, "item"):
        return jsonable(v.item())
    return v


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a killed run loses at most one line."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(jsonable(record), allow_nan=False) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class Sinks:
    """Where rank 0's records go: metrics.jsonl, then the experiment trackers (`logging.report_to`,
    `gspo.report.trackers.Trackers`), which also get each completions table."""

    def __init__(self, jsonl: JsonlWriter, trackers):
        self.jsonl, self.trackers = jsonl, trackers

    def write(self, record: dict) -> None:
        self.jsonl.write(record)  # first: a resume replays into the trackers what they missed of it
        self.trackers.log(record)

    def table(self, step: int, rows: list[dict]) -> None:
        self.trackers.table(step, rows)

    def close(self) -> None:
        try:
            self.trackers.close()
        finally:
            self.jsonl.close()


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines after `last_step` (and a torn last line), so a resumed run does not repeat steps."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("step", 0) <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)


def read_metrics(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def write_completions(run_dir: Path, step: int, rows: Iterable[dict]) -> Path:
    path = Path(run_dir) / "completions" / f"step-{step:06d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(jsonable(r), allow_nan=False) + "\n")
    return path


KEY_METRICS = [("reward/mean", "reward"), ("eval/accuracy", "acc"), ("clip/token_frac", "clip"),
               ("kl/approx", "kl"), ("completion/len_mean", "len"), ("tokens_per_s", "tok/s")]


class Console:
    """A rich progress bar with ETA and key metrics, and periodic tables of completions."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True, description: str = "GSPO"):
        self.enabled = enabled
        self._progress = None
        if not enabled:
            return
        from rich.console import Console as RichConsole
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.console = RichConsole(stderr=True)
        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                  console=self.console, transient=False)
        self._task = self._progress.add_task(description, total=total, completed=start, info="")
        self._progress.start()
        self._t0 = time.time()

    def update(self, completed: int, metrics: dict) -> None:
        if not self._progress:
            return
        parts = []
        for key, short in KEY_METRICS:
            v = metrics.get(key)
            if v is not None and isinstance(v, (int, float)) and math.isfinite(v):
                parts.append(f"{short} {v:.3g}")
        self._progress.update(self._task, completed=completed, info="  ".join(parts))

    def print(self, *args: Any) -> None:
        if self.enabled:  # plain text: a path or a prompt may hold '[/INST]', which rich reads as markup
            self.console.print(*args, markup=False, highlight=False)
        else:
            print(*args)

    def table(self, title: str, rows: list[dict]) -> None:
        if not self.enabled:
            return
        from rich.table import Table
        from rich.text import Text

        t = Table(title=title, show_lines=False)
        for col in ("prompt", "completion", "reward", "advantage"):
            t.add_column(col, overflow="fold", max_width=48 if col in ("prompt", "completion") else 10)
        for r in rows:
            # Text, not str: rich reads '[/INST]' in a Llama-2 or Mistral prompt as a closing tag
            t.add_row(Text(str(r["prompt"])[-120:]), Text(str(r["completion"])[:200]), f"{r['reward']:.3g}"
                      if r["reward"] is not None else "-", f"{r['advantage']:+.2f}")
        self.console.print(t)

    def close(self) -> None:
        if self._progress:
            self._progress.stop()
