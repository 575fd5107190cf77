"""Decode tokens/s of gspo's loop (`rollout.decode=gspo`) against transformers' `generate`
(`rollout.decode=generate`), at equal work, in fp32 and under bf16 autocast
(`rollout.mixed_precision=bf16`): the sampler as `gspo train` builds it (`hf_generator`).

    python bench/gpu_decode.py                      # the Qwen2.5-0.5B shape on CUDA (bench/gpu_check.sh)
    python bench/gpu_decode.py --small              # a tiny model of the same family (CPU smoke)

The model is bench/gpu_check.py's: a random Qwen2 of the 0.5B shape with gspo's character
tokenizer, saved and loaded back by path as `gspo train model.name_or_path=DIR` loads it. Its
EOS is set to an id the tokenizer cannot produce and the random weights seldom sample, so every
row runs to `--new-tokens` on both sides (the tokens each side wrote are counted and reported).
Engines alternate within each round; round 0 warms up (CUDA kernels, allocator) and is not
timed. Reported: the median tokens/s over the timed rounds, and gspo / generate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import QWEN05, SMALL, build_model  # noqa: E402


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model_dir: Path, *, prompts: int, group: int, new_tokens: int, rounds: int,
            precisions=("fp32", "bf16")) -> dict:
    import torch

    from gspo.config import load_config
    from gspo.models import load_policy, resolve_device
    from gspo.train.run import hf_generator

    device = resolve_device("auto")
    model, tok = load_policy(str(model_dir), dtype="float32", device=str(device), trust_remote_code=False)
    model.eval()
    never = model.config.vocab_size - 1  # beyond the char tokenizer: sampled about once in 150k draws
    model.generation_config.eos_token_id = never
    texts = [f"{i}+{i * 7 % 97}=" for i in range(prompts)]
    out = {"device": str(device), "rows": prompts * group, "new_tokens": new_tokens, "cells": {}}
    for prec in precisions:
        gens = {}
        for engine in ("gspo", "generate"):
            cfg = load_config(None, [f"rollout.decode={engine}", f"rollout.mixed_precision={'bf16' if prec == 'bf16' else 'no'}",
                                     f"rollout.max_new_tokens={new_tokens}", "rollout.top_k=0", "rollout.top_p=1.0"])
            gens[engine] = hf_generator(cfg, model, tok)
            gens[engine].eos_token_ids = [never]
        secs: dict[str, list[float]] = {e: [] for e in gens}
        toks: dict[str, list[int]] = {e: [] for e in gens}
        for r in range(rounds + 1):
            for engine in (("gspo", "generate") if r % 2 else ("generate", "gspo")):
                _sync(device)
                t0 = time.perf_counter()
                ro = gens[engine].generate(texts, group, seed=r)
                _sync(device)
                if r:
                    secs[engine].append(time.perf_counter() - t0)
                    toks[engine].append(int(ro.completion_mask.sum()))
        cell = {e: {"s": statistics.median(secs[e]), "tokens": statistics.median(toks[e]),
                    "tok_s": statistics.median([n / s for n, s in zip(toks[e], secs[e])])} for e in gens}
        cell["gspo_over_generate"] = cell["gspo"]["tok_s"] / cell["generate"]["tok_s"]
        out["cells"][prec] = cell
        print(f"{prec}: gspo {cell['gspo']['tok_s']:.0f} tok/s ({cell['gspo']['tokens']:.0f} tokens), generate "
              f"{cell['generate']['tok_s']:.0f} tok/s ({cell['generate']['tokens']:.0f}) -> "
              f"{cell['gspo_over_generate']:.2f}x", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="a tiny model of the same family (CPU smoke)")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/gspo-gpu-decode/model"),
                   help="where the random model is saved (reused when it is there)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.small:
        a.prompts, a.group, a.new_tokens, a.rounds = 2, 4, 8, 1
    if not (a.model_dir / "config.json").exists():
        build_model(a.model_dir, SMALL if a.small else QWEN05)
    res = measure(a.model_dir, prompts=a.prompts, group=a.group, new_tokens=a.new_tokens, rounds=a.rounds)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
