"""Model folders a user copies by hand, checked before anything loads (`gspo.models.sources`):
each incomplete tokenizer is one error that says what is missing, through the CLI's own path."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gspo.cli import main


def _copy(src: Path, dst: Path, *names: str) -> Path:
    dst.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json", *names):
        shutil.copy(src / f, dst / f)
    return dst


def test_a_tokenizer_config_without_its_vocabulary_is_one_error_naming_what_is_missing(saved, tmp_path, capsys):
    """tokenizer_config.json copied without tokenizer.json: transformers' own error advised
    installing sentencepiece or tiktoken; the vocabulary file is what is missing."""
    folder = _copy(Path(saved("llama")), tmp_path / "half", "tokenizer_config.json")
    capsys.readouterr()
    assert main(["train", f"model.name_or_path={folder}", "data.source=arithmetic", "schedule.rollouts=1",
                 f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "no vocabulary beside it" in err and "tokenizer.json" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_sentencepiece_model_alone_needs_the_package_that_reads_it(saved, tmp_path, monkeypatch):
    """tokenizer.model with no tokenizer.json, where the sentencepiece package is missing: one
    error naming the package (transformers' ended by advising tiktoken). With tokenizer.json
    beside it nothing is asked."""
    import importlib.util

    from gspo.models import ModelError, load_policy
    from gspo.models import sources

    real = importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda n, *a: None if n == "sentencepiece" else real(n, *a))
    src = Path(saved("llama"))
    folder = _copy(src, tmp_path / "spm", "tokenizer_config.json")
    (folder / "tokenizer.model").write_bytes(b"\x0a\x00")  # (never read: the check comes first)
    with pytest.raises(ModelError, match="pip install sentencepiece"):
        load_policy(folder, device="cpu")
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    sources.check_vocabulary(folder)  # a fast tokenizer beside it: nothing asked


def test_a_tiktoken_vocabulary_named_dot_model_is_not_taken_for_sentencepiece(saved, tmp_path, monkeypatch):
    """Kimi's and GLM-4's tiktoken vocabularies are named tiktoken.model / tokenizer.model: lines of
    base64 and a rank, not a SentencePiece protobuf. No package is asked for (they were refused)."""
    import importlib.util

    from gspo.models import sources

    real = importlib.util.find_spec
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda n, *a: None if n == "sentencepiece" else real(n, *a))
    folder = _copy(Path(saved("llama")), tmp_path / "kimi", "tokenizer_config.json")
    (folder / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")
    sources.check_vocabulary(folder)
