"""Async mode's messages (`gspo.train.async_mode`): command and rollout frames over
torch.distributed p2p, a rollout as safetensors bytes (its texts and timings as JSON in a
uint8 tensor; nothing is unpickled), the tensors a weight sync sends, and the rollouts in
flight that a checkpoint holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from gspo.rollout import Rollout

GENERATE, WEIGHTS, STOP, ROLLOUT, ERROR = 1, 2, 3, 4, 5
CMD_TAG, ROLLOUT_TAG = 11, 12
INFLIGHT_DIR = "inflight"


def _frame(kind: int, payload: bytes, version: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    head = torch.tensor([kind, len(payload), version], dtype=torch.int64)
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
    return head, body


def send_message(kind: int, payload: bytes, dst: int, tag: int, version: int = 0) -> None:
    head, body = _frame(kind, payload, version)
    dist.send(head, dst, tag=tag)
    if len(payload):
        dist.send(body, dst, tag=tag)


def recv_message(src: int, tag: int) -> tuple[int, bytes, int]:
    head = torch.zeros(3, dtype=torch.int64)
    dist.recv(head, src, tag=tag)
    kind, n, version = (int(x) for x in head)
    body = torch.zeros(n, dtype=torch.uint8)
    if n:
        dist.recv(body, src, tag=tag)
    return kind, body.numpy().tobytes(), version


ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logp", "group_ids")


def encode_rollout(rollout: Rollout, meta: dict) -> bytes:
    """A rollout as safetensors bytes: its tensors, and its texts and `meta` as JSON."""
    from safetensors.torch import save

    tensors = {k: getattr(rollout, k).detach().cpu().contiguous() for k in ROLLOUT_TENSORS}
    if rollout.routes is not None:  # MoE: the sampler's routes (R3)
        tensors["routes"] = rollout.routes.detach().cpu().contiguous()
    text = {"finish_reason": rollout.finish_reason, "group_size": rollout.group_size, "prompts": rollout.prompts,
            "completions": rollout.completions, "meta": meta}
    tensors["json"] = torch.frombuffer(bytearray(json.dumps(text).encode()), dtype=torch.uint8)
    return save(tensors)


def decode_rollout(data: bytes) -> tuple[Rollout, dict]:
    from safetensors.torch import load

    t = load(data)
    text = json.loads(t.pop("json").numpy().tobytes())
    ro = Rollout(**{k: t[k] for k in ROLLOUT_TENSORS}, finish_reason=text["finish_reason"],
                 group_size=text["group_size"], prompts=text["prompts"], completions=text["completions"],
                 routes=t.get("routes"))
    return ro, text["meta"]


def _dtype_groups(tensors: dict[str, torch.Tensor]) -> list[list]:
    """[[dtype name, [tensor names]], ...]: the tensors of each dtype, in their order."""
    groups: dict[str, list[str]] = {}
    for n, t in tensors.items():
        groups.setdefault(str(t.dtype), []).append(n)
    return [[d, names] for d, names in groups.items()]


def weight_tensors(model, full: bool) -> dict[str, torch.Tensor]:
    """What a weight sync sends: every parameter and floating buffer (`full`), else the
    trainable parameters (all others never change). The tensors themselves, not copies."""
    out = {n: p.data for n, p in model.named_parameters() if full or p.requires_grad}
    if full:
        out.update({n: b for n, b in model.named_buffers() if b.is_floating_point()})
    return out


def save_inflight(path: Path, inflight: dict[int, tuple[Rollout, dict]]) -> None:
    if not inflight:
        return
    (path / INFLIGHT_DIR).mkdir()
    for q, (ro, meta) in inflight.items():
        (path / INFLIGHT_DIR / f"rollout-{q}.safetensors").write_bytes(encode_rollout(ro, meta))


def load_inflight(path: Path) -> dict[int, tuple[Rollout, dict]]:
    d = path / INFLIGHT_DIR
    out = {}
    if d.is_dir():
        for f in d.glob("rollout-*.safetensors"):
            ro, meta = decode_rollout(f.read_bytes())
            out[int(meta["rollout"])] = (ro, meta)
    return out
