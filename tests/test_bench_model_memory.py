"""bench/model_memory.py on a tiny Qwen2 shape: both paths run, agree, and report peaks."""

from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType

import pytest
from script_module import load_script
from zygote import script_subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "model_memory.py"
TINY = ["--layers", "2", "--hidden", "64", "--vocab", "1000", "--batch", "2",
        "--prompt-len", "16", "--completion-len", "16", "--device", "cpu", "--chunk-size", "8"]


def _load_bench() -> ModuleType:
    return load_script("bench/model_memory.py", "bench_model_memory")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return _load_bench()


def test_tiny_shape_paths_agree_with_positive_peaks(bench: ModuleType, tmp_path: Path, monkeypatch) -> None:
    """Each path's worker (`python bench/model_memory.py --worker PATH`) is a process of its own,
    forked from the fork server (tests/zygote.py), which has imported torch and transformers."""
    monkeypatch.setattr(bench, "subprocess", script_subprocess)
    out = tmp_path / "result.json"
    result = bench.main([*TINY, "--json", str(out)])

    assert out.exists()
    assert result["agree"] is True
    assert result["rtol"] == pytest.approx(1e-5)
    expected = {"loss", "logp"} | {
        "grad." + name.format(last=1) for name in bench.GRAD_PARAMS
    }
    assert set(result["agreement"]) == expected
    for key, value in result["agreement"].items():
        assert math.isfinite(value) and value <= 1e-5, (key, value)
    for path in bench.PATHS:
        run = result["paths"][path]
        assert run["peak_above_baseline_mib"] > 0, path
        assert run["baseline_mib"] > 0, path
        assert run["peak_above_baseline_mib"] >= run["after_above_baseline_mib"] - 1, path
    assert result["ratio"] > 0


def test_compare_flags_a_disagreement(bench: ModuleType, tmp_path: Path) -> None:
    """The comparison the script relies on does see a wrong gradient or log-prob."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    ref = {"loss": torch.tensor([0.5]), "logp": -torch.rand(2, 4, generator=g),
           "grad.w": torch.randn(3, 3, generator=g)}
    bad = {key: value.clone() for key, value in ref.items()}
    bad["grad.w"][1, 2] += 1e-3 * bad["grad.w"].abs().max()
    save_file(ref, str(tmp_path / "ref.safetensors"))
    save_file(bad, str(tmp_path / "bad.safetensors"))

    diffs = bench._compare(tmp_path / "bad.safetensors", tmp_path / "ref.safetensors")
    assert diffs["loss"] == 0 and diffs["logp"] == 0
    assert diffs["grad.w"] == pytest.approx(1e-3, rel=1e-3)


def test_hwm_reset_or_sampler_measures_growth(bench: ModuleType) -> None:
    """The CPU peak measurement sees 64 MiB of fresh pages that are unmapped before it is read.

    The pages come from mmap, not torch: in a test worker that has run other tests, an
    allocator may serve a tensor from pages a freed block left resident (the RSS never grows),
    which would test the allocator's history instead of the measurement."""
    pytest.importorskip("torch")
    import torch

    _, mem = bench._measure(lambda: bench._touch_and_unmap(64 * 2**20, hold_s=0.05), torch.device("cpu"))
    assert mem["peak_above_baseline_mib"] >= 60, mem
    assert mem["after_above_baseline_mib"] < 8, mem  # unmapped: the RSS is back down
