"""The trainer's forward + backward under each attention implementation and precision: does
the CPU's SDPA kernel hold the bf16 learner back, and would eager attention pay instead?

    python bench/learner_attention.py                          # the 32M model, 16 rows x 134 tokens
    python bench/learner_attention.py --lengths 134 518 --rounds 5

The model is `bench/trl_compare.py`'s compute-dense one (hidden 512, 8 layers, MLP 2048), saved
and loaded as `gspo train` loads a checkpoint (`load_policy`). Each variant runs
`gspo.models.logprobs.token_logprobs` over `--rows` rows of `--lengths` tokens (the last
`--completion` of them scored) and its backward, as one update micro-batch does:

- `sdpa` / `eager`: the attention implementation (transformers' `attn_implementation`);
- `fp32`, `autocast` (bf16 autocast over fp32 weights: `model.mixed_precision=bf16` on one
  process) and `bf16-weights` (the model cast to bf16, as FSDP2's bf16 policy computes).

Variants alternate within each of `--rounds` rounds; the best round is kept. GFLOP/s counts
6 x matmul weights x tokens (no attention scores), so the columns compare like with like.
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_compare import WORKLOADS, build_model_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[134], help="tokens a row (prompt + completion)")
    ap.add_argument("--completion", type=int, default=128, help="scored tokens at the end of each row")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    from gspo.models import load_policy
    from gspo.models.logprobs import token_logprobs

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        build_model_dir(Path(tmp), WORKLOADS["compute-dense"])
        base, _ = load_policy(tmp)
    base.train()
    weights = sum(p.numel() for n, p in base.named_parameters() if p.dim() == 2 and "embed" not in n)

    def with_attention(model, impl):
        model = copy.deepcopy(model)
        model.config._attn_implementation = impl  # the layers share this config object
        return model

    models = {(impl, w): with_attention(base, impl).to(torch.bfloat16 if w == "bf16" else torch.float32)
              for impl in ("sdpa", "eager") for w in ("fp32", "bf16")}
    variants = {f"{impl} {prec}": (models[impl, "bf16" if prec == "bf16-weights" else "fp32"], prec == "autocast")
                for prec in ("fp32", "autocast", "bf16-weights") for impl in ("sdpa", "eager")}
    print(f"compute-dense: {weights / 1e6:.2f}M matmul weights, {a.rows} rows, {a.threads} threads")
    for length in a.lengths:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, base.config.vocab_size, (a.rows, length), generator=g)
        mask = torch.ones_like(ids)
        t = min(a.completion, length - 1)

        def step(model, autocast):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                lp = token_logprobs(model, ids, mask, t)
            lp.sum().backward()
            model.zero_grad(set_to_none=True)

        for v in variants.values():
            step(*v)  # warm-up
        best = {k: float("inf") for k in variants}
        for _ in range(a.rounds):
            for k, v in variants.items():
                t0 = time.perf_counter()
                step(*v)
                best[k] = min(best[k], time.perf_counter() - t0)
        gflop = 6 * weights * a.rows * length / 1e9
        print(f"\n{length} tokens a row ({gflop:.1f} GFLOP in the matmuls)")
        print(f"{'variant':24s} {'s':>7s} {'GFLOP/s':>8s} {'vs sdpa':>8s}")
        for k, s in best.items():
            impl, prec = k.split()
            print(f"{k:24s} {s:7.3f} {gflop / s:8.1f} {best['sdpa ' + prec] / s:7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
