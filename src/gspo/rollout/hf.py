"""The hf backend (`rollout.backend=hf`): `HFGenerator` samples from the trainer's own module.

Its default engine is gspo's KV-cache decode loop (`decode`: the head on the last position only,
finished rows leave the batch, each distinct prompt prefilled once, tokens drawn by
`gspo.rollout.sampling.sample_tokens`); ``engine="hf"`` runs transformers' ``generate`` with a
logits processor (`_RawLogprobRecorder`) that records the sampler's log-probs. Either way the
sampled tokens become a `Rollout` through `gspo.rollout.assemble_rollout`, as the vLLM backend's
(`gspo.rollout.vllm`) do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gspo.config import RolloutConfig
from gspo.models import generation_mode
from gspo.rollout import Rollout, assemble_rollout, chunk_seed, encode_prompts, left_pad, special_ids
from gspo.rollout.sampling import check_sampling, sample_tokens


class _RawLogprobRecorder:
    """Logits processor that records log_softmax(raw_logits / T) of each sampled token.

    transformers applies processors built from the generation config first, then custom ones,
    then the sampling warpers (temperature, top-k, top-p). `HFGenerator` runs generate with a
    clean generation config, so this processor sees the raw fp32 logits, the same tensor that
    ``output_logits=True`` would return. Instead of keeping all T steps of (B, V) logits, it
    keeps one step: the token drawn at step t is read from ``input_ids[:, -1]`` at step t+1.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.prev_logp: torch.Tensor | None = None  # (B, V)
        self.picked: list[torch.Tensor] = []  # T × (B,)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev_logp is not None:
            self._gather(input_ids[:, -1])
        self.prev_logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def _gather(self, tokens: torch.Tensor) -> None:
        self.picked.append(self.prev_logp.gather(-1, tokens[:, None]).squeeze(-1))

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """Log-probs of all generated tokens, (B, T_gen) float32."""
        if self.prev_logp is not None:
            self._gather(last_tokens)
            self.prev_logp = None
        if not self.picked:
            return torch.zeros(last_tokens.shape[0], 0, device=last_tokens.device)
        return torch.stack(self.picked, dim=1)


PREALLOCATE_CACHE = True  # bench/decode_cache.py compares both


def _preallocated_cache(model, capacity: int):
    from gspo.rollout.kv_cache import preallocated_cache

    return preallocated_cache(model, capacity)


def decode(model, ids: torch.Tensor, mask: torch.Tensor, *, max_new_tokens: int, eos_token_ids: Sequence[int],
           pad_token_id: int, temperature: float = RolloutConfig.temperature, top_k: int = RolloutConfig.top_k,
           top_p: float = RolloutConfig.top_p, on_forward=None):
    """Sample completions of left-padded prompts with a KV cache: (B, P), (B, P) ->
    (completion ids (B, T_gen) padded with `pad_token_id` after each row's first EOS,
    log_softmax(logits / T) of each token (B, T_gen) float32, 0 on padding).

    The loop does what sampling needs and nothing else: the head runs on the last position only
    (``logits_to_keep=1``, also in the prefill), and a row that has drawn EOS leaves the batch
    and the cache at once, so finished rows cost nothing in later steps (transformers'
    ``generate`` keeps decoding them until every row is done). The prefill runs each distinct
    prompt once and copies its KV cache to the rows that share it (a group's G rows).

    `on_forward(rows, col, mask, fan_out)`, when given, is told before each model call which
    tokens it runs: the rows (indices into the batch), the input column of its first token, the
    (b, l) mask of real tokens, and for the prefill the map from each batch row to the prompt row
    that stands for it (a `gspo.models.routing.RouteTracker` records the sampler's MoE routes).
    """
    from transformers import DynamicCache

    from gspo.models.logprobs import prompt_groups
    from gspo.models import CACHE_KWARG, position_ids_from_mask
    from gspo.rollout.kv_cache import select_rows

    n, device = ids.shape[0], ids.device
    eos = torch.tensor(list(eos_token_ids), device=device)
    tokens = torch.full((n, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((n, max_new_tokens), dtype=torch.float32, device=device)
    cache = _preallocated_cache(model, ids.shape[1] + max_new_tokens) if PREALLOCATE_CACHE else \
        DynamicCache(config=getattr(model, "config", None))
    pos = position_ids_from_mask(mask)
    first, inverse = prompt_groups(ids, mask, ids.shape[1])  # a group's rows share one prompt
    if on_forward is not None:
        on_forward(first, 0, mask[first], inverse)
    out = model(input_ids=ids[first], attention_mask=mask[first], position_ids=pos[first], **{CACHE_KWARG: cache},
                use_cache=True, logits_to_keep=1)  # the prefill runs each distinct prompt once
    logits = out.logits[inverse]  # (n, 1, V)
    if not torch.equal(first, torch.arange(n, device=first.device)):  # shared prompts, or not in row order
        select_rows(cache, inverse)  # the cache's rows are the distinct prompts, in sorted order
    rows = torch.arange(n, device=device)  # rows still decoding, as indices into the batch
    attn, next_pos = mask, pos[:, -1:] + 1
    used = 0
    for t in range(max_new_tokens):
        tok, lp = sample_tokens(logits[:, -1], temperature, top_k, top_p)
        tokens[rows, t], logps[rows, t] = tok, lp
        used = t + 1
        if t == max_new_tokens - 1:
            break
        going = ~torch.isin(tok, eos)
        if not bool(going.all()):
            keep = going.nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            rows, tok, attn, next_pos = rows[keep], tok[keep], attn[keep], next_pos[keep]
            select_rows(cache, keep)
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
        if on_forward is not None:  # the token drawn at step t sits in column P + t
            on_forward(rows, ids.shape[1] + t, attn.new_ones(attn.shape[0], 1), None)
        logits = model(input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos, **{CACHE_KWARG: cache},
                       use_cache=True, logits_to_keep=1).logits
        next_pos = next_pos + 1
    return tokens[:, :used], logps[:, :used]


class HFGenerator:
    """Sample from the trainer's own module: `decode` (``engine="gspo"``, the default) or
    transformers' ``model.generate`` (``engine="hf"``), with the same sampling rule.

    - Prompts are rendered text (`gspo.data.format_prompt`), tokenized once by
      `gspo.data.encode_texts`: the tokenizer's own BOS when it adds one, never twice (a chat
      template that writes BOS keeps its own).
    - Each prompt is repeated `group_size` times consecutively and sampled in chunks of
      `batch_size` sequences (all at once when None), with torch's global RNG, or with a
      forked RNG seeded per chunk when `generate` gets a `seed` (then the rollout depends on
      the seed and the chunking only, not on how rows are spread over processes).
    - The behaviour policy is exactly "softmax(logits / T), then top-k/top-p filtering":
      sampling defaults shipped with a checkpoint (repetition penalty, min-p, …) never act.
      `decode` applies nothing else; with ``engine="hf"``, generate runs with a fresh
      generation config holding only temperature, top-p, top-k, max_new_tokens and the
      special ids.
    - `sampler_logp` is log_softmax(raw_logits / temperature) of each sampled token over the
      full vocabulary (top-k / top-p never renormalise it), 0 on padding. With
      ``engine="hf"`` it is recorded by a logits processor rather than ``output_logits=True``,
      which would hold all T steps of (B, V) fp32 logits; the values are the same (tested).
    - `decode` is ~1.4x faster than generate on a CPU at equal work (bench: docs/benchmarks.md)
      and skips finished rows; ``engine="hf"`` is there for architectures whose cache or
      forward needs generate's own preparation.
    - Every module is in eval mode while sampling, with a clean generation config
      (`gspo.models.generation_mode`); both are restored after.
    - ``autocast_dtype=torch.bfloat16`` samples under ``torch.autocast`` over the fp32
      weights (each weight cast once per chunk; the log-softmax stays fp32, on bf16 logits):
      faster where bf16 matmuls are (AMX, GPUs), and no longer the trainer's own numbers.
      ``torch.float16`` does the same in fp16 (finer mantissa, narrower range than bf16).
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        temperature: float = RolloutConfig.temperature,
        top_p: float = RolloutConfig.top_p,
        top_k: int = RolloutConfig.top_k,
        max_new_tokens: int = RolloutConfig.max_new_tokens,
        batch_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        engine: str = "gspo",
        autocast_dtype: torch.dtype | None = None,
    ):
        check_sampling(temperature, top_p, top_k, max_new_tokens)
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {batch_size}")
        if engine not in ("gspo", "hf"):
            raise ValueError(f"engine must be gspo | hf, got {engine!r}")
        self.engine = engine
        self.autocast_dtype = autocast_dtype
        self.model = model
        self.tokenizer = tokenizer
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.max_new_tokens = int(max_new_tokens)
        self.batch_size = batch_size
        self.eos_token_ids, self.pad_token_id = special_ids(model, tokenizer, eos_token_ids)
        self.routes = None  # a RouteTracker on `model`: every rollout then carries the sampler's routes

    def sync_weights(self, model) -> None:
        """No-op: the generator samples from the module the trainer updates in place."""

    def _generation_config(self, max_new_tokens: int):
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=True,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            bos_token_id=getattr(self.tokenizer, "bos_token_id", None),
            use_cache=True,
        )

    @torch.inference_mode()  # (no autograd bookkeeping at all: ~9% off a tiny model's decode step)
    def _sample(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, on_forward=None):
        """One chunk: (B, P) left-padded prompts → (B, T_gen) completion ids and log-probs,
        inference tensors, which `generate_ids` copies into ordinary ones (the trainer's
        autograd may then save them)."""
        if self.engine == "gspo":
            return decode(self.model, ids, mask, max_new_tokens=max_new_tokens, eos_token_ids=self.eos_token_ids,
                          pad_token_id=self.pad_token_id, temperature=self.temperature, top_k=self.top_k,
                          top_p=self.top_p, on_forward=on_forward)
        if on_forward is not None:
            raise ValueError("the sampler's MoE routes are recorded by gspo's decode loop only (rollout.decode=gspo)")
        recorder = _RawLogprobRecorder(self.temperature)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=self._generation_config(max_new_tokens),
            logits_processor=[recorder],
        )
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        completion = sequences[:, ids.shape[1] :]  # (B, T_gen)
        logp = recorder.finish(sequences[:, -1])  # (B, T_gen)
        return completion, logp

    def _autocast(self, device: torch.device):
        return torch.autocast(device.type, dtype=self.autocast_dtype or torch.bfloat16,
                              enabled=self.autocast_dtype is not None)

    def _sample_all(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, seed: int | None, offset: int,
                    max_new_tokens: int):
        """All N rows in chunks of `batch_size`, under `gspo.models.generation_mode`."""
        n = prompt_ids.shape[0]
        step = self.batch_size or n
        chunks = []
        with generation_mode(self.model):
            for start in range(0, n, step):
                ids, mask = prompt_ids[start : start + step], prompt_mask[start : start + step]
                first = int(mask.any(dim=0).long().argmax())  # drop columns padded in every row
                hook = None if self.routes is None else self.routes.recorder(start, first)
                if seed is None:
                    with self._autocast(ids.device):
                        chunks.append(self._sample(ids[:, first:], mask[:, first:], max_new_tokens, hook))
                    continue
                devices = [ids.device] if ids.device.type == "cuda" else []
                with torch.random.fork_rng(devices=devices), self._autocast(ids.device):
                    torch.manual_seed(chunk_seed(seed, offset + start))
                    chunks.append(self._sample(ids[:, first:], mask[:, first:], max_new_tokens, hook))
        return chunks

    def generate(self, prompts: list[str], group_size: int, *, seed: int | None = None,
                 offset: int = 0) -> Rollout:
        """Sample `group_size` completions for each prompt (see the class docstring and
        `Generator.generate` for `seed` and `offset`)."""
        rows = encode_prompts(self.tokenizer, prompts, group_size)  # N lists
        return self.generate_ids(rows, prompts, group_size, seed=seed, offset=offset)

    def generate_ids(self, rows: list[list[int]], prompts: list[str], group_size: int = 1, *,
                     seed: int | None = None, offset: int = 0, max_new_tokens: int | None = None) -> Rollout:
        """One completion of each token-id prompt in `rows` (N lists, a group's G rows
        consecutive; `prompts` the B texts they came from), at most `max_new_tokens` (default
        rollout.max_new_tokens): the entry a multi-turn episode continues its context through,
        token in, token out."""
        device = next(self.model.parameters()).device
        prompt_ids, prompt_mask = left_pad(rows, self.pad_token_id, device)  # (N, P)
        limit = int(max_new_tokens or self.max_new_tokens)
        if self.routes is not None:
            self.routes.reset(len(rows), prompt_ids.shape[1] + limit, device)
        try:
            chunks = self._sample_all(prompt_ids, prompt_mask, seed, offset, limit)
        finally:
            if self.routes is not None:
                self.routes.stop_recording()

        n, t = len(rows), max(c.shape[1] for c, _ in chunks)
        completion_ids = torch.full((n, t), self.pad_token_id, dtype=torch.long, device=device)
        sampler_logp = torch.zeros((n, t), dtype=torch.float32, device=device)
        produced = torch.zeros((n, t), dtype=torch.bool, device=device)
        start = 0
        for comp, logp in chunks:  # (b, tg) each: chunks stop at different lengths
            b, tg = comp.shape
            completion_ids[start : start + b, :tg] = comp
            sampler_logp[start : start + b, :tg] = logp
            produced[start : start + b, :tg] = True
            start += b
        ro = assemble_rollout(prompt_ids, prompt_mask, completion_ids, sampler_logp, produced,
                              eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id,
                              tokenizer=self.tokenizer, prompts=prompts, group_size=group_size)
        if self.routes is not None:
            ro.routes = self.routes.routes[:, : prompt_ids.shape[1] + t].clone()
        return ro
