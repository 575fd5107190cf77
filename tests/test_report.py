"""Tests for gspo.report: loading run dirs, PNG plots, the self-contained HTML, the CLI and
(when Debian's `chromium` is installed) that the page really renders its plots."""

import json
import math
import random
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from gspo.report import html as report  # noqa: E402
from gspo.report.html import Run, ema, load_run, main, make_report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EVIL = '<script>alert("x")</script> & <img src=x onerror=alert(1)>'


def _write_run(root, name, *, steps=300, seed=0, moe=True, truncated_tail=True, completion_steps=5):
    rng = random.Random(seed)
    d = root / name
    (d / "completions").mkdir(parents=True)
    (d / "config.yaml").write_text(f"model: tiny\nrun_name: {name}\nnote: '<b>not bold</b>'\n")
    lines = []
    for s in range(1, steps + 1):
        m = {
            "step": s,
            "reward/mean": min(1.0, s / steps + rng.gauss(0, 0.1)),
            "reward/std": 0.3,
            "reward/accuracy/mean": rng.random(),
            "reward/format/mean": 0.5,
            "clip/token_frac": rng.random() * 0.2,
            "clip/seq_frac": rng.random() * 0.1,
            "ratio/seq_mean": 1 + rng.gauss(0, 0.01),
            "ratio/seq_min": 0.9,
            "ratio/seq_max": 1.1,
            "completion/len_mean": 100 + s,
            "completion/truncated_frac": 0.05,
            "grad_norm": rng.random() * 3,
            "mismatch/token_abs_mean": 1e-3,
            "mismatch/kl": 1e-4,
            "time/step": 2.0,
            "tokens_per_s": 1234.5,
        }
        if moe:
            m["routing/changed_frac"] = rng.random() * 0.05
        if s % 50 == 0:
            m["eval/accuracy"] = s / steps / 2
        if s % 7 == 0:
            m["grad_norm"] = None
        if s % 11 == 0:
            m["reward/mean"] = float("nan")
        if s % 13 == 0:
            del m["clip/token_frac"]
        lines.append(json.dumps(m))  # NaN is written as the bare token NaN, as json.dumps does
    text = "\n".join(lines) + "\n"
    if truncated_tail:
        text += '{"step": %d, "reward/mean": 0.' % (steps + 1)  # killed mid-write
    (d / "metrics.jsonl").write_text(text)
    for k in range(completion_steps):
        step = (k + 1) * 10
        rows = [
            {"step": step, "prompt": f"Q{step}.{i}: {EVIL}", "completion": f"A {i} </td></tr> {EVIL}",
             "reward": i % 2, "advantage": (i % 2) - 0.5, "finish_reason": "stop" if i else "length",
             "rewards": {"accuracy": i % 2, "format": 1.0}}
            for i in range(4)
        ]
        (d / "completions" / f"step-{step:06d}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return d


@pytest.fixture
def runs(tmp_path):
    return [_write_run(tmp_path, "run-a", seed=1), _write_run(tmp_path, "run-b", seed=2, moe=False, steps=200)]


def test_load_run(runs):
    r = load_run(runs[0])
    assert isinstance(r, Run) and r.name == "run-a"
    assert [m["step"] for m in r.metrics] == list(range(1, 301))  # truncated tail skipped
    assert r.skipped_lines == 1
    xs, ys = r.series("reward/mean")
    assert len(xs) == 300 - 300 // 11 and all(math.isfinite(y) for y in ys)
    r.metrics.append({"step": 301, "reward/mean": 2.0})  # the per-key cache notices new rows
    assert r.values("reward/mean")[-1] == 2.0
    r.metrics.pop()
    assert len(r.values("grad_norm")) == 300 - 300 // 7
    # latest 3 completion files, newest first
    assert [c["step"] for c in r.completions] == [50] * 4 + [40] * 4 + [30] * 4
    assert "model: tiny" in r.config_text
    assert [c["step"] for c in load_run(runs[0], completion_steps=1).completions] == [50] * 4


def test_load_run_merges_repeated_steps(tmp_path):
    d = tmp_path / "resumed"
    d.mkdir()
    rows = [{"step": 1, "reward/mean": 0.1}, {"step": 2, "reward/mean": 0.2}, {"step": 2, "eval/accuracy": 0.5},
            {"step": 2, "reward/mean": 0.25}, {"reward/mean": 0.3}, "not a dict"]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in rows) + "\n\n")
    r = load_run(d)
    assert [m["step"] for m in r.metrics] == [1, 2, 3]
    assert r.metrics[1]["reward/mean"] == 0.25 and r.metrics[1]["eval/accuracy"] == 0.5
    assert r.completions == [] and r.config_text is None and r.skipped_lines == 1


def test_load_run_missing_metrics(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl"):
        load_run(tmp_path)
    with pytest.raises(ValueError, match="metrics.jsonl"):
        load_run(tmp_path / "nope")


def test_make_report(runs, tmp_path):
    out = tmp_path / "out"
    path = make_report(runs, out, max_completions=6, smoothing=0.6)
    assert path == out / "report.html"
    pngs = sorted(p.stem for p in (out / "plots").glob("*.png"))
    assert set(pngs) == {"reward", "reward_fns", "accuracy", "clip_token", "clip_seq", "ratio", "routing",
                         "mismatch", "completion_len", "truncated", "grad_norm"}  # no kl data -> skipped
    import matplotlib.image

    for p in (out / "plots").glob("*.png"):
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC)
        img = matplotlib.image.imread(p)
        assert img.shape[0] > 100 and img.shape[1] > 100
    page = path.read_text()
    assert page.count('<img src="data:image/png;base64,') == len(pngs)
    assert "<script" not in page.lower() and "<img src=x" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "&lt;/td&gt;&lt;/tr&gt;" in page and "&lt;b&gt;not bold&lt;/b&gt;" in page
    # self-contained: no external resources of any kind
    for bad in ("http://", "https://", "<link", "src=\"http", "url("):
        assert bad not in page
    # summary table: one column per run, key metrics present
    assert "<th>run-a</th>" in page and "<th>run-b</th>" in page
    for label in ("optimizer steps logged", "final reward mean", "best eval accuracy", "mean token clip fraction"):
        assert label in page
    assert "0.5 (step 300)" in page and "0.5 (step 200)" in page  # best eval accuracy per run
    assert page.count("Q50.") == 4 * 2 and "Q40.1" in page and "Q40.2" not in page  # 6 per run, newest first
    assert "length" in page and "accuracy: 1" in page


def test_panels_skipped_and_empty_run(tmp_path):
    d = _write_run(tmp_path, "no-moe", moe=False, steps=30, truncated_tail=False, completion_steps=0)
    out = tmp_path / "o1"
    make_report([d], out)
    assert not (out / "plots" / "routing.png").exists() and (out / "plots" / "reward.png").exists()

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    page = make_report([empty], tmp_path / "o2").read_text()
    assert "No metrics to plot" in page and "data:image/png" not in page
    assert not list((tmp_path / "o2" / "plots").glob("*.png"))


def test_same_named_runs_are_disambiguated(tmp_path):
    a = _write_run(tmp_path / "x", "run", steps=20, completion_steps=0)
    b = _write_run(tmp_path / "y", "run", steps=20, completion_steps=0)
    page = make_report([a, b], tmp_path / "o").read_text()
    assert "<th>x/run</th>" in page and "<th>y/run</th>" in page


def test_ema():
    assert ema([], 0.9) == []
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # bias-corrected
    assert ema([0.0, 1.0], 0.0) == [0.0, 1.0]
    with pytest.raises(ValueError):
        make_report([Run("r", __import__("pathlib").Path("."))], None, smoothing=1.0)


def test_decimate_keeps_envelope():
    xs = list(range(50_000))
    ys = [math.sin(i / 300) + (5.0 if i == 12_345 else 0.0) for i in xs]
    dx, dy = report._decimate(xs, ys)
    assert len(dx) == len(dy) <= 2000 and max(dy) == max(ys) and min(dy) == min(ys)
    assert report._decimate(xs[:100], ys[:100]) == (xs[:100], ys[:100])


def test_cli(tmp_path, capsys):
    runs = [_write_run(tmp_path, n, steps=40, completion_steps=1) for n in ("c1", "c2")]
    assert main([str(runs[0]), str(runs[1]), "--max-completions", "2"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(runs[0] / "report.html") and (runs[0] / "report.html").is_file()
    assert main([str(runs[1]), "--out", str(tmp_path / "cli-out"), "--smooth", "0.9"]) == 0
    assert (tmp_path / "cli-out" / "report.html").is_file()
    assert main([str(tmp_path / "missing")]) == 1
    assert "metrics.jsonl" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    from gspo.cli import main as gspo_main  # the console's `gspo report` takes the same options
    assert gspo_main(["report", str(runs[1]), "--out", str(tmp_path / "o3"), "--smooth", "0.9",
                      "--max-completions", "1"]) == 0
    assert (tmp_path / "o3" / "report.html").is_file()
    with pytest.raises(SystemExit):  # it showed "-1 of 16" and dropped the last completion
        main([str(runs[1]), "--max-completions", "-1"])


def test_missing_matplotlib_names_extra(runs, tmp_path, monkeypatch):
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"gspo\[report\]"):
        make_report(runs, tmp_path / "o")
    load_run(runs[0])  # loading needs no matplotlib


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_renders_in_headless_chromium(runs, tmp_path):
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y --no-install-recommends chromium fonts-dejavu-core)")
    page = make_report(runs, tmp_path / "out")
    shot = tmp_path / "shot.png"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={shot}", "--window-size=1200,2000", page.resolve().as_uri()]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        proc = None  # some builds linger after writing the screenshot; judge by the file
    assert shot.is_file() and shot.stat().st_size > 0, proc and proc.stderr[-2000:]
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(shot)[..., :3]
    if img.dtype != np.uint8:
        img = (img * 255).round().astype(np.uint8)
    assert img.shape[0] >= 1500 and img.shape[1] >= 1000
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 200  # not a blank / text-only page

    def near(rgb, tol=40):
        return int((np.abs(img.astype(int) - np.array(rgb)).sum(axis=-1) < tol).sum())

    # the run colours (matplotlib C0 blue, C1 orange) only appear if the embedded PNGs decoded
    assert near((31, 119, 180)) > 300 and near((255, 127, 14)) > 300


def test_completion_rows_are_strict_json_with_a_missing_reward_inside_them(tmp_path):
    """A function's missing reward (NaN) is null at any depth: the file parses as strict JSON."""
    import json as _json

    import numpy as np
    import torch

    from gspo.report.sinks import write_completions

    rows = [{"step": 1, "reward": float("nan"), "advantage": torch.tensor(0.5),
             "rewards": {"fn": float("nan"), "other": np.float32(1.0)}, "turns": [{"score": float("inf")}]}]
    path = write_completions(tmp_path, 1, rows)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    got = _json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert got == {"step": 1, "reward": None, "advantage": 0.5, "rewards": {"fn": None, "other": 1.0},
                   "turns": [{"score": None}]}


def test_console_prints_prompts_and_messages_as_text_not_markup(capsys):
    """A Llama-2 / Mistral prompt holds '[/INST]'; read as rich markup it was a closing tag with no
    opening one (a MarkupError that ended the run), and '[bold]' vanished from the table."""
    from gspo.report.sinks import Console

    c = Console(total=2)
    c.table("rollout 1", [{"prompt": "<s>[INST] 2+2? [/INST]", "completion": "[bold]4[/bold]", "reward": 1.0,
                           "advantage": 0.5}])
    c.print("data.source /tmp/[/x]/rows.jsonl")
    c.close()
    err = capsys.readouterr().err
    assert "[/INST]" in err and "[bold]4[/bold]" in err and "/tmp/[/x]/rows.jsonl" in err


def test_the_summary_shows_pass_at_k_and_times_each_rollout_once(tmp_path):
    """The summary looked up a literal 'eval/pass@k' (the key is eval/pass@K), summed time/step
    over every optimizer step's line (a rollout's time, written on each of its num_minibatches
    lines), and counted the step-0 evaluation as a step."""
    d = tmp_path / "run"
    d.mkdir()
    lines = [{"step": 0, "rollout": 0, "eval/accuracy": 0.25, "eval/pass@4": 0.5}]
    for s in range(1, 9):  # 2 rollouts of 4 minibatches, 1.5 s each
        lines.append({"step": s, "rollout": (s - 1) // 4 + 1, "time/step": 1.5, "reward/mean": 0.1})
    lines.append({"step": 8, "rollout": 2, "eval/accuracy": 0.5, "eval/pass@4": 0.75})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    run = load_run(d)
    assert report._duration(run) == "0:00:03" and report._pass_at_k(run) == "0.75 (pass@4)"
    page = make_report([d], tmp_path / "out").read_text()
    assert "0.75 (pass@4)" in page and 'steps logged</th><td class="n">8</td>' in page


def test_final_values_are_the_last_evaluations_even_when_null(tmp_path):
    """"final eval accuracy" (and pass@k, and the final reward mean) read the series without its
    nulls, so a last evaluation with no value showed an earlier evaluation's; and a run whose
    every update skipped its rows (ratio/seq_* null on every step) showed "— / —"."""
    d = tmp_path / "run"
    d.mkdir()
    lines = [{"step": 0, "eval/accuracy": 0.25, "eval/pass@4": 0.5}]
    for s, lo, hi in ((1, None, None), (2, 0.95, 1.04), (3, 0.9, 1.1)):
        lines.append({"step": s, "reward/mean": 0.5, "ratio/seq_min": lo, "ratio/seq_max": hi})
    lines.append({"step": 3, "eval/accuracy": None, "eval/pass@4": None, "reward/mean": None})
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    run, summary = load_run(d), dict(report._SUMMARY)
    assert summary["final eval accuracy"](run) == summary["final reward mean"](run) == "— (null at step 3)"
    assert report._pass_at_k(run) == "— (null at step 3)"
    assert summary["best eval accuracy"](run) == "0.25 (step 0)"
    assert summary["min / max sequence ratio"](run) == "0.9 / 1.1"

    skipped = tmp_path / "skipped"  # every group had equal rewards: no row ran, so no ratio
    skipped.mkdir()
    rows = [{"step": s, "reward/mean": 0.0, "ratio/seq_min": None, "ratio/seq_max": None, "rows/skipped_frac": 1.0}
            for s in (1, 2)]
    (skipped / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    page = make_report([d, skipped], tmp_path / "out").read_text()
    ratio_row = page.split("<th>min / max sequence ratio</th>")[1].split("</tr>")[0]
    assert ratio_row == '<td class="n">0.9 / 1.1</td><td class="n">—</td>' and "— / —" not in page
    # the last evaluation came back empty: the row stays and says so (it was left out, as if the
    # run never evaluated); the run that never evaluated shows "—"
    acc_row = page.split("<th>final eval accuracy</th>")[1].split("</tr>")[0]
    assert acc_row == '<td class="n">— (null at step 3)</td><td class="n">—</td>', acc_row
    alone = make_report([d], tmp_path / "alone").read_text()
    assert "<th>final eval accuracy</th><td class=\"n\">— (null at step 3)</td>" in alone
    assert "final eval accuracy" not in make_report([skipped], tmp_path / "never").read_text()
    assert "<th>mean skipped-row fraction</th>" in page
