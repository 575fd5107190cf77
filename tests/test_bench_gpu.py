"""The GPU check's scripts (bench/gpu_check.sh, run when a session is lent a GPU) at their CPU
smoke sizes, so that a lent device's minutes are not lost to a script error: the 0.5B-shaped
run's summary (bench/gpu_check.py) and the decode comparison (bench/gpu_decode.py)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from script_module import ROOT, load_script


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_decode_comparison_runs_both_engines_at_equal_work(tmp_path: Path, keep_threads) -> None:
    """Every row runs to --new-tokens on both sides (EOS is an id the model seldom samples), in
    fp32 and under bf16 autocast."""
    bench = load_script("bench/gpu_decode.py", "bench_gpu_decode")
    res = bench.main(["--small", "--model-dir", str(tmp_path / "model"), "--json", str(tmp_path / "d.json")])
    assert res["device"] == "cpu" and set(res["cells"]) == {"fp32", "bf16"}
    for cell in res["cells"].values():
        for engine in ("gspo", "generate"):
            assert cell[engine]["tokens"] == res["rows"] * res["new_tokens"] == 2 * 4 * 8
            assert cell[engine]["tok_s"] > 0
        assert cell["gspo_over_generate"] == pytest.approx(cell["gspo"]["tok_s"] / cell["generate"]["tok_s"])
    assert (tmp_path / "d.json").is_file()


def test_the_gpu_checks_training_run_reports_its_phases(tmp_path: Path, keep_threads) -> None:
    """The same `gspo train` arguments as on the GPU (FSDP2 strategy, bf16, gradient
    checkpointing) on a 2-layer model, one process; MFU needs a known peak (NaN on a CPU unless
    --peak-tflops is given)."""
    bench = load_script("bench/gpu_check.py", "bench_gpu_check")
    res = bench.main(["--small", "--out", str(tmp_path), "--peak-tflops", "1"])
    assert res["params"] == int((tmp_path / "model" / "n_params.txt").read_text()) > 0
    assert res["completion_tokens"] > 0 and res["total_tokens"] > res["completion_tokens"]
    for k in ("generate_tok_s", "old_logp_tok_s", "update_tok_s"):
        assert res[k] > 0 and math.isfinite(res[k]), k
    assert res["update_mfu"] == pytest.approx(6 * res["params"] * res["total_tokens"] / res["update_s"] / 1e12)
    assert math.isnan(bench.peak_flops(0.0)) or torch.cuda.is_available()


def test_the_gpu_check_fits_its_eight_minutes() -> None:
    """The caps of its steps add up to at most 8 minutes (the device tool allows 10 a command)."""
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    caps = [int(s) for s in re.findall(r"^timeout (\d+) ", script, flags=re.M)]
    assert len(caps) >= 4 and sum(caps) <= 480, caps
    assert "bench/gpu_decode.py" in script and "bench/gpu_check.py" in script
