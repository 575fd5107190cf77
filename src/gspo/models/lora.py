"""What peft's LoRA must leave out of a model, for `lora.target_modules` (gspo.train.run).

- `linear_routers`: MoE routers that are `nn.Linear` subclasses returning scores and logits
  (Llama 4's ``Llama4Router``, PhiMoE's router). A LoRA layer takes a wrapped module's output
  for one tensor, so wrapping them fails in the first forward.
- `mamba_lora_exclusions`: a Mamba mixer's ``out_proj`` (Falcon-H1, NemotronH, Mamba-2), which
  peft refuses to adapt on the model types it lists; ``all-linear`` would otherwise select it
  and peft would stop the run.

Both are left out of ``all-linear``; a router named in an explicit list is one error
(`lora_targets`, what gspo.train.run hands peft).
"""

from __future__ import annotations

import torch

from gspo.config import ConfigError

# the model types whose mixers' out_proj / conv1d peft refuses to adapt (peft 0.17-0.21's own list)
PEFT_MAMBA_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")


def linear_routers(model) -> list[str]:
    """Names of the MoE routers that subclass `nn.Linear` (and return more than a tensor)."""
    return [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and type(m) is not torch.nn.Linear and "router" in type(m).__name__.lower()]


def mamba_lora_exclusions(model) -> list[str]:
    """Names of the linear layers called ``out_proj`` in a model of a type in PEFT_MAMBA_TYPES
    (its Mamba mixers' output projections; attention's is ``o_proj`` there)."""
    if getattr(getattr(model, "config", None), "model_type", None) not in PEFT_MAMBA_TYPES:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.endswith("out_proj")]


def lora_targets(model, targets: list[str]) -> tuple[str | list[str], list[str]]:
    """peft's `target_modules` and `exclude_modules` for `lora.target_modules` = `targets`:
    "all-linear" without what a LoRA layer cannot wrap, or the names given, refusing a router."""
    routers = linear_routers(model)
    named = [n for n in routers for t in targets if n == t or n.endswith("." + t)]
    if named:
        raise ConfigError(f"config field 'lora.target_modules': {named[0]} is a MoE router that returns scores and "
                          f"logits ({type(model.get_submodule(named[0])).__name__}), which a LoRA layer cannot "
                          f"wrap; name the attention or MLP projections, or all-linear (which leaves routers out)")
    if targets == ["all-linear"]:
        return "all-linear", routers + mamba_lora_exclusions(model)
    return targets, routers
