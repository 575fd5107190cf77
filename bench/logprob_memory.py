"""Peak memory of LM head + per-token log-probs + GSPO loss + backward: chunked vs naive.

Starts from the last hidden states (B x T tokens, hidden H) and an LM head of vocab V with
random weights; default shape is the issue's: 16 x 1024 tokens, Qwen2.5-0.5B head (896 x
151,936), fp32. Reports the peak memory above the inputs and weights for
  naive:   logits = hidden @ W.T for every token at once, log_softmax, gather
  chunked: gspo.models.lm_head.head_logprobs (chunks under activation checkpointing)
each followed by gspo.algo.policy_loss (GSPO) and backward, and checks that the loss, the
per-token log-probs and the gradients of the hidden states and of W agree.

    python bench/logprob_memory.py                       # CUDA: peak from torch.cuda
    python bench/logprob_memory.py --tokens 2048 --vocab 32000   # small, also on a CPU (no peak)
"""

from __future__ import annotations

import argparse
import time

import torch

from gspo.algo import policy_loss
from gspo.config import PAPER_CLIP
from gspo.models.lm_head import head_logprobs


def naive_logprobs(head, hidden, targets):
    logits = head(hidden).float()  # (M, V): the whole thing at once
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)


def run(kind, head, hidden0, targets, old_logp, adv, mask, B, T, chunk):
    dev = hidden0.device
    hidden = hidden0.detach().clone().requires_grad_(True)
    head.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    if kind == "naive":
        lp = naive_logprobs(head, hidden, targets)
    else:
        lp = head_logprobs(head, hidden, targets, chunk_size=chunk)
    loss, _ = policy_loss(lp.view(B, T), old_logp, adv, mask, level="sequence", eps_low=PAPER_CLIP["sequence"][0],
                          eps_high=PAPER_CLIP["sequence"][1], max_log_ratio=10.0)
    loss.backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else float("nan")
    return loss.detach(), lp.detach(), hidden.grad.detach(), head.weight.grad.detach().clone(), peak, dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per response")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)
    B, T, M = a.batch, a.tokens, a.batch * a.tokens
    head = torch.nn.Linear(a.hidden, a.vocab, bias=False, device=dev)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(M, a.hidden, device=dev)
    targets = torch.randint(a.vocab, (M,), device=dev)
    with torch.no_grad():  # pi_old a little off the current policy, so ratios and clipping act
        old_logp = (head_logprobs(head, hidden, targets, chunk_size=a.chunk).view(B, T)
                    + 1e-3 * torch.randn(B, T, device=dev))
    adv = torch.randn(B, device=dev)
    mask = torch.ones(B, T, device=dev)
    res = {k: run(k, head, hidden, targets, old_logp, adv, mask, B, T, a.chunk) for k in ("chunked", "naive")}
    n, c = res["naive"], res["chunked"]
    gib = 2**30
    print(f"device {dev}, {B} x {T} tokens, hidden {a.hidden}, vocab {a.vocab}, fp32, chunk {a.chunk}")
    print(f"naive   peak above inputs+weights: {n[4] / gib:8.2f} GiB   {n[5]:.3f} s")
    print(f"chunked peak above inputs+weights: {c[4] / gib:8.2f} GiB   {c[5]:.3f} s")
    print(f"ratio chunked / naive: {c[4] / n[4]:.3f}")
    print(f"max |diff|: loss {abs(n[0] - c[0]).item():.2e}  logp {(n[1] - c[1]).abs().max().item():.2e}  "
          f"grad hidden {(n[2] - c[2]).abs().max().item():.2e}  grad W {(n[3] - c[3]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
