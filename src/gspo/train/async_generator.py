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
from gspo.train.async_job import ROLE_ENV, Job, _timeout, connect, learner_count, torchrun_store
from gspo.train.async_wire import (CMD_TAG, ERROR, EVAL, EVAL_RESULT, ROLLOUT, ROLLOUT_TAG, STOP, WEIGHTS,
                                   encode_rollout, recv_message, send_message, weight_tensors)


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
    """A generator process: build the policy, join the job, then answer the learners' commands
    until STOP (or until the learners are gone). With several learner ranks every GENERATE and
    WEIGHTS comes from each of them in turn: their prompts, sampled part by part as sync mode's
    ranks sample them, and their shards, put together into this process's whole model."""
    from gspo.models import resolve_device
    from gspo.models.routing import RouteTracker, find_routers
    from gspo.rewards.workers import ignore_stop_signals
    from gspo.train.distributed import Dist
    from gspo.train.run import _vllm_generator, build_policy, episode_tools, hf_generator, play_episodes, seed_everything
    from gspo.train.threads import setup_threads

    spawned = bool(os.environ.get(ROLE_ENV))
    timeout = _timeout(cfg)
    # Ctrl-C, and torchrun's or a scheduler's SIGTERM, reach the whole process group: the learner
    # stops after its rollout and saves the rollouts in flight, which it asks this process for;
    # it then sends STOP (and a spawned generator dies with it in any case)
    ignore_stop_signals()
    if spawned:
        _die_with_parent(int(os.environ["GSPO_ASYNC_PARENT"]))
        rank, world = int(os.environ["GSPO_ASYNC_RANK"]), int(os.environ["GSPO_ASYNC_WORLD"])
        store = dist.TCPStore("127.0.0.1", int(os.environ["GSPO_ASYNC_PORT"]), world, is_master=False, timeout=timeout)
        job = Job(world_size=world, learners=1, rank=rank, store=store, local=True)
    else:
        job = Job(world_size=int(os.environ["WORLD_SIZE"]), learners=learner_count(cfg), rank=int(os.environ["RANK"]),
                  store=torchrun_store(cfg))
    device = resolve_device(cfg.model.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    setup_threads(cfg.threads)
    seed_everything(cfg.seed)
    model, tok = build_policy(cfg, device)
    connect(job, cfg, device)
    pg, learners = job.pg, range(job.learners)
    if cfg.rollout.backend == "vllm":  # its engine in this process, fed from `model` after every sync
        generator = _vllm_generator(cfg, model, tok, Dist(device=device), workdir=cfg.run_dir / f"vllm-{job.rank}")
    else:
        generator = hf_generator(cfg, model, tok)
        if find_routers(model) and cfg.rollout.decode == "gspo":  # MoE: every rollout carries its routes (R3)
            generator.routes = RouteTracker(model)
    tools = episode_tools(cfg)
    kind, version, sync_s, idle_from = 0, -1, 0.0, time.perf_counter()
    params = dict(weight_tensors(model, full=True))
    try:
        while True:
            kind, payload, v = recv_message(pg, 0, CMD_TAG)
            if kind == STOP:
                for r in learners[1:]:
                    recv_message(pg, r, CMD_TAG)
                break
            if kind == EVAL:  # from learner 0 alone
                _evaluate(cfg, model, tok, generator, json.loads(payload), version, pg)
                continue
            msgs = [json.loads(payload)] + [_command(pg, r, kind) for r in learners[1:]]
            if kind == WEIGHTS:
                t0 = time.perf_counter()
                _receive_weights(job, msgs, params)
                if cfg.rollout.backend == "vllm":
                    generator.sync_weights(model)
                version = msgs[0]["version"]
                sync_s += time.perf_counter() - t0
                continue
            t0 = time.perf_counter()
            faults.in_generator(msgs[0]["rollout"])  # tests only
            try:
                if msgs[0]["version"] != version:
                    raise RuntimeError(f"asked for rollout {msgs[0]['rollout']} with weights {msgs[0]['version']}, "
                                       f"holds {version}")
                if tools is not None:  # multi-turn episodes, played here with the tools and environments
                    parts = [play_episodes(cfg, generator, tok, tools, m["rows"], seed=m["seed"], offset=m["offset"])
                             for m in msgs]
                else:
                    parts = [generator.generate(m["prompts"], cfg.rollout.group_size, seed=m["seed"],
                                                offset=m["offset"]) for m in msgs]
            except Exception:
                for r in learners:
                    send_message(pg, ERROR, traceback.format_exc().encode(), r, ROLLOUT_TAG)
                raise
            t1 = time.perf_counter()
            meta = {"rollout": msgs[0]["rollout"], "version": version, "generate_s": t1 - t0, "sync_s": sync_s,
                    "idle_s": max(t0 - idle_from - sync_s, 0.0)}
            for r, ro in zip(learners, parts):
                send_message(pg, ROLLOUT, encode_rollout(ro, meta), r, ROLLOUT_TAG)
            sync_s, idle_from = 0.0, time.perf_counter()
    finally:
        if tools is not None:
            tools.runner.close()
        if hasattr(generator, "close"):
            generator.close()


def _command(pg, src: int, kind: int) -> dict:
    """Learner `src`'s copy of the command learner 0 just sent (the learners run in step)."""
    k, payload, _ = recv_message(pg, src, CMD_TAG)
    if k != kind:
        raise RuntimeError(f"learner {src} sent command {k} where learner 0 sent {kind}")
    return json.loads(payload)


def _receive_weights(job: Job, msgs: list[dict], params: dict) -> None:
    """Each learner's part of every tensor (`async_wire.local_part`), in rank order, into place:
    the parts of ranks 0..L-1, flat and concatenated, are the whole tensor."""
    filled: dict[str, int] = {}
    with torch.no_grad():
        for r, msg in enumerate(msgs):
            for dtype, names, numels in msg["groups"]:
                if not sum(numels):
                    continue
                if not msg["flat"]:  # NCCL: straight into place
                    n, k = names[0], numels[0]
                    o = filled.get(n, 0)
                    job.weights_pg.recv([params[n].view(-1)[o:o + k]], r, 0).wait()
                    filled[n] = o + k
                    continue
                buf = torch.empty(sum(numels), dtype=getattr(torch, dtype[6:]))
                job.weights_pg.recv([buf], r, 0).wait()
                for n, k, part in zip(names, numels, buf.split(numels)):
                    o = filled.get(n, 0)
                    params[n].view(-1)[o:o + k].copy_(part)
                    filled[n] = o + k
    short = [n for n, k in filled.items() if k != params[n].numel()]
    if short:
        raise RuntimeError(f"weights {msgs[0]['version']}: the learners' parts of {short[:3]} do not add up")


def _evaluate(cfg: Config, model, tok, generator, req: dict, version: int, pg) -> None:
    """Held-out completions for learner 0 (`AsyncRollouts.evaluate`): greedy ones from the
    policy, and with eval.pass_k sampled ones (seeded by the weight version)."""
    from gspo.rollout import chunk_seed
    from gspo.train.evaluate import greedy_completions

    try:
        if req["version"] != version:
            raise RuntimeError(f"asked to evaluate weights {req['version']}, holds {version}")
        out = {"greedy": greedy_completions(model, tok, req["prompts"], max_new_tokens=req["max_new_tokens"]),
               "samples": None, "group_size": 0}
        if req["pass_k"]:
            ro = generator.generate(req["prompts"], max(req["pass_k"], 2), seed=chunk_seed(cfg.seed, version, 2))
            out.update(samples=ro.completions, group_size=ro.group_size)
    except Exception:
        send_message(pg, ERROR, traceback.format_exc().encode(), 0, ROLLOUT_TAG)
        raise
    send_message(pg, EVAL_RESULT, json.dumps(out).encode(), 0, ROLLOUT_TAG, version)


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
