"""gspo from Python, as a TRL user tries it first: objects where the config takes paths and
entries are one ConfigError naming the field; a dict of sections is a config; a run leaves the
process's torch threads as it found them, and its save prints no progress bar with the console off."""

from __future__ import annotations

import pytest
import torch

from gspo.config import ConfigError, load_config
from gspo.train import train
from test_train import TINY


def _reward(prompts, completions, **kw):
    return [0.0] * len(prompts)


@pytest.mark.parametrize("field,value,says", [
    ("rewards.functions", [_reward], "item 0 is a function; each is {name: ..., weight: ..., kwargs: ...}"),
    ("data.source", [{"prompt": "1+1=", "answer": "2"}], "takes a file or folder: save the rows"),
    ("model.name_or_path", torch.nn.Linear(2, 2), "takes a model folder or hub id: save the model"),
])
def test_python_objects_where_the_config_takes_paths_are_one_error_naming_the_field(tmp_path, field, value, says):
    """They failed with AttributeError / TypeError naming no field."""
    cfg = load_config(None, [*TINY, f"output.dir={tmp_path}"])
    section, key = field.split(".")
    setattr(getattr(cfg, section), key, value)
    with pytest.raises(ConfigError, match=rf"config field '{field}'.*{says[:30]}"):
        train(cfg)
    assert not (tmp_path / "gspo").exists()
    with pytest.raises(ConfigError, match="train\\(\\) takes a gspo.config.Config"):
        train({"rollout": {"group_size": 4}})


def test_a_dict_of_sections_is_a_config_and_entries_may_be_dicts(tmp_path, capfd):
    cfg = load_config({"rollout": {"group_size": 4}}, ["rollout.max_new_tokens=8"])
    assert (cfg.rollout.group_size, cfg.rollout.max_new_tokens) == (4, 8)
    cfg = load_config(None, [*TINY, f"output.dir={tmp_path}", "schedule.rollouts=1", "eval.enabled=false"])
    cfg.rewards.functions = [{"name": "exact_answer", "weight": 2.0}]  # as YAML gives it
    cfg.rollout.group_size = 1  # and the rules a file gets
    with pytest.raises(ConfigError, match="'rollout.group_size': must be >= 2"):
        train(cfg)
    cfg.rollout.group_size = 4
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # (neither the 1 nor the half of the cores the run takes)
    try:
        capfd.readouterr()
        assert (train(cfg) / "final").is_dir()
        assert "Writing model shards" not in capfd.readouterr().err  # (logging.console=false: no bar)
        assert torch.get_num_threads() == 3  # the run's threads were the run's alone
    finally:
        torch.set_num_threads(before)


def test_policy_loss_without_a_clip_range_names_where_the_papers_values_are():
    from gspo.algo import policy_loss
    from gspo.config import PAPER_CLIP

    args = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"eps_low must be given .*gspo.config.PAPER_CLIP\['sequence'\]"):
        policy_loss(*args, level="sequence", eps_low=None, eps_high=None, max_log_ratio=10.0)
    with pytest.raises(ValueError, match=r"gspo.config.OBJECTIVE_CLIP\['cispo'\]"):
        policy_loss(*args, level="token", objective="cispo", eps_low=None, eps_high=0.28, max_log_ratio=10.0)
    loss, _ = policy_loss(*args, level="sequence", eps_low=PAPER_CLIP["sequence"][0],
                          eps_high=PAPER_CLIP["sequence"][1], max_log_ratio=10.0)
    assert loss.item() == 0.0


@pytest.mark.parametrize("field", ["rewards.allow_code_execution", "model.trust_remote_code"])
def test_an_opt_in_set_in_python_takes_only_a_bool(tmp_path, field):
    """A config file takes only the YAML booleans for them; set in Python, "yes" or 1 passed through
    OmegaConf's conversion as true."""
    cfg = load_config(None, [*TINY, f"output.dir={tmp_path}"])
    section, key = field.split(".")
    for value in ("yes", 1):
        setattr(getattr(cfg, section), key, value)
        with pytest.raises(ConfigError, match=rf"config field '{field}': must be True or False"):
            train(cfg)


def test_a_literal_dollar_brace_and_numpy_values_pass_as_a_file_gives_them(tmp_path):
    """checked_config rebuilt the config through OmegaConf, which read a literal "${x}" (written
    "\\${x}" in a file) as an interpolation again: refused, or replaced by another field's value;
    NumPy scalars from a sweep were refused. A run's config.yaml keeps the literal escaped."""
    import numpy as np

    from gspo.config import checked_config, to_yaml

    (tmp_path / "c.yaml").write_text("data:\n  chat_template_kwargs: {note: 'cost \\${model.name_or_path}', "
                                     "other: '\\${x}'}\n")
    cfg = load_config(tmp_path / "c.yaml")
    cfg.optim.lr, cfg.rollout.group_size = np.float64(1e-5), np.int64(4)
    out = checked_config(cfg)
    assert out.data.chat_template_kwargs == {"note": "cost ${model.name_or_path}", "other": "${x}"}
    assert (out.optim.lr, out.rollout.group_size) == (1e-5, 4) and type(out.rollout.group_size) is int
    (tmp_path / "again.yaml").write_text(to_yaml(out))
    assert load_config(tmp_path / "again.yaml").data.chat_template_kwargs == out.data.chat_template_kwargs
