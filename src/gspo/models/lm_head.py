"""The LM head's log-probabilities of given tokens, from final hidden states, a chunk at a time.

`head_logprobs` takes the (M, H) hidden states that predict M tokens and the (M,) tokens, and
applies the head, the logit transform of the architecture (`transform_logits`), the temperature
and the log-softmax `chunk_size` tokens at a time under activation checkpointing, so the
[M × vocab] fp32 logits never exist at once. The log-softmax of a chunk and its gather run in
one autograd function with the backward written out (`_PickedLogSoftmax`; with the entropy,
`_PickedLogSoftmaxEntropy`). `gspo.models.logprobs.token_logprobs` feeds it the decoder's
hidden states of the real completion tokens.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from gspo.config import ModelConfig, RolloutConfig


def transform_logits(logits, scale, softcap):
    """The (scale, softcap) of an architecture's forward (`gspo.models.logprobs._logit_transform`)
    applied to its head's logits: logits · scale, then softcap · tanh(logits / softcap)."""
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _shifted_logits(logits: torch.Tensor, factor: float) -> torch.Tensor:
    """factor · logits − max, in fp32, as a tensor the caller owns (written in place where the
    fp32 copy or the scaled one is already new): (n, V) -> (n, V) <= 0."""
    z = logits.float()  # (a copy for bf16 logits)
    owned = z is not logits
    if factor != 1.0:
        z = z.mul_(factor) if owned else z * factor
        owned = True
    top = z.amax(dim=-1, keepdim=True)  # (n, 1)
    return z.sub_(top) if owned else z - top


class _PickedLogSoftmax(torch.autograd.Function):
    """log_softmax(factor · logits)[targets], (n, V), (n,) -> (n,) float32, with the backward
    written out: d/dz = g · (onehot(target) − softmax(z)).

    The forward keeps exp(z − max) and its row sums, which the log-sum-exp computes anyway, so
    the backward is one in-place pass over them plus a scatter; autograd's logsumexp + gather
    backward recomputes the exponentials and allocates four (n, V) temporaries (zeros, exp,
    their product, the sum of the two gradients). The saved exponentials are consumed by the
    backward, so it runs once (no ``retain_graph``; a second call raises).
    """

    @staticmethod
    def forward(ctx, logits, targets, factor: float):
        zs = _shifted_logits(logits, factor)  # (n, V) <= 0, this function's own
        picked = zs.gather(-1, targets.unsqueeze(-1))  # (n, 1)
        e = zs.exp_()  # (n, V) in (0, 1]
        total = e.sum(dim=-1, keepdim=True)  # (n, 1) >= 1
        ctx.save_for_backward(e, total, targets)
        ctx.factor, ctx.dtype, ctx.spent = factor, logits.dtype, False
        return (picked - total.log()).squeeze(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        if ctx.spent:
            raise RuntimeError("_PickedLogSoftmax: backward ran twice (retain_graph is not supported)")
        ctx.spent = True
        e, total, targets = ctx.saved_tensors
        g = grad_out.float().unsqueeze(-1) * ctx.factor  # (n, 1)
        grad = e.mul_(-g / total)  # −g · softmax(z), in place over the saved exponentials
        grad.scatter_add_(-1, targets.unsqueeze(-1), g)  # + g at the target
        return grad.to(ctx.dtype), None, None


class _PickedLogSoftmaxEntropy(torch.autograd.Function):
    """`_PickedLogSoftmax` that also returns the entropy of softmax(z), z = factor · logits,
    from the same pass: (n, V), (n,) -> (n,), (n,) float32, H = log Σ e^z' − Σ e^z' z' / Σ e^z'
    (z' = z − max). The backward is written out too:
        d log p_y / dz = onehot(y) − p,     dH / dz = −p ⊙ (log p + H),
    so an entropy bonus needs no second pass over the vocabulary either. The exponentials
    overwrite the shifted logits a block of rows at a time (the dot product Σ e^z' z' needs
    both), so the forward holds one (n, V) tensor, as `_PickedLogSoftmax` does, plus a block of
    at most 4 MiB; the same saved tensors."""

    @staticmethod
    def forward(ctx, logits, targets, factor: float):
        zs = _shifted_logits(logits, factor)  # (n, V) <= 0
        picked = zs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n,)
        ez = torch.empty(zs.shape[0], dtype=zs.dtype, device=zs.device)  # (n,) Σ e^z' z'
        rows = max(1, (1 << 20) // max(zs.shape[1], 1))
        for start in range(0, zs.shape[0], rows):
            block = zs[start : start + rows]
            e_block = block.exp()
            ez[start : start + rows] = torch.linalg.vecdot(e_block, block)
            block.copy_(e_block)
        e = zs  # (n, V) in (0, 1], now the exponentials
        total = e.sum(dim=-1)  # (n,) >= 1
        log_total = total.log()
        entropy = log_total - ez / total  # (n,)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(e, total, targets, entropy)
        ctx.factor, ctx.dtype, ctx.spent = factor, logits.dtype, False
        return picked - log_total, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        if ctx.spent:
            raise RuntimeError("_PickedLogSoftmaxEntropy: backward ran twice (retain_graph is not supported)")
        ctx.spent = True
        e, total, targets, entropy = ctx.saved_tensors
        p = e.div_(total.unsqueeze(-1))  # (n, V) softmax, in place over the saved exponentials
        g_lp = torch.zeros_like(total) if g_lp is None else g_lp.float()  # (n,)
        if g_ent is None:
            grad = p.mul_(-g_lp.unsqueeze(-1))
        else:
            g_ent = g_ent.float()
            plogp = torch.special.xlogy(p, p)  # (n, V) p log p, 0 where p underflowed to 0
            grad = p.mul_(-(g_lp + g_ent * entropy).unsqueeze(-1)).sub_(plogp.mul_(g_ent.unsqueeze(-1)))
        grad.scatter_add_(-1, targets.unsqueeze(-1), g_lp.unsqueeze(-1))  # + g at the target
        return grad.mul_(ctx.factor).to(ctx.dtype), None, None


def softmax_entropy(logp_full: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of a (n, V) log-softmax: −Σ p log p."""
    return -(logp_full.exp() * logp_full).sum(-1)


def _chunk_logp(head, hidden, targets, temperature, scale, softcap, entropy=False):
    """log_softmax(head(hidden) / T)[targets] for one chunk: (n, H), (n,) → (n,) float32; with
    `entropy`, also the entropy of softmax(head(hidden) / T) at each of the n positions.

    The matmul runs in the model's dtype (as in the model's own forward); the logits are then
    upcast to fp32 for the temperature, the log-sum-exp and the gather (`_PickedLogSoftmax`;
    a soft-capped head goes through autograd).
    """
    if softcap is None:
        fn = _PickedLogSoftmaxEntropy if entropy else _PickedLogSoftmax
        return fn.apply(head(hidden), targets, scale / temperature)
    logits = transform_logits(head(hidden).float(), scale, softcap)  # (n, V)
    if temperature != 1.0:  # (a division by 1 is a full pass over the logits for nothing)
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n,)
    lp = picked - torch.logsumexp(logits, dim=-1)
    return (lp, softmax_entropy(torch.log_softmax(logits, dim=-1))) if entropy else lp


# Below this many bytes of fp32 logits for a whole call, the head runs without checkpointing
# (its saved tensors are a few times this): recomputing it would only cost time.
_UNCHECKPOINTED_LOGITS_BYTES = 16 << 20


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = RolloutConfig.temperature,
                  chunk_size: int = ModelConfig.logprob_chunk_size, scale: float = 1.0, softcap: float | None = None,
                  entropy: bool = False):
    """log_softmax(head(hidden) / temperature)[targets] for M tokens, `chunk_size` at a time.

    (M, H), (M,) -> (M,) float32. With grad, each chunk runs under activation checkpointing, so
    only one chunk's [chunk x vocab] fp32 logits exist at a time, in the forward pass and again
    (recomputed) in the backward pass; the full [M x vocab] logits are never materialised.
    When all M x vocab fp32 logits fit in 16 MiB (small vocabularies), nothing is recomputed.
    With `entropy`, returns (log-probs (M,), entropies (M,)): each position's entropy of
    softmax(logits / temperature) from the same chunks, differentiable.
    """
    use_ckpt = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    if use_ckpt and hidden.shape[0] * vocab * 4 <= _UNCHECKPOINTED_LOGITS_BYTES:
        use_ckpt = False  # small logits (a small vocabulary): keeping them costs less than recomputing
    pieces = []
    for start in range(0, hidden.shape[0], chunk_size):
        h, y = hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if use_ckpt:
            lp = checkpoint(
                _chunk_logp, head, h, y, temperature, scale, softcap, entropy,
                use_reentrant=False, preserve_rng_state=False,
            )
        else:
            lp = _chunk_logp(head, h, y, temperature, scale, softcap, entropy)
        pieces.append(lp)
    if not entropy:
        return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)
    if not pieces:
        return hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
