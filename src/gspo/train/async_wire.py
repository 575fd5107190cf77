"""Async mode's messages (`gspo.train.async_mode`): command and rollout frames over the
job's own process group (a torch.distributed backend object, `pg`; p2p), a rollout as safetensors bytes (its texts and timings as JSON in a
uint8 tensor; nothing is unpickled), the tensors a weight sync sends, and the rollouts in
flight that a checkpoint holds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gspo.rollout import Rollout

GENERATE, WEIGHTS, STOP, ROLLOUT, ERROR, EVAL, EVAL_RESULT = 1, 2, 3, 4, 5, 6, 7
CMD_TAG, ROLLOUT_TAG = 11, 12
INFLIGHT_DIR = "inflight"


def _frame(kind: int, payload: bytes, version: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    head = torch.tensor([kind, len(payload), version], dtype=torch.int64)
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.zeros(0, dtype=torch.uint8)
    return head, body


def send_message(pg, kind: int, payload: bytes, dst: int, tag: int, version: int = 0) -> None:
    head, body = _frame(kind, payload, version)
    pg.send([head], dst, tag).wait()
    if len(payload):
        pg.send([body], dst, tag).wait()


def recv_message(pg, src: int, tag: int) -> tuple[int, bytes, int]:
    head = torch.zeros(3, dtype=torch.int64)
    pg.recv([head], src, tag).wait()
    kind, n, version = (int(x) for x in head)
    body = torch.zeros(n, dtype=torch.uint8)
    if n:
        pg.recv([body], src, tag).wait()
    return kind, body.numpy().tobytes(), version


ROLLOUT_TENSORS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampler_logp", "group_ids")


def encode_rollout(rollout: Rollout, meta: dict) -> bytes:
    """A rollout as safetensors bytes: its tensors, and its texts and `meta` as JSON."""
    from safetensors.torch import save

    tensors = {k: getattr(rollout, k).detach().cpu().contiguous() for k in ROLLOUT_TENSORS}
    if rollout.routes is not None:  # MoE: the sampler's routes (R3)
        tensors["routes"] = rollout.routes.detach().cpu().contiguous()
    if rollout.loss_mask is not None:  # episodes: the tokens the model wrote
        tensors["loss_mask"] = rollout.loss_mask.detach().cpu().contiguous()
    text = {"finish_reason": rollout.finish_reason, "group_size": rollout.group_size, "prompts": rollout.prompts,
            "completions": rollout.completions, "meta": meta, "turns": rollout.turns,
            "env_reward": rollout.env_reward, "episode_stats": rollout.episode_stats}
    tensors["json"] = torch.frombuffer(bytearray(json.dumps(text).encode()), dtype=torch.uint8)
    return save(tensors)


def decode_rollout(data: bytes) -> tuple[Rollout, dict]:
    from safetensors.torch import load

    t = load(data)
    text = json.loads(t.pop("json").numpy().tobytes())
    ro = Rollout(**{k: t[k] for k in ROLLOUT_TENSORS}, finish_reason=text["finish_reason"],
                 group_size=text["group_size"], prompts=text["prompts"], completions=text["completions"],
                 routes=t.get("routes"), loss_mask=t.get("loss_mask"), turns=text.get("turns"),
                 env_reward=text.get("env_reward"), episode_stats=text.get("episode_stats"))
    return ro, text["meta"]


def weight_tensors(model, full: bool) -> dict[str, torch.Tensor]:
    """What a weight sync sends: every parameter and floating buffer (`full`), else the
    trainable parameters (all others never change). The tensors themselves, not copies; under
    FSDP2 each parameter is a DTensor (`local_part` gives this rank's share)."""
    out = {n: p.data for n, p in model.named_parameters() if full or p.requires_grad}
    if full:
        out.update({n: b for n, b in model.named_buffers() if b.is_floating_point()})
    return out


def local_part(t: torch.Tensor, rank: int) -> torch.Tensor | None:
    """This learner's part of a weight: its shard of an FSDP2 parameter (rows of dim 0, in rank
    order: the parts of ranks 0..L-1 concatenated, flat, are the whole tensor), all of an
    unsharded one on rank 0, and nothing (None) of an unsharded one on the other ranks."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local().contiguous()
    return t if rank == 0 else None


def save_inflight(path: Path, inflight: dict[int, tuple[Rollout, dict]], rank: int = 0) -> None:
    """Each learner rank's part of the rollouts in flight, one file each (`rollout-Q.safetensors`
    on rank 0, `rollout-Q.rank-R.safetensors` on rank R)."""
    if not inflight:
        return
    (path / INFLIGHT_DIR).mkdir(exist_ok=True)
    for q, (ro, meta) in inflight.items():
        (path / INFLIGHT_DIR / _inflight_name(q, rank)).write_bytes(encode_rollout(ro, meta))


def _inflight_name(q: int | str, rank: int) -> str:
    return f"rollout-{q}.safetensors" if rank == 0 else f"rollout-{q}.rank-{rank}.safetensors"


def load_inflight(path: Path, rank: int = 0) -> dict[int, tuple[Rollout, dict]]:
    d = path / INFLIGHT_DIR
    out = {}
    if d.is_dir():
        for f in d.glob(_inflight_name("*", rank)):
            if rank == 0 and ".rank-" in f.name:
                continue
            ro, meta = decode_rollout(f.read_bytes())
            out[int(meta["rollout"])] = (ro, meta)
    return out
