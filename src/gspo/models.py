"""Loading policies and computing per-token log-probabilities without full-vocabulary fp32 logits.

`token_logprobs` is the trainer's path to log π(y_t | x, y_<t): it runs the decoder body once,
keeps only the hidden states that predict completion tokens, and applies the LM head, the
temperature and the log-softmax a chunk of tokens at a time under activation checkpointing, so
the [tokens × vocab] fp32 logits never exist for the whole batch (neither in the forward pass
nor saved for backward). `naive_token_logprobs` is the plain `model(...).logits` reference.
"""

from __future__ import annotations

import os
import re
import warnings
import weakref

import torch
from torch.utils.checkpoint import checkpoint

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
# "org/name" or "name": what the Hub accepts as a repository id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelError(ValueError):
    """A policy could not be loaded (bad path, offline without a cache, unsupported dtype…)."""


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """``"auto"`` → ``cuda`` when available, else ``cpu``; anything else is passed to torch."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _check_source(name_or_path: str) -> None:
    """Fail before any download attempt when `name_or_path` is a missing local path."""
    if os.path.isdir(name_or_path):
        return
    if os.path.exists(name_or_path):
        raise ModelError(f"model path {name_or_path!r} is a file; expected a model directory")
    looks_local = (
        name_or_path.startswith(("/", ".", "~"))
        or "\\" in name_or_path
        or not _HUB_ID.match(name_or_path)
    )
    if looks_local:
        raise ModelError(
            f"model path {name_or_path!r} does not exist (and is not a Hugging Face Hub id)"
        )


def load_policy(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "auto",
    trust_remote_code: bool = False,
):
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``.

    `name_or_path` is a local directory (``save_pretrained`` format) or a Hub id. A missing
    local path raises `ModelError` before anything is tried; a Hub id that cannot be fetched
    (for instance with ``HF_HUB_OFFLINE=1`` and no cached copy) raises `ModelError` naming it.

    Tokenizer decisions: a tokenizer without a pad token gets ``pad_token = eos_token`` (safe
    here because rollouts carry explicit masks and find the end of a completion by its first
    EOS, never by the pad id); ``padding_side`` is set to ``"left"`` because prompts are
    left-padded for generation. The model's ``generation_config.pad_token_id`` is filled from
    the tokenizer when missing. The model is returned in eval mode, as ``from_pretrained``
    leaves it; the trainer switches modes itself.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = os.fspath(name_or_path)
    if name.startswith("~"):
        name = os.path.expanduser(name)
    _check_source(name)
    torch_dtype = _resolve_dtype(dtype)
    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as e:  # hub / file errors are OSError subclasses
        hint = " (HF_HUB_OFFLINE is set and no cached copy was found)" if offline else ""
        raise ModelError(f"could not load model {name!r}{hint}: {e}") from e
    model.to(resolve_device(device))

    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"tokenizer of {name!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS (an int or a list) and the
    tokenizer's ``eos_token_id``, deduplicated in that order."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(gen_eos, int):
        gen_eos = [gen_eos]
    for i in list(gen_eos or []) + [getattr(tokenizer, "eos_token_id", None)]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    return ids


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that restart at 0 at each row's first real token, so a left-padded prompt
    sees the same rotary positions as the unpadded one. (N, L) → (N, L) long."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------- attention on a CPU

_GQA_SDPA = "gspo_sdpa_gqa"


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' SDPA attention, except that with a padding mask on a CPU the grouped
    key/value heads go to SDPA as they are (``enable_gqa``) instead of being copied out to every
    query head (transformers' ``repeat_kv``, which it skips only when there is no mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (attention_mask is None or getattr(module, "num_key_value_groups", 1) == 1 or query.device.type != "cpu"
            or attention_mask.dtype != torch.bool or kwargs.get("position_bias") is not None
            or kwargs.get("cache") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use_cpu_gqa_attention(model) -> bool:
    """On a CPU, switch a grouped-query-attention model that runs transformers' "sdpa" to
    `_sdpa_gqa` (same numbers; measured ~10x cheaper per attention call at 128 rows x 50 cached
    tokens, which shows in decoding, where every step re-reads the whole cache). Returns whether
    it did. Not saved with the model: ``save_pretrained`` writes no attention implementation."""
    cfg = getattr(_unwrap(model), "config", None)
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    first = next(iter(model.parameters()), None)
    if (cfg is None or getattr(cfg, "_attn_implementation", None) != "sdpa" or not heads or not kv or kv >= heads
            or first is None or first.device.type != "cpu"):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(_GQA_SDPA, _sdpa_gqa)
    AttentionMaskInterface.register(_GQA_SDPA, sdpa_mask)
    _unwrap(model).set_attn_implementation(_GQA_SDPA)
    return True


# ----------------------------------------------------------------------------- LM head pieces


def _unwrap(model):
    """The transformers model inside a PEFT wrapper (LoRA layers stay injected in place)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _text_config(model):
    cfg = model.config
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def _logit_transform(model):
    """(scale, softcap) applied to the head's output by some architectures' forward."""
    cfg = _text_config(_unwrap(model))
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
    base = _unwrap(model)
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


def prompt_share_plan(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int):
    """How `token_logprobs(share_prompt=True)` runs a (N, P+T) call: (first row of each distinct
    prompt (k,), each row's prompt index (N,), leading columns padded in every distinct prompt),
    or None when the prompts it would not run again are under 1/8 of the call's tokens (then a
    second decoder call costs more than it saves)."""
    p = input_ids.shape[1] - completion_len
    first, inverse = prompt_groups(input_ids, attention_mask, p)
    mask_u = attention_mask[first, :p]  # (k, P)
    saved = int(attention_mask[:, :p].sum()) - int(mask_u.sum())  # prompt tokens not run again
    if saved * 8 < int(attention_mask.sum()):
        return None
    return first, inverse, int(mask_u.any(dim=0).long().argmax())


def _shared_prompt_hidden(model, input_ids, attention_mask, position_ids, t: int, agree=None):
    """Final hidden states at the positions predicting y_1..y_T, (N, T, H), with each distinct
    prompt run once: the decoder body runs on the k distinct prompts with a KV cache, the
    cache is expanded to the N rows (the gradient of every row flows back into its prompt's
    keys and values), and the completions run on top of it. The same numbers as one forward
    over [prompt | completion] (causal attention: a prompt position never sees the
    completion). None when it would not pay (`prompt_share_plan`) or the model's cache does not
    allow it (gradient checkpointing, recurrent layers). `agree(local decision) -> decision`
    makes the decision common to processes whose decoder calls are collectives (FSDP2): then
    every process makes the same two calls, or one."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    length = input_ids.shape[1]
    p = length - t
    body = _decoder_body(model)
    if body is None or getattr(_unwrap(model), "is_gradient_checkpointing", False):
        return None  # (checkpointed layers drop the cache)
    cache = DynamicCache(config=_text_config(_unwrap(model)))
    if not all(isinstance(layer, DynamicLayer) for layer in cache.layers):
        return None  # attention key/value caches only (full or sliding), not recurrent states
    plan = prompt_share_plan(input_ids, attention_mask, t)
    if agree is not None and not agree(plan is not None and t > 1):  # (t = 1 would be one call)
        return None
    if plan is None:
        return None
    first, inverse, cut = plan
    out = body(input_ids=input_ids[first, cut:p], attention_mask=attention_mask[first, cut:p],
               position_ids=position_ids[first, cut:p], past_key_values=cache, use_cache=True)
    last = out.last_hidden_state[:, -1:]  # (k, 1, H): predicts y_1
    if t == 1:
        return last[inverse]
    cache.batch_select_indices(inverse)  # (k, ...) -> (N, ...)
    out = body(input_ids=input_ids[:, p : length - 1], attention_mask=attention_mask[:, cut : length - 1],
               position_ids=position_ids[:, p : length - 1], past_key_values=cache, use_cache=True)
    return torch.cat([last[inverse], out.last_hidden_state], dim=1)  # (N, T, H)


def _transform(logits, scale, softcap):
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _chunk_logp(head, hidden, targets, temperature, scale, softcap):
    """log_softmax(head(hidden) / T)[targets] for one chunk: (n, H), (n,) → (n,) float32.

    The matmul runs in the model's dtype (as in the model's own forward); the logits are then
    upcast to fp32 for the temperature, the log-sum-exp and the gather.
    """
    logits = _transform(head(hidden).float(), scale, softcap)  # (n, V)
    if temperature != 1.0:  # (a division by 1 is a full pass over the logits for nothing)
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (n,)
    return picked - torch.logsumexp(logits, dim=-1)


_HEAD_OK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _head_matches_forward(model, head, scale, softcap, input_ids, attention_mask) -> bool:
    """Once per model: does head(final hidden) reproduce ``model(...).logits``? Guards against
    architectures whose forward transforms the logits in a way `_logit_transform` misses."""
    key = _unwrap(model)
    if key in _HEAD_OK:
        return _HEAD_OK[key]
    row = int(attention_mask.sum(dim=1).argmax())  # up to 16 real tokens of the longest row
    ids = input_ids[row][attention_mask[row].bool()][-16:].unsqueeze(0)  # (1, ≤16)
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        ref = ref.logits.float()
        ours = _transform(head(_final_hidden(model, ids, mask, pos)).float(), scale, softcap)
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
    temperature: float = 1.0,
    chunk_size: int = 512,
    share_prompt: bool = False,
    agree=None,
) -> torch.Tensor:
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
    the call's tokens (`prompt_share_plan`) and the model's cache allows it. Under FSDP2 pass
    `agree` (see `_shared_prompt_hidden`) so that all processes decide alike.
    """
    _check_inputs(input_ids, attention_mask, completion_len, temperature)
    n, length = input_ids.shape
    t = completion_len
    out = torch.zeros(n, t, dtype=torch.float32, device=input_ids.device)  # (N, T)
    if t == 0:
        return out
    base = _unwrap(model)
    head = base.get_output_embeddings()
    scale, softcap = _logit_transform(model)
    if head is None or not _head_matches_forward(
        model, head, scale, softcap, input_ids, attention_mask
    ):
        return naive_token_logprobs(
            model, input_ids, attention_mask, completion_len, temperature=temperature
        )

    position_ids = position_ids_from_mask(attention_mask)  # (N, L)
    hidden = None
    if share_prompt:
        hidden = _shared_prompt_hidden(model, input_ids, attention_mask, position_ids, t, agree)
    if hidden is None:
        hidden = _final_hidden(model, input_ids, attention_mask, position_ids)  # (N, L, H)
        hidden = hidden[:, length - t - 1 : length - 1]  # (N, T, H): positions predicting y_1..y_T
    targets = input_ids[:, length - t :]  # (N, T)
    valid = attention_mask[:, length - t :].bool()  # (N, T)
    hidden, targets = hidden[valid], targets[valid]  # (M, H), (M,) real tokens only

    if hidden.shape[0]:
        lp = head_logprobs(head, hidden, targets, temperature=temperature, chunk_size=chunk_size,
                           scale=scale, softcap=softcap)  # (M,)
        out = out.masked_scatter(valid, lp)  # (N, T)
    return out


# Below this many bytes of fp32 logits for a whole call, the head runs without checkpointing
# (its saved tensors are a few times this): recomputing it would only cost time.
_UNCHECKPOINTED_LOGITS_BYTES = 16 << 20


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                  chunk_size: int = 512, scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """log_softmax(head(hidden) / temperature)[targets] for M tokens, `chunk_size` at a time.

    (M, H), (M,) -> (M,) float32. With grad, each chunk runs under activation checkpointing, so
    only one chunk's [chunk x vocab] fp32 logits exist at a time, in the forward pass and again
    (recomputed) in the backward pass; the full [M x vocab] logits are never materialised.
    When all M x vocab fp32 logits fit in 16 MiB (small vocabularies), nothing is recomputed.
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
                _chunk_logp, head, h, y, temperature, scale, softcap,
                use_reentrant=False, preserve_rng_state=False,
            )
        else:
            lp = _chunk_logp(head, h, y, temperature, scale, softcap)
        pieces.append(lp)
    return torch.cat(pieces) if pieces else hidden.new_zeros(0, dtype=torch.float32)


def naive_token_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_len: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 512,
) -> torch.Tensor:
    """Reference for `token_logprobs`: the full ``model(...).logits`` (N, L, V), upcast to fp32,
    divided by the temperature, log-softmaxed and gathered. Same inputs, same output; `chunk_size`
    is accepted for signature compatibility and ignored."""
    del chunk_size
    _check_inputs(input_ids, attention_mask, completion_len, temperature)
    length, t = input_ids.shape[1], completion_len
    if t == 0:
        return torch.zeros(input_ids.shape[0], 0, dtype=torch.float32, device=input_ids.device)
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
    return torch.where(attention_mask[:, length - t :].bool(), picked, 0.0)


class LogprobModule(torch.nn.Module):
    """The trainer's forward as one module: completion-token log-probs of `policy`.

    Distributed wrappers (FSDP2's ``fully_shard``, DDP) hook a module's ``forward``; wrapping
    this module, rather than the Hugging Face model, lets `token_logprobs` run the decoder body
    and the chunked LM head directly while the wrapper still gathers and reduces the root's
    parameters (embeddings, final norm, head). ``autocast_dtype`` runs the forward under
    ``torch.autocast`` (bf16 compute over fp32 weights on one device or under DDP).
    ``share_prompt`` runs each distinct prompt of a call once (see `token_logprobs`; ``agree``
    makes that decision common to all processes, for FSDP2).
    """

    def __init__(self, policy, *, temperature: float = 1.0, chunk_size: int = 512,
                 autocast_dtype: torch.dtype | None = None, share_prompt: bool = False, agree=None):
        super().__init__()
        self.share_prompt = bool(share_prompt)
        self.agree = agree
        self.policy = policy
        self.temperature = float(temperature)
        self.chunk_size = int(chunk_size)
        self.autocast_dtype = autocast_dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_len: int) -> torch.Tensor:
        """(N, P+T) ids and mask → (N, T) float32 log-probs of the last `completion_len` tokens."""
        with torch.autocast(input_ids.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None):
            return token_logprobs(self.policy, input_ids, attention_mask, completion_len,
                                  temperature=self.temperature, chunk_size=self.chunk_size,
                                  share_prompt=self.share_prompt, agree=self.agree)
