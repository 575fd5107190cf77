"""The decode loop's KV cache: buffers allocated once (gspo's default) against transformers'
DynamicCache, which concatenates the whole cache at every step.

    python bench/decode_cache.py          # 4 shapes, 5 interleaved rounds (~2 min)

Each shape samples B*G rows of T new tokens from a random tiny Qwen3 (completions forced to run
to T: no EOS), one torch thread, seeded; the two caches alternate within every round and the
ratio is taken within a round (median over rounds). Both give the same tokens
(tests/test_rollout.py::test_the_preallocated_kv_cache_samples_what_dynamic_cache_samples).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHAPES = {  # name: (hidden, layers, rows, prompt tokens, new tokens)
    "h128x2 32r t16": (128, 2, 32, 8, 16),
    "h128x2 256r t128": (128, 2, 256, 8, 128),
    "h128x2 64r p130 t64": (128, 2, 64, 130, 64),
    "h512x8 32r t64": (512, 8, 32, 8, 64),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch

    import gspo.rollout.hf as ro
    from gspo.models.tiny import build_char_tokenizer, build_tiny_model
    from gspo.rollout.hf import HFGenerator

    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    out = {}
    for name, (h, layers, rows, p, t) in SHAPES.items():
        model = build_tiny_model(tok, hidden_size=h, num_layers=layers, seed=0, max_position_embeddings=256).eval()
        gen = HFGenerator(model, tok, max_new_tokens=t, eos_token_ids=[len(tok) + 5])  # never drawn
        prompts = ["".join("0123456789+="[(i * 7 + j) % 12] for j in range(p)) for i in range(rows // 8)]
        times = {True: [], False: []}
        for r in range(a.rounds + 1):
            for pre in ((True, False) if r % 2 else (False, True)):
                ro.PREALLOCATE_CACHE = pre
                t0 = time.perf_counter()
                gen.generate(prompts, 8, seed=r)
                if r:  # round 0 warms up
                    times[pre].append(time.perf_counter() - t0)
        ratios = [d / b for b, d in zip(times[True], times[False])]
        out[name] = {"buffers_s": statistics.median(times[True]), "dynamic_s": statistics.median(times[False]),
                     "dynamic_over_buffers": statistics.median(ratios)}
        print(f"{name:<22} buffers {out[name]['buffers_s']:.3f} s  DynamicCache {out[name]['dynamic_s']:.3f} s  "
              f"-> {out[name]['dynamic_over_buffers']:.2f}x", flush=True)
    ro.PREALLOCATE_CACHE = True
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
