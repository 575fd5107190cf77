"""torch's CPU threads for a run: `setup_threads` at start-up (one thread on a machine of <= 4
cores), then `threads_for_model` once the model has loaded (every core for a compute-bound
model in sync mode). The measurements behind both rules are in docs/benchmarks.md."""

from __future__ import annotations

import os

import torch

from gspo.config import Config


def setup_threads(n: int = 0) -> int:
    """torch CPU threads: `n`, or auto. On machines with <= 4 cores, one thread: on a 2-core VM
    (docs/benchmarks.md, bench/step.py --compare-threads) it was within 1.3-1.7x of the best
    setting in every case and never slowed by outside load, while 2 threads were 1.4x slower
    with OMP_WAIT_POLICY=PASSIVE and up to 3.3x slower without it once another process held a
    core. On bigger machines half the cores leaves room for reward workers (not yet measured)."""
    if n <= 0:
        if "OMP_NUM_THREADS" in os.environ:
            return torch.get_num_threads()
        cores = os.cpu_count() or 1
        n = 1 if cores <= 4 else max(cores // 2, 1)
    torch.set_num_threads(n)
    return n


# Weights per call from which a model counts as compute-bound for the thread default:
# the hidden-512 shape of docs/benchmarks.md's thread table (~1M a layer) ran 1.27x faster with 2
# PASSIVE threads than with 1 on an idle 2-core VM and 1.04x slower with a core busy; the demo's
# model (~0.1M) ran 1.41x slower; bench/trl_compare.py --grid's 32M cell (3.9M a layer) lost to
# TRL at 2 threads while gspo ran 1. The LM head counts too: hidden 128 with a 32k vocabulary
# (4.1M head weights, 0.1M a layer) ran 1.06-1.52x faster a rollout with 2 threads.
COMPUTE_BOUND_LAYER_WEIGHTS = 750_000


def compute_weights(model) -> float:
    """The larger of one decoder layer's weights and the LM head's: what one call of the model's
    biggest part multiplies each token by. The head is the bigger on a small model with a real
    tokenizer's vocabulary (hidden 128 x 32,000 = 4.1M against 0.1M a layer)."""
    from gspo.models import base_model
    from gspo.models.logprobs import layer_weights

    head = getattr(base_model(model), "get_output_embeddings", lambda: None)()  # (a remote-code model may lack it)
    weight = getattr(head, "weight", None) if head is not None else None
    return max(layer_weights(model, active=False), float(weight.numel()) if weight is not None else 0.0)


def threads_for_model(cfg: Config, model) -> int:
    """After the model loads: with `threads` auto on a machine of <= 4 cores (one thread by
    default, `setup_threads`), a compute-bound model (`compute_weights`) gets every core (sync
    mode only; async mode's processes take a core each). Returns the thread count in force."""
    cores = os.cpu_count() or 1
    if cfg.threads > 0 or "OMP_NUM_THREADS" in os.environ or cores > 4 or cores < 2 or cfg.rollout.mode == "async":
        return torch.get_num_threads()
    if compute_weights(model) >= COMPUTE_BOUND_LAYER_WEIGHTS:
        torch.set_num_threads(cores)
    return torch.get_num_threads()
