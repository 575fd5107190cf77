"""Training-run reports: PNG plots plus one self-contained HTML page (``gspo report``).

A run directory holds ``config.yaml``, ``metrics.jsonl`` (one JSON object per optimizer step)
and ``completions/step-NNNNNN.jsonl`` (sampled completions). Every metric key is optional and
values may be null/NaN; a truncated last line (a run killed mid-write) is skipped.

    >>> from gspo.report.html import make_report
    >>> make_report([Path("runs/a"), Path("runs/b")], Path("out"))  # -> out/report.html

matplotlib is only needed by :func:`make_report` (``pip install 'gspo[report]'``).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["Run", "Panel", "PANELS", "load_run", "make_report", "add_arguments", "run", "main"]

_STEP_FILE = re.compile(r"^step-(\d+)\.jsonl$")
_MAX_TEXT = 6000  # characters of prompt/completion shown per table cell


def _num(v: Any) -> float | None:
    """A finite float, or None (null, NaN, inf, strings, bools)."""
    if type(v) is float:  # fast path: nearly every value
        return v if v - v == 0.0 else None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _read_jsonl(path: Path) -> tuple[list[dict], int]:
    """Parse a JSONL file, skipping blank and unparseable lines (e.g. a truncated tail)."""
    rows, bad = [], 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                rows.append(obj)
            else:
                bad += 1
    return rows, bad


@dataclass
class Run:
    name: str
    path: Path
    metrics: list[dict] = field(default_factory=list)  # sorted by "step", one dict per step
    completions: list[dict] = field(default_factory=list)  # newest step first
    config_text: str | None = None
    skipped_lines: int = 0
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of ``key`` over the rows where it is a finite number (cached: read-only)."""
        hit = self._cache.get(key)
        if hit is not None and hit[0] == len(self.metrics):
            return hit[1]
        pairs = [(row["step"], v) for row in self.metrics if (v := _num(row.get(key))) is not None]
        out = ([float(p[0]) for p in pairs], [p[1] for p in pairs])
        self._cache[key] = (len(self.metrics), out)
        return out

    def values(self, key: str) -> list[float]:
        return self.series(key)[1]

    def keys(self) -> set[str]:
        return {k for row in self.metrics for k in row}


def load_run(run_dir: str | Path, *, completion_steps: int = 3) -> Run:
    """Load a run directory: metrics, the completions of the latest ``completion_steps`` steps
    and the raw ``config.yaml`` text. Raises ``ValueError`` if ``metrics.jsonl`` is missing."""
    run_dir = Path(run_dir)
    mfile = run_dir / "metrics.jsonl"
    if not mfile.is_file():
        raise ValueError(f"not a gspo run directory: {mfile} does not exist")
    raw, bad = _read_jsonl(mfile)
    by_step: dict[int, dict] = {}
    last = 0
    for row in raw:
        s = _num(row.get("step"))
        step = int(s) if s is not None else last + 1
        last = step
        # A resumed run re-logs steps and eval may be logged on its own line: later values win.
        by_step.setdefault(step, {}).update(row)
        by_step[step]["step"] = step
    metrics = [by_step[s] for s in sorted(by_step)]

    completions: list[dict] = []
    cdir = run_dir / "completions"
    if cdir.is_dir() and completion_steps > 0:
        files = sorted(
            ((int(m.group(1)), p) for p in cdir.iterdir() if (m := _STEP_FILE.match(p.name))),
            reverse=True,
        )
        for step, p in files[:completion_steps]:
            rows, nbad = _read_jsonl(p)
            bad += nbad
            for r in rows:
                r.setdefault("step", step)
            completions.extend(rows)
    cfg = run_dir / "config.yaml"
    config_text = cfg.read_text(encoding="utf-8", errors="replace") if cfg.is_file() else None
    name = run_dir.resolve().name or str(run_dir)
    return Run(name, run_dir, metrics, completions, config_text, bad)


# ----------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Panel:
    name: str  # PNG file stem
    title: str
    keys: tuple[tuple[str, str], ...] = ()  # (metric key, legend label)
    pattern: str | None = None  # regex: plot every matching key instead of ``keys``
    band: tuple[str, str] | None = None  # (low key, high key) shaded per run
    markers: bool = False  # sparse series (eval): markers, never smoothed
    auto_log: bool = False  # log y-axis when all values > 0 and spanning > 2 decades


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward (mean)", (("reward/mean", "mean"),)),
    Panel("reward_fns", "Reward per function (mean)", pattern=r"^reward/(.+)/mean$"),
    Panel("accuracy", "Eval accuracy and pass@k", pattern=r"^eval/(accuracy|pass@\d+)$", markers=True),
    Panel("clip_token", "Token clip fraction", (("clip/token_frac", "all"),
          ("clip/token_frac_low", "low"), ("clip/token_frac_high", "high"))),
    Panel("clip_seq", "Sequence clip fraction", (("clip/seq_frac", "seq"),)),
    Panel("ratio", "Sequence importance ratio (mean, min–max band)",
          (("ratio/seq_mean", "mean"),), band=("ratio/seq_min", "ratio/seq_max")),
    Panel("routing", "MoE routing change fraction", (("routing/changed_frac", "changed"),)),
    Panel("mismatch", "Sampler vs trainer log-prob mismatch",
          (("mismatch/token_abs_mean", "token |Δ| mean"), ("mismatch/seq_abs_mean", "seq |Δ| mean"),
           ("mismatch/kl", "KL")), auto_log=True),
    Panel("signal", "Groups / rows without signal (advantage 0)",
          (("adv/frac_zero_std", "groups, equal rewards"), ("rows/skipped_frac", "rows skipped in the update"))),
    Panel("completion_len", "Completion length (mean tokens)", (("completion/len_mean", "mean"),)),
    Panel("truncated", "Truncated completion fraction", (("completion/truncated_frac", "truncated"),)),
    Panel("kl", "Approx. KL to old policy", (("kl/approx", "kl"),), auto_log=True),
    Panel("grad_norm", "Gradient norm", (("grad_norm", "grad norm"),), auto_log=True),
)

_STYLES = ("-", "--", ":", "-.")


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:  # pragma: no cover - exercised via monkeypatch in tests
        raise ImportError("gspo report needs matplotlib; install the extra: pip install 'gspo[report]'") from e
    return Figure, FigureCanvasAgg


def ema(values: Sequence[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (TensorBoard-style); weight in [0, 1)."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        acc = weight * acc + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(acc / norm)
    return out


def _buckets(n: int, buckets: int = 1000):
    return np.linspace(0, n, buckets, endpoint=False).astype(int)


def _decimate(xs, ys, buckets: int = 1000):
    """Shrink a long series to a min/max envelope over ``buckets`` pixel-sized buckets: it
    looks identical at report resolution and draws much faster."""
    if len(ys) <= 2 * buckets:
        return xs, ys
    starts, y = _buckets(len(ys), buckets), np.asarray(ys, dtype=float)
    env = np.column_stack([np.minimum.reduceat(y, starts), np.maximum.reduceat(y, starts)])
    return np.repeat(np.asarray(xs, dtype=float)[starts], 2), env.ravel()


def _panel_keys(panel: Panel, runs: Sequence[Run]) -> list[tuple[str, str]]:
    if panel.pattern is None:
        return list(panel.keys)
    rx = re.compile(panel.pattern)
    found = sorted({k for r in runs for k in r.keys() if rx.match(k)})
    return [(k, m.group(1) if (m := rx.match(k)).groups() else k) for k in found]


def _plot_panel(panel: Panel, runs: Sequence[Run], smoothing: float) -> bytes | None:
    """Render one panel to PNG bytes, or None if no run has data for it."""
    keys = _panel_keys(panel, runs)
    data = [(ri, ki, lab, *r.series(k)) for ri, r in enumerate(runs) for ki, (k, lab) in enumerate(keys)]
    data = [d for d in data if d[3]]
    if not data:
        return None
    Figure, FigureCanvasAgg = _require_matplotlib()
    fig = Figure(figsize=(7.2, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    multi_key = len({d[1] for d in data}) > 1
    for ri, ki, lab, xs, ys in data:
        label = runs[ri].name if not multi_key else (lab if len(runs) == 1 else f"{runs[ri].name} · {lab}")
        style = dict(color=colors[ri], linestyle=_STYLES[ki % len(_STYLES)], linewidth=1.4)
        if panel.markers or len(xs) == 1:
            ax.plot(xs, ys, marker="o", markersize=3.5, label=label, **style)
        elif smoothing > 0:
            ax.plot(*_decimate(xs, ys), color=colors[ri], linestyle=style["linestyle"], linewidth=0.8, alpha=0.25)
            ax.plot(*_decimate(xs, ema(ys, smoothing)), label=label, **style)
        else:
            ax.plot(*_decimate(xs, ys), label=label, **style)
    if panel.band is not None:
        lo_k, hi_k = panel.band
        for ri, r in enumerate(runs):
            rows = [(row["step"], lo, hi) for row in r.metrics
                    if (lo := _num(row.get(lo_k))) is not None and (hi := _num(row.get(hi_k))) is not None]
            if rows:
                xs, lo, hi = (np.asarray(c, dtype=float) for c in zip(*rows))
                if len(xs) > 2000:
                    st = _buckets(len(xs))
                    xs, lo, hi = xs[st], np.minimum.reduceat(lo, st), np.maximum.reduceat(hi, st)
                ax.fill_between(xs, lo, hi, color=colors[ri], alpha=0.18, linewidth=0)
    if panel.auto_log:
        ys_all = [y for d in data for y in d[4]]
        if min(ys_all) > 0 and max(ys_all) / min(ys_all) > 100:
            ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=11)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    if len(data) > 1 or len(runs) > 1:  # loc="best" scans every point: too slow for long runs
        ax.legend(fontsize=8, loc="best" if sum(len(d[3]) for d in data) < 5000 else "upper left")
    fig.subplots_adjust(left=0.1, right=0.98, bottom=0.14, top=0.91)  # fixed: tight_layout costs a draw
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ----------------------------------------------------------------------------- summary / html


def _fmt(v: Any) -> str:
    if (v := _num(v)) is None:
        return "—"
    return f"{int(v):,}" if v == int(v) and abs(v) < 1e15 else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _final(r: Run, key: str) -> float | str | None:
    """`key` at the last step that logged it (the last evaluation's, for eval/*), never an
    earlier step's value: where that value is null or NaN, "— (null at step N)", so that the row
    stays and says so; None where no step logged `key` (the row is left out if no run has it)."""
    last = next((m for m in reversed(r.metrics) if key in m), None)
    if last is None:
        return None
    v = _num(last[key])
    return f"— (null at step {last.get('step')})" if v is None else v


def _tail_mean(xs: Sequence[float]) -> float | None:
    return _mean(xs[-max(1, len(xs) // 10):]) if xs else None


def _best_acc(r: Run) -> str:
    pts = list(zip(*r.series("eval/accuracy")))
    x, y = max(pts, key=lambda t: t[1], default=(None, None))
    return "—" if x is None else f"{_fmt(y)} (step {int(x)})"


def _duration(r: Run) -> str:
    """The rollouts' time: `time/step` is a rollout's, written on each of its optimizer steps' lines."""
    per_rollout = {m.get("rollout", m.get("step")): v for m in r.metrics if (v := _num(m.get("time/step"))) is not None}
    s = int(sum(per_rollout.values()))
    return "—" if not per_rollout else f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _pass_at_k(r: Run) -> str | None:
    """The last evaluation's eval/pass@K value (K is the run's eval.pass_k), labelled with its K."""
    key = next((k for m in reversed(r.metrics) for k in m if re.fullmatch(r"eval/pass@\d+", k)), None)
    if key is None:
        return None
    v = _final(r, key)
    return v if isinstance(v, str) else f"{_fmt(v)} ({key[5:]})"


def _ratio_range(r: Run) -> str:
    """min ratio/seq_min / max ratio/seq_max over the steps; "—" (the row left out when every run
    has it) where no step measured a ratio: every row of every update was skipped (all groups
    had equal rewards, under schedule.skip_zero_advantage), which logs them as null."""
    lo, hi = r.values("ratio/seq_min"), r.values("ratio/seq_max")
    return f"{_fmt(min(lo))} / {_fmt(max(hi))}" if lo and hi else "—"


_SUMMARY: tuple[tuple[str, Callable[[Run], Any]], ...] = (
    ("optimizer steps logged", lambda r: len({m["step"] for m in r.metrics if (_num(m.get("step")) or 0) > 0})),
    ("last step", lambda r: r.metrics[-1]["step"] if r.metrics else None),
    ("final reward mean", lambda r: _final(r, "reward/mean")),
    ("reward mean, last 10% of steps", lambda r: _tail_mean(r.values("reward/mean"))),
    ("best eval accuracy", _best_acc),
    ("final eval accuracy", lambda r: _final(r, "eval/accuracy")),
    ("final eval pass@k", _pass_at_k),
    ("mean token clip fraction", lambda r: _mean(r.values("clip/token_frac"))),
    ("mean sequence clip fraction", lambda r: _mean(r.values("clip/seq_frac"))),
    ("min / max sequence ratio", _ratio_range),
    ("mean approx. KL", lambda r: _mean(r.values("kl/approx"))),
    ("mean completion length", lambda r: _mean(r.values("completion/len_mean"))),
    ("mean truncated fraction", lambda r: _mean(r.values("completion/truncated_frac"))),
    ("mean zero-std group fraction", lambda r: _mean(r.values("adv/frac_zero_std"))),
    ("mean skipped-row fraction", lambda r: _mean(r.values("rows/skipped_frac"))),  # (1: no ratio, no clip)
    ("mean routing change fraction", lambda r: _mean(r.values("routing/changed_frac"))),
    ("mean mismatch KL", lambda r: _mean(r.values("mismatch/kl"))),
    ("max token |Δ log p|", lambda r: max(r.values("mismatch/token_abs_max"), default=None)),
    ("mean grad norm", lambda r: _mean(r.values("grad_norm"))),
    ("mean tokens/s", lambda r: _mean(r.values("tokens_per_s"))),
    ("mean step time (s)", lambda r: _mean(r.values("time/step"))),
    ("total step time (h:mm:ss)", _duration),
    ("unparseable lines skipped", lambda r: r.skipped_lines),
)

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:20px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:26px 0 8px;border-bottom:1px solid #ddd}
.meta{color:#666;font-size:13px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}td.n{text-align:right;font-variant-numeric:tabular-nums}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:10px}
figure{margin:0;border:1px solid #eee;padding:4px}figure img{width:100%;height:auto;display:block}
.txt{white-space:pre-wrap;word-break:break-word;font-family:ui-monospace,Menlo,Consolas,monospace;
font-size:12px;max-height:16em;overflow:auto;min-width:16em;max-width:48em}
pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:12px}
"""


def _e(v: Any) -> str:
    return html.escape(v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str), quote=True)


def _text_cell(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False, default=str)
    if len(s) > _MAX_TEXT:
        s = s[:_MAX_TEXT] + f"\n… [{len(s) - _MAX_TEXT} more characters]"
    return f'<td><div class="txt">{html.escape(s, quote=True)}</div></td>'


def _summary_html(runs: Sequence[Run]) -> str:
    head = "".join(f"<th>{_e(r.name)}</th>" for r in runs)
    rows = []
    for label, fn in _SUMMARY:
        vals = [fn(r) for r in runs]
        cells = [v if isinstance(v, str) else _fmt(v) for v in vals]
        if all(c == "—" for c in cells):
            continue
        rows.append(f"<tr><th>{_e(label)}</th>" + "".join(f'<td class="n">{_e(c)}</td>' for c in cells) + "</tr>")
    return f"<table><tr><th>metric</th>{head}</tr>{''.join(rows)}</table>"


def _completions_html(r: Run, limit: int) -> str:
    comps = r.completions[:limit]
    if not comps:
        return '<p class="meta">No completions found.</p>'
    out = ["<table><tr><th>step</th><th>reward</th><th>advantage</th><th>finish</th>"
           "<th>reward functions</th><th>prompt</th><th>completion</th></tr>"]
    for c in comps:
        fns = c.get("rewards")
        fns = ", ".join(f"{k}: {_fmt(v)}" for k, v in fns.items()) if isinstance(fns, dict) else ""
        out.append(
            f'<tr><td class="n">{_e(_fmt(c.get("step")))}</td><td class="n">{_e(_fmt(c.get("reward")))}</td>'
            f'<td class="n">{_e(_fmt(c.get("advantage")))}</td><td>{_e(c.get("finish_reason") or "—")}</td>'
            f"<td>{_e(fns)}</td>{_text_cell(c.get('prompt', ''))}{_text_cell(c.get('completion', ''))}</tr>"
        )
    out.append("</table>")
    if len(r.completions) > limit:
        out.append(f'<p class="meta">Showing {limit} of {len(r.completions)} loaded completions.</p>')
    return "".join(out)


def make_report(
    run_dirs: Sequence[str | Path | Run],
    out_dir: str | Path | None = None,
    *,
    max_completions: int = 50,
    smoothing: float = 0.0,
    completion_steps: int = 3,
) -> Path:
    """Write ``out_dir/plots/*.png`` and a self-contained ``out_dir/report.html``; return the
    HTML path. ``out_dir`` defaults to the first run directory. ``smoothing`` in [0, 1) draws an
    EMA over noisy per-step curves (raw curve kept faint). ``max_completions`` is per run."""
    if not run_dirs:
        raise ValueError("make_report needs at least one run directory")
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
    runs = [r if isinstance(r, Run) else load_run(r, completion_steps=completion_steps) for r in run_dirs]
    names = [r.name for r in runs]
    for r in runs:  # disambiguate identically named runs from different parents
        if names.count(r.name) > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"
    _require_matplotlib()
    out_dir = Path(out_dir) if out_dir is not None else runs[0].path
    plot_dir = out_dir / "plots"
    plot_dir.mkdir(parents=True, exist_ok=True)

    figures = []
    for panel in PANELS:
        png = _plot_panel(panel, runs, smoothing)
        target = plot_dir / f"{panel.name}.png"
        if png is None:
            target.unlink(missing_ok=True)  # stale plot from an earlier report
            continue
        target.write_bytes(png)
        figures.append(
            f'<figure><img src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}" '
            f'alt="{_e(panel.title)}" title="{_e(panel.title)}"></figure>'
        )

    title = "gspo report: " + ", ".join(r.name for r in runs)
    parts = [
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>',
        f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>",
        f'<p class="meta">Generated {datetime.now().strftime("%Y-%m-%d %H:%M:%S")}'
        + (f"; EMA smoothing {smoothing:g}" if smoothing > 0 else "") + "</p>",
        "<h2>Summary</h2>", _summary_html(runs), "<h2>Training curves</h2>",
        f'<div class="plots">{"".join(figures)}</div>' if figures else '<p class="meta">No metrics to plot.</p>',
    ]
    for r in runs:
        parts.append(f"<h2>Run {_e(r.name)}</h2><p class='meta'>{_e(str(r.path.resolve()))}</p>")
        if r.config_text is not None:
            parts.append(f"<details><summary>config.yaml</summary><pre>{_e(r.config_text)}</pre></details>")
        parts.append(f"<h3>Sample completions</h3>{_completions_html(r, max_completions)}")
    parts.append("</body></html>\n")
    path = out_dir / "report.html"
    path.write_text("\n".join(parts), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- CLI


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="training run directories")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: first RUN_DIR)")
    parser.add_argument("--max-completions", type=_count, default=50, help="sample completions shown per run")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1) for noisy curves, e.g. 0.9")
    return parser


def run(args: argparse.Namespace) -> int:
    try:
        path = make_report(args.run_dirs, getattr(args, "out", None),
                           max_completions=getattr(args, "max_completions", 50), smoothing=getattr(args, "smooth", 0.0))
    except (ValueError, ImportError, OSError) as e:
        print(f"gspo report: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="gspo report", description="Plot one or more gspo runs into a self-contained HTML report."))
    return run(parser.parse_args(None if argv is None else [str(a) for a in argv]))
