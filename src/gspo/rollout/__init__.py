"""Sampling G completions per prompt into a typed `Rollout`.

`HFGenerator` samples from the very module the trainer updates (CPU or GPU), with gspo's own
KV-cache decode loop (`decode`: head on the last position only, finished rows leave the batch,
sampling by `gspo.rollout.sampling.sample_tokens`) or with transformers' ``generate`` (``engine="hf"``). Next to the tokens it
records the sampler's log-probabilities of the temperature-scaled, UNFILTERED distribution,
log_softmax(raw_logits / T), which is what the trainer's `gspo.models.logprobs.token_logprobs` computes
for π_old: top-p / top-k only decide which tokens can be drawn, they do not redefine π
(GSPO.md, "Pitfalls").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from gspo.config import RolloutConfig
from gspo.data import encode_texts
from gspo.models import eos_token_ids as model_eos_ids
from gspo.models import generation_mode
from gspo.rollout.sampling import check_sampling, sample_tokens


@dataclass
class Rollout:
    """N = B·G sampled completions, the G completions of each prompt consecutive.

    Token layout: ``input_ids = [prompt_ids | completion_ids]``, prompts left-padded and
    completions right-padded with the pad id, so every completion starts at column P.
    Masks are int64 (usable as attention masks; cast for losses).
    """

    prompt_ids: torch.Tensor  # (N, P) left-padded with the pad id
    prompt_mask: torch.Tensor  # (N, P) 1 on prompt tokens
    completion_ids: torch.Tensor  # (N, T) right-padded with the pad id
    completion_mask: torch.Tensor  # (N, T) 1 on generated tokens up to and including the first EOS
    sampler_logp: torch.Tensor  # (N, T) float32 log_softmax(raw_logits / T)[token], 0 on pad
    finish_reason: list[str]  # N × "eos" | "length"
    group_size: int  # G
    prompts: list[str]  # N prompt texts, each repeated G times consecutively
    completions: list[str]  # N decoded completions, special tokens and EOS stripped
    group_ids: torch.Tensor | None = None  # (N,) long: index of the prompt each row answers
    policy_version: torch.Tensor | None = None  # (N,) long: the weight version (rollouts learned) that sampled each row
    routes: torch.Tensor | None = None  # (N, P+T, layers, k) MoE: the experts the sampler's forward chose, -1 unknown
    # (N, T) 1 on the tokens the model wrote; None: every completion token. Episodes with tool
    # calls hold tokens the model did not write (tool results, the template between turns):
    # attended (completion_mask) but out of the loss, |y| and the length metrics.
    loss_mask: torch.Tensor | None = None
    turns: list[list[dict]] | None = None  # N episodes as TRL's conversational messages (multi-turn only)
    episode_stats: dict | None = None      # counts of the episodes' outcomes (multi-turn only)
    env_reward: list | None = None         # N rewards the episodes' environments reported (None: none)

    def __post_init__(self):
        if self.group_ids is None:
            n = self.prompt_ids.shape[0]
            self.group_ids = torch.arange(n, device=self.prompt_ids.device) // self.group_size

    @property
    def num_samples(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:  # (N, P+T)
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:  # (N, P+T)
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def completion_lengths(self) -> torch.Tensor:  # (N,) long, EOS included
        return self.completion_mask.sum(dim=1)

    @property
    def model_mask(self) -> torch.Tensor:  # (N, T) the tokens the model wrote: the loss mask
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def model_lengths(self) -> torch.Tensor:  # (N,) long: |y|, the tokens the model wrote
        return self.model_mask.sum(dim=1)

    @property
    def truncated(self) -> torch.Tensor:  # (N,) bool on the CPU: cut by the length limit (finish reason "length")
        return torch.tensor([f == "length" for f in self.finish_reason], dtype=torch.bool)

    def _take(self, rows, p_start: int, t_end: int) -> "Rollout":
        rows_t = torch.as_tensor(rows, dtype=torch.long, device=self.prompt_ids.device)
        idx = rows_t.tolist()
        return dataclasses.replace(
            self,
            prompt_ids=self.prompt_ids[rows_t, p_start:],
            prompt_mask=self.prompt_mask[rows_t, p_start:],
            completion_ids=self.completion_ids[rows_t, :t_end],
            completion_mask=self.completion_mask[rows_t, :t_end],
            sampler_logp=self.sampler_logp[rows_t, :t_end],
            loss_mask=None if self.loss_mask is None else self.loss_mask[rows_t, :t_end],
            turns=None if self.turns is None else [self.turns[i] for i in idx],
            finish_reason=[self.finish_reason[i] for i in idx],
            prompts=[self.prompts[i] for i in idx],
            completions=[self.completions[i] for i in idx],
            group_ids=self.group_ids[rows_t],
            policy_version=None if self.policy_version is None else self.policy_version[rows_t],
            routes=None if self.routes is None else torch.cat(  # [prompt | completion] columns
                [self.routes[rows_t, p_start : self.prompt_ids.shape[1]],
                 self.routes[rows_t, self.prompt_ids.shape[1] : self.prompt_ids.shape[1] + t_end]], dim=1),
        )

    def trim(self) -> "Rollout":
        """Drop leading prompt columns and trailing completion columns that are padding in
        every row (a trimmed minibatch costs less in the forward pass)."""
        p_used = self.prompt_mask.bool().any(dim=0).nonzero()
        p_start = int(p_used[0]) if len(p_used) else self.prompt_mask.shape[1]
        t_used = self.completion_mask.bool().any(dim=0).nonzero()
        t_end = int(t_used[-1]) + 1 if len(t_used) else 0
        return self._take(range(self.num_samples), p_start, t_end)

    def select(self, indices: Sequence[int] | torch.Tensor) -> "Rollout":
        """The rows `indices` (a minibatch), trimmed. `group_size` and `group_ids` are kept
        as they were; a selection need not hold whole groups."""
        sub = self._take(indices, 0, self.completion_ids.shape[1])
        return sub.trim()

    def to(self, device: torch.device | str) -> "Rollout":
        fields = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                  "sampler_logp", "group_ids")  # fmt: skip
        out = dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in fields})
        if self.policy_version is not None:
            out.policy_version = self.policy_version.to(device)
        if self.routes is not None:
            out.routes = self.routes.to(device)
        if self.loss_mask is not None:
            out.loss_mask = self.loss_mask.to(device)
        return out


def concat_rollouts(parts: Sequence[Rollout], pad_id: int) -> Rollout:
    """The rows of `parts` one after the other, as one Rollout of whole groups (e.g. groups kept
    from several sampling rounds). Prompts are left-padded and completions right-padded to the
    widest part: ids with `pad_id` (the sampler's pad id, so equal prompts stay equal), masks and
    log-probs with 0, MoE routes with -1 (unknown). `group_ids` are renumbered 0..B-1 in order.
    An optional field is kept when every part has it (`loss_mask`: when any part has one);
    `episode_stats` are the parts' means weighted by their rows."""
    parts = list(parts)
    G = parts[0].group_size
    if any(p.group_size != G or p.num_samples % G for p in parts):
        raise ValueError(f"concat_rollouts: every part must hold whole groups of {G} rows")
    P = max(p.prompt_ids.shape[1] for p in parts)
    T = max(p.completion_ids.shape[1] for p in parts)

    def left(x: torch.Tensor, width: int, value) -> torch.Tensor:  # (n, w, ...) -> (n, width, ...)
        pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
        return torch.cat([pad, x], dim=1)

    def right(x: torch.Tensor, width: int, value) -> torch.Tensor:
        pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
        return torch.cat([x, pad], dim=1)

    def every(name: str) -> bool:
        return all(getattr(p, name) is not None for p in parts)

    def rows(name: str) -> list:
        return [x for p in parts for x in getattr(p, name)]

    n = sum(p.num_samples for p in parts)
    stats = None
    if every("episode_stats"):
        stats = {k: sum(p.episode_stats[k] * p.num_samples for p in parts) / max(n, 1) for k in parts[0].episode_stats}
    routes = None
    if every("routes"):  # [prompt | completion] columns
        routes = torch.cat([
            torch.cat([left(p.routes[:, : p.prompt_ids.shape[1]], P, -1) for p in parts]),
            torch.cat([right(p.routes[:, p.prompt_ids.shape[1]:], T, -1) for p in parts])], dim=1)
    device = parts[0].prompt_ids.device
    return Rollout(
        prompt_ids=torch.cat([left(p.prompt_ids, P, pad_id) for p in parts]),
        prompt_mask=torch.cat([left(p.prompt_mask, P, 0) for p in parts]),
        completion_ids=torch.cat([right(p.completion_ids, T, pad_id) for p in parts]),
        completion_mask=torch.cat([right(p.completion_mask, T, 0) for p in parts]),
        sampler_logp=torch.cat([right(p.sampler_logp, T, 0.0) for p in parts]),
        finish_reason=rows("finish_reason"), group_size=G, prompts=rows("prompts"), completions=rows("completions"),
        group_ids=torch.arange(n, device=device) // G,
        policy_version=torch.cat([p.policy_version for p in parts]) if every("policy_version") else None,
        routes=routes,
        loss_mask=None if all(p.loss_mask is None for p in parts) else
        torch.cat([right(p.model_mask, T, 0) for p in parts]),
        turns=rows("turns") if every("turns") else None,
        episode_stats=stats,
        env_reward=rows("env_reward") if every("env_reward") else None,
    )


def chunk_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys (run seed, rollout, row offset, ...), stable across
    processes and Python versions (unlike hash())."""
    import hashlib

    digest = hashlib.blake2b(",".join(str(int(k)) for k in keys).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@runtime_checkable
class Generator(Protocol):
    """What the training loop needs from a sampler."""

    def generate(self, prompts: list[str], group_size: int, *, seed: int | None = None,
                 offset: int = 0) -> Rollout:
        """Sample `group_size` completions of each prompt; rows of a group are consecutive.
        With `seed`, the chunk of rows starting at global row `offset + i` is sampled from
        `chunk_seed(seed, offset + i)`, so a rollout does not depend on how rows are split
        over processes."""
        ...

    def sync_weights(self, model) -> None:
        """Make the sampler use the trainer's current weights (after each update)."""
        ...


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


def _completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor, produced: torch.Tensor | None = None):
    """(mask, has_eos): mask is 1 on tokens up to and including the first EOS. (B, T) long, (B,).
    `produced` (B, T) bool marks the columns the sampler really produced (rows of different
    lengths): the rest never counts, even when the pad id is an EOS id."""
    is_eos = torch.isin(completion_ids, eos_ids)  # (B, T)
    if produced is not None:
        is_eos &= produced
    eos_before = is_eos.long().cumsum(dim=1) - is_eos.long()  # EOS strictly before each column
    mask = eos_before == 0
    if produced is not None:
        mask &= produced
    return mask.long(), is_eos.any(dim=1)


def special_ids(model, tokenizer, eos_token_ids: Sequence[int] | None = None) -> tuple[list[int], int]:
    """(EOS ids, pad id): `eos_token_ids` or the model's / tokenizer's; the tokenizer's pad id,
    else the first EOS id."""
    ids = list(eos_token_ids) if eos_token_ids is not None else model_eos_ids(model, tokenizer)
    if not ids:
        raise ValueError("no EOS token id: pass eos_token_ids or give the tokenizer one")
    eos = [int(i) for i in ids]
    pad = tokenizer.pad_token_id
    return eos, int(pad) if pad is not None else eos[0]


def encode_prompts(tokenizer, prompts: Sequence[str], group_size: int) -> list[list[int]]:
    """The N = B·G prompt rows (each prompt's ids repeated `group_size` times), tokenized once
    by `gspo.data.encode_texts` (the tokenizer's BOS, once)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if not prompts:
        raise ValueError("no prompts to generate from")
    encoded = encode_texts(tokenizer, prompts)
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise ValueError(f"prompt {text!r} encodes to no tokens")
    return [ids for ids in encoded for _ in range(group_size)]


def assemble_rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                     sampler_logp: torch.Tensor, produced: torch.Tensor, *, eos_token_ids: Sequence[int],
                     pad_token_id: int, tokenizer, prompts: Sequence[str], group_size: int) -> Rollout:
    """A `Rollout` from sampled tokens: (N, T) completion ids and their log-probs, `produced`
    (N, T) bool marking the columns each row really sampled. The mask runs up to and including
    the first EOS; later tokens become padding with log-prob 0; finish_reason is "eos" when an
    EOS was drawn, else "length"; completions are decoded without EOS and special tokens."""
    eos = torch.tensor(list(eos_token_ids), device=completion_ids.device)
    mask, has_eos = _completion_mask(completion_ids, eos, produced.to(completion_ids.device))
    keep = mask.bool()
    completion_ids = torch.where(keep, completion_ids, pad_token_id)
    sampler_logp = torch.where(keep, sampler_logp.float(), 0.0)
    text = keep & ~torch.isin(completion_ids, eos)
    completions = [tokenizer.decode(completion_ids[i][text[i]].tolist(), skip_special_tokens=True)
                   for i in range(completion_ids.shape[0])]
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        sampler_logp=sampler_logp,
        finish_reason=["eos" if d else "length" for d in has_eos.tolist()],
        group_size=group_size,
        prompts=[p for p in prompts for _ in range(group_size)],
        completions=completions,
    )


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


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
        cache.batch_select_indices(inverse)  # the cache's rows are the distinct prompts, in sorted order
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
            cache.batch_select_indices(keep)
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
