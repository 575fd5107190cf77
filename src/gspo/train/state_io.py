"""Serialising one training state without pickle: model and optimizer tensors, the scheduler's
JSON-able state, and every RNG's state.

`gspo.train.checkpoint` puts these files into a crash-safe checkpoint directory; they are separate so
that a sharded (torch.distributed.checkpoint) writer can replace the model/optimizer part.
Tensors go through safetensors or ``torch.load(weights_only=True)``, everything else JSON.
"""

from __future__ import annotations

import base64
import json
import random
import warnings
from pathlib import Path

import numpy as np
import safetensors.torch
import torch


class CheckpointWarning(UserWarning):
    """A partial or corrupt checkpoint was skipped, or a saved state only partly fits this machine."""


# ----------------------------------------------------------------------------- model / optimizer
# Four small functions so a sharded (torch.distributed.checkpoint) variant can replace them.


def save_model_state(model: torch.nn.Module, path: Path, *, trainable_only: bool = False) -> None:
    """Write the model's parameters/buffers to ``path`` (safetensors).

    Tied weights (e.g. lm_head/embed_tokens) are stored once; ``load_model_state`` re-ties them.
    ``trainable_only`` stores only parameters with ``requires_grad`` (LoRA adapters), no buffers.
    """
    if not trainable_only:
        safetensors.torch.save_model(model, str(path), force_contiguous=True)
        return
    # named_parameters() already drops the second name of a tied parameter; clone so that
    # parameters that are views of one storage do not trip safetensors' shared-tensor check.
    tensors = {n: p.detach().cpu().clone().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    safetensors.torch.save_file(tensors, str(path))


def load_model_state(model: torch.nn.Module, path: Path, *, trainable_only: bool = False) -> None:
    """Load ``path`` into ``model`` in place; raise on any missing or unexpected key."""
    device = next(model.parameters(), torch.empty(0)).device
    device = str(device) if device.type != "meta" else "cpu"
    if not trainable_only:
        safetensors.torch.load_model(model, str(path), strict=True, device=device)
        return
    tensors = safetensors.torch.load_file(str(path), device=device)
    params = dict(model.named_parameters(remove_duplicate=False))
    unexpected = sorted(set(tensors) - set(params))
    loaded = {id(params[n]) for n in tensors if n in params}
    missing = sorted(n for n, p in params.items() if p.requires_grad and id(p) not in loaded)
    if unexpected or missing:
        raise RuntimeError(f"trainable-only weights do not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for n, t in tensors.items():
            params[n].copy_(t)


def save_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Write ``optimizer.state_dict()`` with torch.save (tensors, numbers, strings, tuples only)."""
    with open(path, "wb") as f:
        torch.save(optimizer.state_dict(), f)


def load_optimizer_state(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Load optimizer state; weights_only=True refuses anything that would need unpickling code."""
    # map_location="cpu": load_state_dict moves each state tensor to its parameter's device.
    state = torch.load(path, map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state)


# ----------------------------------------------------------------------------- scheduler / RNG


def scheduler_json(scheduler) -> dict:
    """The JSON-able entries of ``scheduler.state_dict()``; the rest (e.g. lambdas) is rebuilt by code."""
    state, dropped = {}, []
    for key, value in scheduler.state_dict().items():
        try:
            json.dumps(value, allow_nan=True)
            state[key] = value
        except (TypeError, ValueError):
            dropped.append(key)
    return {"state": state, "dropped": dropped}


def load_scheduler_state(scheduler, saved: dict) -> None:
    """The checkpoint's step count and base learning rates, under the schedule the trainer's
    code just built (the live lr_lambdas, which a state dict cannot hold): the next step's
    learning rate is that schedule's at the checkpoint's step, at once. Unchanged settings give
    the saved rates bit for bit; a schedule stretched over more rollouts, or another
    schedule.lr_schedule, acts from the first resumed step (it acted one step late, after a
    step at the old schedule's rate: 0 at a finished cosine's end)."""
    state = scheduler.state_dict()
    state.update(saved["state"])
    scheduler.load_state_dict(state)
    if hasattr(scheduler, "lr_lambdas"):  # LambdaLR: lr = base_lr * lambda(step)
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, lrs):
            group["lr"] = lr
        scheduler._last_lr = lrs


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict:
    """Python, numpy, torch CPU and every CUDA device's RNG state, as a JSON-able dict."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch_cpu": _b64(torch.get_rng_state()),
        "torch_cuda": [],
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of ``capture_rng_state``. CUDA states are restored for the devices both runs have."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    cuda = state.get("torch_cuda", [])
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n != len(cuda):
            warnings.warn(f"checkpoint has RNG states for {len(cuda)} CUDA devices, this machine has {n}; "
                          f"restoring the first {min(n, len(cuda))}", CheckpointWarning, stacklevel=2)
        for i, s in enumerate(cuda[:n]):
            torch.cuda.set_rng_state(_unb64(s), device=i)
