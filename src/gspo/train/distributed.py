"""Running on several processes with PyTorch's own engine: torchrun + FSDP2 (or DDP).

`gspo train` is the same program on one process or N. Under ``torchrun`` (WORLD_SIZE > 1):

- the policy is sharded with FSDP2 (``fully_shard`` on every decoder layer, then on the root),
  or replicated with DDP (``distributed.strategy=ddp``);
- every rank takes its own ``prompts_per_step / world_size`` prompts (no overlap) and samples
  whole groups for them, so group advantages never cross ranks;
- losses are weighted so that the gradient averaged over ranks equals the one-process gradient
  of the same global batch; metrics are reduced across ranks and logged by rank 0 only;
- checkpoints are written by ``torch.distributed.checkpoint`` as sharded safetensors files
  (every rank writes its own shard; nothing is pickled), and the final model is gathered into
  Hugging Face format by rank 0.

The gloo backend runs all of this on CPUs (the tests use 2 processes); NCCL on GPUs.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo.config import ConfigError, DistributedConfig, ModelConfig


@dataclass
class Dist:
    """This process's place in the job. One process: rank 0 of 1, every collective a no-op."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # none | fsdp | ddp
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    launched: bool = False  # started by torchrun (a process group exists, even of one process)

    @property
    def enabled(self) -> bool:
        return self.launched or self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Reduce a list of floats across ranks (float64 on the collective's device)."""
        if not self.enabled or not values:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device)
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                               "min": dist.ReduceOp.MIN}[op])
        return t.tolist()

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors from all ranks along dim 0 (rank order)."""
        if not self.enabled:
            return t
        x = t.to(self._comm_device)
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(out, x)
        return torch.cat(out).to(t.device)

    def gather_json(self, obj: Any) -> list:
        """`obj` (JSON-able) from every rank, in rank order, on every rank: JSON bytes in a uint8
        tensor, so nothing is unpickled."""
        if not self.enabled:
            return [obj]
        data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([data.numel()]))  # (world,)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[: data.numel()] = data
        every = self.all_gather(padded).view(self.world_size, -1)  # (world, longest)
        return [json.loads(bytes(every[r, : int(n)].tolist())) for r, n in enumerate(sizes)]

    def broadcast_object(self, obj: Any) -> Any:
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)  # only ever plain str / int / dict from rank 0
        return box[0]

    @property
    def _comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def reduce_metrics(self, m: dict, *, sums: tuple[str, ...] = ()) -> dict:
        """Mean over ranks (each rank holds the same number of sequences); keys ending in
        `_max` / `_min` take the max / min, keys in `sums` the sum. NaN-aware for means."""
        if not self.enabled:
            return m
        keys = sorted(k for k, v in m.items() if isinstance(v, (int, float)))
        vals = [float(m[k]) for k in keys]
        finite = [0.0 if v != v else v for v in vals]
        counts = [0.0 if v != v else 1.0 for v in vals]
        total = self.all_reduce(finite + counts, "sum")
        hi = self.all_reduce([v if v == v else -float("inf") for v in vals], "max")
        lo = self.all_reduce([v if v == v else float("inf") for v in vals], "min")
        n = len(keys)
        out = dict(m)
        for i, k in enumerate(keys):
            if k.endswith("_max") or k.endswith("/max"):
                out[k] = hi[i]
            elif k.endswith("_min") or k.endswith("/min"):
                out[k] = lo[i]
            elif k in sums:
                out[k] = total[i]
            else:
                out[k] = total[i] / total[n + i] if total[n + i] else float("nan")
        return out


def init_distributed(strategy: str, device: torch.device, backend: str = DistributedConfig.backend,
                     timeout_s: float = DistributedConfig.timeout_s) -> Dist:
    """Join the torchrun job described by the environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT). Without torchrun: one plain process. Under torchrun even one process
    runs the distributed path (e.g. FSDP2's mixed-precision policy on one GPU)."""
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"config field 'distributed.backend': nccl joins CUDA GPUs, and this process runs on "
                          f"{device} (model.device); use distributed.backend=gloo (or auto)")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist(device=device)
    world = int(os.environ["WORLD_SIZE"])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    stop_with_launcher()
    return Dist(rank=rank, world_size=world, local_rank=local_rank, strategy=strategy, device=device,
                launched=True)


def stop_with_launcher() -> None:
    """Under torchrun, a SIGTERM to this process once its launcher is gone (torchrun starts each
    rank in a session of its own, so a launcher killed with SIGKILL left the ranks training to the
    end of the schedule): it stops after the rollout in progress and saves, as on any SIGTERM.
    A thread watches the parent; it costs a wake-up a second."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gspo-launcher-watch", daemon=True).start()


def shutdown(d: Dist) -> None:
    if d.enabled and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- wrapping


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers decoder (one FSDP2 unit each)."""
    from gspo.models import base_model

    base = base_model(model)
    # get_decoder() names the body on most families; Llama 4's returns the whole model, whose body is .model
    bodies = [base.get_decoder() if hasattr(base, "get_decoder") else None, getattr(base, "model", None), base]
    for body in filter(None, bodies):
        layers = getattr(body, "layers", None) or getattr(body, "h", None) or getattr(body, "blocks", None)
        if isinstance(layers, torch.nn.ModuleList):
            return list(layers)
    raise ValueError(f"{type(base).__name__}: cannot find the decoder layers to shard")


def wrap_for_training(module: torch.nn.Module, model, d: Dist, *, mixed_precision: str = ModelConfig.mixed_precision,
                      reshard_after_forward: bool = DistributedConfig.reshard_after_forward) -> torch.nn.Module:
    """Shard (FSDP2) or replicate (DDP) `module`, whose forward computes the trainer's log-probs
    and which holds `model` (the policy). One process: `module` unchanged."""
    if not d.enabled:
        return module
    if d.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [d.device.index] if d.device.type == "cuda" else None
        return DDP(module, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(d.device.type, (d.world_size,))
    mp = MixedPrecisionPolicy()
    if mixed_precision == "bf16":  # bf16 compute and all-gathers, fp32 master weights and reductions
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return module


def wrap_frozen(module: torch.nn.Module, model, d: Dist, *, mixed_precision: str = ModelConfig.mixed_precision
                ) -> torch.nn.Module:
    """A module that never trains (the KL reference): sharded like the trainer under FSDP2, so
    that it holds 1/world of its weights per process; unchanged on one process and under DDP,
    which has no gradient of it to reduce. Its forwards are collectives under FSDP2: every
    process calls it as often as the trainer (the plan's micro-batches, placeholders too)."""
    if not (d.enabled and d.strategy == "fsdp"):
        return module
    return wrap_for_training(module, model, d, mixed_precision=mixed_precision)


def generator_copy(model, d: Dist):
    """FSDP2 shards the trainer's parameters, so the generator gets its own full copy
    (refreshed by `full_state_dict` after every update). None when the generator can share the
    trainer's module (one process, DDP)."""
    if d.enabled and d.strategy == "fsdp":
        return copy.deepcopy(model)
    return None


def full_state_dict(module: torch.nn.Module, d: Dist, rank0_cpu: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of a (possibly sharded) module, full, on every rank; with
    `rank0_cpu` on rank 0 alone, in host memory (the other ranks get {})."""
    if not (d.enabled and d.strategy == "fsdp"):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_cpu))


# ----------------------------------------------------------------------------- sharded checkpoints

SHARDED_DIR = "sharded"
OPTIM_GROUPS_FILE = "optim_groups.json"


def _state(module, optimizer) -> tuple[dict, dict]:
    """The tensors to (re)store, named model.* / optim.* (DTensor shards under FSDP2), and the
    optimizer's non-tensor settings (flattened keys)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(module, optimizer,
                              options=StateDictOptions(flatten_optimizer_state_dict=True))
    # tied weights (lm_head = embed_tokens) appear under both names; keep the one parameters use
    names = {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}
    tensors = {f"model.{k}": v for k, v in msd.items() if k in names}
    tensors.update({f"optim.{k}": v for k, v in osd.items() if isinstance(v, torch.Tensor)})
    groups = {k: v for k, v in osd.items() if not isinstance(v, torch.Tensor)}
    return tensors, groups


def save_sharded(path: Path, module, optimizer, d: Dist) -> None:
    """All ranks: write model + optimizer shards under `path/sharded` (safetensors via
    torch.distributed.checkpoint) and rank 0 the optimizer's non-tensor settings (JSON)."""
    import torch.distributed.checkpoint as dcp

    tensors, groups = _state(module, optimizer)
    dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(path / SHARDED_DIR), save_distributed=True))
    if d.is_main:
        (path / OPTIM_GROUPS_FILE).write_text(json.dumps(groups, indent=1))


def load_sharded(path: Path, module, optimizer) -> None:
    """All ranks: read what `save_sharded` wrote into the sharded module and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    tensors, _ = _state(module, optimizer)
    dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(path / SHARDED_DIR)))
    groups = json.loads((path / OPTIM_GROUPS_FILE).read_text())
    model_sd = {k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")}
    optim_sd = {**{k: (tuple(v) if isinstance(v, list) else v) for k, v in groups.items()},
                **{k[len("optim."):]: v for k, v in tensors.items() if k.startswith("optim.")}}
    set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(flatten_optimizer_state_dict=True, strict=False))
