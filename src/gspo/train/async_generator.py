"""An async-mode generator process (`gspo.train.async_mode`): it builds the policy from the
run's config, joins the job, and answers the learner's commands (weights in, rollouts out)
until STOP, or until the learner is gone. Spawned ones run `main` (their config as YAML on
stdin); under torchrun the generator ranks call `serve` from `gspo.train.train`."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from gspo.config import Config, from_yaml_text
from gspo.train import faults
from gspo.train.async_mode import ROLE_ENV, _init_group, _timeout, _weights_backend
from gspo.train.async_wire import (CMD_TAG, ERROR, ROLLOUT, ROLLOUT_TAG, STOP, WEIGHTS, encode_rollout,
                                   recv_message, send_message, weight_tensors)


def _die_with_parent(parent: int) -> None:
    """A spawned generator must not outlive the learner: SIGKILL when the parent dies (Linux),
    and a watchdog for where that is not available."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # died before the line above
        os._exit(1)

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def serve(cfg: Config) -> None:
    """A generator process: build the policy, join the job, then answer the learner's commands
    until STOP (or until the learner is gone)."""
    from gspo.models import resolve_device
    from gspo.models.routing import RouteTracker, find_routers
    from gspo.train.run import build_policy, hf_generator, seed_everything, setup_threads

    spawned = bool(os.environ.get(ROLE_ENV))
    timeout = _timeout(cfg)
    if spawned:
        _die_with_parent(int(os.environ["GSPO_ASYNC_PARENT"]))
        rank, world = int(os.environ["GSPO_ASYNC_RANK"]), int(os.environ["GSPO_ASYNC_WORLD"])
        store = dist.TCPStore("127.0.0.1", int(os.environ["GSPO_ASYNC_PORT"]), world, is_master=False, timeout=timeout)
    device = resolve_device(cfg.model.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    setup_threads(cfg.threads)
    seed_everything(cfg.seed)
    model, tok = build_policy(cfg, device)
    if spawned:
        _init_group(store, rank, world, timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    group = dist.new_group(backend=_weights_backend(device), timeout=timeout)
    generator = hf_generator(cfg, model, tok)
    if find_routers(model) and cfg.rollout.decode == "gspo":  # MoE: every rollout carries its routes (R3)
        generator.routes = RouteTracker(model)
    kind, version, sync_s, idle_from = 0, -1, 0.0, time.perf_counter()
    params = dict(weight_tensors(model, full=True))
    try:
        while True:
            kind, payload, v = recv_message(0, CMD_TAG)
            if kind == STOP:
                break
            msg = json.loads(payload)
            if kind == WEIGHTS:
                t0 = time.perf_counter()
                with torch.no_grad():
                    for dtype, names in msg["groups"]:
                        if not msg["flat"]:  # NCCL: straight into the parameter
                            dist.recv(params[names[0]], 0, group=group)
                            continue
                        buf = torch.empty(sum(params[n].numel() for n in names), dtype=getattr(torch, dtype[6:]))
                        dist.recv(buf, 0, group=group)
                        for n, part in zip(names, buf.split([params[n].numel() for n in names])):
                            params[n].copy_(part.view(params[n].shape))
                version = msg["version"]
                sync_s += time.perf_counter() - t0
                continue
            t0 = time.perf_counter()
            faults.in_generator(msg["rollout"])  # tests only
            try:
                if msg["version"] != version:
                    raise RuntimeError(f"asked for rollout {msg['rollout']} with weights {msg['version']}, holds {version}")
                ro = generator.generate(msg["prompts"], cfg.rollout.group_size, seed=msg["seed"], offset=0)
            except Exception:
                send_message(ERROR, traceback.format_exc().encode(), 0, ROLLOUT_TAG)
                raise
            t1 = time.perf_counter()
            meta = {"rollout": msg["rollout"], "version": version, "generate_s": t1 - t0, "sync_s": sync_s,
                    "idle_s": max(t0 - idle_from - sync_s, 0.0)}
            send_message(ROLLOUT, encode_rollout(ro, meta), 0, ROLLOUT_TAG)
            sync_s, idle_from = 0.0, time.perf_counter()
    finally:
        if kind == STOP:
            dist.destroy_process_group()


def main() -> None:
    """`python -m gspo.train.async_mode`: a spawned generator, its config as YAML on stdin."""
    cfg = from_yaml_text(sys.stdin.read())
    try:
        serve(cfg)
    except (RuntimeError, ConnectionError) as e:  # the learner is gone: nothing to report to
        print(f"gspo generator {os.environ.get('GSPO_ASYNC_RANK')}: stopped: {e}", file=sys.stderr)
        os._exit(1)


if __name__ == "__main__":
    main()
