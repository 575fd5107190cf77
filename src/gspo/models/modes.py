"""The mode of every pass over the policy: the trainer's passes (`set_trainer_mode`: eval mode,
so no dropout enters the ratio, with gradient checkpointing kept working), sampling and
evaluation (`eval_mode`, `generation_mode`)."""

from __future__ import annotations

import types
from contextlib import contextmanager

import torch


def set_trainer_mode(model, *, dropout: bool) -> None:
    """The mode of every trainer pass (the pi_old pass and the update passes), set once.

    Without `dropout` (the default), every module is in eval mode, as in the sampler: dropout
    and any other training-only noise (router jitter, layer drop) would make pi_theta differ
    from pi_old on the very same weights, and that noise enters the ratio s_i, whose clip range
    is 3e-4 (GSPO.md, §5.1). Layers that checkpoint their activations stay in eval mode too and
    still recompute (`_checkpoint_in_eval_mode`), so `set_activation_checkpointing` acts on a
    loaded checkpoint as on a built one. With `dropout`, the whole model is in training mode
    (the checkpoint's dropout acts in every trainer pass; the sampler stays in eval mode, see
    `eval_mode`)."""
    if dropout:
        model.train()
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.eval()
    for m in model.modules():  # (the model modules that loop over the layers need no training flag to checkpoint)
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing is True:
            _checkpoint_in_eval_mode(m)


def _checkpoint_in_eval_mode(layer) -> None:
    """Let `layer` (a transformers GradientCheckpointingLayer) recompute its activations in the
    backward pass while it stays in eval mode.

    transformers checkpoints a layer only when the layer's own `training` flag is set, and some
    families read that same flag in the layer's forward for a dropout of their own (functional
    dropout, not a child module: OPT, BioGPT, XGLM, DBRX's block), which would then act in the
    trainer's passes, under no_grad (pi_old) as well as with grad. Here the flag is set only for
    transformers' decision, only when there is a backward to recompute for, and the function
    that is checkpointed runs with it off. Both are bound methods of the layer, so that a deep
    copy of the model (the KL reference) runs its own layers."""
    if getattr(layer._gradient_checkpointing_func, "__func__", None) is _run_checkpointed_in_eval_mode:
        return
    layer._gspo_checkpoint = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = types.MethodType(_run_checkpointed_in_eval_mode, layer)
    layer.forward = types.MethodType(_forward_deciding_checkpoint, layer)


def _forward_deciding_checkpoint(layer, *args, **kwargs):
    layer.training = torch.is_grad_enabled() and layer.gradient_checkpointing is True
    try:
        return type(layer).forward(layer, *args, **kwargs)
    finally:
        layer.training = False


def _run_checkpointed_in_eval_mode(layer, function, *args, **kwargs):
    def in_eval_mode(*a, **k):
        layer.training = False  # (the forward, and its recompute in the backward pass)
        return function(*a, **k)

    return layer._gspo_checkpoint(in_eval_mode, *args, **kwargs)


@contextmanager
def eval_mode(model):
    """Every module in eval mode inside the block (sampling, evaluation), and each module's own
    mode restored after it: restoring with ``model.train(True)`` would switch on every dropout
    that `set_trainer_mode` left off."""
    saved = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in saved:
            m.training = training


@contextmanager
def generation_mode(model):
    """What sampling and greedy evaluation run under: every module in eval mode (`eval_mode`)
    and a clean generation config, since transformers fills every field a `generate` call
    leaves unset from the checkpoint's own (a shipped repetition penalty, Qwen's 1.05, or a
    no-repeat n-gram size would act). Both are restored after the block, on every module that
    holds a generation config: a peft wrapper's `generate` copies its own into the model it
    wraps, which would otherwise keep the clean one (and save it with the merged model)."""
    from transformers import GenerationConfig

    saved = [(m, vars(m).get("generation_config", _ABSENT)) for m in model.modules()]
    model.generation_config = GenerationConfig()
    try:
        with eval_mode(model):
            yield model
    finally:
        for m, cfg in saved:
            if cfg is not _ABSENT:
                vars(m)["generation_config"] = cfg
            else:
                vars(m).pop("generation_config", None)


_ABSENT = object()
