"""bench/flops.py and bench/scaling.py: --quick runs, the analytic FLOP count against
torch's FlopCounterMode, and the log-log exponent fit."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from script_module import load_script
from zygote import popen

BENCH = Path(__file__).resolve().parents[1] / "bench"
# The analytic counts are exact integer formulas; FlopCounterMode counts the same matmuls. The
# tolerance is tight enough that the textbook variants (attention 12 instead of the executed 14,
# LM head 6 instead of 8 under checkpointing) fall outside it on the checked shapes.
RTOL = 1e-3


def _load(name: str) -> ModuleType:
    return load_script(f"bench/{name}.py", f"bench_{name}")


@pytest.fixture(scope="module")
def flops() -> ModuleType:
    return _load("flop_count")


@pytest.fixture(scope="module")
def scaling() -> ModuleType:
    return _load("scaling")


def test_quick_runs(tmp_path: Path) -> None:
    """Both scripts run end to end in --quick mode (concurrently, to keep the test short), each
    `python bench/SCRIPT.py` forked from the fork server (tests/zygote.py), which runs the script
    without a fresh interpreter's imports of torch, transformers and gspo."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1"}
    outs = {name: tmp_path / f"{name}.json" for name in ("flops", "scaling", "flops-model")}
    extra = {"flops-model": ["--model", "tiny-dense"]}  # a bench/trl_compare.py model, saved and loaded by path
    procs = {name: popen([sys.executable, str(BENCH / f"{name.split('-')[0]}.py"), "--quick", "--out", str(out),
                          *extra.get(name, [])], env=env)
             for name, out in outs.items()}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"{name}: {stdout[-2000:]}\n{stderr[-4000:]}"
    f = json.loads(outs["flops"].read_text())
    assert f["matmul_peak_gflops"] > 0 and f["matmul_peak_gflops_bf16"] > 0  # both measured in the run
    assert f["mean_completion_tokens"] == f["step"]["max_new_tokens"]  # forced to full length
    for phase in ("generate", "pi_old", "update"):
        x = f["phases"][phase]
        assert x["gflop_per_step"] > 0 and x["gflops"] > 0 and x["pct_of_peak"] > 0, phase
        assert x["precision"] == "fp32" and x["pct_of_peak"] == x["pct_of_fp32_peak"], phase  # the quick run is fp32
    for k in ("forward", "train", "generate"):
        assert f["cross_check"][k]["formula"] == f["cross_check"][k]["counted"], k
    assert f["model"] is None and f["dims"]["V"] < 100  # the built-in tiny model: task characters only
    m = json.loads(outs["flops-model"].read_text())
    # trl_compare's tiny-dense: hidden 128, 2 layers, MLP 128, its 1,000-filler character vocabulary
    assert m["model"] == "tiny-dense" and m["dims"]["V"] > 1000
    assert (m["dims"]["H"], m["dims"]["layers"], m["dims"]["intermediate"]) == (128, 2, 128)
    assert m["phases"]["update"]["gflop_per_step"] > 0
    s = json.loads(outs["scaling"].read_text())
    assert set(s["fits"]) == {"G", "length", "width"}
    for name, fit in s["fits"].items():
        for phase in ("step", "generate", "pi_old", "update"):
            assert math.isfinite(fit[phase]["exponent"]), (name, phase)
    for c in s["configs"]:
        assert c["mean_completion_tokens"] == c["max_new_tokens"]
    # the same prompts, G times as many rows: linear in G, less what runs once per prompt (the
    # prefill always, the trainer's prompt positions when it shares them)
    for phase in ("generate", "pi_old", "update"):
        assert 0 < s["fits"]["G"][phase]["flop_exponent"] <= 1.0 + 0.05, phase
    assert s["fits"]["G"]["generate"]["flop_exponent"] < 0.95


@pytest.mark.parametrize("shape", [
    {},                                                                       # 3 rows, 5 + 7 columns
    {"hidden": 32, "layers": 1, "rows": 4, "prompt": 3, "completion": 16},   # head and attention heavier
    {"rows": 6, "prompt": 9, "completion": 5, "groups": 2},                  # 2 prompts run once each
])
def test_formula_matches_flop_counter(flops: ModuleType, shape: dict) -> None:
    c = flops.cross_check(**shape)
    d, rows, mc = c["dims"], c["rows"], c["completion_tokens"]
    L = c["L"] - 1  # an unshared forward runs every column but the last (it predicts nothing)
    assert c["shared"] == bool(shape.get("groups"))  # the calls ran the path the formula describes
    for k in ("forward", "train", "generate"):
        assert c[k]["formula"] == pytest.approx(c[k]["counted"], rel=RTOL), k
    # the check can fail: textbook counts that ignore the recomputations are outside the tolerance
    counted = c["train"]["counted"]
    wrong_attn = c["train"]["formula"] - 2 * d["layers"] * d["A"] * rows * L * L
    wrong_head = c["train"]["formula"] - 2 * d["H"] * d["V"] * mc
    assert abs(wrong_attn - counted) > RTOL * counted
    assert abs(wrong_head - counted) > RTOL * counted
    if c["shared"]:  # the prompts ran once: well under one pass over every row's prompt
        assert counted < 0.8 * flops.train_flops(d, rows, L, mc)
    else:
        assert flops.train_flops(d, rows, L, mc, executed=False) < counted * (1 - RTOL)


def test_step_formula_matches_flop_counter(flops: ModuleType) -> None:
    """step_flops follows the step's own chunking (pi_old skips the first minibatch, micro-batches
    trimmed one by one, generation's prefill + decode) on a real step of the quick shape."""
    c = flops.step_cross_check(["schedule.micro_batch_size=2", "rollout.max_new_tokens=5"])
    for phase in ("generate", "pi_old", "update"):
        assert c[phase]["counted"] > 0, phase
        assert c[phase]["formula"] == pytest.approx(c[phase]["counted"], rel=RTOL), phase


def test_step_flops_counts_padding(flops: ModuleType) -> None:
    """Each micro-batch is counted on its trimmed rectangle: a padded row costs as much as a full one."""
    d = {"N": 1000, "layers": 2, "A": 16, "H": 16, "V": 10}
    assert flops.forward_flops(d, 2, 10, 5) == 2 * 1000 * 20 + 4 * 2 * 16 * 2 * 100 + 2 * 16 * 10 * 5
    # small logits: the head is not recomputed, only the attention backward is
    assert flops.train_flops(d, 2, 10, 5) - flops.train_flops(d, 2, 10, 5, executed=False) == 2 * 2 * 16 * 2 * 100
    big = {**d, "V": 1 << 22}  # 5 x 4M fp32 logits > 16 MiB: checkpointed, the head runs twice forward
    assert flops.train_flops(big, 2, 10, 5) - flops.train_flops(big, 2, 10, 5, executed=False) == \
        2 * 2 * 16 * 2 * 100 + 2 * 16 * (1 << 22) * 5
    # generation: one prefill of P positions, then T-1 one-token steps over a growing cache
    assert flops.generate_flops(d, 1, 3, 1) == 2 * 1000 * 3 + 4 * 2 * 16 * 9 + 2 * 16 * 10
    assert flops.generate_flops(d, 1, 3, 2) - flops.generate_flops(d, 1, 3, 1) == \
        2 * 1000 + 4 * 2 * 16 * 4 + 2 * 16 * 10


def test_fit_exponent(scaling: ModuleType) -> None:
    xs = [4, 8, 16, 32]
    assert scaling.fit_exponent(xs, [float(x) for x in xs]) == pytest.approx(1.0)
    assert scaling.fit_exponent(xs, [3.0 * x**2 for x in xs]) == pytest.approx(2.0)
    assert scaling.fit_exponent(xs, [5.0] * 4) == pytest.approx(0.0)
    # a fixed cost plus a linear one bends the fit below 1
    assert 0.0 < scaling.fit_exponent(xs, [10.0 + x for x in xs]) < 1.0
    with pytest.raises(ValueError):
        scaling.fit_exponent([2, 2], [1.0, 2.0])


def test_points_share_the_base(scaling: ModuleType) -> None:
    configs, where = scaling.points(scaling.BASE, scaling.AXES, ["G", "length", "width"])
    assert len(configs) == 10  # 3 axes x 4 points, the base shape shared by all three
    base = configs.index(scaling.BASE)
    assert all(base in [i for _, i in pts] for pts in where.values())


def test_update_profile_splits_a_micro_batch_and_bounds_it_by_its_matrix_products():
    prof = _load("update_profile")
    out = prof.main(["--model", "tiny-dense", "--rows", "2", "--length", "24", "--completion", "8", "--threads", "1"])
    assert 0 < out["mm_share"] <= 1 and out["peak_gflops"] > 0
    assert out["bound_pct_of_peak"] >= out["pct_of_peak"] > 0  # the products alone: never slower than the whole
    assert out["gflops"] == pytest.approx(out["gflop"] / out["s_per_micro_batch"])
    shares = [s for _, s in out["ops"]]
    assert shares == sorted(shares, reverse=True) and "aten::mm" in dict(out["ops"])
