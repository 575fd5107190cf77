"""What peft's LoRA must leave out of a model, for `lora.target_modules` (gspo.train.run).

- `linear_routers`: MoE routers that are `nn.Linear` subclasses returning scores and logits
  (Llama 4's ``Llama4Router``, PhiMoE's router). A LoRA layer takes a wrapped module's output
  for one tensor, so wrapping them fails in the first forward.
- `mamba_lora_exclusions`: a Mamba mixer's ``out_proj`` (Falcon-H1, NemotronH, Mamba-2), which
  peft refuses to adapt on the model types it lists; ``all-linear`` would otherwise select it
  and peft would stop the run.

- `tied_embedding_targets`: the input embedding and LM head of a tie_word_embeddings model,
  which one merged adapter would change together.

The first two are left out of ``all-linear`` (which leaves the head out too); each named in an
explicit list is one error (`lora_targets`, what gspo.train.run hands peft), as are a name that
matches no module and ``all-linear`` inside a list.
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


def _matches(name: str, target: str) -> bool:
    """peft's rule for a name in a list of target modules: the module's full name, or its end."""
    return name == target or name.endswith("." + target)


def tied_embeddings(model) -> tuple:
    """(input embedding, LM head) of a model that ties their weight (tie_word_embeddings), else ().
    peft adapts each side alone, and merging one adapter into the shared weight changes the other
    side too, so the merged model (final/, a vLLM engine's weights, an adapter folder loaded by
    `gspo.models.load_policy`) would not be the policy the adapter was trained as."""
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None or getattr(inp, "weight", None) is not getattr(out, "weight", False):
        return ()
    return inp, out


def tied_embedding_targets(model, targets: list[str]) -> list[str]:
    """The modules in `targets` whose weight is tied to another (`tied_embeddings`)."""
    tied = tied_embeddings(model)
    return [f"{n} ({'the input embedding' if m is tied[0] else 'the LM head'})"
            for n, m in model.named_modules(remove_duplicate=False)
            if any(m is t for t in tied) and any(_matches(n, t) for t in targets)]


def lora_targets(model, targets: list[str]) -> tuple[str | list[str], list[str]]:
    """peft's `target_modules` and `exclude_modules` for `lora.target_modules` = `targets`:
    "all-linear" without what a LoRA layer cannot wrap, or the names given. Refused, naming the
    field: "all-linear" in a list (peft would adapt only the other names), a name that matches
    no module (a typo would adapt only the others), a router, and a tied embedding or head."""
    if "all-linear" in targets and targets != ["all-linear"]:
        raise ConfigError(f"config field 'lora.target_modules': all-linear stands alone (in a list, peft takes "
                          f"it for a module name and adapts only {[t for t in targets if t != 'all-linear']}); "
                          f"use all-linear, or list every module to adapt")
    names = [n for n, _ in model.named_modules()]
    unknown = [t for t in targets if t != "all-linear" and not any(_matches(n, t) for n in names)]
    if unknown:
        raise ConfigError(f"config field 'lora.target_modules': {unknown[0]!r} matches no module of the model "
                          f"(names end a module's full name, e.g. q_proj for model.layers.0.self_attn.q_proj)")
    tied = tied_embedding_targets(model, targets)
    if tied:
        raise ConfigError(f"config field 'lora.target_modules': {tied[0]} shares its weight with the other end "
                          f"of the model (tie_word_embeddings), so merging its adapter would change both and final/ "
                          f"would not be the trained policy; leave it out (all-linear does)")
    routers = linear_routers(model)
    named = [n for n in routers for t in targets if _matches(n, t)]
    if named:
        raise ConfigError(f"config field 'lora.target_modules': {named[0]} is a MoE router that returns scores and "
                          f"logits ({type(model.get_submodule(named[0])).__name__}), which a LoRA layer cannot "
                          f"wrap; name the attention or MLP projections, or all-linear (which leaves routers out)")
    if targets == ["all-linear"]:
        return "all-linear", routers + mamba_lora_exclusions(model)
    return targets, routers
