"""Where one update micro-batch's time goes, and how far its matrix products alone could take it:
the bound on "the update at >= 50 % of its precision's matmul peak" on this CPU.

    python bench/update_profile.py                         # the 32M model, bf16 autocast, 4 rows x 536 tokens
    python bench/update_profile.py --precision fp32
    python bench/update_profile.py --rows 8 --length 134

The model is `bench/trl_compare.py`'s compute-dense one (hidden 512, 8 layers, MLP 2048), saved
and loaded as `gspo train` loads a checkpoint. One micro-batch is what the trainer runs:
`gspo.models.logprobs.token_logprobs` over `--rows` rows (the last `--completion` tokens
scored) and its backward, under bf16 autocast over fp32 weights (`model.mixed_precision=bf16`)
or in fp32. `torch.profiler` splits its time by operator. The report gives:

- the micro-batch's GFLOP/s (its executed FLOPs as `bench/flop_count.py` counts them, the count
  `bench/flops.py` reports) against the `torch.mm` peak of its precision (2048^3, same run);
- the matrix products' own GFLOP/s (their FLOPs over the `aten::mm` time);
- the bound: the share of the peak the micro-batch would reach if every operator but the matrix
  products took no time at all (attention's FLOPs counted, its time not: the bound is generous).
  Where it is below 50 %, no work outside the matrix products reaches the goal.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flop_count import call_flops, model_dims  # noqa: E402
from trl_compare import WORKLOADS, build_model_dir  # noqa: E402


def mm_peak(dtype, n: int = 2048, seconds: float = 1.0) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = 0.0
    for _ in range(3):
        t, k = time.perf_counter(), 0
        while time.perf_counter() - t < seconds / 3:
            a @ b
            k += 1
        best = max(best, 2 * n ** 3 * k / (time.perf_counter() - t) / 1e9)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="compute-dense", choices=sorted(WORKLOADS))
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=536, help="tokens a row (prompt + completion)")
    ap.add_argument("--completion", type=int, default=128, help="scored tokens at the end of each row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="operators listed")
    args = ap.parse_args(argv)

    from torch.profiler import ProfilerActivity, profile

    from gspo.models import load_policy
    from gspo.models.logprobs import token_logprobs

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="update-profile-") as tmp:
        build_model_dir(Path(tmp) / "m", WORKLOADS[args.model])
        model, _ = load_policy(Path(tmp) / "m")
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size - 1, (args.rows, args.length), generator=g)
    mask = torch.ones_like(ids)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32

    def micro_batch():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            out = token_logprobs(model, ids, mask, args.completion)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    for _ in range(2):
        micro_batch()
    t = time.perf_counter()
    for _ in range(3):
        micro_batch()
    seconds = (time.perf_counter() - t) / 3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        micro_batch()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops) / 1e6
    mm = sum(e.self_cpu_time_total for e in ops if e.key in ("aten::mm", "aten::addmm", "aten::bmm")) / 1e6

    d = model_dims(model)
    flop = call_flops(d, ids, mask, args.completion, args.rows * args.completion, train=True, share=False)
    attention = 14 * d["layers"] * d["A"] * args.rows * (args.length - 1) ** 2  # (flop_count's executed count)
    mm_seconds = mm * seconds / total
    peak = mm_peak(dtype)
    out = {"precision": args.precision, "rows": args.rows, "length": args.length, "threads": args.threads,
           "s_per_micro_batch": seconds, "gflop": flop / 1e9, "gflops": flop / seconds / 1e9, "peak_gflops": peak,
           "pct_of_peak": 100 * flop / seconds / 1e9 / peak, "mm_share": mm / total,
           "mm_gflops": (flop - attention) / mm_seconds / 1e9,
           "bound_pct_of_peak": 100 * flop / mm_seconds / 1e9 / peak,
           "ops": [(e.key, e.self_cpu_time_total / 1e6 / total) for e in ops[:args.top]]}
    print(f"torch {torch.__version__}, {args.threads} thread(s); {args.model}, {args.rows} rows x {args.length} tokens "
          f"({args.completion} scored), {args.precision}")
    print(f"micro-batch: {seconds:.3f} s, {out['gflop']:.1f} GFLOP, {out['gflops']:.1f} GFLOP/s = "
          f"{out['pct_of_peak']:.1f} % of the {args.precision} torch.mm peak ({peak:.1f} GFLOP/s)")
    print(f"matrix products: {100 * out['mm_share']:.1f} % of the time, at {out['mm_gflops']:.1f} GFLOP/s; with every "
          f"other operator at zero time the micro-batch would reach {out['bound_pct_of_peak']:.1f} % of the peak")
    for name, share in out["ops"]:
        print(f"  {100 * share:5.1f} %  {name}")
    return out


if __name__ == "__main__":
    main()
