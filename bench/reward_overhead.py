"""The reward runner's own cost per `score` call: round trips to its long-lived worker
processes (not process start-ups), with a reward function that does nothing, over a grid of
batch sizes and worker counts. Median of --reps calls after one warm-up call.

    python bench/reward_overhead.py            # rows 32, 128, 512 x workers 1, 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def nothing(prompts, completions, **kwargs):
    return [0.0] * len(completions)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[32, 128, 512])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    from gspo.rewards.runner import RewardRunner

    out = []
    for workers in args.workers:
        with RewardRunner([nothing], num_workers=workers) as runner:
            for n in args.rows:
                batch = (["p"] * n, ["c"] * n, {"answer": ["c"] * n})
                runner.score(*batch)
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    runner.score(*batch)
                    times.append(time.perf_counter() - t0)
                out.append({"workers": workers, "rows": n, "ms": 1e3 * statistics.median(times)})
                print(f"workers {workers}  rows {n:4d}  {out[-1]['ms']:.2f} ms per score call", flush=True)
    return out


if __name__ == "__main__":
    main()
