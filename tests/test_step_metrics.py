"""Rollout-level metrics (`gspo.train.step_metrics.rollout_metrics`) on rollouts assembled from
sampled ids as the sampler assembles them, with a tokenizer in a family's own style."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import artifacts
from gspo.rollout import assemble_rollout
from gspo.train.distributed import Dist
from gspo.train.step_metrics import rollout_metrics


def test_empty_frac_counts_completions_of_special_tokens_alone():
    """It counted only completions that were their EOS alone: one made of special tokens (a
    ChatML <|im_start|> then the EOS) decodes to "" for the rewards, yet read as written text.
    Empty is what the rewards get: no text once EOS and special tokens are stripped, or only
    whitespace."""
    tok = artifacts.build_tokenizer("qwen")
    eos, start, pad = (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    space = tok(" ", add_special_tokens=False)["input_ids"][0]
    ids = torch.tensor([[a, b, eos],            # "ab": text
                        [eos, pad, pad],        # its EOS alone: empty
                        [start, start, eos],    # special tokens alone: empty (was counted as text)
                        [start, start, start],  # cut by the length limit, special tokens alone: empty
                        [space, space, eos],    # whitespace alone: empty
                        [start, a, start]])     # "a" between special tokens: text
    ro = assemble_rollout(torch.full((6, 1), a), torch.ones(6, 1, dtype=torch.long), ids, torch.zeros(6, 3),
                          torch.ones(6, 3, dtype=torch.bool), eos_token_ids=[eos], pad_token_id=pad, tokenizer=tok,
                          prompts=["x", "y", "z"], group_size=2)
    assert ro.completions == ["ab", "", "", "", "  ", "a"]  # what the rewards get
    assert ro.model_lengths.tolist() == [3, 1, 3, 3, 3, 3]
    rewards = SimpleNamespace(rewards=torch.zeros(6), stats={})
    m = rollout_metrics(Dist(), ro, rewards, {})
    assert m["completion/empty_frac"] == pytest.approx(4 / 6)  # 4 of the 6 (float32 mean)


def test_completions_are_written_on_rollout_1_and_every_n_and_the_help_says_so():
    """logging.completions_every's help said "every N rollouts", but rollout 1 is written too
    (a first look at what the model writes, before the Nth rollout)."""
    from gspo.config import field_docs
    from gspo.train.step_metrics import _completions_due

    run = SimpleNamespace(cfg=SimpleNamespace(logging=SimpleNamespace(completions_every=10, table_every=0)))
    due = [r for r in range(1, 31) if _completions_due(run, SimpleNamespace(rollout=r))[0]]
    assert due == [1, 10, 20, 30]
    run.cfg.logging.completions_every = 0
    assert not any(_completions_due(run, SimpleNamespace(rollout=r))[0] for r in range(1, 31))
    help_text = dict((name, text) for name, _, text in field_docs())["logging.completions_every"]
    assert "on rollout 1 and every N rollouts" in help_text


def test_a_function_that_scores_nothing_beside_another_is_logged_and_said(tmp_path, capsys):
    """A judge that never found a score, beside a function that did: every row's value was None,
    yet reward/missing read 0 and nothing was said; the run trained on the other alone."""
    import json

    from gspo.cli import main
    from test_train import TINY

    (tmp_path / "silent.py").write_text("def never(prompts, completions, **kw):\n    return [None] * len(prompts)\n")
    capsys.readouterr()
    assert main(["train", *TINY, "schedule.rollouts=2", "eval.enabled=false", f"output.dir={tmp_path}",
                 "output.name=run", "logging.no_signal_every=10",
                 f"rewards.functions=[{{name: exact_answer}}, {{name: '{tmp_path / 'silent.py'}:never'}}]"]) == 0
    err = capsys.readouterr().err
    assert err.count("reward function 'never' gave no value on any completion") == 1  # (once in 10 rollouts)
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["reward/never/missing_frac"] == 1.0 and rec["reward/exact_answer/missing_frac"] == 0.0
