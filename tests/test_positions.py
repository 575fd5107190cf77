"""Sequence length against a model's positions, on checkpoints written with save_pretrained and
trained through the CLI: a learned table of absolute positions (GPT-2, OPT) is a hard limit the
prompts are cut to; relative positions (RoPE) run past max_position_embeddings, with a warning."""

from __future__ import annotations

import re

import pytest

from gspo.cli import main
from test_user_path import SMALL, records


def test_position_limit_is_the_learned_table_only(saved):
    from gspo.models import load_policy, position_limit

    assert position_limit(load_policy(saved("gpt2", n_positions=24))[0]) == 24
    assert position_limit(load_policy(saved("opt"))[0]) == 256  # (OPT's table holds 2 more rows: an offset)
    assert position_limit(load_policy(saved("qwen3"))[0]) is None  # RoPE: no hard limit


def test_a_learned_position_table_caps_prompt_and_completion_before_any_rollout(tmp_path, saved, capsys):
    """GPT-2 with 24 positions: a completion budget that leaves no room for a prompt is one error
    naming the field; a smaller one drops the prompts that would not fit beside it (the lookup
    past the table used to fail mid-rollout with an IndexError)."""
    model_dir = saved("gpt2", n_positions=24)
    base = ["train", f"model.name_or_path={model_dir}", "data.source=arithmetic", *SMALL[:2], "schedule.rollouts=1",
            "logging.console=false", f"output.dir={tmp_path}"]
    capsys.readouterr()
    assert main([*base, "rollout.max_new_tokens=24", "output.name=a"]) == 2
    err = capsys.readouterr().err
    assert "'rollout.max_new_tokens'" in err and "24 learned positions" in err and "Traceback" not in err
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    assert main([*base, "rollout.max_new_tokens=20", "output.name=b", "eval.enabled=true", "eval.num_prompts=4"]) == 0
    assert "longer than 4 tokens (the model's 24 learned positions less rollout.max_new_tokens = 20)" in \
        capsys.readouterr().err
    assert [r for r in records(tmp_path / "b") if "loss" in r]
    assert main(["eval", str(model_dir), "arithmetic", "--num-prompts", "4", "--max-new-tokens", "16"]) == 0


@pytest.mark.parametrize("max_new,max_prompt,warned", [(4, 16, False), (40, 16, True), (4, 64, False)])
def test_a_rope_model_run_past_its_trained_length_is_warned_of_at_start_up(tmp_path, saved, capsys, max_new,
                                                                            max_prompt, warned):
    """Qwen3 saved with 32 positions: the longest arithmetic prompt (about 10 tokens) and 40 new
    tokens run past what it was trained for; RoPE runs there, so a warning naming both fields, not
    an error (the run trains). Within the 32, nothing is said, even where data.max_prompt_tokens
    (64) alone would pass them: the prompts kept are what count. `gspo eval` says it alike."""
    model_dir = saved("qwen3", max_position_embeddings=32)
    capsys.readouterr()
    args = [f"model.name_or_path={model_dir}", "data.source=arithmetic", f"data.max_prompt_tokens={max_prompt}",
            f"rollout.max_new_tokens={max_new}"]
    assert main(["train", *args, *SMALL[:2], "schedule.rollouts=1", "logging.console=false",
                 f"output.dir={tmp_path}", "output.name=run", "eval.enabled=false"]) == 0
    err = capsys.readouterr().err
    said = re.search(r"the longest prompt kept, (\d+) tokens, and rollout.max_new_tokens=(\d+) run to (\d+) tokens, "
                     r"past the 32 positions .*lower data.max_prompt_tokens or rollout.max_new_tokens", err)
    assert bool(said) == warned, err
    if said:
        assert int(said[1]) + int(said[2]) == int(said[3]) and int(said[1]) <= max_prompt
    assert [r for r in records(tmp_path / "run") if "loss" in r]
    assert main(["eval", str(model_dir), "arithmetic", "--num-prompts", "2", "--max-new-tokens", str(max_new),
                 f"data.max_prompt_tokens={max_prompt}"]) == 0
    assert ("past the 32 positions" in capsys.readouterr().err) == warned


def test_a_context_extending_rope_scaling_counts_in_the_trained_length():
    """Qwen2.5's YaRN x4 over 32768 positions handles 131072 (it was warned of at 69632); dynamic
    NTK x4 over 4096, 16384; Llama 3.1's table already holds its extended length."""
    from transformers import LlamaConfig, Qwen2Config

    from gspo.models import trained_length

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert trained_length(Qwen2Config(max_position_embeddings=32768, rope_scaling=yarn)) == 131072
    assert trained_length(LlamaConfig(max_position_embeddings=4096, rope_scaling={"rope_type": "dynamic",
                                                                                  "factor": 4.0})) == 16384
    llama31 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert trained_length(LlamaConfig(max_position_embeddings=131072, rope_scaling=llama31)) == 131072
    assert trained_length(LlamaConfig(max_position_embeddings=4096)) == 4096
