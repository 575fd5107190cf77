"""Sampling G completions per prompt into a typed `Rollout`: what every sampling backend shares.

`Rollout` (token ids, masks and sampler log-probs, passed between a step's stages), the
`Generator` protocol the loop samples through, and the assembly of sampled tokens into a
`Rollout` (`encode_prompts`, `left_pad`, `assemble_rollout`) used by both backends: `hf`
(`gspo.rollout.hf.HFGenerator`, gspo's KV-cache decode loop or transformers' ``generate`` on the
trainer's own module) and `vllm`. Next to the tokens a backend records the sampler's
log-probabilities of the temperature-scaled, UNFILTERED distribution, log_softmax(raw_logits / T),
which is what the trainer's `gspo.models.logprobs.token_logprobs` computes for π_old: top-p /
top-k only decide which tokens can be drawn, they do not redefine π (GSPO.md, "Pitfalls").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from gspo.data import encode_texts
from gspo.models import eos_token_ids as model_eos_ids


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


def completion_mask(completion_ids: torch.Tensor, eos_ids: torch.Tensor, produced: torch.Tensor | None = None):
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


def decode_completions(tokenizer, completion_ids: torch.Tensor, keep: torch.Tensor, eos: torch.Tensor) -> list[str]:
    """The text rewards see of (N, T) completion ids: the `keep` (N, T) bool tokens, less every
    EOS id (`eos`, 1-D; a stop token the tokenizer does not mark special, as Phi-3's `<|end|>`,
    included) and the tokenizer's special tokens. Training and evaluation decode alike."""
    text = keep & ~torch.isin(completion_ids, eos.to(completion_ids.device))  # (N, T)
    return [tokenizer.decode(completion_ids[i][text[i]].tolist(), skip_special_tokens=True)
            for i in range(completion_ids.shape[0])]


def assemble_rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                     sampler_logp: torch.Tensor, produced: torch.Tensor, *, eos_token_ids: Sequence[int],
                     pad_token_id: int, tokenizer, prompts: Sequence[str], group_size: int) -> Rollout:
    """A `Rollout` from sampled tokens: (N, T) completion ids and their log-probs, `produced`
    (N, T) bool marking the columns each row really sampled. The mask runs up to and including
    the first EOS; later tokens become padding with log-prob 0; finish_reason is "eos" when an
    EOS was drawn, else "length"; completions are decoded without EOS and special tokens."""
    eos = torch.tensor(list(eos_token_ids), device=completion_ids.device)
    mask, has_eos = completion_mask(completion_ids, eos, produced.to(completion_ids.device))
    keep = mask.bool()
    completion_ids = torch.where(keep, completion_ids, pad_token_id)
    sampler_logp = torch.where(keep, sampler_logp.float(), 0.0)
    completions = decode_completions(tokenizer, completion_ids, keep, eos)
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
