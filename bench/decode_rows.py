"""What a decode step of gspo's loop costs against the number of rows it decodes: how much of it
is a fixed cost per step, paid again by every smaller batch a rollout is split into.

    python bench/decode_rows.py                      # the grid's tiny dense, tiny MoE and 32M models
    python bench/decode_rows.py --cells g-32m-32r-p8-t64 --rows 8 32 --steps 16
    python bench/decode_rows.py --matmul               # + fp32 / bf16 products at 32 and 568 rows

Each model is a `bench/trl_compare.py` GRID cell's, saved, then loaded and set up as `gspo train`
does (`load_policy`, grouped-query attention on the CPU).
`gspo.rollout.hf.decode` samples `--steps` tokens (EOS never drawn) from 7-token prompts of
distinct rows at each row count; counts alternate within each of `--rounds` rounds and the
best round is kept. The fit is ms per step = a + b * rows (least squares). Threads: the
count `gspo train` picks for the model (`setup_threads`, then `threads_for_model`: 1, or every
core up to 4 for a compute-bound model), unless --threads is given.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_compare import GRID, build_model_dir  # noqa: E402

DEFAULT_CELLS = ["g-dense-32r-p8-t16", "g-moe-32r-p8-t16", "g-32m-32r-p8-t64"]


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line y = a + b x."""
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def matmul_rates(threads: int, rows=(32, 568), k: int = 512, n: int = 2048, weights: int = 16) -> dict:
    """GFLOP/s of `F.linear` of (rows, k) inputs against `weights` distinct (n, k) matrices in turn
    (so that they stream from memory as a model's layers do), fp32 and bf16."""
    torch.set_num_threads(threads)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        ws = [torch.randn(n, k, dtype=dtype) for _ in range(weights)]
        for m in rows:
            x = torch.randn(m, k, dtype=dtype)
            for w in ws:
                torch.nn.functional.linear(x, w)
            reps = max(3, int(2e10 / (2 * m * k * n * weights)))
            t0 = time.perf_counter()
            for _ in range(reps):
                for w in ws:
                    torch.nn.functional.linear(x, w)
            out[f"{str(dtype)[6:]} {m}x{k}.{k}x{n}"] = 2 * m * k * n * reps * weights / (time.perf_counter() - t0) / 1e9
    return out


def measure(cell: str, rows: list[int], steps: int, rounds: int, threads: int | None) -> dict:
    from gspo.config import Config
    from gspo.models import load_policy, use_cpu_gqa_attention
    from gspo.rollout.hf import decode
    from gspo.train.threads import setup_threads, threads_for_model

    with tempfile.TemporaryDirectory(prefix="decode-rows-") as tmp:
        build_model_dir(Path(tmp), GRID[cell])
        model, _ = load_policy(tmp, dtype="float32", device="cpu", trust_remote_code=False)  # as gspo train does
    use_cpu_gqa_attention(model)
    model.eval()
    if threads is None:  # what gspo train picks for this model
        setup_threads(0)
        threads = threads_for_model(Config(), model)
    torch.set_num_threads(threads)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    best = {n: float("inf") for n in rows}
    for r in range(rounds):
        for n in (rows if r % 2 == 0 else rows[::-1]):
            ids = torch.randint(5, vocab - 1, (n, 7), generator=gen)
            with torch.inference_mode():
                t0 = time.perf_counter()
                decode(model, ids, torch.ones_like(ids), max_new_tokens=steps, eos_token_ids=[vocab + 1],
                       pad_token_id=0)
                best[n] = min(best[n], (time.perf_counter() - t0) / steps * 1e3)
    a, b = fit([float(n) for n in rows], [best[n] for n in rows])
    return {"cell": cell, "threads": threads, "ms_per_step": best, "fixed_ms": a, "per_row_ms": b}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", nargs="+", choices=sorted(GRID), default=DEFAULT_CELLS)
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 16, 32, 64, 128])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--matmul", action="store_true", help="also time fp32 and bf16 products at 32 and 568 rows")
    a = ap.parse_args(argv)
    out, threads_before = [], torch.get_num_threads()
    try:
        if a.matmul:
            for th in sorted({1, a.threads or 1}):
                rates = matmul_rates(th)
                print(f"F.linear, {th} thread(s): " + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()) + " GFLOP/s")
        for cell in a.cells:
            res = measure(cell, a.rows, a.steps, a.rounds, a.threads)
            per = "  ".join(f"{n}: {ms:.2f}" for n, ms in res["ms_per_step"].items())
            print(f"{cell} ({res['threads']} thr) ms/step by rows  {per}  |  fit {res['fixed_ms']:.2f} + "
                  f"{res['per_row_ms']:.4f} x rows")
            out.append(res)
    finally:
        torch.set_num_threads(threads_before)
    return out


if __name__ == "__main__":
    main()
