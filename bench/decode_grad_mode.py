"""The decode loop under torch.inference_mode (gspo's sampler) against torch.no_grad.

    python bench/decode_grad_mode.py          # 5 shapes, 6 interleaved rounds (~1 min)

Each shape runs `gspo.rollout.hf.decode` on B rows of a random tiny Qwen3 or Qwen3-MoE (no EOS, so
every row runs to T), one torch thread, inside `gspo.models.generation_mode` as the sampler
does; the two modes alternate within every round and the ratio is taken within a round (median
over rounds). inference_mode skips autograd's version counters and view tracking on every op,
which is per-call overhead the tiny models' decode steps are made of. The samples are the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHAPES = {  # name: (hidden, layers, moe, rows, prompt tokens, new tokens)
    "dense h128x2 32r t16": (128, 2, False, 32, 7, 16),
    "moe h128x2 32r t16": (128, 2, True, 32, 7, 16),
    "dense h128x2 128r t32": (128, 2, False, 128, 7, 32),
    "moe h128x2 128r t32": (128, 2, True, 128, 7, 32),
    "dense h512x8 32r t32": (512, 8, False, 32, 7, 32),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch

    from gspo.models import generation_mode
    from gspo.models.tiny import build_char_tokenizer, build_tiny_model
    from gspo.rollout.hf import decode

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    out = {}
    for name, (h, layers, moe, rows, p, t) in SHAPES.items():
        model = build_tiny_model(tok, hidden_size=h, num_layers=layers, moe=moe, seed=0)
        ids = torch.randint(5, 40, (rows, p), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
        times = {k: [] for k in modes}
        samples = {}
        with generation_mode(model):
            for r in range(a.rounds + 1):
                for k in (list(modes) if r % 2 else list(modes)[::-1]):
                    with modes[k]():
                        torch.manual_seed(r)
                        t0 = time.perf_counter()
                        tokens, _ = decode(model, ids, mask, max_new_tokens=t, eos_token_ids=[len(tok) + 5],
                                           pad_token_id=tok.pad_token_id)
                        if r:  # round 0 warms up
                            times[k].append(time.perf_counter() - t0)
                    samples[k] = tokens.clone()
        assert torch.equal(samples["no_grad"], samples["inference_mode"])
        ratios = [n / i for n, i in zip(times["no_grad"], times["inference_mode"])]
        out[name] = {"no_grad_s": statistics.median(times["no_grad"]),
                     "inference_mode_s": statistics.median(times["inference_mode"]),
                     "no_grad_over_inference_mode": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios)}
        o = out[name]
        print(f"{name:<24} no_grad {o['no_grad_s'] * 1e3:7.1f} ms  inference_mode {o['inference_mode_s'] * 1e3:7.1f} ms"
              f"  -> {o['no_grad_over_inference_mode']:.2f}x ({o['ratio_min']:.2f}-{o['ratio_max']:.2f})", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
