"""examples/claims/precision.py in its quick mode: two cells (GSPO with the fp16 sampler's
log-probs as pi_old, GRPO with a bf16 sampler, the trainer's pi_old and TIS), one seed, three
rollouts, through the script's own main(). Its `python -m gspo demo` processes are forked from
the fork server (tests/zygote.py), which runs what they run without a fresh interpreter's imports."""

from __future__ import annotations

import json
import sys

from script_module import ROOT, load_script
from zygote import script_subprocess


def test_precision_claim_quick(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "claims"))
    precision = load_script("examples/claims/precision.py", "claims_precision")
    monkeypatch.setattr(sys.modules[precision.run_demo.__module__], "subprocess", script_subprocess)
    out = tmp_path / "precision"
    results = precision.main(["--quick", "--out", str(out)])
    assert {(r["algo"], r["cell"]) for r in results} == {("gspo", "fp16-sampler"), ("grpo", "bf16-trainer-tis")}
    assert all(r["rc"] == 0 and r["rollouts_done"] == 3 and not r["collapsed"] for r in results), results
    for r in results:  # the half-precision sampler's gap is measured: small and not zero
        assert 0 < r["mismatch_kl"] < 1e-2 and 0 < r["mismatch_seq_abs"] < 1e-2, r
        assert [x for x, _ in r["curve"]] == [0, 1, 2, 3]  # accuracy at every evaluation
    for r in results:  # each run got its cell's settings
        config = (out / f"{r['algo']}-{r['cell']}-seed0" / "config.yaml").read_text()
        assert f"mixed_precision: {r['sampler']}" in config and f"old_logp: {r['old_logp']}" in config
        assert f"mismatch_correction: {r['correction']}" in config
    table = (out / "table.md").read_text()
    assert "| GSPO | fp16 | sampler | none | 1 |" in table and "| GRPO | bf16 | trainer | tis | 1 |" in table
    assert "Collapse (fixed before the runs)" in table and "Learning curves" in table
    assert len(json.loads((out / "results.json").read_text())) == 2
    assert (out / "report" / "report.html").is_file()


def test_precision_grid_covers_every_axis(monkeypatch):
    """14 cells: fp32 and {bf16, fp16} x {sampler pi_old, trainer pi_old, trainer + TIS}, for GSPO
    and GRPO; no cell asks for a correction with the sampler's pi_old (refused by the config)."""
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "claims"))
    precision = load_script("examples/claims/precision.py", "claims_precision")
    from gspo.config import load_config

    assert len(precision.CELLS) * len(precision.ALGOS) == 14
    assert {c[0] for c in precision.CELLS.values()} == {"fp32", "bf16", "fp16"}
    for level in precision.ALGOS.values():
        for cell in precision.CELLS:
            cfg = load_config(None, precision.overrides(level, cell))  # every cell is a valid config
            assert cfg.algo.level == level and cfg.rollout.old_logp == precision.CELLS[cell][1]
