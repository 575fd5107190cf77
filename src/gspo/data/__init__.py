"""Prompt sources and the prompt stream.

A dataset here is a list of row dicts. Every row has a "prompt" (plain text, or a chat: a list
of {"role", "content"} messages) and any other columns (answers, tests, ...), which pass through
untouched and reach the reward functions as keyword columns.

`load_rows` (`gspo.data.files`) reads JSONL, JSON, CSV, Parquet, a `datasets` save_to_disk
folder or a hub-style folder; `format_prompt` turns a prompt into the text the policy sees;
`filter_long_prompts` drops prompts over a token budget; `PromptStream` deals out batches
endlessly, deterministically and resumably. Built-in offline tasks live in `gspo.tasks`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterator, Sequence

import numpy as np

from gspo.config import DataConfig
from gspo.data.files import DataError, load_rows, validate_rows  # noqa: F401  (the names users import from gspo.data)


# ---------------------------------------------------------------------------------------------
# Prompt text


def as_messages(prompt) -> list[dict]:
    """A dataset prompt as chat messages: a message list as it is, a plain text as one user message."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return list(prompt)


def prefill(prompt) -> str | None:
    """The text of a chat prompt's last message when it is the assistant's, which the completion
    continues (TRL's ``continue_final_message``), else None."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], dict) \
            and prompt[-1].get("role") == "assistant":
        return prompt[-1].get("content") or ""
    return None


def reward_view(prompt, completion: str):
    """(prompt, completion) as reward functions get them, in TRL's shapes: a plain prompt and its
    completion text; a chat prompt and ``[{"role": "assistant", "content": ...}]``, where a
    prompt that ends with an assistant turn loses that turn and the completion's content is its
    text followed by what the model wrote (the turn the model continued, whole)."""
    if isinstance(prompt, str):
        return prompt, completion
    start = prefill(prompt)
    if start is None:
        return prompt, [{"role": "assistant", "content": completion}]
    return list(prompt[:-1]), [{"role": "assistant", "content": start + completion}]


def reward_views(prompts: Sequence, completions: Sequence[str]) -> tuple[list, list]:
    """`reward_view` of each (prompt, completion text): the two lists reward functions get."""
    views = [reward_view(p, c) for p, c in zip(prompts, completions)]
    return [v[0] for v in views], [v[1] for v in views]


TEMPLATE_KWARGS = "gspo_chat_template_kwargs"  # the tokenizer attribute `use_template_kwargs` sets


def use_template_kwargs(tokenizer: Any, kwargs: dict | None) -> None:
    """Render this tokenizer's chat template with `kwargs` (data.chat_template_kwargs, e.g.
    Qwen3's enable_thinking=False) wherever gspo renders it: prompts, episodes' turns."""
    setattr(tokenizer, TEMPLATE_KWARGS, dict(kwargs or {}))


def template_kwargs(tokenizer: Any) -> dict:
    """The extra chat-template variables `use_template_kwargs` gave this tokenizer ({} if none)."""
    return dict(getattr(tokenizer, TEMPLATE_KWARGS, None) or {})


def format_prompt(prompt: str | list[dict], tokenizer: Any, tools: list[dict] | None = None) -> str:
    """The text the policy is conditioned on.

    A plain-text prompt is returned as is (no template; `encode_texts` adds the tokenizer's
    BOS, if it has one, when the text is encoded). A chat prompt is rendered with
    `tokenizer.apply_chat_template(..., tokenize=False, add_generation_prompt=True)`, or, when
    its last message is the assistant's, with ``continue_final_message=True`` instead: the
    completion continues that turn, as in TRL (`prefill`, `reward_view`). With `tools` (the
    schemas of a tool episode, [] for a game without tools) the prompt is an episode's first
    context: a plain text becomes one user message, rendered with the schemas; an episode
    cannot start inside an assistant turn.
    """
    if tools is not None:
        prompt = as_messages(prompt)
        if prefill(prompt) is not None:
            raise DataError(f"format_prompt: a tool episode cannot start inside an assistant turn, and this prompt "
                            f"ends with one: {prompt[-1]!r:.200}; drop that turn")
    if isinstance(prompt, str):
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise DataError(
            f"format_prompt: the dataset has chat prompts but tokenizer {name!r} has no "
            "chat_template; use plain-text prompts or a tokenizer with a chat template"
        )
    cont = prefill(prompt) is not None
    try:
        text = tokenizer.apply_chat_template(list(prompt), tools=tools or None, tokenize=False,
                                             add_generation_prompt=not cont, continue_final_message=cont,
                                             **template_kwargs(tokenizer))
    except Exception as e:
        raise DataError(f"format_prompt: the tokenizer's chat template failed on {prompt!r:.200}: {e}") from e
    if not isinstance(text, str):  # some versions return a list for batched input
        raise DataError(f"format_prompt: apply_chat_template returned {type(text).__name__}, not str")
    return text


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of rendered prompts (`format_prompt`'s output), the one rule every pass uses:
    sampling (`gspo.rollout`, vLLM), training (the ids are the rollout's) and evaluation.

    The ids are what the tokenizer itself produces for the text: the special tokens it adds at
    the start (a Llama-, Gemma- or Mistral-style BOS) are kept, so a base model sees the inputs
    it was trained on. Two exceptions: a text that already begins with those tokens (a chat
    template that writes its own BOS) does not get them a second time, and tokens the tokenizer
    would append at the end (an EOS from ``add_eos_token``) are dropped, since a prompt that
    ends in EOS asks the model to continue past the end of a document."""
    texts = list(texts)
    full = tokenizer(texts, add_special_tokens=True)["input_ids"]
    bare = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [_strip_added(list(f), list(b)) for f, b in zip(full, bare)]


def _strip_added(full: list[int], bare: list[int]) -> list[int]:
    """`full` = prefix + `bare` + suffix (what a post-processor adds): prefix + bare, without a
    prefix that `bare` already holds at its start (a template that writes the BOS itself, after
    a stray newline or two at most)."""
    n = len(bare)
    for k in range(len(full) - n + 1):
        if full[k:k + n] == bare:
            prefix = full[:k]
            return bare if any(bare[j:j + k] == prefix for j in range(3)) else prefix + bare
    return full  # the added tokens merged with the text's own: keep the tokenizer's output


def prompt_token_count(prompt: str | list[dict], tokenizer: Any) -> int:
    """Tokens in the formatted prompt, counted by `encode_texts` (as the policy will see it)."""
    return len(encode_texts(tokenizer, [format_prompt(prompt, tokenizer)])[0])


def filter_long_prompts(
    rows: Sequence[dict], tokenizer: Any, max_prompt_tokens: int, tools: list[dict] | None = None,
    source: str = "", first_row: int = 0,
) -> tuple[list[dict], int]:
    """Drop rows whose formatted prompt (`format_prompt`, with the tool schemas of an episode
    when `tools` is given) is longer than `max_prompt_tokens` tokens. A prompt that cannot be
    formatted (a chat template that refuses it) is an error naming `source` and the row (its
    index in the source: `rows` start at row `first_row` of it).

    Returns (kept_rows, n_dropped); order is kept, and kept_rows may be empty (the caller
    decides whether that is an error). Counting follows `prompt_token_count`.
    """
    if not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise DataError(f"filter_long_prompts: max_prompt_tokens must be a positive int, got {max_prompt_tokens!r}")
    texts = []
    for i, r in enumerate(rows):
        try:
            texts.append(format_prompt(r["prompt"], tokenizer, tools))
        except DataError as e:
            raise DataError(f"{source or 'prompts'}: row {first_row + i}: {e}") from e
    ids = encode_texts(tokenizer, texts) if rows else []
    kept = [r for r, x in zip(rows, ids) if len(x) <= max_prompt_tokens]
    return kept, len(rows) - len(kept)


# ---------------------------------------------------------------------------------------------
# The prompt stream


def column_names(rows: Sequence[dict]) -> list[str]:
    """Every column that any of `rows` has, but the prompt, in first-seen order (the keyword
    columns of reward functions: `gspo.rewards.reward_columns`)."""
    return list(dict.fromkeys(k for row in rows for k in row if k != "prompt"))


class PromptStream:
    """Endless batches of rows, epoch after epoch, the same on every run with the same seed.

    Epoch e visits the rows in the order `numpy.random.default_rng([seed, e]).permutation(n)`
    (or, with `shuffle=False`, the file's order, each epoch starting where the one before
    stopped). Each step takes the next `batch_size * world_size` consecutive rows of that order
    (the global batch) and rank r keeps rows [r * batch_size, (r + 1) * batch_size) of it, so
    ranks never share a row within a step. When fewer rows than one global batch remain in an
    epoch they are skipped that epoch and the next epoch starts: a fresh permutation puts other
    rows last, and without shuffling the skipped rows come first next time, so every row is
    drawn.

    `state_dict()` / `load_state_dict()` capture the position exactly: a stream restored from
    a state dict yields the same batches as one that never stopped. The state holds a sha256 of
    the rows (`data_sha256`), so that a resume on edited data of the same length is refused
    rather than dealt out from the old position. `source` names the rows in errors.
    """

    def __init__(
        self,
        rows: Sequence[dict],
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = DataConfig.shuffle,
        rank: int = 0,
        world_size: int = 1,
        source: str = "",
    ):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"PromptStream: batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise DataError(f"PromptStream: world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise DataError(f"PromptStream: rank must be in [0, {world_size}), got {rank!r}")
        if not isinstance(seed, int) or seed < 0:
            raise DataError(f"PromptStream: seed must be a non-negative int, got {seed!r}")
        self.rows = list(rows)
        self.columns = column_names(self.rows)  # every call of a reward function gets all of them
        self.batch_size, self.seed, self.shuffle = batch_size, seed, bool(shuffle)
        self.rank, self.world_size, self.source = rank, world_size, source
        self._sha256: str | None = None  # (`data_sha256`: computed once, at the first checkpoint or resume)
        self.global_batch_size = batch_size * world_size
        if len(self.rows) < self.global_batch_size:
            raise DataError(
                f"PromptStream: the dataset has {len(self.rows)} rows, fewer than one global batch "
                f"(batch_size {batch_size} x world_size {world_size} = {self.global_batch_size})"
            )
        self._epoch, self._position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        n = len(self.rows)
        if not self.shuffle:  # the rows one epoch leaves out start the next
            return np.roll(np.arange(n), -(epoch * self.steps_per_epoch * self.global_batch_size % n))
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def epoch(self) -> int:
        """Number of completed epochs (the epoch the next batch comes from, unless the rows
        left in this one are fewer than a global batch)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Rows of the current epoch's order already dealt out (all ranks together)."""
        return self._position

    @property
    def data_sha256(self) -> str:
        """sha256 over the rows in order, each as JSON with sorted keys (its prompt and every
        column the rewards get), computed once."""
        if self._sha256 is None:
            h = hashlib.sha256()
            for row in self.rows:  # (numpy values from Parquet as lists, anything else as its text)
                h.update(json.dumps(row, sort_keys=True, ensure_ascii=False,
                                    default=lambda v: v.tolist() if hasattr(v, "tolist") else str(v)
                                    ).encode("utf-8", "surrogatepass"))  # (a lone surrogate read from JSON)
                h.update(b"\n")
            self._sha256 = h.hexdigest()
        return self._sha256

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.global_batch_size

    def next_batch(self) -> list[dict]:
        """The next `batch_size` rows for this rank (shallow copies of the dataset rows)."""
        if self._position + self.global_batch_size > len(self.rows):
            self._epoch += 1
            self._position = 0
            self._order = self._permutation(self._epoch)
        start = self._position + self.rank * self.batch_size
        idx = self._order[start : start + self.batch_size]
        self._position += self.global_batch_size
        return [dict(self.rows[i]) for i in idx]

    def __iter__(self) -> Iterator[list[dict]]:
        return self

    def __next__(self) -> list[dict]:
        return self.next_batch()

    def state_dict(self) -> dict:
        """JSON-able position, plus what must match for a resume to be exact."""
        return {
            "data_sha256": self.data_sha256,
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_rows": len(self.rows),
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "shuffle": int(self.shuffle),
        }

    def data_changed(self, state: dict) -> bool:
        """Whether `state` was saved over other rows than these: its `data_sha256` differs (a
        state written before the hash was kept has none, and passes)."""
        return "data_sha256" in state and state["data_sha256"] != self.data_sha256

    def load_state_dict(self, state: dict, *, allow_changed: bool = False) -> None:
        """Restore a position from `state_dict()`. DataError if the dataset size, seed, batch
        size, world size or shuffle setting differ from the saved run's, or, unless
        `allow_changed` (data.resume_on_changed), the rows themselves (`data_changed`)."""
        mine = {k: v for k, v in self.state_dict().items() if k != "data_sha256"}
        src = f"config field 'data.source' ({self.source})" if self.source else "config field 'data.source'"
        for key, what in (  # world_size before batch_size, which is per process
                ("num_rows", src + ": the resumed run's prompt stream draws from {old} prompts, "
                             "this data has {new} (after data.num_prompts and data.max_prompt_tokens)"),
                ("seed", "config field 'seed': the resumed run's prompt stream has seed={old}, this run seed={new}"),
                ("world_size", "the resumed run's prompt stream was split over {old} processes, this run has {new}"),
                ("batch_size", "config field 'rollout.prompts_per_step': the resumed run's prompt stream has "
                               "batch_size={old}, this run batch_size={new}"),
                ("shuffle", "config field 'data.shuffle': the resumed run's prompt stream has shuffle={old}, this "
                            "run shuffle={new}")):
            if key in state and int(state[key]) != mine[key]:
                raise DataError(what.format(old=state[key], new=mine[key]) + "; an exact resume needs the data and "
                                "settings the run began with (or start a new run)")
        if self.data_changed(state) and not allow_changed:
            raise DataError(f"{src}: the data changed since the checkpoint: its {len(self.rows)} prompts are as many "
                            f"as the resumed run's, but not the same rows (sha256 {self.data_sha256[:12]}, the run's "
                            f"{str(state['data_sha256'])[:12]}); an exact resume needs the data the run began with: "
                            "restore it, start a new run, or set data.resume_on_changed=true to go on over these "
                            "rows from the saved position")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.rows):
            raise DataError(f"PromptStream.load_state_dict: bad epoch/position {epoch}/{position}")
        self._epoch, self._position = epoch, position
        self._order = self._permutation(epoch)
