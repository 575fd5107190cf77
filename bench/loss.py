"""Time and peak memory of gspo.algo.policy_loss (forward + backward) against the plain-Python
loop reference in tests/test_algo.py.

    python bench/loss.py                      # B=512 x T=4096, fp32, CPU, every level
    python bench/loss.py --batch 64 --seq-len 1024 --ref-seqs 4

Each measurement runs in a fresh subprocess so that memory figures do not mix. Memory is the
process's peak resident set (VmHWM) during one forward + backward, minus the resident set
just before it; VmHWM is reset first through /proc/self/clear_refs, and glibc is told to serve
every allocation over 128 KiB with mmap (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the
resident set at once. It counts every byte the call adds (activations, gradients, the
autograd graph), not the inputs. The loop reference is far too slow for the full batch: it
runs on the first --ref-seqs sequences and its time and memory are extrapolated linearly in
the number of valid tokens (its cost is one Python step per token). Times come from other
subprocesses with the default allocator settings (forcing mmap makes every allocation fault
in fresh pages, which would inflate them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [  # (label, level, aggregation, max_len)
    ("sequence (GSPO)", "sequence", None, None),
    ("sequence_token (GSPO-token)", "sequence_token", None, None),
    ("token seq-mean-token-mean", "token", "seq-mean-token-mean", None),
    ("token token-mean", "token", "token-mean", None),
    ("token seq-mean-token-sum-norm", "token", "seq-mean-token-sum-norm", "T"),
]


def _kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_extra_mib(fn) -> tuple[float, str]:
    """Run fn once; return (peak resident set minus resident set before, in MiB; method)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current VmRSS
        before = _kib("VmRSS")
        fn()
        return (_kib("VmHWM") - before) / 1024, "VmHWM after clear_refs"
    except OSError:  # no clear_refs: ru_maxrss is the peak since start, a lower bound
        import resource

        before = _kib("VmRSS")
        fn()
        return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024, \
            "ru_maxrss (lower bound)"


def _inputs(B: int, T: int, level: str, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    old = -3.0 * torch.rand(B, T, generator=g)  # (B, T)
    # log-ratio scale near the level's clip range, so that clipping acts on some terms
    scale = 0.3 if level == "token" else 2e-3
    logp = old + scale * torch.randn(B, T, generator=g)  # (B, T)
    lengths = torch.randint(1, T + 1, (B,), generator=g)  # (B,)
    mask = torch.arange(T) < lengths[:, None]  # (B, T)
    adv = torch.randn(B, generator=g)  # (B,)
    return logp, old, adv, mask


def worker(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from gspo.algo import policy_loss
    from gspo.config import PAPER_CLIP

    level, aggregation = args.level, args.aggregation or None
    max_len = args.seq_len if args.max_len else None
    logp, old, adv, mask = _inputs(args.batch, args.seq_len, level)
    if args.impl == "reference":
        sys.path.insert(0, str(ROOT / "tests"))
        from test_algo import reference_policy_loss

        k = args.ref_seqs
        logp, old, adv, mask = logp[:k], old[:k], adv[:k], mask[:k]
        eps_low, eps_high = PAPER_CLIP[level]

        def loss_fn(x):
            return reference_policy_loss(
                x, old, adv, mask, level=level, eps_low=eps_low, eps_high=eps_high,
                aggregation=aggregation or "seq-mean-token-mean", max_len=max_len)[0]
    else:
        def loss_fn(x):
            return policy_loss(x, old, adv, mask, level=level, eps_low=PAPER_CLIP[level][0],
                               eps_high=PAPER_CLIP[level][1], aggregation=aggregation, max_log_ratio=10.0,
                               max_len=max_len)[0]
    x = logp.requires_grad_()

    def step():
        loss = loss_fn(x)
        loss.backward()  # x.grad (B x T) is part of the peak ...
        value = loss.item()
        x.grad = None  # ... and is freed before the next call's baseline
        return value

    step()  # warm-up
    if args.what == "mem":
        mem, method = _peak_extra_mib(step)
        print(json.dumps({"mem_mib": mem, "method": method}))
        return
    times, loss = [], None
    for _ in range(args.reps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    # the vectorised loss on the same subset, to check the two agree where both ran
    check = None
    if args.impl == "reference":
        check = policy_loss(logp.detach(), old, adv, mask, level=level, eps_low=PAPER_CLIP[level][0],
                            eps_high=PAPER_CLIP[level][1], aggregation=aggregation, max_log_ratio=10.0,
                            max_len=max_len)[0].item()
    print(json.dumps({"time_s": statistics.median(times), "min_s": min(times),
                      "tokens": int(mask.sum()), "loss": loss, "check": check,
                      "threads": torch.get_num_threads()}))


def run_worker(args, what: str, impl: str, level: str, aggregation, max_len, reps: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--what", what, "--impl", impl, "--level", level,
           "--aggregation", aggregation or "", "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--ref-seqs", str(args.ref_seqs), "--reps", str(reps)]
    if max_len:
        cmd.append("--max-len")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    if what == "mem":  # mmap every large block, so that freed tensors leave the resident set
        env["MALLOC_MMAP_THRESHOLD_"] = "131072"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=512, help="sequences B")
    p.add_argument("--seq-len", type=int, default=4096, help="padded length T")
    p.add_argument("--ref-seqs", type=int, default=2, help="sequences the loop reference runs")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", default="vectorised", help=argparse.SUPPRESS)
    p.add_argument("--what", default="time", help=argparse.SUPPRESS)
    p.add_argument("--level", default="sequence", help=argparse.SUPPRESS)
    p.add_argument("--aggregation", default="", help=argparse.SUPPRESS)
    p.add_argument("--max-len", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    t_start = time.perf_counter()
    load = os.getloadavg()[0]
    print("command: python bench/loss.py " + " ".join(sys.argv[1:]))
    print(f"policy_loss forward+backward, B={args.batch} x T={args.seq_len}, fp32, CPU; "
          f"masks with random lengths in [1, T]")
    rows = []
    for label, level, aggregation, max_len in CONFIGS:
        vec = run_worker(args, "time", "vectorised", level, aggregation, max_len, args.reps)
        vec |= run_worker(args, "mem", "vectorised", level, aggregation, max_len, 0)
        ref = run_worker(args, "time", "reference", level, aggregation, max_len, 2)
        ref |= run_worker(args, "mem", "reference", level, aggregation, max_len, 0)
        scale = vec["tokens"] / ref["tokens"]
        rows.append((label, vec, ref, scale))
    print(f"torch threads: {rows[0][1]['threads']}; CPUs: {os.cpu_count()}; load average at "
          f"start: {load:.1f} (other processes on a shared machine make times noisy); "
          f"valid tokens: {rows[0][1]['tokens']:,}")
    head = (f"{'level / aggregation':32s} {'vec time (min)':>16s} {'vec +mem':>10s} "
            f"{'ref time*':>10s} {'ref +mem*':>10s} {'speed-up':>9s} {'|dloss| subset':>15s}")
    print(head)
    print("-" * len(head))
    for label, vec, ref, scale in rows:
        ref_t, ref_m = ref["time_s"] * scale, ref["mem_mib"] * scale
        vec_t = f"{vec['time_s'] * 1e3:.0f}ms ({vec['min_s'] * 1e3:.0f})"
        print(f"{label:32s} {vec_t:>16s} {vec['mem_mib']:7.0f}MiB "
              f"{ref_t:9.0f}s {ref_m / 1024:7.1f}GiB {ref_t / vec['time_s']:8.0f}x "
              f"{abs(ref['loss'] - ref['check']):15.1e}")
    print(f"* loop reference measured on {args.ref_seqs} sequences "
          f"({rows[0][2]['tokens']:,} valid tokens) and extrapolated linearly in valid tokens "
          f"(x{rows[0][3]:.0f}).")
    print(f"memory: {rows[0][1]['method']}: peak resident set during one forward+backward minus "
          "the resident set before it, in its own subprocess with MALLOC_MMAP_THRESHOLD_=131072 "
          "(after one warm-up call); "
          f"inputs (not counted) are {3 * args.batch * args.seq_len * 4 / 2**20:.0f} MiB fp32 "
          f"+ {args.batch * args.seq_len / 2**20:.0f} MiB bool mask.")
    print(f"time: median (min) of {args.reps} runs after one warm-up; reference: 2 runs; "
          "speed-up = extrapolated reference time / vectorised median. "
          f"Total wall {time.perf_counter() - t_start:.0f}s.")


if __name__ == "__main__":
    main()
