"""Per-token log-probabilities of a policy, without full-vocabulary fp32 logits.

`token_logprobs` is the trainer's path to log π(y_t | x, y_<t): it runs the decoder body once
(or each distinct prompt once, then the completions on its KV cache: `share_prompt`), keeps
only the hidden states that predict completion tokens, and applies the LM head, the temperature
and the log-softmax a chunk of tokens at a time under activation checkpointing
(`gspo.models.lm_head.head_logprobs`), so the [tokens × vocab] fp32 logits never exist for the
whole batch (neither in the forward pass nor saved for backward). `naive_token_logprobs` is the
plain `model(...).logits` reference, and `LogprobModule` the module that distributed wrappers wrap.
"""

from __future__ import annotations

import math

import warnings
import weakref
from contextlib import contextmanager

import torch

from gspo.config import ModelConfig, RolloutConfig
from gspo.models import (CACHE_KWARG, base_model, eval_mode, holds_recurrent_state, is_activation_checkpointing,
                         position_ids_from_mask, takes_dynamic_cache)
from gspo.models.lm_head import head_logprobs, softmax_entropy, transform_logits

# ----------------------------------------------------------------------------- hidden states


def _text_config(model):
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _logit_transform(model):
    """(scale, softcap) applied to the head's output by some architectures' forward."""
    cfg = _text_config(base_model(model))
    scale = 1.0
    if getattr(cfg, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        scale *= float(cfg.logit_scale)
    if getattr(cfg, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        scale /= float(cfg.logits_scaling)
    softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3
    return scale, (float(softcap) if softcap else None)


def _final_hidden(model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """Final (post-norm) hidden states (N, L, H), without computing any logits when the
    decoder body can be found; otherwise through ``output_hidden_states``."""
    body = _decoder_body(model)
    if body is not None:
        out = body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        return out.last_hidden_state
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        output_hidden_states=True,
    )
    return out.hidden_states[-1]


def _decoder_body(model):
    base = base_model(model)
    body = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "model", None)
    return body if body is not None and body is not base else None


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int):
    """Rows with the same (left-padded) prompt: (first row of each distinct prompt (k,),
    each row's prompt index (N,)); prompts are compared over their real tokens and padding."""
    prompt = torch.where(attention_mask[:, :prompt_len].bool(), input_ids[:, :prompt_len], -1)  # (N, P)
    _, inverse = torch.unique(prompt, dim=0, return_inverse=True)  # (N,)
    k = int(inverse.max()) + 1
    rows = torch.arange(len(inverse), device=inverse.device)
    first = torch.full((k,), len(inverse), device=inverse.device).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


def prompt_share_plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                      min_saved: int = 0):
    """How `token_logprobs(share_prompt=True)` runs a (N, P+T) call: (first row of each distinct
    prompt (k,), each row's prompt index (N,), leading columns padded in every distinct prompt),
    or None when the prompt tokens it would not run again are under 1/8 of the call's tokens or
    under `min_saved` (then a second decoder call costs more than it saves)."""
    p = input_ids.shape[1] - completion_len
    first, inverse = prompt_groups(input_ids, attention_mask, p)
    mask_u = attention_mask[first, :p]  # (k, P)
    prompt_all, prompt_once, total, cut = torch.stack([  # one device sync for the four numbers
        attention_mask[:, :p].sum(), mask_u.sum(), attention_mask.sum(), mask_u.any(dim=0).long().argmax()]).tolist()
    if (prompt_all - prompt_once) * 8 < total or prompt_all - prompt_once < min_saved:  # the tokens not run again
        return None
    return first, inverse, cut


# Listeners told which tokens each decoder-body call of `token_logprobs` runs (MoE route
# tracking, `gspo.models.routing.RouteTracker`): fn(rows, col_start, mask, fan_out) before each call
# and fn(None, 0, None, None) after the last; see `announce_body_calls`.
_BODY_CALL_LISTENERS: list = []


@contextmanager
def announce_body_calls(listener):
    """While active, `listener(rows, col_start, mask, fan_out)` hears of every decoder-body call
    `token_logprobs` makes (one over all columns but the last, which predicts nothing, or with
    ``share_prompt`` one over each distinct prompt and one over the completions), in the input
    coordinates: ``rows`` (k,) the input rows it runs (None: all), ``col_start`` the input
    column of its first token, ``mask`` (k, l) its real tokens, ``fan_out`` (N,) the run row
    standing for each input row (None: one-to-one); then ``listener(None, 0, None, None)``
    once the forward is over. The full-logits fallback (`naive_token_logprobs`) announces
    nothing: its one call covers the input as it is."""
    _BODY_CALL_LISTENERS.append(listener)
    try:
        yield
    finally:
        _BODY_CALL_LISTENERS.remove(listener)


def _announce(rows, col_start, mask, fan_out) -> None:
    for fn in _BODY_CALL_LISTENERS:
        fn(rows, col_start, mask, fan_out)


def can_share_prompt(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                     min_work: float = 0.0) -> bool:
    """Whether `token_logprobs(share_prompt=True)` would run this call's distinct prompts once:
    the model's cache allows it (no gradient checkpointing, attention key/value caches only)
    and it pays (`prompt_share_plan`, and `min_work`: see `share_min_saved`). The rollout's plan
    (`gspo.train.plan`) asks this of every forward, so that under FSDP2 the processes make the
    decision together before any forward."""
    return _share_plan(model, input_ids, attention_mask, completion_len, min_work) is not None


def share_min_saved(model, min_work: float) -> int:
    """The prompt tokens a shared call must save to pay for its second decoder call:
    `min_work` (model.share_prompt_min_work) over the weights of one decoder layer that a token
    runs through (`layer_weights`: a MoE layer's routed experts only). The second
    call costs a fixed overhead per layer (kernel launches, Python, autograd nodes), the tokens
    saved cost their matrix products (about weights x tokens): on the tiny models short prompts
    do not pay, on big ones they do (docs/benchmarks.md)."""
    if min_work <= 0:
        return 0
    per_layer = layer_weights(model)
    return math.ceil(min_work / per_layer) if per_layer else 0


def layer_weights(model, active: bool = True) -> float:
    """Mean weights of one decoder layer (0 without a decoder body); with `active`, those a token
    runs through: a MoE layer's experts count num_experts_per_tok / num_experts of theirs
    (parameters under an `experts` module). Counted once per model."""
    key = f"_gspo_layer_weights_{active}"
    if key not in model.__dict__:
        body = _decoder_body(model)
        layers = getattr(body, "layers", None) if body is not None else None
        config = _text_config(base_model(model))
        k, e = getattr(config, "num_experts_per_tok", None), getattr(config, "num_experts", None)
        routed = k / e if active and isinstance(k, int) and isinstance(e, int) and e > 0 else 1.0
        total = 0.0
        for layer in layers or []:
            for name, p in layer.named_parameters():
                total += p.numel() * (routed if ".experts." in f".{name}" else 1.0)
        model.__dict__[key] = total / len(layers) if layers else 0.0
    return model.__dict__[key]


def _share_plan(model, input_ids, attention_mask, completion_len: int, min_work: float = 0.0):
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if _decoder_body(model) is None or is_activation_checkpointing(model) or not takes_dynamic_cache(model):
        return None  # (checkpointed layers drop the cache; a family's own cache class is not one to share)
    cache = DynamicCache(config=_text_config(base_model(model)))
    if not all(isinstance(layer, DynamicLayer) and not holds_recurrent_state(layer) for layer in cache.layers):
        return None  # attention key/value caches only (full or sliding), not recurrent states (hybrids)
    return prompt_share_plan(input_ids, attention_mask, completion_len, share_min_saved(model, min_work))


def _shared_prompt_hidden(model, input_ids, attention_mask, position_ids, t: int, decided: bool | None = None,
                          min_work: float = 0.0):
    """Final hidden states at the positions predicting y_1..y_T, (N, T, H), with each distinct
    prompt run once: the decoder body runs on the k distinct prompts with a KV cache, the
    cache is expanded to the N rows (the gradient of every row flows back into its prompt's
    keys and values), and the completions run on top of it. The same numbers as one forward
    over [prompt | completion] (causal attention: a prompt position never sees the
    completion). None when it would not pay or the model's cache does not allow it
    (`can_share_prompt`), or when `decided` is False. `decided` is the decision made for this
    call beforehand (the rollout's plan makes it alike on every process whose decoder calls are
    collectives, FSDP2); None decides here, from this call's rows."""
    from transformers import DynamicCache

    plan = None if decided is False else _share_plan(model, input_ids, attention_mask, t, 0.0 if decided else min_work)
    if plan is None:  # (decided=True with no plan cannot happen: the decision was made from these rows)
        return None
    length = input_ids.shape[1]
    p = length - t
    body = _decoder_body(model)
    cache = DynamicCache(config=_text_config(base_model(model)))
    first, inverse, cut = plan
    try:
        _announce(first, cut, attention_mask[first, cut:p], inverse)
        out = body(input_ids=input_ids[first, cut:p], attention_mask=attention_mask[first, cut:p],
                   position_ids=position_ids[first, cut:p], **{CACHE_KWARG: cache}, use_cache=True)
        last = out.last_hidden_state[:, -1:]  # (k, 1, H): predicts y_1
        if t == 1:
            return last[inverse]
        cache.batch_select_indices(inverse)  # (k, ...) -> (N, ...)
        _announce(None, p, attention_mask[:, p : length - 1], None)
        out = body(input_ids=input_ids[:, p : length - 1], attention_mask=attention_mask[:, cut : length - 1],
                   position_ids=position_ids[:, p : length - 1], **{CACHE_KWARG: cache}, use_cache=True)
    finally:
        _announce(None, 0, None, None)
    return torch.cat([last[inverse], out.last_hidden_state], dim=1)  # (N, T, H)


_HEAD_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _head_matches_forward(model, head, scale, softcap, input_ids, attention_mask) -> bool:
    """Once per model: does head(final hidden) reproduce ``model(...).logits``? Guards against
    architectures whose forward transforms the logits in a way `_logit_transform` misses.
    The two forwards run in eval mode and on a forked RNG: with `model.dropout=true` they would
    otherwise differ by their dropout masks, and draw from the RNG at the first trainer pass of
    each process, so that a resumed run would part from the one it continues."""
    key = base_model(model)
    if key in _HEAD_OK:
        return _HEAD_OK[key]
    row = int(attention_mask.sum(dim=1).argmax())  # up to 16 real tokens of the longest row
    ids = input_ids[row][attention_mask[row].bool()][-16:].unsqueeze(0)  # (1, ≤16)
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    devices = [ids.device] if ids.device.type != "cpu" else []
    with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=ids.device.type), eval_mode(model):
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        ref = ref.logits.float()
        ours = transform_logits(head(_final_hidden(model, ids, mask, pos)).float(), scale, softcap)
        tol = (1e-4 if ref.dtype == torch.float32 else 1e-2) * max(1.0, ref.abs().max().item())
        ok = ours.shape == ref.shape and (ours - ref).abs().max().item() <= tol
    if not ok:
        warnings.warn(
            f"{type(key).__name__}: the LM head applied to the final hidden states does not "
            "reproduce model(...).logits; falling back to full-logit log-probs (more memory)",
            stacklevel=3,
        )
    _HEAD_OK[key] = ok
    return ok


# ----------------------------------------------------------------------------- log-probs


def _check_inputs(input_ids, attention_mask, completion_len, temperature):
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be (N, P+T)"
        )
    if not 0 <= completion_len < input_ids.shape[1]:
        raise ValueError(
            f"completion_len={completion_len} needs at least one prompt column before it "
            f"(sequence length {input_ids.shape[1]})"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_len: int,
    *,
    temperature: float = RolloutConfig.temperature,
    chunk_size: int = ModelConfig.logprob_chunk_size,
    share_prompt: bool = ModelConfig.share_prompt,
    decided: bool | None = None,
    share_min_work: float = 0.0,
    entropy: bool = False,
):
    """log π(y_t | x, y_<t) of every completion token, at the sampling temperature.

    `input_ids` is ``[left-padded prompt | right-padded completion]``, shape (N, P+T) with
    ``T = completion_len``; `attention_mask` marks real tokens. Returns (N, T) float32 with
    ``log_softmax(logits / temperature)`` over the full, unfiltered vocabulary (top-p/top-k
    never enter: they belong to the sampler, not to π), and 0 where the mask is 0.

    Memory: the decoder body runs once; only the hidden states of real completion positions
    are kept, and the head + log-softmax run `chunk_size` tokens at a time under activation
    checkpointing, so at most one chunk's [chunk × vocab] fp32 logits exist at any moment, in
    the forward pass and again (recomputed) in the backward pass. Works with and without grad.
    Position ids restart at each row's first real token (left padding changes nothing).

    ``share_prompt``: rows with the same prompt (a group's G completions) run it once: the
    distinct prompts go through the decoder with a KV cache, and every row's completion runs on
    top of its prompt's keys and values. The same numbers (to float rounding) and gradients,
    with the prompt's work done once instead of G times; used when it saves at least 1/8 of
    the call's tokens (`prompt_share_plan`) and the model's cache allows it (`can_share_prompt`).
    ``decided`` is that decision made beforehand (under FSDP2 the rollout's plan makes it alike
    on every process); None decides from this call's rows, and then ``share_min_work`` (see
    `share_min_saved`) must be met too.

    ``entropy``: return (log-probs, entropies), both (N, T) float32: the entropy of π(· | x,
    y_<t) at the sampling temperature at each completion position, from the same chunked head
    (no second pass over the vocabulary), differentiable, 0 where the mask is 0.
    """
    _check_inputs(input_ids, attention_mask, completion_len, temperature)
    n, length = input_ids.shape
    t = completion_len
    out = torch.zeros(n, t, dtype=torch.float32, device=input_ids.device)  # (N, T)
    if t == 0:
        return (out, out.clone()) if entropy else out
    base = base_model(model)
    head = base.get_output_embeddings()
    scale, softcap = _logit_transform(model)
    if head is None or not _head_matches_forward(
        model, head, scale, softcap, input_ids, attention_mask
    ):
        return naive_token_logprobs(
            model, input_ids, attention_mask, completion_len, temperature=temperature, entropy=entropy
        )

    position_ids = position_ids_from_mask(attention_mask)  # (N, L)
    hidden = None
    if share_prompt:
        hidden = _shared_prompt_hidden(model, input_ids, attention_mask, position_ids, t, decided, share_min_work)
    if hidden is None:  # one call; the last token predicts nothing here, so it is not run
        try:
            _announce(None, 0, attention_mask[:, :-1], None)
            hidden = _final_hidden(model, input_ids[:, :-1], attention_mask[:, :-1], position_ids[:, :-1])
        finally:
            _announce(None, 0, None, None)
        hidden = hidden[:, length - t - 1 :]  # (N, T, H): positions predicting y_1..y_T
    targets = input_ids[:, length - t :]  # (N, T)
    valid = attention_mask[:, length - t :].bool()  # (N, T)
    hidden, targets = hidden[valid], targets[valid]  # (M, H), (M,) real tokens only

    ent_out = out.clone() if entropy else None
    if hidden.shape[0]:
        lp = head_logprobs(head, hidden, targets, temperature=temperature, chunk_size=chunk_size,
                           scale=scale, softcap=softcap, entropy=entropy)  # (M,) or two
        if entropy:
            lp, ent = lp
            ent_out = ent_out.masked_scatter(valid, ent)  # (N, T)
        out = out.masked_scatter(valid, lp)  # (N, T)
    return (out, ent_out) if entropy else out


def naive_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_len: int,
    *,
    temperature: float = RolloutConfig.temperature,
    chunk_size: int = 512,
    entropy: bool = False,
):
    """Reference for `token_logprobs`: the full ``model(...).logits`` (N, L, V), upcast to fp32,
    divided by the temperature, log-softmaxed and gathered. Same inputs, same output (with
    ``entropy``, the entropies too); `chunk_size` is accepted for signature compatibility and
    ignored."""
    del chunk_size
    _check_inputs(input_ids, attention_mask, completion_len, temperature)
    length, t = input_ids.shape[1], completion_len
    if t == 0:
        out = torch.zeros(input_ids.shape[0], 0, dtype=torch.float32, device=input_ids.device)
        return (out, out.clone()) if entropy else out
    position_ids = position_ids_from_mask(attention_mask)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
    ).logits  # (N, L, V), model dtype
    logits = logits[:, length - t - 1 : length - 1].float() / temperature  # (N, T, V)
    logp = torch.log_softmax(logits, dim=-1)
    targets = input_ids[:, length - t :]  # (N, T)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N, T)
    valid = attention_mask[:, length - t :].bool()
    if entropy:
        return torch.where(valid, picked, 0.0), torch.where(valid, softmax_entropy(logp), 0.0)
    return torch.where(valid, picked, 0.0)


class LogprobModule(torch.nn.Module):
    """The trainer's forward as one module: completion-token log-probs of `policy`.

    Distributed wrappers (FSDP2's ``fully_shard``, DDP) hook a module's ``forward``; wrapping
    this module, rather than the Hugging Face model, lets `token_logprobs` run the decoder body
    and the chunked LM head directly while the wrapper still gathers and reduces the root's
    parameters (embeddings, final norm, head). ``autocast_dtype`` runs the forward under
    ``torch.autocast`` (bf16 compute over fp32 weights on one device or under DDP).
    ``share_prompt`` runs each distinct prompt of a call once (see `token_logprobs`); a call's
    ``share`` is that decision made beforehand (the rollout's plan, alike on every process).
    """

    def __init__(self, policy, *, temperature: float = RolloutConfig.temperature,
                 chunk_size: int = ModelConfig.logprob_chunk_size, autocast_dtype: torch.dtype | None = None,
                 share_prompt: bool = ModelConfig.share_prompt, share_min_work: float = 0.0):
        super().__init__()
        self.share_prompt = bool(share_prompt)
        self.share_min_work = float(share_min_work)
        self.policy = policy
        self.temperature = float(temperature)
        self.chunk_size = int(chunk_size)
        self.autocast_dtype = autocast_dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int,
                share: bool | None = None, entropy: bool = False):
        """(N, P+T) ids and mask → (N, T) float32 log-probs of the last `completion_len` tokens
        (with `entropy`, and π's entropy at each of those positions)."""
        with torch.autocast(input_ids.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            return token_logprobs(self.policy, input_ids, attention_mask, completion_len,
                                  temperature=self.temperature, chunk_size=self.chunk_size,
                                  share_prompt=self.share_prompt, decided=share, share_min_work=self.share_min_work,
                                  entropy=entropy)
