"""Reward models as reward functions: `model:PATH_OR_ID` and `judge:PATH_OR_ID`.

- `model:` a sequence-classification reward model (`AutoModelForSequenceClassification`, the
  kind TRL's RewardTrainer writes). A completion's score is the model's raw logit where its own
  pooling reads it (a decoder: the last token that is not the pad token, so trailing EOS tokens
  count as padding when pad falls back to EOS, as in TRL): its single logit (`num_labels == 1`)
  or the one `kwargs.label` names (an index or a label name). A row longer than the model's
  positions keeps its last tokens (a warning says so once). With a chat template the conversation (the prompt, then the
  completion as the assistant's turn) is rendered with it; without one the prompt's text and the
  completion's are concatenated.
- `judge:` a causal LM asked to grade the completion through `kwargs.template` (placeholders
  `{prompt}` and `{completion}`, sent as one user turn through the chat template when the
  tokenizer has one). Its greedy answer is searched with `kwargs.regex` (default: the first
  number; with a capture group, the group); no match, or a value outside
  [`min_score`, `max_score`], scores None (missing).

Both load once, when `gspo.rewards.validate_specs` resolves the spec (at start-up, before the
policy loads), with `trust_remote_code` off unless `kwargs.trust_remote_code` is true and with
`weights_only=True` (safetensors, or a .bin through torch's restricted unpickler: never arbitrary
pickle). A bad path, a checkpoint of the wrong kind, missing head weights or a bad kwarg is one
`RewardConfigError` at that point. `RewardRunner` calls them in the learner's process, not in a
worker: the weights stay on their device (a forked worker cannot use CUDA, a spawned one would
need a copy of the model), and a forward is not the user code (a hang, a crash) that workers are
there to contain. They run in eval mode under no_grad, in micro-batches of `kwargs.batch_size` rows of
similar length; the runner's deadline is checked after each micro-batch, since a forward cannot
be interrupted the way a worker process can be killed.

Departures from TRL: a plain-text prompt is rendered as a one-turn conversation when the reward
model's tokenizer has a chat template (TRL concatenates unless the data is conversational;
`use_chat_template: false` does that); concatenated text gets the tokenizer's own special
tokens (TRL adds none), so the model sees its BOS or [CLS] as in training. The judge is
gspo's own (TRL's judges are separate classes, not reward functions).
"""

from __future__ import annotations

import math
import numbers
import os
import re
import sys
import time
from typing import Any, Sequence

from gspo.rewards.errors import RewardConfigError

SCORER_PREFIXES = ("model:", "judge:")

DEFAULT_JUDGE_TEMPLATE = (
    "Rate how well the response answers the prompt, from 0 (wrong or useless) to 10 (correct and "
    "complete). Reply with the number only.\n\nPrompt:\n{prompt}\n\nResponse:\n{completion}\n\nScore:"
)
DEFAULT_SCORE_REGEX = r"-?\d+(?:\.\d+)?"  # the first number in the answer

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_COMMON = {"device": "auto", "dtype": "auto", "batch_size": 16, "trust_remote_code": False, "use_chat_template": True}
REWARD_MODEL_KWARGS = {**_COMMON, "label": None}
JUDGE_KWARGS = {**_COMMON, "template": DEFAULT_JUDGE_TEMPLATE, "regex": DEFAULT_SCORE_REGEX, "min_score": 0.0,
                "max_score": 10.0, "max_new_tokens": 16}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
_PLACEHOLDER = re.compile(r"\{(prompt|completion)\}")


class DeadlineExceeded(Exception):
    """A scorer's call ran past the runner's deadline (checked after each micro-batch)."""


def is_scorer_name(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(SCORER_PREFIXES)


def scorer_short_name(name: str) -> str:
    """The key of a `model:` / `judge:` reward in metrics: the last part of its path or Hub id."""
    path = name.partition(":")[2].rstrip("/\\")
    return re.split(r"[/\\]", path)[-1] or name.partition(":")[0]


# ---------------------------------------------------------------------------------------------
# Texts


def as_messages(x: Any, role: str) -> list[dict]:
    """A prompt or completion as chat messages: a message list as it is, a text as one `role` turn."""
    if isinstance(x, str):
        return [{"role": role, "content": x}]
    if isinstance(x, (list, tuple)) and x and all(isinstance(m, dict) for m in x):
        return [dict(m) for m in x]
    raise TypeError(f"expected a str or a list of messages, got {type(x).__name__}")


def plain_text(x: Any) -> str:
    """A text as it is; one message as its content; several as 'role: content' lines."""
    if isinstance(x, str):
        return x
    messages = as_messages(x, "user")
    if len(messages) == 1:
        return str(messages[0].get("content", ""))
    return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in messages)


def fill_template(template: str, prompt: Any, completion: Any) -> str:
    """`template` with {prompt} and {completion} replaced in one pass (so braces in the texts,
    or a completion that writes "{prompt}", stay as they are)."""
    values = {"prompt": plain_text(prompt), "completion": plain_text(completion)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def parse_score(text: str, regex: re.Pattern, min_score: float, max_score: float) -> float | None:
    """The judge's score in `text`: the first match of `regex` (its first group that matched, if
    it has groups: `([0-9]+)/10|score=([0-9]+)` reads either) as a float; None when nothing matches,
    it is no number, or it lies outside the range."""
    m = regex.search(text)
    if m is None:
        return None
    try:
        value = float(next((g for g in m.groups() if g is not None), None) if regex.groups else m.group(0))
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) and min_score <= value <= max_score else None


def right_pad(seqs: list[list[int]], pad_id: int, device):
    """(ids, attention mask), each (B, L) long, the rows padded on the right."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, L)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)         # (B, L)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids.to(device), mask.to(device)


# ---------------------------------------------------------------------------------------------
# The scorers


class ModelScorer:
    """What both kinds share: a loaded model in eval mode, its tokenizer, the micro-batch size.
    Called as a reward function (`fn(prompts, completions, **columns)`; the columns are unused)
    or through `score`, which the runner calls with its deadline."""

    kind = ""

    def __init__(self, name: str, model, tokenizer, *, batch_size: int, use_chat_template: bool):
        self.name, self.model, self.tokenizer, self.batch_size = name, model, tokenizer, batch_size
        self.chat = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        self.device = next(model.parameters()).device

    def __call__(self, prompts: Sequence, completions: Sequence, **columns) -> list[float | None]:
        return self.score(prompts, completions)

    def score(self, prompts: Sequence, completions: Sequence, *, deadline: float | None = None) -> list[float | None]:
        """One value per completion. Rows go in micro-batches of similar token length (less
        padding); past `deadline` (time.monotonic()) after a micro-batch, DeadlineExceeded."""
        import torch

        if not completions:
            return []
        ids = self.encode(list(prompts), list(completions))
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]), reverse=True)
        out: list[float | None] = [None] * len(ids)
        with torch.no_grad():
            for lo in range(0, len(order), self.batch_size):
                rows = order[lo : lo + self.batch_size]
                for i, v in zip(rows, self.score_ids([ids[i] for i in rows])):
                    out[i] = v
                if deadline is not None and time.monotonic() > deadline:
                    raise DeadlineExceeded(f"{self.name}: past its deadline after {lo + len(rows)} of {len(ids)} rows")
        return out

    def encode(self, prompts: list, completions: list) -> list[list[int]]:
        raise NotImplementedError

    def score_ids(self, ids: list[list[int]]) -> list[float | None]:
        raise NotImplementedError


class RewardModel(ModelScorer):
    """`model:PATH`: the logit `label` of a sequence-classification model, where its own pooling
    reads it (a decoder: each row's last token that is not `pad_id`). A row longer than the
    model's positions (`max_len`) keeps its last `max_len` tokens, so that the completion is
    scored (the model would otherwise fail on it); the first time, a warning says so."""

    kind = "model"

    def __init__(self, name, model, tokenizer, *, label: int, pad_id: int, max_len: int | None = None, **kw):
        super().__init__(name, model, tokenizer, **kw)
        self.label, self.pad_id, self.max_len = label, pad_id, max_len
        self._warned = False

    def encode(self, prompts, completions):
        if self.chat:
            texts = [self.tokenizer.apply_chat_template(as_messages(p, "user") + as_messages(c, "assistant"),
                                                        tokenize=False) for p, c in zip(prompts, completions)]
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # the template wrote them
        else:
            ids = self.tokenizer([plain_text(p) + plain_text(c) for p, c in zip(prompts, completions)])["input_ids"]
        return self._truncate(ids)

    def _truncate(self, ids: list[list[int]]) -> list[list[int]]:
        return cut_rows(self, ids, self.max_len, "a prompt + completion", "reward model's {} positions")

    def score_ids(self, ids):
        input_ids, mask = right_pad(ids, self.pad_id, self.device)              # (B, L)
        logits = self.model(input_ids=input_ids, attention_mask=mask).logits     # (B, num_labels)
        return logits[:, self.label].float().tolist()


def cut_rows(scorer, ids: list[list[int]], max_len: int | None, what: str, room: str) -> list[list[int]]:
    """Rows cut to `max_len` tokens: their leading special tokens ([CLS], BOS, a template's first
    marker), which an encoder pools and a decoder expects, then their last tokens; the first
    time a row is cut, a warning on stderr (`scorer._warned`)."""
    if max_len is None or all(len(s) <= max_len for s in ids):
        return ids
    if not scorer._warned:
        scorer._warned = True
        print(f"warning: reward {scorer.name!r}: {what} of {max(len(s) for s in ids)} tokens is longer than the "
              f"{room.format(max_len)}; such rows keep their leading special tokens and then their last tokens (the "
              f"start of the prompt is cut), here and from now on", file=sys.stderr)
    special = set(getattr(scorer.tokenizer, "all_special_ids", ()))
    out = []
    for s in ids:
        k = 0
        while k < min(len(s), max_len // 2) and s[k] in special:
            k += 1
        out.append(s if len(s) <= max_len else s[:k] + s[len(s) - (max_len - k):])
    return out


class Judge(ModelScorer):
    """`judge:PATH`: a causal LM's greedy answer to the filled template, parsed for a score. A
    judge with a learned position table (GPT-2's) reads at most its positions less
    `max_new_tokens` of each filled template, cut as a reward model's rows are (`cut_rows`); an
    answer budget that leaves no room is refused when it loads."""

    kind = "judge"

    def __init__(self, name, model, tokenizer, *, template: str, regex: re.Pattern, min_score: float,
                 max_score: float, max_new_tokens: int, **kw):
        super().__init__(name, model, tokenizer, **kw)
        from gspo.models import eos_token_ids, position_limit

        limit = position_limit(model)
        if limit is not None and max_new_tokens >= limit:
            raise RewardConfigError(f"reward {name!r}: kwargs.max_new_tokens={max_new_tokens} leaves no room for the "
                                    f"judge's prompt in its {limit} learned positions; set it below {limit}")
        self.max_len, self._warned = (None if limit is None else limit - max_new_tokens), False
        self.template, self.regex, self.max_new_tokens = template, regex, max_new_tokens
        self.min_score, self.max_score = min_score, max_score
        self.eos = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos[0] if self.eos else 0)  # left padding, masked

    def encode(self, prompts, completions):
        from gspo.data import encode_texts, format_prompt

        texts = [fill_template(self.template, p, c) for p, c in zip(prompts, completions)]
        if self.chat:
            texts = [format_prompt([{"role": "user", "content": t}], self.tokenizer) for t in texts]
        ids = encode_texts(self.tokenizer, texts)  # the tokenizer's BOS once, no trailing EOS
        return cut_rows(self, ids, self.max_len, "a filled judge template",
                        "{} positions the judge has beside its answer (kwargs.max_new_tokens)")

    def answers(self, ids: list[list[int]]) -> list[str]:
        """The judge's greedy answers (special tokens left out)."""
        from gspo.models import generation_mode
        from gspo.rollout import left_pad

        input_ids, mask = left_pad(ids, self.pad_id, self.device)  # (B, L)
        with generation_mode(self.model):  # argmax, whatever the checkpoint's generation config says
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=self.max_new_tokens, eos_token_id=self.eos,
                                      pad_token_id=self.pad_id)  # (B, L + new)
        return self.tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)

    def score_ids(self, ids):
        return [parse_score(t, self.regex, self.min_score, self.max_score) for t in self.answers(ids)]


# ---------------------------------------------------------------------------------------------
# Loading


def load_scorer(name: str, kwargs: dict | None = None) -> ModelScorer:
    """The scorer of a `model:PATH_OR_ID` or `judge:PATH_OR_ID` reward name, loaded with the
    options in `kwargs` (REWARD_MODEL_KWARGS / JUDGE_KWARGS give them and their defaults)."""
    kind, _, path = name.partition(":")
    what = f"reward {name!r}"
    if kind not in ("model", "judge"):
        raise RewardConfigError(f"{what}: expected a name starting with {' or '.join(SCORER_PREFIXES)}")
    if not isinstance(kwargs, (dict, type(None))):
        raise RewardConfigError(f"{what}: kwargs must be a dict, got {kwargs!r}")
    o = _options(dict(kwargs or {}), REWARD_MODEL_KWARGS if kind == "model" else JUDGE_KWARGS, what)
    source, config, tok = _load_config_and_tokenizer(kind, path, o, what)
    common = dict(batch_size=o["batch_size"], use_chat_template=o["use_chat_template"])
    if kind == "judge":
        from transformers import AutoModelForCausalLM

        model = _load_model(AutoModelForCausalLM, source, config, o, path, what)
        return Judge(name, model, tok, template=o["template"], regex=o["regex"], min_score=o["min_score"],
                     max_score=o["max_score"], max_new_tokens=o["max_new_tokens"], **common)
    from transformers import AutoModelForSequenceClassification

    label = _label(config, o["label"], what)
    model = _load_model(AutoModelForSequenceClassification, source, config, o, path, what)
    text_config = model.config.get_text_config()
    pad = text_config.pad_token_id
    if pad is None:  # as TRL: the tokenizer's pad, else its EOS
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pad is None and o["batch_size"] > 1:
        raise RewardConfigError(f"{what}: neither the model nor its tokenizer has a pad or EOS token to pad "
                                "batches with; set kwargs.batch_size=1")
    model.config.pad_token_id = text_config.pad_token_id = pad  # the model's pooling finds each row's end by it
    return RewardModel(name, model, tok, label=label, pad_id=0 if pad is None else pad,
                       max_len=_max_positions(text_config, tok), **common)


def _max_positions(text_config, tok) -> int | None:
    """The longest row the model takes: its position table (GPT-2's `n_positions`, BERT's
    `max_position_embeddings`), or the tokenizer's `model_max_length` when that is less (RoBERTa's
    table holds two offset rows); None when neither says."""
    limits = [getattr(text_config, k, None) for k in ("n_positions", "max_position_embeddings")]
    limits.append(getattr(tok, "model_max_length", None))
    limits = [v for v in limits if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 10**9]  # (a "no limit" sentinel)
    return min(limits) if limits else None


def _options(kwargs: dict, defaults: dict, what: str) -> dict:
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise RewardConfigError(f"{what}: unknown kwargs {', '.join(map(repr, unknown))}; "
                                f"this kind takes {', '.join(sorted(defaults))}")
    o = {**defaults, **kwargs}

    def bad(key: str, want: str):
        raise RewardConfigError(f"{what}: kwargs.{key} must be {want}, got {o[key]!r}")

    for key in ("trust_remote_code", "use_chat_template"):
        if not isinstance(o[key], bool):
            bad(key, "true or false")
    for key in ("batch_size", "max_new_tokens"):
        if key in o and (isinstance(o[key], bool) or not isinstance(o[key], int) or o[key] < 1):
            bad(key, "an int >= 1")
    if o["dtype"] not in _DTYPES:
        bad("dtype", " | ".join(_DTYPES))
    o["device"] = _device(o["device"], what)
    if "label" in o and not (o["label"] is None or isinstance(o["label"], str)
                             or (isinstance(o["label"], int) and not isinstance(o["label"], bool) and o["label"] >= 0)):
        bad("label", "the index (int >= 0) or the name of the logit that scores a completion")
    if "template" in o:
        if not isinstance(o["template"], str) or "{completion}" not in o["template"]:
            bad("template", "a text with a {completion} placeholder (and, optionally, {prompt})")
        if not isinstance(o["regex"], str):
            bad("regex", "a regular expression")
        try:
            o["regex"] = re.compile(o["regex"])
        except re.error as e:
            raise RewardConfigError(f"{what}: kwargs.regex {o['regex']!r} is not a regular expression: {e}") from None
        for key in ("min_score", "max_score"):
            if isinstance(o[key], bool) or not isinstance(o[key], numbers.Real) or not math.isfinite(o[key]):
                bad(key, "a finite number")
            o[key] = float(o[key])
        if o["min_score"] > o["max_score"]:
            raise RewardConfigError(f"{what}: kwargs.min_score={o['min_score']:g} is above kwargs.max_score="
                                    f"{o['max_score']:g}")
    return o


def _device(name: Any, what: str):
    """"auto": the current CUDA device (the learner's, which torchrun's set-up selects) when there
    is one, else the CPU; anything else is torch's device name."""
    import torch

    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise RewardConfigError(f"{what}: kwargs.device must be auto or a device name (cpu, cuda, cuda:1), "
                                f"got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RewardConfigError(f"{what}: kwargs.device={name!r}, but no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise RewardConfigError(f"{what}: kwargs.device={name!r}, but this process sees "
                                f"{torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda", "mps", "xpu"):  # (meta holds no weights to run)
        raise RewardConfigError(f"{what}: kwargs.device={name!r} cannot run a model (cpu, cuda, cuda:N)")
    return device


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:500]}"


def _source(path: str, what: str) -> str:
    """A local model directory, or a Hub id (from_pretrained then finds it in the cache or
    downloads it); a missing local path fails here, before any download is tried."""
    if not path:
        raise RewardConfigError(f"{what}: no model path or Hub id after the prefix")
    local = os.path.expanduser(path)
    if os.path.isdir(local):
        return local
    if os.path.exists(local):
        raise RewardConfigError(f"{what}: {path!r} is a file; expected a model directory (save_pretrained's output)")
    if path.startswith(("/", ".", "~")) or not _HUB_ID.fullmatch(path):
        raise RewardConfigError(f"{what}: no such directory {path!r} (and it is not a Hugging Face Hub id)")
    return path


def _load_config_and_tokenizer(kind: str, path: str, o: dict, what: str):
    from transformers import AutoConfig, AutoTokenizer

    source, trust = _source(path, what), o["trust_remote_code"]
    hint = "" if trust else " (a model with its own code needs kwargs.trust_remote_code=true)"
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
    except Exception as e:
        raise RewardConfigError(f"{what}: cannot read a model config from {path!r}: {_one_line(e)}{hint}") from None
    archs = [str(a) for a in (getattr(config, "architectures", None) or [])]
    seq_cls = [a for a in archs if a.endswith("ForSequenceClassification")]
    if kind == "model" and archs and not seq_cls:
        raise RewardConfigError(f"{what}: {path!r} holds a {', '.join(archs)}, not a sequence-classification reward "
                                f"model (...ForSequenceClassification); a causal LM can grade completions as a "
                                f"judge: name: judge:{path}")
    if kind == "judge" and seq_cls:
        raise RewardConfigError(f"{what}: {path!r} holds a {seq_cls[0]}, a reward model, not a causal LM; "
                                f"score with it as name: model:{path}")
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    except Exception as e:
        raise RewardConfigError(f"{what}: cannot load a tokenizer from {path!r} (save one beside the model with "
                                f"tokenizer.save_pretrained): {_one_line(e)}") from None
    if len(tok) < 2 or not tok("a", add_special_tokens=False)["input_ids"]:  # transformers builds an empty one
        raise RewardConfigError(f"{what}: no tokenizer at {path!r} (its vocabulary is empty); save one beside the "
                                "model with tokenizer.save_pretrained")
    return source, config, tok


def _load_model(auto_class, source: str, config, o: dict, path: str, what: str):
    import torch

    dtype = o["dtype"] if o["dtype"] == "auto" else getattr(torch, o["dtype"])
    try:
        model, info = auto_class.from_pretrained(source, config=config, dtype=dtype,
                                                 trust_remote_code=o["trust_remote_code"], weights_only=True,
                                                 output_loading_info=True)
    except Exception as e:
        raise RewardConfigError(f"{what}: cannot load the model from {path!r}: {_one_line(e)}") from None
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise RewardConfigError(f"{what}: the checkpoint at {path!r} has no weights for {shown}; they would start "
                                f"at random (is it a checkpoint {auto_class.__name__} loads?)")
    return model.to(o["device"]).eval().requires_grad_(False)


def _label(config, label: int | str | None, what: str) -> int:
    """The index of the logit that scores a completion."""
    n = int(config.num_labels)
    names = dict(sorted(((str(k), int(v)) for k, v in (getattr(config, "label2id", None) or {}).items()),
                        key=lambda kv: kv[1]))  # in logit order
    if isinstance(label, str):
        if label not in names:
            raise RewardConfigError(f"{what}: kwargs.label {label!r} is not one of the model's labels "
                                    f"({', '.join(names) or 'none named'})")
        return names[label]
    if label is None:
        if n == 1:
            return 0
        raise RewardConfigError(f"{what}: the model has {n} labels ({', '.join(names)}); set kwargs.label to the "
                                "index or name of the logit that scores a completion")
    if label >= n:
        raise RewardConfigError(f"{what}: kwargs.label={label} is out of range for the model's {n} labels")
    return label
