"""The sampling rule of gspo's decode loop (`gspo.rollout.hf.decode`; the vLLM backend asks its
engine for the same rule): one token per row from softmax(logits / T), restricted by top-k then
top-p, drawn by inverse CDF; the log-prob returned is of the UNFILTERED distribution,
log_softmax(logits / T), which is what the trainer computes for π_old (GSPO.md, "Pitfalls").
`check_sampling` holds the settings every generator accepts.
"""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_p: float, top_k: int, max_new_tokens: int) -> None:
    """The sampling settings every generator accepts (ValueError otherwise)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (no greedy decoding), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")



_CDF_BLOCK = 64  # tokens per block of the two-level inverse CDF


def _inverse_cdf(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row from unnormalised non-negative weights (b, V) float32, by inverse CDF
    with one float64 uniform per row: -> (tokens (b,) long, row totals (b,) float64).

    Two levels, so that no float64 pass over the whole vocabulary is needed: the uniform picks
    a block of `_CDF_BLOCK` tokens by the cumulative block sums (float64 over V/64 sums), then
    a token within the block by that block's cumulative weights (float64 over 64 values).
    A zero-weight token is never returned (a uniform rounded onto a block's last edge falls
    back to the row's heaviest token).
    """
    b, vocab = weights.shape
    full = vocab - vocab % _CDF_BLOCK
    sums = weights[:, :full].reshape(b, -1, _CDF_BLOCK).sum(-1)  # (b, V // 64)
    if full < vocab:
        sums = torch.cat([sums, weights[:, full:].sum(-1, keepdim=True)], dim=1)
    cum = sums.double().cumsum(-1)  # (b, blocks)
    total = cum[:, -1:]
    u = torch.rand(b, 1, dtype=torch.float64, device=weights.device) * total  # (b, 1)
    block = torch.searchsorted(cum, u, right=True).clamp_(max=cum.shape[1] - 1)  # (b, 1)
    idx = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=weights.device)  # (b, 64)
    inside = idx < vocab
    vals = weights.gather(1, idx.clamp(max=vocab - 1)).double() * inside
    before = cum.gather(1, (block - 1).clamp_(min=0)) * (block > 0)  # mass of the blocks before
    j = torch.searchsorted(vals.cumsum(-1), u - before, right=True).clamp_(max=_CDF_BLOCK - 1)
    tokens = idx.gather(1, j).squeeze(1).clamp_(max=vocab - 1)
    bad = weights.gather(1, tokens[:, None]).squeeze(1) == 0
    if bool(bad.any()):
        tokens = torch.where(bad, weights.argmax(-1), tokens)
    return tokens, total.squeeze(1)


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """Draw one token per row from softmax(logits / T) restricted by top-k, then top-p.

    (b, V) raw logits -> (tokens (b,) long, log_softmax(logits / T)[token] (b,) float32): the
    log-prob is of the UNFILTERED distribution (the filters only decide what can be drawn).
    Drawing by inverse CDF (one float64 uniform per row, `_inverse_cdf`) is exact and, on a CPU,
    an order of magnitude cheaper than torch.multinomial; without filters the draw and the
    log-prob share one exp pass over the vocabulary.
    """
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()  # (b, V)
    vocab = scaled.shape[-1]
    if not (0 < top_k < vocab or top_p < 1.0):
        top = scaled.amax(-1, keepdim=True)  # (b, 1)
        tokens, total = _inverse_cdf((scaled - top).exp_())  # weights exp(logit - max) <= 1
        lse = top.squeeze(1) + total.log().float()
        return tokens, scaled.gather(-1, tokens[:, None]).squeeze(-1) - lse
    logp = scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)  # (b, V)
    allowed = logp
    if 0 < top_k < vocab:
        kth = torch.topk(logp, top_k, dim=-1).values[:, -1:]  # (b, 1)
        allowed = allowed.masked_fill(allowed < kth, float("-inf"))
    if top_p < 1.0:  # the smallest set of most likely tokens holding >= top_p of the mass
        srt, order = torch.sort(allowed, dim=-1, descending=True)
        p = torch.softmax(srt, dim=-1)
        drop = (p.cumsum(-1) - p) >= top_p  # mass before this token already reaches top_p
        drop[:, 0] = False
        allowed = allowed.scatter(-1, order, srt.masked_fill(drop, float("-inf")))
    tokens, _ = _inverse_cdf(allowed.exp())  # log-probs <= 0; unnormalised: the draw scales by the total
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
