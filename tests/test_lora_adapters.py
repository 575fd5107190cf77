"""PEFT adapter folders as users bring them (their own, a TRL checkpoint-N, a run's final/adapter)
as `model.name_or_path`, and what `lora.*` may adapt: each loads as the model it stands for, or is
one error naming the folder or the config field."""

from __future__ import annotations

import json
import re
import shutil

import peft
from safetensors.torch import load_file
import pytest
import torch
from transformers import AutoModelForCausalLM

import artifacts
from gspo.config import ConfigError, load_config
from gspo.models import ModelError, load_policy
from gspo.train.run import build_policy

X = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])


def user_adapter(base, out, *, seed: int = 1, **lora):
    """A user's LoRA adapter on `base`, trained elsewhere (random nonzero B), no tokenizer saved."""
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_pretrained(base)
    p = peft.get_peft_model(m, peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                                                  "task_type": "CAUSAL_LM", **lora}))
    with torch.no_grad():
        for n, w in p.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.3)
    p.save_pretrained(out)
    return out


def logp(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=X).logits.log_softmax(-1)


def policy(*overrides: str):
    return build_policy(load_config(None, ["model.device=cpu", *overrides]), torch.device("cpu"))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return artifacts.save_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    return user_adapter(llama, tmp_path_factory.mktemp("adapter") / "user")


# ----------------------------------------------------------------------------- an adapter folder as the model


def test_full_fine_tuning_from_an_adapter_folder_trains_every_weight(adapter):
    # peft's merge leaves the base frozen: the first backward found nothing to differentiate
    model, _ = policy(f"model.name_or_path={adapter}", "lora.enabled=false")
    assert all(p.requires_grad for p in model.parameters())
    model(input_ids=X).logits.sum().backward()
    assert model.get_submodule("model.layers.0.self_attn.q_proj").weight.grad is not None


def test_lora_on_an_adapter_folder_names_it_as_the_new_adapters_base(adapter, tmp_path):
    """The new adapters were trained on base + the user's adapter: their adapter_config.json names
    the adapter folder, which gspo loads as base + that adapter merged, so loaded the documented
    ways they are the trained model, not new adapters on the bare base."""
    model, _ = policy(f"model.name_or_path={adapter}", "lora.enabled=true", "lora.r=4")
    torch.manual_seed(2)
    with torch.no_grad():
        for n, w in model.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "new")
    assert json.loads((tmp_path / "new" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(adapter)
    trained = logp(model)
    got, _ = load_policy(tmp_path / "new", device="cpu")
    assert (logp(got) - trained).abs().max().item() < 1e-5
    # outside gspo, peft stacks them only with the first merged (docs/scaling.md's recipe): loaded as
    # AutoPeftModel loads it, the second adapter, also "default", replaced the first (0.49 off in a probe)
    base = AutoModelForCausalLM.from_pretrained(json.loads((adapter / "adapter_config.json").read_text())
                                                ["base_model_name_or_path"])
    first = peft.PeftModel.from_pretrained(base, adapter).merge_and_unload()
    assert (logp(peft.PeftModel.from_pretrained(first, tmp_path / "new")) - trained).abs().max().item() < 1e-5
    # (the user's adapter did move the base: the bare base is another model)
    bare, _ = load_policy(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"],
                          device="cpu")
    assert (logp(bare) - logp(load_policy(adapter, device="cpu")[0])).abs().max().item() > 1e-3


def test_an_adapter_that_cannot_be_merged_is_one_error(llama, tmp_path):
    m = AutoModelForCausalLM.from_pretrained(llama)
    peft.get_peft_model(m, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)).save_pretrained(
        tmp_path / "prompt")
    with pytest.raises(ModelError, match=r"PEFT adapter of type PROMPT_TUNING .*cannot be merged"):
        load_policy(tmp_path / "prompt", device="cpu")
    # IA3 and DoRA merge: they load as before
    m = AutoModelForCausalLM.from_pretrained(llama)
    peft.get_peft_model(m, peft.IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", "down_proj"],
                                          feedforward_modules=["down_proj"])).save_pretrained(tmp_path / "ia3")
    user_adapter(llama, tmp_path / "dora", use_dora=True)
    for kind in ("ia3", "dora"):
        model, _ = load_policy(tmp_path / kind, device="cpu")
        assert torch.isfinite(logp(model)).all()


def test_an_adapter_on_a_base_of_other_shapes_is_one_error(llama, adapter, tmp_path):
    other = artifacts.save_model(tmp_path / "llama64", "llama", hidden_size=64)
    shutil.copytree(adapter, tmp_path / "ad")
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": str(other)}))
    with pytest.raises(ModelError, match=re.escape(f"{str(tmp_path / 'ad')!r} is a LoRA adapter that does not fit "
                                                   f"the base model its adapter_config.json names ({str(other)!r})")):
        load_policy(tmp_path / "ad", device="cpu")


def test_a_trainer_peft_checkpoint_loads_as_an_adapter(adapter, tmp_path):
    """HF Trainer / TRL write output_dir/checkpoint-N: the adapter files beside trainer_state.json."""
    ckpt = tmp_path / "trl_out" / "checkpoint-500"
    shutil.copytree(adapter, ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 500, "log_history": []}))
    (ckpt / "training_args.bin").write_bytes(b"")
    got, _ = load_policy(ckpt, device="cpu")
    want, _ = load_policy(adapter, device="cpu")
    assert torch.equal(logp(got), logp(want))


def test_a_run_directory_whose_final_is_adapters_names_it(adapter, tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(adapter, run / "final")  # lora.merge_final=false: final/ is the adapters alone
    with pytest.raises(ModelError, match=re.escape(f"is a gspo run directory, not a model folder; its model is "
                                                   f"{run / 'final'}")):
        load_policy(run, device="cpu")


# ----------------------------------------------------------------------------- lora.target_modules


@pytest.mark.parametrize("targets,says", [
    ("[all-linear, lm_head]", "all-linear stands alone"),  # peft adapted lm_head alone
    ("[all-linear, q_proj]", "all-linear stands alone"),  # ... q_proj alone
    ("[q_proj, v_prj]", "'v_prj' matches no module"),  # ... q_proj alone
])
def test_target_modules_that_would_adapt_fewer_modules_are_refused(llama, targets, says):
    with pytest.raises(ConfigError, match=re.escape(f"config field 'lora.target_modules': {says}")):
        policy(f"model.name_or_path={llama}", "lora.enabled=true", f"lora.target_modules={targets}")


def test_target_modules_names_and_suffixes_adapt_what_they_name(llama):
    model, _ = policy(f"model.name_or_path={llama}", "lora.enabled=true", "lora.target_modules=[q_proj, mlp.up_proj]")
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "up_proj"}


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_lora_on_a_tied_embedding_is_refused(saved, target):
    """Qwen3 (tests/artifacts.py) ties its head to its embedding: an adapter merged into the
    shared weight changes both, and final/ was not the trained policy (0.17 in log-probs)."""
    with pytest.raises(ConfigError, match=rf"'lora.target_modules': \S*{target} .*tie_word_embeddings"):
        policy(f"model.name_or_path={saved('qwen3')}", "lora.enabled=true", f"lora.target_modules=[{target}]")
    # untied, the head is a Linear like any other
    policy(f"model.name_or_path={saved('qwen3', tie_word_embeddings=False)}", "lora.enabled=true",
           "lora.target_modules=[lm_head]")


# ----------------------------------------------------------------------------- the weights a vLLM engine gets


@pytest.mark.parametrize("targets", [["embed_tokens"], ["q_proj", "embed_tokens"]])
def test_vllm_engine_weights_merge_an_embedding_lora(llama, targets):
    """`merged_weights` skipped peft's Embedding LoRA layers (lora_embedding_A/B): the engine
    sampled from the base embedding, not the policy's."""
    from gspo.rollout.vllm import merged_weights

    torch.manual_seed(0)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(llama),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, w in model.named_parameters():
            if "lora_" in n:
                w.normal_(0, 0.5)
    engine = AutoModelForCausalLM.from_pretrained(llama)
    engine.load_state_dict(dict(merged_weights(model)), strict=True)
    assert (logp(engine) - logp(model)).abs().max().item() < 1e-5
    assert (logp(engine) - logp(AutoModelForCausalLM.from_pretrained(llama))).abs().max().item() > 1e-2


# ----------------------------------------------------------------------------- final/


def test_lora_in_bfloat16_on_a_float32_checkpoint_merges_at_float32(llama, tmp_path, capsys):
    """model.dtype=bfloat16 with LoRA on a float32 checkpoint: final/ is written in float32
    (output.final_dtype=auto), so the fp32 adapters are merged into the base cast up, not into
    its bf16 weights, where an update of ~lr per step is far below a weight's bf16 spacing
    (~1e-4 here) and rounded away: final/ was the bf16 base."""
    from safetensors.torch import load_file

    from gspo.cli import main

    rc = main(["train", f"model.name_or_path={llama}", "model.dtype=bfloat16", "lora.enabled=true", "lora.r=4",
               "optim.lr=1e-6", "data.source=arithmetic", "rollout.prompts_per_step=2", "rollout.group_size=2",
               "rollout.max_new_tokens=4", "schedule.rollouts=1", "schedule.num_minibatches=1",
               "rewards.functions=[{name: 'artifacts:signal_reward'}]", "logging.console=false",
               f"output.dir={tmp_path}", "output.name=x"])
    assert rc == 0
    final = load_file(tmp_path / "x" / "final" / "model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).float()  # the base as it trained
    bf16_base = {k: v.clone() for k, v in base.state_dict().items()}
    exact = peft.PeftModel.from_pretrained(base, tmp_path / "x" / "final" / "adapter").merge_and_unload().state_dict()
    k = "model.layers.0.self_attn.q_proj.weight"
    assert final[k].dtype == torch.float32
    update = exact[k] - bf16_base[k]
    assert 0 < update.abs().max().item() < 1e-4  # the adapters moved it, by less than bf16 can hold
    torch.testing.assert_close(final[k], exact[k], rtol=0, atol=1e-7)


def test_an_adapter_on_a_tied_embedding_is_refused_at_load(saved, tmp_path):
    """A user's adapter on the head of a model that ties it to the embedding: peft's merge wrote
    the head's update into the embedding too (0.17 in log-probs from base + adapter)."""
    user_adapter(saved("qwen3"), tmp_path / "ad", target_modules=["lm_head"])
    with pytest.raises(ModelError, match=r"LoRA adapter on lm_head, whose weight its base .* ties"):
        load_policy(tmp_path / "ad", device="cpu")


class _Evil:
    def __reduce__(self):
        return (print, ("the pickle's code ran",))


@pytest.mark.parametrize("what", ["model", "adapter"])
def test_a_pickled_bin_weights_file_is_one_error_and_its_code_never_runs(llama, adapter, what, tmp_path, capsys):
    """A pytorch_model.bin (or adapter_model.bin) that torch's weights-only loader refuses raised a
    raw UnpicklingError: a traceback, exit 1. Now one ModelError naming the folder, exit 2."""
    from gspo.cli import main

    folder = tmp_path / what
    shutil.copytree(llama if what == "model" else adapter, folder)
    stem = "model" if what == "model" else "adapter_model"
    state = load_file(folder / f"{stem}.safetensors")
    (folder / f"{stem}.safetensors").unlink()
    torch.save({**state, "extra": _Evil()}, folder / ("pytorch_model.bin" if what == "model" else "adapter_model.bin"))
    with pytest.raises(ModelError, match="pickle holding more than tensors"):
        load_policy(folder)
    assert main(["train", f"model.name_or_path={folder}", "schedule.rollouts=1", "eval.enabled=false",
                 f"output.dir={tmp_path}"]) == 2
    err = capsys.readouterr()
    assert "pickle holding more than tensors" in err.err and "Traceback" not in err.err, err.err[-1500:]
    assert "the pickle's code ran" not in err.out + err.err


def test_a_lora_run_on_an_adapter_folder_says_how_its_adapters_load(adapter, tmp_path, capsys):
    from gspo.cli import main

    capsys.readouterr()
    assert main(["train", f"model.name_or_path={adapter}", "lora.enabled=true", "data.source=arithmetic",
                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
                 "schedule.rollouts=1", "schedule.num_minibatches=1", "eval.enabled=false",
                 "logging.console=false", f"output.dir={tmp_path}"]) == 0
    assert "is a LoRA adapter: it is merged into its base and the run trains new adapters on that" in \
        capsys.readouterr().err
