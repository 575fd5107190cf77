"""A training run's state on disk: its checkpoints (`save_run`, `restore_run`, in the crash-safe
format of `gspo.train.checkpoint`) and its model in Hugging Face format (`save_final`), for the
run's processes together: sharded under FSDP2, with async mode's rollouts in flight."""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from gspo.config import to_yaml
from gspo.models import as_brought, saved_dtype
from gspo.train import distributed, faults
from gspo.train.checkpoint import CheckpointError, disk_full_hint, load_checkpoint, save_checkpoint
from gspo.train.run import build_policy, policy_state, push_weights


def save_run(run, state) -> Path:
    """Checkpoint a training run (`gspo.train.run.Run`) after `state.step` optimizer steps: the
    policy (the adapters alone with LoRA on one process), optimizer, scheduler, trainer state,
    every rank's RNG and the resolved config; sharded by `torch.distributed.checkpoint` under
    FSDP2."""
    d, cfg = run.dist, run.cfg
    sharded = d.enabled and d.strategy == "fsdp"
    write = (lambda p: distributed.save_sharded(p, run.trainer, run.optimizer, d)) if sharded else None
    extra = None
    if run.remote is not None:  # async mode: the rollouts older weights sampled for the next ones
        from gspo.train.async_wire import save_inflight

        inflight = run.remote.inflight(state.rollout)
        extra = lambda p: save_inflight(p, inflight, d.rank)  # noqa: E731
    return save_checkpoint(cfg.run_dir, state.step, model=run.policy, optimizer=run.optimizer,
                           scheduler=run.scheduler, trainer_state=asdict(state), config_text=to_yaml(cfg),
                           keep_last=cfg.checkpoint.keep_last, trainable_only=cfg.lora.enabled and not sharded,
                           comm=d if d.enabled else None, write_state=write, write_extra=extra)


def restore_run(run, path: Path) -> dict:
    """Load `path` into the run and push the weights to the generator; returns the trainer state."""
    sharded = run.dist.enabled and run.dist.strategy == "fsdp"
    read = (lambda p: distributed.load_sharded(p, run.trainer, run.optimizer)) if sharded else None
    state = load_checkpoint(path, model=run.policy, optimizer=run.optimizer, scheduler=run.scheduler,
                            read_state=read, rank=run.dist.rank)
    if "sampler" in state:  # checkpoints written before the prompt stream's position was named "prompts"
        state["prompts"] = state.pop("sampler")
    push_weights(run)
    return state


def _gathered_policy(run):
    """Every rank: the sharded policy's full weights, loaded into a fresh CPU copy on rank 0
    (None elsewhere): what async mode with FSDP2 writes as final/."""
    full = distributed.full_state_dict(run.trainer, run.dist, rank0_cpu=True)
    if not run.dist.is_main:
        return None
    model, _ = build_policy(run.cfg, torch.device("cpu"))
    model.load_state_dict(policy_state(full), strict=True)
    return model


def _final_dtype(run, model) -> torch.dtype | None:
    """output.final_dtype (auto: the dtype the checkpoint was saved in, `saved_dtype`); None
    where that is unknown (the tiny model): the weights are written as trained."""
    name = run.cfg.output.final_dtype
    return getattr(torch, name) if name != "auto" else (saved_dtype(run.policy) or saved_dtype(model))


def _weights_dtype(model) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _merged(run, model):
    """The LoRA adapters merged into `model`'s base, in place (training is over). A base that
    trained in a narrower dtype than final/ is written in (model.dtype=bfloat16 on a float32
    checkpoint) is cast up first, so that the fp32 adapters' update is added at the precision
    it is written in: merged into the bf16 weights, most of a small update rounds away."""
    target, trained = _final_dtype(run, model), _weights_dtype(model)
    if target is not None and trained is not None and target.itemsize > trained.itemsize:
        model.to(target)
    return model.merge_and_unload()


def _in_final_dtype(run, model, trained: torch.dtype | None):
    """`model` with its floating-point weights in output.final_dtype (`_final_dtype`), cast in
    place (training is over), and a note when that is not `trained`, the dtype it trained in: a
    bfloat16 checkpoint comes back as bfloat16, not at twice its size, though a change smaller
    than half a weight's bf16 spacing rounds away."""
    name = run.cfg.output.final_dtype
    if hasattr(model, "peft_config"):  # adapters alone (lora.merge_final=false): peft's own dtype
        return model
    target = _final_dtype(run, model)
    if target is None or trained is None or target == trained:
        return model
    model.to(target)
    if run.dist.is_main:
        why = "the dtype the checkpoint was saved in" if name == "auto" else "output.final_dtype"
        print(f"final/: weights written in {str(target)[6:]}, {why} (trained in {str(trained)[6:]}; "
              f"output.final_dtype={str(trained)[6:]} writes them as trained)", file=sys.stderr)
    return model


@contextmanager
def _progress_bars(on: bool):
    """transformers' progress bars (save_pretrained's "Writing model shards") only where the
    console is on (logging.console), and as they were afterwards."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not on:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not on:
            hf_logging.enable_progress_bar()


def save_final(run) -> Path:
    """Rank 0 writes final/ in Hugging Face format: the model (LoRA merged in) and the
    tokenizer; with LoRA also the adapters alone in final/adapter. It is written beside, as
    final.partial/, and renamed when whole, so a process killed meanwhile leaves no final/ that
    looks done (a resumed run then writes it again from the finished checkpoint)."""
    out = run.cfg.run_dir / "final"
    model = run.generator_model  # full weights on every strategy (pushed after the last update)
    if run.remote is not None and run.dist.enabled and run.dist.strategy == "fsdp":
        model = _gathered_policy(run)  # async mode keeps no full copy: gather one, on rank 0 alone
    if run.dist.is_main:
        part = out.with_name("final.partial")
        shutil.rmtree(part, ignore_errors=True)
        try:
            # (the weights are read only when final/ has a dtype to be cast to)
            trained = _weights_dtype(model) if _final_dtype(run, model) is not None else None
            if run.cfg.lora.enabled:
                model.save_pretrained(part / "adapter", safe_serialization=True)
                if run.cfg.lora.merge_final:
                    model = _merged(run, model)
            model = _in_final_dtype(run, model, trained)
            with as_brought(run.tokenizer, model), _progress_bars(run.cfg.logging.console):  # the user's pad and
                model.save_pretrained(part, safe_serialization=True)  # padding side; transformers' bar as the console
                run.tokenizer.save_pretrained(part)
        except Exception as e:  # a full disk, a lost mount: the finished checkpoint is whole
            shutil.rmtree(part, ignore_errors=True)
            raise CheckpointError(f"could not write {out}: {type(e).__name__}: {e}{disk_full_hint(e, out.parent)}; "
                                  f"the run's last checkpoint is whole: resume with resume=auto to write final/ "
                                  f"again") from e
        faults.in_final()  # tests only
        shutil.rmtree(out, ignore_errors=True)
        os.rename(part, out)
    run.dist.barrier()
    return out
