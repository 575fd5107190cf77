"""The config surface: values that load (OmegaConf interpolation in any field) and values refused
with one error naming the field before any model loads (a device this torch cannot reach, an
optimizer setting torch would refuse, a process-group backend for hardware that is not there).
Each test here failed before the fix it guards."""

from __future__ import annotations

import pytest
import torch

from gspo.cli import main
from gspo.config import ConfigError, load_config


def test_interpolation_works_in_number_fields_as_in_text_fields(monkeypatch):
    """`${...}` was refused in number fields ("must be a number, got '${...}'") before OmegaConf
    could resolve it."""
    monkeypatch.setenv("GSPO_TEST_G", "6")
    cfg = load_config(None, ["rollout.group_size=${rollout.prompts_per_step}", "optim.lr=${oc.env:GSPO_TEST_G}",
                             "output.name=run-${rollout.group_size}"])
    assert cfg.rollout.group_size == cfg.rollout.prompts_per_step and isinstance(cfg.rollout.group_size, int)
    assert cfg.optim.lr == 6.0 and cfg.output.name == f"run-{cfg.rollout.prompts_per_step}"
    with pytest.raises(ConfigError, match=r"config field 'rollout.group_size'.*could not be converted to Integer"):
        load_config(None, ["rollout.group_size=${output.name}"])
    with pytest.raises(ConfigError, match="config field 'rollout.group_size': must be a number"):
        load_config(None, ["rollout.group_size=many"])


@pytest.mark.parametrize("eps", ["-1", "nan", "inf", "0"])
def test_adam_eps_out_of_range_is_refused_naming_the_field(eps):
    """torch's "Invalid epsilon value" came after the model loaded, without the field's name; 0
    made every weight whose gradient was 0 NaN (0/0)."""
    with pytest.raises(ConfigError, match="config field 'optim.adam_eps': must be a finite number > 0"):
        load_config(None, [f"optim.adam_eps={eps}"])


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda", "cuda:1", "meta", "hpu"],
                         ids=["tpu", "a-gpu", "cuda", "cuda-1", "meta", "hpu"])
def test_a_device_torch_cannot_use_is_refused_before_the_model_loads(tmp_path, capsys, device):
    """'tpu' was torch's RuntimeError with a traceback (exit 1); 'cuda' on a CPU-only torch failed
    in model.to() after the weights had loaded."""
    if device.startswith("cuda") and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        pytest.skip("this machine has the device")
    assert main(["train", f"model.device={device}", f"output.dir={tmp_path}", "output.name=x"]) == 2
    err = capsys.readouterr().err
    assert f"config field 'model.device': '{device}'" in err and "Traceback" not in err, err[-1500:]
    assert not (tmp_path / "x").exists()


def test_nccl_on_a_process_without_a_gpu_is_refused_naming_the_backend(monkeypatch):
    """torch's "init_process_group device_id parameter must be an accelerator with an index",
    once per rank, named no field."""
    from gspo.train import distributed

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda *a, **k: pytest.fail("joined a group"))
    with pytest.raises(ConfigError, match="config field 'distributed.backend': nccl joins CUDA GPUs"):
        distributed.init_distributed("fsdp", torch.device("cpu"), "nccl")
    monkeypatch.delenv("RANK")  # one process, no torchrun: refused all the same (it was accepted, and unused)
    with pytest.raises(ConfigError, match="config field 'distributed.backend': nccl joins CUDA GPUs"):
        distributed.init_distributed("fsdp", torch.device("cpu"), "nccl")


def test_an_adapter_folders_errors_keep_their_context_with_the_tokenizer_loaded_first(tmp_path, capsys):
    """Loading the tokenizer before the model lost _load_adapter's messages: an adapter naming no
    base said its tokenizer did not load; one whose base is gone named only the base's path."""
    import json

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (bare / "tokenizer_config.json").write_text("{}")  # (a tiny run's final/adapter has a tokenizer of its own)
    assert main(["eval", str(bare), "arithmetic", "--num-prompts", "1"]) == 2
    assert "is a LoRA adapter whose adapter_config.json names no base model" in capsys.readouterr().err
    orphan = tmp_path / "orphan"
    orphan.mkdir()
    (orphan / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA",
                                                            "base_model_name_or_path": str(tmp_path / "gone")}))
    assert main(["eval", str(orphan), "arithmetic", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert f"model path {str(orphan)!r} is a LoRA adapter on the base model {str(tmp_path / 'gone')!r}" in err, err


def test_a_run_that_fails_before_it_starts_leaves_no_directory(saved, tmp_path, capsys):
    """A bad input found after the run directory was claimed (a model that does not load) left
    runs/NAME/ behind holding only its lock."""
    import shutil

    model = shutil.copytree(saved("qwen3"), tmp_path / "model")
    (model / "model.safetensors").write_bytes(b"\0" * 8)
    assert main(["train", f"model.name_or_path={model}", "rollout.max_new_tokens=4", f"output.dir={tmp_path}",
                 "output.name=x"]) == 2
    assert "could not load model" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_lr_beyond_float32_is_refused():
    with pytest.raises(ConfigError, match="config field 'optim.lr': must be a number > 0 and below float32's range"):
        load_config(None, ["optim.lr=1e39"])


def test_a_step_that_makes_weights_non_finite_stops_the_run_without_saving_them(tmp_path):
    """A step with a finite loss and gradient norm that the optimizer took past float32's range
    went unnoticed: the NaN model then drew only equal rewards, its zero-advantage steps counted
    as finite, and the run ended with exit 0, a NaN final/ and NaN checkpoints."""
    from types import SimpleNamespace

    from gspo.train.distributed import Dist
    from gspo.train.loop import TrainerState, _optimizer_step
    from gspo.train.produce import TrainingError

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=1e30)
    run = SimpleNamespace(optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), dist=Dist(),
                          cfg=load_config(None, ["optim.lr=1e30", f"output.dir={tmp_path}"]))
    state = TrainerState()
    w.grad = torch.full((3,), 1e-30)  # a finite step: w moves by 1
    _optimizer_step(run, state, loss=0.5, grad_norm=1.0)
    assert state.step == 1 and torch.isfinite(w).all()
    w.grad = torch.full((3,), 1e10)  # finite loss and gradient, but 1e40 past the range
    with pytest.raises(TrainingError, match="optimizer step 2 made weights non-finite .*it had no checkpoint yet"):
        _optimizer_step(run, state, loss=0.5, grad_norm=1e10)


def test_a_python_function_set_as_a_reward_name_is_one_error_naming_the_field():
    """A config built in a script, with a function where the name goes, raised AttributeError
    ('function' object has no attribute 'replace') from deep in the start-up checks."""
    from gspo.train.reward_specs import checked_reward_specs

    def mine(prompts, completions, **kw):
        return [0.0] * len(completions)

    cfg = load_config(None, [])
    cfg.rewards.functions[0].name = mine
    with pytest.raises(ConfigError, match=r"config field 'rewards.functions\[0\].name': must be text.*got function"):
        checked_reward_specs(cfg)


def test_a_stop_every_process_decided_is_said_by_rank_0_alone(monkeypatch, capsys):
    """Under torchrun both ranks printed the same non-finite-weights stop."""
    from gspo import cli
    from gspo.train.produce import TrainingError

    def stopped(args):
        raise TrainingError("optimizer step 1 made weights non-finite", everywhere=True)

    monkeypatch.setattr(cli, "cmd_report", stopped)
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert main(["report", "x"]) == 1
        assert ("stopped: optimizer step 1" in capsys.readouterr().err) == said


@pytest.mark.parametrize("value", ["1", "2", "'True'", "'on'", "null"])
@pytest.mark.parametrize("field", ["rewards.allow_code_execution", "model.trust_remote_code"])
def test_an_opt_in_to_running_code_takes_only_the_yaml_booleans(field, value, tmp_path):
    """`rewards.allow_code_execution=2` (or "1", "True", "on") was read as true: model-written code ran."""
    with pytest.raises(ConfigError, match=rf"config field '{field}': must be true or false \(the YAML boolean\)"):
        load_config(None, [f"{field}={value}"])
    section, key = field.split(".")
    (tmp_path / "c.yaml").write_text(f"{section}:\n  {key}: {value}\n")
    with pytest.raises(ConfigError, match=rf"config field '{field}'"):
        load_config(tmp_path / "c.yaml")
    assert getattr(getattr(load_config(None, [f"{field}=true"]), section), key) is True
