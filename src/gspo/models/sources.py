"""Where a policy comes from, checked before anything loads: `check_source` answers a model path
that is missing, a gspo run directory or checkpoint, a folder without a tokenizer, or a
tokenizer that cannot be read, with one `ModelError` that says what to name instead."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

# "org/name" or "name": what the Hub accepts as a repository id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class ModelError(ValueError):
    """A policy could not be loaded (bad path, offline without a cache, unsupported dtype…)."""


# the files one of which a saved tokenizer has (fast, sentencepiece, byte-level BPE, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tokenizer.tiktoken")
# a vocabulary file, in any family's form
_VOCABULARY = re.compile(r"tokenizer\.json|.*\.model|.*\.tiktoken|vocab\..*|.*\.vocab|merges\.txt")


def check_vocabulary(d: Path) -> None:
    """A tokenizer folder's vocabulary, before transformers reads it (its own errors for these
    cases advise installing the wrong package): tokenizer_config.json with no vocabulary file
    beside it, and a SentencePiece model with no tokenizer.json where the sentencepiece package
    that reads it is not installed."""
    have = sorted(f.name for f in d.iterdir() if f.is_file() and _VOCABULARY.fullmatch(f.name))
    if not have:
        raise ModelError(f"model path {str(d)!r} has tokenizer_config.json but no vocabulary beside it "
                         f"(tokenizer.json, tokenizer.model, vocab.json + merges.txt, ...): copy the tokenizer's "
                         f"files whole, or save it with tokenizer.save_pretrained on the same folder")
    if all(f.endswith(".model") for f in have) and _sentencepiece(d / have[0]) \
            and importlib.util.find_spec("sentencepiece") is None:
        raise ModelError(f"model path {str(d)!r}: its tokenizer is a SentencePiece model only ({have[0]}, no "
                         f"tokenizer.json), which needs the sentencepiece package: pip install sentencepiece (or "
                         f"save a fast tokenizer's tokenizer.json beside it)")


def _sentencepiece(path: Path) -> bool:
    """Whether a `.model` file is a SentencePiece model (a protobuf, whose first field's tag is
    0x0a), not a tiktoken vocabulary under that name (Kimi's, GLM-4's: lines of base64 and a rank)."""
    with path.open("rb") as f:
        return f.read(1) == b"\x0a"


def check_source(name_or_path: str) -> None:
    """Fail before any download attempt when `name_or_path` is a missing local path, or a
    local folder that is not a model: a gspo run directory, one of its checkpoints, or a LoRA
    adapter folder, each named with where the model is."""
    if os.path.isdir(name_or_path):
        d = Path(name_or_path)
        if (d / "config.json").is_file():
            if not any((d / f).is_file() for f in TOKENIZER_FILES):
                raise ModelError(f"model path {name_or_path!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, "
                                 f"...): save the tokenizer beside the model (tokenizer.save_pretrained on the same "
                                 f"folder)")
            check_vocabulary(d)
            return
        if (d / "adapter_config.json").is_file():
            return  # a LoRA adapter (a TRL/Trainer checkpoint-N too): `load_policy` loads its base, merges it in
        if (d / "checkpoints").is_dir() or (d / "metrics.jsonl").is_file():
            final = any((d / "final" / f).is_file() for f in ("config.json", "adapter_config.json"))
            where = (f"its model is {d / 'final'}" if final else
                     "it has no final/ yet: finish the run (resume=auto), which writes final/")
            raise ModelError(f"model path {name_or_path!r} is a gspo run directory, not a model folder; {where}")
        if (d / "trainer_state.json").is_file() or (d / "COMPLETE").is_file():
            raise ModelError(f"model path {name_or_path!r} is a gspo training checkpoint, not a model folder; the "
                             f"model of a run is its final/ (a stopped run writes it when resumed to its end)")
        raise ModelError(f"model path {name_or_path!r} has no config.json: not a model folder "
                         f"(save_pretrained writes one)")
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
